"""Ogg/Opus streams at 24 kHz mono with sphn, as Kyutai's clients and servers send them.

One reader and one writer per session and direction: the Ogg stream and the Opus
decoder carry state from page to page. The writer's first output holds the OpusHead
and OpusTags pages before the audio; each 80 ms frame then becomes two 40 ms packets,
one Ogg page each (the layout ``moshi/server.py`` produces).

sphn holds the GIL while it encodes or decodes (``duplexserve bench codec-costs``
measures it), so a thread pool cannot run it beside the event loop. These classes run
where they are called: inline on the loop when no codec process is configured, or
inside a codec worker process (``procpool.py``) when one is.
"""

from __future__ import annotations

import numpy as np
import sphn

from duplexserve.codecs.formats import MODEL_RATE, FormatError
from duplexserve.codecs.opus_budget import OpusBudget
from duplexserve.codecs.opus_reader import OggOpusReader

_EMPTY = np.zeros(0, dtype=np.float32)


class OpusStreamDecoder:
    """Ogg/Opus bytes of any chunking in, float32 at 24 kHz out (none until a page ends)."""

    inline = True  # holds the GIL: a thread would not run it in parallel (module doc)
    remote = False

    def __init__(self, budget: OpusBudget | None = None) -> None:
        self._reader = sphn.OpusStreamReader(MODEL_RATE)
        # Our Ogg reader in front: the stream's checks, the packet cap and the budget,
        # before sphn decodes what the pages claim (opus_reader.py).
        self._pages = OggOpusReader(budget)

    def decode(self, data: bytes) -> np.ndarray:
        self._pages.packets(data)
        try:
            pcm = self._reader.append_bytes(bytes(data))
        except ValueError as exc:
            raise FormatError(f"invalid Ogg/Opus data: {exc}") from None
        return pcm if pcm.dtype == np.float32 else pcm.astype(np.float32)

    def flush(self) -> np.ndarray:
        return _EMPTY  # a page is decoded as soon as it is complete; a partial one is lost


class OpusStreamEncoder:
    """One model frame in, the Ogg pages of its two Opus packets out."""

    inline = True
    remote = False

    def __init__(self) -> None:
        self._writer = sphn.OpusStreamWriter(MODEL_RATE)

    def encode(self, frame: np.ndarray) -> bytes:
        return self._writer.append_pcm(np.ascontiguousarray(frame, dtype=np.float32))
