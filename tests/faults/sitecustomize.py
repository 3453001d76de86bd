"""A fault put into a real server process for tests: on PYTHONPATH, Python imports this at start.

``DUPLEXSERVE_TEST_FAULT=where:n`` makes the n-th call (from 1) of one place raise:
``piece``, the tokenizer's ``id_to_piece`` as the engine renders a text token; ``deliver``,
``Session.deliver`` as the loop hands a session its answer. Nothing else changes: the
server, engine and clients are the real ones (tests/test_persona_isolation.py).
"""

from __future__ import annotations

import itertools
import os

_fault = os.environ.get("DUPLEXSERVE_TEST_FAULT", "")
if _fault:
    _where, _n = _fault.split(":")
    _calls = itertools.count(1)

    def _failing(original):
        def call(*args, **kwargs):
            if next(_calls) == int(_n):
                raise RuntimeError(f"fault put in by the test ({_fault})")
            return original(*args, **kwargs)

        return call

    if _where == "piece":
        import sentencepiece

        cls = sentencepiece.SentencePieceProcessor
        cls.id_to_piece = _failing(cls.id_to_piece)
    elif _where == "deliver":
        from duplexserve.server.core.session import Session

        Session.deliver = _failing(Session.deliver)
