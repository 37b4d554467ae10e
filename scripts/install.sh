#!/usr/bin/env bash
# Install specd and its test tools into the current Python (idempotent).
# torch is pinned first: 2.13.0 is the CPU build this machine kind serves locally;
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip --disable-pip-version-check -q"
python3 -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13") else 1)' 2>/dev/null \
  || $PIP install "torch==2.13.0"
$PIP install -e ".[test]"
