"""``--api-keys-file``: the API keys in a file, re-read when it changes.

A key in an environment variable shows in ``docker inspect`` and ``kubectl describe``, and
changing it means a rollout. A file (a Kubernetes Secret mounted as a volume, a compose bind
mount) can be rotated in place: the server stats it every :data:`POLL_S` from the event loop
(one ``stat`` call, no thread) and re-reads it when its inode, size or mtime change. ``stat``
follows symlinks, so Kubernetes' atomic swap of a Secret volume (the ``..data`` symlink
re-pointed at a new directory) reads as a new inode. The keys live in ``config.api_keys``,
which every check reads at the moment it checks: a key taken out is refused for the next
session or request; sessions already open were checked at their start and go on. SIGHUP re-reads
it at once, changed or not (``docker compose kill -s HUP``, ``kill -HUP``).

A file that cannot be read or names no key stops the server at start (one line, exit 2); later
the last good set stays and a warning says why, so a half-written file never opens the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from duplexserve.config import ServerConfig

#: How often the file is looked at: a revoked key is refused within about this long.
POLL_S = 1.0

log = logging.getLogger("duplexserve")


def read_keys(path: str) -> tuple[str, ...]:
    """The keys in ``path``: one a line, blank lines and ``#`` comments ignored.

    Raises ValueError, with the reason, for a file that cannot be read, names no key or has a
    key with a comma or a space in it (``--api-keys`` separates keys with commas)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-keys-file {path}: cannot read it ({exc})") from None
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if "," in key or any(c.isspace() for c in key):
            msg = f"--api-keys-file {path}: line {number} holds a comma or a space (one key a line)"
            raise ValueError(msg)
        keys.append(key)
    if not keys:
        raise ValueError(f"--api-keys-file {path}: names no key (one key a line; # starts a comment)")
    return tuple(keys)


def _stamp(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class KeyFile:
    """Loads ``config.api_keys_file`` into ``config.api_keys`` now, and again on each change."""

    def __init__(self, config: ServerConfig, poll_s: float = POLL_S) -> None:
        self.config, self.path, self.poll_s = config, config.api_keys_file, poll_s
        self._stamp = _stamp(self.path)
        self._apply(read_keys(self.path))  # at start: a bad file is the caller's error
        self._failed: str | None = None
        self._task: asyncio.Task[None] | None = None

    def _apply(self, keys: tuple[str, ...]) -> None:
        self.config.api_keys = ",".join(keys)
        self.count = len(keys)

    def check(self) -> None:
        """Re-read the file if it changed since the last look; keep the last good keys if it
        cannot be read (a warning once per failure, not once per poll)."""
        stamp = _stamp(self.path)
        if stamp == self._stamp and self._failed is None:
            return
        try:
            keys = read_keys(self.path)
        except ValueError as exc:
            self._stamp = stamp
            if str(exc) != self._failed:
                log.warning("%s: keeping the %d keys read before", exc, self.count)
                self._failed = str(exc)
            return
        self._stamp, self._failed = stamp, None
        if ",".join(keys) != self.config.api_keys:
            log.info("--api-keys-file %s: %d keys now (were %d)", self.path, len(keys), self.count)
            self._apply(keys)

    def reload(self) -> None:
        """Re-read the file now, whatever its stamp says (SIGHUP)."""
        log.info("SIGHUP: reading --api-keys-file %s again", self.path)
        self._stamp = (-1, -1, -1, -1)
        self.check()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            self.check()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        # Only the main thread's loop may take signals: an app run in a test's thread polls only.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, self.reload)

    async def stop(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
