"""Every speculative method emits exactly the tokens plain decoding emits (float32, CPU).

Greedy: identical to `ar` (itself checked against transformers in test_model.py). Sampling: identical
to `ar` for the same seed, because the noise for each absolute position is keyed by (seed, position).
Random tiny targets with random heads exercise the bookkeeping; stories260K-hf with a trained head
(many tokens accepted per round) exercises deep acceptance and KV compaction.
"""
import pytest
import torch

from conftest import needs_shared, reference_greedy
from checkpoint import save_head
from draft import Eagle3, HeadConfig
from calibrate import warm_up
from cli import build_engine
from engine import METHODS, generate, make_method
from graft import Config, Graft
from verify import Proposer, Tree, commit
from model import ModelArgs
from verify import Sampling

GREEDY = Sampling()
SAMPLED = Sampling(temperature=0.8, top_p=0.9, seed=1234)


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


@pytest.fixture(scope="module")
def tiny_engine(tiny_ckpt, tmp_path_factory):
    target = tiny_ckpt("llama31")
    head = random_head(target, tmp_path_factory.mktemp("head"))
    eng = build_engine(str(target), str(head), max_seq_len=256)
    warm_up(eng, Config(), rounds=2, max_new_tokens=24, use_cache=False)
    # thresholds that make every stage fire sometimes on a random head
    eng.thresholds = {0: 0.05, 1: 0.01, 5: 0.001}
    return eng


def prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(eng, method, ids, n, s, **cfg):
    return generate(eng, make_method(eng, method, Config(**cfg)), ids, n, s, eng.tokenizer.eos_ids)


def test_ar_is_plain_greedy_decoding(tiny_engine):
    for ids in prompts(3, 300):
        assert run(tiny_engine, "ar", ids, 32, GREEDY).tokens == reference_greedy(tiny_engine.model, ids, 32, tiny_engine.tokenizer.eos_ids)


@pytest.mark.parametrize("s", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_eagle3_lossless_12_prompts(tiny_engine, s):
    for ids in prompts(12, 300, seed=1):
        base = run(tiny_engine, "ar", ids, 48, s).tokens
        assert run(tiny_engine, "eagle3", ids, 48, s).tokens == base, ids


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("ar", "eagle3")])
@pytest.mark.parametrize("s", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_every_method_lossless(tiny_engine, method, s):
    for ids in prompts(6, 300, seed=2):
        base = run(tiny_engine, "ar", ids, 40, s).tokens
        assert run(tiny_engine, method, ids, 40, s).tokens == base, (method, ids)


def test_sampling_differs_across_seeds(tiny_engine):
    ids = prompts(1, 300, seed=3)[0]
    a = run(tiny_engine, "ar", ids, 32, Sampling(temperature=1.0, seed=1)).tokens
    b = run(tiny_engine, "ar", ids, 32, Sampling(temperature=1.0, seed=2)).tokens
    assert a != b


class Oracle(Proposer):
    """Proposes a tree holding the true continuation (up to 6 tokens deep) among decoy siblings, so
    that long paths are accepted and the loop's compaction is exercised on every round."""
    N, P = 13, 7

    def __init__(self, eng, truth, prompt_len):
        self.eng, self.truth, self.n0 = eng, truth, prompt_len
        eng.reserve(self.N, self.P)

    def round(self, root):
        done = self.eng.L_host + 1 - self.n0            # generated tokens so far, root included
        nxt = self.truth[done:done + 6]
        toks, pars, prev = [self.eng.root_id], [-1], 0
        for t in nxt:
            toks += [(t + 7) % 300, t]                    # a wrong sibling first, then the true token
            pars += [prev, prev]
            prev = len(toks) - 1
        pad = self.N - len(toks)
        tree = Tree(torch.tensor(toks + [0] * pad), torch.tensor(pars + [-1] * pad),
                    torch.tensor([True] * len(toks) + [False] * pad))
        return commit(self.eng.verify(tree, self.P), tree)


@pytest.mark.parametrize("s", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_deep_acceptance_keeps_cache_exact(tiny_engine, s):
    for ids in prompts(4, 300, seed=4):
        truth = run(tiny_engine, "ar", ids, 60, s).tokens
        res = generate(tiny_engine, Oracle(tiny_engine, truth, len(ids)), ids, 60, s, tiny_engine.tokenizer.eos_ids)
        assert res.tokens == truth
        assert res.mat > 5 or len(truth) < 20             # the oracle's paths were accepted


# ----------------------------------------------------------------------------- stories260K, trained head

@pytest.fixture(scope="module")
def stories_engine():
    from data import STORIES, stories_head_dir
    eng = build_engine(STORIES, stories_head_dir())
    warm_up(eng, Config(), use_cache=False)
    return eng


STORY_PROMPTS = ["Once upon a time", "One day, a little boy named Tim", "The cat and the dog",
                 "Lily wanted to play", "There was a big tree in the park", "Sue had a red ball",
                 "Mom said", "The sun was shining and", "Ben and his friend went", "A bird flew"]


@needs_shared
@pytest.mark.parametrize("s", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_stories_every_method_lossless(stories_engine, s):
    eng = stories_engine
    mats = {}
    for p in STORY_PROMPTS if s.greedy else STORY_PROMPTS[:5]:     # (sampling: every method again, 5 prompts)
        ids = eng.tokenizer.encode(p)
        base = run(eng, "ar", ids, 64, s).tokens
        for m in list(METHODS)[1:]:
            r = run(eng, m, ids, 64, s)
            assert r.tokens == base, (m, p)
            mats.setdefault(m, []).append(r.mat)
    if s.greedy:   # the trained head really drafts: long paths were accepted (not a speed claim)
        assert sum(mats["eagle3"]) / len(mats["eagle3"]) > 2.0


def test_warmup_records_retrieval_from_before_the_round(tiny_engine):
    """What the throughput calibration replays: each warm-up round's retrieval as the round saw it,
    before its own verified logits reached the matrix (after them the matrix already holds the
    target's answer for that round, and retrieval would look far better than it is)."""
    from graft import PRIOR_HIT_RATES, build_template
    eng = tiny_engine
    d = eng.drafter
    from calibrate import Recorder
    m = Graft(eng, Config(budget=8, prune=False, retrieve=False, top_k=d.top_k, depth=d.depth), eng.matrix)
    m.recorder = Recorder(build_template(PRIOR_HIT_RATES, 16))
    before, after, learn = [], [], m.learn

    def spy(tree, v):
        before.append(eng.matrix.retrieve(tree.tokens[0], m.recorder.template).cpu())
        out = learn(tree, v)
        after.append(eng.matrix.retrieve(tree.tokens[0], m.recorder.template).cpu())
        return out
    m.learn = spy
    for ids in prompts(3, eng.model.args.vocab_size, seed=5):
        generate(eng, m, ids, 16, Sampling(), ())
    assert len(m.recorder.records) == len(before) > 0
    assert all(torch.equal(r["retrieved"], b) for r, b in zip(m.recorder.records, before))
    assert any(not torch.equal(b, a) for b, a in zip(before, after))      # the round's update changes it
