"""Exact mode (issue 29): in every dtype, a row's logits do not depend on the rows computed beside it,
so every method emits exactly plain decoding's tokens in bfloat16 and float16 too. Two routes: graft's
CPU kernels (cpu_kernels.py, the default) and, where they cannot be built, torch's kernels with padded rows
and blocked attention (the fallback, checked with the kernels switched off).

Kernel level, per architecture (Llama with GQA, Qwen3 with q/k norms, Qwen3-MoE) and dtype: plain
decoding's logits at each position equal, bit for bit, those of the same tokens as a chain inside a
verified tree of M = 1..61 nodes (its nodes at scattered tree rows, positions crossing a block of
exact_attention) and inside one prefill chunk. End to end: every method on the stdlib pair, greedy and
seeded sampling, at B = 1 and B = 3, equals `ar` in bfloat16 and float16.
"""
import dataclasses

import pytest
import torch

import engine as E
import cpu_kernels
import model as M
from cli import build_engine, check_args, ArgumentParser, add_engine_flags
from conftest import NO_BLOCK, ROOT
from graft import Config, METHODS
from model import GraftError
from verify import Sampling, tree_mask

ARCHS = {
    "llama": dict(arch="llama", n_heads=4, n_kv_heads=2, head_dim=16),
    "qwen3": dict(arch="qwen3", n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=True),
    "qwen3-moe": dict(arch="qwen3", n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=True, n_experts=8,
                      n_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, sparse_layers=(True, False, True)),
}
CHAIN = 8


def tiny(arch: str, dtype) -> M.Transformer:
    torch.manual_seed(0)
    a = M.ModelArgs(vocab_size=300, dim=64, n_layers=3, intermediate_size=96, norm_eps=1e-6, **ARCHS[arch])
    m = M.Transformer(a)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if p.dim() == 1 else 0.2 * torch.randn(p.shape))
    m = m.to(dtype).eval()
    m.setup_caches(192, 1, 64)
    return m


def tree_of(M_: int, g: torch.Generator) -> tuple:
    """parents (M,) of a random tree whose chain 0 -> r1 -> ... holds min(CHAIN, M) nodes at scattered
    rows; returns (parents, the chain's rows)."""
    K = min(CHAIN, M_)
    chain = [0] + sorted(torch.randperm(M_ - 1, generator=g)[:K - 1].add(1).tolist())
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, M_)]
    for a, b in zip(chain, chain[1:]):
        parents[b] = a
    return torch.tensor(parents), chain


@torch.no_grad()
def rows_differ(m: M.Transformer, L0: int, Ms) -> list:
    """(M, chain index) of every tree row whose logits differ from plain decoding's at its position, and
    ("prefill", i) of every prefill row that does."""
    g = torch.Generator().manual_seed(L0)
    prefix = torch.randint(3, 300, (1, L0), generator=g)
    chain = torch.randint(3, 300, (1, CHAIN), generator=g)
    one = lambda T: torch.ones(T, T, dtype=torch.bool).tril()
    L = torch.tensor([L0])
    rows = torch.arange(L0)[None]
    m(prefix, rows, rows, M.attention_mask(one(L0), torch.tensor([0]), torch.arange(L0)))
    saved = [t.clone() for t in m.cache.tensors()]
    ref = []
    for i in range(CHAIN):                                  # plain decoding: one token a pass
        r = torch.tensor([[L0 + i]])
        ref.append(m(chain[:, i:i + 1], r, r, M.attention_mask(one(1), L + i, torch.arange(L0 + i + 1)))[0, 0])
    bad = []
    for M_ in Ms:
        for t, s in zip(m.cache.tensors(), saved):
            t.copy_(s)
        parents, at = tree_of(M_, g)
        toks = torch.randint(3, 300, (1, M_), generator=g)
        toks[0, at] = chain[0, :len(at)]
        mask, depth = tree_mask(parents[None], torch.ones(1, M_, dtype=torch.bool), M_)
        out = m(toks, L0 + depth, L0 + torch.arange(M_)[None], M.attention_mask(mask, L, torch.arange(L0 + M_)))
        bad += [(M_, i) for i, r in enumerate(at) if not torch.equal(out[0, r], ref[i])]
    for t, s in zip(m.cache.tensors(), saved):              # the chain as one prefill chunk after the prefix
        t.copy_(s)
    r = L0 + torch.arange(CHAIN)[None]
    out = m(chain, r, r, M.attention_mask(one(CHAIN), L, torch.arange(L0 + CHAIN)))
    return bad + [("prefill", i) for i in range(CHAIN) if not torch.equal(out[0, i], ref[i])]


@pytest.fixture
def torch_kernels():
    """cpu_kernels.py switched off for one test: model.py then takes torch's kernels (the fallback route)."""
    on, cpu_kernels.ON = cpu_kernels.ON, False
    yield
    cpu_kernels.ON = on


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(arch, dtype):
    """graft's kernels. M = 1..61 in bfloat16 (every size a round verifies at), a spread of sizes in the
    other dtypes; prefixes of 5 and 60 tokens (a tree from 60 crosses exact_attention's block at 64)."""
    assert cpu_kernels.ready(), "graft's CPU kernels did not build here"
    m = tiny(arch, dtype)
    M.set_exact(m, True)
    Ms = range(1, 62) if dtype == torch.bfloat16 else (1, 2, 3, 4, 5, 7, 9, 16, 17, 31, 61)
    for L0 in (5, 60):
        assert rows_differ(m, L0, Ms) == [], (arch, dtype, L0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_fallback_is_exact_too(arch, dtype, torch_kernels):
    """torch's kernels in exact mode (padded rows, blocked attention): the same check, fewer sizes."""
    m = tiny(arch, dtype)
    M.set_exact(m, True)
    assert rows_differ(m, 60, (1, 2, 3, 9, 17, 61)) == [], (arch, dtype)


@pytest.mark.parametrize("route", ["kernels", "torch"])
def test_without_exact_mode_rows_differ(route, request):
    """The check above can fail: in plain mode some bf16 row differs (torch's attention, and with torch's
    kernels its linears, take other paths for one row than for several)."""
    if route == "torch":
        request.getfixturevalue("torch_kernels")
    bad = []
    for arch in ARCHS:
        bad += rows_differ(tiny(arch, torch.bfloat16), 60, (1, 2, 17, 61))
    assert bad


def test_exact_linear_pads_rows(torch_kernels):
    """On torch's kernels, Linear in exact mode pads rows (EXACT_ROWS; float32: EXACT_ROWS_F32): M = 1..9
    rows give the rows of M = 64."""
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        lin = M.Linear(576, 1152, bias=False).to(dtype)
        M.set_exact(lin, True)
        x = torch.randn(64, 576).to(dtype)
        full = lin(x)
        assert all(torch.equal(lin(x[:n]), full[:n]) for n in range(1, 10)), dtype
        assert torch.equal(lin(x[:5].view(1, 5, 576))[0], full[:5])


# ----------------------------------------------------------------------------- every method, end to end

def stream(eng, n: int = 4) -> list:
    from data import stdlib_prompts
    return [eng.tokenizer.encode(t)[:40] for t in stdlib_prompts(n)]


def sampling(i: int) -> Sampling:
    return Sampling() if i % 2 == 0 else Sampling(0.8, 0.9, 0, seed=100 + i)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_method_equals_ar_in_reduced_precision(dtype):
    """The stdlib pair in exact mode: every method at B = 1 and B = 3 (a stream of four prompts, greedy
    and seeded sampling side by side) returns what `ar` returns for each prompt alone."""
    ck = str(ROOT / "checkpoints")
    engines = {B: build_engine(f"{ck}/stdlib-qwen3", f"{ck}/stdlib-qwen3-eagle3", dtype=dtype, max_seq_len=128,
                               batch=B, exact=True) for B in (1, 3)}
    assert not_ar(engines) == []


def not_ar(engines: dict) -> list:
    """(method, B, request) of every output of every method, on each engine {B: engine}, that differs from
    `ar`'s for the same prompt alone (on engines[1]): a stream of four prompts, greedy and seeded side by side."""
    eng = engines[1]
    prompts = stream(eng)
    want = [E.generate(eng, eng.make("ar"), p, 12, sampling(i)).tokens for i, p in enumerate(prompts)]
    bad = []
    for B, e in engines.items():
        for name in NO_BLOCK:
            got = E.run(e, e.make(name, Config(budget=16, recycle_size=24)),
                        [E.Request(p, sampling(i), i) for i, p in enumerate(prompts)], 12)
            bad += [(name, B, i) for i, r in enumerate(got.requests) if r.tokens != want[i]]
    return bad


def test_exact_flag():
    """--exact is eager and CPU only; it is the default of an eager CPU run where the kernels build."""
    p = ArgumentParser()
    add_engine_flags(p)
    a = p.parse_args(["--exact", "--compile"])
    with pytest.raises(GraftError, match="--exact runs eager on the CPU"):
        check_args(a)
    for flags, exact, compiled in (([], True, False), (["--exact"], True, False), (["--no-exact"], False, False),
                                   (["--compile"], False, True)):
        a = p.parse_args(flags)
        check_args(a)
        assert (a.exact, a.compile) == (exact and cpu_kernels.ON, compiled), flags


def test_the_default_follows_the_kernels(torch_kernels):
    """Without graft's kernels exact mode costs 25-40% here (padded rows): then it is not the default."""
    p = ArgumentParser()
    add_engine_flags(p)
    a = p.parse_args([])
    check_args(a)
    assert not a.exact
