"""Cost-aware rounds (engine.Pacer): where no tree pays for its cost, plain steps, and drafting again later.

The decision, on a synthetic cost table: a request goes plain exactly when the tokens its drafting rounds
commit, times a plain step's seconds, fall short of a drafting round's seconds (by the margin); its plain
runs double while drafting keeps failing to pay, up to what a drafter's pending rows hold, and reset when
it pays; a plain step's cost is measured before it is compared. The rounds themselves, on the demo pair
(checkpoints/stdlib-qwen3 and its head): every method, with rounds forced plain, some slots drafting and
others not, and runs of plain steps as long as a drafter's pending rows hold (Method.room) or longer (its
head reading them outside a drafting round), emits exactly what plain decoding emits, greedy and sampled,
at B = 1 and B = 3; the head catches up on every row it missed; and the default, paced, runs every method
losslessly with what the costs decide.
"""
import dataclasses
from collections import deque
from pathlib import Path

import pytest
import torch

import engine as E
from cli import build_engine
from conftest import ROOT
from data import STDLIB_CKPT, STDLIB_DFLASH, STDLIB_DRAFT, STDLIB_PROMPT
from engine import Pacer, Request, Slot, generate
from graft import LAZY_RUN, PLAIN_RUN, Config
from verify import Sampling

pytestmark = pytest.mark.skipif(not (Path(STDLIB_CKPT) / "model.safetensors").is_file(), reason="no demo pair")

TEXTS = [STDLIB_PROMPT, "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
         "for i in range(10):\n    print(i)\n" * 3]
N_NEW = 36


# ----------------------------------------------------------------------------- the decision

def fake_engine(B: int):
    eng = type("Eng", (), {})()
    eng.B, eng.slots = B, [Slot(Request([1])) for _ in range(B)]
    return eng


def costs(p: Pacer, plain: float, **tree):
    """A synthetic cost table: 8 rounds of each count of drafting slots (k1=0.025: one slot drafting)."""
    for k, t in [(0, plain)] + [(int(k[1:]), t) for k, t in tree.items()]:
        p.times[k] = deque([t] * 8, maxlen=Pacer.WINDOW)


def feed(p: Pacer, eng, seconds: float, plain: bool, accepted: list):
    """One round's outcome: its cost and, per slot, the tokens it accepted (the bonus comes on top)."""
    grow = p.plan(eng, None)
    out = [([0] * a, 0, [], 0) for a in accepted]
    p.seen(eng, None, [not plain and g for g in grow], out, seconds, plain)
    return grow


@pytest.mark.parametrize("B", [1, 4])
def test_a_plain_steps_cost_is_measured_before_anything_is_compared(B):
    """Plain steps first (they cost what ar's do: drafting first, recycle's 81-node trees at B = 4 cost 13 plain
    steps each while measured), then drafting rounds until two are timed (a head's first after plain steps reads
    their rows: no sample), and a decision from both costs."""
    p, eng = Pacer(), fake_engine(B)
    plans = [feed(p, eng, 0.010, True, [0] * B) for _ in range(Pacer.PLAIN_SAMPLES)]
    assert plans == [[False] * B] * Pacer.PLAIN_SAMPLES and p.cost(0) == pytest.approx(0.010)
    assert [feed(p, eng, 0.060, False, [0] * B) for _ in range(3)] == [[True] * B] * 3     # nothing to compare yet
    assert p.cost(B) == pytest.approx(0.060) and p.plan(eng, None) == [False] * B       # 6 plain steps' worth: none pays


def test_a_plain_steps_cost_is_a_plain_runs():
    """Trees of 12 ms that commit 2 tokens against 2 ms plain steps: the first plain step after trees (9 ms: the
    target's weights out of cache) is no sample, and one a neighbour slowed (9 ms) is outvoted: the plain cost is
    2 ms, and the request goes plain (of the first two, 9 ms: 2 x 9 > 12, drafting at a loss until STALE)."""
    p, eng = Pacer(), fake_engine(1)
    costs(p, 0.002, k1=0.012)
    p.times[0].clear()                                      # measured again (as after STALE rounds of trees)
    p.seen(eng, None, [True], [([0], 0, [], 0)], 0.012, False)
    for t in [0.009, 0.009, 0.002, 0.002]:
        assert p.plan(eng, None) == [False]
        p.seen(eng, None, [False], [([], 0, [], 0)], t, True)
    assert list(p.times[0]) == [0.009, 0.002, 0.002] and p.cost(0) == pytest.approx(0.002)
    p.seen(eng, None, [True], [([0], 0, [], 0)], 0.012, False)
    assert p.plan(eng, None) == [False] and eng.slots[0].plain > 0


def test_a_stale_plain_cost_is_measured_again():
    """A plain step's cost grows with the context: measured at 5 ms on long prompts, it makes trees of 12 ms
    that commit 3 tokens look paying (3 x 5 > 12). After STALE rounds without a plain step the pacer drops
    it and measures again (2 ms: 3 x 2 < 12), and the request goes plain."""
    p, eng = Pacer(), fake_engine(1)
    costs(p, 0.005, k1=0.012)
    drafted = 0
    while p.plan(eng, None) == [True] and drafted <= Pacer.STALE + 1:
        p.seen(eng, None, [True], [([0, 0], 0, [], 0)], 0.012, False)
        drafted += 1
    assert drafted == Pacer.STALE + 1 and not p.times[0]          # the old samples dropped, a plain step next
    for _ in range(Pacer.PLAIN_SAMPLES + 1):                       # (the first after trees: no sample)
        p.seen(eng, None, [False], [([], 0, [], 0)], 0.002, True)
    assert p.cost(0) == pytest.approx(0.002)
    assert p.plan(eng, None) == [True]                             # a drafting round, read against the new cost
    p.seen(eng, None, [True], [([0, 0], 0, [], 0)], 0.012, False)
    assert p.plan(eng, None) == [False] and eng.slots[0].plain > 0


@pytest.mark.parametrize("tokens, goes_plain", [(1, True), (2, True), (3, False), (4, False)])
def test_a_request_goes_plain_exactly_when_its_trees_do_not_pay(tokens, goes_plain):
    """A drafting round costs 2.5 plain steps: it pays when it commits 3 tokens or more."""
    p, eng = Pacer(), fake_engine(1)
    costs(p, 0.010, k1=0.025)
    p.seen(eng, None, [True], [([0] * (tokens - 1), 0, [], 0)], 0.025, False)
    s = eng.slots[0]
    assert s.mat == tokens and (s.plain > 0) == goes_plain
    assert p.plan(eng, None) == [not goes_plain]


# A probe that commits 1 token and loses little against the plain step it replaces (its round, after a plain
# run, is no sample of a tree's cost: the head resumed): it does not pay, and its loss sets no longer run.
CHEAP_PROBE = 0.0101


def test_plain_runs_double_up_to_plain_run_and_reset_when_drafting_pays():
    p, eng = Pacer(), fake_engine(1)
    costs(p, 0.010, k1=0.030)
    s, runs = eng.slots[0], []
    for _ in range(7):                                     # every probe commits 1 token: never pays
        assert p.plan(eng, None) == [True]                 # (the probe drafts)
        p.seen(eng, None, [True], [([], 0, [], 0)], CHEAP_PROBE, False)
        runs.append(s.plain)
        while s.plain:                                     # the plain run: no drafting
            assert p.plan(eng, None) == [False]
            p.seen(eng, None, [False], [([], 0, [], 0)], 0.010, True)
    assert runs == [4, 8, 16, 32, 32, 32, 32] and max(runs) == PLAIN_RUN
    s.mat = None                                           # then drafting pays again: 5 tokens a round
    for _ in range(3):
        p.seen(eng, None, [True], [([0] * 4, 0, [], 0)], 0.030, False)
    assert s.plain == 0 and s.backoff == 0


@pytest.mark.parametrize("paid", [False, True])
def test_a_new_request_takes_up_the_last_ones_plain_run_until_a_tree_has_paid(paid):
    """Alone (B = 1), until a tree has paid on this engine a new request takes up the last one's plain run
    where it stopped (the runs keep doubling across requests, so a method that never pays probes less than
    once a request: DFlash here); once one has paid, on measured costs, a new request starts with a plain
    run of at most 2 MIN_RUN (the next text may differ)."""
    p, eng = Pacer(), fake_engine(1)
    costs(p, 0.010, k1=0.030)
    if paid:                                               # a round that paid: 4 tokens for 3 plain steps' cost
        p.seen(eng, None, [True], [([0] * 3, 0, [], 0)], 0.030, False)
        assert eng.slots[0].plain == 0 and p.paid
        eng.slots[0], p.prior = Slot(Request([1])), None   # (another request, from scratch)
    s = eng.slots[0]
    for _ in range(4):                                     # probes that commit 1 token: runs of 4, 8, 16, 32
        assert p.plan(eng, None) == [True]
        p.seen(eng, None, [True], [([], 0, [], 0)], CHEAP_PROBE, False)
        for _ in range(s.plain if s.backoff < PLAIN_RUN else 5):    # (the last run: 5 of its 32 steps)
            assert p.plan(eng, None) == [False]
            p.seen(eng, None, [False], [([], 0, [], 0)], 0.010, True)
    assert s.backoff == PLAIN_RUN and s.plain == PLAIN_RUN - 5 and p.paid == paid
    eng.slots[0] = Slot(Request([1]))                      # the request ends; the next one takes its slot
    assert p.plan(eng, None) == [False]
    new = eng.slots[0]
    assert (new.backoff, new.plain) == ((2 * Pacer.MIN_RUN,) * 2 if paid else (PLAIN_RUN, PLAIN_RUN - 5))


class CatchesUp:
    """A method whose drafter can read its pending rows outside a drafting round (graft.Method.catch_up)."""
    can_catch_up = lambda self, eng: True                  # noqa: E731


def test_once_a_tree_has_paid_a_run_longer_than_a_request_goes_on_into_the_next():
    """Once a tree has paid, a new request starts with the rest of the run, at most max(2 MIN_RUN, floor()): where
    probes lose enough that the floor outlasts a request, the run counts on across requests (restarted at every
    request, the stdlib pair's graft never probed again: all plain over 28 requests, where its trees had paid)."""
    p, eng = Pacer(), fake_engine(1)
    costs(p, 0.010, k1=0.030)
    p.seen(eng, None, [True], [([0] * 3, 0, [], 0)], 0.030, False)      # a tree that paid
    p.lost.extend([0.030] * 8)                 # probes that lost 3 plain steps each: floor() 100
    assert p.paid and p.floor() == 100
    eng.slots[0].mat = 1.0
    p.seen(eng, None, [True], [([], 0, [], 0)], 0.030, False)           # a tree that does not pay: a run of 32
    assert eng.slots[0].plain == PLAIN_RUN
    probe = None
    for request in range(3):                   # requests of 20 plain steps
        eng.slots[0] = Slot(Request([1])) if request else eng.slots[0]
        for step in range(20):
            if p.plan(eng, None) == [True]:
                probe = probe or (request, step)
                break
            p.seen(eng, None, [False], [([], 0, [], 0)], 0.010, True)
    assert probe == (1, PLAIN_RUN - 20)        # the probe after 20 + 12 plain steps, in the second request


def test_where_the_drafter_catches_up_plain_runs_double_up_to_max_run():
    """A method that catches up (an EAGLE-3 head, eager) is not bound by its pending rows: the runs go on
    doubling to Pacer.MAX_RUN, and a slot whose rows are full is not made to draft."""
    p, eng = Pacer(), fake_engine(1)
    costs(p, 0.010, k1=0.030)
    s, runs, m = eng.slots[0], [], CatchesUp()
    for _ in range(7):
        assert p.plan(eng, m) == [True]
        p.seen(eng, m, [True], [([], 0, [], 0)], CHEAP_PROBE, False)
        runs.append(s.plain)
        while s.plain:
            s.pend = PLAIN_RUN                             # (full: the engine has the head catch up)
            assert p.plan(eng, m) == [False]
            p.seen(eng, m, [False], [([], 0, [], 0)], 0.010, True)
    assert runs == [4, 8, 16, 32, 64, 128, 128] and Pacer.MAX_RUN == 128



@pytest.mark.parametrize("catches_up", [False, True])
def test_where_no_tree_can_pay_the_plain_run_is_the_longest(catches_up):
    """A tree that would not pay even if it committed its longest path (the method's P tokens: here 4 plain
    steps' worth, 40 ms against a 10 ms step) backs off at once to the longest run: Pacer.LONGEST where the
    drafter catches up, else the cap; a tree that could pay (P = 5) doubles from MIN_RUN as before."""
    for P, hopeless in ((4, True), (5, False)):
        p, eng = Pacer(), fake_engine(1)
        costs(p, 0.010, k1=0.040)
        m = type("M", (CatchesUp,), {"P": P, "can_catch_up": lambda self, e: catches_up})()
        s = eng.slots[0]
        assert p.plan(eng, m) == [True]
        p.seen(eng, m, [True], [([], 0, [], 0)], 0.040, False)
        top = Pacer.LONGEST if catches_up else PLAIN_RUN
        assert s.plain == (top if hopeless else Pacer.MIN_RUN), (P, catches_up)
    assert Pacer.LONGEST > Pacer.MAX_RUN


def test_deep_in_a_plain_run_the_drafter_is_left_behind():
    """Pacer.deep: a plain round leaves the drafter behind while more than RECENT plain rounds are left in
    the run (the slot's at B = 1 or with one live request; the batch's, which plan has counted this round
    off, at B > 1), and never on a compiled engine."""
    p, eng = Pacer(), fake_engine(1)
    eng.compiling = False
    for left, deep in ((0, False), (1, False), (Pacer.RECENT, False), (Pacer.RECENT + 1, True), (900, True)):
        eng.slots[0].plain = left
        assert p.deep(eng) == deep, left
    eng.compiling = True
    assert not p.deep(eng)
    eng = fake_engine(3)
    eng.compiling, eng.slots[1].plain = False, 900          # (a slot's own run: not the batch's)
    for left, deep in ((0, False), (Pacer.RECENT - 1, False), (Pacer.RECENT, True)):
        p.batch.plain = left
        assert p.deep(eng) == deep, left
    eng.slots[0] = eng.slots[2] = Slot()                    # one live request: its own run
    p.batch.plain = 0
    assert p.deep(eng)


@pytest.mark.parametrize("catches_up", [False, True])
def test_probes_that_lose_set_plain_runs_long_enough_that_probing_costs_explore(catches_up):
    """Probes that commit 1 token in 3 plain steps' time (a 10 ms step) and catch up 5 ms first: each loses
    25 ms, so after the first such probe a plain run is long enough that probing costs EXPLORE (3%) of its
    time: 25 / (0.03 x 10) -> 84 steps, doubling from there (up to the cap: PLAIN_RUN where the drafter cannot
    catch up); a new request starts within that run (of the mean loss); probes that gain set no floor."""
    p, eng = Pacer(), fake_engine(1)
    costs(p, 0.010, k1=0.030)
    s, runs, m = eng.slots[0], [], CatchesUp() if catches_up else None
    for _ in range(3):
        assert p.plan(eng, m) == [True]
        p.seen(eng, m, [True], [([], 0, [], 0)], 0.030, False, clean=True, ahead=0.005)
        runs.append(s.plain)
        while s.plain:
            assert p.plan(eng, m) == [False]
            p.seen(eng, m, [False], [([], 0, [], 0)], 0.010, True)
    cap = Pacer.MAX_RUN if catches_up else PLAIN_RUN
    assert p.floor() == 84 and runs == [4, min(84, cap), cap]       # (the first round: no probe; then doubling)
    assert list(p.lost) == [pytest.approx(0.025)] * 2
    eng.slots[0], p.paid = Slot(Request([1])), True
    p.seen(eng, m, [True], [([0] * 3, 0, [], 0)], 0.030, False)     # (a new request's first tree pays: no probe)
    assert p.prior[1] == 0
    s = eng.slots[0]
    s.backoff, s.idle = 64, True
    p.seen(eng, m, [True], [([], 0, [], 0)], 0.030, False)          # a probe that does not pay: the run, the prior
    assert p.floor() == 78 and s.plain == cap and p.prior[1:] == (min(78, cap),) * 2    # (mean loss 23.3 ms)
    for _ in range(16):                                             # probes that gain: no floor
        p.seen(eng, m, [True], [([0] * 3, 0, [], 0)], 0.030, False)
        s.idle = True
    assert p.floor() == 0


class ScoresItself:
    """A method whose every proposal is scored (graft.Method.shadow, as pld's): each plan settles the next
    of `scores` (kind, tokens a drafting round of it commits) and proposes one of kind `kinds` (next)."""
    shadows, pending = True, False
    can_catch_up = lambda self, eng: True                  # noqa: E731

    def __init__(self, scores, kinds=None):
        self.scores, self.kinds = iter(scores), iter(kinds) if kinds is not None else None

    def shadow(self, eng):
        kind = next(self.kinds) if self.kinds is not None else "n"
        return [[next(self.scores)]], [kind]


def test_a_method_that_scores_its_proposals_never_probes():
    """A drafting round costs 2.5 plain steps (pays at 2.5 x 1.03 tokens). Proposals that would have
    committed 1 token: plain every round, no probe ever; then proposals of 5: it drafts within a few
    rounds, as its MAT passes the line, and stays drafting."""
    p, eng = Pacer(), fake_engine(1)
    costs(p, 0.010, k1=0.025)
    m, s = ScoresItself([("n", 1)] * 300 + [("n", 5)] * 20), eng.slots[0]
    for _ in range(300):
        assert p.plan(eng, m) == [False]
        p.seen(eng, m, [False], [([], 0, [], 0)], 0.010, True)
    assert s.mat == pytest.approx(1.0) and s.plain == 0 and s.backoff == 0
    plans = []
    for _ in range(20):
        plans.append(p.plan(eng, m)[0])
        p.seen(eng, m, [plans[-1]], [([0] * 4, 0, [], 0)], 0.025 if plans[-1] else 0.010, not plans[-1])
    first = plans.index(True)
    assert 0 < first < 10 and all(plans[first:])


def test_a_shadowing_method_drafts_the_kinds_of_proposal_that_pay():
    """Each round decides from the MAT of its own proposal's kind (pld: the n-gram that matched): kind 3
    commits 4 tokens a round, kind 1 one, and a round without a proposal never drafts. At B = 1 the plan
    follows the kinds round by round; at B = 2 the batch drafts the slot whose kind pays."""
    p, eng = Pacer(), fake_engine(1)
    costs(p, 0.010, k1=0.020)
    kinds = [3, 1] * 20 + [None, 3, 1]
    m = ScoresItself([(3, 4), (1, 1)] * 22, kinds)
    plans = [p.plan(eng, m)[0] for _ in range(len(kinds))]
    assert plans[-3:] == [False, True, False] and plans[2:40] == [True, False] * 19
    assert p.kinds[3] == pytest.approx(4.0) and p.kinds[1] == pytest.approx(1.0)
    assert p.explain(eng.slots[0], False).endswith("MAT by kind of proposal 1: 1.00, 3: 4.00; plain step 10.0 ms, "
                                                   "drafting round 20.0 ms; a round drafts where its proposal's "
                                                   "kind pays (3), else it takes a plain step")

    class Two(ScoresItself):
        def shadow(self, eng):
            return [[], []], [3, 1]
    p2, eng2 = Pacer(), fake_engine(2)
    costs(p2, 0.010, k1=0.013, k2=0.016)
    p2.kinds = {3: 4.0, 1: 1.0}
    assert p2.plan(eng2, Two([])) == [True, False]


def test_alone_a_method_that_cuts_its_proposals_drafts_the_length_that_pays_best():
    """Pacer.cut (pld's chains, Method.cuts), alone: rounds drafting 1-5 nodes cost 11-15 ms against a 10 ms
    plain step. Each length is first drafted twice (costs measured, never assumed), shortest first; then a
    kind of proposal that commits 2 tokens (its first node accepted) drafts 1 node (2 / 11 ms beats 3 / 12
    ms and a plain step's 1 / 10), one that commits all 6 drafts all 5 (6 / 15 ms), one that commits 1 none;
    explain shows the cut and the costs it read; a length timed higher than a longer one reads the longer's."""
    import itertools
    cost = {1: 0.011, 2: 0.012, 3: 0.013, 4: 0.014, 5: 0.015}

    class Cuts(ScoresItself):
        cuts, N, drafted = True, 6, [0]
    p, eng = Pacer(), fake_engine(1)
    costs(p, 0.010, k1=0.020)
    kinds = ["one", "all", "none"]
    m, s = Cuts(itertools.cycle([("one", 2), ("all", 6), ("none", 1)]), itertools.cycle(kinds)), eng.slots[0]
    plans = []
    for _ in range(19):
        g = p.plan(eng, m)[0]
        m.drafted = [s.length or 5 if g else 0]
        plans.append((g, s.length))
        p.seen(eng, m, [g], [([0] * (m.drafted[0] // 2), 0, [], 0)], cost[m.drafted[0]] if g else 0.010, not g)
    assert plans[:10] == [(True, 1), (True, 1), (True, 2), (True, 2), (True, 3), (True, 3), (True, 4), (True, 4),
                          (True, None), (True, None)]
    assert plans[10:] == [(True, None), (False, None), (True, 1)] * 3        # kinds all, none, one in turn
    assert p.cuts["one"] == pytest.approx([2.0] * 5) and p.cuts["all"] == pytest.approx([2, 3, 4, 5, 6])
    assert p.explain(s, True).endswith("its first 1 node(s) by rounds' cost (1: 11.0 ms, 2: 12.0 ms, 3: 13.0 ms, "
                                       "4: 14.0 ms, 5: 15.0 ms)")
    p.rows[1] = deque([0.030] * 2, maxlen=Pacer.WINDOW)   # 1 node timed once high (noise): read as 2 nodes' cost
    assert p.cut(s, [2.0] * 5) and s.length == 1


def test_pld_scores_every_proposal_against_the_tokens_decoded_after_it():
    """PromptLookup.shadow: every round's chain, drafted or not, settles at its first mismatch (its
    matching prefix + 1) or once all of it is decoded (its length + 1), under the n its lookup matched;
    no match: no proposal (kind None), nothing to settle."""
    import types
    import graft as GR
    r = Request([7, 1, 2, 3, 4, 5, 6, 1, 2])                # "1 2" recurs: the chain is 3 4 5 6 1, n = 2
    eng = types.SimpleNamespace(requests=lambda: [r])
    m = types.SimpleNamespace(cfg=Config(pld_tokens=5), guess=[[]], now=[None])
    m.propose = lambda r, b: GR.PromptLookup.propose(m, r, b)                        # noqa: E731
    shadow = lambda: GR.PromptLookup.shadow(m, eng)       # noqa: E731
    assert shadow() == ([[]], [2]) and m.guess[0] == [(r, 0, [3, 4, 5, 6, 1], 2)]
    r.tokens += [3]                                        # "1 2 3" recurs: 4 5 6 1 2, n = 3
    assert shadow() == ([[]], [3]) and [g[2] for g in m.guess[0]] == [[3, 4, 5, 6, 1], [4, 5, 6, 1, 2]]
    r.tokens += [4, 9]
    assert shadow() == ([[(2, 3), (3, 2)]], [None])       # mismatches: at the third (2 + 1), the second (1 + 1)
    assert m.guess[0] == []                                # "... 4 9": no earlier 9, no 4 9: no chain
    r.tokens[:] = [3, 4, 5, 6, 1]
    m.guess[0], m.now[0] = [(r, 0, [3, 4, 5, 6, 1], 3)], None
    assert shadow()[0] == [[(3, 6)]]                       # all five decoded: 5 + 1
    assert GR.PromptLookup.shadows and not GR.Method.shadows

def test_a_cost_not_measured_is_read_off_the_line_through_its_neighbours():
    p = Pacer()
    assert p.cost(0) is None
    costs(p, 0.010, k4=0.030)
    assert p.cost(2) == pytest.approx(0.020) and p.cost(8) == pytest.approx(0.050)     # (above: from plain)
    costs(p, 0.010, k1=0.014, k4=0.030)
    assert p.cost(2) == pytest.approx(0.014 + 0.016 / 3) and p.cost(1) == pytest.approx(0.014)


def test_a_batch_drafts_the_requests_whose_trees_pay_best_first():
    """At B = 3, one slot drafting costs 1.2 plain steps, two 1.4, three 1.8 (the whole batch's round):
    MATs of 3, 1.1 and 2 draw the most tokens a second with slots 0 and 2 drafting (6 tokens / 1.4 = 4.3
    against 5 / 1.2, 6.1 / 1.8 and 3 / 1); with every MAT 1.1 no count pays: the batch goes plain for
    MIN_RUN rounds. An empty slot never drafts."""
    p, eng = Pacer(), fake_engine(3)
    costs(p, 0.010, k1=0.012, k2=0.014, k3=0.018)
    for s, mat in zip(eng.slots, (3.0, 1.1, 2.0)):
        s.mat = mat
    assert p.plan(eng, None) == [True, False, True]
    for s in eng.slots:
        s.mat = 1.1
    assert [p.plan(eng, None) for _ in range(Pacer.MIN_RUN)] == [[False] * 3] * Pacer.MIN_RUN
    p.batch.plain = p.batch.backoff = 0
    eng.slots[0].mat, eng.slots[2] = 9.0, Slot()
    assert p.plan(eng, None) == [True, False, False]


def test_at_b_above_one_probes_draft_one_tree_in_turn_and_runs_double():
    """After the batch's plain run a probe drafts one request's tree (the slots in turn); where it still
    does not pay, the next run is twice as long; where it pays, the batch drafts again and the run halves.
    A head whose pending rows are full drafts even in a plain run."""
    p, eng = Pacer(), fake_engine(3)
    costs(p, 0.010, k1=0.012, k2=0.015, k3=0.018)
    for s in eng.slots:
        s.mat = 1.1
    runs, probes = [], []
    for _ in range(4):
        plans = [p.plan(eng, None)]
        while not any(plans[-1]):
            plans.append(p.plan(eng, None))
        runs.append(len(plans) - 1)
        probes.append(plans[-1])
    assert runs == [4, 8, 16, 32] and probes == [[True, False, False], [False, True, False], [False, False, True],
                                                 [True, False, False]]
    eng.slots[1].mat = 3.0                                  # the probe's request now pays: 5 tokens / 1.2
    assert p.plan(eng, None) == [False, True, False] and p.batch.backoff == 16       # (32, halved)
    p.batch.plain, eng.slots[1].mat, eng.slots[2].pend = 5, 1.1, PLAIN_RUN
    assert p.plan(eng, None) == [False, False, True]


def test_at_b_above_one_a_probe_drafts_every_tree_where_that_costs_less_a_request():
    """A head drafts a batch's trees at once: where every request's tree costs less over a plain step, a
    request, than one tree does (here 3 ms / 3 against 2.5 ms: graft's at B = 4, 36 and 38 ms against a
    25 ms step), the probe after a plain run drafts them all, and every MAT is fresh after it."""
    p, eng = Pacer(), fake_engine(3)
    costs(p, 0.010, k1=0.0125, k3=0.013)
    for s in eng.slots:
        s.mat = 1.1
    plans = [p.plan(eng, None)]
    while not any(plans[-1]):
        plans.append(p.plan(eng, None))
    assert len(plans) == Pacer.MIN_RUN + 1 and plans[-1] == [True] * 3


@pytest.mark.parametrize("lost", [0.0, 0.5])
def test_at_b_above_one_a_plain_run_shortens_once_every_request_it_began_with_has_left(lost):
    """A batch's plain run is evidence about the requests it began with: while one of them runs it goes on
    (a request joining beside it changes nothing); once all have left (a new stream, maybe another kind
    of text: HumanEval after MT-bench had graft at B = 4 plain in 99% of its rounds), what is left of it is
    at most what a new request alone takes up: 2 MIN_RUN, or floor() where probes lose (recycle's 81-node
    trees at B = 4 cost ~5 plain steps: a probe at every change of requests cost it 20%)."""
    p, eng = Pacer(), fake_engine(3)
    costs(p, 0.010, k1=0.012, k2=0.015, k3=0.018)
    p.lost.extend([lost] * 4)                               # floor(): 0, or 0.5 s / (3% of 10 ms) = 1667 steps
    p.batch.backoff, p.probed = 8, True                     # after a probe that did not pay: a run of 16
    for s in eng.slots:
        s.mat = 1.1
    assert p.plan(eng, None) == [False] * 3 and p.batch.plain == (31 if lost else 15)     # (floor: the cap, 32)
    eng.slots[0], eng.slots[1] = Slot(Request([1])), Slot(Request([1]))      # two leave, two join
    for s in eng.slots[:2]:
        s.mat = 1.1
    assert [p.plan(eng, None) for _ in range(5)] == [[False] * 3] * 5 and p.batch.plain == (26 if lost else 10)
    eng.slots[2] = Slot(Request([1]))                       # the last of the run's requests leaves
    eng.slots[2].mat = 1.1
    plans = [p.plan(eng, None) for _ in range(10)]
    if lost:                                                # probes lose: the run goes on (26 left)
        assert plans == [[False] * 3] * 10 and p.batch.plain == 16
    else:                                                   # 8 plain steps, then a probe
        assert plans[:8] == [[False] * 3] * 8 and plans[8] == [True, False, False]


@pytest.mark.parametrize("fused", [True, False], ids=["cpp", "torch"])
def test_a_plain_rounds_learn_is_the_general_one_for_one_node(fused, monkeypatch):
    """graft.plain_learn (one C++ call, or one indexed write each) leaves what update, context_append and
    learn's pending writes leave for trees of one node: the matrix rows (an empty slot's on the spare row V),
    the context (an empty slot's token on its spare column), the pending rows and counts; and a method that
    keeps no matrix, no context nor pending ids has only its pending rows written."""
    from types import SimpleNamespace as NS

    import graft as G
    from verify import Tree
    monkeypatch.setattr(G, "FUSED", fused)
    torch.manual_seed(0)
    B, V, k, F, S, R = 4, 50, 3, 6, 20, 9
    active = torch.tensor([1, 0, 1, 1])
    tree = Tree(torch.randint(0, V, (B, 1)), torch.full((B, 1), -1), active[:, None] > 0)
    v = NS(logits=torch.randn(B, 1, V), bonus=torch.randint(0, V, (B,)), feats=torch.randn(B, 1, F))

    def state():
        g = torch.Generator().manual_seed(1)
        return NS(matrix=True, pending=True, needs_head=True,
                  M=torch.randint(0, V, (B, V + 1, k), generator=g, dtype=torch.int32),
                  written=torch.rand(B, V + 1, generator=g) < 0.5, ctx=torch.randint(0, V, (B, S), generator=g),
                  clen=torch.tensor([3, 0, S - 1, 7]), pend_feats=torch.randn(B, R, F, generator=g),
                  pend_ids=torch.randint(0, V, (B, R), generator=g), pend_n=torch.tensor([1, 0, 4, 8]))
    a, b = state(), state()
    G.plain_learn(a, tree, v, active)
    G.update(b.M, b.written, tree.tokens, v.logits, tree.valid)
    G.context_append(b.ctx, b.clen, v.bonus[:, None], active)
    at = b.pend_n[:, None]
    b.pend_feats.scatter_(1, at[:, :, None].expand(-1, 1, F), v.feats)
    b.pend_ids.scatter_(1, at, v.bonus[:, None])
    b.pend_n.add_(active)
    for name in ("M", "written", "ctx", "clen", "pend_feats", "pend_ids", "pend_n"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    c, d = state(), state()
    c.matrix = c.ctx = None
    c.needs_head = False
    G.plain_learn(c, tree, v, active)
    assert torch.equal(c.pend_feats, b.pend_feats) and torch.equal(c.pend_n, b.pend_n)
    assert all(torch.equal(getattr(c, x), getattr(d, x)) for x in ("M", "written", "clen", "pend_ids"))


# ----------------------------------------------------------------------------- the rounds

class Forced(Pacer):
    """A pacer whose plan is given: pattern(round, slot) -> draft? (the costs it still records)."""

    def __init__(self, pattern):
        super().__init__()
        self.pattern, self.n = pattern, 0

    def plan(self, eng, method):
        self.n += 1
        return [s.request is not None and self.pattern(self.n, b) for b, s in enumerate(eng.slots)]


PATTERNS = {
    "alternate": lambda n, b: n % 2 == 0,                           # plain, drafting, plain, ...
    "some_slots": lambda n, b: (n + b) % 3 == 0,                    # at B > 1, slots drafting beside plain ones
    "long_runs": lambda n, b: n % (PLAIN_RUN + 1) == 0,             # PLAIN_RUN plain steps (a compiled room)
}


@pytest.fixture(scope="module")
def engines():
    return {B: build_engine(STDLIB_CKPT, STDLIB_DRAFT, max_seq_len=512, batch=B) for B in (1, 3)}


@pytest.fixture(scope="module")
def baselines(engines):
    eng = engines[1]
    ids = [eng.tokenizer.encode(t) for t in TEXTS]
    out = {}
    for kind in ("greedy", "sampled"):
        reqs = requests(ids, kind)
        out[kind] = (ids, [generate(eng, eng.make("ar"), r.ids, N_NEW, r.sampling).tokens for r in reqs])
    return out


def requests(ids, kind):
    s = lambda i: Sampling() if kind == "greedy" else Sampling(0.8, 0.9, 20, seed=7 + i)    # noqa: E731
    return [Request(x, s(i), i) for i, x in enumerate(ids)]


# every kind of state a plain round keeps in step: a head's pending rows (eagle3, graft), a matrix and a
# context (graft, recycle), the host's lookup (pld); DFlash's pending rows: test_block_methods_paced
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("name", ["eagle3", "graft", "recycle", "pld"])
def test_plain_rounds_and_partial_rounds_are_lossless(engines, baselines, name, pattern):
    """Rounds forced plain, slots drafting beside plain ones, and full plain runs: each request's tokens
    are plain decoding's, greedy and sampled, at B = 1 and B = 3; the plain rounds counted are the ones
    that ran."""
    for kind in ("greedy", "sampled"):
        ids, base = baselines[kind]
        for B, eng in engines.items():
            if pattern == "some_slots" and B == 1:
                continue
            m = eng.make(name, Config(budget=6, recycle_size=12, pace=True))
            m.pacer = Forced(PATTERNS[pattern])
            res = E.run(eng, m, requests(ids, kind), N_NEW)
            assert [r.tokens for r in res.requests] == base, (name, pattern, kind, B)
            st = res.stats()
            assert 0 < st["plain_share"] < 1 and st["rounds"] >= st["requests"]


@pytest.mark.parametrize("run", [PLAIN_RUN - 1, LAZY_RUN, 2 * LAZY_RUN + 5])
def test_a_drafters_rows_after_a_plain_run_are_the_rows_it_would_have_had(engines, baselines, run):
    """After a run of plain steps the head reads the rows it missed: all but the last just before the drafting
    round (Method.catch_up, outside the round's time, so that the round samples a tree's cost), and during
    a run of LAZY_RUN or more (an eager engine's room) every LAZY_RUN plain steps. Either way the head's rows
    then hold what a prefill of those tokens leaves, bit for bit (the target's features and the head's
    layer are row-invariant), so it drafts the very tree a request whose prompt already held them drafts."""
    eng = engines[1]
    ids, base = baselines["greedy"]
    first, caught = {}, []
    want = generate(eng, eng.make("ar"), ids[0], run + 8).tokens
    for tag, prompt, pacer in (("plain run", ids[0], Forced(lambda n, b: n > run)),
                               ("prefilled", ids[0] + want[:run], None)):
        m = eng.make("eagle3", Config(budget=6, pace=True))
        m.pacer = pacer
        catch_up = m.catch_up
        m.catch_up = lambda e, which: (caught.append(e.slots[0].pend), catch_up(e, which))
        got = []
        E.run(eng, m, [Request(prompt)], run + 8 if pacer else 8,
              on_round=lambda rnd, c: got.append(rnd.tree.tokens[0].tolist()) if not rnd.plain else None)
        first[tag] = got[0]
    assert first["plain run"] == first["prefilled"] and len(first["prefilled"]) > 1
    full, resume = caught[:run // LAZY_RUN], caught[run // LAZY_RUN:]
    assert full == [LAZY_RUN] * (run // LAZY_RUN)           # each time its rows were full
    assert len(resume) == 1 and 1 < resume[0] <= LAZY_RUN   # and as it drafts again (outside the timed round)


class Runs(Pacer):
    """Plain runs of `run` rounds between drafting rounds, counted down where the real pacer keeps them (each
    slot's plain, the batch's), so that Pacer.deep sees them; the rounds that left the drafter behind counted."""

    def __init__(self, run):
        super().__init__()
        self.run, self.n, self.behind = run, 0, 0

    def plan(self, eng, method):
        self.n += 1
        left = (self.run + 1 - self.n % (self.run + 1)) % (self.run + 1)     # this run's rounds left, this one too
        for s in eng.slots:
            s.plain = left
        self.batch.plain = max(left - 1, 0)
        self.behind += bool(left) and self.deep(eng)
        return [s.request is not None and not left for s in eng.slots]


@pytest.mark.parametrize("name", ["eagle3", "graft", "recycle"])
def test_long_plain_runs_leave_the_drafter_behind_losslessly(engines, baselines, name):
    """Runs of 30 plain rounds: the first 30 - RECENT leave the head, matrix and context behind (Pacer.deep:
    `ar`'s step alone, no features kept), the last RECENT keep them in step; the next tree reads a text with
    those tokens cut. The tokens are plain decoding's, greedy and sampled, at B = 1 and B = 3, and the head's
    pending rows never hold more than the rounds that kept them."""
    for kind in ("greedy", "sampled"):
        ids, base = baselines[kind]
        for B, eng in engines.items():
            m = eng.make(name, Config(budget=6, recycle_size=12, pace=True))
            m.pacer, pend, learned = Runs(30), [], []

            def seen(rnd, commits):
                pend.append(max(s.pend for s in eng.slots))
                learned.append(rnd.learned)
            res = E.run(eng, m, requests(ids, kind), N_NEW, on_round=seen)
            assert [r.tokens for r in res.requests] == base, (name, kind, B)
            assert m.pacer.behind > 0 and learned.count(False) == m.pacer.behind
            assert max(pend) <= Pacer.RECENT + m.P + 1, (name, B, max(pend))


class FixedCosts(Pacer):
    """The real pacer on a machine where a drafting round costs two plain steps: at B = 3 a tree then pays
    only for 6 tokens or more a round, which the tiny pair never commits, so drafters keep backing off."""
    cost = lambda self, k: 0.020 if k else 0.010                # noqa: E731


class NeverPays(Pacer):
    """The real pacer where a drafting round costs ten plain steps: no tree the tiny pair drafts pays."""
    cost = lambda self, k: 0.100 if k else 0.010                # noqa: E731


@pytest.mark.parametrize("catch_up", [True, False])
def test_a_batch_whose_trees_never_pay_stays_within_the_pending_rows(engines, baselines, catch_up):
    """The batch rule (Pacer.plan) backs drafters off again and again: each slot's pending rows stay within
    the method's room (one more would not fit): where the head can catch up outside a drafting round
    (Method.catch_up) the plain runs go past it, where it cannot a full head drafts (and that round reads
    every slot's rows); and the tokens are plain decoding's."""
    eng = engines[3]
    ids, _ = baselines["greedy"]
    want = [generate(engines[1], engines[1].make("ar"), x, 120).tokens for x in ids[:3]]
    m = eng.make("graft", Config(budget=6, pace=True))
    m.pacer, runs, pend = NeverPays(), [[0] for _ in range(3)], []
    if not catch_up:
        m.can_catch_up = lambda e: False

    def count(rnd, commits):
        pend.append(max(s.pend for s in eng.slots))
        for b in range(3):
            drafted = not rnd.plain and (rnd.grow is None or rnd.grow[b])
            runs[b].append(0 if drafted else runs[b][-1] + 1)
    res = E.run(eng, m, [Request(x) for x in ids[:3]], 120, on_round=count)
    assert [r.tokens for r in res.requests] == want
    longest = max(max(r) for r in runs)
    assert 0 < res.stats()["plain_share"] < 1 and max(pend) <= m.room
    assert longest > PLAIN_RUN or not catch_up, [max(r) for r in runs]


def test_paced_by_default_every_method_is_lossless(engines, baselines):
    """What a user runs (Config(pace=None) with engine.PACE on): the pacer decides from this machine's
    costs; whatever it decides, the tokens are plain decoding's."""
    for kind in ("greedy", "sampled"):
        ids, base = baselines[kind]
        for B, eng in engines.items():
            for name in ("graft", "eagle3", "pld", "recycle"):
                m = eng.make(name, Config(budget=6, recycle_size=12, pace=True))
                assert m.pacer is not None
                res = E.run(eng, m, requests(ids, kind), N_NEW)
                assert [r.tokens for r in res.requests] == base, (name, kind, B)


def test_block_methods_paced(baselines):
    """dflash and graft-tail (a DFlash drafter's pending rows, graft-tail's matrix) through plain rounds,
    partial rounds, full plain runs and long ones that leave the drafter behind (Pacer.deep): lossless,
    greedy and sampled, B = 1 and B = 3."""
    engs = {B: build_engine(STDLIB_CKPT, dflash=STDLIB_DFLASH, max_seq_len=512, batch=B) for B in (1, 3)}
    for kind in ("greedy", "sampled"):
        ids, base = baselines[kind]
        for B, eng in engs.items():
            for name in ("dflash", "graft-tail"):
                for pattern in list(PATTERNS) + ["deep_runs"]:
                    m = eng.make(name, Config(tail_threshold=0.3, pace=True))
                    m.pacer = Runs(30) if pattern == "deep_runs" else Forced(PATTERNS[pattern])
                    res = E.run(eng, m, requests(ids, kind), N_NEW)
                    assert [r.tokens for r in res.requests] == base, (name, pattern, kind, B)
                assert m.pacer.behind > 0


def test_prompt_lookup_finds_the_newest_aligned_occurrence():
    """graft.lookup searches the ids' bytes: a match must start on a token, not inside one (ids whose
    bytes straddle: 0x01000000 then 1 holds 0x01 0x00 0x00 0x00 where 256 would), and it agrees with the
    plain search (the newest earlier occurrence of the last 3, 2, 1 tokens) on random contexts."""
    import random
    from graft import lookup

    def plain(ctx, ngram, n_tokens):
        for n in range(min(ngram, len(ctx) - 1), 0, -1):
            for s in range(len(ctx) - n - 1, -1, -1):
                if ctx[s:s + n] == ctx[-n:]:
                    return n, ctx[s + n:s + n + n_tokens]
        return 0, []

    assert lookup([256, 9, 0x01000000, 1, 5, 256], 1, 2) == (1, [9, 0x01000000])
    assert lookup([7, 1, 2, 3, 4, 1, 2], 3, 5) == (2, [3, 4, 1, 2]) and lookup([1, 2, 3], 3, 5) == (0, [])
    rng = random.Random(0)
    for _ in range(2000):
        pool = rng.choice([[0, 1, 2], list(range(40)), [0x01000000, 1, 0x01010101, 0x00010000, 256, 2 ** 31 - 1]])
        ctx = [rng.choice(pool) for _ in range(rng.randrange(0, 40))]
        for ngram in (1, 2, 3):
            assert lookup(ctx, ngram, 5) == plain(ctx, ngram, 5), (ctx, ngram)


def test_the_pld_kinds_script_scores_as_the_pacer_does():
    """scripts/pld_kinds.py (the numbers behind pld's pacing by kind) scores every position's chain as
    PromptLookup.shadow does round by round, plain step after plain step: the same (n, tokens) settle."""
    import importlib.util
    import random
    import types
    import graft as GR
    spec = importlib.util.spec_from_file_location("pld_kinds", ROOT / "scripts" / "pld_kinds.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rng = random.Random(3)
    for _ in range(50):
        ids = [rng.randrange(6) for _ in range(rng.randrange(2, 12))]
        answer = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        r = Request(ids)
        eng = types.SimpleNamespace(requests=lambda: [r])
        m = types.SimpleNamespace(cfg=Config(pld_tokens=4), guess=[[]], now=[None])
        m.propose = lambda q, b: GR.PromptLookup.propose(m, q, b)                    # noqa: E731
        got = []
        for t in answer:                   # each plain step commits one token, then the next round's plan
            r.tokens.append(t)
            got += GR.PromptLookup.shadow(m, eng)[0][0]
        want = script.scores(ids, answer, 3, 4)
        assert sorted(got) == sorted((n, a) for n, xs in want.items() if n for a in xs), (ids, answer)
