"""A short soak in CI: sessions come and go (some vanish); nothing leaks, nothing is lost."""

from __future__ import annotations

import asyncio

from duplexserve.bench.soak import soak


def test_short_soak_leaks_nothing_and_loses_nothing(server_factory):
    server = server_factory("--max-sessions", "32")
    report = asyncio.run(soak(server.ws(), duration_s=8, concurrency=8, seed=3))
    assert report.sessions_completed > 0 and report.frames_sent > 0
    assert report.sessions_failed == 0, report.errors
    assert report.frames_lost == 0 and report.frames_altered == 0
    assert report.sessions_leaked == 0
    assert report.ok
