"""Which Opus stream codec a session gets: libopus where it loads (libopus.py for output,
opus_reader.py for input), else sphn (opus.py), the same streams, slower.

Apart from those modules so that none of them imports another's fallback: no circle.
"""

from __future__ import annotations

import logging

from duplexserve.codecs.libopus import DEFAULT_COMPLEXITY, LIBOPUS, LibopusStreamEncoder
from duplexserve.codecs.opus_budget import OpusBudget, OpusLimits
from duplexserve.codecs.opus_reader import LibopusStreamDecoder

log = logging.getLogger(__name__)

_warned = False


def make_opus_decoder(limits: OpusLimits | None = None) -> LibopusStreamDecoder | object:
    """The libopus decoder when libopus loads, else sphn's reader (the same samples);
    ``limits``: the connection's budget (a server's sessions; None: a client's own audio)."""
    budget = OpusBudget(limits) if limits is not None else None
    if LIBOPUS is not None:
        return LibopusStreamDecoder(budget)
    from duplexserve.codecs.opus import OpusStreamDecoder  # sphn: imported only where needed

    return OpusStreamDecoder(budget)


def make_opus_encoder(complexity: int = DEFAULT_COMPLEXITY) -> LibopusStreamEncoder | object:
    """The libopus encoder when libopus loads, else sphn's writer (logged once)."""
    global _warned
    if LIBOPUS is not None:
        return LibopusStreamEncoder(complexity)
    if not _warned:
        _warned = True
        log.warning("libopus could not be loaded: Opus output uses sphn (complexity 10, slower)")
    from duplexserve.codecs.opus import OpusStreamEncoder

    return OpusStreamEncoder()
