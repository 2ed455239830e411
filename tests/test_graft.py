"""graft.py: the continuation matrix, retrieval templates, threshold calibration and hybrid trees.

Hand-made matrices, logits and trees with exact expected outputs, plus a few seeded property checks.
CPU only, no model except the last section (the graft-tail anchor in generate.py).
"""
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import calibrate as CAL  # noqa: E402
import engine as E  # noqa: E402
import graft as GR  # noqa: E402
from calibrate import youden_threshold  # noqa: E402
from graft import ContinuationMatrix, build_template, graft_trees  # noqa: E402

torch.set_num_threads(1)


def T(x, dtype=torch.long):
    return torch.tensor(x, dtype=dtype)


def ranked_logits(rankings: list, vocab: int = 10) -> torch.Tensor:
    """One row per ranking: the listed tokens get 10, 9, 8, ...; every other token gets a low value."""
    out = torch.full((len(rankings), vocab), -5.0)
    for i, r in enumerate(rankings):
        for j, t in enumerate(r):
            out[i, t] = 10.0 - j
        # make the unlisted ones distinct too, all below the listed ones
        rest = [t for t in range(vocab) if t not in r]
        for j, t in enumerate(rest):
            out[i, t] = -5.0 - 0.1 * j
    return out


# ----------------------------------------------------------------------------- ContinuationMatrix.update
def upd(cm, tokens, logits, path=None):
    """update() with every node real; `path` the accepted path's nodes (root first)."""
    valid = torch.ones_like(tokens, dtype=torch.bool)
    if path is None:
        return cm.update(tokens, logits, valid)
    return cm.update(tokens, logits, valid, path, torch.tensor(path.numel() - 1))


def rec(cm, tokens, target):
    cm.record(tokens, target, torch.ones_like(tokens, dtype=torch.bool))


ROWS = [[9, 1, 4], [0, 3, 8], [6, 5, 2], [1, 2, 3]]      # the top-3 of each node's logits


def test_update_writes_topk_rows():
    cm = ContinuationMatrix(10, k=3)
    upd(cm, T([2, 5, 2, 7]), ranked_logits(ROWS))
    # token 2 occurs at nodes 0 and 2, no accepted path: the later node wins
    assert cm.M[2].tolist() == [6, 5, 2]
    assert cm.M[5].tolist() == [0, 3, 8]
    assert cm.M[7].tolist() == [1, 2, 3]
    assert cm.M.dtype == torch.int32
    assert cm.written[:10].nonzero().flatten().tolist() == [2, 5, 7]
    assert (cm.M[[0, 1, 3, 4, 6, 8, 9]] == T([0, 1, 2]).int()).all()   # untouched rows: the fallback


def test_update_accepted_path_wins():
    cm = ContinuationMatrix(10, k=3)
    upd(cm, T([2, 5, 2, 7]), ranked_logits(ROWS), path=T([0, 1]))
    assert cm.M[2].tolist() == [9, 1, 4]                       # node 0 is on the path, node 2 is not
    assert cm.M[5].tolist() == [0, 3, 8]


def test_update_token_twice_on_path_later_wins():
    cm = ContinuationMatrix(10, k=3)
    upd(cm, T([2, 5, 2, 7]), ranked_logits(ROWS), path=T([0, 2, 3]))
    assert cm.M[2].tolist() == [6, 5, 2]


def test_update_later_node_wins_regardless_of_position_in_batch():
    cm = ContinuationMatrix(10, k=3)
    upd(cm, T([7, 2, 7, 7]), ranked_logits(ROWS))
    assert cm.M[7].tolist() == [1, 2, 3]                       # node 3, the last one with token 7
    cm2 = ContinuationMatrix(10, k=3)
    upd(cm2, T([7, 2, 7, 7]), ranked_logits(ROWS), path=T([0, 1]))
    assert cm2.M[7].tolist() == [9, 1, 4]                      # node 0: the only path node with token 7


def test_update_overwrites_rows_whole():
    cm = ContinuationMatrix(10, k=3)
    upd(cm, T([4]), ranked_logits([[1, 2, 3]]))
    upd(cm, T([4]), ranked_logits([[7, 8, 0]]))
    assert cm.M[4].tolist() == [7, 8, 0]


def test_unwritten_rows_fall_back_to_unigram_topk():
    cm = ContinuationMatrix(10, k=3)
    upd(cm, T([2]), ranked_logits([[6, 5, 2]]))
    assert cm.rows(T([8, 2])).tolist() == [[0, 1, 2], [6, 5, 2]]       # before warm-up: arange(k)
    rec(cm, T([0, 0, 0, 0, 0, 0]), T([4, 4, 4, 9, 9, 1]))             # target choices: 4 x3, 9 x2, 1 x1
    cm.refresh_fallback()
    assert cm.fallback.tolist() == [4, 9, 1]
    assert cm.rows(T([8, 3, 2])).tolist() == [[4, 9, 1], [4, 9, 1], [6, 5, 2]]
    assert not cm.written[8]


def test_refresh_fallback_without_counts_keeps_arange():
    cm = ContinuationMatrix(10, k=3)
    cm.refresh_fallback()
    assert cm.fallback.tolist() == [0, 1, 2]


def test_record_counts_per_rank_hits():
    cm = ContinuationMatrix(10, k=3)
    upd(cm, T([2, 5, 7]), ranked_logits([[6, 5, 2], [0, 3, 8], [1, 2, 3]]))
    #            token:  2  2  5  7  7  4 (unwritten: fallback 0, 1, 2)
    rec(cm, T([2, 2, 5, 7, 7, 4]), T([5, 6, 8, 3, 0, 1]))
    #           rank:    1  0  2  2  miss  1
    assert cm.hits.tolist() == [1.0, 2.0, 2.0, 1.0]
    assert torch.allclose(cm.hit_rates(), T([1 / 6, 2 / 6, 2 / 6], torch.float32))
    assert cm.counts[[5, 6, 8, 3, 0, 1]].tolist() == [1.0] * 6 and cm.counts.sum() == 6
    rec(cm, T([2]), T([6]))
    assert cm.hits.tolist() == [2.0, 2.0, 2.0, 1.0]


def test_hit_rates_none_before_any_record():
    assert ContinuationMatrix(10, k=3).hit_rates() is None


def test_state_dict_round_trip():
    cm = ContinuationMatrix(10, k=3)
    upd(cm, T([2, 5]), ranked_logits([[6, 5, 2], [0, 3, 8]]))
    rec(cm, T([2, 4]), T([5, 9]))
    cm2 = ContinuationMatrix(10, k=3)
    cm2.load_state_dict(cm.state_dict())
    for name, x in cm.state_dict().items():
        assert torch.equal(x, cm2.state_dict()[name]), name
    with pytest.raises(ValueError):
        ContinuationMatrix(12, k=3).load_state_dict(cm.state_dict())


# ----------------------------------------------------------------------------- build_template

def test_build_template_exact_small():
    tpl = build_template((0.5, 0.25), 4)
    # best first: r0 (.5), then the .25 tie: root rank 1 before r0-r0 (it was offered first), then r0-r1
    assert tpl.parents.tolist() == [-1, -1, 0, 0]
    assert tpl.ranks.tolist() == [0, 1, 0, 1]
    assert tpl.depth.tolist() == [1, 1, 2, 2]
    assert tpl.size == 4 and tpl.widths() == [2, 2]


def test_build_template_exact_six():
    tpl = build_template((0.5, 0.25), 6)
    # .125 ties: r0-r1 (offered first), r1-r0, r0-r0-r0
    assert tpl.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert tpl.ranks.tolist() == [0, 1, 0, 1, 0, 0]
    assert tpl.depth.tolist() == [1, 1, 2, 2, 2, 3]


def test_build_template_depth_cap():
    tpl = build_template((0.5, 0.25), 6, max_depth=2)
    assert tpl.parents.tolist() == [-1, -1, 0, 0, 1, 1]
    assert tpl.ranks.tolist() == [0, 1, 0, 1, 0, 1]
    assert int(tpl.depth.max()) == 2
    deep = build_template(GR.PRIOR_HIT_RATES, 80, max_depth=3)
    assert int(deep.depth.max()) == 3 and deep.size == 80


def path_score(tpl, j, rates):
    s = 1.0
    while j >= 0:
        s *= rates[int(tpl.ranks[j])]
        j = int(tpl.parents[j])
    return s


@pytest.mark.parametrize("n", [1, 20, 36, 52, 80])
def test_build_template_structure(n):
    rates = GR.PRIOR_HIT_RATES
    tpl = build_template(rates, n)
    P, R, Dp = tpl.parents, tpl.ranks, tpl.depth
    assert tpl.size == n
    assert ((P >= -1) & (P < torch.arange(n))).all()                     # parents before children
    assert ((R >= 0) & (R < len(rates))).all()
    for j in range(n):                                                   # depth = parent's depth + 1
        assert int(Dp[j]) == (1 if P[j] < 0 else int(Dp[P[j]]) + 1)
    # no two siblings share a rank
    pairs = set(zip(P.tolist(), R.tolist()))
    assert len(pairs) == n
    # best-first: path scores never increase along the node order
    scores = [path_score(tpl, j, rates) for j in range(n)]
    assert all(a >= b - 1e-12 for a, b in zip(scores, scores[1:]))
    # it is the best prefix-closed set: no unchosen child of a chosen node (or of the root) beats the worst
    worst = min(scores)
    for p in [-1] + list(range(n)):
        if p >= 0 and int(Dp[p]) >= GR.MAX_TEMPLATE_DEPTH:
            continue
        base = 1.0 if p < 0 else scores[p]
        for r, a in enumerate(rates):
            if (p, r) not in pairs:
                assert base * a <= worst + 1e-12
    # levels: one (idx, parent, rank) triple per depth, covering every node once
    seen = []
    for d, (idx, par, rank) in enumerate(tpl.levels, start=1):
        assert (Dp[idx] == d).all()
        assert torch.equal(par, P[idx]) and torch.equal(rank, R[idx])
        seen += idx.tolist()
    assert sorted(seen) == list(range(n))


def test_build_template_prior_52_resembles_paper():
    tpl = build_template(GR.PRIOR_HIT_RATES, 52)
    w = tpl.widths()
    # the paper's 52-node template: 8, 10, 8, 6, 5, 4, 4, 4, 3 (9 levels, root width 8)
    assert sum(w) == 52
    assert 8 <= len(w) <= 9, w
    assert w[0] >= 6, w
    assert max(w) <= 16, w
    # asymmetric: the deepest node sits at the end of the rank-0 chain
    deepest = int(torch.argmax(tpl.depth))
    j = deepest
    while j >= 0:
        assert int(tpl.ranks[j]) == 0, w
        j = int(tpl.parents[j])


# ----------------------------------------------------------------------------- retrieve

def test_retrieve_exact():
    cm = ContinuationMatrix(10, k=3)
    cm.M[3] = T([7, 1, 4], torch.int32)
    cm.M[7] = T([2, 5, 6], torch.int32)
    cm.M[2] = T([8, 9, 0], torch.int32)
    cm.written[[3, 7, 2]] = True
    tpl = build_template((0.5, 0.25), 4)                 # parents -1 -1 0 0, ranks 0 1 0 1
    assert cm.retrieve(T(3), tpl).tolist() == [7, 1, 2, 5]
    tpl6 = build_template((0.5, 0.25), 6)                # + (parent 1, rank 0), (parent 2, rank 0)
    # node 4 hangs under token 1, whose row was never written: the fallback's rank 0 (0)
    assert cm.retrieve(T(3), tpl6).tolist() == [7, 1, 2, 5, 0, 8]


def test_retrieve_random_matches_definition():
    g = torch.Generator().manual_seed(0)
    V, k = 30, 8
    cm = ContinuationMatrix(V, k)
    cm.update(torch.arange(V), torch.randn(V, V, generator=g), torch.ones(V, dtype=torch.bool))
    tpl = build_template(GR.PRIOR_HIT_RATES, 52)
    out = cm.retrieve(T(11), tpl)
    assert out.dtype == torch.long and out.shape == (52,)
    for j in range(52):
        par_tok = 11 if tpl.parents[j] < 0 else int(out[tpl.parents[j]])
        assert int(out[j]) == int(cm.M[par_tok, tpl.ranks[j]])


# ----------------------------------------------------------------------------- youden / calibrate

def test_youden_recovers_threshold():
    g = torch.Generator().manual_seed(0)
    pos = 0.5 + 0.5 * torch.rand(400, generator=g)
    neg = 0.5 * torch.rand(600, generator=g)
    conf = torch.cat([pos, neg])
    lab = torch.cat([torch.ones(400, dtype=torch.bool), torch.zeros(600, dtype=torch.bool)])
    perm = torch.randperm(1000, generator=g)
    tau = youden_threshold(conf[perm], lab[perm])
    assert abs(tau - 0.5) < 0.05, tau
    assert float(neg.max()) < tau <= float(pos.min())


def test_youden_exact_midpoint():
    assert youden_threshold([0.9, 0.2, 0.8, 0.3], [True, False, True, False]) == pytest.approx(0.55)


def test_youden_ties_cut_after_all_equal():
    # the two 0.5s cannot be split: the cut goes below both
    assert youden_threshold([0.5, 0.5, 0.2], [True, False, False]) == pytest.approx(0.35)


def test_youden_all_positive_never_prunes():
    assert youden_threshold([0.1, 0.5, 0.9], [True, True, True]) == 0.0


def test_youden_all_negative_always_prunes():
    assert youden_threshold([0.1, 0.5, 0.99, 1.0], [False] * 4) > 1.0


def test_youden_uninformative_never_prunes():
    assert youden_threshold([0.1, 0.9], [True, False]) == 0.0


def J(conf, pos, tau):
    conf, pos = torch.as_tensor(conf, dtype=torch.float64), torch.as_tensor(pos)
    pred = conf >= tau
    return float((pred & pos).sum() / pos.sum() - (pred & ~pos).sum() / (~pos).sum())


def test_youden_maximises_j_on_noisy_data():
    g = torch.Generator().manual_seed(3)
    conf = torch.rand(300, generator=g)
    pos = torch.rand(300, generator=g) < conf            # informative but overlapping
    tau = youden_threshold(conf, pos)
    best = max(J(conf, pos, float(c)) for c in conf)
    assert J(conf, pos, tau) == pytest.approx(best)


def test_calibrate_positive_means_accepted_past_level():
    # (confidences, accepted draft length): positive at c iff accepted > c + 1
    records = [({0: 0.9, 1: 0.7}, 5),
               ({0: 0.2, 1: 0.1}, 1),
               ({0: 0.8, 1: 0.6}, 2),
               ({0: 0.3, 1: 0.05}, 0)]
    taus = CAL.calibrate(records, checkpoints=(0, 1, 5))
    # c=0: positives {0.9, 0.8} (accepted 5 and 2 > 1), negatives {0.2, 0.3}
    assert taus[0] == pytest.approx(0.55)
    # c=1: only accepted 5 > 2 is positive: 0.7 vs 0.6 (accepted == 2 is a negative) -> 0.65
    assert taus[1] == pytest.approx(0.65)
    # c=5: no record carries it -> never prune
    assert taus[5] == 0.0


def test_scaled_keep():
    assert GR.scaled_keep(60) == GR.KEEP == (8, 24, 40)
    assert GR.scaled_keep(30) == (4, 12, 20)
    assert GR.scaled_keep(2) == (1, 1, 1)


# ----------------------------------------------------------------------------- graft_trees

TPL4 = build_template((0.5, 0.25), 4)          # parents -1 -1 0 0, ranks 0 1 0 1
D_TOK, D_PAR = T([10, 11, 20]), T([-1, -1, 0])  # root -> 10, 11; 10 -> 20


def run_graft(r_tokens, free, anchor=-1, d_tok=D_TOK, d_par=D_PAR, tpl=TPL4):
    t, p, v, s = graft_trees(d_tok, d_par, T(r_tokens), tpl, free, anchor)
    assert v.all()                                  # these cases fill every slot
    return t.tolist(), p.tolist(), s.tolist()


def test_graft_no_merge_all_free():
    t, p, s = run_graft([30, 31, 40, 41], free=4)
    assert t == [10, 11, 20, 30, 31, 40, 41]
    assert p == [-1, -1, 0, -1, -1, 3, 3]
    assert s == [False] * 3 + [True] * 4


def test_graft_no_merge_takes_first_free_template_nodes():
    t, p, s = run_graft([30, 31, 40, 41], free=2)
    assert (t, p, s) == ([10, 11, 20, 30, 31], [-1, -1, 0, -1, -1], [False] * 3 + [True] * 2)


def test_graft_merges_duplicate_of_root_child():
    # template node 0 retrieves 11, a draft child of the root: merged into draft node 1, its retrieved
    # children (40, 41) attach under draft node 1, and its freed slot goes to the next template node
    t, p, s = run_graft([11, 30, 40, 41], free=2)
    assert t == [10, 11, 20, 30, 40]
    assert p == [-1, -1, 0, -1, 1]
    assert s == [False, False, False, True, True]


def test_graft_merges_along_a_chain():
    # 10 merges into draft 0; its child 20 merges into draft 2 (a child of draft 0): two slots freed
    t, p, s = run_graft([10, 30, 20, 41], free=2)
    assert t == [10, 11, 20, 30, 41]
    assert p == [-1, -1, 0, -1, 0]
    assert s == [False, False, False, True, True]


def test_graft_same_token_different_parent_is_not_merged():
    # 20 is a draft grandchild (under 10); retrieved at the root it is a new sibling, not a duplicate
    t, p, s = run_graft([20, 30, 40, 41], free=2)
    assert t == [10, 11, 20, 20, 30]
    assert p == [-1, -1, 0, -1, -1]


def test_graft_tail_anchor():
    # the retrieval subtree hangs under draft node 2 (token 20)
    t, p, s = run_graft([50, 51, 60, 61], free=4, anchor=2)
    assert t == [10, 11, 20, 50, 51, 60, 61]
    assert p == [-1, -1, 0, 2, 2, 3, 3]
    assert s == [False] * 3 + [True] * 4


def test_graft_tail_anchor_merges_with_anchor_children():
    d_tok, d_par = T([10, 11, 20, 50]), T([-1, -1, 0, 2])
    t, p, s = run_graft([50, 51, 60, 61], free=2, anchor=2, d_tok=d_tok, d_par=d_par)
    assert t == [10, 11, 20, 50, 51, 60]
    assert p == [-1, -1, 0, 2, 2, 3]                    # 60 under draft node 3 (the merged 50)
    assert s == [False] * 4 + [True] * 2


def random_draft_tree(rng, K, vocab):
    toks, pars = [], []
    for i in range(K):
        p = rng.randrange(-1, i)
        used = {toks[j] for j in range(i) if pars[j] == p}
        toks.append(rng.choice([t for t in range(vocab) if t not in used]))
        pars.append(p)
    return T(toks), T(pars)


def children_distinct(root_tok, tokens, parents):
    seen = set()
    for t, p in zip(tokens.tolist(), parents.tolist()):
        if (p, t) in seen:
            return False
        seen.add((p, t))
    return True


@pytest.mark.parametrize("seed", range(12))
def test_graft_random_invariants(seed):
    # a small vocabulary makes merges frequent
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    vocab, k = 12, 4
    K = rng.randrange(1, 20)
    free = rng.randrange(1, 25)
    d_tok, d_par = random_draft_tree(rng, K, vocab)
    cm = ContinuationMatrix(vocab, k)
    cm.update(torch.arange(vocab), torch.randn(vocab, vocab, generator=g), torch.ones(vocab, dtype=torch.bool))
    tpl = build_template((0.6, 0.3, 0.2, 0.1), K + free)
    anchor = -1 if seed % 3 else rng.randrange(K)
    root = 3
    r_tok = cm.retrieve(T(root if anchor < 0 else int(d_tok[anchor])), tpl)
    t, p, v, s = graft_trees(d_tok, d_par, r_tok, tpl, free, anchor)
    assert t.numel() == p.numel() == s.numel() == v.numel() == K + free
    assert v.all()              # a draft node absorbs at most one template node: the K + free template fills
    assert torch.equal(t[:K], d_tok) and torch.equal(p[:K], d_par)
    assert s.tolist() == [False] * K + [True] * free
    assert ((p >= -1) & (p < torch.arange(K + free))).all()
    assert children_distinct(root, t, p), (t.tolist(), p.tolist())
    # every retrieved node is a real retrieval: its token is in the continuation row of its parent
    for i in range(K, K + free):
        if anchor >= 0:
            assert p[i] >= 0                            # nothing retrieved hangs at the root
        par_tok = root if p[i] < 0 else int(t[p[i]])
        assert int(t[i]) in cm.rows(T([par_tok]))[0].tolist()


def test_graft_leaves_padding_when_merges_exhaust_the_template():
    # template of 2 nodes (ranks 0, 1 under the root), 2 free slots; both retrieved tokens are draft
    # children of the root, so both merge: nothing new, the 2 slots are padding
    tpl = build_template((0.5, 0.25), 2)
    t, p, v, s = graft_trees(D_TOK, D_PAR, T([10, 11]), tpl, 2, -1)
    assert v.tolist() == [True] * 3 + [False] * 2 and s.tolist() == [False] * 5


# ----------------------------------------------------------------------------- the Graft proposer's stages

class FakeDrafter:
    """Stands in for draft.Drafter: fixed candidate buffers (what extend/level would have left)."""

    def __init__(self, scores, tokens, parents, top_k, depth):
        self.scores, self.tokens, self.parents = scores, tokens, parents
        self.top_k, self.depth = top_k, depth

    def extend(self, *a):
        raise AssertionError("not drafted in this test")

    level = extend


class FakeEngine:
    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self, drafter):
        import types
        self.drafter, self.model = drafter, types.SimpleNamespace(args=types.SimpleNamespace(dim=4),
                                                                          capture_layers=(0, 1, 2))

    def reserve(self, *a):
        pass

    def compile(self, fn, name=None):
        return fn

    def static(self, *a):
        pass


@torch.no_grad()
def test_graft_tail_anchor_is_deepest_draft_node():
    #            slot:    0     1     2     3     4     5     6     7
    #            level:   1     1     2     2     2     2     3     3
    d = FakeDrafter(scores=T([-0.1, -1.0, -0.2, -2.5, -3.5, -4.0, -0.3, -2.6], torch.float32),
                    tokens=T([10, 11, 12, 13, 14, 15, 16, 17]), parents=T([-1, -1, 0, 0, 1, 1, 2, 2]),
                    top_k=2, depth=3)
    cfg = GR.Config(budget=5, top_k=2, depth=3, prune=False, ablation="tail")
    cm = ContinuationMatrix(64, 8)
    g = GR.Graft(FakeEngine(d), cfg, cm)
    a = g.stages[None][1]                           # retrieved nodes on top of the dense tree
    tree = g.assemble_stage(None, T(30))
    # budget 5 keeps slots 0, 1, 2, 3, 6: leaves 1 (depth 1), 3 (depth 2), 6 (depth 3, best path)
    assert tree.tokens[:6].tolist() == [30, 10, 11, 12, 13, 16]
    assert tree.retrieved.tolist() == [False] * 6 + [True] * a and tree.valid.all()
    # the retrieval subtree's top nodes hang under the anchor: tree index 5 = draft node 16
    tops = {int(tree.parents[i]) for i in range(6, 6 + a) if not tree.retrieved[tree.parents[i]]}
    assert tops == {5}, f"retrieval hangs under tree node(s) {tops}, tokens {tree.tokens.tolist()}"
    assert (cm.rows(T([16]))[0].long() == tree.tokens[6]).any()     # retrieved from 16's row


@torch.no_grad()
def test_every_stage_has_a_keep_size_and_n_nodes():
    """An extra checkpoint (--checkpoints 0,1,5,6, no --keep) still has a keep size, and every stage's
    tree has the same N nodes (padding where pruning freed slots and nothing retrieves)."""
    k = 2
    scores, tokens, parents, off = [], [], [], 0
    for lvl in range(1, 8):     # 7 levels of a k=2 tree: level 1 has 2 nodes, later levels k*k = 4
        n = k if lvl == 1 else k * k
        scores += [-0.1 * lvl - 0.01 * j for j in range(n)]
        tokens += [10 + off + j for j in range(n)]
        parents += [-1] * n if lvl == 1 else [off - (k if lvl == 2 else k * k) + (j // k) for j in range(n)]
        off += n
    d = FakeDrafter(T(scores, torch.float32), T(tokens), T(parents), k, 8)
    for retrieve in (True, False):
        cfg = GR.Config(budget=20, top_k=k, depth=8, checkpoints=(0, 1, 5, 6), retrieve=retrieve)
        assert len(cfg.keep_sizes()) == 4
        g = GR.Graft(FakeEngine(d), cfg, ContinuationMatrix(64, 8) if retrieve else None)
        assert set(g.stages) == {None, 0, 1, 5, 6} and g.N == 21
        for stage, (K, R) in g.stages.items():
            tree = g.assemble_stage(stage, T(30))
            assert tree.tokens.numel() == 21
            assert int(tree.valid.sum()) == 1 + K + R and (R == 0 or retrieve)


# ----------------------------------------------------------------------------- throughput calibration

def rounds_of(rows):
    """(conf_0, A_full, A_stage0) per round -> the (conf, accepted) pairs throughput() reads."""
    return [({0: c}, {None: full, 0: pruned}) for c, full, pruned in rows]


def test_throughput_is_tokens_over_seconds():
    rounds = rounds_of([(0.9, 5, 0), (0.3, 1, 1)])
    cost = {None: 10.0, 0: 2.0}
    # tau 0.5: round 1 full (6 tokens, 10 s), round 2 pruned (2 tokens, 2 s)
    assert CAL.throughput(rounds, {0: 0.5}, cost, (0,)) == pytest.approx(8 / 12)
    assert CAL.throughput(rounds, {0: 0.0}, cost, (0,)) == pytest.approx(8 / 20)
    assert CAL.throughput(rounds, {0: 1.1}, cost, (0,)) == pytest.approx(3 / 4)


def test_throughput_picks_the_known_best_threshold():
    # pruning a confident round loses all its tokens; pruning an unconfident one loses nothing
    rounds = rounds_of([(0.9, 5, 0), (0.8, 5, 0), (0.3, 1, 1), (0.2, 1, 1)])
    taus, rate = CAL.throughput_thresholds(rounds, {None: 10.0, 0: 4.0}, (0,))
    assert taus == {0: pytest.approx(0.55)} and rate == pytest.approx(16 / 28)


def test_throughput_and_youden_disagree():
    """Youden's J separates positives (accepted past level 1) from negatives at 0.55; throughput prunes
    round 2 too: it accepts only 2 tokens dense, and a pruned round costs a fifth of a dense one."""
    rows = [(0.9, 8, 0), (0.6, 2, 1), (0.5, 1, 1), (0.4, 1, 1)]
    assert CAL.youden_threshold([r[0] for r in rows], [r[1] > 1 for r in rows]) == pytest.approx(0.55)
    taus, rate = CAL.throughput_thresholds(rounds_of(rows), {None: 10.0, 0: 2.0}, (0,))
    assert taus == {0: pytest.approx(0.75)} and rate == pytest.approx(15 / 16)
    assert CAL.throughput(rounds_of(rows), {0: 0.55}, {None: 10.0, 0: 2.0}, (0,)) == pytest.approx(16 / 24)


def test_throughput_two_checkpoints_coordinate_ascent():
    # checkpoint 1 only matters for rounds that pass checkpoint 0
    rounds = [({0: 0.9, 1: 0.8}, {None: 6, 0: 0, 1: 5}), ({0: 0.9, 1: 0.2}, {None: 2, 0: 0, 1: 2}),
              ({0: 0.1, 1: 0.1}, {None: 0, 0: 0, 1: 0})]
    cost = {None: 8.0, 0: 1.0, 1: 2.0}
    taus, rate = CAL.throughput_thresholds(rounds, cost, (0, 1))
    # best: prune round 3 at 0 (1 s), round 2 at 1 (2 s), round 1 at 1 too (5 of 6 tokens for 2 s not 8)
    assert CAL.stage_of({0: 0.1, 1: 0.1}, taus, (0, 1)) == 0
    assert CAL.stage_of({0: 0.9, 1: 0.2}, taus, (0, 1)) == 1 and CAL.stage_of({0: 0.9, 1: 0.8}, taus, (0, 1)) == 1
    assert rate == pytest.approx((6 + 3 + 1) / (2 + 2 + 1))


def test_choose_budget_picks_the_known_best():
    """Two budgets: the larger accepts one more token a round but its verify pass costs 60% more."""
    rounds16 = rounds_of([(0.9, 3, 1), (0.2, 1, 1)])
    rounds32 = rounds_of([(0.9, 4, 1), (0.2, 2, 1)])
    options = {16: (rounds16, {None: 10.0, 0: 6.0}), 32: (rounds32, {None: 16.0, 0: 12.0})}
    b, taus, rate, curve = CAL.choose_budget(options, (0,))
    # 16: best is tau 0.55 -> (4 + 2) / (10 + 6) = 0.375; 32: (5 + 3) / 32 = 0.25 or (5+2)/28 = 0.25
    assert b == 16 and rate == pytest.approx(6 / 16) and curve == {16: pytest.approx(6 / 16), 32: pytest.approx(0.25)}
    options[32] = (rounds32, {None: 11.0, 0: 7.0})      # cheaper verification: 32 wins
    assert CAL.choose_budget(options, (0,))[0] == 32


# ----------------------------------------------------------------------------- measuring costs

# What a pass over N nodes costs without interference (ms), and warm-up rounds whose expected rate at
# these costs is nearly the same at budgets 8 and 12 (12 accepts a little more, its pass costs a
# little more: 0.45% fewer tokens/s than 8).
PASS_MS = {1: 4.0, 9: 18.0, 13: 18.5, 17: 26.0, 25: 34.0}
ACCEPTED = {8: (3, 2), 12: (3.15, 2.1), 16: (3.15, 2.1), 24: (3.3, 2.2)}         # (round 1, round 2) at full depth


def budget_options(ms: dict, accepted=ACCEPTED) -> dict:
    """choose_budget's input for these costs: 4 rounds, 2 ms a draft forward, 8 forwards at full depth."""
    def rounds(b):
        a1, a2 = accepted[b]
        return rounds_of([(0.9, a1, 1), (0.8, a2, 1), (0.3, 1, 1), (0.2, 0, 0)])
    return {b: (rounds(b), {None: 16.0 + ms[b + 1], 0: 2.0 + ms[b + 1]}) for b in accepted}


def noisy_samples(seed: int, hit: int, factors: list) -> dict:
    """One warm-up's timings on a fake clock: 8 timed passes of each size (each after an untimed one),
    `hit` of them slowed by interference (a factor from `factors`, like the issue's 43.1 and 26.9 ms
    for an 18 ms pass), every pass with up to 2% jitter. Returns time_passes's {N: [seconds]}."""
    rng = random.Random(seed)
    now = [0.0]
    bad = {n: set(rng.sample(range(8), hit)) for n in PASS_MS}
    calls = {n: 0 for n in PASS_MS}

    def run(n):
        timed = calls[n] % 2 == 1                     # untimed, timed, untimed, ...
        slow = rng.choice(factors) if timed and calls[n] // 2 in bad[n] else 1.0
        now[0] += PASS_MS[n] * (1 + rng.uniform(0, 0.02)) * slow / 1000
        calls[n] += 1
    return E.time_passes(run, sorted(PASS_MS), 8, timer=lambda: now[0])


@pytest.mark.parametrize("hit,factors", [(4, [1.49, 1.81, 2.39]),                  # the issue's
                                         (6, [1.49, 1.81, 2.39, 3.5, 5.0])])       # and worse
def test_noisy_timings_give_the_same_budget_and_thresholds_every_time(hit, factors):
    choices, by_mean, no_ties = set(), set(), set()
    for seed in range(20):
        samples = noisy_samples(seed, hit, factors)
        fastest, spread = E.robust_costs(samples)
        ms = {n: 1000 * c for n, c in E.monotone(fastest).items()}
        b, taus, _, _ = CAL.choose_budget(budget_options(ms), (0,), spread)
        choices.add((b, round(taus[0], 6)))
        no_ties.add(CAL.choose_budget(budget_options(ms), (0,))[0])
        mean = {n: 1000 * sum(xs) / len(xs) for n, xs in samples.items()}       # what averaging would pick
        by_mean.add(CAL.choose_budget(budget_options(mean), (0,))[0])
    assert choices == {(8, 0.85)}
    assert len(by_mean) > 1 and len(no_ties) > 1       # the noise is that bad: averages, or no tie rule, flip


def test_time_passes_interleaves_sizes_after_an_untimed_call():
    calls, now = [], [0.0]

    def run(n):
        calls.append(n)
        now[0] += n
    samples = E.time_passes(run, [1, 9, 13], 2, timer=lambda: now[0])
    assert calls == [1, 1, 9, 9, 13, 13, 13, 13, 9, 9, 1, 1]                 # untimed, timed; reversed sweep
    assert samples == {1: [1.0, 1.0], 9: [9.0, 9.0], 13: [13.0, 13.0]}


def test_robust_costs_fastest_sample_and_spread():
    costs, spread = E.robust_costs({9: [43.1, 26.9, 20.0, 20.2], 13: [18.9, 33.5, 19.0, 40.0]})
    assert costs == {9: 20.0, 13: 18.9}
    assert spread == pytest.approx((0.2 / 20.0 + 0.1 / 18.9) / 2)              # median of the two sizes' gaps


def test_monotone_fit_never_lets_a_bigger_tree_cost_less():
    assert E.monotone({1: 4.0, 9: 20.0, 13: 18.9, 17: 26.0}) == {1: 4.0, 9: pytest.approx(19.45),
                                                                  13: pytest.approx(19.45), 17: 26.0}
    assert E.monotone({1: 3.0, 9: 2.0, 13: 1.0}) == {1: 2.0, 9: 2.0, 13: 2.0}


def test_choose_budget_prefers_the_smaller_within_the_spread():
    """12's expected rate beats 8's by 0.5%: with a 0.2% spread (3 spreads: 0.6%) that is a tie."""
    options = budget_options(PASS_MS, {8: (3, 2), 12: (3.24, 2.16)})
    b, _, _, curve = CAL.choose_budget(options, (0,))
    assert b == 12 and curve[12] == pytest.approx(curve[8] * 1.005, rel=1e-3)
    assert CAL.choose_budget(options, (0,), spread=0.002)[0] == 8
    assert CAL.choose_budget(options, (0,), spread=0.001)[0] == 12


def test_accepted_by_follows_the_true_continuation():
    from verify import Tree
    #  root 0 -> 1 (5) -> 3 (7) -> 4 (9);  0 -> 2 (6)
    tree = Tree(T([100, 5, 6, 7, 9]), T([-1, 0, 0, 1, 3]), T([True] * 5, torch.bool))
    assert CAL.accepted_by(tree, [5, 7, 9, 4]) == 3
    assert CAL.accepted_by(tree, [5, 7, 8]) == 2
    assert CAL.accepted_by(tree, [6, 7]) == 1
    assert CAL.accepted_by(tree, [4]) == 0
    assert CAL.accepted_by(Tree(tree.tokens, tree.parents, T([True, True, True, False, True], torch.bool)), [5, 7, 9]) == 1


def test_stage_tree_keeps_only_levels_drafted_by_the_stage():
    k = 2   # slots: level 1 = 0, 1; level 2 = 2..5
    rec = {"scores": T([-0.1, -0.2, -0.15, -3.0, -4.0, -5.0], torch.float32), "tokens": T([10, 11, 12, 13, 14, 15]),
           "parents": T([-1, -1, 0, 0, 1, 1]), "root": 99, "retrieved": T([20, 21, 22, 23])}
    full = CAL.stage_tree(rec, None, 3, 0, (0.5, 0.25), k)
    assert full.tokens.tolist() == [99, 10, 11, 12]            # slot 2 (-0.15) beats slot 1's children
    early = CAL.stage_tree(rec, 0, 2, 2, (0.5, 0.25), k)        # stage 0: level 1 only, then 2 retrieved
    assert early.tokens.tolist() == [99, 10, 11, 20, 21] and early.retrieved.tolist() == [False] * 3 + [True] * 2


# ----------------------------------------------------------------------------- --show-tree

def test_render_round_exact():
    from cli import render_round
    #   0 root(100) -> 1 (10, draft) -> 3 (30, draft) ; 0 -> 2 (20, matrix) -> 4 (40, matrix) ; 5 padding
    got = render_round(7, tokens=[100, 10, 20, 30, 40, 0], parents=[-1, 0, 0, 1, 2, -1],
                       valid=[1, 1, 1, 1, 1, 0], retrieved=[0, 0, 1, 0, 1, 0], path=[0, 2, 4], stage=0, bonus=55,
                       decode=lambda ids: f"t{ids[0]}")
    assert got == (
        "round 7: pruned at checkpoint 0; 4 nodes verified (2 drafted, 2 retrieved); accepted 2 (*), bonus 't55'\n"
        "* 't100'                     root\n"
        "├─  't10'                    draft\n"
        "│  └─  't30'                 draft\n"
        "└─* 't20'                    matrix\n"
        "   └─* 't40'                 matrix")


def test_render_round_labels_prompt_lookup_nodes_as_copied():
    from cli import render_round
    got = render_round(3, tokens=[100, 10, 20, 0], parents=[-1, 0, 1, -1], valid=[1, 1, 1, 0], retrieved=[0, 0, 0, 0],
                       path=[0, 1], stage=None, bonus=55, decode=lambda ids: f"t{ids[0]}", source="copied")
    assert got == (
        "round 3: 2 nodes verified (2 copied); accepted 1 (*), bonus 't55'\n"
        "* 't100'                     root\n"
        "└─* 't10'                    copied\n"
        "   └─  't20'                 copied")


# ----------------------------------------------------------------------------- cached calibrations

def good_meta():
    per = lambda taus: {"eagle3": {"budget": 24, "rate": 50.0, "thresholds": {}},
                        "prune": {"budget": 12, "rate": 60.0, "thresholds": taus},
                        "graft": {"budget": 8, "rate": 70.0, "thresholds": taus}}
    return {"calibrations": {"throughput": per({"0": 1.0, "1": 0.0, "5": 0.0}),
                             "youden": per({"0": 0.05, "1": 0.08, "5": 0.002})},
            "budget_curve": {"graft": {"8": 70.0, "16": 65.0}}}


def test_read_calibrations_round_trip():
    from calibrate import read_calibrations
    cal, curve = read_calibrations(good_meta(), (0, 1, 5))
    assert cal["throughput"]["graft"] == {"budget": 8, "rate": 70.0, "thresholds": {0: 1.0, 1: 0.0, 5: 0.0}}
    assert cal["youden"]["eagle3"]["thresholds"] == {} and curve == {"graft": {8: 70.0, 16: 65.0}}


@pytest.mark.parametrize("spoil", [
    lambda m: m["calibrations"].pop("youden"),                                           # one missing
    lambda m: m["calibrations"]["throughput"]["graft"]["thresholds"].pop("5"),           # other checkpoints
    lambda m: m["calibrations"]["throughput"]["prune"]["thresholds"].update({"0": float("nan")}),
    lambda m: m["calibrations"]["youden"]["graft"]["thresholds"].update({"1": 7.0}),     # not a probability
    lambda m: m["calibrations"]["throughput"]["graft"].update({"budget": 0}),
    lambda m: m["calibrations"]["throughput"]["graft"].update({"budget": "many"}),
    lambda m: m.update({"budget_curve": {"graft": {"x": 1.0}}}),
])
def test_read_calibrations_refuses_what_does_not_fit(spoil):
    from calibrate import read_calibrations
    meta = good_meta()
    spoil(meta)
    assert read_calibrations(meta, (0, 1, 5)) is None


def test_method_config_uses_each_methods_own_calibration():
    import types
    from calibrate import read_calibrations
    from engine import method_config
    eng = types.SimpleNamespace(calibration="throughput", calibrations=read_calibrations(good_meta(), (0, 1, 5))[0])
    cfg = GR.Config(budget=16)
    assert method_config(eng, "prune", cfg, auto_budget=True).budget == 12
    assert method_config(eng, "graft", cfg, auto_budget=False) == GR.Config(budget=16, thresholds={0: 1.0, 1: 0.0, 5: 0.0})
    assert method_config(eng, "graft-root", cfg, auto_budget=True).budget == 8        # ablations: graft's
    assert method_config(eng, "graft", cfg, False, calibration="youden").thresholds == {0: 0.05, 1: 0.08, 5: 0.002}
    given = GR.Config(budget=16, thresholds={0: 0.5, 1: 0.5, 5: 0.5})                  # --thresholds wins
    assert method_config(eng, "graft", given, auto_budget=False).thresholds == given.thresholds
    assert method_config(eng, "eagle3", cfg, auto_budget=True) == GR.Config(budget=24)
    assert method_config(eng, "pld", cfg, auto_budget=True) == cfg                   # not calibrated
