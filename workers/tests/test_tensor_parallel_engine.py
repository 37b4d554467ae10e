"""A tensor-parallel replica (issue 32): rank 0 runs the engine, the other ranks are Ray
actors that run each model call rank 0 broadcasts (``engine/rank_group.py``).

On CPU with gloo, float32: greedy output at tensor 2 equals transformers' (and so tensor
1's, which equals it in ``test_engine.py``), at page 1 and 16, batch 1 and 8, with
chunked prefill; the speculative matrix is lossless with strict leak checks; sessions
and the prefix cache reuse KV; through the gateway, killing one rank fails its replica's
requests, the pool replaces the whole group and the other replica keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
import ray
import torch
from transformers import AutoTokenizer

from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_TARGET,
    check_exact_run,
    check_leak_free,
    collect,
    demo_prompts,
    hf_greedy,
    metric_value,
    running_gateway,
    specd_serve,
    start_engine,
    start_spec_engine,
    wait_idle,
)
from specd.devtools.tiny_draft import make_tiny_eagle3
from specd.devtools.tp_ranks import run_on_ranks
from specd.kernels import build_attention_metadata
from specd.workers.config import spec_for_model
from specd.workers.engine.engine import Engine
from specd.workers.engine.rank_wire import ContextOnWire, KVMove, ModelCall, RankWire, Stop
from specd.workers.pool.rank_actor import start_ranks
from specd.workers.types import FinishReason

MAX_NEW = 12
TP2 = {"tensor": 2}


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=6, include_dashboard=False, namespace="specd-tp", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    """Eight demo prompts (40 tokens: chunked at 16) and transformers' greedy outputs."""
    prompts = demo_prompts(8, 40)
    return prompts, hf_greedy(DEMO_TARGET, prompts, MAX_NEW)


def _wire_round_trip(tp, every_tensor_apart: bool) -> list:
    """Rank 0 sends three records; every rank returns what it holds afterwards."""
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    meta = build_attention_metadata(table, [0, 1], [2, 1], [4, 3], torch.ones(11, dtype=torch.bool))
    records = [
        ModelCall("target", "forward_with_aux", (torch.arange(3), ContextOnWire(meta, torch.tensor([3, 4, 9]), "draft"), (1, 2)), {"x": 1.5}),
        KVMove("target", torch.tensor([5, 6]), torch.tensor([7, 8])),
        Stop(),
    ]  # fmt: skip
    separate = (lambda t: True) if every_tensor_apart else (lambda t: False)
    wire = RankWire(tp.group, tp.group, torch.device("cpu"), separate)
    if tp.rank == 0:
        for record in records:
            wire.send(record)
        return records
    return [wire.receive() for _ in records]


@pytest.mark.slow
@pytest.mark.parametrize("apart", [False, True], ids=["inline", "device-group"])
def test_records_cross_the_wire_whole(apart):
    """Every field of each record arrives, with its tensors inside the pickle (CPU) or
    broadcast after it on the device group (how CUDA tensors travel, run here on gloo)."""
    sent, received = run_on_ranks(2, _wire_round_trip, apart)
    assert [type(r) for r in received] == [ModelCall, KVMove, Stop]
    call, move = received[0], received[1]
    ids, ctx, layers = call.args
    assert torch.equal(ids, sent[0].args[0]) and layers == (1, 2) and call.kwargs == {"x": 1.5}
    assert ctx.pool == "draft" and torch.equal(ctx.out_cache_loc, sent[0].args[1].out_cache_loc)
    for field in ("qo_indptr", "kv_indptr", "kv_indices", "custom_mask"):
        assert torch.equal(getattr(ctx.attn_meta, field), getattr(sent[0].args[1].attn_meta, field))
    assert (ctx.attn_meta.qo_lens, ctx.attn_meta.kv_lens) == ((2, 1), (4, 3))
    assert torch.equal(move.src, sent[1].src) and torch.equal(move.dst, sent[1].dst)


@pytest.mark.parametrize("page", [1, pytest.param(16, marks=pytest.mark.slow)])
def test_tensor_2_greedy_equals_transformers(ray_cluster, reference, page):
    prompts, expected = reference
    engine = start_engine(
        DEMO_TARGET,
        parallelism=TP2,
        kvCache={"pageSize": page, "maxTokens": 4096},
        scheduler={"chunkedPrefillSize": 16},
        debug={"strictMemCheck": 1},
    )
    assert engine.ranks is not None and engine.graphs_off.startswith("spec.parallelism.tensor")
    assert engine.kv_pool.buffer.shape[3] == 2  # the demo's 4 KV heads, split over 2 ranks
    check_exact_run(engine, prompts, expected, MAX_NEW)  # batch 1, then all 8
    assert engine.ranks.error is None


SPEC_CASES = {
    "chain": pytest.param(dict(page_size=1, steps=3, topk=1), marks=pytest.mark.slow),
    "tree-page16-overlap": dict(page_size=16, steps=3, topk=2, overlap=True),
    "chain-overlap": pytest.param(
        dict(page_size=1, steps=3, topk=1, overlap=True), marks=pytest.mark.slow
    ),
    "tree-page1": pytest.param(dict(page_size=1, steps=2, topk=4), marks=pytest.mark.slow),
    "tree-page16": pytest.param(dict(page_size=16, steps=3, topk=4), marks=pytest.mark.slow),
    "tree-token-map-bf16-draft": pytest.param(  # the map's head replicated on both ranks
        dict(
            page_size=16,
            steps=3,
            topk=2,
            draft_fields={"tokenMap": f"{DEMO_EAGLE}/token_map.json", "dtype": "bfloat16"},
        ),
        marks=pytest.mark.slow,
    ),
}


@pytest.mark.parametrize("case", list(SPEC_CASES.values()), ids=list(SPEC_CASES))
def test_tensor_2_speculative_matrix_is_lossless(ray_cluster, reference, case):
    """The trained demo EAGLE head at tensor 2: outputs equal transformers', drafts are
    accepted, strict leak checks pass busy and idle."""
    prompts, expected = reference
    engine = start_spec_engine(DEMO_TARGET, DEMO_EAGLE, parallelism=TP2, **case)
    try:
        results = [r[0] for r in _run(engine, prompts)]
        assert results == expected
        assert metric_value(engine, "specd_spec_accepted_tokens_total") > 10
        check_leak_free(engine)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_tensor_2_eagle3_is_lossless(ray_cluster, reference, tmp_path):
    """An EAGLE-3 head (its own draft vocabulary, captured target layers) at tensor 2."""
    prompts, expected = reference
    eagle3 = make_tiny_eagle3(tmp_path / "eagle3", DEMO_TARGET)
    engine = start_spec_engine(
        DEMO_TARGET, str(eagle3), algorithm="EAGLE3", parallelism=TP2, page_size=16, topk=2
    )
    try:
        assert [r[0] for r in _run(engine, prompts)] == expected
        check_leak_free(engine)
    finally:
        engine.shutdown()


def _run(engine, prompts):
    async def go():
        return await asyncio.gather(
            *(
                collect(engine, f"r{i}", p, max_tokens=MAX_NEW, ignore_eos=True)
                for i, p in enumerate(prompts)
            )
        )

    return asyncio.run(go())


@pytest.mark.slow
def test_tensor_2_sessions_and_prefix_cache_reuse_kv(ray_cluster, reference):
    """A session's second turn reuses its history's KV; a repeated prompt's pages come
    from the prefix cache; a session that moves keeps its history (its KV, split over
    the ranks, stays); every turn gives transformers' tokens."""
    prompts, _ = reference
    engine = start_spec_engine(
        DEMO_TARGET,
        DEMO_EAGLE,
        parallelism=TP2,
        page_size=16,
        topk=2,
        sessions={"enabled": True},
    )
    first, second = prompts[0][:20], prompts[1][:12]
    try:
        sid = engine.open_session()

        async def turns():
            one = await collect(engine, "t0", first, sid, max_tokens=MAX_NEW, ignore_eos=True)
            two = await collect(engine, "t1", second, sid, max_tokens=MAX_NEW, ignore_eos=True)
            again = await collect(engine, "p", prompts[2], max_tokens=MAX_NEW, ignore_eos=True)
            repeat = await collect(engine, "q", prompts[2], max_tokens=MAX_NEW, ignore_eos=True)
            return one, two, again, repeat

        one, two, again, repeat = asyncio.run(turns())
        history = first + one[0] + second
        assert [one[0], two[0]] == [
            *hf_greedy(DEMO_TARGET, [first], MAX_NEW),
            *hf_greedy(DEMO_TARGET, [history], MAX_NEW),
        ]
        assert two[2].usage.cached_tokens == len(first) + MAX_NEW  # the session's KV
        assert again[0] == repeat[0] == hf_greedy(DEMO_TARGET, [prompts[2]], MAX_NEW)[0]
        assert repeat[2].usage.cached_tokens >= 32  # two 16-token pages from the cache

        async def move_and_continue():  # a drain's move, here out of and back into one replica
            snapshot = await engine.export_session(sid)
            arrived_with_kv = await engine.import_session(snapshot)
            three = await collect(engine, "t2", second, sid, max_tokens=MAX_NEW, ignore_eos=True)
            return snapshot, arrived_with_kv, three

        snapshot, arrived_with_kv, three = asyncio.run(move_and_continue())
        history += two[0]
        assert snapshot.kv == () and list(snapshot.history) == history  # split KV stays
        assert not arrived_with_kv
        assert three[0] == hf_greedy(DEMO_TARGET, [history + second], MAX_NEW)[0]
        engine.close_session(sid)
        assert wait_idle(engine)
        check_leak_free(engine)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_an_idle_group_outlives_its_timeout_and_a_stuck_rank_fails_it_in_time(
    ray_cluster, reference
):
    """collectiveTimeoutSeconds 3: an engine idle for twice that still serves (rank 0
    ticks); then rank 1 is stopped (SIGSTOP, alive but silent) and the next request
    ends with an error within seconds, the engine unhealthy, nothing hung."""
    prompts, expected = reference
    spec = spec_for_model(
        DEMO_TARGET,
        model={"dtype": "float32"},
        parallelism={"tensor": 2, "collectiveTimeoutSeconds": 3},
        kvCache={"pageSize": 16, "maxTokens": 4096},
    )
    ranks = start_ranks(spec)
    engine = Engine(spec, rendezvous=ranks.rendezvous)
    engine.start()
    rank1 = ray.get(ranks.actors[0].pid.remote())
    try:
        time.sleep(6)
        got = asyncio.run(collect(engine, "a", prompts[0], max_tokens=MAX_NEW, ignore_eos=True))
        assert got[0] == expected[0] and engine.healthy
        os.kill(rank1, signal.SIGSTOP)
        started = time.monotonic()
        tokens, _, last = asyncio.run(collect(engine, "b", prompts[1], max_tokens=MAX_NEW))
        waited = time.monotonic() - started
        print(f"stuck rank: the request failed after {waited:.1f} s: {last.error}")
        assert last.finish_reason is FinishReason.ERROR and waited < 20, (last, waited)
        assert "rank group broke" in last.error and not engine.healthy, last.error
    finally:
        os.kill(rank1, signal.SIGCONT)
        ranks.kill()
        engine.shutdown()


def _spec(replicas: int, **extra):
    return spec_for_model(
        DEMO_TARGET,
        name="tp",
        replicas=replicas,
        model={"name": "tp", "dtype": "float32"},
        parallelism=TP2,
        resources={"cpu": 0.5},
        kvCache={"pageSize": 16, "maxTokens": 4096},
        **extra,
    )


@pytest.mark.slow
def test_killing_a_rank_fails_its_replica_and_the_pool_replaces_the_group(ray_cluster):
    """Two tensor-2 replicas; one's rank 1 is killed while both stream: that replica's
    requests end with an error, the pool replaces its whole group (a new rank 0 and
    rank 1), and the other replica serves on untouched."""
    spec = _spec(
        2, draft={"path": DEMO_EAGLE}, speculative={"numSteps": 3, "topk": 1, "numDraftTokens": 4}
    )
    with running_gateway(spec, "tpkill", ready_timeout_s=180) as gw:
        victim, survivor = gw.pool.ready()
        table = ray.util.placement_group_table(
            ray.util.get_placement_group(f"{victim.actor_name}-ranks")
        )  # each replica reserves its ranks together, on one node
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2, table
        ends: list[str] = []
        started = threading.Barrier(7)

        def stream(prompt: list[int]) -> None:
            body = {"model": "tp", "prompt": prompt, "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=120) as r:
                lines = r.iter_lines()
                next(lines)
                started.wait(60)
                ends.append("\n".join(lines))

        threads = [threading.Thread(target=stream, args=(p,)) for p in demo_prompts(6, 24)]
        for i, t in enumerate(threads):  # one at a time: the router spreads them
            t.start()
            deadline = time.monotonic() + 30
            while victim.inflight + survivor.inflight <= i:
                assert time.monotonic() < deadline, "a stream did not start"
                time.sleep(0.01)
        started.wait(60)
        assert victim.inflight and survivor.inflight, "both replicas streaming"
        ray.kill(ray.get_actor(f"{victim.actor_name}-rank1"), no_restart=True)
        for t in threads:
            t.join(120)
        failed = [e for e in ends if '"error"' in e]
        finished = [e for e in ends if '"finish_reason":"length"' in e]
        assert failed and finished and len(failed) + len(finished) == 6, ends
        deadline = time.monotonic() + 120
        while not (gw.pool.converged() and victim not in gw.pool.ready()):
            assert time.monotonic() < deadline, "no replacement group"
            time.sleep(0.2)
        assert survivor in gw.pool.ready() and survivor.restarts == 0
        with pytest.raises(ValueError):  # the dead group's reservation went with it
            ray.util.get_placement_group(f"{victim.actor_name}-ranks")
        assert "rank group broke: rank 1 died" in (victim.error or ""), victim.error
        replacement = next(r for r in gw.pool.ready() if r is not survivor)
        assert ray.get_actor(f"{replacement.actor_name}-rank1")  # a new group, rank 1 too
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
        for _ in range(4):  # both replicas answer
            done = client.completions.create(model="tp", prompt="def f(x):", max_tokens=8)
            assert done.usage.completion_tokens == 8
        # rank 0 dies: Ray ends its children, so no rank of the group is left behind,
        # and the pool replaces the group again
        ray.kill(ray.get_actor(replacement.actor_name), no_restart=True)
        deadline = time.monotonic() + 120
        while _actor_exists(f"{replacement.actor_name}-rank1") or not (
            gw.pool.converged() and replacement not in gw.pool.ready()
        ):
            assert time.monotonic() < deadline, "rank 1 outlived its rank 0, or no new group"
            time.sleep(0.2)


def _actor_exists(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


@pytest.mark.slow
def test_specd_serve_runs_a_tensor_2_deployment(tmp_path):
    """``specd serve`` of a tensor-2 YAML, answered through the ``openai`` client with
    the tokens tensor 1 gives (transformers' greedy)."""
    prompt = demo_prompts(1, 24)[0]
    doc = {
        "apiVersion": "specd.dev/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": "tp2"},
        "spec": {
            "model": {"path": DEMO_TARGET, "name": "tp2", "dtype": "float32"},
            "draft": {"path": DEMO_EAGLE},
            "speculative": {"numSteps": 3, "topk": 2, "numDraftTokens": 4},
            "parallelism": TP2,
            "kvCache": {"pageSize": 16, "maxTokens": 4096},
        },
    }
    file = tmp_path / "tp2.yaml"
    file.write_text(json.dumps(doc))
    with specd_serve(file, "tp2", tmp_path / "state", ready_timeout_s=180) as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
        done = client.completions.create(
            model="tp2",
            prompt=prompt,
            max_tokens=MAX_NEW,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    expected = hf_greedy(DEMO_TARGET, [prompt], MAX_NEW)[0]
    assert done.usage.completion_tokens == MAX_NEW
    assert done.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
