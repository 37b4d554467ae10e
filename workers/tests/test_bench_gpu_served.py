"""benchmarks/bench_gpu_served.py: bench_gpu's engine in-process and served by
``specd serve``; here on CPU with the tiny shape (the GPU run is the issue's check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specd.workers.bench_knobs import ENV_VAR, BenchKnobs
from specd.workers.config import ConfigError, load_deployment
from specd.workers.model.preflight import check_model_folders

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served():
    """bench_gpu_served imported as its script runs (benchmarks/ on the path)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu_served

        yield bench_gpu_served
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_the_served_sdd_is_the_in_process_engines_and_carries_its_knobs(served, tmp_path):
    args = served.parse_args(["--shape", "tiny", "--device", "cpu", "--batch", "1", "4"])
    target, draft = served.bench_gpu.write_folders(tmp_path, served.bench_gpu.SHAPES["tiny"],
                                                   args.dtype)  # fmt: skip
    doc, env = served.served_doc(args, target, draft, "torch")
    spec_file = tmp_path / "served.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    spec = load_deployment(spec_file).spec  # what `specd serve` accepts
    fields, knobs = served.bench_gpu.engine_settings(args, draft, "torch")
    assert spec.max_running_requests == 4 == fields["maxRunningRequests"]
    assert spec.kv_cache.max_tokens == fields["kvCache"]["maxTokens"]
    assert spec.draft.path == str(draft) and spec.resources.gpus == 0
    assert json.loads(env[ENV_VAR]) == {"dummy_weights": True, "force_accept_len": 4.0}
    assert knobs == BenchKnobs(dummy_weights=True, force_accept_len=4.0)
    # no weight file in either folder: refused unless the dummy weights stand in
    with pytest.raises(ConfigError, match="spec.model.path: no weights"):
        check_model_folders(spec)
    check_model_folders(spec, weights=False)


def test_the_table_judges_batch_32(served):
    def row(batch, ratio):
        return {"batch": batch, "in_process_tok_s": 100.0, "served_tok_s": 100.0 * ratio,
                "served_over_in_process": ratio, "in_process_accept_len": 4.0,
                "served_accept_len": None}  # fmt: skip

    assert "| 32 | 100.0 | 95.0 | 0.95 | 4.00 / - |" in served.table([row(32, 0.95)])
    assert served.table([row(32, 0.95)]).endswith("0.95, met")
    assert served.table([row(1, 0.5), row(32, 0.85)]).endswith("0.85, not met")
    assert "goal" not in served.table([row(1, 0.5)])


def test_the_split_table_shows_the_time_outside_the_engines_steps(served):
    row = {"batch": 32, "wall_ms": (400.0, 580.0), "busy_ms": (390.0, 450.0),
           "last_first_token_ms": (20.0, 95.0)}  # fmt: skip
    assert "| 32 | 400 / 580 | 390 / 450 | 10 / 130 | 20 / 95 |" in served.split_table([row])


@pytest.mark.slow
def test_bench_gpu_served_smoke(tmp_path):
    """The whole benchmark on CPU: both engines run, and the served one speculates at
    the forced acceptance too (the knobs reached its actor)."""
    out = tmp_path / "served.json"
    cmd = [sys.executable, "benchmarks/bench_gpu_served.py", "--shape", "tiny", "--device"]
    cmd += ["cpu", "--batch", "1", "2", "--new-tokens", "8", "--repeats", "1", "--cpu", "1"]
    done = subprocess.run([*cmd, "--json", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["in_process_tok_s"] > 0 and r["served_tok_s"] > 0
        assert r["in_process_accept_len"] == r["served_accept_len"] == 4.0
        # where the time went: each side's engine steps take part of its run, the
        # batch's first tokens come before its end
        for wall, busy, first in zip(
            r["wall_ms"], r["busy_ms"], r["last_first_token_ms"], strict=True
        ):
            assert 0 < busy < wall and 0 < first < wall
    assert "| 2 |" in done.stdout and "outside steps ms" in done.stdout
