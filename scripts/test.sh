#!/usr/bin/env bash
# Install everything the tests need into .venv, lint, and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
./scripts/install-moshi.sh  # the moshi engine's torch + moshi, pinned (see the script)
# The reference of tests/test_hibiki_zero_reference.py: Hibiki-Zero's own server loop
# (hibiki-zero 0.0.4, inference.ServerState). A test dependency only, so not in
# install-moshi.sh (the GPU image runs that). --no-deps: it declares gradio and jupyter, its
# web UI and notebooks, which the test never runs (and moshi, installed above). What its
# inference module imports beyond moshi's own: aiohttp (already there: pipecat's test extra takes
# 3.14, past moshi's declared <3.12, and the reference runs on it) and
# IPython (client_utils.py imports IPython.display).
.venv/bin/python -m pip install -q --no-deps "hibiki-zero==0.0.4"
.venv/bin/python -m pip install -q "aiohttp>=3.10.5" "ipython>=8,<10"
.venv/bin/ruff check duplexserve tests
.venv/bin/python -m pytest -q "$@"
# The protocol, codec and reliability tests again over uvicorn's own ASGI path: the
# fallback where the fast path's scope extension is absent (docs/architecture.md).
DUPLEXSERVE_WS=websockets-sansio .venv/bin/python -m pytest -q \
  tests/test_native_protocol.py tests/test_realtime_protocol.py tests/test_moshi_protocol.py \
  tests/test_twilio.py tests/test_twilio_bad_input.py tests/test_resume.py tests/test_reliability.py \
  tests/test_formats_server.py tests/test_deadlines.py tests/test_fuzz.py tests/test_codec_batching.py \
  tests/test_hostile_transport.py
