"""Run a Python script under Triton's interpreter (``TRITON_INTERPRET=1``), which runs the CUDA
path's kernels on the CPU: in a subprocess, since ``@triton.jit`` picks the interpreter as it
defines a kernel, and this process may have defined ours already."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(script: str, timeout: float) -> str:
    """``python -c script`` under the interpreter; its stdout, once it has exited 0."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout
