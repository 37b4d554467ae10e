#!/usr/bin/env bash
# Install specd and its test tools into the current Python (idempotent), and promtool
# (Debian's prometheus package) for the chart's dashboard and alert tests.
# torch is pinned first: 2.13.0 is the CPU build this machine kind serves locally;
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip --disable-pip-version-check -q"
python3 -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13") else 1)' 2>/dev/null \
  || $PIP install "torch==2.13.0"
$PIP install -e ".[test]"
# Without CUDA the Triton kernels are tested through Triton's interpreter, which needs
# 3.9+ on CPU; with CUDA, the Triton that matches the installed torch stays.
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || $PIP install "triton>=3.9"
if ! command -v promtool >/dev/null; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "install.sh: promtool missing; install Debian's prometheus package (charts/tests need it)" >&2
  fi
fi
