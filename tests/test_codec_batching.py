"""Codec worker requests leave in batches: many sessions' frames, one sendmsg, in order."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from duplexserve.codecs import AudioFormat, make_decoder, make_encoder
from duplexserve.codecs.procpool import CodecProcesses
from duplexserve.config import ServerConfig
from tests.test_codecs import frames_of, tone


class CountingSocket:
    """The worker's socket, counting the sendmsg calls the loop makes."""

    def __init__(self, sock) -> None:
        self._sock, self.sendmsgs = sock, 0

    def sendmsg(self, buffers):
        self.sendmsgs += 1
        return self._sock.sendmsg(buffers)

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.parametrize("batch_ms", [0.0, 5.0])
def test_requests_of_many_sessions_share_one_sendmsg_and_keep_their_order(batch_ms):
    signals = [tone(300 + 150 * i, 0.4) for i in range(6)]
    local = []
    for x in signals:
        enc, dec = make_encoder(AudioFormat("opus")), make_decoder(AudioFormat("opus"))
        pages = [enc.encode(f) for f in frames_of(x)]
        local.append((pages, [dec.decode(p) for p in pages]))

    async def main():
        procs = CodecProcesses(1, batch_ms=batch_ms)
        try:
            encs = [make_encoder(AudioFormat("opus"), procs) for _ in signals]
            decs = [make_decoder(AudioFormat("opus"), procs) for _ in signals]
            worker = encs[0]._worker
            warm = make_encoder(AudioFormat("opus"), procs)
            await warm.encode_async(np.zeros(0, np.float32))  # the worker is up
            worker.sock = counting = CountingSocket(worker.sock)

            async def session(i):
                pages, pcm = [], []
                for f in frames_of(signals[i]):
                    pages.append(await encs[i].encode_async(f))
                    pcm.append(await decs[i].decode_async(pages[-1]))
                return pages, pcm

            results = await asyncio.gather(*(session(i) for i in range(len(signals))))
            return results, counting.sendmsgs
        finally:
            procs.close()

    results, sendmsgs = asyncio.run(main())
    for (pages, pcm), (ref_pages, ref_pcm) in zip(results, local, strict=True):
        assert pages == ref_pages
        assert all(np.array_equal(a, b) for a, b in zip(pcm, ref_pcm, strict=True))
    frames = len(frames_of(signals[0]))
    # Every session asks at the same moments: about one sendmsg per round of encodes and one
    # per round of decodes (a round whose replies come back in parts may split the next),
    # far from one per request.
    requests = 2 * frames * len(signals)
    assert 2 * frames <= sendmsgs <= requests // 3


def test_batch_window_is_validated():
    for bad in (-1.0, 21.0):
        with pytest.raises(ValueError, match="codec_batch_ms"):
            ServerConfig(codec_batch_ms=bad).validate()
    assert ServerConfig().codec_batch_ms == 2.0


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_full_batch_leaves_at_once_not_after_the_window(loop):
    """16 requests (an engine step's encodes) go out in this loop iteration, on uvloop too
    (whose timer handles are not asyncio's), not when the 20 ms window ends."""
    import time

    import uvloop

    frame = tone(440, 0.08)[:1920]

    async def main():
        procs = CodecProcesses(1, batch_ms=20.0)
        try:
            encs = [make_encoder(AudioFormat("opus"), procs) for _ in range(16)]
            await encs[0].encode_async(np.zeros(0, np.float32))  # the worker is up
            worker = encs[0]._worker
            sent_at = []

            class Timed(CountingSocket):
                def sendmsg(self, buffers):
                    sent_at.append(time.perf_counter())
                    return super().sendmsg(buffers)

            worker.sock = Timed(worker.sock)
            start = time.perf_counter()
            await asyncio.gather(*(e.encode_async(frame) for e in encs))
            return sent_at[0] - start
        finally:
            procs.close()

    waited = uvloop.run(main()) if loop == "uvloop" else asyncio.run(main())
    assert waited < 0.010, waited
