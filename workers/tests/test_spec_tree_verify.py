"""Draft-tree construction and verify (greedy, lossless sampling, accepted-path KV moves)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from specd.kernels.metadata import build_attention_metadata
from specd.kernels.torch_backend import TorchAttentionBackend
from specd.workers.speculative.tree import (
    DraftTree,
    StepOut,
    build_tree,
    expand_step,
    first_step,
    tree_attention_mask_for_verify,
)
from specd.workers.speculative.verify import (
    PAD,
    accepted_path_positions,
    draw_coins,
    verify_greedy,
    verify_sampling,
)

torch.set_num_threads(1)


def _log(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log().float()


def _draft(root_probs, child_probs, k: int, num_tokens: int, root_token: int = 9) -> DraftTree:
    """One request: root_probs [V]; child_probs: per later step, [k, V] rows (one per kept node)."""
    steps = [first_step(_log([root_probs]), k)]
    for rows in child_probs:
        steps.append(expand_step(steps[-1], _log([rows]), k))
    return build_tree(torch.tensor([root_token]), steps, num_tokens)


def _random_draft(gen: torch.Generator, bs: int, k: int, num_steps: int, t: int, v: int):
    """Random draft log-probs -> (tree, the step outputs)."""
    steps = [first_step(torch.log_softmax(2 * torch.randn(bs, v, generator=gen), -1), k)]
    for _ in range(num_steps - 1):
        child = torch.log_softmax(2 * torch.randn(bs, k, v, generator=gen), -1)
        steps.append(expand_step(steps[-1], child, k))
    roots = torch.randint(v, (bs,), generator=gen)
    return build_tree(roots, steps, t), steps


def _take(tree: DraftTree, rows: torch.Tensor) -> DraftTree:
    """The requests ``rows`` of ``tree`` (repeats allowed)."""
    tensors = {
        f.name: getattr(tree, f.name)[rows]
        for f in dataclasses.fields(tree)
        if f.name not in ("num_steps", "node_counts")
    }
    return DraftTree(**tensors, num_steps=tree.num_steps)


# Worked example of build_tree's docstring: r=9, a=0, b=1, c=2, e=3 (V=5).
ROOT = [0.6, 0.3, 0.05, 0.03, 0.02]
STEP1 = [[0.05, 0.05, 0.6, 0.2, 0.1], [0.0, 0.1, 0.0, 0.9, 0.0]]  # after a, after b
# Ties: a=0 .5, b=1 .25; c=2 .5*.5 and e=3 .25*1 score exactly like b (e like its parent).
TIE_ROOT = [0.5, 0.25, 0.15, 0.1, 0.0]
TIE_STEP1 = [[0.0, 0.0, 0.5, 0.3, 0.2], [0.0, 0.0, 0.0, 1.0, 0.0]]

TREE_CASES = [
    pytest.param(
        dict(k=1, root=ROOT, steps=[[STEP1[0]], [[0.1, 0.7, 0.1, 0.1, 0.0]]], t=4),
        dict(
            tokens=[9, 0, 2, 1],
            parents=[-1, 0, 1, 2],
            depths=[0, 1, 2, 3],
            next_token=[1, 2, 3, -1],
            next_sibling=[-1, -1, -1, -1],
        ),
        id="chain-k1",
    ),
    pytest.param(
        dict(k=2, root=ROOT, steps=[STEP1], t=4),
        dict(
            tokens=[9, 0, 1, 2],
            parents=[-1, 0, 0, 1],
            depths=[0, 1, 1, 2],
            next_token=[1, 3, -1, -1],
            next_sibling=[-1, 2, -1, -1],
        ),
        id="worked-example-k2-S2-T4",
    ),
    pytest.param(
        dict(k=2, root=ROOT, steps=[STEP1], t=3),
        dict(
            tokens=[9, 0, 2],
            parents=[-1, 0, 1],
            depths=[0, 1, 2],
            next_token=[1, 2, -1],
            next_sibling=[-1, -1, -1],
        ),
        id="T-below-candidates-drops-shallow-b",
    ),
    pytest.param(
        dict(k=2, root=ROOT, steps=[STEP1], t=5),
        dict(
            tokens=[9, 0, 1, 2, 3],
            parents=[-1, 0, 0, 1, 2],
            depths=[0, 1, 1, 2, 2],
            next_token=[1, 3, 4, -1, -1],
            next_sibling=[-1, 2, -1, -1, -1],
        ),
        id="T-takes-all-candidates",
    ),
    pytest.param(
        dict(k=2, root=TIE_ROOT, steps=[TIE_STEP1], t=3),
        dict(
            tokens=[9, 0, 1],
            parents=[-1, 0, 0],
            depths=[0, 1, 1],
            next_token=[1, -1, -1],
            next_sibling=[-1, 2, -1],
        ),
        id="ties-prefer-shallower",
    ),
    pytest.param(
        dict(k=2, root=TIE_ROOT, steps=[TIE_STEP1], t=4),
        dict(
            tokens=[9, 0, 1, 2],
            parents=[-1, 0, 0, 1],
            depths=[0, 1, 1, 2],
            next_token=[1, 3, -1, -1],
            next_sibling=[-1, 2, -1, -1],
        ),
        id="ties-then-lower-index",
    ),
    pytest.param(
        dict(k=2, root=TIE_ROOT, steps=[TIE_STEP1], t=5),
        dict(
            tokens=[9, 0, 1, 2, 3],
            parents=[-1, 0, 0, 1, 2],
            depths=[0, 1, 1, 2, 2],
            next_token=[1, 3, 4, -1, -1],
            next_sibling=[-1, 2, -1, -1, -1],
        ),
        id="ties-child-equal-to-parent",
    ),
]


@pytest.mark.parametrize(("draft", "want"), TREE_CASES)
def test_build_tree_table(draft, want):
    tree = _draft(draft["root"], draft["steps"], draft["k"], draft["t"])
    tree.check_invariants()
    assert tree.tokens[0].tolist() == want["tokens"]
    assert tree.parents[0].tolist() == want["parents"]
    assert tree.depths[0].tolist() == want["depths"]
    assert tree.retrieve_next_token[0].tolist() == want["next_token"]
    assert tree.retrieve_next_sibling[0].tolist() == want["next_sibling"]
    assert tree.positions(torch.tensor([7]))[0].tolist() == [7 + d for d in want["depths"]]


def test_worked_example_mask():
    tree = _draft(ROOT, [STEP1], k=2, num_tokens=4)
    assert tree.tree_mask[0].int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]


def test_child_scored_above_parent_is_never_kept_alone():
    """Scores that are not log-probs (child > parent) still give a closed tree."""
    step0 = first_step(_log([[0.5, 0.4, 0.1]]), 2)
    child = torch.tensor([[[-5.0, -5.5, -6.0], [-5.0, -5.5, 1.0]]])  # b's child scores > b
    tree = build_tree(torch.tensor([9]), [step0, expand_step(step0, child, 2)], 2)
    assert tree.tokens[0].tolist() == [9, 0]


def test_build_tree_rejects_too_many_tokens():
    step0 = first_step(_log([ROOT]), 2)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        build_tree(torch.tensor([9]), [step0], 4)


def test_root_only_tree_verifies_like_plain_decode():
    """The plain rung (steps 0, T 1): the root alone; greedy emits the target's argmax,
    sampling draws from the target's distribution with coin T; nothing needs moving."""
    tree = build_tree(torch.tensor([9, 4]), [], 1)
    tree.check_invariants()
    assert (tree.num_tokens, tree.num_steps) == (1, 0)
    assert tree.parents.tolist() == [[-1], [-1]] and tree.tree_mask.tolist() == [[[True]]] * 2
    greedy = verify_greedy(tree, torch.tensor([[5], [7]]))
    assert greedy.accepted_tokens.tolist() == [[5], [7]]
    assert greedy.accept_len.tolist() == [0, 0] and greedy.num_new_tokens.tolist() == [1, 1]
    probs = torch.tensor([[[0.0, 0.5, 0.5]], [[1.0, 0.0, 0.0]]])
    coins = torch.tensor([[0.9, 0.25], [0.0, 0.99]])  # coin 0 unused: no child to try
    sampled = verify_sampling(tree, probs, coins)
    assert sampled.accepted_tokens.tolist() == [[1], [0]]
    b, _, _ = accepted_path_positions(sampled).needed()
    assert b.numel() == 0
    with pytest.raises(ValueError, match="the root alone"):
        build_tree(torch.tensor([9]), [], 2)


def _reference_selection(steps, b: int, t: int, root: int) -> tuple[list[int], list[int]]:
    """Plain-Python best T-1 candidates (score desc, then index), as (tokens, parents)."""
    k, cands = steps[0].tokens.shape[1], []  # (score, index, token, parent candidate)
    for s, step in enumerate(steps):
        for j in range(k):
            parent = -1 if s == 0 else (s - 1) * k + int(step.parents[b, j])
            cands.append((float(step.scores[b, j]), s * k + j, int(step.tokens[b, j]), parent))
    kept = sorted(sorted(cands, key=lambda c: (-c[0], c[1]))[: t - 1], key=lambda c: c[1])
    node = {-1: 0} | {c[1]: i + 1 for i, c in enumerate(kept)}
    return [root] + [c[2] for c in kept], [-1] + [node[c[3]] for c in kept]


def _ancestors(parents: list[int], i: int) -> list[int]:
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


@pytest.mark.parametrize(("k", "num_steps", "t"), [(1, 4, 5), (2, 3, 5), (3, 3, 8), (4, 4, 16)])
def test_tree_invariants_random(k, num_steps, t):
    gen = torch.Generator().manual_seed(k * 100 + t)
    bs = 16
    tree, steps = _random_draft(gen, bs, k, num_steps, t, v=12)
    tree.check_invariants()
    seq_lens = torch.randint(0, 50, (bs,), generator=gen)
    positions = tree.positions(seq_lens)
    for b in range(bs):
        parents = tree.parents[b].tolist()
        assert all(0 <= parents[i] < i for i in range(1, t))
        assert tree.depths[b].tolist() == sorted(tree.depths[b].tolist())  # (depth, rank) order
        for i in range(t):
            path = _ancestors(parents, i)
            assert tree.tree_mask[b, i].nonzero().flatten().tolist() == sorted(path)
            assert tree.depths[b, i] == len(path) - 1 <= num_steps
            assert positions[b, i] == seq_lens[b] + len(path) - 1
            kids = [j for j in range(t) if parents[j] == i]
            assert tree.retrieve_next_token[b, i] == (kids[0] if kids else -1)
            sibs = [j for j in range(i + 1, t) if i and parents[j] == parents[i]]
            assert tree.retrieve_next_sibling[b, i] == (sibs[0] if sibs else -1)
        want_tokens, want_parents = _reference_selection(steps, b, t, int(tree.tokens[b, 0]))
        assert tree.tokens[b].tolist() == want_tokens
        assert parents == want_parents


def test_verify_mask_layout():
    tree = _draft(ROOT, [STEP1], k=2, num_tokens=4)
    both = _take(tree, torch.tensor([0, 0]))
    flat = tree_attention_mask_for_verify(both, torch.tensor([2, 0]))
    assert flat.dtype == torch.bool and flat.numel() == 4 * 6 + 4 * 4
    first, second = flat[:24].view(4, 6), flat[24:].view(4, 4)
    assert first[:, :2].all()
    assert torch.equal(first[:, 2:], tree.tree_mask[0])
    assert torch.equal(second, tree.tree_mask[0])


def test_verify_mask_matches_path_attention():
    """Through the torch backend, each node attends exactly to the prefix and its path."""
    gen = torch.Generator().manual_seed(3)
    tree, _ = _random_draft(gen, bs=2, k=2, num_steps=3, t=6, v=10)
    prefix, t, heads, dim = [3, 5], 6, 2, 8
    slots = torch.randperm(40, generator=gen)
    req_to_token = torch.stack([slots[:20], slots[20:]]).int()  # [2 rows, width 20]
    k_buf, v_buf = torch.randn(2, 40, heads, dim, generator=gen).unbind(0)
    meta = build_attention_metadata(
        req_to_token,
        [0, 1],
        qo_lens=[t, t],
        kv_lens=[p + t for p in prefix],
        custom_mask=tree_attention_mask_for_verify(tree, prefix),
    )
    backend = TorchAttentionBackend()
    q = torch.randn(2 * t, heads, dim, generator=gen)
    out = backend.forward(q, k_buf, v_buf, backend.plan(meta), scale=dim**-0.5)
    for b in range(2):
        for i in range(t):
            seen = list(range(prefix[b])) + [
                prefix[b] + j for j in _ancestors(tree.parents[b].tolist(), i)
            ]
            kv = req_to_token[b, seen].long()
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[b * t + i][:, None, :],
                k_buf[kv].transpose(0, 1),
                v_buf[kv].transpose(0, 1),
                scale=dim**-0.5,
            )[:, 0]
            torch.testing.assert_close(out[b * t + i], ref)


# Greedy verify. TREE6: r=9 with children a=1, b=2; a -> c=3; b -> d=4, e=5.
TREE6 = DraftTree.from_parents(
    torch.tensor([[9, 1, 2, 3, 4, 5]]), torch.tensor([[-1, 0, 0, 1, 2, 2]]), num_steps=2
)
CHAIN4 = DraftTree.from_parents(
    torch.tensor([[9, 1, 2, 3]]), torch.tensor([[-1, 0, 1, 2]]), num_steps=3
)

GREEDY_CASES = [
    pytest.param(CHAIN4, [1, 2, 3, 7], [0, 1, 2, 3], [1, 2, 3, 7], id="chain-all-accepted"),
    pytest.param(CHAIN4, [6, 2, 3, 7], [0, PAD, PAD, PAD], [6, PAD, PAD, PAD], id="chain-none"),
    pytest.param(CHAIN4, [1, 2, 8, 7], [0, 1, 2, PAD], [1, 2, 8, PAD], id="chain-partial"),
    pytest.param(TREE6, [1, 3, 5, 6, 0, 0], [0, 1, 3], [1, 3, 6], id="tree-first-branch"),
    pytest.param(TREE6, [2, 3, 5, 0, 0, 0], [0, 2, 5], [2, 5, 0], id="tree-branch-switch-depth2"),
    pytest.param(
        TREE6, [2, 3, 4, 0, 7, 0], [0, 2, 4], [2, 4, 7], id="tree-second-branch-first-kid"
    ),
    pytest.param(TREE6, [1, 4, 4, 0, 0, 0], [0, 1, PAD], [1, 4, PAD], id="tree-partial"),
    pytest.param(TREE6, [8, 3, 4, 0, 0, 0], [0, PAD, PAD], [8, PAD, PAD], id="tree-none"),
]


@pytest.mark.parametrize(("tree", "argmax", "index", "tokens"), GREEDY_CASES)
def test_verify_greedy_table(tree, argmax, index, tokens):
    res = verify_greedy(tree, torch.tensor([argmax]))
    n = sum(i != PAD for i in index) - 1
    assert res.accept_index[0].tolist() == index
    assert res.accepted_tokens[0].tolist() == tokens
    assert (res.accept_len.item(), res.num_new_tokens.item()) == (n, n + 1)
    assert res.bonus_tokens.item() == tokens[n]


def _greedy_reference(tokens: list[int], parents: list[int], argmax: list[int]) -> list[int]:
    """Accepted path (node indices, root first): the deepest node whose path all matches."""
    best = [0]
    for i in range(1, len(tokens)):
        path = _ancestors(parents, i)
        if all(tokens[n] == argmax[parents[n]] for n in path[1:]) and len(path) > len(best):
            best = path
    return best


@pytest.mark.parametrize(("k", "num_steps", "t"), [(1, 4, 5), (2, 2, 5), (3, 2, 5), (2, 4, 5)])
def test_verify_greedy_exhaustive(k, num_steps, t):
    """Every argmax assignment over V=3 (3**5 = 243 of them) on a random tree."""
    gen = torch.Generator().manual_seed(10 * k + num_steps)
    one, _ = _random_draft(gen, bs=1, k=k, num_steps=num_steps, t=t, v=3)
    combos = torch.tensor(list(itertools.product(range(3), repeat=t)))  # [243, T]
    tree = _take(one, torch.zeros(len(combos), dtype=torch.long))
    res = verify_greedy(tree, combos)
    tokens, parents = one.tokens[0].tolist(), one.parents[0].tolist()
    for b, argmax in enumerate(combos.tolist()):
        path = _greedy_reference(tokens, parents, argmax)
        want = [tokens[n] for n in path[1:]] + [argmax[path[-1]]]
        width = num_steps + 1
        assert res.accept_index[b].tolist() == path + [PAD] * (width - len(path))
        assert res.accepted_tokens[b].tolist() == want + [PAD] * (width - len(want))
        assert res.accept_len[b] == len(path) - 1


# Sampling.


def _target_probs(gen: torch.Generator, tree: DraftTree, v: int) -> torch.Tensor:
    """[bs, T, V] with every token >= 0.2 / V, and extra mass on each node's children."""
    bs, t = tree.tokens.shape
    logits = torch.randn(bs, t, v, generator=gen)
    for i in range(1, t):
        logits[torch.arange(bs), tree.parents[:, i], tree.tokens[:, i]] += 2.0
    return 0.8 * torch.softmax(logits, -1) + 0.2 / v


def _reference_sample(tokens, parents, probs, coins, renormalize=True) -> list[int]:
    """One request in plain Python: emitted tokens (accepted drafts, then the bonus).

    ``renormalize=False`` is the deliberately wrong sampler: a rejected child's token stays
    in the distribution used for its siblings and the bonus.
    """
    t = len(tokens)
    node, residual, out = 0, list(probs[0]), []
    while True:
        for c in (j for j in range(t) if parents[j] == node):
            x = tokens[c]
            if coins[c] * sum(residual) < residual[x]:
                out.append(x)
                node, residual = c, list(probs[c])
                break
            if renormalize:
                residual[x] = 0.0
        else:
            draw, acc = coins[t] * sum(residual), 0.0
            out.append(next(i for i, w in enumerate(residual) if (acc := acc + w) > draw))
            return out


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of counts [V] to probs [V] (all > 0)."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    expected = counts.sum() * probs
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


SAMPLING_SHAPES = [pytest.param(1, 3, 4, id="chain"), pytest.param(2, 3, 6, id="tree-k2")]
N_TRIALS, V = 20_000, 8


def _one_draft_many_trials(k, num_steps, t, seed):
    gen = torch.Generator().manual_seed(seed)
    one, _ = _random_draft(gen, bs=1, k=k, num_steps=num_steps, t=t, v=V)
    probs = _target_probs(gen, one, V)  # [1, T, V]
    rows = torch.zeros(N_TRIALS, dtype=torch.long)
    return one, probs, _take(one, rows), probs.expand(N_TRIALS, -1, -1)


@pytest.mark.parametrize(("k", "num_steps", "t"), SAMPLING_SHAPES)
def test_sampling_matches_target_distribution(k, num_steps, t):
    """First emitted token ~ target at the root; given it is the first child's token, the
    second ~ target at that child."""
    one, probs, tree, batch_probs = _one_draft_many_trials(k, num_steps, t, seed=7)
    res = verify_sampling(tree, batch_probs, torch.Generator().manual_seed(0))
    first = res.accepted_tokens[:, 0]
    assert _chi2_pvalue(torch.bincount(first, minlength=V), probs[0, 0]) > 1e-3
    assert res.accept_len.float().mean() > 0.3  # drafts do get accepted
    child = int(one.retrieve_next_token[0, 0])
    second = res.accepted_tokens[first == one.tokens[0, child], 1]
    assert len(second) > 2000 and (second != PAD).all()
    assert _chi2_pvalue(torch.bincount(second, minlength=V), probs[0, child]) > 1e-3


@pytest.mark.parametrize(("k", "num_steps", "t"), SAMPLING_SHAPES)
def test_chi_square_catches_missing_residual(k, num_steps, t):
    """The same test on a sampler that never removes rejected tokens fails hard."""
    one, probs, _, _ = _one_draft_many_trials(k, num_steps, t, seed=7)
    coins = draw_coins(N_TRIALS, t, torch.Generator().manual_seed(0), "cpu").double().tolist()
    tokens, parents, rows = (
        one.tokens[0].tolist(),
        one.parents[0].tolist(),
        probs[0].double().tolist(),
    )
    first = [_reference_sample(tokens, parents, rows, c, renormalize=False)[0] for c in coins]
    assert _chi2_pvalue(torch.bincount(torch.tensor(first), minlength=V), probs[0, 0]) < 1e-6


@pytest.mark.parametrize(("k", "num_steps", "t"), [(1, 4, 5), (2, 3, 6), (3, 3, 9)])
def test_sampling_equals_reference(k, num_steps, t):
    """Given the same coins, the vectorized sampler emits what the plain-Python one does."""
    gen = torch.Generator().manual_seed(k + 20)
    tree, _ = _random_draft(gen, bs=200, k=k, num_steps=num_steps, t=t, v=5)
    probs = _target_probs(gen, tree, 5)
    coins = draw_coins(200, t, gen, "cpu")
    res = verify_sampling(tree, probs, coins)
    for b in range(200):
        want = _reference_sample(
            tree.tokens[b].tolist(),
            tree.parents[b].tolist(),
            probs[b].double().tolist(),
            coins[b].double().tolist(),
        )
        assert res.accepted_tokens[b, : len(want)].tolist() == want
        assert res.num_new_tokens[b] == len(want)


def test_sampling_with_one_hot_target_is_greedy():
    gen = torch.Generator().manual_seed(5)
    tree, _ = _random_draft(gen, bs=64, k=2, num_steps=3, t=6, v=4)
    argmax = torch.randint(4, (64, 6), generator=gen)
    one_hot = torch.nn.functional.one_hot(argmax, 4).float()
    greedy, sampled = verify_greedy(tree, argmax), verify_sampling(tree, one_hot, gen)
    for field in ("accept_index", "accepted_tokens", "accept_len", "bonus_tokens"):
        assert torch.equal(getattr(greedy, field), getattr(sampled, field)), field


def test_sampling_per_request_generators_are_deterministic():
    """Request b's output depends only on its own seed, not on its batch neighbours."""
    gen = torch.Generator().manual_seed(11)
    tree, _ = _random_draft(gen, bs=6, k=2, num_steps=3, t=6, v=6)
    probs = _target_probs(gen, tree, 6)
    seeds = [101, 202, 303, 404, 505, 606]

    def gens(ids):
        return [torch.Generator().manual_seed(seeds[i]) for i in ids]

    batched = verify_sampling(tree, probs, gens(range(6)))
    again = verify_sampling(tree, probs, gens(range(6)))
    assert torch.equal(batched.accepted_tokens, again.accepted_tokens)
    for b in (0, 3, 5):
        alone = verify_sampling(_take(tree, torch.tensor([b])), probs[b : b + 1], gens([b]))
        assert torch.equal(alone.accepted_tokens[0], batched.accepted_tokens[b])


def test_draw_coins_checks_generator_count():
    with pytest.raises(ValueError, match="2 generators for 3"):
        draw_coins(3, 4, [torch.Generator(), torch.Generator()], "cpu")


# Accepted-path KV moves.


def test_accepted_path_positions_table():
    res = verify_greedy(TREE6, torch.tensor([[2, 3, 5, 0, 0, 0]]))  # path 0 -> 2 -> 5
    moves = accepted_path_positions(res)
    assert moves.src[0].tolist() == [0, 2, 5]
    assert moves.dst[0].tolist() == [0, 1, 2]
    assert [m.tolist() for m in moves.needed()] == [[0, 0], [2, 5], [1, 2]]
    none = accepted_path_positions(verify_greedy(TREE6, torch.tensor([[8, 0, 0, 0, 0, 0]])))
    assert none.valid[0].tolist() == [True, False, False]
    assert [m.numel() for m in none.needed()] == [0, 0, 0]
    offsets = torch.tensor([[0, 10, 11, 12, 13, 14]])  # nodes written elsewhere (paged layout)
    assert accepted_path_positions(res, offsets).src[0].tolist() == [0, 11, 14]


def test_accepted_path_moves_make_path_contiguous():
    gen = torch.Generator().manual_seed(13)
    bs, t = 32, 8
    tree, _ = _random_draft(gen, bs=bs, k=3, num_steps=3, t=t, v=3)
    res = verify_greedy(tree, torch.randint(3, (bs, t), generator=gen))
    seq_lens = torch.randint(0, 10, (bs,), generator=gen)
    kv = torch.full((bs, 10 + t), -7)  # fake KV per position: the token it was computed for
    kv[torch.arange(bs)[:, None], seq_lens[:, None] + torch.arange(t)] = tree.tokens
    req, src, dst = accepted_path_positions(res).needed()
    kv[req, seq_lens[req] + dst] = kv[req, seq_lens[req] + src]  # gather, then scatter
    for b in range(bs):
        n = int(res.accept_len[b]) + 1
        path = tree.tokens[b, res.accept_index[b, :n]]
        assert torch.equal(kv[b, seq_lens[b] : seq_lens[b] + n], path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(17)
    _, steps = _random_draft(gen, bs=8, k=3, num_steps=3, t=8, v=50)
    roots = torch.arange(8)
    cpu = build_tree(roots, steps, 8)
    gpu_steps = [StepOut(s.tokens.cuda(), s.scores.cuda(), s.parents.cuda()) for s in steps]
    gpu = build_tree(roots.cuda(), gpu_steps, 8)
    assert torch.equal(cpu.tree_mask, gpu.tree_mask.cpu())
    probs = _target_probs(gen, cpu, 50)
    coins = draw_coins(8, 8, gen, "cpu")
    a = verify_sampling(cpu, probs, coins)
    b = verify_sampling(gpu, probs.cuda(), coins.cuda())
    assert torch.equal(a.accepted_tokens, b.accepted_tokens.cpu())
    argmax = probs.argmax(-1)
    greedy_cpu = verify_greedy(cpu, argmax).accepted_tokens
    assert torch.equal(greedy_cpu, verify_greedy(gpu, argmax.cuda()).accepted_tokens.cpu())
