"""Long context (issue 20): a long prompt's prefill costs one target pass a chunk and the lm_head on one
row of each (the matrix does not learn the prompt: docs/graft.md section 3), every method stays
lossless near the end of a 4K cache with two long requests side by side, and the head's agreement is
measured by position.
"""
import importlib.util
import sysconfig
from pathlib import Path

import pytest
import torch

import engine as E
from calibrate import warm_up
from cli import build_engine
from conftest import NO_BLOCK, ROOT
from data import STDLIB_CKPT, STDLIB_DRAFT, stdlib_files
from graft import Config, ContinuationMatrix
from test_lossless import plain_greedy, random_head
from verify import Sampling

has_stdlib = pytest.mark.skipif(not (Path(STDLIB_CKPT) / "model.safetensors").is_file(), reason="no stdlib pair")
GREEDY, SAMPLED = Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=7)


def stdlib_text() -> str:
    """The longest stdlib file (deterministic: size, then path)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(stdlib_files(root), key=lambda f: (-Path(f).stat().st_size, f))
    return Path(files[0]).read_text(errors="replace")


@pytest.fixture(scope="module")
def stdlib_engine():
    return build_engine(STDLIB_CKPT, STDLIB_DRAFT, max_seq_len=2048)


@pytest.fixture(scope="module")
def engines():
    """The stdlib pair, prefill chunks of 128 tokens, B = 2."""
    return {128: build_engine(STDLIB_CKPT, STDLIB_DRAFT, max_seq_len=2048, batch=2)}


@has_stdlib
@pytest.mark.parametrize("method", ["graft", "recycle"])
def test_a_long_prompt_costs_a_pass_a_chunk_and_one_lm_head_row_each(engines, method, monkeypatch):
    """1500 tokens in chunks of 128 into slot 1: one target pass a chunk, the lm_head on each chunk's
    last row alone, the first token the one a full causal pass chooses, and the matrix untouched (what
    a request leaves as the prior is what it learned in its rounds: none here)."""
    eng = engines[128]
    ids = eng.tokenizer.encode(stdlib_text())[:1500]
    calls, rows = [], []
    step, head = eng.steps.prefill, eng.model.lm_head.forward
    monkeypatch.setattr(eng.steps, "prefill", lambda *a, **k: calls.append(1) or step(*a, **k))
    monkeypatch.setattr(eng.model.lm_head, "forward", lambda x: rows.append(x.shape[:-1].numel()) or head(x))
    m = ContinuationMatrix(eng.model.args.vocab_size, 8)
    before = m.state_dict()
    p = eng.make(method, Config(thresholds={0: 0.5}), matrix=m)    # (a graft that prunes: it keeps a matrix)
    first = eng.admit(1, E.Request(ids), p)
    eng.free(1, p)
    assert len(calls) == -(-len(ids) // 128) and rows == [1] * len(calls)
    with torch.no_grad():
        logits = eng.model(torch.tensor([ids]), torch.arange(len(ids)))[0, -1]     # (V,) causal, no cache
    assert first == int(logits.argmax())
    assert all(torch.equal(a, b) for a, b in zip(before.values(), m.state_dict().values()))


@pytest.fixture(scope="module")
def long_tiny(tiny_ckpt, tmp_path_factory):
    """A tiny random Llama with a 4K context and a random head, caches sized to the context, one
    engine with one slot and one with two; the warm-up's Calibration."""
    target = tiny_ckpt("llama31", max_position_embeddings=4096)
    head = random_head(target, tmp_path_factory.mktemp("head4k"))
    engs = {B: build_engine(str(target), str(head), max_seq_len=4096, batch=B) for B in (1, 2)}
    cal = warm_up(engs[1], Config(), rounds=1, max_new_tokens=16, use_cache=False)
    return engs, cal


THRESHOLDS = {0: 0.013, 1: 1.5e-4, 5: 1e-11}        # every stage fires sometimes on the random head


def long_prompts(n: int, length: int, vocab: int = 300) -> list:
    """Prompts of `length` tokens that repeat (so retrieval and lookup accept): a random phrase of
    20-60 tokens, repeated with random edits."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        phrase = torch.randint(3, vocab, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g)
        ids = phrase.repeat(length // phrase.numel() + 1)[:length].clone()
        edits = torch.randint(0, length, (length // 10,), generator=g)
        ids[edits] = torch.randint(3, vocab, (edits.numel(),), generator=g)
        out.append([1] + ids[1:].tolist())
    return out


def test_every_method_lossless_at_the_end_of_a_4k_context(long_tiny):
    """Every method, the last rounds writing the cache's last rows: two requests near the end of the
    context side by side in two slots, of different lengths, one greedy and one sampled with its own
    seed; each request's tokens are its prompt's alone."""
    engs, cal = long_tiny
    new = 32
    a, b = long_prompts(2, 4096 - new)
    reqs = lambda: [E.Request(a, GREEDY, 0), E.Request(b[:4000], SAMPLED, 1)]
    base = [E.generate(engs[1], engs[1].make("ar"), r.ids, new, r.sampling, ()).tokens for r in reqs()]
    assert base[0][:8] == plain_greedy(engs[1].model, a, 8)
    for m in NO_BLOCK:
        got = E.run(engs[2], engs[2].make(m, Config(budget=16, thresholds=THRESHOLDS), cal), reqs(), new, ())
        assert [r.tokens for r in got.requests] == base, m


@has_stdlib
def test_a_trained_pair_is_lossless_with_a_2k_prompt_of_real_code(stdlib_engine, engines):
    """2000 tokens of real code beside a 1200-token prompt in two slots: every method's tokens are
    plain decoding's, and the head still drafts usefully this deep."""
    eng, two = stdlib_engine, engines[128]
    ids = eng.tokenizer.encode(stdlib_text())[:2048 - 48]
    other = eng.tokenizer.encode(stdlib_text())[300:1500]
    base = [E.generate(eng, E.make_method(eng, "ar"), x, 48, GREEDY, eng.tokenizer.eos_ids).tokens for x in (ids, other)]
    for m in ("eagle3", "prune", "graft", "recycle", "pld"):
        got = E.run(two, two.make(m), [E.Request(ids), E.Request(other)], 48, eng.tokenizer.eos_ids).requests
        assert [x.tokens for x in got] == base, m
        if m in ("eagle3", "graft"):
            assert got[0].mat > 1.5, (m, got[0].mat)          # the head still drafts usefully this deep


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@has_stdlib
def test_head_agreement_is_what_a_rounds_first_draft_token_would_do(stdlib_engine):
    """Teacher-forced agreement at row t: the head's top-1 after (feature t, token t+1) is the target's
    choice after token t+1. A round after the prompt ids[:t+1] with root ids[t+1] drafts level 1 from
    that very row, and verifies: its best level-1 token against the target's choice after the root."""
    H = load_script("head_by_position")
    eng = stdlib_engine
    ids = eng.tokenizer.encode(stdlib_text())[:300]
    hits = H.agreement(eng, ids)
    assert hits.shape == (len(ids) - 2,)
    assert 0.2 < hits.float().mean() < 1.0          # a trained head on its own domain: far from chance
    for t in (3, 40, 150, 297):
        g = eng.make("eagle3")
        eng.admit(0, E.Request(ids[:t + 1]), g)
        eng.root[0] = g.pend_ids[0, 0] = ids[t + 1]             # the round's root: the text's next token
        rnd, _ = eng.step(g)
        assert bool(hits[t]) == (int(eng.drafter.tokens[0, 0]) == int(rnd.v.target[0, 0])), t
        eng.free(0, g)
    rows = H.by_position([hits], (0, 128, 256, 512))
    assert [r["rows"] for r in rows] == [127, 128, len(ids) - 2 - 255]
    assert rows[0]["agreement"] == round(float(hits[:127].float().mean()), 4)


@has_stdlib
def test_continuation_agreement_counts_only_generated_rows(stdlib_engine):
    H = load_script("head_by_position")
    eng = stdlib_engine
    text = stdlib_text()
    rows = H.on_continuations(eng, [text], [64, 256], new_tokens=16)
    assert [(r["context"], r["rows"]) for r in rows] == [(64, 15), (256, 15)]     # tokens after the first generated one


def test_context_cost_names_the_attention_kernel(long_tiny):
    C = load_script("context_cost")
    got = C.profiled_pass(long_tiny[0][1], 512, 9, repeats=1)
    assert got["attention_kernel"] and all(k.startswith("aten::_scaled_dot_product") for k in got["attention_kernel"])
    assert 0 < got["attention_ms"] < got["total_ms"]
