"""The benchmark-only null model (``BenchKnobs.null_model``, ``model/null_model.py``): its
fixed successor rule through a real engine (eager and under emulated decode graphs) and
through ``specd serve`` with ``SPECD_BENCH_KNOBS``; the variable's parsing; the refusal
of a draft."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from specd.devtools.testing import check_leak_free, run_all, specd_serve
from specd.devtools.tiny_draft import make_tiny_eagle
from specd.workers.bench_knobs import ENV_VAR, BenchKnobs, BenchKnobsError
from specd.workers.config import ConfigError, spec_for_model
from specd.workers.engine.engine import Engine
from specd.workers.model.null_model import NullCausalLM, successor_table

NULL = BenchKnobs(null_model=True)
MAX_TOKENS = 12
# last prompt ids: a plain one, one near the vocabulary's end (384: the chain wraps), and
# special ids (BOS 0, EOS 1), which the chain steps over like any avoided id
PROMPTS = [[0, 10, 20], [0, 50, 379], [7, 0], [1]]


def expected_chain(last: int, n: int, vocab: int, avoid: set[int]) -> list[int]:
    """The rule written out: each token is the next id above the previous one, wrapping,
    skipping avoided ids."""
    out, token = [], last
    for _ in range(n):
        token = (token + 1) % vocab
        while token in avoid:
            token = (token + 1) % vocab
        out.append(token)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("gqa")


@pytest.fixture(scope="module")
def avoided(tiny) -> set[int]:
    """The tiny tokenizer's special ids: BOS 0, EOS 1, pad 2 and its three chat markers."""
    tok = AutoTokenizer.from_pretrained(tiny)
    return set(tok.all_special_ids) | {tok.eos_token_id, tok.bos_token_id}


def start_null_engine(model_path: str, **overrides) -> Engine:
    spec = spec_for_model(
        model_path, model={"dtype": "float32"}, debug={"strictMemCheck": 1}, **overrides
    )
    engine = Engine(spec, knobs=NULL)
    engine.start()
    return engine


def test_successor_table_steps_over_avoided_ids_and_wraps():
    assert successor_table(8, {0, 1, 2}).tolist() == [3, 3, 3, 4, 5, 6, 7, 3]
    with pytest.raises(ValueError, match="every id"):
        successor_table(3, {0, 1, 2})


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_engine_generates_the_successor_chain_leak_free(tiny, avoided, temperature):
    """Every prompt's output is the chain from its last id, also when sampled (the chosen
    logit's margin leaves nothing else to sample); nothing leaks."""
    engine = start_null_engine(tiny)
    try:
        assert isinstance(engine.model, NullCausalLM)
        vocab = engine.model_config.vocab_size
        outs = run_all(engine, PROMPTS, max_tokens=MAX_TOKENS, temperature=temperature, seed=3)
        for prompt, (tokens, text, last) in zip(PROMPTS, outs, strict=True):
            assert tokens == expected_chain(prompt[-1], MAX_TOKENS, vocab, avoided)
            assert last.finish_reason.value == "length" and text
        check_leak_free(engine)
    finally:
        engine.shutdown()


def test_decode_graphs_replay_the_same_chain(tiny, avoided):
    """The body is graph-safe: under emulated decode graphs (Triton backend in the
    interpreter, as the CUDA tests run on CPU) decode steps replay and give the chain."""
    engine = start_null_engine(
        tiny, attentionBackend="triton", cudaGraph={"enabled": True, "maxBatchSize": 4}
    )
    try:
        assert engine.graphs is not None and engine.graphs.mode == "emulated"
        outs = run_all(engine, PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
        vocab = engine.model_config.vocab_size
        for prompt, (tokens, _, _) in zip(PROMPTS, outs, strict=True):
            assert tokens == expected_chain(prompt[-1], MAX_TOKENS, vocab, avoided)
        assert engine.graphs.replays > 0
        check_leak_free(engine)
    finally:
        engine.shutdown()


def test_a_draft_is_refused(tiny, tmp_path):
    draft = make_tiny_eagle(tmp_path / "eagle", tiny)
    spec = spec_for_model(
        tiny,
        model={"dtype": "float32"},
        draft={"path": str(draft)},
        speculative={"numSteps": 2, "topk": 1, "numDraftTokens": 3},
    )
    with pytest.raises(ConfigError, match=r"null_model .* drop spec\.draft"):
        Engine(spec, knobs=NULL).start()


# -- SPECD_BENCH_KNOBS ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "knobs"),
    [
        (None, BenchKnobs()),
        ("", BenchKnobs()),
        ('{"null_model": true}', NULL),
        ('{"force_accept_len": 2, "dummy_weights": true}', BenchKnobs(True, 2.0)),
    ],
    ids=["unset", "empty", "null-model", "int-for-float"],
)
def test_from_env_reads_the_variable(monkeypatch, value, knobs):
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)
    assert BenchKnobs.from_env() == knobs


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{null_model: true}", "is not JSON"),
        ('["null_model"]', "must be a JSON object"),
        ('{"null_modle": true}', "unknown field 'null_modle'"),
        ('{"null_model": "yes"}', "field 'null_model' must be bool"),
        ('{"force_accept_len": -1}', "force_accept_len -1.0 must be a finite number >= 1"),
        ('{"force_accept_len": NaN}', "force_accept_len nan must be"),
        ('{"force_accept_len": 1e309}', "force_accept_len inf must be"),
    ],
    ids=["bad-json", "not-an-object", "unknown-field", "wrong-type", "below-1", "nan", "inf"],
)
def test_from_env_refuses_naming_the_variable_and_the_known_fields(monkeypatch, value, message):
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(BenchKnobsError) as refused:
        BenchKnobs.from_env()
    text = str(refused.value)
    assert text.startswith(ENV_VAR) and message in text
    assert "known fields: dummy_weights, force_accept_len" in text and "null_model" in text


# -- served --------------------------------------------------------------------------------


@pytest.mark.slow
def test_served_engine_takes_the_knobs_from_the_environment(tiny, avoided, tmp_path):
    """``specd serve`` with ``SPECD_BENCH_KNOBS`` set: the engine actor (a Ray worker of
    the server's local Ray) serves the null model."""
    spec_file = tmp_path / "null.yaml"
    spec_file.write_text(
        "apiVersion: specd.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: nulled}\n"
        f"spec:\n  model: {{path: {tiny}, name: tiny, dtype: float32}}\n  replicas: 1\n"
        "  resources: {cpu: 1}\n"
    )
    env = {ENV_VAR: '{"null_model": true}'}
    with specd_serve(spec_file, "nulled", tmp_path / "state", env=env) as served:
        body = {"model": "tiny", "prompt": [0, 10, 20], "max_tokens": MAX_TOKENS}
        r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(tiny)
    chain = expected_chain(20, MAX_TOKENS, len(tok), avoided)
    assert r.json()["choices"][0]["text"] == tok.decode(chain)
