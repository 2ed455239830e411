"""Every speculative method emits exactly the tokens plain decoding emits (float32, CPU), at every
batch size.

Greedy: identical to `ar` (itself checked against transformers in test_model.py). Sampling: identical
to `ar` for the same seed, because the noise for each absolute position is keyed by (the request's
seed, position). One engine serves every B: a single request is a batch of one, so each method runs
at B = 1, 2, 3 and 5 on a stream of more prompts than slots (a finished request's slot takes the
next one), prompts of different lengths side by side (one of a single token, one of three prefill
chunks), requests that end at an EOS and at max_new_tokens, each with its own seed and sampling
(temperature, top-p, top-k, greedy in one batch): every request's tokens equal the same prompt run
alone with `ar` and its seed. Graft and prune run under both pruning policies ("stop", "replace") at
every B. Random tiny targets with random heads exercise the bookkeeping; an oracle that proposes the
true continuation exercises deep acceptance and KV compaction in every slot; stories260K-hf with a
trained head does both on real text.
"""
import dataclasses

import pytest
import torch

import engine as E
import graft as GR
from calibrate import warm_up
from checkpoint import save_head
from cli import build_engine
from conftest import NO_BLOCK, needs_shared
from draft import Eagle3, HeadConfig
from engine import METHODS, Request, generate, make_method
from graft import Calibration, Config
from model import ModelArgs
from verify import Sampling, Tree

GREEDY = Sampling()
SAMPLED = Sampling(temperature=0.8, top_p=0.9, seed=1234)
BATCHES = (1, 2, 3, 5)
N_NEW = 16


def random_head(target_dir, out_dir, seed=0, draft_vocab=200):
    """A random EAGLE-3 head for a checkpoint, saved in the published format."""
    from checkpoint import load_model
    t = load_model(str(target_dir))
    a = t.args
    torch.manual_seed(seed)
    layer = ModelArgs(dim=a.dim, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=a.dim // 4,
                      intermediate_size=2 * a.dim, vocab_size=a.vocab_size)
    h = Eagle3(HeadConfig(layer=layer, target_hidden=a.dim, vocab_size=a.vocab_size, draft_vocab_size=draft_vocab))
    for p in h.parameters():
        torch.nn.init.normal_(p, std=0.2)
    h.d2t.copy_(torch.sort(torch.randperm(a.vocab_size)[:draft_vocab]).values - torch.arange(draft_vocab))
    save_head(h, str(out_dir))
    return out_dir


@torch.no_grad()
def plain_greedy(model, ids: list, n: int, eos_ids=()) -> list:
    """The oracle without any cache: each token the argmax after a causal pass over everything before
    it (at most n new tokens; stops after one in eos_ids)."""
    out = []
    while len(out) < n and not (out and out[-1] in eos_ids):
        x = torch.tensor([ids + out])
        out.append(int(model(x, torch.arange(x.shape[1]))[0, -1].argmax()))
    return out


def prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# ----------------------------------------------------------------------------- the tiny pair, one engine per B

@pytest.fixture(scope="module")
def pair(tiny_ckpt, tmp_path_factory):
    target = tiny_ckpt("llama31")
    return str(target), str(random_head(target, tmp_path_factory.mktemp("head")))


@pytest.fixture(scope="module")
def engines(pair):
    """One engine per batch size, prefill chunks of 16 tokens (a 40-token prompt takes three)."""
    return {B: build_engine(*pair, max_seq_len=256, chunk=16, batch=B) for B in BATCHES}


@pytest.fixture(scope="module")
def cal(engines):
    """The warm-up's Calibration (hit rates, the prior matrix of the B = 1 engine), and thresholds that
    make every stage fire sometimes on this random head: quantiles of the confidences it reports."""
    eng = engines[1]
    got = warm_up(eng, Config(), rounds=2, max_new_tokens=24, use_cache=False)
    assert isinstance(got, Calibration)
    conf = {}
    m = eng.make("eagle3", Config(budget=16), got)

    def keep(rnd, commits):
        for c, x in rnd.record["conf"].items():
            conf.setdefault(c, []).extend(x.tolist())
    E.run(eng, m, [Request(ids) for ids in prompts(4, 300, seed=9)], 16, (), on_round=keep, record=True)
    taus = {c: sorted(v)[int(q * len(v))] for (c, v), q in zip(sorted(conf.items()), (0.3, 0.4, 0.5))}
    return dataclasses.replace(got, methods={kind: {m: {"budget": 16, "thresholds": dict(taus), "rate": None}
                                                    for m in ("eagle3", "prune", "graft")}
                                             for kind in ("throughput", "youden")})


# every method, and prune and graft under each pruning policy (None: the default for the engine's B)
CASES = [(m, None) for m in NO_BLOCK] + [(m, p) for m in ("prune", "graft") for p in GR.POLICIES]


def config(policy=None, **kw):
    return Config(budget=16, recycle_size=24, policy=policy, **kw)


def mixed(i: int, seed: int = 1234) -> Sampling:
    """Request i's sampling in the sampled stream: top-p, top-k, both, or greedy, its own seed."""
    kinds = [Sampling(0.8, 0.9, 0), Sampling(1.0, 1.0, 20), Sampling(0.6, 0.8, 30), Sampling()]
    return dataclasses.replace(kinds[i % 4], seed=seed + i)


STREAM = prompts(5, 300, seed=1) + [[1], [1] + list(range(40, 79))]     # 1, 3..12 and 40 tokens


def requests(kind: str, ids=STREAM) -> list:
    return [Request(x, GREEDY if kind == "greedy" else mixed(i), i) for i, x in enumerate(ids)]


def alone(eng, r: Request, n: int, eos=()) -> list:
    """The prompt run alone (a batch of one) with plain decoding and the request's own sampling."""
    return generate(eng, make_method(eng, "ar"), r.ids, n, r.sampling, eos).tokens


@pytest.fixture(scope="module")
def streams(engines):
    """Per sampling kind: an EOS the first request reaches early (so some requests end at an EOS and
    others at max_new_tokens), and every request's tokens alone."""
    eng, out = engines[1], {}
    for kind in ("greedy", "sampled"):
        eos = [alone(eng, requests(kind)[0], N_NEW)[5]]
        base = [alone(eng, r, N_NEW, eos) for r in requests(kind)]
        assert any(len(b) < N_NEW for b in base) and any(len(b) == N_NEW for b in base), base
        out[kind] = (eos, base)
    return out


def test_ar_is_plain_greedy_decoding(engines):
    ids = STREAM
    want = [plain_greedy(engines[1].model, x, 24, engines[1].tokenizer.eos_ids) for x in ids]
    for B in (1, 3):
        eng = engines[B]
        got = E.run(eng, make_method(eng, "ar"), [Request(x) for x in ids], 24, eng.tokenizer.eos_ids)
        assert [r.tokens for r in got.requests] == want, B


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
@pytest.mark.parametrize("name, policy", CASES, ids=[m + (f"-{p}" if p else "") for m, p in CASES])
def test_every_method_lossless_at_every_batch(engines, cal, streams, name, policy, kind):
    """Seven prompts through B slots: each request's tokens are its own prompt's alone, whatever its
    neighbours, and the results come back in input order."""
    eos, base = streams[kind]
    for B in BATCHES:
        eng = engines[B]
        m = eng.make(name, config(policy), cal)
        res = E.run(eng, m, requests(kind), N_NEW, eos)
        assert [r.tokens for r in res.requests] == base, (name, policy, B)
        assert [r.index for r in res.requests] == list(range(len(STREAM)))
        assert len({r.rounds for r in res.requests}) > 1                   # they end at different rounds
        assert res.rounds >= max(r.rounds for r in res.requests)
        assert not any(eng.requests()) and int(eng.active.sum()) == 0       # every slot was freed


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
@pytest.mark.parametrize("name", ["eagle3", "prune", "graft"])
def test_a_tree_of_one_node_is_lossless(engines, cal, streams, name, kind):
    """Budget 1 (the smallest --budget auto prices on a CPU): the root and the head's best guess (every
    checkpoint keeps at least one drafted node, so graft's tree is prune's here); every request's tokens
    are its prompt's alone at every batch size, and no round verified more than one node."""
    eos, base = streams[kind]
    for B in BATCHES:
        eng = engines[B]
        m = eng.make(name, dataclasses.replace(config(), budget=1), cal)
        res = E.run(eng, m, requests(kind), N_NEW, eos)
        assert [r.tokens for r in res.requests] == base, (name, B)
        st = [r.stats() for r in res.requests]
        assert m.N == 2 and all(x["padded_per_round"] <= 1 for x in st), (name, B, st)
        assert any(x["verified_per_round"] > 0 for x in st), (name, B, st)     # some rounds drafted


def test_policies_and_their_defaults(engines, cal):
    """stop unless chosen, but replace at B > 1 where the engine replays CUDA graphs (Method.configure);
    each reads the calibration named beside it (stop: the chosen one, replace: Youden's J); an unknown
    policy is an error."""
    assert set(GR.POLICIES) == {"stop", "replace"}
    th = {"throughput": {0: 0.1, 1: 0.02, 5: 0.003}, "youden": {0: 0.2, 1: 0.04, 5: 0.005}}
    c = Calibration({k: {"graft": {"budget": 16, "thresholds": v, "rate": None}} for k, v in th.items()})
    for B in BATCHES:
        for name in ("prune", "graft"):
            m = engines[B].make(name, config())
            assert m.policy == "stop", (name, B)           # (an eager CPU engine)
            graphs = GR.METHODS[name].configure(config(), None, B, graphs=True).policy
            assert graphs == ("stop" if B == 1 else "replace"), (name, B)
        assert engines[B].make("graft", config("stop"), c).thresholds == th["throughput"]
        assert engines[B].make("graft", config("replace"), c).thresholds == th["youden"]
        assert engines[B].make("eagle3", config()).policy is None
    with pytest.raises(ValueError, match="pruning policy"):
        engines[1].make("graft", config("sometimes"))


def test_stop_policy_stops_at_every_checkpoint(engines, cal):
    """The thresholds used here make every stage happen: pruned at 0, 1, 5 and drafted to full
    depth, at B = 1 and B = 3; replace never stops a round early."""
    for B in (1, 3):
        eng = engines[B]
        for policy, stages in (("stop", {0, 1, 5, None}), ("replace", {None})):
            res = E.run(eng, eng.make("graft", config(policy), cal), requests("greedy"), N_NEW, ())
            seen = {s for r in res.requests for s in r.stages}
            assert seen == stages, (B, policy, seen)


def test_graft_whose_thresholds_never_prune_is_prune(engines):
    """Thresholds of 0 (what the warm-up calibrates where trees are small) free no slot for retrieval:
    graft then keeps no matrix or context and its rounds are prune's, tree for tree, at B = 1 and 3."""
    never = {0: 0.0, 1: 0.0, 5: 0.0}
    for B in (1, 3):
        eng, trees = engines[B], {}
        for name in ("graft", "prune"):
            m = eng.make(name, config(thresholds=never))
            got = trees[name] = []
            E.run(eng, m, requests("greedy"), N_NEW, (),
                  on_round=lambda rnd, c: got.append((rnd.tree.tokens.tolist(), rnd.tree.valid.tolist())))
            if name == "graft":
                assert m.matrix is None and m.ctx is None and m.tpl is None
        assert trees["graft"] == trees["prune"] and len(trees["graft"]) > 0, B
    assert engines[1].make("graft", config(thresholds={0: 0.1, 1: 0.0, 5: 0.0})).tpl is not None


@pytest.mark.parametrize("name", ["ar", "graft", "pld"])
def test_copies_of_a_prompt_draw_their_own_outputs(engines, cal, name):
    """Four copies of one prompt at temperature 1, seeds 0..3: four different outputs, each what the
    prompt draws alone with its seed, at B = 1, 2 (refills) and 5 (a free slot)."""
    ids = STREAM[2]
    reqs = lambda: [Request(ids, Sampling(temperature=1.0, seed=s), s) for s in range(4)]
    want = [alone(engines[1], r, N_NEW) for r in reqs()]
    assert len({tuple(w) for w in want}) == 4
    for B in (1, 2, 5):
        res = E.run(engines[B], engines[B].make(name, config(), cal), reqs(), N_NEW, ())
        assert [r.tokens for r in res.requests] == want, (name, B)


# ----------------------------------------------------------------------------- deep acceptance

class Oracle(GR.Method):
    """Proposes, for every request, a tree holding its true continuation (up to 6 tokens deep) among
    decoy siblings (for even requests a wrong sibling first, so the accepted path is never the first
    rows; odd ones the other way round), so that long paths are accepted and compaction runs in every
    slot on every round, each slot's path its own."""

    def __init__(self, eng, truth: dict):
        super().__init__(eng, Config())
        self.truth = truth                          # request index -> its tokens alone

    @classmethod
    def shape(cls, cfg):
        return 13, 7

    def round(self, eng, record=False, full=False):
        toks = torch.zeros(eng.B, self.N, dtype=torch.long)
        pars = torch.full((eng.B, self.N), -1, dtype=torch.long)
        valid = torch.zeros(eng.B, self.N, dtype=torch.bool)
        for b, r in enumerate(eng.requests()):
            if r is None:
                continue
            nxt = self.truth[r.index][len(r.tokens):len(r.tokens) + 6]
            t, p, prev = [0], [-1], 0
            for x in nxt:                   # odd requests: the true token first (their paths differ)
                t += [x, (x + 7) % 300] if r.index % 2 else [(x + 7) % 300, x]
                p += [prev, prev]
                prev = len(t) - 1 - r.index % 2
            toks[b, :len(t)], pars[b, :len(t)], valid[b, :len(t)] = torch.tensor(t), torch.tensor(p), True
        tree = Tree(torch.cat([eng.root[:, None], toks[:, 1:].to(eng.device)], 1), pars.to(eng.device),
                    valid.to(eng.device))
        v = eng.steps.verify(tree, eng.L, eng.active, eng.cols(self.N), eng.smp, eng.mode, self.P, False, eng.root)
        return GR.Round(tree, v, [None] * eng.B)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_deep_acceptance_keeps_cache_exact(engines, kind):
    n = 48
    truth = {r.index: alone(engines[1], r, n) for r in requests(kind)}
    for B in (1, 3):
        res = E.run(engines[B], Oracle(engines[B], truth), requests(kind), n, ())
        for r in res.requests:
            assert r.tokens == truth[r.index], (B, r.index)
            assert r.mat > 5                             # the oracle's paths were accepted


# ----------------------------------------------------------------------------- the warm-up

def test_warm_up_returns_a_calibration_and_writes_nothing_into_the_engine(pair):
    """calibrate.warm_up returns what it measured; the engine keeps its fields (only the prior matrix
    it owns learns), and a method reads the thresholds from the Calibration it is given."""
    eng = build_engine(*pair, max_seq_len=256, chunk=16)
    before = dict(vars(eng))
    got = warm_up(eng, Config(budget=16), rounds=2, max_new_tokens=24, use_cache=False)
    assert isinstance(got, Calibration) and got.get("graft") is not None
    assert set(vars(eng)) == set(before)
    assert all(vars(eng)[k] is v for k, v in before.items() if k != "mode")
    assert eng.make("graft", config("stop"), got).thresholds == got.get("graft")["thresholds"]
    assert eng.make("graft", config("replace"), got).thresholds == got.get("graft", "youden")["thresholds"]


def test_warmup_records_retrieval_from_before_the_round(engines):
    """What the throughput calibration replays: each warm-up round's retrieval as the round saw it,
    before its own verified logits reached the matrix (after them the matrix already holds the
    target's answer for that round, and retrieval would look far better than it is)."""
    from graft import PRIOR_HIT_RATES, build_template, retrieve
    eng = engines[3]
    m = eng.make("eagle3", Config(budget=8), matrix=eng.matrix.copy())
    m.record_tpl = build_template(PRIOR_HIT_RATES, 16)
    before, after, got = [], [], []
    learn = eng.steps.learn

    def spy(meth, tree, v, active):
        before.append(retrieve(meth.M, tree.tokens[:, 0], m.record_tpl).clone())
        out = learn(meth, tree, v, active)
        after.append(retrieve(meth.M, tree.tokens[:, 0], m.record_tpl).clone())
        return out
    eng.steps.learn = spy
    try:
        E.run(eng, m, [Request(x) for x in prompts(5, 300, seed=5)], 16, (), record=True,
              on_round=lambda rnd, c: got.append((rnd.record["retrieved"].clone(), [x is not None for x in c])))
    finally:
        eng.steps.learn = learn
    assert len(got) == len(before) > 0
    for (rec, live), b in zip(got, before):
        assert all(torch.equal(rec[i], b[i]) for i in range(eng.B) if live[i])
    assert any(not torch.equal(b, a) for b, a in zip(before, after))      # the round's update changes it


# ----------------------------------------------------------------------------- stories260K, trained head

@pytest.fixture(scope="module")
def stories():
    from data import STORIES, stories_head_dir
    engs = {B: build_engine(STORIES, stories_head_dir(), batch=B, max_seq_len=512) for B in (1, 3)}
    cal = warm_up(engs[1], Config(), rounds=3, max_new_tokens=48, use_cache=False)
    return engs, cal


STORY_PROMPTS = ["Once upon a time", "One day, a little boy named Tim", "The cat and the dog",
                 "Lily wanted to play", "There was a big tree in the park", "Sue had a red ball",
                 "Mom said", "The sun was shining and", "Ben and his friend went", "A bird flew"]


@needs_shared
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_stories_every_method_lossless(stories, kind):
    """A trained head on its own domain (long accepted paths): every method at B = 1 and B = 3,
    each request equal to its prompt alone."""
    engs, cal = stories
    eng = engs[1]
    ids = [eng.tokenizer.encode(p) for p in (STORY_PROMPTS[:6] if kind == "greedy" else STORY_PROMPTS[6:])]
    reqs = lambda: [Request(x, GREEDY if kind == "greedy" else mixed(i), i) for i, x in enumerate(ids)]
    base = [alone(eng, r, 40, eng.tokenizer.eos_ids) for r in reqs()]
    mats = {}
    for B, e in engs.items():
        for m in NO_BLOCK[1:]:
            res = E.run(e, e.make(m, Config(budget=24), cal), reqs(), 40, e.tokenizer.eos_ids)
            assert [r.tokens for r in res.requests] == base, (m, B)
            mats[(m, B)] = res.stats()["mat_drafting"]        # (rounds that drafted: pacing may add plain ones)
    if kind == "greedy":     # the trained head really drafts: long paths were accepted (not a speed claim)
        assert mats[("eagle3", 1)] > 2.0 and mats[("eagle3", 3)] > 2.0
