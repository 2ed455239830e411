"""One Graft round on a mock target and a mock head, step by step (nanochat style: small fakes with
known outputs, exact expectations).

The head drafts two levels of a top-2 tree with known probabilities; checkpoint 1 prunes it (its best
path, 0.32, is below tau = 0.5); the round keeps the 4 best draft nodes, retrieves 2 nodes from a
continuation matrix written by hand (two retrieved nodes repeat draft nodes and are merged), verifies
the hybrid tree against a target whose next token after each token is a fixed table, accepts three
tokens (the last one retrieved), and writes the matrix rows of every verified node.
"""
import types

import torch

from test_graft import FakeEngine
from graft import Config, ContinuationMatrix, Graft, build_template, graft_round
from verify import Sampling, verify

T = torch.tensor
V = 40                                                  # vocabulary
NEXT = {5: 10, 10: 12, 12: 30, 30: 7}                   # the target's next token (2 for every other token)
RATES = (0.6, 0.3, 0.1)                                 # per-rank hit rates: the matrix keeps 3 per token


class MockTarget:
    """Logits that make NEXT[t] the target's choice after t, then 0, 1, 2, ... in that order."""
    cache = types.SimpleNamespace(move_rows=lambda src, dst: None)

    def __call__(self, tokens, positions, rows=None, mask=None, capture=False, cache=None, keep=None):
        nxt = T([NEXT.get(int(t), 2) for t in tokens[0]])
        logits = -0.01 * torch.arange(V, dtype=torch.float32).repeat(tokens.shape[1], 1)
        logits[torch.arange(tokens.shape[1]), nxt] = 10.0
        feats = torch.zeros(1, tokens.shape[1], 12)
        return (logits[None], feats) if capture else logits[None]


class MockHead:
    """draft.Drafter's interface with known drafts: level 1 is 10 (p 0.8) and 11 (0.1) under the root;
    level 2 is 12 (0.4) and 13 (0.3) under 10, 14 (0.5) and 15 (0.2) under 11."""
    top_k, depth = 2, 3

    def __init__(self):
        self.C = 2 + 2 * 4
        self.scores = torch.full((self.C,), float("-inf"))
        self.tokens = torch.zeros(self.C, dtype=torch.long)
        self.parents = torch.full((self.C,), -1, dtype=torch.long)
        self.Ld_host, self.calls = 0, []

    def reset(self):
        self.Ld_host = 0

    def extend(self, feats, ids, n, cols):
        self.calls.append("extend")
        self.scores[:2] = T([0.8, 0.1]).log()
        self.tokens[:2] = T([10, 11])
        return T(0.8)                                                        # conf_0: the best path

    def level(self, i, cols):
        self.calls.append(f"level {int(i)}")
        at = slice(2 + 4 * int(i), 6 + 4 * int(i))
        self.scores[at] = T([0.8 * 0.4, 0.8 * 0.3, 0.1 * 0.5, 0.1 * 0.2]).log()
        self.tokens[at], self.parents[at] = T([12, 13, 14, 15]), T([0, 0, 1, 1])
        return T(0.8 * 0.4)                                                  # conf_1


class MockEngine(FakeEngine):
    """What a Graft round reads from engine.Engine (test_graft's fake, plus the round's state): the
    drafter, the clock, the cache columns, and verify(), here the real verifier over the mock target."""

    def __init__(self, head):
        super().__init__(head)
        self.target = MockTarget()
        self.L, self.root, self.root_id, self.L_host = T(3), T(5), 5, 3
        self.clock = types.SimpleNamespace(mark=lambda phase: None)

    def cols(self, n, head=False):
        return torch.arange(n)

    def verify(self, tree, P, capture=False):
        return verify(self.target, tree, self.L, torch.arange(16), Sampling(), T(0), P, capture, root=self.root)


def make_round():
    head = MockHead()
    eng = MockEngine(head)
    matrix = ContinuationMatrix(V, 3)
    for tok, row in {5: [10, 20, 21], 10: [12, 22, 23], 12: [30, 31, 29], 20: [24, 25, 26]}.items():
        matrix.M[tok] = T(row, dtype=torch.int32)
        matrix.written[tok] = True
    cfg = Config(budget=6, top_k=2, depth=3, checkpoints=(0, 1), keep=(2, 4), thresholds={0: 0.5, 1: 0.5}, matrix_k=3)
    g = Graft(eng, cfg, matrix, RATES)
    g.start([1, 2, 5])
    return g, eng, head, matrix


def test_the_template_is_the_best_rank_paths():
    """Step 3's shape: the 6 rank paths of largest hit-rate product, best first (parents first)."""
    tpl = build_template(RATES, 6)
    assert tpl.parents.tolist() == [-1, 0, -1, 1, 0, 2] and tpl.ranks.tolist() == [0, 0, 1, 0, 1, 0]


def test_step_1_drafts_until_checkpoint_1_prunes():
    g, eng, head, _ = make_round()
    v = graft_round(g, eng.root)
    assert head.calls == ["extend", "level 0"]                 # level 3 is never drafted
    assert v.stage == 1 and v.draft_forwards == 2
    assert v.syncs == 1 + 2                                    # the commit, and the checkpoints 0 and 1 reached
    assert g.stages[1] == (4, 2)                               # stage 1 keeps 4 draft nodes and retrieves 2


def test_steps_2_to_4_keep_retrieve_graft():
    """Keep the 4 best draft nodes (10, 11, 12, 13); retrieve the template under the root: 10 and 12
    repeat draft nodes and merge, so the 2 free slots go to 20 (under the root) and 30 (under 12)."""
    g, eng, _, _ = make_round()
    graft_round(g, eng.root)
    t = g.last_tree
    assert t.tokens.tolist() == [5, 10, 11, 12, 13, 20, 30]
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 0, 3]
    assert t.valid.all() and t.retrieved.tolist() == [False] * 5 + [True, True]


def test_step_5_verifies_and_accepts_the_targets_path():
    """The target continues 5 -> 10 -> 12 -> 30 -> 7: three tokens accepted (the last a retrieved
    node), bonus 7, which also lands in the engine's root buffer."""
    g, eng, _, _ = make_round()
    v = graft_round(g, eng.root)
    assert v.accepted == [10, 12, 30] and v.bonus_id == 7 and v.from_retrieval == [0, 0, 1]
    assert v.path.tolist()[:4] == [0, 1, 3, 6] and int(eng.root) == 7 and int(eng.L) == 3 + 4


def test_step_6_updates_the_matrix_and_the_heads_input():
    """Every verified node's row becomes the target's top 3 after it; the head's next input is the
    accepted path and the bonus."""
    g, eng, _, matrix = make_round()
    graft_round(g, eng.root)
    rows = {t: matrix.M[t].tolist() for t in (5, 10, 11, 12, 13, 20, 30)}
    assert rows == {5: [10, 0, 1], 10: [12, 0, 1], 11: [2, 0, 1], 12: [30, 0, 1], 13: [2, 0, 1], 20: [2, 0, 1],
                    30: [7, 0, 1]}
    assert g.P == 7 and g.pend_ids.tolist()[:4] == [10, 12, 30, 7]           # (the rest: filler, not read)
    assert int(g.pend_n) == 4 and g.pend_n_host == 4
    assert not matrix.written[24]                              # a retrieved token that was never verified


def test_a_recorder_sees_the_round_once_before_the_matrix_learns():
    """The warm-up's hook: called once, after verification, while the matrix still holds what the
    round retrieved from."""
    g, eng, _, matrix = make_round()
    seen = []
    g.recorder = lambda m, conf, tree, v: seen.append((sorted(conf), matrix.M[12].tolist(), int(v.A)))
    graft_round(g, eng.root)
    assert seen == [([0, 1], [30, 31, 29], 3)]
