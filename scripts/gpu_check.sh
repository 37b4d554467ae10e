#!/usr/bin/env bash
# The GPU checks of the CUDA backends (issue 6), for one CUDA machine, no network needed:
#   bash scripts/gpu_check.sh [tests|bench|served|all] [OUT_DIR] [PYTEST_ARGS... | BENCH_ARGS...]
# Runs the gpu-marked tests (the lossless matrix on every CUDA backend installed, kernels
# against the torch reference, captured CUDA graphs) and the GPU benchmark (8B shape,
# batch 1 and 32), and writes their logs and the benchmark's JSON to OUT_DIR
# (default ./gpu-check); PYTEST_ARGS (e.g. -k flashinfer, or -n 8 with pytest-xdist: the
# tests bound their KV pools, so workers share one GPU) narrow or spread the tests; with
# `bench`, BENCH_ARGS go to bench_gpu.py instead (e.g. --overlap on --backends triton
# flashinfer).  `served` runs only bench_gpu_served.py (the same engine in-process and
# through `specd serve`; BENCH_ARGS go to it; its bundle needs --serving).
# Packages: specd's dependencies as usual (pip install -e '.[test,gpu]'),
# or, offline, the bundle of scripts/offline_gpu_bundle.py in $SPECD_BUNDLE: its site
# folder is unpacked to /tmp/specd-site (later runs on the same host reuse it without
# SPECD_BUNDLE) and its packed demo weights restore any missing from examples/models/.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
out="${2:-gpu-check}"
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
site=/tmp/specd-site  # the bundle's packages, unpacked once per host: later runs reuse them
if [[ -n "${SPECD_BUNDLE:-}" ]]; then
  python3 scripts/offline_gpu_bundle.py "$SPECD_BUNDLE" --unpack-to "$site" || exit
fi
mkdir -p "$site" && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c 'import specd.workers' 2>/dev/null; then  # run from this checkout's sources
  export PYTHONPATH="workers:kernels:operator:$PYTHONPATH"
  # the CLI reads specd's version from its metadata: give the sources a dist-info
  version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
  mkdir -p "$site/specd-$version.dist-info"
  printf 'Metadata-Version: 2.1\nName: specd\nVersion: %s\n' "$version" \
    > "$site/specd-$version.dist-info/METADATA"
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' || true; } \
  2>&1 | tee "$out/env.log"
if [[ "$what" == served ]]; then
  python3 benchmarks/bench_gpu_served.py --json "$out/served.json" "$@" 2>&1 \
    | tee "$out/served.log"
  exit
fi
if [[ "$what" != bench ]]; then
  # only the modules with gpu tests: the others import the serving stack (Ray, FastAPI, ...)
  mapfile -t modules < <(grep -l "mark.gpu" kernels/tests/*.py workers/tests/*.py)
  # -v names each test as it starts, so a hang or a cut-off run shows where it stopped;
  # faulthandler dumps every thread's stack of a test still running after 240 s
  python3 -m pytest -m gpu -p no:cacheprovider -v -rfE --durations=15 \
    -o faulthandler_timeout=240 "$@" "${modules[@]}" 2>&1 | tee "$out/gpu-tests.log"
fi
if [[ "$what" != tests ]]; then
  bench_args=()
  [[ "$what" == bench ]] && bench_args=("$@")
  python3 benchmarks/bench_gpu.py --json "$out/bench.json" "${bench_args[@]}" 2>&1 \
    | tee "$out/bench.log"
fi
