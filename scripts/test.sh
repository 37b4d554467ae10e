#!/usr/bin/env bash
# The test command: installs what the tests need, lints (ruff, import-linter), runs pytest.
#   bash scripts/test.sh          default suite (not slow, not gpu)
#   bash scripts/test.sh --all    also `slow`, and `gpu` where CUDA exists (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check .
lint-imports --no-cache  # the layers and the operator's independence (pyproject.toml)
markers="not slow and not gpu"
if [[ "${1:-}" == "--all" ]]; then
  shift
  if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    markers=""
  else
    markers="not gpu"
  fi
fi
if [[ -n "$markers" ]]; then
  exec python3 -m pytest -m "$markers" "$@"
fi
exec python3 -m pytest "$@"
