#!/usr/bin/env bash
# The protocol and reliability tests against servers running on the LOWEST versions of the
# runtime dependencies that pyproject.toml admits (scripts/lowest_constraints.py pins each
# `name>=X` to `name==X`), while the test clients (the openai SDK, websockets' client) stay
# at the newest, in .venv: what a user whose environment holds older libraries runs.
# Needs .venv from scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-lowest
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -c <(.venv/bin/python scripts/lowest_constraints.py) -e .
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(fastapi|uvicorn|uvloop|websockets|janus|numpy|prometheus.client|soxr|sphn|starlette) '
"$VENV/bin/python" -c "from duplexserve.server.transports.websocket.protocol import fast_path_problem as p; print('fast path:', p() or 'on')"
DUPLEXSERVE_TEST_SERVER_PYTHON="$PWD/$VENV/bin/python" .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_native_protocol.py tests/test_realtime_protocol.py tests/test_moshi_protocol.py \
  tests/test_twilio.py tests/test_twilio_bad_input.py tests/test_resume.py tests/test_reliability.py \
  tests/test_engine_restart.py tests/test_formats_server.py tests/test_deadlines.py tests/test_fuzz.py \
  tests/test_ws_fastpath.py
