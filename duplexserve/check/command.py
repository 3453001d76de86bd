"""Show what this machine and these options give, without serving.

Python, torch and its CUDA, each GPU with its free memory, moshi, libopus, the engine
and model the options choose, the memory plan (the weights, the KV ring of a slot, the
slots that fit and what --max-sessions auto would pick), and each missing piece with
its fix. It takes every option of `duplexserve serve` and exits 0 when `serve` with
them would start, 1 otherwise. Paste its output into a bug report.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import duplexserve
from duplexserve.check.machine import GIB, Torch, driver_gpus, host_available, probe_torch
from duplexserve.check.model import Model, ModelError, checkpoint_named, resolve_model
from duplexserve.check.model_source import add_model_argument
from duplexserve.check.plan import DTYPE_BYTES, LOAD_SLACK, auto_slots, kv_per_slot, lm_dtype, paging, plan
from duplexserve.check.requirements import (
    INSTALL_MOSHI,
    Problem,
    found,
    requirements,
    version,
    vllm_omni_venv,
)
from duplexserve.check.sessions import session_problems
from duplexserve.codecs.libopus import LIBOPUS
from duplexserve.config import AUTO_SESSIONS, ServerConfig
from duplexserve.engine_bridge.moshi.presets import preset_note
from duplexserve.listen import listen_socket
from duplexserve.options import settle

Line = Callable[[str, str], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ServerConfig.add_arguments(parser, notes={"moshi_preset": preset_note()})
    add_model_argument(parser)  # as serve's, never downloading


def run(args: argparse.Namespace) -> int:
    def line(label: str, text: str) -> None:
        print(f"{label:<13} {text}")

    config = settle(args, "duplexserve check")  # before the report: its error is one line on stderr
    print("duplexserve check: this machine and these options (paste all of it into a bug report)")
    found_problems = report(config, line)
    fatal = [p for p in found_problems if p.fatal]
    line("problems", "none" if not found_problems else str(len(found_problems)))
    for problem in found_problems:
        line("  error" if problem.fatal else "  warning", problem.line())
    line("result", "serve would not start" if fatal else "serve would start with these options")
    return 1 if fatal else 0


def report(config: ServerConfig, line: Line) -> list[Problem]:
    """Write the report through ``line``; return everything missing or wrong, fatal first."""
    found_problems = requirements(config)
    try:
        config.validate()
    except ValueError as exc:
        found_problems.insert(0, Problem(str(exc), "duplexserve serve --help describes every setting"))
    found_problems[:0] = _port(config)
    line("duplexserve", f"{duplexserve.__version__} ({Path(duplexserve.__file__).parent})")
    line("python", f"{platform.python_version()} ({sys.executable}) on {platform.platform()}")
    torch = probe_torch()
    line("torch", torch.describe())
    _gpus(torch, line)
    line("moshi", (version("moshi") or "version unknown") if found("moshi") else "not installed")
    line("triton", version("triton") or "not installed")
    line("libopus", "loaded" if LIBOPUS is not None else f"not loaded: Opus through sphn {version('sphn')}")
    vllm_omni = version("vllm-omni") if found("vllm_omni") else f"not here (its venv: {vllm_omni_venv()})"
    line("vllm-omni", vllm_omni)
    if config.engine == "moshi":
        found_problems += _moshi(config, torch, line)
    elif config.engine == "synthetic":
        line("engine", f"synthetic ({config.synthetic_mode}): no model, no GPU")
    else:
        model = "the CPU stand-in" if config.vllm_omni_standin else config.vllm_omni_model or "(none)"
        line("engine", f"vllm-omni, model {model}: vLLM-Omni resolves and sizes it")
    return sorted(found_problems, key=lambda p: not p.fatal)


def _port(config: ServerConfig) -> list[Problem]:
    """Whether ``serve`` could bind ``--host``:``--port`` (bound as serve binds, then closed)."""
    try:
        listen_socket(config.host, config.port).close()
    except OSError as exc:
        what = f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
        return [Problem(what, "another server there? --port picks another")]
    return []


def _gpus(torch: Torch, line: Line) -> None:
    if torch.gpus:
        for gpu in torch.gpus:
            line(f"gpu {gpu.index}", gpu.describe())
        return
    driver = driver_gpus()
    if isinstance(driver, str):
        line("gpus", driver)
        return
    for gpu in driver:
        line(f"gpu {gpu.index}", f"{gpu.describe()} (the driver's; torch cannot use it)")


def _moshi(config: ServerConfig, torch: Torch, line: Line) -> list[Problem]:
    """The engine, the model and the memory plan; the problems only importing can show."""
    found_problems = [Problem(f"torch is {torch.error}", INSTALL_MOSHI)] if torch.error else []
    on_gpu = config.device.startswith("cuda") or (config.device == "auto" and bool(torch.gpus))
    sessions = "auto" if config.max_sessions == AUTO_SESSIONS else str(config.max_sessions)
    where = "a process of its own" if config.engine_in_process else "the engine thread"
    line("engine", f"moshi on {'cuda' if on_gpu else 'cpu'} (--device {config.device}) in {where}, "
                   f"--max-sessions {sessions}")
    imports = torch.module is not None and found("moshi") and _moshi_imports(found_problems)
    if checkpoint_named(config) and not imports:
        line("model", "a checkpoint, read with moshi once it imports")
        return found_problems
    try:
        model = resolve_model(config)
    except ModelError as exc:
        line("model", "none: see the problems below")
        return [*found_problems, exc.problem]
    line("model", model.describe())
    found_problems += session_problems(config, model)
    dtype = lm_dtype(config, on_gpu)
    kv = kv_per_slot(config, model, dtype)
    line("kv ring", f"{_size(kv)} a slot: {_kv_formula(config, model, dtype)}")
    paged = paging(config, model, kv)
    if paged is not None:
        line("kv pages", f"paged (--moshi-kv-layout paged): pages of {paged.page} frames, "
                         f"{_size(paged.page_bytes)} each; a slot reserves its floor of {paged.floor_pages} "
                         f"(--moshi-kv-floor-s {config.moshi_kv_floor_s:g}), a call takes more as it ages, "
                         f"up to the {paged.context_pages} of the full context, given back at its end")
    if not imports:
        line("memory", "no plan: the weights are counted with torch and moshi")
        return found_problems
    return found_problems + memory_plan(config, model, torch, on_gpu, line)


def _moshi_imports(found_problems: list[Problem]) -> bool:
    try:
        import moshi.models  # noqa: F401  (the engine's first import)
    except Exception as exc:  # any failure is what the engine would hit: report it
        what = f"moshi is installed, but import moshi.models fails: {type(exc).__name__}: {exc}"
        found_problems.append(Problem(what, INSTALL_MOSHI))
        return False
    return True


def memory_plan(config: ServerConfig, model: Model, torch: Torch, on_gpu: bool, line: Line) -> list[Problem]:
    """The weights, and the slots against the free memory of the GPU in ``torch.gpus`` the engine
    would use (the host's, on the CPU); the problems of that plan."""
    index = int(config.device.partition(":")[2] or 0)
    gpu = next((g for g in torch.gpus if g.index == index), None) if on_gpu else None
    free = gpu.free if gpu else (host_available() or 0)
    weights, memory = plan(config, model, free, on_gpu)
    line("weights", f"LM {_size(weights.lm)} ({weights.dtype}) + Mimi {_size(weights.mimi)} = "
                    f"{_size(weights.total)} (counted on the meta device)")
    if gpu is None and on_gpu:
        line("memory", f"{_size(memory.per_slot)} a slot; no usable GPU {index} to fit them in")
        return []
    if gpu is None:
        host = f"{_size(free)} available" if free else "available memory unknown"
        kv, per_slot, sink = "KV ring", memory.kv_per_slot, ""
        if memory.paging:  # on the CPU the pool holds every slot's full context, and the sink page
            kv, per_slot = "KV pages", memory.paging.context_pages * memory.paging.page_bytes
            sink = f" + a {_size(memory.paging.page_bytes)} sink page"
        need = memory.slots * per_slot + weights.total + (memory.paging.page_bytes if memory.paging else 0)
        line("memory", f"the CPU does not size slots by memory: {memory.slots} slots x "
                       f"{_size(per_slot)} of {kv}{sink} + the weights = {_size(need)} ({host})")
        line("auto", "--max-sessions auto sizes by GPU memory: on the CPU give a number")
        return []
    auto = auto_slots(memory)
    line("memory", f"GPU {index}, after the weights: {memory.describe()}")
    line("auto", f"--max-sessions auto would pick {auto} (keeping {LOAD_SLACK >> 20} MiB for what loading "
                 "leaves)")
    smaller = "lower --moshi-kv-floor-s" if memory.paging else "shorten --moshi-context"
    smaller += " or use --moshi-kv-dtype int8"
    if config.max_sessions == AUTO_SESSIONS and auto < 1:
        return [Problem(f"--max-sessions auto: no slot fits on GPU {index}", f"free the GPU, {smaller}")]
    if config.max_sessions != AUTO_SESSIONS and memory.needed > memory.free:
        what = f"--max-sessions {config.max_sessions} does not fit on GPU {index}: {memory.describe()}"
        return [Problem(what, f"use --max-sessions {auto} (or auto), {smaller}")]
    return []


def _kv_formula(config: ServerConfig, model: Model, dtype: str) -> str:
    lm = model.lm
    repeat = lm.get("kv_repeat", 1)
    values = f"{lm['dim'] // repeat} values"
    if repeat > 1:
        values += f" ({lm['num_heads'] // repeat} KV heads)"
    shape = f"{lm['num_layers']} layers x K,V x {lm['context']} frames x {values}"
    if config.moshi_cfg_coef != 1.0:
        shape = f"2 rows (guidance) x {shape}"
    if config.moshi_kv_dtype == "int8" and config.moshi_attention == "live":
        return f"{shape} x 1 B, with a {DTYPE_BYTES[dtype]} B scale a head"
    return f"{shape} x {DTYPE_BYTES[dtype]} B ({dtype})"


def _size(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
