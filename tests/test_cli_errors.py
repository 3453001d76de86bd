"""What ``duplexserve`` says to a wrong command line: the valid range, the subcommand's own
usage, and a busy port at once, before any model loads."""

from __future__ import annotations

import socket

from tests.duplexserve_cli import run


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


def test_an_unknown_option_shows_the_subcommands_usage():
    for command in ("serve", "check", "loadgen"):
        done = run(command, "--bogus", "ws://127.0.0.1:1")
        assert done.returncode == 2
        assert done.stderr.startswith(f"usage: duplexserve {command} ")
        assert f"duplexserve {command}: error: unrecognized arguments: --bogus" in done.stderr


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
