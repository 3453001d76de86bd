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
