"""verify.py: tree geometry, greedy/sampled acceptance, logit warping, KV compaction.

Everything is hand-made and tiny: trees are written out node by node, logits are crafted, and the
one model is a 3-layer random model.Transformer built directly from a ModelArgs (no checkpoint).
Every function takes a batch (B requests, a leading dimension): a single request is a batch of one,
and each batched test checks that row b of a batch equals the same call on row b alone. CPU, float32.
"""
import math
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import model as M  # noqa: E402
import verify as V  # noqa: E402
from verify import Sampling  # noqa: E402

torch.set_num_threads(1)
NEG = float("-inf")


def T(x, dtype=torch.long):
    return torch.tensor(x, dtype=dtype)


def mask_from_ancestors(anc: list) -> torch.Tensor:
    """anc[i] = set of nodes row i may see (itself and its ancestors) -> (N, N) bool."""
    N = len(anc)
    m = torch.zeros(N, N, dtype=torch.bool)
    for i, s in enumerate(anc):
        for j in s:
            m[i, j] = True
    return m


def slot_sampling(*samplings) -> tuple:
    """SlotSampling with one row per Sampling, and the batch's mode."""
    smp = V.SlotSampling(len(samplings), "cpu")
    for b, s in enumerate(samplings):
        smp.set(b, s)
    return smp, V.sampling_mode(samplings)


def tree_mask1(parents, valid=None, max_depth=None):
    """tree_mask of one tree (a batch of one): (N, N) mask, (N,) depths."""
    valid = torch.ones_like(parents, dtype=torch.bool) if valid is None else valid
    mask, depth = V.tree_mask(parents[None], valid[None], parents.numel() - 1 if max_depth is None else max_depth)
    assert mask.shape == (1, parents.numel(), parents.numel()) and depth.shape == (1, parents.numel())
    return mask[0], depth[0]


# ----------------------------------------------------------------------------- tree_mask

def test_tree_mask_branching_tree():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     6
    #   |
    #   5
    parents = T([-1, 0, 0, 1, 1, 3, 2])
    mask, depth = tree_mask1(parents, max_depth=3)
    want = mask_from_ancestors([{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 1, 3, 5}, {0, 2, 6}])
    assert mask.dtype == torch.bool
    assert torch.equal(mask, want)
    assert depth.tolist() == [0, 1, 1, 2, 2, 3, 2]


@pytest.mark.parametrize("N", [2, 5, 8, 9, 17, 33, 64])
def test_tree_mask_chain(N):
    # a chain is the worst case for the squaring trick: depth N-1 (the max_depth given) must be reached
    parents = torch.arange(N) - 1
    mask, depth = tree_mask1(parents, max_depth=N - 1)
    assert torch.equal(mask, torch.ones(N, N, dtype=torch.bool).tril())
    assert depth.tolist() == list(range(N))


def test_tree_mask_star():
    parents = T([-1, 0, 0, 0, 0])
    mask, depth = tree_mask1(parents, max_depth=1)
    want = torch.eye(5, dtype=torch.bool)
    want[:, 0] = True
    assert torch.equal(mask, want)
    assert depth.tolist() == [0, 1, 1, 1, 1]


def test_tree_mask_single_root():
    mask, depth = tree_mask1(T([-1]))
    assert torch.equal(mask, T([[True]], torch.bool))
    assert depth.tolist() == [0]


def test_tree_mask_batch_rows_are_independent():
    # three trees of 7 nodes in one call (a branching tree, a chain, a star with padding): each row
    # equals that tree alone
    parents = T([[-1, 0, 0, 1, 1, 3, 2], [-1, 0, 1, 2, 3, 4, 5], [-1, 0, 0, 0, 1, 0, 2]])
    valid = T([[1] * 7, [1] * 7, [1, 1, 1, 1, 0, 1, 0]], torch.bool)
    mask, depth = V.tree_mask(parents, valid, 6)
    assert mask.shape == (3, 7, 7) and depth.shape == (3, 7)
    for b in range(3):
        m1, d1 = tree_mask1(parents[b], valid[b], 6)
        assert torch.equal(mask[b], m1) and torch.equal(depth[b], d1), b
    assert torch.equal(mask[1], torch.ones(7, 7, dtype=torch.bool).tril())
    assert depth[2].tolist() == [0, 1, 1, 1, 0, 1, 0]          # padding nodes are their own roots


# ----------------------------------------------------------------------------- accept

def run_accept(tokens, parents, target, valid=None):
    """accept() on one tree (a batch of one): (path up to the bonus's parent, bonus, A)."""
    tokens, parents, target = T(tokens)[None], T(parents)[None], T(target)[None]
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else T(valid, torch.bool)[None]
    N = tokens.shape[1]
    mask, depth = V.tree_mask(parents, valid, N - 1)
    A, bonus, path = V.accept(tokens, parents, valid, mask, depth, target, N)
    assert A.shape == bonus.shape == (1,) and path.shape == (1, N)
    A = int(A[0])
    return path[0, :A + 1].tolist(), int(bonus[0]), A


# the branching tree above with tokens; the root token is 100
BR_PARENTS = [-1, 0, 0, 1, 1, 3, 2]
BR_TOKENS = [100, 10, 11, 20, 21, 30, 22]


def test_accept_picks_deepest_matching_path():
    # target after node i: 0 -> 10 (node 1 ok, node 2 not), 1 -> 20 (node 3 ok), 3 -> 30 (node 5 ok),
    # 5 -> 99 (bonus). Node 6 (22) hangs under a rejected node 2 even though target[2] == 22.
    target = [10, 20, 22, 30, 7, 99, 8]
    assert run_accept(BR_TOKENS, BR_PARENTS, target) == ([0, 1, 3, 5], 99, 3)


def test_accept_shallower_path_when_deep_one_breaks():
    # node 1 ok, node 4 (21) ok, node 3 (20) not: A = 2 through node 4; bonus = target[4]
    target = [10, 21, 5, 30, 77, 6, 8]
    assert run_accept(BR_TOKENS, BR_PARENTS, target) == ([0, 1, 4], 77, 2)


def test_accept_descendant_of_rejected_node_never_accepted():
    # node 2 (11) rejected at the root, though node 6 (22) equals target[2]: only node 1 at depth 1
    target = [10, 55, 22, 0, 0, 0, 0]
    assert run_accept(BR_TOKENS, BR_PARENTS, target) == ([0, 1], 55, 1)


def test_accept_first_on_ties():
    # two sibling nodes carry the same token (both match): the first one's path wins at equal depth
    parents = [-1, 0, 0, 1, 2]
    tokens = [100, 10, 10, 20, 21]
    target = [10, 20, 21, 41, 42]       # node 3 ok (under 1), node 4 ok (under 2): both depth 2
    assert run_accept(tokens, parents, target) == ([0, 1, 3], 41, 2)


def test_accept_nothing_matches():
    target = [12, 20, 22, 30, 7, 99, 8]        # no root child is 12
    assert run_accept(BR_TOKENS, BR_PARENTS, target) == ([0], 12, 0)


def test_accept_root_alone():
    assert run_accept([5], [-1], [9]) == ([0], 9, 0)


@pytest.mark.parametrize("seed", range(20))
def test_tree_mask_and_accept_in_cpp_equal_the_torch_versions(seed, monkeypatch):
    """On a CPU tree_mask and accept run as one C++ call each (verify.FUSED); the torch versions are the
    reference (GPUs, compiled steps). Random batches of random trees: padding nodes (their children
    hang under them), chains deeper than max_depth allows, targets that often match (a small
    vocabulary), paths shorter than the tree: every output alike, element for element."""
    import random
    if not M.use_kernels(torch.zeros(1)):
        pytest.skip("graft's CPU kernels did not build here")
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    B, N, vocab = rng.randrange(1, 5), rng.randrange(1, 20), rng.choice((2, 3, 50))
    parents = torch.tensor([[-1] + [rng.randrange(-1, i) for i in range(1, N)] for _ in range(B)])
    valid = torch.rand(B, N, generator=g) < 0.85
    valid[:, 0] = True
    tokens = torch.randint(0, vocab, (B, N), generator=g)
    target = torch.randint(0, vocab, (B, N), generator=g)
    max_depth, P = rng.randrange(0, 9), rng.randrange(1, N + 3)

    def run(fused):
        monkeypatch.setattr(V, "FUSED", fused)
        mask, depth = V.tree_mask(parents, valid, max_depth)
        return (mask, depth, *V.accept(tokens, parents, valid, mask, depth, target, P))
    for x, y in zip(run(True), run(False)):
        assert x.dtype == y.dtype and torch.equal(x, y), (seed, x, y)


def test_accept_path_root_first_when_nodes_interleaved():
    # the accepted path's nodes are not contiguous and appear after unrelated nodes
    parents = [-1, 0, 0, 2, 1, 3, 4]
    tokens = [100, 50, 10, 20, 51, 30, 52]
    target = [10, 0, 20, 30, 0, 44, 0]
    path, bonus, A = run_accept(tokens, parents, target)
    assert (path, bonus, A) == ([0, 2, 3, 5], 44, 3)


def test_accept_batch_rows_equal_each_alone():
    # four requests in one call, each with its own tree, tokens, padding and target: every row's
    # (A, bonus, path) is what accept gives that request alone
    cases = [(BR_TOKENS, BR_PARENTS, [10, 20, 22, 30, 7, 99, 8], None),
             (BR_TOKENS, BR_PARENTS, [10, 21, 5, 30, 77, 6, 8], None),
             ([100, 50, 10, 20, 51, 30, 52], [-1, 0, 0, 2, 1, 3, 4], [10, 0, 20, 30, 0, 44, 0], None),
             ([100, 10, 11, 20, 5, 6, 7], [-1, 0, 0, 2, 0, 0, 0], [11, 5, 20, 7, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1])]
    tokens, parents, target = (T([c[i] for c in cases]) for i in range(3))
    valid = T([c[3] or [1] * 7 for c in cases], torch.bool)
    mask, depth = V.tree_mask(parents, valid, 6)
    A, bonus, path = V.accept(tokens, parents, valid, mask, depth, target, 7)
    for b, (tk, pr, tg, vd) in enumerate(cases):
        want = run_accept(tk, pr, tg, vd)
        assert (path[b, :int(A[b]) + 1].tolist(), int(bonus[b]), int(A[b])) == want, b
    assert A.tolist() == [3, 2, 3, 0]


# ----------------------------------------------------------------------------- warp

def warp1(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """warp() of one request's rows logits (N, V) under its Sampling."""
    smp, mode = slot_sampling(s)
    out = V.warp(logits[None], smp.temperature, smp.top_k, smp.top_p, mode)
    assert out.shape == (1, *logits.shape) and out.dtype == torch.float32
    return out[0]


def test_warp_temperature_only():
    logits = T([[1.0, -2.0, 0.5, 3.0]], torch.float32)
    out = warp1(logits, Sampling(temperature=0.5))
    assert torch.allclose(out, logits / 0.5)


def test_warp_top_k_exact_mask():
    logits = T([[1.0, 5.0, 3.0, 4.0, 2.0],
                [0.0, -1.0, 2.0, 2.5, -3.0]], torch.float32)
    out = warp1(logits, Sampling(temperature=1.0, top_k=2))
    assert torch.isinf(out).tolist() == [[True, False, True, False, True],
                                         [True, True, False, False, True]]
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])


def test_warp_top_k_keeps_ties_at_kth():
    logits = T([[3.0, 1.0, 3.0, 0.0]], torch.float32)
    out = warp1(logits, Sampling(temperature=1.0, top_k=1))
    assert torch.isinf(out).tolist() == [[False, True, False, True]]


def test_warp_top_k_off_and_not_smaller_than_vocab():
    logits = torch.randn(3, 6)
    assert torch.equal(warp1(logits, Sampling(temperature=1.0, top_k=0)), logits)
    assert torch.equal(warp1(logits, Sampling(temperature=1.0, top_k=6)), logits)


@pytest.mark.parametrize("top_p, removed", [
    (0.9, [0]),            # ascending cumsum 0.05, 0.20, 0.50, 1.0: drop mass <= 0.1
    (0.75, [0, 2]),        # drop mass <= 0.25
    (0.3, [0, 2, 3]),      # only the most likely token survives
    (1e-6, [0, 2, 3]),     # the most likely token is always kept
    (1.0, []),
])
def test_warp_top_p_exact_mask(top_p, removed):
    probs = T([0.05, 0.5, 0.15, 0.3], torch.float64)
    logits = probs.log().float()[None]
    out = warp1(logits, Sampling(temperature=1.0, top_p=top_p))
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == removed
    keep = [i for i in range(4) if i not in removed]
    assert torch.equal(out[0, keep], logits[0, keep])


def test_warp_top_p_applies_after_temperature():
    # at T = 0.5 the tempered probabilities are p^2 / sum p^2 = [.0068, .6803, .0612, .2449] (approx);
    # top_p 0.9 then drops tokens 0 and 2 (cumsum 0.0068, 0.068 <= 0.1), which at T = 1 it would not
    probs = T([0.05, 0.5, 0.15, 0.3], torch.float64)
    logits = probs.log().float()[None]
    out = warp1(logits, Sampling(temperature=0.5, top_p=0.9))
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [0, 2]


def test_warp_top_k_then_top_p():
    # top_k=3 removes token 0 first; renormalised [.5, .15, .3]/.95 -> ascending cumsum .158, .474:
    # top_p 0.8 drops mass <= 0.2, i.e. token 2 as well
    probs = T([0.05, 0.5, 0.15, 0.3], torch.float64)
    logits = probs.log().float()[None]
    out = warp1(logits, Sampling(temperature=1.0, top_k=3, top_p=0.8))
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [0, 2]


def test_warp_batch_rows_use_their_own_settings():
    # one batch, each request with its own temperature, top-k and top-p (the mode turns on what any
    # request needs): every row equals the request warped alone, under its own mode
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 12, generator=g) * 2
    ss = [Sampling(temperature=0.5), Sampling(temperature=1.0, top_k=3), Sampling(temperature=0.8, top_p=0.7),
          Sampling(temperature=1.3, top_k=5, top_p=0.9)]
    smp, mode = slot_sampling(*ss)
    assert mode == (True, True, True)
    out = V.warp(logits, smp.temperature, smp.top_k, smp.top_p, mode)
    for b, s in enumerate(ss):
        assert torch.equal(out[b], warp1(logits[b], s)), b
    assert not torch.isinf(out[0]).any() and (torch.isfinite(out[1]).sum(-1) == 3).all()


# ----------------------------------------------------------------------------- choose

def choose1(logits: torch.Tensor, positions: torch.Tensor, s: Sampling) -> torch.Tensor:
    """choose() for one request: logits (N, V), positions (N,) -> (N,)."""
    smp, mode = slot_sampling(s)
    out = V.choose(logits[None], positions[None], smp, mode)
    assert out.shape == (1, logits.shape[0])
    return out[0]


def test_choose_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(20, 50, generator=g)
    got = choose1(logits, torch.arange(20), Sampling())
    assert torch.equal(got, logits.argmax(-1))


SAMP = Sampling(temperature=0.8, top_p=0.9, seed=7)


def test_choose_sampling_deterministic_for_seed_and_position():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 1000, generator=g) * 0.1        # near uniform: the noise decides
    pos = torch.tensor([42])
    first = choose1(logits, pos, SAMP)
    for _ in range(3):
        assert torch.equal(choose1(logits, pos, SAMP), first)
    # same position inside a request's tree (as a tree node) draws the same token
    tree = choose1(logits.expand(4, -1), torch.tensor([3, 42, 42, 9]), SAMP)
    assert int(tree[1]) == int(first) and int(tree[2]) == int(first)
    # and so does another request with the same seed at that position, beside one with another seed
    smp, mode = slot_sampling(Sampling(temperature=0.8, top_p=0.9, seed=8), SAMP, Sampling())
    batch = V.choose(logits.expand(3, 2, -1), torch.tensor([[42, 5], [7, 42], [42, 42]]), smp, mode)
    assert int(batch[1, 1]) == int(first)
    assert int(batch[0, 0]) == int(choose1(logits, pos, Sampling(temperature=0.8, top_p=0.9, seed=8)))
    assert batch[2].tolist() == [int(logits.argmax())] * 2                        # a greedy request: argmax


def test_choose_sampling_differs_across_positions():
    logits = torch.zeros(64, 1000)
    got = choose1(logits, torch.arange(100, 164), SAMP)
    assert len(set(got.tolist())) > 48, got.tolist()


def test_choose_sampling_differs_across_seeds():
    logits = torch.zeros(64, 1000)
    pos = torch.arange(64)
    a = choose1(logits, pos, Sampling(temperature=0.8, top_p=0.9, seed=1))
    b = choose1(logits, pos, Sampling(temperature=0.8, top_p=0.9, seed=2))
    assert (a != b).sum() > 48
    # the same two requests side by side in one batch draw what each drew alone
    smp, mode = slot_sampling(Sampling(temperature=0.8, top_p=0.9, seed=1), Sampling(temperature=0.8, top_p=0.9, seed=2))
    both = V.choose(logits.expand(2, -1, -1), pos.expand(2, -1), smp, mode)
    assert torch.equal(both[0], a) and torch.equal(both[1], b)


def test_choose_batch_rows_equal_each_alone():
    # greedy, temperature, top-k and top-p requests in one batch, at different positions
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 16, 30, generator=g)
    pos = torch.arange(64).view(4, 16) * 3 + 11
    ss = [Sampling(), Sampling(temperature=0.9, seed=4), Sampling(temperature=0.7, top_k=4, seed=5),
          Sampling(temperature=1.2, top_p=0.8, seed=6)]
    smp, mode = slot_sampling(*ss)
    got = V.choose(logits, pos, smp, mode)
    for b, s in enumerate(ss):
        assert torch.equal(got[b], choose1(logits[b], pos[b], s)), b
    assert torch.equal(got[0], logits[0].argmax(-1))


def test_choose_sampling_never_picks_removed_tokens():
    N = 3000
    pos = torch.arange(N)
    # top-k: 2 survivors (3, 7) of 10
    lk = torch.zeros(10)
    lk[3], lk[7], lk[1] = 2.0, 1.9, 1.8
    got = choose1(lk.expand(N, -1), pos, Sampling(temperature=0.8, top_k=2, seed=3))
    assert set(got.tolist()) == {3, 7}
    # top-p: tempered probabilities (T * log p / T = log p) .5, .3, .15, .05 -> 0.9 keeps tokens 0, 1, 2
    probs = T([0.5, 0.3, 0.15, 0.05], torch.float64)
    lp = (0.8 * probs.log()).float()
    got = choose1(lp.expand(N, -1), pos, Sampling(temperature=0.8, top_p=0.9, seed=4))
    assert set(got.tolist()) == {0, 1, 2}


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = probs * n
    return float(((counts - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("seed", [0, 11])
def test_choose_sampling_distribution_matches_softmax(seed):
    N, Tmp = 4000, 0.8
    logits = T([1.0, 0.2, -0.5, 0.7, -1.5], torch.float32)
    got = choose1(logits.expand(N, -1), torch.arange(N) + 1000 * seed, Sampling(temperature=Tmp, seed=seed))
    counts = torch.bincount(got, minlength=5).double()
    want = (logits.double() / Tmp).softmax(-1)
    # 4 degrees of freedom: P(chi2 > 30) ~ 5e-6
    assert chi2(counts, want) < 30, (counts.tolist(), (want * N).tolist())


def test_choose_sampling_distribution_matches_warped():
    N, Tmp = 4000, 0.8
    probs = T([0.5, 0.3, 0.15, 0.05, 1e-3], torch.float64)
    logits = (Tmp * probs.log()).float()
    got = choose1(logits.expand(N, -1), torch.arange(N), Sampling(temperature=Tmp, top_p=0.9, seed=5))
    counts = torch.bincount(got, minlength=5).double()
    assert counts[3] == 0 and counts[4] == 0
    want = probs[:3] / probs[:3].sum()
    assert chi2(counts[:3], want) < 25, counts.tolist()


def test_position_noise_is_gumbel():
    noise = V.position_noise(torch.tensor(0), torch.arange(2000), 50).flatten()
    assert torch.isfinite(noise).all()
    # Gumbel(0, 1): mean = Euler-Mascheroni 0.5772, variance pi^2/6
    assert abs(float(noise.mean()) - 0.5772) < 0.02
    assert abs(float(noise.var()) - math.pi ** 2 / 6) < 0.05


def test_position_noise_broadcasts_seed_per_request():
    # seeds (B, 1) against positions (B, N): row b is the noise of seed b at its positions alone
    seeds, pos = T([[3], [9], [3]]), T([[5, 6, 7], [5, 6, 7], [100, 5, 2]])
    got = V.position_noise(seeds, pos, 20)
    assert got.shape == (3, 3, 20)
    for b in range(3):
        assert torch.equal(got[b], V.position_noise(seeds[b, 0], pos[b], 20)), b
    assert torch.equal(got[0, 0], got[2, 1]) and not torch.equal(got[0], got[1])   # (seed, position) alone decides


def test_sampling_mode_is_what_any_request_needs():
    assert V.sampling_mode([]) == (False, False, False)
    assert V.sampling_mode([Sampling(), Sampling(top_k=5, top_p=0.5)]) == (False, False, False)  # greedy ignores them
    assert V.sampling_mode([Sampling(), Sampling(temperature=0.7)]) == (True, False, False)
    assert V.sampling_mode([Sampling(temperature=0.7, top_k=3), Sampling(temperature=1.0, top_p=0.9)]) == (True, True, True)


def test_slot_sampling_set_fills_one_row():
    smp = V.SlotSampling(3, "cpu")
    smp.set(1, Sampling(temperature=0.7, top_p=0.9, top_k=5, seed=11))
    smp.set(2, Sampling(temperature=1e-7, seed=4))                 # below MIN_TEMPERATURE: greedy
    assert smp.greedy.tolist() == [True, False, True]
    assert smp.temperature.tolist() == pytest.approx([1.0, 0.7, 1.0])     # greedy rows never divide
    assert smp.top_k.tolist() == [0, 5, 0] and smp.seed.tolist() == [0, 11, 4]
    assert smp.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])


# ----------------------------------------------------------------------------- verify + KV compaction

PROMPT = [1, 5, 9, 13, 22, 40, 3]


def tiny_model(seed: int = 2, std: float = 0.3) -> M.Transformer:
    """3 layers, GQA (4 q heads, 2 kv heads), vocab 64; weights ~ N(0, std), norms ~ 1 + N(0, .1).
    Its own cache holds one request of 64 rows."""
    a = M.ModelArgs(arch="llama", vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                    intermediate_size=64, norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128)
    torch.manual_seed(seed)
    m = M.Transformer(a)
    with torch.no_grad():
        for _, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if p.dim() == 1 else std * torch.randn(p.shape))
    m.eval()
    m.setup_caches(64)
    return m


def batch_cache(m, B: int) -> M.KVCache:
    """A cache of B requests shaped like the model's own."""
    a = m.args
    return M.KVCache(a.n_layers, B, a.n_kv_heads, m.cache.rows, a.head_dim, torch.float32, "cpu")


@torch.no_grad()
def prefill(m, ids, cache=None, slot=None):
    """The prompt into the model's cache (or into request `slot` of `cache`). Returns logits (n, V)."""
    n = len(ids)
    pos = torch.arange(n)
    tri = torch.ones(n, n, dtype=torch.bool).tril()
    if cache is None:
        return m(torch.tensor([ids]), pos, pos, tri)[0]
    mask = M.attention_mask(tri, T([0]), torch.arange(cache.rows))          # (1, n, rows)
    return m(torch.tensor([ids]), pos, pos[None], mask, cache=cache, slots=T([slot]))[0]


@torch.no_grad()
def plain_decode(m, ids, n, s: Sampling = Sampling()):
    """Prefill, then one token per forward. Returns (the n chosen tokens, a snapshot of every layer's
    k/v after the last forward). tokens[0] is the root chosen from the prefill."""
    m.setup_caches(64)
    L = len(ids)
    logits = prefill(m, ids)
    toks = [int(choose1(logits[-1:], torch.tensor([L]), s)[0])]
    for p in range(L, L + n - 1):
        rows = torch.tensor([p])
        lg = m(torch.tensor([[toks[-1]]]), rows, rows, torch.ones(1, p + 1, dtype=torch.bool))[0]
        toks.append(int(choose1(lg, torch.tensor([p + 1]), s)[0]))
    kv = [(k.clone(), v.clone()) for k, v in zip(m.cache.k, m.cache.v)]
    return toks, kv


def one(v, b: int, got: tuple):
    """Request b of a verification: its commit() tuple and its rows of the device result."""
    acc, bonus, ret, nodes, finite = got
    return types.SimpleNamespace(accepted=acc, bonus_id=bonus, retrieved=ret, nodes=nodes, finite=finite,
                                 A=int(v.A[b]), path=v.path[b], logits=v.logits[b], target=v.target[b],
                                 feats=None if v.feats is None else v.feats[b])


@torch.no_grad()
def run_verify(m, tokens, parents, L, s: Sampling, capture=False, valid=None, window=False):
    """verify() of one request (a batch of one) on the model's own cache, as the engine calls it:
    static cols (the whole cache) or a window (rows 0..L+N-1). Checks what the step leaves behind
    (L advanced by A + 1, the bonus in root) and returns the request's result (one())."""
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
    tree = V.Tree(tokens[None], parents[None], valid[None])
    N = tokens.numel()
    Lt, root = T([L]), T([-1])
    cols = torch.arange(L + N if window else m.cache.rows)
    smp, mode = slot_sampling(s)
    v = V.verify(m, m.cache, tree, Lt, T([1]), cols, smp, mode, N, capture, root)
    [got] = V.commit(v, tree)
    r = one(v, 0, got)
    assert r.finite and r.nodes == int(valid.sum()) - 1 and r.retrieved == [0] * r.A
    assert int(Lt) == L + r.A + 1 and int(root) == r.bonus_id == int(v.bonus[0]) and len(r.accepted) == r.A
    return r


def path_of(v):
    return v.path[:len(v.accepted) + 1].tolist()


def other(tok: int, *avoid) -> int:
    """A token that is none of `avoid` (a wrong sibling)."""
    t = (tok + 17) % 64
    while t in avoid or t == tok:
        t = (t + 1) % 64
    return t


def forced_tree(g):
    """g = [r, g1, g2, g3, g4, ...] the plain continuation. A tree whose accepted path is r-g1-g2-g3
    (nodes 0, 2, 5, 7: not contiguous), with wrong siblings and a wrong child under g3."""
    r, g1, g2, g3, g4 = g[:5]
    w1, w2, w4 = other(g1), other(g2), other(g4)
    tokens = [r, w1, g1, w2, g2, g2, 3, g3, w4]
    parents = [-1, 0, 0, 2, 1, 2, 3, 5, 7]
    # node 4 (g2 under the wrong w1) and node 6 (under w2) are decoys that must not be accepted
    return T(tokens), T(parents), [0, 2, 5, 7]


def test_verify_commits_greedy_path_and_compacts_kv():
    m = tiny_model()
    L = len(PROMPT)
    # r, g1..g4 (g4 is the bonus after g3), and the cache after decoding r, g1, g2, g3 one by one
    g, ref_kv = plain_decode(m, PROMPT, 5)
    tokens, parents, want_path = forced_tree(g)

    m.setup_caches(64)                                 # fresh cache: prefill again, then one tree pass
    prefill(m, PROMPT)
    v = run_verify(m, tokens, parents, L, Sampling())
    assert path_of(v) == want_path
    assert v.accepted == g[1:4]
    assert v.bonus_id == g[4]
    assert v.logits.shape == (tokens.numel(), 64) and v.feats is None
    rows = L + len(v.accepted) + 1                     # rows 0..L+A
    for c_k, c_v, (k, vv) in zip(m.cache.k, m.cache.v, ref_kv):
        assert torch.allclose(c_k[:, :, :rows], k[:, :, :rows], atol=1e-5, rtol=0)
        assert torch.allclose(c_v[:, :, :rows], vv[:, :, :rows], atol=1e-5, rtol=0)


def test_verify_then_continue_matches_plain_decoding():
    # after a compacted verification, the next round decodes from the compacted cache exactly as plain
    m = tiny_model()
    L = len(PROMPT)
    g, _ = plain_decode(m, PROMPT, 10)
    tokens, parents, _ = forced_tree(g)
    m.setup_caches(64)
    prefill(m, PROMPT)
    v = run_verify(m, tokens, parents, L, Sampling())
    L += len(v.accepted) + 1
    # second round: a chain holding the next three greedy tokens, then a wrong one
    nxt = g[5:8]
    t2 = T([v.bonus_id] + nxt + [other(g[8])])
    v2 = run_verify(m, t2, torch.arange(5) - 1, L, Sampling(), window=True)
    assert [g[0]] + v.accepted + [v.bonus_id] + v2.accepted + [v2.bonus_id] == g[:9]


def test_verify_nothing_accepted():
    m = tiny_model()
    L = len(PROMPT)
    g, ref_kv = plain_decode(m, PROMPT, 2)             # cache after decoding r
    tokens = T([g[0], other(g[1]), other(g[1], other(g[1]))])
    m.setup_caches(64)
    prefill(m, PROMPT)
    v = run_verify(m, tokens, T([-1, 0, 0]), L, Sampling())
    assert (path_of(v), v.accepted, v.bonus_id) == ([0], [], g[1])
    for c_k, c_v, (k, vv) in zip(m.cache.k, m.cache.v, ref_kv):
        assert torch.allclose(c_k[:, :, :L + 1], k[:, :, :L + 1], atol=1e-5, rtol=0)
        assert torch.allclose(c_v[:, :, :L + 1], vv[:, :, :L + 1], atol=1e-5, rtol=0)


def test_verify_sampling_reproduces_plain_sampling():
    # lossless sampling: noise keyed by (seed, position) makes the tree pass emit the plain draws
    s = Sampling(temperature=0.8, top_p=0.9, seed=5)
    m = tiny_model()
    L = len(PROMPT)
    g, _ = plain_decode(m, PROMPT, 5, s)
    tokens, parents, want_path = forced_tree(g)
    m.setup_caches(64)
    prefill(m, PROMPT)
    v = run_verify(m, tokens, parents, L, s)
    assert path_of(v) == want_path
    assert v.accepted + [v.bonus_id] == g[1:5]


def test_verify_capture_returns_path_features():
    m = tiny_model()
    L = len(PROMPT)
    g, _ = plain_decode(m, PROMPT, 5)
    tokens, parents, want_path = forced_tree(g)
    m.setup_caches(64)
    prefill(m, PROMPT)
    v = run_verify(m, tokens, parents, L, Sampling(), capture=True)
    assert v.feats.shape == (tokens.numel(), 3 * 32)      # (P, 3*dim): the path first, then filler
    # the features of the accepted nodes equal those of a one-by-one decode of the same tokens
    m.setup_caches(64)
    prefill(m, PROMPT)
    feats = []
    with torch.no_grad():
        for i, t in enumerate([g[0]] + g[1:4]):
            p = L + i
            rows = torch.tensor([p])
            _, f = m(torch.tensor([[t]]), rows, rows, torch.ones(1, p + 1, dtype=torch.bool), capture=True)
            feats.append(f[0, 0])
    assert torch.allclose(v.feats[:len(want_path)], torch.stack(feats), atol=1e-4, rtol=1e-5)   # features reach ~20


def padded(tokens, parents, N):
    """A tree padded to N nodes with dummies (parent 0, token 1) that are not real."""
    n = tokens.numel()
    valid = torch.arange(N) < n
    return (torch.cat([tokens, T([1] * (N - n))]), torch.cat([parents, T([0] * (N - n))]), valid)


@torch.no_grad()
def test_verify_batch_rows_equal_each_request_alone():
    """Three requests with their own prompts (so their own L), trees (padded to one N), sampling and
    cache rows, and an empty fourth slot, verified in one pass: each request's path, bonus, logits,
    path features and cache rows are those of verifying it alone; the empty slot stays at L = 0 and
    commits nothing."""
    m = tiny_model()
    s = Sampling(temperature=0.8, top_p=0.9, seed=5)
    reqs = [(PROMPT, Sampling()), ([1, 7, 8, 30, 2], s), ([4, 4, 9, 60, 11, 12, 13, 50, 2, 33, 21], Sampling())]
    N = 9
    alone, trees = [], []
    for b, (ids, smp_b) in enumerate(reqs):
        g, _ = plain_decode(m, ids, 6, smp_b)
        if b == 0:
            tokens, parents, _ = forced_tree(g)                                  # accepts 3
        elif b == 1:
            tokens, parents = T(g[:4] + [other(g[4])]), torch.arange(5) - 1      # a chain: accepts 3 of 4
        else:
            tokens, parents = T([g[0], other(g[1]), g[1]]), T([-1, 0, 0])        # accepts 1
        tokens, parents, valid = padded(tokens, parents, N)
        m.setup_caches(64)
        prefill(m, ids)
        r = run_verify(m, tokens, parents, len(ids), smp_b, capture=True, valid=valid)
        rows = len(ids) + r.A + 1
        alone.append((r, [(k[:, :, :rows].clone(), v[:, :, :rows].clone()) for k, v in zip(m.cache.k, m.cache.v)]))
        trees.append((tokens, parents, valid))
    assert [r.A for r, _ in alone] == [3, 3, 1]

    B = 4
    cache = batch_cache(m, B)
    for b, (ids, _) in enumerate(reqs):
        prefill(m, ids, cache, b)
    empty = (T([0] * N), T([-1] + [0] * (N - 1)), torch.zeros(N, dtype=torch.bool))
    tokens, parents, valid = (torch.stack([t[i] for t in trees + [empty]]) for i in range(3))
    tree = V.Tree(tokens, parents, valid)
    L0 = [len(ids) for ids, _ in reqs] + [0]
    L, active, root = T(L0), T([1, 1, 1, 0]), T([-1] * B)
    smp, mode = slot_sampling(*[x for _, x in reqs], Sampling())
    v = V.verify(m, cache, tree, L, active, torch.arange(cache.rows), smp, mode, N, True, root)
    got = V.commit(v, tree)
    assert v.A.shape == v.bonus.shape == v.finite.shape == (B,) and v.path.shape == (B, N)
    assert v.logits.shape == (B, N, 64) and v.feats.shape == (B, N, 96)
    for b, (r, kv) in enumerate(alone):
        w = one(v, b, got[b])
        assert (w.accepted, w.bonus_id, w.nodes, w.finite) == (r.accepted, r.bonus_id, r.nodes, True), b
        assert torch.equal(w.path[:w.A + 1], r.path[:r.A + 1]), b
        real = trees[b][2]
        assert torch.allclose(w.logits[real], r.logits[real], atol=1e-5, rtol=0), b
        assert torch.allclose(w.feats[:w.A + 1], r.feats[:r.A + 1], atol=1e-4, rtol=1e-5), b
        assert int(L[b]) == L0[b] + r.A + 1 and int(root[b]) == r.bonus_id
        rows = L0[b] + r.A + 1
        for i, (k, vv) in enumerate(kv):
            assert torch.allclose(cache.k[i][b:b + 1, :, :rows], k, atol=1e-5, rtol=0), (b, i)
            assert torch.allclose(cache.v[i][b:b + 1, :, :rows], vv, atol=1e-5, rtol=0), (b, i)
    acc, _, _, nodes, finite = got[3]                 # the empty slot: nothing real, L stays 0
    assert int(L[3]) == 0 and acc == [] and nodes == -1 and finite


# ----------------------------------------------------------------------------- static shapes: padding, windows

def test_accept_never_takes_padding_even_when_it_matches():
    # node 2 is padding carrying exactly the target's token at the root; node 3 hangs under it
    tokens, parents, valid = [100, 10, 11, 20], [-1, 0, 0, 2], [True, True, False, True]
    target = [11, 5, 20, 7]
    assert run_accept(tokens, parents, target, valid) == ([0], 11, 0)


def test_tree_mask_padding_sees_only_itself():
    mask, depth = tree_mask1(T([-1, 0, 0, 1]), T([True, True, False, True], torch.bool))
    assert mask[2].tolist() == [False, False, True, False] and depth.tolist() == [0, 1, 0, 2]


def test_attention_mask_exact():
    # 2 committed rows, a round of 3 rows (tree: 0; 1 under 0; 2 under 0), 6 cache rows in all
    tree = T([[1, 0, 0], [1, 1, 0], [1, 0, 1]], torch.bool)
    got = M.attention_mask(tree, T([2]), torch.arange(6))
    assert got.shape == (1, 3, 6)
    assert got[0].int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0]]
    # a window of just the rows in use gives the same leading columns
    assert torch.equal(M.attention_mask(tree, T([2]), torch.arange(5)), got[:, :, :5])


def test_attention_mask_batch_rows_each_at_their_own_length():
    # three requests at committed lengths 2, 0 and 3, with a tree each (B, N, W) or one shared (N, W):
    # row b is that request's mask alone
    trees = T([[[1, 0, 0], [1, 1, 0], [1, 0, 1]],
               [[1, 0, 0], [1, 1, 0], [1, 1, 1]],
               [[1, 0, 0], [0, 1, 0], [0, 0, 1]]], torch.bool)
    L, cols = T([2, 0, 3]), torch.arange(7)
    got = M.attention_mask(trees, L, cols)
    assert got.shape == (3, 3, 7)
    for b in range(3):
        assert torch.equal(got[b], M.attention_mask(trees[b], L[b:b + 1], cols)[0]), b
    assert got[1].int().tolist() == [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0]]
    assert got[2].int().tolist() == [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 1, 0]]
    shared = M.attention_mask(trees[0], L, cols)
    for b in range(3):
        assert torch.equal(shared[b], M.attention_mask(trees[0], L[b:b + 1], cols)[0]), b


def test_padding_changes_nothing():
    """The same tree padded with dummy nodes (whose tokens equal the plain continuation) commits the
    same path, the same logits at real nodes, and the same cache rows."""
    m = tiny_model()
    L = len(PROMPT)
    g, ref_kv = plain_decode(m, PROMPT, 5)
    tokens, parents, want = forced_tree(g)
    m.setup_caches(64)
    prefill(m, PROMPT)
    v = run_verify(m, tokens, parents, L, Sampling())
    logits = v.logits.clone()
    m.setup_caches(64)
    prefill(m, PROMPT)
    pad = 4
    tp = torch.cat([tokens, T(g[1:1 + pad])])            # tempting tokens: a real node would be accepted
    pp = torch.cat([parents, T([0, 9, 10, 11])])
    vp = torch.cat([torch.ones(tokens.numel(), dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)])
    w = run_verify(m, tp, pp, L, Sampling(), valid=vp)
    assert path_of(w) == want and w.accepted == v.accepted and w.bonus_id == v.bonus_id
    assert torch.allclose(w.logits[:tokens.numel()], logits, atol=1e-5, rtol=0)
    rows = L + len(w.accepted) + 1
    for c_k, (k, _) in zip(m.cache.k, ref_kv):
        assert torch.allclose(c_k[:, :, :rows], k[:, :, :rows], atol=1e-5, rtol=0)


@torch.no_grad()
def test_decode_one_token_is_plain_decoding():
    m = tiny_model()
    g, ref_kv = plain_decode(m, PROMPT, 6)
    m.setup_caches(64)
    logits = prefill(m, PROMPT)
    L, active = T([len(PROMPT)]), T([1])
    smp, mode = slot_sampling(Sampling())
    root = choose1(logits[-1:], L, Sampling())
    got = [int(root)]
    for _ in range(5):
        v = V.decode(m, m.cache, root, L, active, torch.arange(int(L) + 1), smp, mode)
        got.append(int(root))
        assert int(v.bonus[0]) == int(root) and v.A.tolist() == [0] and v.path.tolist() == [[0]]
        assert bool(v.finite[0]) and v.logits.shape == (1, 1, 64)
    assert got == g and int(L) == len(PROMPT) + 5
    for c_k, (k, _) in zip(m.cache.k, ref_kv):
        assert torch.allclose(c_k[:, :, :int(L)], k[:, :, :int(L)], atol=1e-5, rtol=0)


@torch.no_grad()
def test_decode_batch_rows_are_plain_decoding_of_each_request():
    """Three requests (greedy and two sampled, different prompt lengths) and an empty slot decode
    side by side: each emits its own plain decoding; the empty slot's L stays 0."""
    m = tiny_model()
    reqs = [(PROMPT, Sampling()), ([1, 7, 8, 30, 2], Sampling(temperature=0.8, top_p=0.9, seed=5)),
            ([4, 4, 9, 60, 11, 12, 13, 50, 2, 33, 21], Sampling(temperature=1.1, top_k=8, seed=2))]
    want = [plain_decode(m, ids, 6, s)[0] for ids, s in reqs]
    cache = batch_cache(m, 4)
    roots = []
    for b, (ids, s) in enumerate(reqs):
        roots.append(int(choose1(prefill(m, ids, cache, b)[-1:], T([len(ids)]), s)[0]))
    L0 = [len(ids) for ids, _ in reqs] + [0]
    L, active, root = T(L0), T([1, 1, 1, 0]), T(roots + [0])
    smp, mode = slot_sampling(*[s for _, s in reqs], Sampling())
    got = [[r] for r in roots]
    for _ in range(5):
        v = V.decode(m, cache, root, L, active, torch.arange(max(L.tolist()) + 1), smp, mode)
        assert v.finite.all()
        for b in range(3):
            got[b].append(int(root[b]))
    assert got == want
    assert L.tolist() == [n + 5 for n in L0[:3]] + [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rows_finite_sees_one_bad_logit_in_a_real_row_and_ignores_padding(dtype):
    """In every dtype (bfloat16 sums in place, float16 in float32)."""
    from verify import rows_finite
    x = torch.randn(1, 4, 1000).to(dtype)
    valid = torch.tensor([[True, True, False, True]])
    assert rows_finite(x).tolist() == [True] and rows_finite(x, valid).tolist() == [True]
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[0, 1, 537] = bad
        assert not bool(rows_finite(y)) and not bool(rows_finite(y, valid))
        y = x.clone()
        y[0, 2, 5] = bad                                # a padding row: junk is allowed there
        assert bool(rows_finite(y, valid)) and not bool(rows_finite(y))
    big = torch.full((1, 1, 49152), 60000.0, dtype=torch.float16)    # a fp16 row whose fp16 sum would overflow
    assert bool(rows_finite(big))


def test_rows_finite_is_per_request():
    from verify import rows_finite
    x = torch.randn(3, 4, 50)
    valid = torch.tensor([[True] * 4, [True, True, False, False], [True] * 4])
    x[0, 3, 7] = float("nan")                          # request 0: a real row
    x[1, 2, 1] = float("inf")                          # request 1: padding only
    assert rows_finite(x, valid).tolist() == [False, True, True]
    assert rows_finite(x).tolist() == [False, False, True]
    for b in range(3):
        assert rows_finite(x, valid)[b] == rows_finite(x[b:b + 1], valid[b:b + 1])[0]


def test_commit_reports_each_request_retrieved_flags_and_nodes():
    # commit() on a hand-made result: per request its accepted tokens, bonus, retrieved flags of the
    # accepted nodes, real candidates and finiteness, from one transfer
    tree = V.Tree(T([[9, 10, 11, 12], [5, 6, 7, 8]]), T([[-1, 0, 1, 0], [-1, 0, 0, 2]]),
                  T([[1, 1, 1, 1], [1, 1, 1, 0]], torch.bool), T([[0, 0, 1, 1], [0, 1, 0, 0]], torch.bool))
    v = V.Verified(A=T([2, 0]), bonus=T([40, 41]), path=T([[0, 1, 2, 3], [0, 1, 2, 3]]), logits=None, target=None,
                   feats=None, finite=T([True, False], torch.bool))
    assert V.commit(v, tree) == [([10, 11], 40, [0, 1], 3, True), ([], 41, [], 2, False)]
