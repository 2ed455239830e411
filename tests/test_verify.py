"""verify.py: tree geometry, greedy/sampled acceptance, logit warping, KV compaction.

Everything is hand-made and tiny: trees are written out node by node, logits are crafted, and the
one model is a 3-layer random model.Transformer built directly from a ModelArgs (no checkpoint).
CPU, float32.
"""
import math
import sys
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
    mask, depth = V.tree_mask(parents)
    want = mask_from_ancestors([{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 1, 3, 5}, {0, 2, 6}])
    assert mask.dtype == torch.bool
    assert torch.equal(mask, want)
    assert depth.tolist() == [0, 1, 1, 2, 2, 3, 2]


@pytest.mark.parametrize("N", [2, 5, 8, 9, 17, 33, 64])
def test_tree_mask_chain(N):
    # a chain is the worst case for the squaring trick: depth N-1 must still be reached
    parents = torch.arange(N) - 1
    mask, depth = V.tree_mask(parents)
    assert torch.equal(mask, torch.ones(N, N, dtype=torch.bool).tril())
    assert depth.tolist() == list(range(N))


def test_tree_mask_star():
    parents = T([-1, 0, 0, 0, 0])
    mask, depth = V.tree_mask(parents)
    want = torch.eye(5, dtype=torch.bool)
    want[:, 0] = True
    assert torch.equal(mask, want)
    assert depth.tolist() == [0, 1, 1, 1, 1]


def test_tree_mask_single_root():
    mask, depth = V.tree_mask(T([-1]))
    assert torch.equal(mask, T([[True]], torch.bool))
    assert depth.tolist() == [0]


# ----------------------------------------------------------------------------- accept

def run_accept(tokens, parents, target, valid=None):
    tokens, parents, target = T(tokens), T(parents), T(target)
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else T(valid, torch.bool)
    mask, depth = V.tree_mask(parents, valid)
    A, bonus, path = V.accept(tokens, parents, valid, mask, depth, target, tokens.numel())
    A = int(A)
    return path[:A + 1].tolist(), int(bonus), A


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


def test_accept_path_root_first_when_nodes_interleaved():
    # the accepted path's nodes are not contiguous and appear after unrelated nodes
    parents = [-1, 0, 0, 2, 1, 3, 4]
    tokens = [100, 50, 10, 20, 51, 30, 52]
    target = [10, 0, 20, 30, 0, 44, 0]
    path, bonus, A = run_accept(tokens, parents, target)
    assert (path, bonus, A) == ([0, 2, 3, 5], 44, 3)


# ----------------------------------------------------------------------------- warp

def test_warp_temperature_only():
    logits = T([[1.0, -2.0, 0.5, 3.0]], torch.float32)
    out = V.warp(logits, Sampling(temperature=0.5))
    assert torch.allclose(out, logits / 0.5)


def test_warp_top_k_exact_mask():
    logits = T([[1.0, 5.0, 3.0, 4.0, 2.0],
                [0.0, -1.0, 2.0, 2.5, -3.0]], torch.float32)
    out = V.warp(logits, Sampling(temperature=1.0, top_k=2))
    assert torch.isinf(out).tolist() == [[True, False, True, False, True],
                                         [True, True, False, False, True]]
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])


def test_warp_top_k_keeps_ties_at_kth():
    logits = T([[3.0, 1.0, 3.0, 0.0]], torch.float32)
    out = V.warp(logits, Sampling(temperature=1.0, top_k=1))
    assert torch.isinf(out).tolist() == [[False, True, False, True]]


def test_warp_top_k_off_and_not_smaller_than_vocab():
    logits = torch.randn(3, 6)
    assert torch.equal(V.warp(logits, Sampling(temperature=1.0, top_k=0)), logits)
    assert torch.equal(V.warp(logits, Sampling(temperature=1.0, top_k=6)), logits)


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
    out = V.warp(logits, Sampling(temperature=1.0, top_p=top_p))
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == removed
    keep = [i for i in range(4) if i not in removed]
    assert torch.equal(out[0, keep], logits[0, keep])


def test_warp_top_p_applies_after_temperature():
    # at T = 0.5 the tempered probabilities are p^2 / sum p^2 = [.0068, .6803, .0612, .2449] (approx);
    # top_p 0.9 then drops tokens 0 and 2 (cumsum 0.0068, 0.068 <= 0.1), which at T = 1 it would not
    probs = T([0.05, 0.5, 0.15, 0.3], torch.float64)
    logits = probs.log().float()[None]
    out = V.warp(logits, Sampling(temperature=0.5, top_p=0.9))
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [0, 2]


def test_warp_top_k_then_top_p():
    # top_k=3 removes token 0 first; renormalised [.5, .15, .3]/.95 -> ascending cumsum .158, .474:
    # top_p 0.8 drops mass <= 0.2, i.e. token 2 as well
    probs = T([0.05, 0.5, 0.15, 0.3], torch.float64)
    logits = probs.log().float()[None]
    out = V.warp(logits, Sampling(temperature=1.0, top_k=3, top_p=0.8))
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [0, 2]


# ----------------------------------------------------------------------------- choose

def test_choose_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(20, 50, generator=g)
    got = V.choose(logits, torch.arange(20), Sampling())
    assert torch.equal(got, logits.argmax(-1))


SAMP = Sampling(temperature=0.8, top_p=0.9, seed=7)


def test_choose_sampling_deterministic_for_seed_and_position():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 1000, generator=g) * 0.1        # near uniform: the noise decides
    pos = torch.tensor([42])
    first = V.choose(logits, pos, SAMP)
    for _ in range(3):
        assert torch.equal(V.choose(logits, pos, SAMP), first)
    # same position inside a batch (as a tree node) draws the same token
    batch = V.choose(logits.expand(4, -1), torch.tensor([3, 42, 42, 9]), SAMP)
    assert int(batch[1]) == int(first) and int(batch[2]) == int(first)


def test_choose_sampling_differs_across_positions():
    logits = torch.zeros(64, 1000)
    got = V.choose(logits, torch.arange(100, 164), SAMP)
    assert len(set(got.tolist())) > 48, got.tolist()


def test_choose_sampling_differs_across_seeds():
    logits = torch.zeros(64, 1000)
    pos = torch.arange(64)
    a = V.choose(logits, pos, Sampling(temperature=0.8, top_p=0.9, seed=1))
    b = V.choose(logits, pos, Sampling(temperature=0.8, top_p=0.9, seed=2))
    assert (a != b).sum() > 48


def test_choose_sampling_never_picks_removed_tokens():
    N = 3000
    pos = torch.arange(N)
    # top-k: 2 survivors (3, 7) of 10
    lk = torch.zeros(10)
    lk[3], lk[7], lk[1] = 2.0, 1.9, 1.8
    got = V.choose(lk.expand(N, -1), pos, Sampling(temperature=0.8, top_k=2, seed=3))
    assert set(got.tolist()) == {3, 7}
    # top-p: tempered probabilities (T * log p / T = log p) .5, .3, .15, .05 -> 0.9 keeps tokens 0, 1, 2
    probs = T([0.5, 0.3, 0.15, 0.05], torch.float64)
    lp = (0.8 * probs.log()).float()
    got = V.choose(lp.expand(N, -1), pos, Sampling(temperature=0.8, top_p=0.9, seed=4))
    assert set(got.tolist()) == {0, 1, 2}


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = probs * n
    return float(((counts - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("seed", [0, 11])
def test_choose_sampling_distribution_matches_softmax(seed):
    N, Tmp = 4000, 0.8
    logits = T([1.0, 0.2, -0.5, 0.7, -1.5], torch.float32)
    got = V.choose(logits.expand(N, -1), torch.arange(N) + 1000 * seed, Sampling(temperature=Tmp, seed=seed))
    counts = torch.bincount(got, minlength=5).double()
    want = (logits.double() / Tmp).softmax(-1)
    # 4 degrees of freedom: P(chi2 > 30) ~ 5e-6
    assert chi2(counts, want) < 30, (counts.tolist(), (want * N).tolist())


def test_choose_sampling_distribution_matches_warped():
    N, Tmp = 4000, 0.8
    probs = T([0.5, 0.3, 0.15, 0.05, 1e-3], torch.float64)
    logits = (Tmp * probs.log()).float()
    got = V.choose(logits.expand(N, -1), torch.arange(N), Sampling(temperature=Tmp, top_p=0.9, seed=5))
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


# ----------------------------------------------------------------------------- verify + KV compaction

PROMPT = [1, 5, 9, 13, 22, 40, 3]


def tiny_model(seed: int = 2, std: float = 0.3) -> M.Transformer:
    """3 layers, GQA (4 q heads, 2 kv heads), vocab 64; weights ~ N(0, std), norms ~ 1 + N(0, .1)."""
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


@torch.no_grad()
def prefill(m, ids):
    n = len(ids)
    pos = torch.arange(n)
    return m(torch.tensor([ids]), pos, pos, torch.ones(n, n, dtype=torch.bool).tril())[0]   # (n, V)


@torch.no_grad()
def plain_decode(m, ids, n, s: Sampling = Sampling()):
    """Prefill, then one token per forward. Returns (the n chosen tokens, a snapshot of every layer's
    k/v after the last forward). tokens[0] is the root chosen from the prefill."""
    L = len(ids)
    logits = prefill(m, ids)
    toks = [int(V.choose(logits[-1:], torch.tensor([L]), s)[0])]
    for p in range(L, L + n - 1):
        rows = torch.tensor([p])
        lg = m(torch.tensor([[toks[-1]]]), rows, rows, torch.ones(1, p + 1, dtype=torch.bool))[0]
        toks.append(int(V.choose(lg, torch.tensor([p + 1]), s)[0]))
    kv = [(k.clone(), v.clone()) for k, v in zip(m.cache.k, m.cache.v)]
    return toks, kv


def run_verify(m, tokens, parents, L, s: Sampling, capture=False, valid=None, window=False):
    """verify() as the engine calls it: static cols (the whole cache) or a window (rows 0..L+N-1)."""
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
    tree = V.Tree(tokens, parents, valid)
    N = tokens.numel()
    cols = torch.arange(L + N if window else m.cache.rows)
    v = V.verify(m, tree, torch.tensor(L), cols, s, torch.tensor(s.seed), N, capture=capture)
    return V.commit(v, tree)


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


# ----------------------------------------------------------------------------- static shapes: padding, windows

def test_accept_never_takes_padding_even_when_it_matches():
    # node 2 is padding carrying exactly the target's token at the root; node 3 hangs under it
    tokens, parents, valid = [100, 10, 11, 20], [-1, 0, 0, 2], [True, True, False, True]
    target = [11, 5, 20, 7]
    assert run_accept(tokens, parents, target, valid) == ([0], 11, 0)


def test_tree_mask_padding_sees_only_itself():
    mask, depth = V.tree_mask(T([-1, 0, 0, 1]), T([True, True, False, True], torch.bool))
    assert mask[2].tolist() == [False, False, True, False] and depth.tolist() == [0, 1, 0, 2]


def test_attention_mask_exact():
    # 2 committed rows, a round of 3 rows (tree: 0; 1 under 0; 2 under 0), 6 cache rows in all
    tree = T([[1, 0, 0], [1, 1, 0], [1, 0, 1]], torch.bool)
    got = M.attention_mask(tree, torch.tensor(2), torch.arange(6))
    assert got.int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0]]
    # a window of just the rows in use gives the same leading columns
    assert torch.equal(M.attention_mask(tree, torch.tensor(2), torch.arange(5)), got[:, :5])


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


def test_decode_one_token_is_plain_decoding():
    m = tiny_model()
    g, ref_kv = plain_decode(m, PROMPT, 6)
    m.setup_caches(64)
    logits = prefill(m, PROMPT)
    L = torch.tensor(len(PROMPT))
    tok = V.choose(logits[-1:], L.view(1), Sampling())
    got = [int(tok)]
    for _ in range(5):
        tok, finite = V.decode_one_token(m, tok, L, torch.arange(int(L) + 1), Sampling(), torch.tensor(0))
        got.append(int(tok))
        assert bool(finite)
    assert got == g and int(L) == len(PROMPT) + 5


def test_rows_finite_sees_one_bad_logit_in_a_real_row_and_ignores_padding():
    from verify import rows_finite
    x = torch.randn(4, 1000)
    valid = torch.tensor([True, True, False, True])
    assert bool(rows_finite(x)) and bool(rows_finite(x, valid))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 537] = bad
        assert not bool(rows_finite(y)) and not bool(rows_finite(y, valid))
        y = x.clone()
        y[2, 5] = bad                                   # a padding row: junk is allowed there
        assert bool(rows_finite(y, valid)) and not bool(rows_finite(y))
    big = torch.full((1, 49152), 60000.0, dtype=torch.float16)    # a fp16 row whose fp16 sum would overflow
    assert bool(rows_finite(big))
