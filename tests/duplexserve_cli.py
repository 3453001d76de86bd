"""Run ``python -m duplexserve`` in a subprocess, optionally with modules made absent.

A module is made absent the way a fresh venv lacks it: a ``sitecustomize`` first on
PYTHONPATH sets ``sys.modules[name] = None``, so ``import name`` raises
ModuleNotFoundError and ``importlib.util.find_spec`` finds nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SITECUSTOMIZE = """\
import os, sys
for name in os.environ["DUPLEXSERVE_TEST_HIDE"].split(","):
    sys.modules[name] = None
"""


def hiding(folder: Path, *modules: str) -> tuple[list[Path], dict[str, str]]:
    """``path`` and ``env`` for ``run`` in which ``modules`` are absent (a sitecustomize in ``folder``)."""
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return [folder], {"DUPLEXSERVE_TEST_HIDE": ",".join(modules)}


def run(*args: str, path: Sequence[Path] = (), env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``duplexserve *args`` with ``path`` first on PYTHONPATH and ``env`` added to the environment."""
    environ = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, path), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "duplexserve", *args], capture_output=True, text=True,
                          env=environ, timeout=timeout)
