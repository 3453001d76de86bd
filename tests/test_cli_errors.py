"""What ``duplexserve`` says to a wrong command line: the valid range, the subcommand's own
usage, and a busy port at once, before any model loads."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from duplexserve.config import ServerConfig
from tests.duplexserve_cli import run

REPO = Path(__file__).resolve().parent.parent


def test_max_sessions_out_of_range_says_the_range():
    for value in ("0", "-3", "many"):
        done = run("serve", "--max-sessions", value)
        assert done.returncode == 2
        assert "invalid int_or_auto value" not in done.stderr
        assert f"argument --max-sessions: {value!r} is no session count: a whole number from 1 up, or auto" \
            in done.stderr
    done = run("serve", env={"DUPLEXSERVE_MAX_SESSIONS": "0"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "DUPLEXSERVE_MAX_SESSIONS='0': '0' is no session count" in done.stderr


def test_an_unknown_option_says_its_error_first_then_a_short_usage():
    for command in ("serve", "check", "loadgen"):
        done = run(command, "--bogus", "ws://127.0.0.1:1")
        assert done.returncode == 2
        lines = done.stderr.splitlines()
        assert lines[0].startswith(f"duplexserve {command}: error: unrecognized arguments: --bogus"), lines
        assert lines[1].startswith(f"usage: duplexserve {command} ") and lines[1].endswith("[options]")
        assert lines[2:] == [f"duplexserve {command} --help lists every option"]


def test_a_busy_port_is_said_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run("serve", "--port", str(port), "--engine", "moshi", "--moshi-preset", "tiny",
                   "--device", "cpu")
    assert done.returncode == 1
    assert done.stderr == (f"duplexserve: cannot listen on 127.0.0.1:{port}: Address already in use "
                           "(another server there? --port picks another)\n")
    assert done.stdout == ""


#: A bad value each, by flag or by variable: (arguments, environment, what the line says).
BAD_VALUES = [
    (("--port", "99999"), {}, "argument --port: '99999' is no TCP port: a whole number from 1 to 65535"),
    (("--port=-1",), {}, "argument --port: '-1' is no TCP port"),
    ((), {"DUPLEXSERVE_PORT": "70000"}, "DUPLEXSERVE_PORT='70000': '70000' is no TCP port"),
    ((), {"DUPLEXSERVE_WS": "bogus"}, "DUPLEXSERVE_WS='bogus': not one of fast, websockets-sansio, "
                                      "websockets"),
    (("--ws", "bogus"), {}, "argument --ws: invalid choice: 'bogus'"),
    ((), {"DUPLEXSERVE_DEVICE": "gpu"}, "DUPLEXSERVE_DEVICE='gpu': 'gpu' is no device: auto, cpu, cuda or "
                                        "cuda:N"),
    (("--device", "cuda:x"), {}, "argument --device: 'cuda:x' is no device"),
    (("--voice-prompt-dir", "/nonexistent/voices"), {},
     "argument --voice-prompt-dir: /nonexistent/voices does not exist"),
    ((), {"DUPLEXSERVE_MOSHI_GREEDY": "maybe"}, "DUPLEXSERVE_MOSHI_GREEDY='maybe': a switch: one of 1, true"),
    ((), {"DUPLEXSERVE_ENGINE_PROCESS": "maybe"}, "DUPLEXSERVE_ENGINE_PROCESS='maybe': a switch"),
]


@pytest.mark.parametrize("command", ["serve", "check"])
@pytest.mark.parametrize(("args", "env", "said"), BAD_VALUES)
def test_a_bad_value_is_one_line_and_exit_2(command, args, env, said):
    done = run(command, "--engine", "moshi", *args, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""  # check's report not begun: nothing loaded
    assert done.stderr.startswith(f"duplexserve {command}: error: {said}"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def check_engine(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``duplexserve check`` with ``args``, on a free port."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    return run("check", "--port", str(port), *args, env=env)


def engine_line(done: subprocess.CompletedProcess[str]) -> str:
    return next(line[14:] for line in done.stdout.splitlines() if line.startswith("engine "))


def test_an_engine_option_alone_selects_its_engine(tmp_path):
    done = check_engine("--moshi-preset", "tiny-personaplex", "--device", "cpu", "--max-sessions", "2",
                        "--voice-prompt-dir", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert engine_line(done).startswith("moshi on cpu (--device cpu)")
    assert "preset tiny-personaplex" in done.stdout
    done = check_engine("--max-sessions", "2", env={"DUPLEXSERVE_DEVICE": "cpu"})  # by the environment too
    assert engine_line(done).startswith("moshi on cpu"), done.stdout + done.stderr
    done = check_engine("--vllm-omni-standin")
    assert engine_line(done).startswith("vllm-omni, model the CPU stand-in"), done.stdout + done.stderr
    done = check_engine("--synthetic-mode", "silence", env={"DUPLEXSERVE_MOSHI_PRESET": "tiny"})
    assert engine_line(done) == "synthetic (silence): no model, no GPU"  # the flag's engine, the variable ...
    assert done.stderr == ("duplexserve check: warning: DUPLEXSERVE_MOSHI_PRESET (the environment) set "
                           "another engine's options, which the synthetic engine ignores\n")  # ... warned of


def test_an_engine_option_of_another_engine_than_the_one_named_is_refused():
    done = check_engine("--engine", "synthetic", "--moshi-preset", "tiny-personaplex")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("duplexserve check: error: --moshi-preset is an option of the moshi engine, and "
                           "--engine synthetic ignores it: leave it out, or serve --engine moshi\n")
    done = run("serve", "--device", "cpu", env={"DUPLEXSERVE_ENGINE": "vllm-omni"})
    assert done.returncode == 2 and done.stderr == (
        "duplexserve serve: error: --device is an option of the moshi engine, and "
        "DUPLEXSERVE_ENGINE=vllm-omni ignores it: leave it out, or serve --engine moshi\n")
    done = run("serve", "--moshi-preset", "tiny", "--vllm-omni-model", "some/model")
    assert done.returncode == 2 and done.stderr == (
        "duplexserve serve: error: --moshi-preset (moshi) and --vllm-omni-model (vllm-omni) are options of "
        "different engines: name the one to serve with --engine\n")
    # The environment is a deployment's defaults (compose.cpu.yaml: the synthetic engine, the
    # moshi variables of compose.yaml): said, not refused; an empty one is unset.
    env = {"DUPLEXSERVE_DEVICE": "cpu", "DUPLEXSERVE_MOSHI_WEIGHTS": "", "DUPLEXSERVE_ENGINE": "synthetic"}
    done = check_engine(env=env)
    assert done.returncode == 0 and engine_line(done).startswith("synthetic"), done.stdout + done.stderr
    assert done.stderr == ("duplexserve check: warning: DUPLEXSERVE_DEVICE (the environment) set another "
                           "engine's options, which the synthetic engine ignores\n")


def test_the_readme_persona_recipe_serves_the_moshi_engine_and_its_voices(server_factory, tmp_path):
    """README, Personas and voices: `--moshi-preset tiny-personaplex --device cpu --voice-prompt-dir
    DIR`, no --engine; it served the echo, with no voice."""
    pytest.importorskip("moshi")
    from tests.personaplex_checkpoint import write_wav
    from tests.test_moshi_equivalence import signal

    write_wav(tmp_path / "mine.wav", 0.5 * signal(99, 5).reshape(-1))
    server = server_factory("--moshi-preset", "tiny-personaplex", "--device", "cpu", "--voice-prompt-dir",
                            str(tmp_path))
    deadline = time.monotonic() + 180  # the engine loads after /health answers
    while not (ready := httpx.get(server.http + "/ready", timeout=10).json())["ready"]:
        assert time.monotonic() < deadline, ready
        time.sleep(0.2)
    assert ready["engine"].startswith("moshi"), ready
    voices = httpx.get(server.http + "/v1/voices", timeout=10).json()["data"]
    assert "mine.wav" in json.dumps(voices), voices


def test_an_unknown_variable_is_warned_of_with_the_closest_setting():
    done = check_engine(env={"DUPLEXSERVE_MAX_SESSION": "3", "DUPLEXSERVE_TORCH_VERSION": "2.13.0",
                             "DUPLEXSERVE_NOFILE": "65536", "DUPLEXSERVE_GPU_1": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ("duplexserve check: warning: DUPLEXSERVE_MAX_SESSION is no setting, ignored; did "
                           "you mean DUPLEXSERVE_MAX_SESSIONS (--max-sessions)?\n")
    done = check_engine(env={"DUPLEXSERVE_QQQQQQQQQQQQ": "1"})  # no name close to it
    assert done.stderr == "duplexserve check: warning: DUPLEXSERVE_QQQQQQQQQQQQ is no setting, ignored\n"


def test_every_duplexserve_variable_the_repository_names_is_a_setting_or_known():
    """The scripts', docker files' and tests' own variables get no warning; a new one is added to
    options.NOT_SETTINGS, or it would be warned of as a misspelt setting."""
    from duplexserve.options import NOT_SETTING_PREFIXES, NOT_SETTINGS

    settings = {f.name.upper() for f in dataclasses.fields(ServerConfig)}
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    named = set()
    for path in tracked:
        if path == "tests/test_cli_errors.py":  # its misspelt names, on purpose
            continue
        if path.endswith((".py", ".md", ".sh", ".yaml", ".yml", ".conf", ".toml", ".txt", ".cfg")) \
                or "Dockerfile" in path:
            text = (REPO / path).read_text(errors="replace")
            named |= {m.group(1) for m in re.finditer(r"DUPLEXSERVE_([A-Z0-9_]*[A-Z0-9])\b(?! is no setting)",
                                                       text)}  # the warning, as the docs quote it
    unknown = {n for n in named if n not in settings and n not in NOT_SETTINGS
               and not n.startswith(NOT_SETTING_PREFIXES) and not n.startswith(("MOSHI_",))}
    assert not unknown, sorted(unknown)


def test_serve_help_groups_every_option_common_first():
    from duplexserve.option_table import GROUPS

    text = run("serve", "--help").stdout
    assert text.startswith("usage: duplexserve serve [MODEL] [options]\n")
    headings = [line[:-1] for line in text.splitlines() if re.fullmatch(r"[a-z][a-z -]*:", line)]
    assert headings == ["options", *(g.title for g in GROUPS), "advanced"]
    assert headings[1:3] == ["model", "server"]
    for f in dataclasses.fields(ServerConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name
    model = text[text.index("\nmodel:"):text.index("\nserver:")]
    assert all(flag in model for flag in ("--engine", "--moshi-preset", "--moshi-hf-repo", "--device"))
