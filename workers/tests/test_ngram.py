"""NGRAM drafting (prompt lookup): the proposer, its settings, and the engine with it:
lossless against plain decode over page size x topk x overlap with strict leak checks,
the sampling law unchanged, sessions and retraction exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specd.devtools.testing import (
    DEMO_TARGET,
    check_exact_run,
    check_same_marginals,
    check_small_pool_run,
    check_token_sources,
    demo_prompts,
    demo_reference,
    metric_value,
    run_all,
    sampled_continuations,
    start_engine,
)
from specd.workers.config import ConfigError, parse_deployment
from specd.workers.speculative.ngram import (
    NgramProposer,
    Proposal,
    ShadowDraft,
    TokenHistory,
    continuation_tree,
    match_continuations,
    padded_tree,
)
from specd.workers.speculative.tree import ragged_verify_mask, tree_attention_mask_for_verify
from specd.workers.speculative.verify import verify_greedy, verify_sampling

MAX_NEW = 24
STEPS = 4  # draft steps of the engines below


def continuations(tokens, min_match=1, max_match=4, length=3, limit=8):
    found = match_continuations(np.array(tokens), min_match, max_match, length, limit)
    return [c.tolist() for c in found]


def test_the_longest_match_comes_first_then_the_most_recent():
    # suffix "1 2 3": matched 3 long at index 0, 2 long ("2 3") at index 6, 1 long at 10
    tokens = [1, 2, 3, 7, 8, 9, 2, 3, 5, 6, 3, 4, 0, 1, 2, 3]
    assert continuations(tokens) == [[7, 8, 9], [5, 6, 3], [4, 0, 1]]
    assert continuations(tokens, limit=1) == [[7, 8, 9]]
    assert continuations(tokens, min_match=2) == [[7, 8, 9], [5, 6, 3]]
    assert continuations(tokens, min_match=4) == []  # no 4-token match
    # two equally long matches: the most recent first
    assert continuations([4, 1, 5, 4, 1, 6, 4, 1], min_match=2, length=1) == [[6], [5]]


def test_max_match_caps_the_match_length_it_ranks_by():
    tokens = [9, 1, 2, 8, 5, 1, 2, 7, 9, 1, 2]  # "9 1 2" at 0, "1 2" at 5
    assert continuations(tokens, max_match=3, length=1) == [[8], [7]]
    assert continuations(tokens, max_match=2, length=1) == [[7], [8]]  # tie: most recent


def test_no_match_and_short_histories_propose_nothing():
    assert continuations([1, 2, 3, 4]) == []
    assert continuations([5]) == []
    assert continuations([5, 5]) == [[5]]  # the one earlier 5 is followed by 5


def test_a_continuation_may_run_into_the_suffix_itself():
    # the two 2-long matches first (most recent first), then the 1-long one
    assert continuations([7, 7, 7, 7], max_match=2, length=3) == [[7], [7, 7], [7, 7, 7]]


def test_the_trie_keeps_topk_children_and_the_most_shared_nodes():
    conts = [np.array(c) for c in ([5, 6, 7], [5, 6, 8], [5, 9, 9], [4, 4, 4], [3, 3, 3])]
    proposal = continuation_tree(conts, topk=2, num_nodes=5)
    tokens, parents = proposal.tokens, proposal.parents
    # 5 (3 continuations), 6 (2), then one each: 4 (depth 1), 9 under 5 and 4 under 4
    # (depth 2, inserted in that order); [3, 3, 3] found the root full
    assert tokens == [5, 6, 4, 9, 4]
    assert parents == [-1, 0, -1, 0, 2]
    assert all(p < i for i, p in enumerate(parents))
    assert proposal.score == (3 + 2 + 1 + 1 + 1) / 5  # continuations through kept nodes
    chain = continuation_tree(conts, topk=1, num_nodes=3)
    assert (chain.tokens, chain.parents) == ([5, 6, 7], [-1, 0, 1])  # the first continuation


def test_the_proposer_pads_every_tree_to_its_size_under_the_root():
    proposer = NgramProposer(1, 4)
    histories = [TokenHistory([1, 2, 3, 1, 2]), TokenHistory([9, 8])]
    proposals = [proposer.propose(h, steps=3, topk=2, num_nodes=4) for h in histories]
    assert [p.tokens for p in proposals] == [[3, 1, 2], []]
    tree = padded_tree(proposals, [2, 8], steps=3, num_tokens=5, device="cpu")
    tree.check_invariants()
    assert tree.tokens.tolist() == [[2, 3, 1, 2, 2], [8, 8, 8, 8, 8]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 0], [-1, 0, 0, 0, 0]]
    assert tree.node_counts == (4, 1)


def test_padding_is_never_accepted_and_its_mask_is_cut_off():
    """A ragged tree's walks try each request's own nodes only, greedy and sampled, even
    where the target predicts the padding's token; its verify mask is the full mask's
    top-left block per request."""
    proposals = [Proposal([3, 1], [-1, 0]), Proposal([], [])]
    tree = padded_tree(proposals, [2, 8], steps=2, num_tokens=4, device="cpu")
    # the target says 3, then 2 (the padding's token), at every node of request 0; 8 at 1's
    argmax = torch.tensor([[3, 2, 2, 2], [8, 8, 8, 8]])
    greedy = verify_greedy(tree, argmax)
    assert greedy.accept_len.tolist() == [1, 0]
    assert greedy.accepted_tokens.tolist() == [[3, 2, -1], [8, -1, -1]]
    one_hot = torch.nn.functional.one_hot(argmax, 16).float()
    sampled = verify_sampling(tree, one_hot, torch.zeros(2, 5))
    assert sampled.accepted_tokens.tolist() == greedy.accepted_tokens.tolist()
    prefix = [5, 7]
    full = tree_attention_mask_for_verify(tree, prefix)
    blocks = full.split([4 * (p + 4) for p in prefix])
    expected = [
        b.view(4, p + 4)[:n, : p + n].flatten()
        for b, p, n in zip(blocks, prefix, (3, 1), strict=True)
    ]
    assert torch.equal(ragged_verify_mask(tree, prefix, tree.node_counts), torch.cat(expected))


def test_a_shadow_walk_accepts_what_a_greedy_verify_would():
    # tree: 5 -> 6 -> 7, and 5 -> 9; 4 under the root
    proposal = Proposal([5, 4, 6, 9, 7], [-1, -1, 0, 0, 2])
    walk = ShadowDraft.of(proposal, steps=3)
    assert [walk.follow(t) for t in (5, 6, 8)] == [None, None, 2]  # 8 is the bonus
    walk = ShadowDraft.of(proposal, steps=3)
    assert [walk.follow(t) for t in (5, 6, 7, 1)] == [None, None, None, 3]  # all, then bonus
    assert ShadowDraft.of(proposal, steps=3).follow(6) == 0  # 6 is no root child
    assert ShadowDraft.of(Proposal([], []), steps=3).follow(5) == 0  # nothing proposed


def test_the_history_grows_in_place():
    history, expected = TokenHistory([1, 2]), [1, 2]
    for i in range(200):
        history.extend((i, i + 1))
        expected += [i, i + 1]
    assert history.tokens.tolist() == expected


BASE = {"model": {"path": "/m"}, "speculative": {}}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"draft": {"algorithm": "NGRAM", "path": "/d"}}, "spec.draft.path: NGRAM drafts"),
        ({"draft": {"algorithm": "EAGLE"}}, "spec.draft.path: EAGLE drafts with a model"),
        (
            {"draft": {"path": "/d"}, "speculative": {"ngram": {"maxMatch": 4}}},
            "spec.speculative.ngram: set for spec.draft.algorithm EAGLE",
        ),
        (
            {
                "draft": {"algorithm": "NGRAM"},
                "speculative": {"ngram": {"minMatch": 5, "maxMatch": 2}},
            },
            "spec.speculative.ngram.minMatch: 5 exceeds maxMatch (2)",
        ),
        (
            {"draft": {"algorithm": "NGRAM"}, "speculative": {"ngram": {"maxMatch": 0}}},
            "spec.speculative.ngram.maxMatch",
        ),
    ],
)
def test_bad_ngram_settings_are_refused_naming_the_field(fields, message):
    doc = {
        "apiVersion": "specd.dev/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": "x"},
        "spec": {**BASE, **fields},
    }
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_deployment(doc)


def test_ngram_defaults_apply_when_left_out():
    doc = {
        "apiVersion": "specd.dev/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": "x"},
        "spec": {**BASE, "draft": {"algorithm": "NGRAM"}},
    }
    ngram = parse_deployment(doc).spec.ngram
    assert (ngram.min_match, ngram.max_match) == (1, 8)


def ngram_engine(page_size=1, topk=1, overlap=False, steps=STEPS, algorithm="NGRAM", **extra):
    """Draft-free drafting (NGRAM, or SUFFIX) on the demo target, always speculating,
    strict leak checks."""
    tokens = steps + 1 if topk == 1 else 2 * steps
    return start_engine(
        DEMO_TARGET,
        kvCache={"pageSize": page_size, "maxTokens": 4096, **extra.pop("kvCache", {})},
        scheduler={"chunkedPrefillSize": 16, "overlap": overlap, **extra.pop("scheduler", {})},
        draft={"algorithm": algorithm},
        speculative={
            "numSteps": steps,
            "topk": topk,
            "numDraftTokens": tokens,
            "policy": {"costModel": {"enabled": False}},
            **extra.pop("speculative", {}),
        },
        debug={"strictMemCheck": 1},
        **extra,
    )


@pytest.fixture(scope="module")
def reference():
    """Python-source prompts (which repeat themselves: prompt lookup finds matches) and
    their plain greedy outputs, checked against transformers."""
    return demo_reference(6, 48, MAX_NEW)


DRAFT_FREE = ["NGRAM", "SUFFIX"]


CORNERS = [(1, 1, False), (16, 4, True)]
MATRIX = [  # NGRAM's whole matrix by default; SUFFIX (the same path) at its corners, rest slow
    (algorithm, page, topk, overlap)
    if algorithm == "NGRAM" or (page, topk, overlap) in CORNERS
    else pytest.param(algorithm, page, topk, overlap, marks=pytest.mark.slow)
    for algorithm in DRAFT_FREE for page in (1, 16) for topk in (1, 4) for overlap in (False, True)
]  # fmt: skip


@pytest.mark.parametrize("algorithm, page_size, topk, overlap", MATRIX)
def test_draft_free_greedy_is_lossless(reference, algorithm, page_size, topk, overlap):
    """Requests with nothing to propose verify their roots alone beside the drafting
    ones.  SUFFIX: the batch-1 run's output is in the cache when the concurrent run starts."""
    prompts, expected = reference
    engine = ngram_engine(page_size, topk, overlap, algorithm=algorithm)
    results = check_exact_run(engine, prompts, expected, MAX_NEW)
    check_token_sources(engine, results, MAX_NEW, overshoot=STEPS)
    assert metric_value(engine, "specd_spec_draft_info", algorithm=algorithm) == 1
    assert metric_value(engine, "specd_spec_accepted_tokens_total") > 10
    assert metric_value(engine, "specd_spec_root_only_requests_total") > 0
    assert metric_value(engine, "specd_leak_checks_total", result="ok") > 0
    assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0


@pytest.mark.parametrize("algorithm", DRAFT_FREE)
def test_draft_free_under_a_small_pool_retracts_and_stays_exact(reference, algorithm):
    prompts, expected = reference
    engine = ngram_engine(4, 4, algorithm=algorithm, kvCache={"maxTokens": 160})
    check_small_pool_run(engine, prompts, expected, MAX_NEW)


@pytest.mark.parametrize("algorithm", DRAFT_FREE)
def test_draft_free_with_the_cost_model_stays_exact(reference, algorithm):
    prompts, expected = reference
    policy = {"policy": {"costModel": {"enabled": True}}}
    engine = ngram_engine(16, 2, True, algorithm=algorithm, speculative=policy)
    check_exact_run(engine, prompts, expected, MAX_NEW)


@pytest.mark.parametrize(
    "algorithm",
    ["NGRAM", pytest.param("SUFFIX", marks=pytest.mark.slow)],  # ~18 s each
)
def test_draft_free_sampling_keeps_the_target_distribution(algorithm):
    """Temperature 1: generated tokens 2 and 3 follow the target's law with draft-free
    drafting.  The shipped target on Python source: sampled tokens often continue a match
    in the prompt (proposals, dozens accepted), and the rest verify their roots alone;
    SUFFIX also proposes the outputs of the samples before."""
    target = DEMO_TARGET
    prompt = demo_prompts(1, 48)[0]
    plain = start_engine(target, kvCache={"pageSize": 1})
    spec = start_engine(
        target,
        kvCache={"pageSize": 1},
        draft={"algorithm": algorithm},
        speculative={
            "numSteps": 2,
            "topk": 2,
            "numDraftTokens": 4,
            "policy": {"costModel": {"enabled": False}},
        },
    )
    n = 800
    try:
        runs = [
            sampled_continuations(engine, prompt, n, first_seed=k * n)
            for k, engine in enumerate((plain, spec))
        ]
        accepted = metric_value(spec, "specd_spec_accepted_tokens_total")
        root_only = metric_value(spec, "specd_spec_root_only_requests_total")
    finally:
        plain.shutdown()
        spec.shutdown()
    assert accepted > 0, "some proposals must be accepted for the test to mean anything"
    assert root_only > 0
    a, b = runs
    check_same_marginals(a, b)


def test_plain_steps_measure_the_acceptance_verifies_get(reference):
    """Four requests in lockstep with maxBatchForSpec 1 run plain from start to end, and
    their plain tokens walk the drafts NGRAM would have verified.  A walk starts where a
    verify would (the previous walk's bonus), so, greedy, the walks repeat one request
    at a time's verifies, less the last one per request that max_tokens cuts short."""
    prompts = reference[0][:4]
    engine = ngram_engine(  # one prefill step for all: no request ever runs alone
        speculative={"policy": {"maxBatchForSpec": 1}}, scheduler={"chunkedPrefillSize": 512}
    )
    alone = ngram_engine()
    try:
        run_all(engine, prompts, max_tokens=MAX_NEW, ignore_eos=True)
        assert metric_value(engine, "specd_spec_plain_steps_total", reason="load") > 0
        assert metric_value(engine, "specd_spec_accepted_tokens_total") == 0
        walks = metric_value(engine, "specd_spec_shadow_walks_total")
        shadow = metric_value(engine, "specd_spec_shadow_accepted_total")
        results = [run_all(alone, [p], max_tokens=MAX_NEW, ignore_eos=True)[0] for p in prompts]
    finally:
        engine.shutdown()
        alone.shutdown()
    verifies = sum(r[2].usage.spec_verify_steps for r in results)
    accepted = sum(r[2].usage.spec_accepted_tokens for r in results)
    assert accepted > 10
    assert verifies - len(prompts) <= walks <= verifies
    assert accepted - STEPS * len(prompts) <= shadow <= accepted
