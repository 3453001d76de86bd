#!/usr/bin/env bash
# Install everything the tests need into .venv, lint, and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
./scripts/install-moshi.sh  # the moshi engine's torch + moshi, pinned (see the script)
.venv/bin/ruff check duplexserve tests
.venv/bin/python -m pytest -q "$@"
