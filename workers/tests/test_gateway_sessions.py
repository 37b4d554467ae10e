"""Streaming sessions through the gateway, over real HTTP and a real local Ray.

Two engine replicas of a tiny checkpoint with a tiny EAGLE draft (tree drafting,
overlap scheduling, priority policy), strict busy memory checks and sessions on.  Turns are checked
against plain (session-less) generation over the whole token history, which greedy
speculative decoding must reproduce exactly.  Every test closes its sessions: the load
test ends by asserting that no replica holds KV or an open session.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import httpx
import pytest
import ray

from specd.devtools.testing import in_loop, running_gateway
from specd.devtools.tiny_checkpoint import make_tiny_checkpoint
from specd.devtools.tiny_draft import make_tiny_eagle
from specd.workers.config import spec_for_model
from specd.workers.gateway.api_keys import ApiKeys, key_id
from specd.workers.gateway.ownership import Owners
from specd.workers.model.tokenizer import apply_chat_template, load_tokenizer
from specd.workers.pool.session_directory import SessionDirectory
from specd.workers.types import GenerateRequest, SamplingParams

MODEL = "tiny"
CONTEXT = 1024
NAMESPACE = "specd-test-sessions"
MAX_NEW = 12
PAGE = 4
TURN = {"temperature": 0, "ignore_eos": True, "max_tokens": MAX_NEW}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("gws-tiny")
    return str(make_tiny_checkpoint(folder, max_position_embeddings=CONTEXT))


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def gateway(serve_gateway, model_dir, tmp_path_factory):
    draft = make_tiny_eagle(tmp_path_factory.mktemp("gws-draft"), model_dir)
    spec = spec_for_model(
        model_dir,
        replicas=2,
        model={"name": MODEL},
        resources={"cpu": 0.5},
        draft={"path": str(draft)},
        speculative={"numSteps": 2, "topk": 2, "numDraftTokens": 4},
        kvCache={"pageSize": PAGE, "maxTokens": 16384},
        scheduler={"overlap": True, "policy": "priority"},
        sessions={"enabled": True},
        debug={"strictMemCheck": 1},
    )
    return serve_gateway(spec, "gwsess")


@pytest.fixture()
async def client(gateway):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as c:
        yield c


# -- helpers ------------------------------------------------------------------------


async def open_session(client: httpx.AsyncClient) -> str:
    r = await client.post("/v1/sessions")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "session" and body["replica"]
    return body["id"]


async def close_session(client: httpx.AsyncClient, sid: str) -> None:
    r = await client.delete(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    assert r.json() == {"id": sid, "object": "session", "deleted": True}


def body_of(path: str, prompt, sid: str | None, **extra) -> dict:
    key = "prompt" if path == CMPL else "messages"
    body = {"model": MODEL, key: prompt, **TURN, **extra}
    return body if sid is None else {**body, "session_id": sid}


async def turn(client, sid, prompt, path=CMPL, **extra) -> httpx.Response:
    return await client.post(path, json=body_of(path, prompt, sid, **extra))


def text_of(response: dict) -> str:
    choice = response["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


async def streamed_turn(client, sid, prompt, path=CMPL) -> tuple[str, dict]:
    """A streamed turn with ``include_usage``: its text and the final usage."""
    body = body_of(path, prompt, sid, stream=True, stream_options={"include_usage": True})
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(
        c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
        for c in chunks
        if c["choices"]
    )
    return text, chunks[-1]["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


async def plain_generation(
    gateway, ids: list[int], beside: str | None = None
) -> tuple[list[int], str]:
    """Greedy output over ``ids`` with no session, straight from a replica (token ids
    are not in HTTP responses, and the next turn's history needs them): the replica
    holding session ``beside`` if given, else the least loaded."""

    async def go():
        req = GenerateRequest(
            f"ref-{uuid.uuid4().hex}",
            tuple(ids),
            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True),
        )
        pool = gateway.pool
        replica = pool.pick() if beside is None else pool.serving_actor(beside.split(".")[0])
        deltas = [d async for d in pool.stream(replica, req)]
        assert deltas[-1].error is None, deltas[-1]
        return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(go(), gateway.loop))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(r: httpx.Response, status: int, *needles: str, param: str | None = None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["param"] == param, error
    for needle in needles:
        assert needle in error["message"], error


# -- behaviour ------------------------------------------------------------------------


async def test_turns_reuse_the_history_exactly(client, gateway):
    """Three turns: each reuses every earlier prompt and completion as cached KV and
    produces what plain generation over the whole history produces (run first on the
    session's replica, so the first turn borrows its prompt's whole page from the
    prefix cache); once deleted, the session answers 410."""
    sid = await open_session(client)
    history: list[int] = []
    for i, prompt in enumerate([[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]):
        ref_ids, ref_text = await plain_generation(gateway, history + prompt, beside=sid)
        if i == 1:
            text, usage = await streamed_turn(client, sid, prompt)
        else:
            r = await turn(client, sid, prompt, priority=i - 1)  # policy: priority
            assert r.status_code == 200, r.text
            text, usage = text_of(r.json()), r.json()["usage"]
        assert cached(usage) == (len(history) if i else PAGE), f"turn {i}"
        assert usage["prompt_tokens"] == len(history) + len(prompt)
        assert usage["completion_tokens"] == MAX_NEW
        assert text == ref_text, f"turn {i}"
        history += prompt + ref_ids

    await close_session(client, sid)
    assert_error(await turn(client, sid, [5]), 410, sid, "closed", param="session_id")
    assert_error(await client.delete(f"/v1/sessions/{sid}"), 410, sid)


async def test_first_turns_gather_where_their_prompt_is_cached(client, gateway):
    """Two sessions opened on different replicas whose first turns share a system prompt
    that a plain request left in one replica's prefix cache: both first turns run there
    (the other session moves before it), borrow the prompt's pages, and say what plain
    generation says; later turns reuse their whole history, also through a gateway that
    never saw the move (one that restarted)."""
    pool = gateway.pool
    rng = random.Random(23)
    system = [rng.randrange(3, 250) for _ in range(16 * PAGE)]
    warm = await turn(client, None, system + [7, 7], max_tokens=2)
    assert warm.status_code == 200, warm.text
    deadline = time.monotonic() + 30  # earlier tests' sessions closed: probes catch up
    while any(r.load.sessions_open for r in pool.ready()):
        assert time.monotonic() < deadline, [r.load for r in pool.ready()]
        await asyncio.sleep(0.1)
    opened = [(await client.post("/v1/sessions")).json() for _ in range(2)]
    assert len({o["replica"] for o in opened}) == 2, opened  # fewest sessions first
    moved_before = pool.session_directory.placements["moved"]
    histories = {}
    for i, session in enumerate(opened):
        prompt = system + [9, 10 + i]
        ref_ids, ref_text = await plain_generation(gateway, prompt)
        r = await turn(client, session["id"], prompt)
        assert r.status_code == 200, r.text
        assert text_of(r.json()) == ref_text
        assert cached(r.json()["usage"]) == len(system), f"session {i}"
        histories[session["id"]] = prompt + ref_ids
    homes = {pool.session_directory.home_of(o["id"].rpartition(".")[2]) for o in opened}
    assert len(homes) == 1, homes  # together
    assert pool.session_directory.placements["moved"] == moved_before + 1

    async def next_turn(sid: str, prompt: list[int]) -> None:
        ref_ids, ref_text = await plain_generation(gateway, histories[sid] + prompt)
        r = await turn(client, sid, prompt)
        assert r.status_code == 200, r.text
        assert text_of(r.json()) == ref_text
        assert cached(r.json()["usage"]) == len(histories[sid])
        histories[sid] += prompt + ref_ids

    for sid in histories:
        await next_turn(sid, [11, 12])
    in_loop(gateway, setattr, pool, "session_directory", SessionDirectory())  # a restarted gateway's
    for sid in histories:
        await next_turn(sid, [13])
        await close_session(client, sid)


async def test_a_full_replica_leaves_a_first_turn_where_it_was(client, gateway):
    """The replica caching a first turn's prompt holds ``maxSessions`` sessions: the
    session is offered there, refused, and stays where it opened, whose turn then
    prefills the whole prompt and says what plain generation says."""
    pool = gateway.pool
    rng = random.Random(29)
    system = [rng.randrange(3, 250) for _ in range(16 * PAGE)]
    assert (await turn(client, None, system + [7], max_tokens=2)).status_code == 200
    prompt = system + [8]
    cached_on = [r for r in pool.ready() if pool.first_turn_home(prompt, r) is None]
    assert len(cached_on) == 1, "the prefix is recorded on one replica"
    holder, other = cached_on[0], next(r for r in pool.ready() if r is not cached_on[0])
    fillers = {holder.name: [], other.name: []}
    while len(fillers[holder.name]) < pool.spec.sessions.max_sessions:  # fill ``holder``
        opened = (await client.post("/v1/sessions")).json()
        fillers[opened["replica"]].append(opened["id"])
    if len(fillers[other.name]) == pool.spec.sessions.max_sessions:
        await close_session(client, fillers[other.name].pop())
    opened = (await client.post("/v1/sessions")).json()
    assert opened["replica"] == other.name, opened
    mine = opened["id"]
    refused_before = pool.session_directory.placements["refused"]
    _, ref_text = await plain_generation(gateway, prompt)
    r = await turn(client, mine, prompt)
    assert r.status_code == 200, r.text
    assert text_of(r.json()) == ref_text
    assert pool.session_directory.placements["refused"] == refused_before + 1
    assert pool.session_directory.home_of(mine.rpartition(".")[2]) == other.actor_name
    for sid in [*fillers[holder.name], *fillers[other.name], mine]:
        await close_session(client, sid)


async def test_unknown_and_malformed_session_ids(client, gateway):
    live_actor = gateway.pool.ready()[0].actor_name
    unknown = f"{live_actor}.{'0' * 32}"
    assert_error(await turn(client, unknown, [5]), 404, unknown, param="session_id")
    assert_error(await client.delete(f"/v1/sessions/{unknown}"), 404, unknown)
    for bad in ["nope", "a b.c"]:
        assert_error(await turn(client, bad, [5]), 404, "no session", param="session_id")
    assert_error(await client.delete("/v1/sessions/nope"), 404, "no session")

    gone = "specd-gwsess-000000-r99.abc"
    assert_error(
        await turn(client, gone, [5]), 410, "replica r99, which is gone", param="session_id"
    )
    assert_error(await client.delete(f"/v1/sessions/{gone}"), 410, "replica r99")


async def test_concurrent_turns_on_one_session_conflict(client):
    sid = await open_session(client)
    first, second = await asyncio.gather(
        turn(client, sid, [5, 6, 7], max_tokens=200), turn(client, sid, [8, 9], max_tokens=200)
    )
    [ok, conflict] = sorted([first, second], key=lambda r: r.status_code)
    assert ok.status_code == 200, ok.text
    assert_error(conflict, 409, sid, "in flight", param="session_id")

    usage = ok.json()["usage"]
    r = await turn(client, sid, [10])
    assert r.status_code == 200, r.text
    assert cached(r.json()["usage"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    await close_session(client, sid)


async def test_delete_aborts_the_turn_in_flight(client):
    """DELETE during a streamed turn: 200 at once, the turn ends with a 410 error event."""
    sid = await open_session(client)
    body = body_of(CMPL, [5, 6, 7], sid, max_tokens=CONTEXT - 16, stream=True)
    async with client.stream("POST", CMPL, json=body) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        await close_session(client, sid)
        events = [line[6:] async for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 410 and sid in error["message"] and error["param"] == "session_id"
    assert_error(await turn(client, sid, [5]), 410, sid, param="session_id")


async def test_chat_turns_render_only_the_new_messages(client, gateway, model_dir):
    """A chat turn is the template over its new messages; the first keeps its BOS, the
    engine drops the BOS of later turns (a second BOS mid-context)."""
    tok = load_tokenizer(model_dir)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    second = [{"role": "user", "content": "And then?"}]
    first_ids = apply_chat_template(tok, first)
    assert first_ids[0] == tok.bos_token_id
    sid = await open_session(client)

    r = await turn(client, sid, first, CHAT)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(first_ids) and cached(usage) == 0
    _, ref_text = await plain_generation(gateway, first_ids)
    assert text_of(r.json()) == ref_text

    text, usage2 = await streamed_turn(client, sid, second, CHAT)
    assert text
    assert cached(usage2) == usage["prompt_tokens"] + usage["completion_tokens"]
    new_tokens = len(apply_chat_template(tok, second)) - 1
    assert usage2["prompt_tokens"] == cached(usage2) + new_tokens
    await close_session(client, sid)


# -- load ----------------------------------------------------------------------------


class LoadRun:
    """Tallies of a load run: HTTP statuses of requests that ran to the end, and how
    many were aborted by the client on purpose."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.aborted = 0


async def abort_mid_stream(client, body: dict, path: str = CMPL) -> None:
    """Stream ``body`` and hang up after the first event."""
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break


async def session_conversation(client, run: LoadRun, rng: random.Random, turns: int) -> str:
    """Open a session and play ``turns`` turns, one of them aborted mid-stream; each
    completed turn must reuse exactly the history of the completed turns before it."""
    sid = await open_session(client)
    history = 0  # tokens of completed turns
    aborted_turn = rng.randrange(1, turns - 1)
    for i in range(turns):
        prompt = [rng.randrange(3, 70) for _ in range(rng.randint(2, 12))]
        if i == aborted_turn:
            await abort_mid_stream(client, body_of(CMPL, prompt, sid, max_tokens=400))
            run.aborted += 1
            continue
        # right after an aborted turn too: the gateway lands the abort first (no 409)
        r = await turn(client, sid, prompt)
        run.statuses.append(r.status_code)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert cached(usage) == history, (sid, i)
        history = usage["prompt_tokens"] + usage["completion_tokens"]
    return sid


async def plain_request(client, run: LoadRun, rng: random.Random, stream: bool) -> None:
    prompt = [rng.randrange(3, 70) for _ in range(rng.randint(2, 30))]
    body = body_of(CMPL, prompt, None, max_tokens=rng.randint(4, 24))
    if stream:
        async with client.stream("POST", CMPL, json={**body, "stream": True}) as r:
            await r.aread()
    else:
        r = await client.post(CMPL, json=body)
    run.statuses.append(r.status_code)


async def aborted_request(client, run: LoadRun, rng: random.Random) -> None:
    prompt = [rng.randrange(3, 70) for _ in range(rng.randint(2, 30))]
    await abort_mid_stream(client, body_of(CMPL, prompt, None, max_tokens=600))
    run.aborted += 1


async def quiet_replicas(client) -> list[dict]:
    """Replica loads from ``/admin/status`` once nothing runs (probes lag a little)."""
    deadline = time.monotonic() + 30
    while True:
        loads = [a["load"] for a in (await client.get("/admin/status")).json()["actors"]]
        idle = all(load["running"] == load["queued"] == load["inflight"] == 0 for load in loads)
        if (idle and all(load["kv_used_tokens"] == 0 for load in loads)) or (
            time.monotonic() > deadline
        ):
            return loads
        await asyncio.sleep(0.2)


async def test_load_mixed_sessions_plain_and_aborted(client, gateway):
    """Eight sessions x five turns (one aborted each), plain and client-aborted
    requests, all at once; afterwards every session is closed and no replica holds KV, an open
    session or a leak-check failure, and nothing that ran to its end got a 5xx."""
    rng = random.Random(7)
    run = LoadRun()
    started = time.monotonic()
    conversations = [session_conversation(client, run, rng, turns=5) for _ in range(8)]
    plain = [plain_request(client, run, rng, stream=i % 2 == 0) for i in range(24)]
    aborts = [aborted_request(client, run, rng) for _ in range(8)]
    results = await asyncio.gather(*conversations, *plain, *aborts)
    sids = results[: len(conversations)]
    for sid in sids:
        await close_session(client, sid)
    duration = time.monotonic() - started

    assert {sid.rpartition(".")[0] for sid in sids} == {r.actor_name for r in gateway.pool.ready()}
    assert [s for s in run.statuses if s >= 500] == []
    assert set(run.statuses) == {200}, run.statuses
    loads = await quiet_replicas(client)
    for load in loads:
        assert load["kv_used_tokens"] == 0 and load["sessions_open"] == 0, load
        assert load["leak_check_failures"] == 0 and load["healthy"], load
        assert load["speculation"]["verify_steps"] > 0, load  # the draft was in use
    served = len(run.statuses) + len(sids) * 2  # + one open and one close per session
    print(
        f"\nload: {served} requests served ({len(run.statuses)} generations, "
        f"{len(sids)} sessions opened and closed), {run.aborted} client-aborted, "
        f"in {duration:.1f}s"
    )


# -- replica loss (slow; last: it replaces a replica) ---------------------------------


@pytest.mark.slow
async def test_session_on_a_killed_replica_is_gone(client, gateway):
    r = await client.post("/v1/sessions")
    sid, replica = r.json()["id"], r.json()["replica"]
    assert (await turn(client, sid, [5, 6, 7])).status_code == 200
    ray.kill(ray.get_actor(sid.rpartition(".")[0], namespace=NAMESPACE))

    gone = await turn(client, sid, [8])
    needles = (sid, f"replica {replica}, which is gone", "open a new session")
    assert_error(gone, 410, *needles, param="session_id")
    assert_error(await client.delete(f"/v1/sessions/{sid}"), 410, f"replica {replica}")

    deadline = time.monotonic() + 90
    while not gateway.pool.converged() or replica in {r.name for r in gateway.pool.ready()}:
        assert time.monotonic() < deadline, "no replacement replica"
        await asyncio.sleep(0.2)
    fresh = await open_session(client)
    assert (await turn(client, fresh, [5])).status_code == 200
    await close_session(client, fresh)


async def test_a_turn_right_after_a_client_abort_is_not_refused(client):
    """A client that hangs up on a turn and sends the next one at once (a chat UI's
    "stop" then a new message) gets it served, not 409: the gateway lands the abort in
    the engine before forwarding the next turn of that session."""
    sid = await open_session(client)
    conflicts = 0
    for i in range(20):
        await abort_mid_stream(client, body_of(CMPL, [5 + i, 6, 7], sid, max_tokens=400))
        r = await turn(client, sid, [8, 9], max_tokens=4)
        conflicts += r.status_code == 409
        assert r.status_code in (200, 409), r.text
    assert conflicts == 0
    assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200


@pytest.mark.slow
async def test_sessions_survive_a_rolling_update(client, gateway):
    """A spec change rolls both replicas while one conversation goes on: each drained
    replica's idle sessions move with their KV, so no turn fails, every turn reuses its
    whole history, and idle sessions continue as plain generation over their history
    does.  A gateway that never saw the moves (one that restarted) finds the sessions by
    asking the replicas."""
    pool = gateway.pool
    idle = {await open_session(client): [] for _ in range(3)}
    talker, talked = await open_session(client), 0  # history length

    async def exact_turn(sid: str, prompt: list[int]) -> None:
        history = idle[sid]
        ref_ids, ref_text = await plain_generation(gateway, history + prompt)
        r = await turn(client, sid, prompt)
        assert r.status_code == 200, r.text
        assert text_of(r.json()) == ref_text and cached(r.json()["usage"]) == len(history)
        history += prompt + ref_ids

    async def talk(prompt: list[int]) -> int:
        r = await turn(client, talker, prompt, max_tokens=2)
        assert r.status_code == 200, r.text
        assert cached(r.json()["usage"]) == talked
        await asyncio.sleep(0.1)
        return r.json()["usage"]["total_tokens"]

    for sid in idle:
        await exact_turn(sid, [5, 6, 7])
    talked = await talk([5])
    before = pool.spec
    new = before.model_copy(update={"max_running_requests": before.max_running_requests - 1})
    in_loop(gateway, pool.update_spec, new)
    deadline = time.monotonic() + 120
    while not pool.converged():
        assert time.monotonic() < deadline, "the rolling update did not finish"
        talked = await talk([6, 7])
    assert {r.config_hash for r in pool.ready()} == {new.config_hash()}
    assert pool.session_directory.outcomes["ended"] == 0
    assert pool.session_directory.outcomes["kv"] >= len(idle)
    assert any(e.event == "sessions moved" for e in pool.events)
    for sid in idle:
        await exact_turn(sid, [8, 9])

    in_loop(gateway, setattr, pool, "session_directory", SessionDirectory())  # a restarted gateway's
    for sid in idle:
        await exact_turn(sid, [10])
    talked = await talk([11])
    for sid in [*idle, talker]:
        await close_session(client, sid)


async def test_a_session_belongs_to_the_api_key_that_opened_it(ray_cluster, model_dir):
    """With API keys a session is its opener's: another key's turns and close get the
    404 of an unknown id, and the opener goes on.  The owner travels sealed in the id, so
    the bare engine token is no id either, and a gateway restarted with the same admin
    token (the operator's Secret) still knows whose it is."""
    spec = spec_for_model(
        model_dir,
        replicas=1,
        model={"name": MODEL},
        resources={"cpu": 0.5},
        kvCache={"pageSize": PAGE},
        sessions={"enabled": True},
    )
    keys = ApiKeys(("key-a", "key-b"))
    with running_gateway(spec, "gwsesskeys", api_keys=keys, admin_token="adm1n") as gw:
        async with (
            httpx.AsyncClient(base_url=gw.url, timeout=120, headers=bearer("key-a")) as a,
            httpx.AsyncClient(base_url=gw.url, timeout=120, headers=bearer("key-b")) as b,
        ):
            sid = await open_session(a)
            token, _, _ = sid.rpartition("-")
            unknown = f"{token}-{'0' * 32}"  # a seal no key makes

            def seen(r: httpx.Response, session_id: str) -> tuple[int, dict]:
                return r.status_code, json.loads(r.text.replace(session_id, "<id>"))

            chat = [{"role": "user", "content": "Hi"}]
            for path, prompt in ((CMPL, [5, 6]), (CHAT, chat)):
                theirs = seen(await turn(b, sid, prompt, path), sid)
                assert theirs == seen(await turn(b, unknown, prompt, path), unknown)
                assert theirs[0] == 404 and theirs[1]["error"]["param"] == "session_id"
            closing = seen(await b.delete(f"/v1/sessions/{sid}"), sid)
            assert closing == seen(await b.delete(f"/v1/sessions/{unknown}"), unknown)
            assert closing[0] == 404 and "no session" in closing[1]["error"]["message"]
            assert_error(await turn(a, token, [5, 6]), 404, "no session", param="session_id")
            r = await turn(a, sid, [5, 6])
            assert r.status_code == 200, r.text
            restarted = Owners(keyed=True, admin_token="adm1n")
            assert restarted.unseal(sid, key_id("key-a")) == token
            assert restarted.unseal(sid, key_id("key-b")) is None
            assert Owners(keyed=True, admin_token="other").unseal(sid, key_id("key-a")) is None
            await close_session(a, sid)
