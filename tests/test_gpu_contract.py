"""The GPU's failure classes, made visible on the CPU (the contract in generate.py, above Engine).

CUDA graphs (torch.compile mode="reduce-overhead") and SDPA's kernel choice have rules a CPU never
enforces. Each test here enforces one of them on the CPU:
  placement   every step of every method runs on a non-CPU device (meta: data-less), so a CPU tensor
              mixed into a step fails here as it would on a GPU
  lifetimes   every step output is poisoned when it expires (next generation, or the step's next run):
              every method stays lossless, so nothing reads an output after a replay
  host syncs  device-to-host reads per round are counted and equal the documented number
  host data   no tensor is built from host data for the device inside a round (a blocking copy on a GPU)
  masked rows non-finite values in cache rows nobody may see change no token, in both attention modes
  attention   masked grouped-query attention never asks SDPA for enable_gqa (the math kernel on a GPU)
  code        every step has its own code object (its own dynamo cache); caches are 16-row aligned
The compiled checks (aot_eager: the same tracing as a GPU's compile) run in tests/compile_check.py.
"""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import cli as CLI
import engine as E
import graft as GR
import verify as V
import graft
import model as M
from conftest import ROOT
from test_lossless import prompts, random_head
from verify import Sampling, Tree

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

GREEDY = Sampling()
SAMPLED = Sampling(temperature=0.8, top_p=0.9, seed=1234)
CFG = dict(budget=10, checkpoints=(0, 1, 3))
THRESHOLDS = {0: 0.05, 1: 0.01, 3: 0.001}         # every stage fires sometimes on a random head


@pytest.fixture(scope="module")
def pair(tiny_ckpt, tmp_path_factory):
    target = tiny_ckpt("llama31")                    # 4 query heads over 2 KV heads: grouped attention
    return str(target), str(random_head(target, tmp_path_factory.mktemp("head")))


def engine(pair, **kw):
    eng = CLI.build_engine(*pair, max_seq_len=256, top_k=4, depth=5, chunk=16, **kw)
    eng.thresholds = dict(THRESHOLDS)
    return eng


def method(eng, name):
    cfg = GR.Config(**CFG, thresholds=dict(THRESHOLDS) if name in E.PRUNING else None)
    return E.make_method(eng, name, cfg)


@pytest.fixture(scope="module")
def plain(pair):
    return engine(pair)


def reference(plain, ids, n, s):
    return E.generate(plain, method(plain, "ar"), ids, n, s, ()).tokens


# ----------------------------------------------------------------------------- placement

def test_every_step_runs_on_a_non_cpu_device():
    """Every step the engine compiles, of every method, both attention modes, greedy and sampled, and
    the verify step at every size --budget auto times: no CPU tensor in any of them."""
    got = gpu_check.placement_check()
    assert got.pop("missing") == []
    assert {k: v for k, v in got.items() if v != "ok"} == {}
    assert len(got) > 200


def test_a_template_left_on_the_cpu_is_caught(monkeypatch):
    """The check sees the failure it exists for: retrieval templates that stay on the CPU (the first
    GPU run's crash) fail every assembling stage that retrieves."""
    monkeypatch.setattr(graft.Template, "to", lambda self, device: self)
    got = gpu_check.placement_check()
    bad = {k for k, v in got.items() if k != "missing" and v != "ok"}
    assert bad and all("/assemble_" in k or "recycle" in k or "/verify" in k or "/learn" in k for k in bad)
    assert any(k.endswith("/graft/greedy/assemble_0") for k in bad)


def test_gpu_check_fake_cuda_runs(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--fake-cuda", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("placement  ok")


# ----------------------------------------------------------------------------- output lifetimes

@pytest.mark.parametrize("s", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(E.METHODS))
def test_expired_outputs_are_never_read(pair, plain, name, s):
    """Outputs poisoned as a CUDA graph's next replay would overwrite them: every method, both
    attention modes, still emits plain decoding's tokens, and drafts exactly what it drafts unpoisoned
    (a poisoned read into the head's input would only show in what gets accepted)."""
    for attention in ("window", "full"):
        eng, same = engine(pair, check_lifetimes=True, attention=attention), engine(pair, attention=attention)
        m, m2 = method(eng, name), method(same, name)
        for ids in prompts(2, 300, seed=11) + [[1] + list(range(40, 80))]:      # (the last: 3 prefill chunks)
            got, want = E.generate(eng, m, ids, 30, s, ()), E.generate(same, m2, ids, 30, s, ())
            assert got.tokens == reference(plain, ids, 30, s), (name, attention, ids)
            assert (got.rounds, got.accepted, got.draft_forwards, got.stages) == \
                   (want.rounds, want.accepted, want.draft_forwards, want.stages)


def test_the_poison_is_real(pair):
    """What the lifetime check does to an output kept too long: the next round's step poisons it."""
    eng = engine(pair, check_lifetimes=True)
    m = method(eng, "ar")
    eng.begin(GREEDY)
    E.prefill(eng, m, [1, 5, 7])
    eng.mark_step()
    nxt, finite = eng.decode()
    kept = nxt.clone()
    eng.decode()                              # the same step again: the first call's outputs expire
    assert int(nxt[0]) == torch.iinfo(torch.long).max and int(kept[0]) != int(nxt[0])
    assert not bool(finite)                   # booleans flip
    eng.mark_step()                           # a new generation: the second call's outputs expire too


def test_prefill_marks_a_generation_per_chunk(pair, monkeypatch):
    """Every prefill chunk and every round starts a generation (the prefill step replays per chunk)."""
    eng = engine(pair)
    marks = []
    monkeypatch.setattr(eng, "mark_step", lambda: marks.append(eng.L_host))
    res = E.generate(eng, method(eng, "graft"), [1] + list(range(10, 50)), 12, GREEDY, ())      # 41 tokens: 3 chunks
    assert len(marks) == 3 + res.rounds and marks[:3] == [0, 16, 32]


# ----------------------------------------------------------------------------- host syncs and host data

class Transfers(TorchDispatchMode):
    """Counts what reaches the host from a tensor (item, float, bool: aten._local_scalar_dense; copies
    out of a non-CPU device; tolist) and tensors built from host data for a device (torch.tensor or
    torch.as_tensor with device=: a blocking copy on a GPU)."""

    def __init__(self):
        super().__init__()
        self.syncs = self.to_device = 0
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        elif func is torch.ops.aten._to_copy.default and args[0].device.type != "cpu" and \
                str(kwargs.get("device", args[0].device)).startswith("cpu"):
            self.syncs += 1
        return func(*args, **kwargs)


@pytest.fixture
def transfers(monkeypatch):
    """tolist() on a CPU tensor reads memory without any aten call, and torch.tensor(..., device=)
    on a CPU is no copy at all: both counted at the Python call."""
    t = Transfers()
    tolist, tensor, as_tensor = torch.Tensor.tolist, torch.tensor, torch.as_tensor

    def counted(self):
        t.syncs += t.active
        return tolist(self)

    def built(make):
        def f(*a, **kw):
            t.to_device += t.active and kw.get("device") is not None
            return make(*a, **kw)
        return f
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    monkeypatch.setattr(torch, "tensor", built(tensor))
    monkeypatch.setattr(torch, "as_tensor", built(as_tensor))
    return t


@pytest.mark.parametrize("name", list(E.METHODS))
def test_host_syncs_per_round_are_the_documented_ones(pair, transfers, name):
    """One host sync a round (commit's transfer) plus one per checkpoint reached, plus the prefill's
    one: counted, not trusted from what the round reports."""
    eng = engine(pair)
    m = method(eng, name)
    ids = prompts(1, 300, seed=12)[0]
    E.generate(eng, m, ids, 8, GREEDY, ())                           # set up and warmed outside the count
    rounds = []
    with transfers:
        res = E.generate(eng, m, ids, 30, GREEDY, (), on_round=lambda meth, v: rounds.append(v))
    thresholds = m.thresholds if isinstance(m, GR.Graft) else {}
    reached = [len(thresholds) if v.stage is None else list(thresholds).index(v.stage) + 1 for v in rounds]
    assert [v.syncs for v in rounds] == [1 + r for r in reached]
    assert transfers.syncs == 1 + sum(1 + r for r in reached) == 1 + res.syncs


@pytest.mark.parametrize("name", list(E.METHODS))
def test_no_host_data_enters_a_round(pair, transfers, name):
    """A tensor built from host values for the device inside a round is a blocking copy on a GPU:
    none but the prompt's one copy (pld's chain goes through a pinned buffer, asynchronously)."""
    eng = engine(pair)
    m = method(eng, name)
    ids = prompts(1, 300, seed=13)[0]
    E.generate(eng, m, ids, 8, GREEDY, ())
    with transfers:
        res = E.generate(eng, m, ids, 30, GREEDY, ())
    assert transfers.to_device == 1 and res.rounds > 5


# ----------------------------------------------------------------------------- masked rows

@pytest.mark.parametrize("attention", ["window", "full"])
@pytest.mark.parametrize("name", ["ar", "graft", "recycle"])
def test_nonfinite_unwritten_rows_change_no_token(pair, plain, attention, name):
    """Cache rows filled with NaN and inf before a generation (what torch.empty or an earlier run
    that overflowed leaves): the same tokens. Full attention reads every row under the mask."""
    eng = engine(pair, attention=attention)
    m = method(eng, name)
    for ids in prompts(2, 300, seed=14):
        for t in eng.model.cache.tensors() + eng.drafter.head.cache.tensors():
            t.fill_(float("nan"))
            t[..., ::3, :] = float("inf")
        assert E.generate(eng, m, ids, 24, GREEDY, ()).tokens == reference(plain, ids, 24, GREEDY)


def test_padding_rows_write_zeros(pair):
    """A padding row's keys and values never reach the cache (zeros there): a prefill chunk's tail
    and a tree's padding nodes."""
    eng = engine(pair, attention="full")
    eng.begin(GREEDY)
    for t in eng.model.cache.tensors():
        t.fill_(1.0)
    toks = torch.tensor([1, 5, 9, 7] + [0] * 12)
    eng.prefill(toks, 4, False)
    k = eng.model.cache.k[0][0]                                        # (H_kv, rows, D)
    assert bool((k[:, 4:16] == 0).all()) and bool((k[:, :4] != 0).any(-1).all())
    tree = Tree(torch.tensor([7, 3, 4, 0, 0]), torch.tensor([-1, 0, 0, -1, -1]),
                torch.tensor([True, True, True, False, False]))
    eng.verify(tree, 2)                                                # rows 4..8, padding at 7 and 8
    assert bool((k[:, 7:9] == 0).all())


def test_padding_logits_do_not_stop_verification(pair):
    """A padding node whose logits are not finite (its dummy token overflows) is not the target's
    failure: only real nodes' logits are checked."""
    eng = engine(pair)
    m = eng.model
    with torch.no_grad():
        m.embed_tokens.weight[0] = float("nan")                      # the padding token
    try:
        eng.begin(GREEDY)
        E.prefill(eng, method(eng, "ar"), [1, 5, 9, 7])
        tree = Tree(torch.tensor([7, 3, 4, 0, 0]), torch.tensor([-1, 0, 0, -1, -1]),
                    torch.tensor([True, True, True, False, False]))
        v = eng.verify(tree, 2)
        assert bool(v.finite) and bool(torch.isfinite(v.logits[:3]).all()) and not bool(torch.isfinite(v.logits[3:]).any())
    finally:
        with torch.no_grad():
            m.embed_tokens.weight[0] = 0.0


# ----------------------------------------------------------------------------- attention and code

def test_masked_grouped_attention_never_expands_kv(pair, monkeypatch):
    """SDPA never sees enable_gqa with a mask (on a GPU: the math kernel, which copies K and V to
    every query head), and the folded form equals the expanded one."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append((kw.get("attn_mask") is not None, bool(kw.get("enable_gqa", False)), a[0].shape[1], a[1].shape[1]))
        return sdpa(*a, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    eng = engine(pair)
    E.generate(eng, method(eng, "graft"), [1, 5, 9, 7], 12, GREEDY, ())
    assert calls and not any(mask and gqa for mask, gqa, _, _ in calls)
    assert all(hq == hkv for mask, _, hq, hkv in calls if mask)          # folded: query heads = KV heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, t, 8, generator=g) for h, t in ((6, 5), (2, 11), (2, 11)))
    mask = torch.rand(5, 11, generator=g) > 0.3
    mask[:, 0] = True
    assert torch.allclose(M.grouped_attention(q, k, v, mask), sdpa(q, k, v, attn_mask=mask, enable_gqa=True), atol=1e-6)


def test_every_step_has_its_own_code_object(pair):
    """Dynamo keeps one cache per code object: each step its own, shared by two methods' instances."""
    eng = engine(pair)
    a, b = method(eng, "graft"), method(eng, "prune")
    codes = lambda f: f.func.__code__ if hasattr(f, "func") else f.__func__.__code__ if hasattr(f, "__func__") else f.__code__
    steps = [eng._decode, eng._verify, eng._prefill, eng._head_prefill, a.extend, a.level, a.learn, *a.assemble.values()]
    assert len({id(codes(s)) for s in steps}) == len(steps)
    assert codes(eng._verify) is not V.verify.__code__
    assert codes(a.extend) is codes(b.extend) and codes(a.assemble[0]) is codes(b.assemble[0])


def test_cache_rows_are_16_aligned(pair):
    eng = engine(pair)
    assert eng.model.cache.rows % 16 == 0 and eng.drafter.head.cache.rows % 16 == 0
    assert M.cache_rows(4225) == 4240 and M.cache_rows(4224) == 4224
