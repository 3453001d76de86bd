"""``duplexserve serve`` on a machine that lacks what its engine needs: one line, its fix, no traceback.

Real ``python -m duplexserve serve`` processes, with modules made absent as a fresh venv
lacks them (``tests/duplexserve_cli.py``). A wrong torch is a ``torch`` package first on
PYTHONPATH whose ``version.py`` says which build it is (importing it fails, as a broken
install's would).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from duplexserve.codecs.libopus import LIBOPUS
from tests.duplexserve_cli import hiding, run

NO_DRIVER = pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has an NVIDIA driver")


def fake_torch(root: Path, cuda: str | None) -> Path:
    """A folder holding a ``torch`` whose version.py says ``cuda`` and whose import fails."""
    package = root / "fake" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('a stand-in torch, never imported')\n")
    (package / "version.py").write_text(f"__version__ = '2.13.0'\ncuda = {cuda!r}\nhip = None\n")
    return package.parent


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The process failed before serving and said why in exactly one line, without a traceback."""
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "Traceback" not in out and "Application startup" not in out, out
    lines = out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("duplexserve: cannot serve --engine "), out
    return lines[0]


@pytest.mark.parametrize("missing", ["torch", "moshi", "sentencepiece"])
def test_a_missing_moshi_dependency_is_one_line_naming_the_install_script(tmp_path, missing):
    path, env = hiding(tmp_path, missing)
    line = one_line(run("serve", "--engine", "moshi", path=path, env=env))
    assert f"the moshi engine needs {missing}, not installed in {sys.prefix}" in line
    assert "scripts/install-moshi.sh" in line and "[moshi] extra" in line


def test_everything_missing_is_named_at_once(tmp_path):
    path, env = hiding(tmp_path, "torch", "moshi")
    line = one_line(run("serve", "--engine", "moshi", path=path, env=env))
    assert "needs torch and moshi, not installed" in line


def test_a_traceback_only_at_log_level_debug(tmp_path):
    path, env = hiding(tmp_path, "torch")
    done = run("serve", "--engine", "moshi", "--log-level", "debug", path=path, env=env)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "needs torch" in done.stderr.splitlines()[-1]


def test_device_cuda_with_a_cpu_build_of_torch(tmp_path):
    line = one_line(run("serve", "--engine", "moshi", "--device", "cuda", path=[fake_torch(tmp_path, None)]))
    assert "--device cuda, and torch 2.13.0 is a CPU build" in line
    assert "pip uninstall -y torch && scripts/install-moshi.sh" in line


@NO_DRIVER
def test_device_cuda_on_a_machine_without_a_gpu(tmp_path):
    done = run("serve", "--engine", "moshi", "--device", "cuda", path=[fake_torch(tmp_path, "12.8")])
    line = one_line(done)
    assert "--device cuda, and this machine shows no NVIDIA GPU (/dev/nvidiactl is missing)" in line
    assert "--device cpu" in line


def test_no_opus_at_all(tmp_path):
    """Without libopus sphn encodes Opus (a warning); without sphn too, there is no Opus."""
    path, env = hiding(tmp_path, "sphn")
    line = one_line(run("serve", path=path, env={**env, "DUPLEXSERVE_NO_LIBOPUS": "1"}))
    assert "libopus is turned off (DUPLEXSERVE_NO_LIBOPUS is set) and sphn is not installed" in line


@pytest.mark.skipif(LIBOPUS is not None, reason="libopus loads on this machine")
def test_no_libopus_names_the_package_that_installs_it(tmp_path):
    path, env = hiding(tmp_path, "sphn")
    line = one_line(run("serve", path=path, env=env))
    assert "libopus (libopus.so.0) cannot be loaded" in line and "apt-get install libopus0" in line


def test_vllm_omni_outside_its_venv(tmp_path):
    venv = tmp_path / "vllm-venv"
    args = ("serve", "--engine", "vllm-omni", "--vllm-omni-model", "some/model")
    path, env = hiding(tmp_path, "vllm", "vllm_omni")
    env["DUPLEXSERVE_VLLM_OMNI_VENV"] = str(venv)
    line = one_line(run(*args, path=path, env=env))
    assert "--engine vllm-omni needs vllm and vllm_omni" in line
    assert f"make its venv with scripts/test-vllm-omni.sh ({venv}" in line
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "duplexserve").write_text("")
    line = one_line(run(*args, path=path, env=env))
    assert f"run the server from its venv: {venv}/bin/duplexserve serve" in line


def test_an_unknown_preset_and_a_missing_checkpoint():
    line = one_line(run("serve", "--engine", "moshi", "--moshi-preset", "moshi-13b"))
    assert "unknown moshi preset 'moshi-13b'; known: moshi-7b" in line
    line = one_line(run("serve", "--engine", "moshi", "--moshi-weights", "/nonexistent/weights"))
    assert "/nonexistent/weights does not exist" in line and "point --moshi-weights at a folder" in line


def test_max_sessions_auto_needs_a_gpu():
    """One line that says what auto needs and what to pass instead (it was the top-level usage)."""
    for args, env in [(("--max-sessions", "auto"), {}), ((), {"DUPLEXSERVE_MAX_SESSIONS": "auto"})]:
        done = run("serve", "--engine", "moshi", "--device", "cpu", *args, env=env)
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == [
            "duplexserve serve: --max-sessions auto needs the moshi engine on a GPU (it sizes the slots by "
            "the GPU's free memory); on the CPU pass a number instead, e.g. --max-sessions 8"
        ]
    done = run("serve", "--max-sessions", "auto")
    assert done.returncode == 2 and "with --engine synthetic pass a number instead" in done.stderr
    assert "usage" not in done.stderr
    done = run("serve", "--max-sessions", "0")  # 0 is not a way to write auto
    assert done.returncode == 2 and "'0' is no session count: a whole number from 1 up" in done.stderr

