"""Tests against the real vLLM-Omni 0.30 package; each module skips where it is not installed.

vLLM-Omni needs vLLM 0.30.x and a CUDA build of torch (about 9 GB), which the main test
environment does not carry: ``scripts/test-vllm-omni.sh`` builds that environment and
runs these tests (docs/vllm-omni.md says why they are not part of the default run).
"""

from __future__ import annotations

import importlib
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the stand-in model must never reach for a hub

SKIP_REASON = (
    "vllm-omni 0.30 is not installed here; scripts/test-vllm-omni.sh runs these tests in its own venv"
)


def require_vllm_omni() -> None:
    """Skip the module without vLLM-Omni, unless DUPLEXSERVE_REQUIRE_VLLM_OMNI makes that an error."""
    if os.environ.get("DUPLEXSERVE_REQUIRE_VLLM_OMNI"):
        importlib.import_module("vllm_omni")
    else:
        pytest.importorskip("vllm_omni", reason=SKIP_REASON)


def assert_text_follows_its_audio(got: list[tuple[int, str]], frames: int, every: int = 5) -> None:
    """The stand-in says "w<seq>" on every ``every``-th unit (seq counts from 1: frames 4, 9,
    ... for 5). vLLM-Omni emits a unit's text event after its audio event, and the two may
    reach the loop in different batches; either way the text is on the frame its unit made
    (after that frame's audio when it already went out). Every word, once, in order, each on
    its unit's frame, the last one too (a finished session waits for its text)."""
    units = list(range(every - 1, frames, every))
    assert [text for _, text in got] == [f"w{i + 1}" for i in units]
    assert [frame for frame, _ in got] == units, got
