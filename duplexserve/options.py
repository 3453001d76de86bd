"""``serve``'s and ``check``'s options settled: no option is ignored without a word.

An engine's option selects its engine when none was named (``--moshi-preset
tiny-personaplex`` alone serves the moshi engine), and is refused in one line when
``--engine`` names another. The environment is a deployment's shared defaults
(docker/compose.yaml sets the moshi variables, compose.cpu.yaml then the synthetic
engine), so a variable of another engine than the one named is warned of, not refused.
A ``DUPLEXSERVE_*`` variable that is no setting is warned of with the closest name.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from collections.abc import Callable

from duplexserve.config import ENV_PREFIX, GIVEN, ServerConfig
from duplexserve.option_table import engine_of

#: ``DUPLEXSERVE_*`` variables that are no setting of ``serve`` yet are read elsewhere: by the
#: scripts, docker files and tests (tests/test_cli_errors.py checks the repository names
#: no other), or by a module (DUPLEXSERVE_NO_LIBOPUS, DUPLEXSERVE_SPEECH_WAV).
NOT_SETTINGS = frozenset({
    "API_KEY", "CHROMIUM", "COTURN_IMAGE", "DOCKER_BASE", "DOCKER_KEEP", "GPU", "GPUS", "HTTP", "IMAGE",
    "KEY", "KEYS_DIR", "NAME", "NGINX_IMAGE", "NOFILE", "NO_LIBOPUS", "PUBLISH_PORT",
    "REQUIRE_VLLM_OMNI", "RESULTS_DIR", "SPEECH_WAV", "SUBNET", "TERMINATION_GRACE_S", "TLS_DIR",
    "TORCH_CPU", "TORCH_CPU_INDEX", "TORCH_CUDA", "TORCH_VERSION", "UPDATE_READY_S",
    "UPDATE_SCREENSHOT", "UPDATE_SERVICES", "URL", "VAR", "VLLM_OMNI_NEED_GB", "VLLM_OMNI_VENV",
    "WEIGHTS_DIR",
})
#: ... and the families of them (DUPLEXSERVE_GPU_1, DUPLEXSERVE_PUBLISH_PORT_2, DUPLEXSERVE_TEST_HIDE).
NOT_SETTING_PREFIXES = ("GPU_", "PUBLISH_PORT_", "TEST_", "LOADGEN_", "LB_", "TURN")


def settle(args: argparse.Namespace, prog: str) -> ServerConfig:
    """The config ``args`` give, its engine chosen by its options; exits 2 with one line on
    stderr for options of two engines. Warns, on stderr, of what the environment sets in vain."""
    for line in unknown_environment():
        print(f"{prog}: warning: {line}", file=sys.stderr)
    config = ServerConfig.from_namespace(args)
    try:
        engine, ignored = choose_engine(config.engine, getattr(args, GIVEN, set()), environment_set())
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if ignored:
        print(f"{prog}: warning: {', '.join(ignored)} (the environment) set another engine's options, "
              f"which the {engine} engine ignores", file=sys.stderr)
    return dataclasses.replace(config, engine=engine)


def choose_engine(engine: str, flags: set[str], env: set[str]) -> tuple[str, list[str]]:
    """The engine to serve, and the variables of ``env`` it ignores. ``flags``, ``env``: the
    fields set on the command line and in the environment; ``engine``: the parsed one."""
    flag_engines = {name: engine_of(name) for name in sorted(flags) if engine_of(name)}
    env_engines = {name: engine_of(name) for name in sorted(env - flags) if engine_of(name)}
    if "engine" in flags or "engine" in env:
        named = f"--engine {engine}" if "engine" in flags else f"{ENV_PREFIX}ENGINE={engine}"
        for name, owner in flag_engines.items():
            if owner != engine:
                raise ValueError(f"{_flag(name)} is an option of the {owner} engine, and {named} ignores "
                                 f"it: leave it out, or serve --engine {owner}")
    else:
        engine = _implied(flag_engines, _flag) or _implied(env_engines, _env) or engine
    return engine, [_env(name) for name, owner in env_engines.items() if owner != engine]


def _implied(owners: dict[str, str | None], spell: Callable[[str], str]) -> str | None:
    """The one engine ``owners`` select (None: no option of any); a ValueError for two."""
    engines = sorted({owner for owner in owners.values() if owner})
    if len(engines) > 1:
        first = {owner: name for name, owner in reversed(owners.items())}
        which = " and ".join(f"{spell(first[e])} ({e})" for e in engines)
        raise ValueError(f"{which} are options of different engines: name the one to serve with --engine")
    return engines[0] if engines else None


def environment_set() -> set[str]:
    """The fields a non-empty ``DUPLEXSERVE_*`` variable sets (an empty one, as compose files
    write an unset one, leaves the default)."""
    return {f.name for f in dataclasses.fields(ServerConfig) if os.environ.get(_env(f.name), "").strip()}


def unknown_environment() -> list[str]:
    """A line for each ``DUPLEXSERVE_*`` variable that is no setting, with the closest setting."""
    settings = {_env(f.name): _flag(f.name) for f in dataclasses.fields(ServerConfig)}
    lines = []
    for name in sorted(os.environ):
        rest = name[len(ENV_PREFIX):]
        if not name.startswith(ENV_PREFIX) or name in settings or rest in NOT_SETTINGS:
            continue
        if rest.startswith(NOT_SETTING_PREFIXES):
            continue
        close = difflib.get_close_matches(rest, [s[len(ENV_PREFIX):] for s in settings], n=1)  # the prefix
        near = ENV_PREFIX + close[0] if close else ""  # matches every one: compared without it
        guess = f"; did you mean {near} ({settings[near]})?" if close else ""
        lines.append(f"{name} is no setting, ignored{guess}")
    return lines


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()
