"""Retrieval from several sources (docs/graft.md section 4a): the continuation matrix and context matches.

The device's context match is the host reference's, row by row; the merge puts both sources in one
subtree by score (a node both propose, or that repeats a kept draft node, costs no slot; parents come
first); graft and recycle stay lossless against `ar` with each source set (greedy at B = 1, seeded
sampling at B = 3; both sources at every B are tests/test_lossless.py's default); a source turned off
proposes nothing and the per-source shares count accepted real nodes only; a bad --sources is one line.
"""
import dataclasses

import pytest
import torch

import calibrate as CAL
import engine as E
import graft as GR
from cli import build_engine, sources
from conftest import ROOT
from data import stdlib_snippets
from model import GraftError
from verify import Sampling

T = torch.tensor
CKPT, HEAD = ROOT / "checkpoints" / "stdlib-qwen3", ROOT / "checkpoints" / "stdlib-qwen3-eagle3"


def test_device_match_is_the_host_reference():
    """Longest suffix match (at most G tokens), newest among the longest, the T tokens after it that are
    known; a batch of rows of different lengths, with and without repeats."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 4, (n,), generator=g).tolist() for n in (1, 2, 7, 30, 45)]
    rows += [[5, 6, 7, 8, 5, 6, 7], [9] * 12, list(range(20))]
    S, G, n = 50, 4, 6
    ctx = torch.zeros(len(rows), S, dtype=torch.long)
    for b, r in enumerate(rows):
        ctx[b, :len(r)] = T(r)
    tok, real, m = GR.context_match(ctx, T([len(r) for r in rows]), G, n)
    for b, r in enumerate(rows):
        want, wm = CAL.match_context(r, G, n)
        assert int(m[b]) == wm and tok[b][real[b]].tolist() == want, (r, tok[b], real[b], m[b])
    assert m.tolist()[-3:] == [3, 4, 0] and tok[-3, :3].tolist() == [8, 5, 6]
    w = max(len(r) for r in rows) + 1             # eager rounds read the live columns only (graft.match_cols)
    tok2, real2, m2 = GR.context_match(ctx[:, :w], T([len(r) for r in rows]), G, n)
    assert torch.equal(real2, real) and torch.equal(m2, m) and torch.equal(tok2[real], tok[real])


def test_context_append_writes_each_requests_accepted_tokens():
    ctx, clen = torch.zeros(2, 10, dtype=torch.long), T([2, 0])
    GR.context_append(ctx, clen, T([[7, 8, 9], [4, 5, 6]]), T([3, 1]))
    assert clen.tolist() == [5, 1] and ctx[0, 2:5].tolist() == [7, 8, 9] and ctx[1, :2].tolist() == [4, 0]


def merge(d_tok, kept, r_tok, r_score, tpl, free):
    """graft_trees for one request under the root: (tokens, parents, valid, source) as lists."""
    d_par = T([[-1] * d_tok.shape[1]])
    out = GR.graft_trees(d_tok, d_par, kept, r_tok, tpl, T([-1]), T([free]), r_score)
    return [x[0].tolist() for x in out]


def test_merge_by_score_dedups_and_keeps_parents_first():
    """Template of 4 (ranks 0..3 under the root, scores log .4 .3 .2 .1) and a chain of 3. The chain's
    first token repeats the template's rank-3 node: merged (no slot), which then takes the chain's
    better score, so the chain's next tokens hang under it and outrank the template's others."""
    tpl = GR.build_template((0.4, 0.3, 0.2, 0.1), 4, max_depth=1)
    rtpl = GR.with_chain(tpl, 3)
    d_tok, kept = T([[50, 0, 0, 0]]), T([[True, False, False, False]])
    r_tok = T([[60, 61, 62, 63, 63, 64, 65]])
    chain = GR.context_scores(T([[True, True, True]]), T([2]), torch.log(T([0.0, 0.5, 0.9])))
    tok, par, valid, src = merge(d_tok, kept, r_tok, torch.cat([tpl.score[None], chain], 1), rtpl, 3)
    # kept 50; then by score: 63 (lifted to .9), 64 (.81, under 63), 65 (.729, under 64): the template's
    # 60 (.4), 61, 62 lose their slots
    assert tok == [50, 63, 64, 65] and par == [-1, -1, 1, 2] and valid == [True] * 4
    assert src == [0, GR.SOURCES["matrix"], GR.SOURCES["context"], GR.SOURCES["context"]]
    # a chain that repeats a kept draft node merges into it; without a match it offers nothing
    tok, par, _, src = merge(d_tok, kept, T([[60, 61, 62, 63, 50, 66, 67]]), torch.cat([tpl.score[None], chain], 1), rtpl, 3)
    assert tok == [50, 66, 67, 60] and par == [-1, 0, 1, -1] and src == [0, 2, 2, 1]
    off = GR.context_scores(T([[True, True, True]]), T([0]), torch.log(T([0.0, 0.5, 0.9])))
    tok, _, _, src = merge(d_tok, kept, r_tok, torch.cat([tpl.score[None], off], 1), rtpl, 3)
    assert tok == [50, 60, 61, 62] and src == [0, 1, 1, 1]
    # the matrix turned off: only the chain, and the slots it cannot fill stay padding
    none = torch.full((1, 4), float("-inf"))
    tok, par, valid, src = merge(d_tok, kept, r_tok, torch.cat([none, chain], 1), rtpl, 3)
    assert valid == [True] * 4 and tok == [50, 63, 64, 65] and src == [0, 2, 2, 2]
    short = GR.context_scores(T([[True, False, False]]), T([2]), torch.log(T([0.0, 0.5, 0.9])))
    _, _, valid, src = merge(d_tok, kept, r_tok, torch.cat([none, short], 1), rtpl, 3)
    assert valid == [True, True, False, False] and src == [0, 2, 0, 0]


def test_context_hit_rates_are_measured_per_match_length():
    """q(0) = 0; a text that repeats itself raises the rates of the matches it makes above the prior;
    lengths never seen keep the prior."""
    loop = E.Request([1, 2, 3, 4, 5], tokens=[1, 2, 3, 4, 5] * 6)
    q = CAL.context_hit_rates([loop])
    assert len(q) == GR.MATCH + 1 and q[0] == 0.0 and all(0 <= x <= 1 for x in q)
    assert q[GR.MATCH] > GR.PRIOR_CONTEXT_RATES[GR.MATCH]
    assert CAL.context_hit_rates([E.Request([1, 2, 3], tokens=[4, 5, 6])]) == (0.0,) + GR.PRIOR_CONTEXT_RATES[1:]


@pytest.fixture(scope="module")
def stdlib():
    if not (CKPT / "model.safetensors").is_file():
        pytest.skip("no stdlib pair")
    engs = {B: build_engine(str(CKPT), str(HEAD), max_seq_len=384, chunk=64, batch=B) for B in (1, 3)}
    # held-out standard-library code, which repeats its own names: context matches happen
    ids = [engs[1].tokenizer.encode(s)[:160] for s in stdlib_snippets(heldout=True, n=3, lines=16)]
    return engs, ids


def check_round(off: int):
    """on_round: in a busy slot (its root real) a node comes from a source only when it is real, and
    never from the one turned off."""
    def look(rnd, got):
        t = rnd.tree
        busy = t.valid[:, :1]
        assert not ((t.retrieved != 0) & ~t.valid & busy).any() and not ((t.retrieved == off) & busy).any()
    return look


@pytest.mark.parametrize("kind, B", [("greedy", 1), ("sampled", 3)])
def test_each_source_set_is_lossless_and_counted(stdlib, kind, B):
    """graft (every round pruned at checkpoint 0, so most slots are retrieval's) with each source alone
    (both: tests/test_lossless.py), and recycle from the context alone: every request's tokens are
    ar's; the shares by source add up to the retrieval share, of accepted tokens; a source turned off
    contributes nothing. Context matches are accepted in these runs (the check can fail)."""
    engs, ids = stdlib
    smp = Sampling() if kind == "greedy" else Sampling(0.8, 0.9, 0, 7)
    base = [E.generate(engs[1], engs[1].make("ar"), x, 16, smp).tokens for x in ids]
    cfg = GR.Config(budget=12, recycle_size=16, thresholds={0: 1.0, 1: 1.0, 5: 1.0})
    eng, seen = engs[B], {}
    for name, srcs in [("graft", ("matrix",)), ("graft", ("context",)), ("recycle", ("context",))]:
        m = eng.make(name, dataclasses.replace(cfg, sources=srcs))
        off = next((i for s, i in GR.SOURCES.items() if s not in srcs), -1)
        res = E.run(eng, m, [E.Request(x, dataclasses.replace(smp, seed=7)) for x in ids], 16, on_round=check_round(off))
        assert [r.tokens for r in res.requests] == base, (name, srcs)
        for r in res.requests:
            assert sum(r.from_source.values()) == r.from_retrieval <= r.accepted
            assert all(r.from_source[s] == 0 for s in GR.SOURCES if s not in srcs)
        seen[name, srcs] = sum(r.from_source["context"] for r in res.requests)
    assert seen["graft", ("context",)] > 0 and seen["recycle", ("context",)] > 0, seen


def test_bad_sources_are_one_line_errors():
    assert sources("context,matrix") == ("context", "matrix")
    for bad in ("", "matrix,", "cache", "matrix,matrix", "MATRIX"):
        with pytest.raises(GraftError, match="^--sources takes one or more of matrix, context"):
            sources(bad)
    import api
    with pytest.raises(GraftError, match="--sources"):
        api.engine_options(sources="prompt")
    import bench
    with pytest.raises(GraftError, match="--ablate-sources runs one request at a time"):
        bench.main(["--ckpt", str(CKPT), "--draft", str(HEAD), "--methods", "ar,graft", "--batch", "1,2",
                    "--ablate-sources", "--datasets", "stdlib"])
