"""One Graft round on a mock target and a mock head, step by step (nanochat style: small fakes with
known outputs, exact expectations).

The head drafts two levels of a top-2 tree with known probabilities; checkpoint 1 prunes it (its best
path, 0.32, is below tau = 0.5); the round keeps the 4 best draft nodes, retrieves 2 nodes from a
continuation matrix written by hand (two retrieved nodes repeat draft nodes and are merged), verifies
the hybrid tree against a target whose next token after each token is a fixed table, accepts three
tokens (the last one retrieved), and writes the matrix rows of every verified node.

The round is graft.Graft.round, run by engine.Engine.step (the round, then the one commit) on a mock
engine whose steps are the real ones (assemble, verify, learn) except the target's and the head's
forwards. A single request is a batch of one; the last tests put a second request beside it, which
drafts deeper (its confidence passes checkpoint 1), and check that each request's round is what it is
alone.
"""
import types
from functools import partial

import torch

import engine as E
import graft as GR
from graft import Calibration, Config, ContinuationMatrix, Graft, build_template
from verify import Sampling, SlotSampling, sampling_mode, verify

T = torch.tensor
V = 40                                                  # vocabulary
NEXT = {5: 10, 10: 12, 12: 30, 30: 7, 7: 2}             # the target's next token (2 for every other token)
RATES = (0.6, 0.3, 0.1)                                 # per-rank hit rates: the matrix keeps 3 per token
F = 12                                                  # feature width: 3 capture layers of dim 4


class MockTarget:
    """Logits that make NEXT[t] the target's choice after t, then 0, 1, 2, ... in that order; each
    node's features hold its token."""

    def __call__(self, tokens, positions, rows=None, mask=None, capture=False, cache=None, keep=None, slots=None):
        B, N = tokens.shape
        nxt = T([[NEXT.get(int(t), 2) for t in row] for row in tokens])
        logits = -0.01 * torch.arange(V, dtype=torch.float32).repeat(B, N, 1)
        logits.scatter_(2, nxt[..., None], 10.0)
        feats = tokens[..., None].float().expand(B, N, F)
        return (logits, feats) if capture else logits


# Each request's drafts: per level the tokens, the head's probability of each given its parent, and the
# parents (candidate slots; -1 = the root). Request 0 is the story of the module docstring: level 1 is
# 10 (p 0.8) and 11 (0.1) under the root; level 2 is 12 (0.4) and 13 (0.3) under 10, 14 (0.5) and 15
# (0.2) under 11; its level 3 (never drafted alone) scores high, so that a request pruned at
# checkpoint 1 must leave it out. Request 1 (root 30, the target goes on 7, 2, 2): 7 (0.9) and 11;
# then 2 (0.7) under 7; then 2 (0.8) under that: conf_1 = 0.63 passes checkpoint 1.
DRAFTS = {
    0: [([10, 11], [0.8, 0.1], [-1, -1]), ([12, 13, 14, 15], [0.4, 0.3, 0.5, 0.2], [0, 0, 1, 1]),
        ([34, 35, 36, 37], [0.9, 0.5, 0.5, 0.5], [2, 2, 3, 3])],
    1: [([7, 11], [0.9, 0.05], [-1, -1]), ([2, 13, 14, 15], [0.7, 0.2, 0.5, 0.4], [0, 0, 1, 1]),
        ([2, 17, 18, 19], [0.8, 0.1, 0.1, 0.05], [2, 2, 3, 3])],
}


class MockHead:
    """draft.Drafter's interface (B requests) with the known drafts above: extend drafts level 1,
    level(i) level i+2; each returns every request's best path probability."""
    top_k, depth = 2, 3

    def __init__(self, requests=(0,)):
        self.requests = list(requests)
        B = len(self.requests)
        self.C = 2 + 2 * 4
        self.scores = torch.full((B, self.C), float("-inf"))
        self.tokens = torch.zeros(B, self.C, dtype=torch.long)
        self.parents = torch.full((B, self.C), -1, dtype=torch.long)
        self.calls, self.read = [], []

    def _draft(self, level: int) -> torch.Tensor:
        at = slice(0, 2) if level == 0 else slice(2 + 4 * (level - 1), 6 + 4 * (level - 1))
        for b, r in enumerate(self.requests):
            toks, p, par = DRAFTS[r][level]
            par = T(par)
            base = torch.where(par < 0, 0.0, self.scores[b].clamp(min=-1e9)[par.clamp(min=0)])
            self.scores[b, at] = base + T(p).log()
            self.tokens[b, at], self.parents[b, at] = T(toks), par
        return self.scores[:, at].max(1).values.exp()

    def extend(self, feats, ids, n, cols, k=None):
        assert k in (None, self.top_k)                                     # these rounds' budgets leave the beam whole
        self.calls.append("extend")
        self.read.append([ids[b, :int(n[b])].tolist() for b in range(len(self.requests))])
        self.scores.fill_(float("-inf"))
        return self._draft(0)                                              # conf_0: the best path

    def level(self, i, cols, k=None):
        assert k in (None, self.top_k)
        self.calls.append(f"level {int(i)}")
        return self._draft(int(i) + 1)                                     # conf_{i+1}


class MockEngine:
    """What a round reads from engine.Engine: the slots and their device state, the drafter, the clock,
    the cache columns and the step table, whose steps are the real ones except the two models' forwards.
    Its step() is Engine.step itself: the method's round, then the one commit."""
    device, dtype = torch.device("cpu"), torch.float32
    step = E.Engine.step
    settle = E.Engine.settle
    advance_head = E.Engine.advance_head
    pending_rows = E.Engine.pending_rows
    compiling = False

    def __init__(self, head, matrix, prompts, roots, L, samplings=None):
        B = len(prompts)
        self.drafter, self.B, self.matrix = head, B, matrix
        self.model = types.SimpleNamespace(args=types.SimpleNamespace(dim=4), capture_layers=(0, 1, 2), max_seq_len=64)
        self.L, self.root, self.active = T(L), T(roots), torch.ones(B, dtype=torch.long)
        self.grow, self.grow_host, self.drafts = torch.ones(B, dtype=torch.bool), torch.ones(B, dtype=torch.bool), [True] * B
        samplings = samplings or [Sampling()] * B
        self.smp, self.mode = SlotSampling(B, "cpu"), sampling_mode(samplings)
        for b, s in enumerate(samplings):
            self.smp.set(b, s)
        self.slots = [E.Slot(E.Request(list(p), s), L=l, Ld=l - 1, pend=1) for p, s, l in zip(prompts, samplings, L)]
        self.clock = types.SimpleNamespace(mark=lambda phase: None)
        self.fills = types.SimpleNamespace(level=[T(i) for i in range(head.depth)])
        cache = types.SimpleNamespace(move_rows=lambda src, dst: None)
        self.steps = types.SimpleNamespace(extend=head.extend, level=head.level, assemble=partial(GR.assemble, head),
                                           verify=partial(verify, MockTarget(), cache), learn=GR.learn,
                                           mark=lambda: None)
        self.head_rows = []                  # what the method sent to the head's prefill

    def slot_index(self, b):
        return T([b])

    def head_prefill(self, b, feats, ids, n):
        self.head_rows.append((b, feats.clone(), ids.clone(), n))

    def cols(self, n, head=False):
        return torch.arange(16)

    def requests(self):
        return [s.request for s in self.slots]


CFG = Config(budget=6, top_k=2, depth=3, checkpoints=(0, 1), keep=(2, 4), thresholds={0: 0.5, 1: 0.5}, matrix_k=3,
             policy="stop")
PRIOR = {5: [10, 20, 21], 10: [12, 22, 23], 12: [30, 31, 29], 20: [24, 25, 26]}


def prior_matrix() -> ContinuationMatrix:
    matrix = ContinuationMatrix(V, 3)
    for tok, row in PRIOR.items():
        matrix.M[tok] = T(row, dtype=torch.int32)
        matrix.written[tok] = True
    return matrix


def make_round(requests=(0,)):
    """A Graft on the mock engine with its requests admitted as Engine.admit does (the method's admit,
    one prefill chunk, prefilled): request 0 (prompt [1, 2, 9], root 5, 3 committed rows) and request 1
    (prompt [1, 3, 4, 9], root 30, 4 rows), each starting from the prior matrix, with the prompt's last
    feature and the root pending for the head."""
    head, matrix = MockHead(requests), prior_matrix()
    table = {0: ([1, 2, 9], 5, 3), 1: ([1, 3, 4, 9], 30, 4)}
    prompts, roots, L = zip(*(table[r] for r in requests))
    eng = MockEngine(head, matrix, prompts, roots, L)
    g = Graft(eng, CFG, Calibration(hit_rates=RATES), matrix)
    for b, p in enumerate(prompts):
        g.admit(eng, b)
        ids = T([p])
        logits, feats = MockTarget()(ids, None, capture=True)
        g.prompt_chunk(eng, b, ids, logits, feats, len(p))
        g.prefilled(eng, b)
    return g, eng, head, matrix


def test_admission_feeds_the_head_not_the_matrix():
    """The prompt's rows for the head pair feature t with token t+1 (the last feature waits for the
    root); the request's matrix starts as the prior and does not learn the prompt (docs/graft.md, 3)."""
    g, eng, _, matrix = make_round()
    [(b, feats, ids, n)] = eng.head_rows
    assert b == 0 and n == 2 and ids.tolist() == [[2, 9, 0]] and feats[0, :, 0].tolist() == [1, 2, 9]
    assert g.pend_feats[0, 0, 0] == 9 and g.pend_ids[0, 0] == 5 and g.pend_n.tolist() == [1]
    assert torch.equal(g.M[0], matrix.M) and torch.equal(g.written[0], matrix.written)


def test_the_template_is_the_best_rank_paths():
    """Step 3's shape: the 6 rank paths of largest hit-rate product, best first (parents first)."""
    tpl = build_template(RATES, 6)
    assert tpl.parents.tolist() == [-1, 0, -1, 1, 0, 2] and tpl.ranks.tolist() == [0, 0, 1, 0, 1, 0]


def test_step_1_drafts_until_checkpoint_1_prunes():
    g, eng, head, _ = make_round()
    assert g.policy == "stop" and g.P == 7 and g.N == 7
    rnd, got = eng.step(g)
    assert head.calls == ["extend", "level 0"]                 # level 3 is never drafted
    assert head.read == [[[5]]]                                # the first extend reads the root after the prompt
    assert rnd.stages == [1] and rnd.forwards == 2
    assert rnd.syncs == 1 + 2                                  # the commit, and the checkpoints 0 and 1 reached
    assert g.stages[1] == (4, 2)                               # stage 1 keeps 4 draft nodes and retrieves 2
    assert eng.slots[0].Ld == 3                                # the head read one row (the root)


def test_steps_2_to_4_keep_retrieve_graft():
    """Keep the 4 best draft nodes (10, 11, 12, 13); retrieve the template under the root: 10 and 12
    repeat draft nodes and merge, so the 2 free slots go to 20 (under the root) and 30 (under 12)."""
    g, eng, _, _ = make_round()
    rnd, _ = eng.step(g)
    t = rnd.tree
    assert t.tokens.tolist() == [[5, 10, 11, 12, 13, 20, 30]]
    assert t.parents.tolist() == [[-1, 0, 0, 1, 1, 0, 3]]
    assert t.valid.all() and t.retrieved.tolist() == [[False] * 5 + [True, True]]


def test_step_5_verifies_and_accepts_the_targets_path():
    """The target continues 5 -> 10 -> 12 -> 30 -> 7: three tokens accepted (the last a retrieved
    node), bonus 7, which also lands in the engine's root buffer."""
    g, eng, _, _ = make_round()
    rnd, got = eng.step(g)
    assert got == [([10, 12, 30], 7, [0, 0, 1], 6)]            # (accepted, bonus, retrieved flags, real nodes)
    assert rnd.v.path.tolist()[0][:4] == [0, 1, 3, 6] and eng.root.tolist() == [7] and eng.L.tolist() == [3 + 4]
    assert eng.slots[0].L == 3 + 4 and eng.slots[0].pend == 4


def test_step_6_updates_the_matrix_and_the_heads_input():
    """Every verified node's row of the request's matrix becomes the target's top 3 after it; the
    head's next input is the accepted path and the bonus; the prior learns it when the request ends."""
    g, eng, head, matrix = make_round()
    eng.step(g)
    rows = {t: g.M[0, t].tolist() for t in (5, 10, 11, 12, 13, 20, 30)}
    assert rows == {5: [10, 0, 1], 10: [12, 0, 1], 11: [2, 0, 1], 12: [30, 0, 1], 13: [2, 0, 1], 20: [2, 0, 1],
                    30: [7, 0, 1]}
    assert g.pend_ids.tolist()[0][:4] == [10, 12, 30, 7]           # (the rest: filler, not read)
    assert g.pend_feats[0, :4, 0].tolist() == [5, 10, 12, 30]        # the path's features: the root's first
    assert g.pend_n.tolist() == [4] and eng.slots[0].pend == 4
    assert not g.written[0, 24]                                # a retrieved token that was never verified
    assert matrix.M[12].tolist() == [30, 31, 29]               # the prior: untouched while the request runs
    eng.step(g)                                                # the next round's extend reads the path
    assert head.read[1] == [[10, 12, 30, 7]]
    g.finish(eng, 0)
    assert torch.equal(matrix.M, g.M[0]) and torch.equal(matrix.written, g.written[0])
    assert g.pend_n.tolist() == [0]                            # an empty slot's extend reads nothing


def test_a_recorded_round_returns_what_the_warm_up_reads_before_the_matrix_learns():
    """round(record=True) (the warm-up's): the round returns its record, taken after verification while
    the matrix still holds what the round retrieved from: the confidences of every configured
    checkpoint reached, the drafter's candidates, the rank at which each node's row held the target's
    choice, and the record template's retrieval under the root. Without record: no record."""
    g, eng, head, matrix = make_round()
    rnd, _ = eng.step(g)
    assert rnd.record is None
    g, eng, head, matrix = make_round()
    g.record_tpl = build_template(RATES, 4)
    rnd, _ = eng.step(g, record=True)
    rec = rnd.record
    assert sorted(rec["conf"]) == [0, 1]
    assert [round(float(rec["conf"][c][0]), 4) for c in (0, 1)] == [0.8, 0.32]
    assert torch.equal(rec["scores"], head.scores) and torch.equal(rec["tokens"], head.tokens)
    #   tree:              5  10  11  12  13  20  30
    #   target after it:  10  12   2  30   2   2   7
    #   row before:    [10 20 21] [12 22 23] fallback [30 31 29] fallback [24 25 26] fallback
    assert rec["rank"].tolist() == [[0, 0, 2, 0, 2, 3, 3]]     # 3: not in the row (after learning: all 0)
    assert rec["retrieved"].tolist() == [[10, 12, 20, 30]]     # the template (0.6, 0.3, 0.1) of 4 under 5
    assert rnd.stages == [1] and head.calls == ["extend", "level 0"]


def test_a_full_round_drafts_every_level_without_checkpoint_syncs():
    """full=True (the compile warm-up): every level's step runs, whatever the confidences, and no
    checkpoint is read on the host; the output stays the target's."""
    g, eng, head, _ = make_round()
    rnd, got = eng.step(g, full=True)
    assert head.calls == ["extend", "level 0", "level 1"] and rnd.forwards == 3 and rnd.syncs == 1
    assert got[0][0] + [got[0][1]] == [10, 12, 30, 7][:len(got[0][0]) + 1]


def test_two_requests_prune_each_at_its_own_stage():
    """Request 1 beside request 0: checkpoint 1 stops request 0 (0.32 < 0.5) but not request 1 (0.63),
    so drafting goes on to level 3 for it. Request 0's tree is the one above (its level 3, drafted for
    request 1, is left out: stage 1 keeps only levels 1-2); request 1 keeps its best 6 nodes of all
    three levels and retrieves nothing (stage None); each accepts what its target says, and each
    request's tree, commit and state are those of its round alone."""
    g, eng, head, _ = make_round((0, 1))
    rnd, got = eng.step(g)
    assert head.calls == ["extend", "level 0", "level 1"] and rnd.forwards == 3 and rnd.syncs == 1 + 2
    assert rnd.stages == [1, None]
    assert rnd.tree.tokens.tolist() == [[5, 10, 11, 12, 13, 20, 30], [30, 7, 11, 2, 13, 2, 17]]
    assert rnd.tree.parents.tolist()[1] == [-1, 0, 0, 1, 1, 3, 3]
    assert not rnd.tree.retrieved[1].any()
    assert got == [([10, 12, 30], 7, [0, 0, 1], 6), ([7, 2, 2], 2, [0, 0, 0], 6)]
    assert eng.root.tolist() == [7, 2] and eng.L.tolist() == [7, 8] and g.pend_n.tolist() == [4, 4]
    for b in (0, 1):
        g1, eng1, _, _ = make_round((b,))
        rnd1, got1 = eng1.step(g1)
        assert got1 == [got[b]] and rnd1.stages == [rnd.stages[b]], b
        for f in ("tokens", "parents", "valid", "retrieved"):
            assert torch.equal(getattr(rnd1.tree, f)[0], getattr(rnd.tree, f)[b]), (b, f)
        assert torch.equal(g1.M[0], g.M[b]) and torch.equal(g1.pend_ids[0], g.pend_ids[b]), b


def test_an_empty_slot_beside_a_request_changes_nothing():
    """Slot 1 without a request (its tree all padding, nothing accepted, L stays): request 0's round is
    its round alone, and the empty slot commits nothing."""
    g, eng, head, _ = make_round((0, 1))
    eng.slots[1] = E.Slot()
    eng.L[1], eng.active[1] = 0, 0
    rnd, got = eng.step(g)
    assert got == [([10, 12, 30], 7, [0, 0, 1], 6), None]
    assert rnd.stages == [1, None] and head.calls == ["extend", "level 0"]     # only request 0 decides
    assert not rnd.tree.valid[1].any() and eng.L.tolist() == [7, 0] and g.pend_n.tolist() == [4, 0]
