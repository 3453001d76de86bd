#!/usr/bin/env bash
# Install what the moshi engine needs into .venv, without letting pip resolve torch.
#
# moshi 0.2.13 declares torch<2.10 (and numpy<2.3) but runs on newer releases (CPU
# tests here: torch 2.13; H200 runs: torch 2.11). Installed with its dependencies, pip
# would replace the torch in place with a <2.10 build of several GB, so the steps are:
# torch pinned first (the CPU build, which this machine keeps as a local wheel), then
# moshi with --no-deps, then only the packages moshi imports at run time, with the
# ranges it declares (numpy with duplexserve's: moshi's <2.3 is too narrow, see above),
# so that a fresh venv (docker/Dockerfile.gpu's layer before the package) can import it.
# Nothing here downloads model weights.
#
# DUPLEXSERVE_TORCH_VERSION picks torch (default below); PyPI's Linux x86_64 wheel of it is
# the CUDA build (2.13.0: CUDA 13.0, its libraries as nvidia-* and cuda-toolkit wheels).
# DUPLEXSERVE_TORCH_CUDA=1 fails unless the torch installed is a CUDA build (the GPU
# image sets it, so that a CPU-only mirror or a CPU torch already present cannot pass).
#
# On a machine without an NVIDIA GPU (no nvidia-smi, no /dev/nvidia*) the CUDA build is
# gigabytes of libraries nothing uses, so torch comes from PyTorch's CPU index
# (DUPLEXSERVE_TORCH_CPU_INDEX, default below) when it answers; when it does not, or its install
# fails, pip takes whatever its own configuration finds (an index, a mirror, a local wheel by
# find-links: this project's CI machine keeps the CPU build as one). DUPLEXSERVE_TORCH_CPU=1
# takes the CPU index even beside a GPU, =0 never (PyPI's default build); DUPLEXSERVE_TORCH_CUDA=1
# implies =0 (the GPU image is built on a machine that may have no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TORCH_VERSION="${DUPLEXSERVE_TORCH_VERSION:-2.13.0}"
CPU_INDEX="${DUPLEXSERVE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
TORCH_CPU="${DUPLEXSERVE_TORCH_CPU:-auto}"
if [ "${DUPLEXSERVE_TORCH_CUDA:-0}" = 1 ]; then
  if [ "$TORCH_CPU" = 1 ]; then
    echo "install-moshi.sh: DUPLEXSERVE_TORCH_CPU=1 and DUPLEXSERVE_TORCH_CUDA=1 ask for two builds" >&2
    exit 2
  fi
  TORCH_CPU=0
fi
if [ "$TORCH_CPU" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 || compgen -G "/dev/nvidia*" >/dev/null; then
    TORCH_CPU=0
  else
    TORCH_CPU=1
  fi
fi
if [ "$TORCH_CPU" != 0 ] && [ "$TORCH_CPU" != 1 ]; then
  echo "install-moshi.sh: DUPLEXSERVE_TORCH_CPU=$TORCH_CPU: 1 (the CPU build), 0 (PyPI's) or unset (by the GPU)" >&2
  exit 2
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  installed=0
  if [ "$TORCH_CPU" = 1 ]; then
    if "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip('/') + '/torch/', timeout=10)" \
        "$CPU_INDEX" 2>/dev/null; then
      echo "install-moshi.sh: no NVIDIA GPU (or DUPLEXSERVE_TORCH_CPU=1): torch ${TORCH_VERSION}, CPU build, from $CPU_INDEX"
      if "$PY" -m pip install -q --index-url "$CPU_INDEX" "torch==${TORCH_VERSION}"; then
        installed=1
      else
        echo "install-moshi.sh: the CPU index failed; torch from pip's own configuration instead" >&2
      fi
    else
      echo "install-moshi.sh: no NVIDIA GPU, but $CPU_INDEX does not answer: torch from pip's own" \
        "configuration (on Linux x86_64 PyPI has only the CUDA build; DUPLEXSERVE_TORCH_CPU_INDEX names a mirror)" >&2
    fi
  fi
  if [ "$installed" = 0 ]; then
    "$PY" -m pip install -q "torch==${TORCH_VERSION}"
  fi
fi
# What moshi imports first, moshi itself last: pip checks every installed package's declared
# requirements after an install that resolves dependencies, and with moshi already there it
# prints "ERROR: ... moshi 0.2.13 requires torch<2.10" although nothing failed; an install
# with --no-deps skips that check.
"$PY" -m pip install -q "safetensors>=0.4,<0.8" "huggingface-hub>=0.24,<1.0" "einops>=0.7,<0.9" \
  "sentencepiece>=0.2,<0.3" "numpy>=1.26,<3" "pyloudnorm>=0.1.1,<0.3"
"$PY" -m pip install -q --no-deps "moshi==0.2.13"
"$PY" -c "import moshi.models, torch; print('moshi', moshi.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)"
if [ "${DUPLEXSERVE_TORCH_CUDA:-0}" = 1 ] && ! "$PY" -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
  echo "install-moshi.sh: DUPLEXSERVE_TORCH_CUDA=1 but the torch installed is not a CUDA build" >&2
  exit 1
fi
echo "install-moshi.sh: done. moshi 0.2.13 declares torch<2.10 and numpy<2.3 and runs on the torch" \
  "above: where pip (pip check, a later pip install) reports that as a conflict, it is expected"
