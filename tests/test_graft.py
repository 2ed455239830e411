"""graft.py: the continuation matrix, retrieval templates, threshold calibration and hybrid trees.

Hand-made matrices, logits and trees with exact expected outputs, plus a few seeded property checks.
Every step takes a batch (B requests): a single request is a batch of one, and the batched tests
check that row b equals the same call on request b alone. The round's assembly (graft.assemble) runs
on a fake drafter's fixed candidates. CPU only, no model.
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


# ----------------------------------------------------------------------------- the continuation matrix: update

def upd(cm, tokens, logits, path=None):
    """update() of one request (a batch of one) into cm's own M, every node real; `path` the accepted
    path's nodes (root first)."""
    valid = torch.ones_like(tokens, dtype=torch.bool)
    M, written = cm.M[None], cm.written[None]                  # views: the writes land in cm
    if path is None:
        return GR.update(M, written, tokens[None], logits[None], valid[None])
    return GR.update(M, written, tokens[None], logits[None], valid[None], path[None], T([path.numel() - 1]))


def rec(cm, tokens, target):
    """What the warm-up records for these nodes: the rank at which each node's row held the target's
    choice (matrix_ranks), and the choices."""
    rank = GR.matrix_ranks(cm.M[None], tokens[None], target[None])[0]
    cm.record(rank, target, torch.ones_like(tokens, dtype=torch.bool))


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


def test_update_padding_and_past_the_path_write_nothing():
    # padding nodes (valid False) land in the spare row V; path entries past A are filler, not the path
    cm = ContinuationMatrix(10, k=3)
    valid = T([[True, False, True, True]], torch.bool)
    GR.update(cm.M[None], cm.written[None], T([[2, 5, 2, 7]]), ranked_logits(ROWS)[None], valid,
              T([[0, 2, 1]]), T([0]))                          # A = 0: only the root (node 0) is accepted
    assert cm.M[2].tolist() == [9, 1, 4]                       # node 0 (on the path) beats node 2 (filler)
    assert not cm.written[5] and cm.M[5].tolist() == [0, 1, 2]
    assert cm.written[:10].nonzero().flatten().tolist() == [2, 7]


def test_update_batch_rows_write_their_own_matrices():
    """Three requests, each with its own matrix (B, V+1, k), tokens, path and padding, in one update:
    each request's matrix is what updating it alone leaves."""
    g = torch.Generator().manual_seed(0)
    B, N, Vv, k = 3, 6, 10, 3
    tokens = torch.randint(0, Vv, (B, N), generator=g)
    tokens[0, 3] = tokens[0, 1]                                # a repeated token in one request
    logits = torch.randn(B, N, Vv, generator=g)
    valid = torch.rand(B, N, generator=g) > 0.2
    path, A = T([[0, 1, 3, 2, 4, 5], [0, 2, 1, 3, 4, 5], [0, 5, 4, 1, 2, 3]]), T([2, 0, 1])
    prior = ContinuationMatrix(Vv, k)
    M, W = prior.M[None].repeat(B, 1, 1), prior.written[None].repeat(B, 1)
    GR.update(M, W, tokens, logits, valid, path, A)
    for b in range(B):
        m1, w1 = prior.M[None].clone(), prior.written[None].clone()
        GR.update(m1, w1, tokens[b:b + 1], logits[b:b + 1], valid[b:b + 1], path[b:b + 1], A[b:b + 1])
        assert torch.equal(M[b], m1[0]) and torch.equal(W[b], w1[0]), b


def test_unwritten_rows_fall_back_to_unigram_topk():
    cm = ContinuationMatrix(10, k=3)
    upd(cm, T([2]), ranked_logits([[6, 5, 2]]))
    assert cm.M[T([8, 2])].tolist() == [[0, 1, 2], [6, 5, 2]]       # before warm-up: arange(k)
    rec(cm, T([0, 0, 0, 0, 0, 0]), T([4, 4, 4, 9, 9, 1]))             # target choices: 4 x3, 9 x2, 1 x1
    cm.refresh_fallback()
    assert cm.fallback.tolist() == [4, 9, 1]
    assert cm.M[T([8, 3, 2])].tolist() == [[4, 9, 1], [4, 9, 1], [6, 5, 2]]
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


def test_matrix_ranks_batch_rows_read_their_own_matrices():
    # the same tokens and targets against two requests' matrices: each row ranks in its own matrix
    a, b = ContinuationMatrix(10, k=3), ContinuationMatrix(10, k=3)
    upd(a, T([2, 5]), ranked_logits([[6, 5, 2], [0, 3, 8]]))
    upd(b, T([2, 5]), ranked_logits([[5, 6, 1], [8, 9, 0]]))
    M = torch.stack([a.M, b.M])
    tokens, target = T([[2, 2, 5, 4], [2, 2, 5, 4]]), T([[5, 6, 8, 1], [5, 6, 8, 1]])
    got = GR.matrix_ranks(M, tokens, target)
    assert got.tolist() == [[1, 0, 2, 1], [0, 1, 0, 1]]
    for r in range(2):
        assert torch.equal(got[r], GR.matrix_ranks(M[r:r + 1], tokens[r:r + 1], target[r:r + 1])[0])


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


def test_copy_is_independent():
    # a request starts from a copy of the prior: what the copy learns does not reach the original
    cm = ContinuationMatrix(10, k=3)
    upd(cm, T([2]), ranked_logits([[6, 5, 2]]))
    c = cm.copy()
    assert torch.equal(c.M, cm.M) and torch.equal(c.written, cm.written)
    upd(c, T([4]), ranked_logits([[7, 8, 0]]))
    assert c.M[4].tolist() == [7, 8, 0] and cm.M[4].tolist() == [0, 1, 2] and not cm.written[4]


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

def retrieve1(cm, under: int, tpl):
    """retrieve() of one request (a batch of one) from cm's matrix."""
    out = GR.retrieve(cm.M[None], T([under]), tpl)
    assert out.shape == (1, tpl.size) and out.dtype == torch.long
    return out[0]


def test_retrieve_exact():
    cm = ContinuationMatrix(10, k=3)
    cm.M[3] = T([7, 1, 4], torch.int32)
    cm.M[7] = T([2, 5, 6], torch.int32)
    cm.M[2] = T([8, 9, 0], torch.int32)
    cm.written[[3, 7, 2]] = True
    tpl = build_template((0.5, 0.25), 4)                 # parents -1 -1 0 0, ranks 0 1 0 1
    assert retrieve1(cm, 3, tpl).tolist() == [7, 1, 2, 5]
    tpl6 = build_template((0.5, 0.25), 6)                # + (parent 1, rank 0), (parent 2, rank 0)
    # node 4 hangs under token 1, whose row was never written: the fallback's rank 0 (0)
    assert retrieve1(cm, 3, tpl6).tolist() == [7, 1, 2, 5, 0, 8]


def test_retrieve_random_matches_definition():
    g = torch.Generator().manual_seed(0)
    V, k = 30, 8
    cm = ContinuationMatrix(V, k)
    upd(cm, torch.arange(V), torch.randn(V, V, generator=g))
    tpl = build_template(GR.PRIOR_HIT_RATES, 52)
    out = retrieve1(cm, 11, tpl)
    assert out.shape == (52,)
    for j in range(52):
        par_tok = 11 if tpl.parents[j] < 0 else int(out[tpl.parents[j]])
        assert int(out[j]) == int(cm.M[par_tok, tpl.ranks[j]])


def test_retrieve_batch_rows_read_their_own_matrices():
    # three requests, each with its own matrix and its own node to hang under: row b is the retrieval
    # of request b alone
    g = torch.Generator().manual_seed(1)
    V, k = 30, 8
    cms = []
    for b in range(3):
        cm = ContinuationMatrix(V, k)
        upd(cm, torch.arange(V), torch.randn(V, V, generator=g))
        cms.append(cm)
    tpl = build_template(GR.PRIOR_HIT_RATES, 40)
    under = T([11, 11, 4])
    got = GR.retrieve(torch.stack([c.M for c in cms]), under, tpl)
    assert got.shape == (3, 40)
    for b in range(3):
        assert torch.equal(got[b], retrieve1(cms[b], int(under[b]), tpl)), b
    assert not torch.equal(got[0], got[1])               # same node, other matrices


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

D_TOK, D_PAR = T([10, 11, 20]), T([-1, -1, 0])  # root -> 10, 11; 10 -> 20
RATES2 = (0.5, 0.25)                            # templates: parents -1 -1 0 0 1 2 ..., ranks 0 1 0 1 0 0 ...


def graft1(d_tok, d_par, kept, r_tok, tpl, anchor, free):
    """graft_trees of one request (a batch of one): (tokens, parents, valid, retrieved), each (n,)."""
    out = graft_trees(d_tok[None], d_par[None], kept[None], None if r_tok is None else r_tok[None], tpl,
                      T([anchor]), T([free]))
    assert all(x.shape == (1, d_tok.numel()) for x in out)
    return tuple(x[0] for x in out)


def selection(d_tok, d_par, free):
    """A selection of K + free candidates: the K draft nodes (kept), then `free` the request drops
    (tokens no template retrieves here, under the root)."""
    return (torch.cat([d_tok, T([70 + j for j in range(free)])]), torch.cat([d_par, T([-1] * free)]),
            torch.arange(d_tok.numel() + free) < d_tok.numel())


def run_graft(r_tokens, free, anchor=-1, d_tok=D_TOK, d_par=D_PAR):
    """The K draft nodes kept and `free` slots for retrieval: the template has K + free nodes (one per
    slot), the first len(r_tokens) retrieving r_tokens, the rest tokens no draft node carries."""
    n = d_tok.numel() + free
    tpl = build_template(RATES2, n)
    r_tok = T(list(r_tokens) + [90 + j for j in range(n - len(r_tokens))])
    t, p, v, s = graft1(*selection(d_tok, d_par, free), r_tok, tpl, anchor, free)
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


def test_graft_compacts_kept_nodes_out_of_the_selection():
    # select's order is slot order: kept and dropped candidates interleave; the kept come first,
    # in order, their parents re-indexed, and the dropped slots go to retrieval
    d_tok, d_par = T([10, 77, 11, 78, 20]), T([-1, -1, -1, 1, 0])
    kept = T([True, False, True, False, True], torch.bool)
    tpl = build_template(RATES2, 5)
    t, p, v, s = graft1(d_tok, d_par, kept, T([30, 31, 40, 41, 42]), tpl, -1, 2)
    assert t.tolist() == [10, 11, 20, 30, 31] and p.tolist() == [-1, -1, 0, -1, -1] and v.all()
    assert s.tolist() == [False] * 3 + [True] * 2
    # the anchor indexes the selection: node 4 (token 20) is result node 2
    t, p, v, s = graft1(d_tok, d_par, kept, T([30, 31, 40, 41, 42]), tpl, 4, 2)
    assert t.tolist() == [10, 11, 20, 30, 31] and p.tolist() == [-1, -1, 0, 2, 2]


def random_draft_tree(rng, K, vocab):
    toks, pars = [], []
    for i in range(K):
        p = rng.randrange(-1, i)
        used = {toks[j] for j in range(i) if pars[j] == p}
        toks.append(rng.choice([t for t in range(vocab) if t not in used]))
        pars.append(p)
    return T(toks), T(pars)


def random_selection(rng, d_tok, d_par, n, vocab):
    """The K draft nodes (parents first) at random places among n candidates (the others dropped,
    hanging under the root or under dropped ones). Returns (tokens, parents, kept, place of each kept)."""
    K = d_tok.numel()
    at = sorted(rng.sample(range(n), K))
    tok, par, kept, junk = [], [], [], []
    for i in range(n):
        if i in at:
            j = at.index(i)
            tok.append(int(d_tok[j]))
            par.append(-1 if d_par[j] < 0 else at[int(d_par[j])])
            kept.append(True)
        else:
            tok.append(rng.randrange(vocab))
            par.append(rng.choice([-1] + junk))
            kept.append(False)
            junk.append(i)
    return T(tok), T(par), T(kept, torch.bool), at


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
    n = K + free
    d_tok, d_par = random_draft_tree(rng, K, vocab)
    sel_tok, sel_par, kept, at = random_selection(rng, d_tok, d_par, n, vocab)
    cm = ContinuationMatrix(vocab, k)
    upd(cm, torch.arange(vocab), torch.randn(vocab, vocab, generator=g))
    tpl = build_template((0.6, 0.3, 0.2, 0.1), n)
    anchor = -1 if seed % 3 else rng.randrange(K)
    root = 3
    r_tok = retrieve1(cm, root if anchor < 0 else int(d_tok[anchor]), tpl)
    t, p, v, s = graft1(sel_tok, sel_par, kept, r_tok, tpl, -1 if anchor < 0 else at[anchor], free)
    assert t.numel() == p.numel() == s.numel() == v.numel() == K + free
    assert v.all()              # a draft node absorbs at most one template node: the K + free template fill
    assert torch.equal(t[:K], d_tok) and torch.equal(p[:K], d_par)
    assert s.tolist() == [False] * K + [True] * free
    assert ((p >= -1) & (p < torch.arange(K + free))).all()
    assert children_distinct(root, t, p), (t.tolist(), p.tolist())
    # every retrieved node is a real retrieval: its token is in the continuation row of its parent
    for i in range(K, K + free):
        if anchor >= 0:
            assert p[i] >= 0                            # nothing retrieved hangs at the root
        par_tok = root if p[i] < 0 else int(t[p[i]])
        assert int(t[i]) in cm.M[par_tok].tolist()


@pytest.mark.parametrize("seed", range(30))
def test_graft_trees_in_cpp_equals_the_torch_version(seed, monkeypatch):
    """On a CPU graft_trees runs as one C++ call (cpu_kernels.graft_trees, graft.FUSED); the torch
    version is the reference (GPUs, compiled steps). Random batches with frequent merges (a small
    vocabulary), a context chain (parents -2, ranks -1), scores that offer nothing (-inf), anchors under
    kept draft nodes, and more or fewer free slots than the retrieval has: element for element alike."""
    if not GR.use_kernels(torch.zeros(1)):
        pytest.skip("graft's CPU kernels did not build here")
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    vocab, k, B = rng.choice((12, 40)), 4, rng.randrange(1, 4)
    n = rng.randrange(2, 30)
    cm = ContinuationMatrix(vocab, k)
    upd(cm, torch.arange(vocab), torch.randn(vocab, vocab, generator=g))
    tpl = build_template((0.6, 0.3, 0.2, 0.1), rng.randrange(1, n + 1))
    if seed % 2:
        tpl = GR.with_chain(tpl, rng.randrange(1, 6))
    R = tpl.size
    rows = []
    for b in range(B):
        K = rng.randrange(1, min(n, 10) + 1)              # (at most 10 children of a node: vocab >= 12)
        d_tok, d_par = random_draft_tree(rng, K, vocab)
        sel_tok, sel_par, kept, at = random_selection(rng, d_tok, d_par, n, vocab)
        anchor = at[rng.randrange(K)] if rng.random() < 0.4 else -1
        r_tok = torch.randint(0, vocab, (R,), generator=g)
        score = tpl.score.clone() + 0.01 * torch.randn(R, generator=g)
        score[torch.rand(R, generator=g) < 0.2] = float("-inf")
        rows.append((sel_tok, sel_par, kept, r_tok, score, anchor, rng.randrange(0, n - K + 3)))
    st = lambda i: torch.stack([r[i] for r in rows])
    args = (st(0), st(1), st(2), st(3), tpl, T([r[5] for r in rows]), T([r[6] for r in rows]), st(4))
    monkeypatch.setattr(GR, "FUSED", True)
    fused = graft_trees(*args)
    monkeypatch.setattr(GR, "FUSED", False)
    ref = graft_trees(*args)
    for x, y in zip(fused, ref):
        assert x.dtype == y.dtype and torch.equal(x, y), (seed, x, y)


@pytest.mark.parametrize("seed", range(20))
def test_retrieval_and_learning_in_cpp_equal_the_torch_versions(seed, monkeypatch):
    """On a CPU retrieve, context_match and a drafting round's learn run as one C++ call each (graft.FUSED);
    the torch versions are the reference (GPUs, compiled steps). Random batches: repeated tokens (a small
    vocabulary), padding, accepted paths of every length, empty slots, contexts longer than a narrowed
    view and shorter than a match, methods without a matrix, a context or pending ids: every output and
    every written tensor alike, element for element."""
    from types import SimpleNamespace as NS

    from verify import Tree
    if not GR.use_kernels(torch.zeros(1)):
        pytest.skip("graft's CPU kernels did not build here")
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    B, V, k, N, F = rng.randrange(1, 5), rng.choice((6, 40)), rng.randrange(1, 5), rng.randrange(1, 9), 5
    P, S = rng.randrange(1, N + 1), rng.randrange(4, 30)

    def both(fn, *args):
        monkeypatch.setattr(GR, "FUSED", True)
        got = fn(*args)
        monkeypatch.setattr(GR, "FUSED", False)
        return got, fn(*args)

    # retrieve: a template under random nodes of each request's matrix
    M = torch.randint(0, V + 1, (B, V + 1, k), generator=g, dtype=torch.int32)
    tpl = build_template([0.6, 0.3, 0.2, 0.1][:k], rng.randrange(1, 12))
    a, b = both(GR.retrieve, M, torch.randint(0, V + 1, (B,), generator=g), tpl)
    assert a.dtype == b.dtype and torch.equal(a, b), (seed, a, b)
    # context_match: whole and narrowed contexts, repeats likely
    ctx = torch.randint(0, 3, (B, S), generator=g)
    clen = torch.tensor([rng.choice((0, 1, 2, rng.randrange(S + 1), S + 3)) for _ in range(B)])
    G, Tn = rng.randrange(1, 5), rng.randrange(1, 7)
    for c in (ctx, ctx[:, :rng.randrange(1, S + 1)]):
        got, ref = both(GR.context_match, c, clen, G, Tn)
        for x, y in zip(got, ref):
            assert x.dtype == y.dtype and torch.equal(x, y), (seed, got, ref)
    # learn: a verified round's writes
    tokens = torch.randint(0, V, (B, N), generator=g)
    valid = torch.rand(B, N, generator=g) < 0.8
    valid[:, 0] = True
    tree = Tree(tokens, torch.full((B, N), -1), valid)
    path = torch.stack([torch.cat([T([0]), torch.randperm(N - 1, generator=g) + 1])[:P] for _ in range(B)])
    active = torch.tensor([rng.choice((0, 1, 1)) for _ in range(B)])
    v = NS(logits=torch.randn(B, N, V, generator=g), path=path, A=torch.randint(0, P, (B,), generator=g),
           bonus=torch.randint(0, V, (B,), generator=g), feats=torch.randn(B, P, F, generator=g))
    keeps, at = (rng.random() < 0.8, rng.random() < 0.8, rng.random() < 0.8), [rng.randrange(S) for _ in range(B)]

    def state():
        h = torch.Generator().manual_seed(seed + 1)
        mx, cx, head = keeps
        return NS(matrix=True if mx else None, pending=True, needs_head=head, P=P,
                  M=torch.randint(0, V, (B, V + 1, k), generator=h, dtype=torch.int32) if mx else None,
                  written=torch.rand(B, V + 1, generator=h) < 0.5 if mx else None,
                  ctx=torch.randint(0, V, (B, S), generator=h) if cx else None,
                  clen=torch.tensor(at) if cx else None, pend_feats=torch.randn(B, P + 2, F, generator=h),
                  pend_ids=torch.randint(0, V, (B, P + 2), generator=h), pend_n=torch.randint(0, P, (B,), generator=h))
    a, b = state(), state()
    monkeypatch.setattr(GR, "FUSED", True)
    GR.learn(a, tree, v, active)
    monkeypatch.setattr(GR, "FUSED", False)
    GR.learn(b, tree, v, active)
    for name in ("M", "written", "ctx", "clen", "pend_feats", "pend_ids", "pend_n"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), (seed, name, x, y)


def test_graft_merges_free_slots_for_later_template_nodes():
    # both of the template's root nodes repeat draft children of the root and merge: the template has
    # a node per slot, so the next template nodes (under the merged 10) take the 2 free slots
    tpl = build_template(RATES2, 5)
    t, p, v, s = graft1(*selection(D_TOK, D_PAR, 2), T([10, 11, 90, 91, 92]), tpl, -1, 2)
    assert t.tolist() == [10, 11, 20, 90, 91] and p.tolist() == [-1, -1, 0, 0, 0]
    assert v.all() and s.tolist() == [False] * 3 + [True] * 2


def test_graft_leaves_padding_without_free_slots_or_retrieval():
    # free = 0 (pruning without retrieval) or no template at all: the dropped candidates' slots are padding
    sel = selection(D_TOK, D_PAR, 2)
    tpl = build_template(RATES2, 5)
    for r_tok, free in ((T([30, 31, 40, 41, 42]), 0), (None, 0), (None, 2)):
        t, p, v, s = graft1(*sel, r_tok, tpl if r_tok is not None else None, -1, free)
        assert t[:3].tolist() == [10, 11, 20] and p[:3].tolist() == [-1, -1, 0]
        assert v.tolist() == [True] * 3 + [False] * 2 and not s.any()


def test_graft_batch_rows_equal_each_request_alone():
    """Four requests in one call, each with its own selection, kept set, retrieval, anchor and free
    slots: row b of the result is graft_trees of request b alone."""
    rng = random.Random(5)
    g = torch.Generator().manual_seed(5)
    vocab, n = 12, 14
    cm = ContinuationMatrix(vocab, 4)
    upd(cm, torch.arange(vocab), torch.randn(vocab, vocab, generator=g))
    tpl = build_template((0.6, 0.3, 0.2, 0.1), n)
    rows = []
    for b, K in enumerate((3, 7, 1, 10)):
        d_tok, d_par = random_draft_tree(rng, K, vocab)
        sel_tok, sel_par, kept, at = random_selection(rng, d_tok, d_par, n, vocab)
        anchor = at[K - 1] if b % 2 else -1
        r_tok = retrieve1(cm, 3 if anchor < 0 else int(sel_tok[anchor]), tpl)
        rows.append((sel_tok, sel_par, kept, r_tok, anchor, n - K if b != 2 else 0))
    st = lambda i: torch.stack([r[i] for r in rows])
    got = graft_trees(st(0), st(1), st(2), st(3), tpl, T([r[4] for r in rows]), T([r[5] for r in rows]))
    for b, (tk, pr, kp, rt, an, fr) in enumerate(rows):
        alone = graft1(tk, pr, kp, rt, tpl, an, fr)
        for x, y in zip(got, alone):
            assert torch.equal(x[b], y), b
    assert got[2].sum(1).tolist() == [n, n, 1, n]                    # request 2 retrieves nothing: padding


def test_with_root_prepends_each_root_and_empties_inactive_slots():
    tokens, parents = T([[10, 11, 20], [5, 6, 7]]), T([[-1, -1, 0], [-1, 0, 1]])
    valid, retrieved = T([[True, True, False], [True, True, True]], torch.bool), T([[0, 1, 0], [0, 0, 1]], torch.bool)
    tree = GR.with_root(T([99, 98]), tokens, parents, valid, retrieved, T([True, False], torch.bool))
    assert tree.tokens.tolist() == [[99, 10, 11, 20], [98, 5, 6, 7]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1], [-1, 0, 1, 2]]
    assert tree.valid.tolist() == [[True, True, True, False], [False] * 4]      # slot 1 is empty: all padding
    assert tree.retrieved.tolist() == [[False, False, True, False], [False, False, False, True]]


# ----------------------------------------------------------------------------- the round's assembly: keep, retrieve, graft

class FakeDrafter:
    """Stands in for draft.Drafter: fixed candidate buffers (B, C) (what extend/level would have left)."""

    def __init__(self, scores, tokens, parents, top_k, depth):
        row = lambda x: x if x.dim() == 2 else x[None]
        self.scores, self.tokens, self.parents = row(scores), row(tokens), row(parents)
        self.top_k, self.depth = top_k, depth


class FakeEngine:
    """What a method reads from engine.Engine when it is set up: the drafter, B, the prior matrix, the
    device and dtype, whether it compiles, and the target's feature width."""
    device, dtype, compiling = torch.device("cpu"), torch.float32, False

    def __init__(self, drafter, matrix=None):
        import types
        self.drafter, self.B, self.matrix = drafter, drafter.scores.shape[0], matrix
        self.model = types.SimpleNamespace(args=types.SimpleNamespace(dim=4), capture_layers=(0, 1, 2), max_seq_len=64)


def set_stages(m, stages: list):
    """Make request b's stage stages[b] under the stop policy: conf_c above tau_c at the checkpoints
    before it, below at it (None: above everywhere)."""
    for b, s in enumerate(stages):
        for i, c in enumerate(m.checkpoints):
            m.conf[b, i] = 0.0 if s is not None and c >= s else 1.0


def assemble(d, m, roots, active=None):
    active = torch.ones_like(roots) if active is None else active
    return GR.assemble(d, m, roots, active)


def rows_of(d, b):
    """Request b's candidates alone (a FakeDrafter of one)."""
    return FakeDrafter(d.scores[b], d.tokens[b], d.parents[b], d.top_k, d.depth)


@torch.no_grad()
def test_graft_tail_anchor_is_deepest_draft_node():
    #            slot:    0     1     2     3     4     5     6     7
    #            level:   1     1     2     2     2     2     3     3
    d = FakeDrafter(scores=T([-0.1, -1.0, -0.2, -2.5, -3.5, -4.0, -0.3, -2.6], torch.float32),
                    tokens=T([10, 11, 12, 13, 14, 15, 16, 17]), parents=T([-1, -1, 0, 0, 1, 1, 2, 2]),
                    top_k=2, depth=3)
    cfg = GR.Config(budget=5, top_k=2, depth=3)
    cm = ContinuationMatrix(64, 8)
    g = GR.GraftNaiveTail(FakeEngine(d), cfg, matrix=cm)
    assert g.anchor == "deepest" and g.cfg.ablation == "tail"
    a = g.stages[None][1]                           # retrieved nodes on top of the dense tree
    tree = assemble(d, g, T([30]))
    assert tree.tokens.shape == (1, 1 + 5 + a)
    tokens, parents, retrieved = tree.tokens[0], tree.parents[0], tree.retrieved[0]
    # budget 5 keeps slots 0, 1, 2, 3, 6: leaves 1 (depth 1), 3 (depth 2), 6 (depth 3, best path)
    assert tokens[:6].tolist() == [30, 10, 11, 12, 13, 16]
    assert retrieved.tolist() == [False] * 6 + [True] * a and tree.valid.all()
    # the retrieval subtree's top nodes hang under the anchor: tree index 5 = draft node 16
    tops = {int(parents[i]) for i in range(6, 6 + a) if not retrieved[parents[i]]}
    assert tops == {5}, f"retrieval hangs under tree node(s) {tops}, tokens {tokens.tolist()}"
    assert (cm.M[16].long() == tokens[6]).any()     # retrieved from 16's row


@torch.no_grad()
def test_tail_anchor_is_per_request():
    """Two requests: the first's best level-3 node is slot 6 (token 16), the second's slot 7 (token 17),
    and the second's matrix differs: each request's retrieval hangs under its own deepest node, read
    from its own matrix, as assembling it alone does."""
    scores = T([[-0.1, -1.0, -0.2, -2.5, -3.5, -4.0, -0.3, -2.6],
                [-0.1, -1.0, -0.2, -2.5, -3.5, -4.0, -2.6, -0.3]], torch.float32)
    tokens = T([10, 11, 12, 13, 14, 15, 16, 17]).expand(2, -1)
    parents = T([-1, -1, 0, 0, 1, 1, 2, 2]).expand(2, -1)
    d = FakeDrafter(scores, tokens, parents, 2, 3)
    cm = ContinuationMatrix(64, 8)
    g = GR.GraftNaiveTail(FakeEngine(d), GR.Config(budget=5, top_k=2, depth=3), matrix=cm)
    upd_b = ContinuationMatrix(64, 8)
    upd(upd_b, T([16, 17]), torch.randn(2, 64, generator=torch.Generator().manual_seed(0)))
    g.M[1].copy_(upd_b.M)
    tree = assemble(d, g, T([30, 31]))
    assert tree.tokens[:, 5].tolist() == [16, 17]               # the anchors, each at tree index 5
    assert (tree.tokens[1, 6:].long()[:, None] == upd_b.M[17].long()[None]).any(-1)[tree.parents[1, 6:] == 5].all()
    for b in range(2):
        one = GR.GraftNaiveTail(FakeEngine(rows_of(d, b)), GR.Config(budget=5, top_k=2, depth=3), matrix=cm)
        one.M[0].copy_(g.M[b])
        alone = assemble(rows_of(d, b), one, tree.tokens[b, :1])
        for f in ("tokens", "parents", "valid", "retrieved"):
            assert torch.equal(getattr(tree, f)[b], getattr(alone, f)[0]), (b, f)


def stage_drafter(B: int, k: int = 2, levels: int = 8) -> FakeDrafter:
    """`levels` levels of a k = 2 tree (level 1 has k nodes, later levels k*k), scores falling with
    the level, the same candidates for B requests."""
    scores, tokens, parents, off = [], [], [], 0
    for lvl in range(1, levels + 1):
        n = k if lvl == 1 else k * k
        scores += [-0.1 * lvl - 0.01 * j for j in range(n)]
        tokens += [10 + off + j for j in range(n)]
        parents += [-1] * n if lvl == 1 else [off - (k if lvl == 2 else k * k) + (j // k) for j in range(n)]
        off += n
    row = lambda x, dt=torch.long: T(x, dt)[None].expand(B, -1).clone()
    return FakeDrafter(row(scores, torch.float32), row(tokens), row(parents), k, levels)


@torch.no_grad()
@pytest.mark.parametrize("cls", [GR.Graft, GR.Prune])
def test_assemble_picks_each_requests_keep_size_from_its_stage(cls):
    """Every stage in one batch (--checkpoints 0,1,5,6, no --keep, stop policy): request b pruned at
    stage b keeps K of its stage (candidates of the levels drafted by then only) and retrieves its R
    (graft) or leaves them as padding (prune); every tree has the same N nodes; each row is what
    assembling that request alone gives."""
    stages = [None, 0, 1, 5, 6]
    d = stage_drafter(len(stages))
    cfg = GR.Config(budget=20, checkpoints=(0, 1, 5, 6), thresholds={0: 0.5, 1: 0.5, 5: 0.5, 6: 0.5}, policy="stop")
    assert len(cfg.keep_sizes()) == 4
    g = cls(FakeEngine(d, ContinuationMatrix(64, 8)), cfg)
    assert g.policy == "stop" and set(g.stages) == {None, 0, 1, 5, 6} and g.N == 21
    set_stages(g, stages)
    roots = T([30, 31, 32, 33, 34])
    tree = assemble(d, g, roots)
    assert tree.tokens.shape == (5, 21) and tree.tokens[:, 0].tolist() == roots.tolist()
    k = d.top_k
    for b, s in enumerate(stages):
        K, R = g.stages[s]
        assert R == 0 or cls is GR.Graft
        assert int(tree.valid[b].sum()) == 1 + K + R, (s, K, R)
        assert int(tree.retrieved[b].sum()) == R
        drafted = set(d.tokens[b, :k + (s if s is not None else d.depth - 1) * k * k].tolist())
        assert set(tree.tokens[b, 1:1 + K].tolist()) <= drafted                # levels drafted by the stage
        one = cls(FakeEngine(rows_of(d, b), ContinuationMatrix(64, 8)), cfg)
        set_stages(one, [s])
        alone = assemble(rows_of(d, b), one, roots[b:b + 1])
        for f in ("tokens", "parents", "valid", "retrieved"):
            assert torch.equal(getattr(tree, f)[b], getattr(alone, f)[0]), (s, f)


@torch.no_grad()
def test_assemble_replace_policy_drops_low_confidence_nodes_and_fills_with_retrieval():
    """The batch variant ("replace"): the full tree is drafted; a node whose path probability, or an
    ancestor's, is below the threshold of the deepest checkpoint its level has passed is dropped, and
    retrieved nodes fill the slots, under the best node of the deepest kept level."""
    #            slot:    0     1     2     3     4     5     6     7     8     9
    #            level:   1     1     2     2     2     2     3     3     3     3
    scores = T([0.9, 0.4, 0.5, 0.35, 0.2, 0.1, 0.45, 0.25, 0.2, 0.05], torch.float32).log()
    d = FakeDrafter(scores, T([10, 11, 12, 13, 14, 15, 16, 17, 18, 19]), T([-1, -1, 0, 0, 1, 1, 2, 2, 3, 3]), 2, 3)
    cfg = GR.Config(budget=6, checkpoints=(0, 1), keep=(3, 6), thresholds={0: 0.5, 1: 0.3}, policy="replace")
    cm = ContinuationMatrix(64, 8)
    g = GR.Graft(FakeEngine(d, cm), cfg)
    assert g.policy == "replace" and g.anchor == "deepest"
    # level 1 reads tau_0 = 0.5: 11 (0.4) goes, and its children with it; levels 2, 3 read tau_1 = 0.3
    assert g.log_tau.exp().tolist() == pytest.approx([0.5, 0.5] + [0.3] * 8)
    tree = assemble(d, g, T([30]))
    n_kept = 4                                       # 10, 12, 13, 16 (0.9, 0.5, 0.35, 0.45); not 17 (0.25)
    assert tree.tokens[0, :1 + n_kept].tolist() == [30, 10, 12, 13, 16]
    assert tree.parents[0, :1 + n_kept].tolist() == [-1, 0, 1, 1, 2]
    assert tree.valid.all() and tree.retrieved[0].tolist() == [False] * (1 + n_kept) + [True] * (6 - n_kept)
    tops = {int(p) for p, r in zip(tree.parents[0, 1 + n_kept:], tree.retrieved[0, 1 + n_kept:]) if not tree.retrieved[0, p]}
    assert tops == {4}                               # under 16, the kept node of the deepest level


@torch.no_grad()
def test_assemble_empty_slot_is_all_padding():
    d = stage_drafter(2)
    cfg = GR.Config(budget=20, checkpoints=(0, 1, 5, 6), thresholds={0: 0.5, 1: 0.5, 5: 0.5, 6: 0.5}, policy="stop")
    g = GR.Graft(FakeEngine(d, ContinuationMatrix(64, 8)), cfg)
    tree = assemble(d, g, T([30, 31]), T([1, 0]))
    assert tree.valid[0].all() and not tree.valid[1].any()


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
    return CAL.time_passes(run, sorted(PASS_MS), 8, timer=lambda: now[0])


@pytest.mark.parametrize("hit,factors", [(4, [1.49, 1.81, 2.39]),                  # the issue's
                                         (6, [1.49, 1.81, 2.39, 3.5, 5.0])])       # and worse
def test_noisy_timings_give_the_same_budget_and_thresholds_every_time(hit, factors):
    choices, by_mean, no_ties = set(), set(), set()
    for seed in range(20):
        samples = noisy_samples(seed, hit, factors)
        fastest, spread = CAL.robust_costs(samples)
        ms = {n: 1000 * c for n, c in CAL.monotone(fastest).items()}
        b, taus, _, _ = CAL.choose_budget(budget_options(ms), (0,), spread, CAL.MIN_TIE)   # as the warm-up calls it
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
    samples = CAL.time_passes(run, [1, 9, 13], 2, timer=lambda: now[0])
    assert calls == [1, 1, 9, 9, 13, 13, 13, 13, 9, 9, 1, 1]                 # untimed, timed; reversed sweep
    assert samples == {1: [1.0, 1.0], 9: [9.0, 9.0], 13: [13.0, 13.0]}


def test_robust_costs_fastest_sample_and_spread():
    costs, spread = CAL.robust_costs({9: [43.1, 26.9, 20.0, 20.2], 13: [18.9, 33.5, 19.0, 40.0]})
    assert costs == {9: 20.0, 13: 18.9}
    assert spread == pytest.approx((0.2 / 20.0 + 0.1 / 18.9) / 2)              # median of the two sizes' gaps


def test_monotone_fit_never_lets_a_bigger_tree_cost_less():
    assert CAL.monotone({1: 4.0, 9: 20.0, 13: 18.9, 17: 26.0}) == {1: 4.0, 9: pytest.approx(19.45),
                                                                  13: pytest.approx(19.45), 17: 26.0}
    assert CAL.monotone({1: 3.0, 9: 2.0, 13: 1.0}) == {1: 2.0, 9: 2.0, 13: 2.0}


def test_choose_budget_prefers_the_smaller_within_the_spread():
    """12's expected rate beats 8's by 0.5%: with a 0.6% spread (one spread: 0.6%) that is a tie."""
    options = budget_options(PASS_MS, {8: (3, 2), 12: (3.24, 2.16)})
    b, _, _, curve = CAL.choose_budget(options, (0,))
    assert b == 12 and curve[12] == pytest.approx(curve[8] * 1.005, rel=1e-3)
    assert CAL.choose_budget(options, (0,), spread=0.006)[0] == 8
    assert CAL.choose_budget(options, (0,), spread=0.004)[0] == 12
    assert CAL.choose_budget(options, (0,), floor=CAL.MIN_TIE)[0] == 8       # the floor alone: a tie


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
    full = CAL.stage_tree(rec, None, 3, 0, (0.5, 0.25), k)     # a tree of one request, (1, N)
    assert full.tokens.tolist() == [[99, 10, 11, 12]]          # slot 2 (-0.15) beats slot 1's children
    assert full.parents.tolist() == [[-1, 0, 0, 1]] and full.valid.all()
    early = CAL.stage_tree(rec, 0, 2, 2, (0.5, 0.25), k)        # stage 0: level 1 only, then 2 retrieved
    assert early.tokens.tolist() == [[99, 10, 11, 20, 21]] and early.retrieved.tolist() == [[False] * 3 + [True] * 2]
    assert CAL.accepted_by(full, [10, 12, 5]) == 2 and CAL.accepted_by(early, [20, 7]) == 1
    # with the context chain graft's round offers (a match of 3 tokens, then 30, 31) scored above the
    # matrix's nodes (q(3) = 0.9 > 0.5): the 2 free slots take the chain, as the round's retrieval would
    log_q = torch.tensor([float("-inf"), 0.5, 0.7, 0.9]).log()
    chained = CAL.stage_tree({**rec, "context": ([30, 31], 3)}, 0, 2, 2, (0.5, 0.25), k, log_q)
    assert chained.tokens.tolist() == [[99, 10, 11, 30, 31]] and chained.parents.tolist() == [[-1, 0, 0, 0, 3]]
    assert CAL.accepted_by(chained, [30, 31, 5]) == 2 and CAL.accepted_by(early, [30, 31, 5]) == 0
    assert CAL.stage_tree({**rec, "context": ([], 0)}, 0, 2, 2, (0.5, 0.25), k, log_q).tokens.tolist() == \
        early.tokens.tolist()                                    # no match: the matrix's nodes, as before


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
    per = lambda taus: {"eagle3": {"budget": 24, "depth": 3, "rate": 50.0, "thresholds": {}},
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
    assert cal["throughput"]["eagle3"]["depth"] == 3


@pytest.mark.parametrize("spoil", [
    lambda m: m["calibrations"].pop("youden"),                                           # one missing
    lambda m: m["calibrations"]["throughput"]["graft"]["thresholds"].pop("5"),           # other checkpoints
    lambda m: m["calibrations"]["throughput"]["prune"]["thresholds"].update({"0": float("nan")}),
    lambda m: m["calibrations"]["youden"]["graft"]["thresholds"].update({"1": 7.0}),     # not a probability
    lambda m: m["calibrations"]["throughput"]["graft"].update({"budget": 0}),
    lambda m: m["calibrations"]["throughput"]["graft"].update({"budget": "many"}),
    lambda m: m["calibrations"]["throughput"]["eagle3"].update({"depth": 0}),
    lambda m: m.update({"budget_curve": {"graft": {"x": 1.0}}}),
])
def test_read_calibrations_refuses_what_does_not_fit(spoil):
    from calibrate import read_calibrations
    meta = good_meta()
    spoil(meta)
    assert read_calibrations(meta, (0, 1, 5)) is None


def test_method_config_uses_each_methods_own_calibration():
    from calibrate import read_calibrations
    from calibrate import method_config
    cal = GR.Calibration(read_calibrations(good_meta(), (0, 1, 5))[0], "throughput")
    cfg = GR.Config(budget=16)
    assert method_config(cal, "prune", cfg, auto_budget=True).budget == 12
    # thresholds: without a --calibration the method reads the one its pruning policy names (below);
    # with one, method_config sets that calibration's
    assert method_config(cal, "graft", cfg, auto_budget=False) == cfg
    assert method_config(cal, "graft", cfg, False, calibration="throughput") == GR.Config(
        budget=16, thresholds={0: 1.0, 1: 0.0, 5: 0.0})
    assert method_config(cal, "graft-naive-root", cfg, auto_budget=True).budget == 8        # ablations: graft's
    assert method_config(cal, "graft", cfg, False, calibration="youden").thresholds == {0: 0.05, 1: 0.08, 5: 0.002}
    given = GR.Config(budget=16, thresholds={0: 0.5, 1: 0.5, 5: 0.5})                  # --thresholds wins
    assert method_config(cal, "graft", given, False, calibration="youden").thresholds == given.thresholds
    assert method_config(cal, "eagle3", cfg, auto_budget=True) == GR.Config(budget=24, depth=3)   # its calibrated depth
    assert method_config(cal, "pld", cfg, auto_budget=True) == cfg                   # not calibrated
    assert method_config(None, "graft", cfg, auto_budget=True) == cfg                # nothing calibrated
    assert cal.budget == 8 and cal.thresholds == {0: 1.0, 1: 0.0, 5: 0.0}


@torch.no_grad()
def test_methods_read_their_own_calibration_by_policy():
    """A pruning method set up with the warm-up's Calibration reads its own method's thresholds: under
    the stop policy the chosen calibration's, under replace Youden's (graft.POLICIES); --thresholds
    (Config.thresholds) overrides both."""
    from calibrate import read_calibrations
    cal = GR.Calibration(read_calibrations(good_meta(), (0, 1, 5))[0], "throughput")
    one, two = stage_drafter(1, levels=3), stage_drafter(2, levels=3)
    cfg = GR.Config(budget=8)
    assert GR.Graft(FakeEngine(one, ContinuationMatrix(64, 8)), cfg, cal).thresholds == {0: 1.0, 1: 0.0, 5: 0.0}
    assert GR.Graft(FakeEngine(two, ContinuationMatrix(64, 8)), cfg, cal).policy == "stop"      # (no CUDA graphs)
    g2 = GR.Graft(FakeEngine(two, ContinuationMatrix(64, 8)), GR.Config(budget=8, policy="replace"), cal)
    assert g2.policy == "replace" and g2.thresholds == {0: 0.05, 1: 0.08, 5: 0.002}
    p = GR.Prune(FakeEngine(one), GR.Config(budget=8, checkpoints=(0, 1)), cal)
    assert p.thresholds == {0: 1.0, 1: 0.0}
    youden = GR.Calibration(cal.methods, "youden")
    assert GR.Prune(FakeEngine(one), cfg, youden).thresholds == {0: 0.05, 1: 0.08, 5: 0.002}
    given = GR.Config(budget=8, thresholds={0: 0.5, 1: 0.25, 5: 0.125})
    assert GR.Graft(FakeEngine(two, ContinuationMatrix(64, 8)), given, cal).thresholds == given.thresholds
    assert GR.Eagle3Tree(FakeEngine(one), cfg, cal).thresholds == {}                  # never prunes
