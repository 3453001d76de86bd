"""This machine as the engine would see it: torch and its CUDA, each GPU and its free memory.

Unlike ``requirements.py`` this imports torch (``duplexserve check`` only), so it reports
what ``import torch`` really gives here, why it fails if it does, and the GPUs torch can
use; where torch sees none, the driver's own list (nvidia-smi) shows what it misses.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from duplexserve.check.requirements import NVIDIA_DRIVER, found

GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total: int  # bytes
    free: int

    def describe(self) -> str:
        return f"{self.name}, {self.free / GIB:.1f} GiB free of {self.total / GIB:.1f} GiB"


@dataclass
class Torch:
    module: ModuleType | None  # None: not installed, or its import failed
    error: str = ""  # why the import failed
    gpus: list[Gpu] = field(default_factory=list)  # the GPUs torch can use

    def describe(self) -> str:
        torch = self.module
        if torch is None:
            return self.error or "not installed"
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
        seen = f"{len(self.gpus)} GPU(s) usable" if self.gpus else "no GPU usable"
        return f"{torch.__version__}, {build}, {seen}"


def probe_torch() -> Torch:
    if not found("torch"):
        return Torch(None)
    try:
        import torch
    except Exception as exc:  # any failure is what the engine would hit: report it
        return Torch(None, f"installed, but import torch fails: {type(exc).__name__}: {exc}")
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            gpus.append(Gpu(i, torch.cuda.get_device_name(i), total, free))
    return Torch(torch, gpus=gpus)


def driver_gpus() -> list[Gpu] | str:
    """The GPUs the NVIDIA driver lists, or why there are none to list."""
    if not Path(NVIDIA_DRIVER).exists():
        return f"none (no NVIDIA driver: {NVIDIA_DRIVER} is missing)"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return f"{NVIDIA_DRIVER} is there but nvidia-smi is not on PATH"
    query = ["--query-gpu=index,name,memory.total,memory.free", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run([smi, *query], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi fails: {exc}"
    gpus = []
    for line in out.strip().splitlines():
        index, name, total, free = (part.strip() for part in line.split(","))
        gpus.append(Gpu(int(index), name, int(total) << 20, int(free) << 20))  # MiB
    return gpus


def host_available() -> int | None:
    """Bytes of host memory available (Linux's MemAvailable); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return None
