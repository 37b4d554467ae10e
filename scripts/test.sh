#!/usr/bin/env bash
# The test command: installs what the tests need, lints (ruff, import-linter), runs pytest.
#   bash scripts/test.sh          default suite (not slow, not gpu)
#   bash scripts/test.sh --all    then a second pass: `slow`, and `gpu` where CUDA exists (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check .
lint-imports --no-cache  # the layers and the operator's independence (pyproject.toml)
default="not slow and not gpu"
# The default suite runs on two pytest-xdist workers; each test file's tests stay on one
# worker, with its Ray cluster and module fixtures (about 12 minutes on 2 cores).
parallel=(-n 2 --dist loadfile)
if [[ "${1:-}" != "--all" ]]; then
  exec python3 -m pytest -m "$default" "${parallel[@]}" "$@"
fi
shift
# --all: the default suite, then a second pass with the slow tests (and the gpu ones
# where CUDA exists) on the same two workers, then the `serial` ones (they time a stall
# or a probe) one at a time. Every pass runs even if one fails, so one CI log shows
# every failure.
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  second="(slow or gpu)"
else
  second="(slow and not gpu)"
fi
failed=0
python3 -m pytest -m "$default" "${parallel[@]}" "$@" || failed=1
python3 -m pytest -m "$second and not serial" "${parallel[@]}" "$@" || failed=1
python3 -m pytest -m "$second and serial" "$@" || failed=1
exit "$failed"
