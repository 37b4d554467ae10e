"""The sharded model (tensor parallelism, ``model/parallel.py``) against tensor 1 and
transformers: real ranks in separate processes joined by gloo, float32, paged KV,
chunked prefill and greedy decode; each rank holds 1/N of the weights; bad tensor sizes
are refused naming ``spec.parallelism.tensor``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specd.devtools.testing import DEMO_EAGLE, DEMO_TARGET
from specd.devtools.tiny_draft import make_tiny_eagle, make_tiny_eagle3
from specd.devtools.tp_ranks import model_trace, run_on_ranks, stalled_collective
from specd.workers.cli import EXIT_INVALID, main
from specd.workers.config import spec_for_model
from specd.workers.engine.factory import auto_draft_dtype, draft_dtype
from specd.workers.model.config import ModelLoadError, load_model_config
from specd.workers.model.cpu_linear import native_bfloat16_matmuls
from specd.workers.model.llama import LlamaForCausalLM
from specd.workers.model.loader import load_model
from specd.workers.model.parallel import SINGLE_RANK, ShardPlan, TpGroup, TpShape

ATOL = 1e-4
STEPS = 6
# (variant, tensor size, page size): split KV heads at 2, replicated at 4 (2 KV heads)
# (15-30 s each on 2 cores: the default suite runs the first, CI's slow pass the rest)
CASES = [
    ("gqa", 2, 1),
    pytest.param("gqa", 4, 16, marks=pytest.mark.slow),
    pytest.param("tied", 2, 16, marks=pytest.mark.slow),
    pytest.param("bias", 2, 1, marks=pytest.mark.slow),  # Qwen2: q/k/v biases, cut by rows
    pytest.param("qwen3", 2, 16, marks=pytest.mark.slow),  # q/k norms on the rank's heads
    # every expert's columns cut, router replicated
    pytest.param("qwen3-moe", 2, 16, marks=pytest.mark.slow),
]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 4, 13)]


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize(("variant", "tensor", "page_size"), CASES)
def test_sharded_model_equals_tensor_1_and_transformers(tiny_models, variant, tensor, page_size):
    path = tiny_models(variant)
    prompts = _prompts(load_model_config(path).vocab_size)
    traces = run_on_ranks(tensor, model_trace, path, prompts, page_size, STEPS)
    (single,) = run_on_ranks(1, model_trace, path, prompts, page_size, STEPS)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for trace in traces:  # every rank holds the whole logits, the same on each
        assert trace.tokens == single.tokens
        for got, prompt in zip(trace.prefill, prompts, strict=True):
            torch.testing.assert_close(got, _hf_logits(hf, prompt), atol=ATOL, rtol=0)
        for step, got in enumerate(trace.decode):
            upto = [seq[: len(p) + step + 1] for seq, p in zip(trace.tokens, prompts, strict=True)]
            expected = torch.stack([_hf_logits(hf, seq)[-1] for seq in upto])
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(trace.decode[-1], traces[0].decode[-1], atol=0, rtol=0)
    for prompt, seq in zip(prompts, single.tokens, strict=True):
        greedy = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=STEPS)
        assert seq[len(prompt) :] == greedy[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_each_rank_holds_its_share_of_the_weights(tiny_models):
    """Resident weights per rank ~ 1/N of the model: all but the replicated norms."""
    path = tiny_models("gqa")
    prompts = _prompts(load_model_config(path).vocab_size)
    (single,) = run_on_ranks(1, model_trace, path, prompts, 1, 1)
    traces = run_on_ranks(2, model_trace, path, prompts, 1, 1)
    config = load_model_config(path)
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size * 4  # float32, replicated
    half = (single.weight_bytes - norms) / 2 + norms
    for trace in traces:  # within 0.1%: RoPE's small inverse-frequency buffer is replicated too
        assert abs(trace.weight_bytes - half) < 0.001 * single.weight_bytes


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory):
    target = tiny_models("gqa")
    return {
        "EAGLE": make_tiny_eagle(tmp_path_factory.mktemp("eagle"), target),
        # a draft vocabulary that 2 ranks split unevenly is padded, then trimmed
        "EAGLE3": make_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, draft_vocab_size=97),
    }


@pytest.mark.parametrize("algorithm", [pytest.param("EAGLE", marks=pytest.mark.slow), "EAGLE3"])
def test_sharded_draft_head_equals_tensor_1(tiny_models, drafts, algorithm):
    path = tiny_models("gqa")
    prompts = _prompts(load_model_config(path).vocab_size)
    draft = (algorithm, str(drafts[algorithm]))
    (single,) = run_on_ranks(1, model_trace, path, prompts, 16, 1, draft)
    for trace in run_on_ranks(2, model_trace, path, prompts, 16, 1, draft):
        assert trace.draft.shape == single.draft.shape
        torch.testing.assert_close(trace.draft, single.draft, atol=ATOL, rtol=0)
        assert trace.weight_bytes < 0.6 * single.weight_bytes


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (8, "spec.parallelism.tensor 8 does not divide the model's attention heads"),
        (
            4,
            "spec.parallelism.tensor 4 neither divides the model's 3 KV heads nor is a multiple",
        ),
    ],
)
def test_a_tensor_size_that_does_not_split_the_model_is_refused(tiny_models, tensor, message):
    config = load_model_config(tiny_models("gqa"))
    if tensor == 4:
        config = dataclasses.replace(config, num_key_value_heads=3)
    with pytest.raises(ModelLoadError, match=message.replace(".", r"\.")):
        TpShape.of(config, tensor)


def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused_before_it_is_cut(tiny_models):
    path = tiny_models("gqa")
    config = load_model_config(path)
    with torch.device("meta"):
        full = LlamaForCausalLM(config)
        local = LlamaForCausalLM(config, TpGroup(1, 2))
    plan = ShardPlan.between(full, local, TpGroup(1, 2), kv_replicas=1)
    name = "model.layers.0.self_attn.q_proj.weight"
    wrong = torch.zeros(config.hidden_size * 2, config.hidden_size)
    with pytest.raises(ModelLoadError, match=f"tensor {name} has shape"):
        plan.take(name, wrong)
    right = torch.arange(config.hidden_size**2, dtype=torch.float32).view(config.hidden_size, -1)
    half = config.hidden_size // 2
    assert torch.equal(plan.take(name, right), right[half:])
    bias = "model.layers.0.self_attn.o_proj.bias"  # not in this model: comes whole
    assert torch.equal(plan.take(bias, torch.ones(3)), torch.zeros(3))  # rank 1 adds none


def test_tensor_1_is_the_single_device_model(tiny_models):
    model, _ = load_model(tiny_models("gqa"), dtype="float32", tp=SINGLE_RANK)
    assert model.tp.size == 1
    assert model.model.embed_tokens.num_embeddings == model.config.vocab_size


@pytest.mark.parametrize(
    ("tensor", "draft", "message"),
    [
        (8, False, "spec.parallelism.tensor 8 does not divide the model's attention heads"),
        (4, True, "spec.parallelism.tensor 4 does not divide the draft's MLP intermediate size"),
    ],
)
def test_validate_names_the_tensor_size_a_model_or_draft_refuses(
    tiny_models, tmp_path, capsys, tensor, draft, message
):
    """`specd validate` reads the folders' config.json: widths that do not split name
    the field."""
    spec: dict = {"model": {"path": tiny_models("gqa")}, "parallelism": {"tensor": tensor}}
    if draft:  # the target splits 4 ways; a draft MLP of 130 columns does not
        folder = make_tiny_eagle3(tmp_path / "d", tiny_models("gqa"))
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 130}))
        spec |= {"draft": {"path": str(folder), "algorithm": "EAGLE3"}, "speculative": {}}
    file = tmp_path / "spec.yaml"
    head = {"apiVersion": "specd.dev/v1alpha1", "kind": "SpecDecodeDeployment"}
    file.write_text(json.dumps(head | {"metadata": {"name": "tp"}, "spec": spec}))
    assert main(["validate", str(file)]) == EXIT_INVALID
    assert message in capsys.readouterr().err


def test_validate_accepts_a_tensor_size_that_splits_model_and_draft(tiny_models, tmp_path, capsys):
    folder = make_tiny_eagle3(tmp_path / "d", tiny_models("gqa"))
    spec = {
        "model": {"path": tiny_models("gqa")},
        "draft": {"path": str(folder), "algorithm": "EAGLE3"},
        "speculative": {},
        "parallelism": {"tensor": 2},
    }
    file = tmp_path / "spec.yaml"
    head = {"apiVersion": "specd.dev/v1alpha1", "kind": "SpecDecodeDeployment"}
    file.write_text(json.dumps(head | {"metadata": {"name": "tp"}, "spec": spec}))
    assert main(["validate", str(file)]) == 0, capsys.readouterr().err


@pytest.mark.slow
def test_a_group_formed_with_a_long_timeout_then_fails_a_stalled_call_after_its_own():
    """A group formed with a 120 s timeout (a replica's ranks meet and load with a long
    one; one rank joins 5 s late) set to 2 s: a collective the last rank stalls fails
    on rank 0 after about 2 s."""
    (waited, error), _ = run_on_ranks(2, stalled_collective, 2.0, 8.0, late_s=5)
    assert error and 1.5 < waited < 6, (waited, error)


def _agreed_draft_dtypes(tp: TpGroup, native_by_rank: list[list[bool]]) -> list:
    """Per case, this rank's vote on native bfloat16 -> (the group's answer, the auto
    draft dtype beside a float32 target); then ``draft_dtype`` of the demo pair on this
    CPU, asked over the group."""
    cpu = torch.device("cpu")
    votes = [tp.all_agree(case[tp.rank]) for case in native_by_rank]
    chosen = [(vote, auto_draft_dtype(torch.float32, cpu, vote)) for vote in votes]
    spec = spec_for_model(DEMO_TARGET, draft={"path": DEMO_EAGLE}, speculative={})
    return [*chosen, draft_dtype(spec, cpu, torch.float32, tp)]


def test_the_ranks_of_a_replica_agree_on_the_auto_draft_dtype():
    """``spec.draft.dtype: auto`` over two ranks whose CPUs differ: bfloat16 only where
    every rank multiplies bfloat16 natively, so no rank loads shards of another dtype
    than the others'."""
    cases = [[True, False], [False, True], [True, True], [False, False]]
    per_rank = run_on_ranks(2, _agreed_draft_dtypes, cases)
    assert per_rank[0] == per_rank[1]
    *chosen, here = per_rank[0]
    assert chosen == [(False, "auto"), (False, "auto"), (True, "bfloat16"), (False, "auto")]
    assert here == ("bfloat16" if native_bfloat16_matmuls() else "auto")
