"""Helpers for tests and benchmarks that drive an ``Engine`` in-process (CPU)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from specd.devtools.greedy_judge import GreedyJudge
from specd.kernels.ops import TorchOps
from specd.workers.config import default_num_draft_tokens, spec_for_model
from specd.workers.engine.engine import Engine
from specd.workers.types import FinishReason, GenerateRequest, SamplingParams

# The trained demo pair the repo ships (demo-target, demo-eagle), from a source checkout.
DEMO_MODELS = Path(__file__).resolve().parents[3] / "examples" / "models"
DEMO_TARGET = str(DEMO_MODELS / "demo-target")  # the shipped trained pair
DEMO_EAGLE = str(DEMO_MODELS / "demo-eagle")


class RecordingOps(TorchOps):
    """The torch ops, recording every ``req_to_token`` write as (row, position) pairs."""

    def __init__(self):
        self.writes: list[list[tuple[int, int]]] = []

    def write_req_to_token(self, req_to_token, rows, starts, slots, lens):
        pairs = []
        for row, start, n in zip(rows.tolist(), starts.tolist(), lens, strict=True):
            pairs += [(row, start + i) for i in range(n)]
        self.writes.append(pairs)
        super().write_req_to_token(req_to_token, rows, starts, slots, lens)


def in_loop(gw, fn, *args):
    """Run ``fn(*args)`` on a `Gateway`'s event loop (the pool is not thread-safe)."""

    async def call():
        return fn(*args)

    return asyncio.run_coroutine_threadsafe(call(), gw.loop).result(timeout=10)


@contextlib.contextmanager
def running_gateway(spec, name: str, ready_timeout_s: float = 90, **options):
    """A `Gateway` (uvicorn in a thread, free loopback port) on the Ray already initialized,
    yielded once every replica is ready; stopped on exit.  ``options``: more `Gateway`
    arguments (``on_stop``, ``admin_token``)."""
    from specd.workers.gateway.app import Gateway  # Ray and FastAPI only for the tests that serve
    from specd.workers.gateway.event_loop import run_gateway_loop

    gw = Gateway(
        spec,
        name=name,
        port=0,
        drain_timeout_s=5,
        pool_options={"health_interval_s": 0.3, "probe_timeout_s": 5},
        **options,
    )
    thread = threading.Thread(
        target=lambda: run_gateway_loop(gw.run(handle_signals=False)), daemon=True
    )
    thread.start()
    try:
        assert gw.listening.wait(60), "gateway did not start listening"
        deadline = time.monotonic() + ready_timeout_s
        while not gw.pool.converged():
            assert time.monotonic() < deadline, f"{name}: replicas not ready"
            time.sleep(0.1)
        yield gw
    finally:
        gw.stop()
        thread.join(timeout=60)
    assert not thread.is_alive(), "a gateway did not stop"


def source_roots() -> str:
    """A PYTHONPATH for subprocesses that import this checkout's ``specd`` first."""
    import specd

    roots = [str(Path(p).parent) for p in specd.__path__]
    return os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")])


@dataclasses.dataclass
class ServeProcess:
    """A running ``specd serve``: its process, the lines it has printed so far (read by
    a thread) and its URL once ready."""

    proc: subprocess.Popen
    lines: list[str]
    url: str = ""

    @property
    def output(self) -> str:
        return "".join(self.lines)


@contextlib.contextmanager
def specd_serve(
    spec_file: Path,
    name: str,
    state_dir: Path,
    env: dict[str, str] | None = None,
    unset: tuple[str, ...] = ("RAY_ADDRESS", "SPECD_ADMIN_TOKEN", "SPECD_ADMIN_TOKEN_FILE"),
    ready_timeout_s: float = 90,
) -> Iterator[ServeProcess]:
    """``specd serve spec_file --port 0`` as a user runs it (its own local Ray), yielded
    once it prints that ``name`` is ready; killed on exit if still running.  ``env`` is
    added to this process's environment less ``unset``; the admin token file goes
    under ``state_dir``."""
    child_env = {k: v for k, v in os.environ.items() if k not in unset}
    child_env |= {"PYTHONPATH": source_roots(), "XDG_STATE_HOME": str(state_dir), **(env or {})}
    cmd = [sys.executable, "-m", "specd.workers.cli", "serve", str(spec_file), "--port", "0"]
    proc = subprocess.Popen(
        cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    served = ServeProcess(proc, [])
    reader = threading.Thread(target=lambda: served.lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not served.url:
            ready = next((ln for ln in served.lines if ln.startswith(f"specd: {name} ready")), "")
            served.url = ready.split(" on ")[-1].strip()
            assert proc.poll() is None or served.url, served.output
            assert time.monotonic() < deadline, f"specd serve not ready:\n{served.output}"
            time.sleep(0.1)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)


def with_thinking_tags(model_path, out_dir) -> Path:
    """A copy of ``model_path`` whose tokenizer spells its last two vocabulary entries
    ``<think>`` and ``</think>`` (single tokens, as a thinking model's), weights linked."""
    src, out = Path(model_path), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name != "tokenizer.json":
            (out / item.name).symlink_to(item.resolve())
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    last = max(by_id)
    renamed = {by_id[last - 1]: "<think>", by_id[last]: "</think>"}
    for old, tag in renamed.items():
        vocab[tag] = vocab.pop(old)
        tok["added_tokens"].append(
            {"id": vocab[tag], "content": tag, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": False}
        )  # fmt: skip

    def merged(merge) -> str:  # "a b" or ["a", "b"] -> "ab"
        return (merge if isinstance(merge, str) else " ".join(merge)).replace(" ", "")

    tok["model"]["merges"] = [m for m in tok["model"]["merges"] if merged(m) not in renamed]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


TEST_GPU_KV_TOKENS = 16384


def bounded_kv_cache(kv_cache: dict) -> dict:
    """``kv_cache`` with ``maxTokens: TEST_GPU_KV_TOKENS`` unless it sizes the pool itself:
    tests share one GPU between pytest-xdist workers, so none may take the default share
    of free memory."""
    if "maxTokens" in kv_cache or "memFraction" in kv_cache:
        return kv_cache
    return {**kv_cache, "maxTokens": TEST_GPU_KV_TOKENS}


def pinned_speculation(speculative: dict) -> dict:
    """``speculative`` with the cost model off unless it sets ``policy``: tests' drafts
    are mostly random, and the cost model would soon run them plain, leaving the verify
    path they test unexercised.  Tests of the cost model set the policy themselves."""
    if "policy" in speculative:
        return speculative
    return {**speculative, "policy": {"costModel": {"enabled": False}}}


def start_engine(model_path, *, device: str = "cpu", **overrides) -> Engine:
    """An engine over ``model_path`` (float32 unless ``model.dtype`` says otherwise), with
    the spec fields in ``overrides`` (camelCase, as in the YAML).  At
    ``parallelism.tensor`` > 1 this process is rank 0 and the other ranks are Ray actors
    on the Ray already initialized."""
    model = {"dtype": "float32", **overrides.pop("model", {})}
    if "draft" in overrides:
        overrides["speculative"] = pinned_speculation(overrides.get("speculative", {}))
    if device != "cpu":
        overrides["kvCache"] = bounded_kv_cache(overrides.get("kvCache", {}))
    spec = spec_for_model(model_path, model=model, **overrides)
    rendezvous = None
    if spec.parallelism.tensor > 1:  # this process is rank 0; the others are Ray actors
        from specd.workers.pool.rank_actor import start_ranks

        rendezvous = start_ranks(spec).rendezvous
    engine = Engine(spec, device=device, rendezvous=rendezvous)
    engine.start()
    return engine


def start_spec_engine(
    target,
    draft,
    page_size=1,
    steps=3,
    topk=1,
    tokens=None,
    algorithm="EAGLE",
    overlap=False,
    policy=None,
    draft_fields=None,
    **extra,
) -> Engine:
    """A speculative engine with strict leak checks; ``tokens`` defaults to the chain's
    ``steps + 1``, or for a tree ``min(topk * steps + 1, 2 * steps + 2)``; ``policy``:
    ``speculative.policy`` (default: always speculate, ``pinned_speculation``);
    ``draft_fields``: more ``spec.draft`` fields (a token map, a dtype); ``draft`` None for
    the draft-free algorithms (NGRAM, SUFFIX)."""
    tokens = tokens or default_num_draft_tokens(steps, topk, cap=2 * steps + 2)
    speculative = {"numSteps": steps, "topk": topk, "numDraftTokens": tokens}
    if policy is not None:
        speculative["policy"] = policy
    return start_engine(
        target,
        kvCache={"pageSize": page_size, "maxTokens": 4096},
        scheduler={"chunkedPrefillSize": 16, "overlap": overlap, **extra.pop("scheduler", {})},
        draft={
            "algorithm": algorithm,
            **({"path": draft} if draft else {}),
            **(draft_fields or {}),
        },
        speculative=speculative,
        debug={"strictMemCheck": 1},
        **extra,
    )


async def collect(engine: Engine, rid: str, prompt, session_id=None, priority=0, **params):
    tokens, text, last = [], "", None
    async for delta in engine.generate(
        GenerateRequest(rid, tuple(prompt), SamplingParams(**params), session_id, priority)
    ):
        tokens += delta.token_ids
        text += delta.text
        last = delta
    return tokens, text, last


def run_all(engine: Engine, prompts, loop_factory=None, seeds=None, **params):
    """Every prompt at once, on a new event loop (``loop_factory``: its class) -> one
    ``collect`` result per prompt; ``seeds``: one per prompt, each its request's seed."""
    each = [{}] * len(prompts) if seeds is None else [{"seed": seed} for seed in seeds]

    async def go():
        return await asyncio.gather(
            *(
                collect(engine, f"r{i}", p, **params, **own)
                for i, (p, own) in enumerate(zip(prompts, each, strict=True))
            )
        )

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(go())


def wait_idle(engine: Engine, timeout_s: float = 60.0) -> bool:
    """Wait until the loop has published a status with no request and no KV held but
    by idle sessions.  Returns as soon as it has; the bound is generous because the
    last step in flight may take seconds under Triton's interpreter on a busy CPU
    (measured 10 s for a page-16 EAGLE-3 tree verify of four requests on 2 cores)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = engine.status()
        if st.running == st.queued == 0 and st.kv_used_tokens == st.session_kv_tokens:
            return True
        time.sleep(0.02)
    return False


def demo_prompts(n=4, length=48):
    """Python source like the demo's training text (the shipped draft accepts a lot on it)."""
    import inspect
    import json.decoder

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO_MODELS / "demo-target" / "tokenizer.json"))
    ids = tok.encode(inspect.getsource(json.decoder)).ids
    return [ids[i * 97 : i * 97 + length] for i in range(n)]


def plain_reference(target, prompts, max_tokens: int) -> list[list[int]]:
    """``target``'s plain greedy outputs for ``prompts``, checked against transformers'
    (the reference a speculative engine must equal)."""
    engine = start_engine(target, kvCache={"pageSize": 1})
    try:
        outputs = [r[0] for r in run_all(engine, prompts, max_tokens=max_tokens, ignore_eos=True)]
    finally:
        engine.shutdown()
    assert outputs == hf_greedy(target, prompts, max_tokens)
    return outputs


def demo_reference(n: int, length: int, max_tokens: int) -> tuple[list, list]:
    """``demo_prompts(n, length)`` and the demo target's ``plain_reference``."""
    prompts = demo_prompts(n, length)
    return prompts, plain_reference(str(DEMO_MODELS / "demo-target"), prompts, max_tokens)


def ragged_demo_prompts(lengths=(5, 48, 17, 33, 9, 40)):
    """``demo_prompts`` cut to ``lengths``: in-domain text that ends inside and on the
    edges of 4- and 16-token pages."""
    return [p[:n] for p, n in zip(demo_prompts(len(lengths)), lengths, strict=True)]


def hf_greedy(model_path, prompts, max_new_tokens):
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


def random_prompts(n, vocab, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def check_leak_free(engine: Engine) -> None:
    """The engine went idle healthy, and its strict leak checks ran and never failed."""
    assert wait_idle(engine)
    assert engine.status().healthy, engine.status().last_error
    assert metric_value(engine, "specd_leak_checks_total", result="ok") > 0
    assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0


def metric_value(engine: Engine, name: str, **labels: str) -> float:
    """Sum of the engine's samples of ``name`` whose labels include ``labels``."""
    return metric_in_text(engine.metrics_text().decode(), name, **labels)


def metric_in_text(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in the exposition ``text`` whose labels include
    ``labels``; KeyError when there is none."""
    found, total = False, 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                found, total = True, total + sample.value
    if not found:
        raise KeyError(f"{name} {labels}")
    return total


def check_outputs(prompts, outputs, expected, judge=None) -> None:
    """``outputs == expected``, or with a ``GreedyJudge`` equal up to its near ties."""
    if judge is None:
        assert outputs == expected
    else:
        judge.check_close(prompts, outputs, expected)


def check_small_pool_run(engine: Engine, prompts, expected, max_tokens: int) -> None:
    """Run ``prompts`` on an engine whose KV pool is too small for all of them at once:
    outputs must equal ``expected``, a retraction must have happened, and the engine
    must go back to idle with no KV held.  Shuts the engine down."""
    try:
        results = run_all(engine, prompts, max_tokens=max_tokens, ignore_eos=True)
        assert [r[0] for r in results] == expected
        assert metric_value(engine, "specd_retractions_total") > 0
        assert wait_idle(engine)
    finally:
        engine.shutdown()


def check_exact_run(engine: Engine, prompts, expected, max_tokens: int, judge=None):
    """Batch 1, then every prompt concurrently: greedy outputs equal ``expected`` (with a
    ``GreedyJudge``: up to its near ties), every request ends on its length, the engine
    stays healthy and goes back to idle with no KV held.  Shuts the engine down; returns
    the concurrent run's results."""
    try:
        single = run_all(engine, prompts[:1], max_tokens=max_tokens, ignore_eos=True)
        check_outputs(prompts[:1], [single[0][0]], expected[:1], judge)
        results = run_all(engine, prompts, max_tokens=max_tokens, ignore_eos=True)
        check_outputs(prompts, [r[0] for r in results], expected, judge)
        assert all(r[2].finish_reason is FinishReason.LENGTH for r in results)
        assert wait_idle(engine)
        assert engine.status().healthy, engine.status().last_error
    finally:
        engine.shutdown()
    assert request_held_tokens(engine) == 0
    engine.kv.check_integrity()
    return results


def check_token_sources(engine: Engine, results, max_tokens: int, overshoot: int = 0) -> None:
    """Every request of a concurrent speculative run verified, and after its first token
    each token came from a verify (accepted or bonus) or from a plain decode in a prefill
    step of another request (``specd_spec_prefill_step_decodes_total``).  A request's
    last verify may accept drafts past ``max_tokens`` (counted, not kept): up to
    ``overshoot`` per request."""
    usages = [r[2].usage for r in results]
    assert all(u.spec_verify_steps > 0 for u in usages), usages
    decoded = metric_value(engine, "specd_spec_prefill_step_decodes_total")
    verified = sum(u.spec_verify_steps + u.spec_accepted_tokens for u in usages)
    extra = verified + decoded - len(usages) * (max_tokens - 1)
    assert 0 <= extra <= overshoot * len(usages), (verified, decoded)


def sampled_continuations(
    engine: Engine, prompt, n: int, first_seed: int, count: int = 3
) -> list[tuple]:
    """Generated tokens 2..``count`` of ``n`` samples of ``prompt`` at temperature 1
    (token 1 comes from prefill; the rest from verify steps).  Sample ``i`` is seeded
    ``first_seed + i``, so a run draws the same tokens each time: a law test cannot
    fail by chance on one machine and pass on the next.  Give each run its own range."""
    seeds = range(first_seed, first_seed + n)
    law = {"max_tokens": count, "temperature": 1.0, "ignore_eos": True}
    results = run_all(engine, [prompt] * n, seeds=seeds, **law)
    return [tuple(r[0][1:]) for r in results]


def check_same_marginals(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> None:
    """Two runs' sampled tokens (one tuple of positions per sample) follow the same law at
    each position: chi-square on a contingency table, tokens seen under 10 times pooled."""
    from scipy.stats import chi2_contingency

    for position in range(len(a[0])):
        xs, ys = [t[position] for t in a], [t[position] for t in b]
        common = [v for v in sorted(set(xs + ys)) if xs.count(v) + ys.count(v) >= 10]
        table = [[s.count(v) for v in common] + [sum(v not in common for v in s)] for s in (xs, ys)]
        assert len(common) >= 3, "the target should be spread over several tokens"
        assert chi2_contingency(table).pvalue > 0.001, (position, table)


def request_held_tokens(engine: Engine) -> int:
    """KV slots in use that the prefix cache does not hold (0 once every request is
    done), with no cached page still borrowed."""
    cache = engine.kv.cache
    if cache is None:
        return engine.allocator.used_tokens
    assert cache.num_locked_pages == 0, "prefix-cache pages borrowed after the run"
    return engine.allocator.used_tokens - cache.num_pages * engine.allocator.page_size


@dataclasses.dataclass(frozen=True)
class Reference:
    """Prompts, the torch backend's greedy outputs of ``max_new`` tokens for them, and the
    judge other runs are held to (None: token for token)."""

    prompts: list[list[int]]
    outputs: list[list[int]]
    max_new: int
    judge: GreedyJudge | None = None

    @classmethod
    def run(cls, target, prompts, max_new, judge=None, **extra) -> Reference:
        """All ``prompts`` at once on the torch backend, page size 1 (``extra``: more
        spec fields, e.g. ``device`` and ``model``)."""
        engine = start_engine(target, kvCache={"pageSize": 1}, attentionBackend="torch", **extra)
        try:
            results = run_all(engine, prompts, max_tokens=max_new, ignore_eos=True)
        finally:
            engine.shutdown()
        outputs = [r[0] for r in results]
        short = [i for i, out in enumerate(outputs) if len(out) != max_new]
        if short:
            raise RuntimeError(f"reference run failed: prompts {short} got fewer than "
                               f"{max_new} tokens (see the engine's log)")  # fmt: skip
        return cls(prompts, outputs, max_new, judge)

    def first(self, n: int) -> Reference:
        return dataclasses.replace(self, prompts=self.prompts[:n], outputs=self.outputs[:n])

    def check_run(self, engine):
        """``check_exact_run`` of these prompts on ``engine`` (shut down after)."""
        return check_exact_run(engine, self.prompts, self.outputs, self.max_new, self.judge)


def stalled_stream(url: str, path: str, body: dict) -> socket.socket:
    """POST ``body`` to ``url`` + ``path`` on a socket with a small receive buffer that
    nobody reads: a client that stopped reading its stream (close it when done)."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.hostname, parts.port))
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock.sendall(head + data)
    return sock
