#!/usr/bin/env bash
# The --engine vllm-omni tests against the real vLLM-Omni 0.30.0 (tests/vllm_omni), in a venv
# of their own: vllm 0.30.0 pins torch 2.13.0 and vLLM-Omni needs its CUDA build (about 9 GB
# with everything; it runs on a CPU too). docs/vllm-omni.md has the numbers and the reasons.
#
# This machine's pip configuration points at a local folder holding torch 2.13.0's CPU build,
# beside which vLLM's torchvision, torchaudio and torchcodec fail to load; the install below
# therefore bypasses that configuration and takes torch from the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DUPLEXSERVE_VLLM_OMNI_VENV:-.venv-vllm-omni}"
PY="$VENV/bin/python"
# A new venv needs about 10 GB (pip's cache is off: it would hold the downloads a second
# time). Where the disk has less, the install could only fail half-way on "no space left on
# device": the suite is skipped instead, and says so with both figures.
NEED_GB="${DUPLEXSERVE_VLLM_OMNI_NEED_GB:-11}"
if ! "$PY" -c "import vllm_omni" 2>/dev/null; then
  free_gb=$(df -BG --output=avail "$(dirname "$(realpath -m "$VENV")")" | tail -1 | tr -dc 0-9)
  if [ "$free_gb" -lt "$NEED_GB" ]; then
    echo "SKIPPED: the vLLM-Omni tests need about $NEED_GB GB free for their venv, $free_gb GB are"
    exit 0
  fi
fi
[ -x "$PY" ] || python3 -m venv "$VENV"
start=$(date +%s)
export PIP_NO_CACHE_DIR=1
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --upgrade pip
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q -e '.[test,vllm-omni]'
echo "vllm-omni venv ready in $(( $(date +%s) - start )) s: $(du -sh "$VENV" | cut -f1)"
"$PY" -c "import vllm, vllm_omni; print('vllm', vllm.__version__, 'vllm-omni', vllm_omni.__version__)"
# Here a missing vllm_omni is an error, not a skip.
DUPLEXSERVE_REQUIRE_VLLM_OMNI=1 HF_HUB_OFFLINE=1 "$PY" -m pytest -q tests/vllm_omni "$@"
