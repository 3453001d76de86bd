"""What each engine needs installed, found without importing it, with the command that installs it.

Nothing here imports torch, moshi or vLLM: finding a module and reading a version costs
milliseconds, so ``duplexserve serve`` refuses a machine that lacks one before uvicorn
starts, and the server process (whose moshi engine runs in a process of its own on a
GPU) does not load torch for it. A package that is there but fails to import fails in the
engine with its traceback; ``duplexserve check`` imports it and says why.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from duplexserve.config import ServerConfig

MOSHI_VERSION = "0.2.13"
VLLM_OMNI_VERSION = "0.30.0"
#: What ``moshi.models`` imports when it loads (scripts/install-moshi.sh installs these).
MOSHI_NEEDS = ("torch", "moshi", "safetensors", "huggingface_hub", "einops", "sentencepiece")
NVIDIA_DRIVER = "/dev/nvidiactl"  # what ServerConfig's --device auto looks for, too
INSTALL_MOSHI = (
    "install the moshi engine with scripts/install-moshi.sh (not the [moshi] extra: moshi 0.2.13 "
    "declares torch<2.10, so pip would replace the installed torch)"
)
CUDA_TORCH = (
    "install a CUDA build: .venv/bin/pip uninstall -y torch && scripts/install-moshi.sh "
    "(torch 2.13.0 from PyPI is one on Linux)"
)
INSTALL_LIBOPUS = "apt-get install libopus0 (Debian, Ubuntu; dnf install opus on Fedora)"


@dataclass(frozen=True)
class Problem:
    """Something this machine or these options lack, and how to get it."""

    what: str
    fix: str
    fatal: bool = True  # serve cannot start; False: it starts without it, worse (a warning)

    def line(self) -> str:
        return f"{self.what}; {self.fix}"


@dataclass(frozen=True)
class TorchBuild:
    version: str
    cuda: str | None  # the CUDA it was built for; None: a CPU (or ROCm) build
    hip: str | None

    @property
    def gpu(self) -> bool:
        return bool(self.cuda or self.hip)


def found(module: str) -> bool:
    """Whether ``import module`` would find it (a module set to None in sys.modules is absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_build() -> TorchBuild | None:
    """torch's version and the CUDA it was built for, read from ``torch/version.py`` unimported."""
    spec = importlib.util.find_spec("torch") if found("torch") else None
    if spec is None:
        return None
    values: dict[str, Any] = {}
    try:
        source = Path(next(iter(spec.submodule_search_locations or ())), "version.py").read_text()
    except (OSError, StopIteration):
        return TorchBuild(version("torch") or "unknown", None, None)
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            with contextlib.suppress(ValueError):
                values[target.id] = ast.literal_eval(value)
    return TorchBuild(str(values.get("__version__", "unknown")), values.get("cuda"), values.get("hip"))


def requirements(config: ServerConfig) -> list[Problem]:
    """Everything the engine and codecs of ``config`` need that this environment lacks."""
    engine = {"moshi": moshi, "vllm-omni": vllm_omni}.get(config.engine)
    return (engine(config) if engine else []) + opus()


def moshi(config: ServerConfig) -> list[Problem]:
    missing = [name for name in MOSHI_NEEDS if not found(name)]
    if missing:
        what = f"the moshi engine needs {_names(missing)}, not installed in {sys.prefix}"
        return [Problem(what, INSTALL_MOSHI)]
    problems = []
    installed = version("moshi")
    if installed != MOSHI_VERSION:
        what = f"moshi {installed} is installed and the engine is written against {MOSHI_VERSION}"
        problems.append(Problem(what, INSTALL_MOSHI, fatal=False))
    build = torch_build()
    assert build is not None
    driver = os.path.exists(NVIDIA_DRIVER)
    if config.device.startswith("cuda"):
        if not build.gpu:
            problems.append(Problem(f"--device cuda, and torch {build.version} is a CPU build", CUDA_TORCH))
        if not driver and not build.hip:
            problems.append(Problem(
                f"--device cuda, and this machine shows no NVIDIA GPU ({NVIDIA_DRIVER} is missing)",
                "run on a GPU host (nvidia-smi lists its GPUs) or use --device cpu",
            ))
    elif config.device == "auto" and driver and not build.gpu:
        what = f"this machine has an NVIDIA GPU and torch {build.version} is a CPU build: the engine runs " \
               "on the CPU"
        problems.append(Problem(what, CUDA_TORCH, fatal=False))
    return problems


def vllm_omni_venv() -> Path:
    """Where scripts/test-vllm-omni.sh makes vLLM-Omni's venv (``DUPLEXSERVE_VLLM_OMNI_VENV``, as there)."""
    venv = Path(os.environ.get("DUPLEXSERVE_VLLM_OMNI_VENV", ".venv-vllm-omni"))
    checkout = Path(__file__).resolve().parents[2]  # the script's folder, in a source checkout
    base = checkout if (checkout / "scripts" / "test-vllm-omni.sh").exists() else Path.cwd()
    return venv if venv.is_absolute() else base / venv


def vllm_omni(config: ServerConfig) -> list[Problem]:
    """vLLM-Omni lives in a venv of its own: vLLM pins torch 2.13.0's CUDA build (docs/vllm-omni.md)."""
    missing = [name for name in ("vllm", "vllm_omni") if not found(name)]
    if not missing:
        installed = version("vllm-omni")
        if installed == VLLM_OMNI_VERSION:
            return []
        what = f"vllm-omni {installed} is installed and the bridge is written against {VLLM_OMNI_VERSION}"
        fix = f"pip install 'vllm=={VLLM_OMNI_VERSION}' 'vllm-omni=={VLLM_OMNI_VERSION}'"
        return [Problem(what, fix, fatal=False)]
    venv = vllm_omni_venv()
    if Path(sys.prefix).resolve() == venv.resolve():
        fix = f"install it there: {venv}/bin/pip install -e '.[vllm-omni]'"
    elif (venv / "bin" / "duplexserve").exists():
        fix = f"run the server from its venv: {venv}/bin/duplexserve serve ..."
    else:
        fix = (f"make its venv with scripts/test-vllm-omni.sh ({venv}, about 10 GB; it runs the bridge's "
               f"tests too), then run {venv}/bin/duplexserve serve ... (docs/vllm-omni.md)")
    return [Problem(f"--engine vllm-omni needs {_names(missing)}, not installed in {sys.prefix}", fix)]


def opus() -> list[Problem]:
    """libopus (ctypes) encodes and decodes Opus; sphn is the slower fallback; without both, none."""
    from duplexserve.codecs.libopus import LIBOPUS

    if LIBOPUS is not None:
        return []
    if os.environ.get("DUPLEXSERVE_NO_LIBOPUS"):
        what, fix = "libopus is turned off (DUPLEXSERVE_NO_LIBOPUS is set)", "unset DUPLEXSERVE_NO_LIBOPUS"
    else:
        what, fix = "libopus (libopus.so.0) cannot be loaded", f"install it: {INSTALL_LIBOPUS}"
    if found("sphn"):
        return [Problem(f"{what}: Opus runs through sphn, at about 7x the CPU a frame", fix, fatal=False)]
    return [Problem(f"{what} and sphn is not installed: no Opus, the format of Kyutai's clients", fix)]


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
