"""``duplexserve serve``'s preflight: refuse what the engine cannot start with, before uvicorn starts.

A missing dependency used to surface as uvicorn's startup traceback from the engine
thread (``ModuleNotFoundError: No module named 'torch'``, "Application startup failed").
Now the serve path asks first: what the engine needs (``requirements.py``, milliseconds,
nothing imported) and which model the options name (``model.py``). The first thing
missing becomes one line with its fix and a non-zero exit; what only makes serving worse
is logged as a warning. Reading a checkpoint's config and sizing ``--max-sessions auto``
import torch and moshi, so they run in a child process: the server's own process (whose
engine runs in a process of its own on a GPU) then neither loads torch nor keeps a CUDA
context for them.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from duplexserve.check.model import ModelError, checkpoint_named, resolve_model
from duplexserve.check.plan import auto_plan
from duplexserve.check.requirements import INSTALL_MOSHI, Problem, requirements
from duplexserve.config import AUTO_SESSIONS, ServerConfig
from duplexserve.engine_bridge.moshi.memory import MemoryPlan

log = logging.getLogger("duplexserve")


class CannotServe(Exception):
    """What stops ``serve`` from starting, in one line with its fix."""


@dataclass(frozen=True)
class Probe:
    """What the child process found: a problem, or the plan of ``--max-sessions auto``."""

    problem: Problem | None = None
    plan: MemoryPlan | None = None
    trace: str = ""  # the traceback of an unexpected failure, logged at --log-level debug


def preflight(config: ServerConfig) -> ServerConfig:
    """``config`` ready to serve (``--max-sessions auto`` resolved); raises CannotServe."""
    found = requirements(config)
    moshi = config.engine == "moshi"
    if moshi and not checkpoint_named(config):
        try:
            resolve_model(config)  # a preset: read from presets.py
        except ModelError as exc:
            found.append(exc.problem)
    fatal = [p for p in found if p.fatal]
    if fatal:
        raise CannotServe(_one_line(config, fatal))
    if moshi and (config.max_sessions == AUTO_SESSIONS or checkpoint_named(config)):
        config = _in_child(config)
    for problem in found:
        log.warning("%s", problem.line())
    return config


def _in_child(config: ServerConfig) -> ServerConfig:
    """Resolve the checkpoint and ``--max-sessions auto`` in a child process (``probe``)."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        try:
            found_there = pool.submit(probe, config).result()
        except BrokenProcessPool as exc:  # killed, or crashed inside torch
            raise CannotServe(f"cannot serve --engine moshi: the process reading the model died ({exc}); "
                              "duplexserve check with the same options shows more") from exc
    if found_there.trace:
        log.debug("in the preflight's child process:\n%s", found_there.trace)
    if found_there.problem is not None:
        raise CannotServe(_one_line(config, [found_there.problem]))
    if found_there.plan is None:
        return config
    log.info("--max-sessions auto: %s", found_there.plan.describe())
    return dataclasses.replace(config, max_sessions=found_there.plan.slots)


def probe(config: ServerConfig) -> Probe:
    """In the child: resolve the model and, for ``--max-sessions auto``, size the slots."""
    try:
        model = resolve_model(config)
        memory = auto_plan(config, model) if config.max_sessions == AUTO_SESSIONS else None
    except ModelError as exc:
        return Probe(exc.problem)
    except ImportError as exc:  # installed, yet it does not import: the engine would fail the same way
        what = f"the moshi engine's imports fail ({type(exc).__name__}: {exc})"
        return Probe(Problem(what, INSTALL_MOSHI), trace=traceback.format_exc())
    except Exception as exc:  # what the engine would hit too, one line here
        what = f"reading the model failed ({type(exc).__name__}: {exc})"
        fix = "duplexserve check with the same options shows more"
        return Probe(Problem(what, fix), trace=traceback.format_exc())
    if isinstance(memory, str):
        return Probe(Problem(f"--max-sessions auto: {memory}", "give --max-sessions a number"))
    if memory is not None and memory.slots < 1:
        return Probe(Problem(
            f"--max-sessions auto: no slot fits ({memory.describe()})",
            "free the GPU, shorten --moshi-context or use --moshi-kv-dtype int8",
        ))
    return Probe(plan=memory)


def _one_line(config: ServerConfig, fatal: list[Problem]) -> str:
    more = f" ({len(fatal) - 1} more: duplexserve check lists them)" if len(fatal) > 1 else ""
    return f"cannot serve --engine {config.engine}: {fatal[0].line()}{more}"
