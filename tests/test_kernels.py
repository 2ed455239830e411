"""graft's CPU kernels (cpu_kernels.py, cpu_kernels.cpp): the numbers they compute, their row invariance, their
shapes under torch.compile, and what happens where they cannot be built."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import cpu_kernels
import model as M
from conftest import ROOT

pytestmark = pytest.mark.skipif(not cpu_kernels.ready(), reason="graft's CPU kernels did not build here")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_is_the_linear_and_row_invariant(dtype):
    """Odd K (a masked tail) and N (a partial tile), a bias: the product within the dtype's rounding of a
    float64 reference, and any row's output the same bits for M = 1..96 rows around it (on AVX2, bfloat16
    with K = 560: a tile's prefetched run of an odd number of 16-weight steps; on AMX, bfloat16
    with even K: tiles of 16 rows and of 32 weights, here with a short last chunk and a partial block; K a
    multiple of 32: 17-80 rows at once against one output block, full blocks of rows and a last one of 1-16
    rows; past 80 blocks of rows in pairs and a lone last one, against four output blocks at a time (two
    such tasks: N = 130) and against one)."""
    g = torch.Generator().manual_seed(0)
    for N, K in ((37, 67), (64, 576), (5, 33), (37, 70), (37, 64), (100, 96), (130, 64), (37, 560)):
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
        b = torch.randn(N, generator=g).to(dtype)
        xs = torch.randn(96, K, generator=g).to(dtype)
        y = cpu_kernels.linear(xs, w, b)
        ref = xs.double() @ w.double().T + b.double()
        tol = 2e-6 if dtype == torch.float32 else 1e-2
        assert (y.double() - ref).abs().max() <= tol * ref.abs().max(), (N, K)
        for m in range(1, 97):
            assert torch.equal(cpu_kernels.linear(xs[:m], w, b), y[:m]), (N, K, m)
            assert torch.equal(cpu_kernels.linear(xs[m - 1:m], w, b)[0], y[m - 1]), (N, K, m)
        assert cpu_kernels.linear(xs[:40].view(4, 10, K), w, None).shape == (4, 10, N)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_sum_is_the_same_to_its_last_bit(dtype):
    """Row invariance where the output's rounding cannot hide it: a bias that cancels a row's sum leaves its
    last float32 bits in the output, and one row alone gives them as 20 rows do (on AMX: one row runs the
    tile multiply's arithmetic on vector FMAs, so this checks that it is the tile's; also with sums at the
    edge of float32's normal range, where the tiles flush denormals)."""
    g = torch.Generator().manual_seed(1)
    for N, K, scale in ((37, 70, 1.0), (64, 576, 1.0), (48, 1536, 1.0), (17, 34, 1.0), (32, 96, 1e-19)):
        w = (torch.randn(N, K, generator=g) * scale).to(dtype)
        xs = (torch.randn(20, K, generator=g) * (scale if dtype != torch.float16 else 1.0)).to(dtype)
        ref = (xs.double() @ w.double().T).float()
        for r in range(20):
            b = -ref[r] if scale == 1.0 else None                       # the sum cancelled: its last bits remain
            one = cpu_kernels.linear(xs[r:r + 1], w, b)[0]
            assert torch.equal(one, cpu_kernels.linear(xs, w, b)[r]), (N, K, r)
            assert torch.equal(one, cpu_kernels.linear(xs[:r + 1], w, b)[r]), (N, K, r)
        if K >= 576 and dtype != torch.float16:
            assert (one != 0).sum() > N // 4                            # the residuals are there to compare


def test_a_weight_written_in_place_or_viewed_is_read_as_it_is():
    """The linear's packed copy of a weight (AMX) follows it: written in place, the next call reads the new
    values; a view of some of its rows gives those rows' outputs. (Elsewhere the same holds trivially.)"""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(3, 64, generator=g).bfloat16()
    y = cpu_kernels.linear(x, w)
    w.mul_(2)                                           # exact in bfloat16: every output doubles
    assert torch.equal(cpu_kernels.linear(x, w), 2 * y)
    assert torch.equal(cpu_kernels.linear(x, w[16:48]), cpu_kernels.linear(x, w)[:, 16:48])


@pytest.mark.skipif(not (cpu_kernels.isa() or "").endswith("+amx"), reason="no AMX here")
def test_amx_can_be_refused():
    """GRAFT_AMX=0: a process of its own runs bfloat16 on VDPBF16PS instead, as row-invariant."""
    code = """
import torch, cpu_kernels
assert cpu_kernels.ready(), "no build"
w, x = torch.randn(100, 96).bfloat16(), torch.randn(17, 96).bfloat16()
y = cpu_kernels.linear(x, w)
assert all(torch.equal(cpu_kernels.linear(x[m:m + 1], w)[0], y[m]) for m in range(17))
print(cpu_kernels.isa())
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, GRAFT_AMX="0"), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.split() == ["avx512_bf16"], r.stderr[-2000:]


def test_peak_runs_for_every_dtype():
    """The multiply-add peak (bench's % of peak) runs for every dtype a linear takes, in a process of its own
    (a fault there must fail this test, not end the suite): a tile configuration the compiler had cut to
    its first 8 bytes once configured AMX's tiles with 0 rows, and the first tile load raised SIGILL."""
    code = """
import math, torch, cpu_kernels
assert cpu_kernels.ready(), "no build"
got = [cpu_kernels.peak(d, 0.01) for d in (torch.float32, torch.bfloat16, torch.float16)]
assert all(math.isfinite(p) and p > 0 for p in got), got
print(*got)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and len(r.stdout.split()) == 3, (r.returncode, r.stderr[-2000:])


def test_threads_split_outputs_never_sums():
    """Two threads split the output columns (linear) and the queries (attention), never one output's
    sum: the same bits as one thread."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(576, 1536, generator=g).bfloat16(), torch.randn(9, 1536, generator=g).bfloat16()
    q, k, v = (torch.randn(*s, generator=g).bfloat16() for s in ((1, 9, 9, 64), (1, 3, 80, 64), (1, 3, 80, 64)))
    mask = torch.ones(1, 1, 9, 80, dtype=torch.bool).tril(71)
    n = torch.get_num_threads()
    try:
        got = []
        for t in (1, 2):
            torch.set_num_threads(t)
            got.append((cpu_kernels.linear(x, w), cpu_kernels.attention(q, k, v, mask, 0.125)))
    finally:
        torch.set_num_threads(n)
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_is_masked_attention(dtype):
    """Grouped heads, a ragged bool mask with a row that sees nothing (a padding row: zeros), a mask
    broadcast over requests; within rounding of SDPA on the same keys."""
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, T, S, D = 2, 6, 2, 19, 45, 24            # 19 queries: more than one block of 16; D not 16-aligned
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    mask = torch.rand(B, 1, T, S, generator=g) < 0.5
    mask[..., 0] = True
    mask[1, 0, 3] = False
    y = cpu_kernels.attention(q, k, v, mask, D ** -0.5)
    ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(3, 1),
                                         v.double().repeat_interleave(3, 1), attn_mask=mask)
    ref[1, :, 3] = 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (y.double() - ref).abs().max() < tol
    one = cpu_kernels.attention(q[:1], k[:1], v[:1], mask[:1, :, :1].expand(1, 1, T, S), D ** -0.5)
    assert torch.equal(one[0, :, 0], y[0, :, 0]) and torch.equal(one[0, :, 5], cpu_kernels.attention(
        q[:1], k[:1], v[:1], mask[:1, :, :1].expand(1, 1, T, S), D ** -0.5)[0, :, 5])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128, 24])
def test_a_query_alone_is_the_query_among_many(dtype, D):
    """Decoding's few query-heads and a tree's many (values read in place where D is whole vectors; D = 24
    widens them first; bfloat16 with D = 64, 128 scores on AMX tiles where the CPU has them, 27 query-heads
    in two blocks of 16): one query's output is the same bits alone, beside 8 others, and in every request
    of a batch."""
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, T, S = 2, 6, 2, 9, 100                    # G = 3: one row is 3 query-heads, nine rows 27
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    mask = torch.zeros(B, 1, T, S, dtype=torch.bool)
    mask[..., :90] = True
    mask[:, :, 4, 37] = False                            # (a row whose seen list has a hole)
    many = cpu_kernels.attention(q, k, v, mask, D ** -0.5)
    for t in range(T):
        one = cpu_kernels.attention(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], D ** -0.5)
        assert torch.equal(one[:, :, 0], many[:, :, t])
        assert torch.equal(cpu_kernels.attention(q[1:, :, t:t + 1], k[1:], v[1:], mask[1:, :, t:t + 1], D ** -0.5)[0],
                           one[1])


def test_a_query_reads_its_keys_in_row_order_wherever_they_sit():
    """A tree node sees the committed rows and then its ancestors at tree rows; plain decoding sees the
    same keys at consecutive rows. The same keys in the same order: the same bits."""
    g = torch.Generator().manual_seed(2)
    H, Hkv, S, D, L = 4, 2, 64, 32, 30
    k, v = torch.randn(1, Hkv, S, D, generator=g).bfloat16(), torch.randn(1, Hkv, S, D, generator=g).bfloat16()
    q = torch.randn(1, H, 1, D, generator=g).bfloat16()
    plain = torch.zeros(1, 1, 1, S, dtype=torch.bool)
    plain[..., :L + 3] = True                                # rows 0..L+2: positions 0..L+2
    k2, v2 = k.clone(), v.clone()
    tree = torch.zeros(1, 1, 1, S, dtype=torch.bool)
    tree[..., :L] = True
    for j, row in enumerate((40, 47, 55)):                   # positions L, L+1, L+2 at scattered tree rows
        k2[:, :, row], v2[:, :, row] = k[:, :, L + j], v[:, :, L + j]
        tree[..., row] = True
    k2[:, :, L:40], v2[:, :, L:40] = 7.0, 7.0                 # rows nobody sees
    assert torch.equal(cpu_kernels.attention(q, k, v, plain, D ** -0.5), cpu_kernels.attention(q, k2, v2, tree, D ** -0.5))


def test_compiled_graphs_call_them():
    """Registered with shape functions: a compiled model's CPU linears run cpu_kernels.linear, with the same
    bits as eager."""
    lin = M.Linear(48, 40).bfloat16()
    x = torch.randn(3, 48).bfloat16()
    with torch.no_grad():
        eager = lin(x)
        got = torch.compile(lin, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(got, eager) and torch.equal(eager, cpu_kernels.linear(x, lin.weight, lin.bias))


def test_training_takes_torchs_linear():
    """Gradients flow: with grad enabled and weights that need it, Linear is F.linear."""
    lin = M.Linear(16, 8)
    x = torch.randn(2, 16)
    lin(x).sum().backward()
    assert lin.weight.grad is not None


def test_without_a_compiler_one_line_and_torchs_kernels(tmp_path):
    """A build that fails (here: a source that does not compile) says so in one line and graft runs on
    torch's kernels; GRAFT_KERNELS=0 turns them off silently."""
    bad = tmp_path / "cpu_kernels.cpp"
    bad.write_text("this is not C++\n")
    code = ("import cpu_kernels, pathlib, torch, model; cpu_kernels.SOURCE = pathlib.Path(%r); print(cpu_kernels.ready()); "
            "print(model.Linear(4, 2)(torch.ones(1, 4)).shape)" % str(bad))
    env = dict(os.environ, GRAFT_KERNELS_DIR=str(tmp_path / "build"))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["False", "torch.Size([1, 2])"], r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "building" not in ln]
    assert len(lines) == 1 and lines[0].startswith("graft: CPU kernels unavailable ("), r.stderr
    r = subprocess.run([sys.executable, "-c", "import cpu_kernels; print(cpu_kernels.ready())"], cwd=ROOT,
                       env=dict(env, GRAFT_KERNELS="0"), capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False" and r.stderr == ""


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fused_layer_is_the_modules(arch, dtype):
    """cpu_kernels.block (model.Block.fused_forward) against the same layers as torch modules (Block.fuse off,
    exact mode): two requests in a 3-slot cache (slots), a padding row (keep), a tree mask, q/k/v biases
    (llama) or q/k norms (qwen3). The same logits within the dtype's rounding, the same cache rows, and
    a row outside the cache refused in one line before anything is written."""
    torch.manual_seed(0)
    kind = dict(arch="llama", n_heads=4, n_kv_heads=2, head_dim=16, attention_bias=True) if arch == "llama" else \
        dict(arch="qwen3", n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=True)
    m = M.Transformer(M.ModelArgs(vocab_size=300, dim=64, n_layers=2, intermediate_size=96, norm_eps=1e-6, **kind))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if p.dim() == 1 else 0.2 * torch.randn(p.shape))
    m = m.to(dtype).eval()
    m.setup_caches(100, 3)                 # the RoPE table; the caches are the test's own (64 rows)
    M.set_exact(m, True)
    B, T, S = 2, 5, 48
    tokens, slots = torch.randint(3, 300, (B, T)), torch.tensor([2, 0])
    L = torch.tensor([30, 17])
    rows = L[:, None] + torch.arange(T)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [0, 0, 0, 0, 1]]).bool()
    mask = M.attention_mask(tree, L, torch.arange(S))
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 4] = False
    out, caches = [], []
    for fuse in (True, False):
        M.Block.fuse = fuse
        cache, g = M.KVCache(2, 3, 2, 64, kind["head_dim"], dtype, "cpu"), torch.Generator().manual_seed(1)
        for t in cache.tensors():                       # rows the requests have committed already
            t.copy_(torch.randn(t.shape, generator=g))
        try:
            with torch.no_grad():
                out.append(m(tokens, rows, rows, mask, cache=cache, keep=keep, slots=slots).float())
        finally:
            M.Block.fuse = True
        caches.append(cache)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert (out[0][keep] - out[1][keep]).abs().max() <= tol * out[1][keep].abs().max()
    assert (out[0][~keep] == 0).all()               # a padding row is not computed: its logits are zeros
    for a, b in zip(caches[0].tensors(), caches[1].tensors()):
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()
    with torch.no_grad(), pytest.raises(RuntimeError, match="a row outside the cache"):
        m(tokens, rows + 60, rows + 60, mask, cache=caches[0], keep=keep, slots=slots)


def test_the_fused_route_reads_the_modules_as_they_are_now():
    """Block.fused_weights/fused_scales read the modules' own dicts (not nn.Module.__getattr__, which costs
    a tenth of a token's pass): the same objects attribute access finds, for a llama layer with biases, a
    qwen3 layer with q/k norms and an int8 layer; and a module replaced after a step is the one read next."""
    import quant
    for kind in (dict(arch="llama", attention_bias=True), dict(arch="qwen3", qk_norm=True)):
        m = M.Transformer(M.ModelArgs(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                      intermediate_size=96, **kind)).eval()
        for q in (False, True):
            if q:
                quant.quantize(m)
            for b in m.layers:
                a, mlp = b.self_attn, b.mlp
                want = (b.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias,
                        a.v_proj.weight, a.v_proj.bias, a.o_proj.weight, a.q_norm.weight if a.qk_norm else None,
                        a.k_norm.weight if a.qk_norm else None, b.post_attention_layernorm.weight,
                        mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
                assert all(x is y for x, y in zip(b.fused_weights(), want, strict=True))
                lins = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
                assert all(x is y.scale for x, y in zip(b.fused_scales(), lins, strict=True)) if q else b.fused_scales() == []
    torch.manual_seed(0)
    m = M.Transformer(M.ModelArgs(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                  intermediate_size=96)).eval()
    m.setup_caches(64, 1)
    M.set_exact(m, True)
    tokens, rows = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    mask = M.attention_mask(torch.ones(3, 3, dtype=torch.bool).tril_(), torch.tensor([0]), torch.arange(64))
    with torch.no_grad():
        m(tokens, rows, rows, mask)
        new = M.Linear(64, 64, bias=False)
        new.weight.mul_(3)
        m.layers[1].self_attn.q_proj = new
        fused = m(tokens, rows, rows, mask)
        M.Block.fuse = False
        try:
            unfused = m(tokens, rows, rows, mask)
        finally:
            M.Block.fuse = True
    assert (fused - unfused).abs().max() <= 1e-4 * unfused.abs().max()


# ----------------------------------------------------------------------------- the round's small steps

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_rows_and_top_logprobs_are_torchs(dtype):
    """topk_rows: torch.topk's values and indices where no two values tie (ties go to the lower index, as
    argmax: k = 1 is argmax, NaN never chosen); top_logprobs: log_softmax then topk."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 7, 1000, generator=g).to(dtype)
    for k in (1, 5, 16):
        v, i = cpu_kernels.topk_rows(x, k)
        ref = x.float().topk(k, dim=-1)
        assert torch.equal(v, ref.values) and torch.equal(x.float().gather(-1, i), ref.values)
        lv, li = cpu_kernels.top_logprobs(x, k)
        lref = torch.log_softmax(x.float(), -1).topk(k, dim=-1)
        assert torch.allclose(lv, lref.values, atol=1e-5) and torch.equal(li, i)
    tie = torch.tensor([[1.0, 3.0, 3.0, 2.0, float("nan")]]).to(dtype)
    assert cpu_kernels.topk_rows(tie, 1)[1].item() == 1 == tie.float().nan_to_num(-1).argmax().item()
    assert cpu_kernels.topk_rows(tie, 3)[1].tolist() == [[1, 2, 3]]


def test_move_rows_is_the_indexed_copy():
    """KV compaction in one call: each request's source rows to its destination rows in every cache,
    overlapping ranges read before written: what KVCache.move_rows's torch version does."""
    g = torch.Generator().manual_seed(5)
    caches = [torch.randn(3, 2, 20, 8, generator=g).bfloat16() for _ in range(4)]
    src, dst = torch.tensor([[5, 7, 9], [3, 4, 5], [10, 2, 6]]), torch.tensor([[4, 5, 6], [4, 5, 6], [2, 3, 4]])
    want = [t.clone() for t in caches]
    bi, hi = torch.arange(3)[:, None, None], torch.arange(2)[None, :, None]
    for t in want:
        t.index_put_((bi, hi, dst[:, None, :]), t[bi, hi, src[:, None, :]])
    cpu_kernels.move_rows(caches, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(caches, want))
    with pytest.raises(RuntimeError, match="a row outside the cache"):
        cpu_kernels.move_rows(caches, src + 20, dst)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_layer_in_one_call_and_padding_rows_left_out(dtype, monkeypatch):
    """Transformer.fused_layers (one cpu_kernels.layers call) gives the bits and captured features of
    Block.fused_forward layer after layer; padding rows (keep False) are not computed (zeros out) and
    leave every real row's bits as they are without them; nor are their logits (lm_head reads the real
    rows only: a tree's padding is free on a CPU)."""
    torch.manual_seed(0)
    m = M.Transformer(M.ModelArgs(vocab_size=300, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                                  intermediate_size=96, norm_eps=1e-6)).to(dtype).eval()
    m.capture_layers = (0, 2, 3)
    m.setup_caches(64, 1)
    M.set_exact(m, True)
    T = 6
    tokens, rows = torch.randint(3, 300, (1, T)), torch.arange(T)[None] + 10
    keep = torch.tensor([[True, True, False, True, False, True]])
    tree = torch.ones(T, T, dtype=torch.bool).tril() & (keep[0][None, :] | torch.eye(T, dtype=torch.bool))
    mask = M.attention_mask(tree, torch.tensor([10]), torch.arange(20))     # no real row sees a padding row

    def per_layer(self, x, rope, rows, mask, cache, keep, slots, points):
        feats = []
        for i, b in enumerate(self.layers):
            feats += [x] * list(points).count(i)
            x = b.fused_forward(x, rope, rows, mask, (cache, i), keep, slots)
        return x, feats + [x] * list(points).count(len(self.layers))

    read, head = [], m.lm_head.forward
    m.lm_head.forward = lambda x: (read.append(x.shape[:-1].numel()), head(x))[1]
    with torch.no_grad():
        one = m(tokens, rows, rows, mask, capture=True, keep=keep)
        full = m(tokens, rows, rows, mask, capture=True)
        assert read == [int(keep.sum()), T]
        monkeypatch.setattr(M.Transformer, "fused_layers", per_layer)
        each = m(tokens, rows, rows, mask, capture=True, keep=keep)
    assert torch.equal(one[0], each[0]) and torch.equal(one[1], each[1])
    assert (one[0][~keep] == 0).all() and (one[1][~keep][:, 64:] == 0).all()    # (layer 0's input: the embedding)
    assert torch.equal(one[0][keep], full[0][keep]) and torch.equal(one[1][keep], full[1][keep])


def test_another_machines_instructions_built_here(tmp_path):
    """GRAFT_KERNELS_MARCH builds the kernels for a lower target (x86-64-v3: AVX2, no AVX-512, as a
    Zen 3 has), here, in a process of its own: its linear and attention are as row-invariant as the
    native build's (bfloat16's 4-row tiles in asm, with an odd prefetched run at K = 560), and its
    multi-row linear is the matrix product. (On a machine without AVX-512 this is
    its native path again.)"""
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64 only")
    code = """
import torch, cpu_kernels
assert cpu_kernels.ready(), "no build"
print(cpu_kernels.isa())
g = torch.Generator().manual_seed(0)
for dt, K in ((torch.float32, 131), (torch.bfloat16, 131), (torch.bfloat16, 560)):
    w, b = (torch.randn(37, K, generator=g) / K ** 0.5).to(dt), torch.randn(37, generator=g).to(dt)
    x = torch.randn(19, K, generator=g).to(dt)
    y = cpu_kernels.linear(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    assert (y.double() - ref).abs().max() <= (2e-6 if dt == torch.float32 else 1e-2) * ref.abs().max()
    for m in range(1, 20):
        assert torch.equal(cpu_kernels.linear(x[m - 1:m], w, b)[0], y[m - 1]), (K, m)
        assert torch.equal(cpu_kernels.linear(x[:m], w, b), y[:m]), (K, m)
    q, k, v = (torch.randn(*s, generator=g).to(dt) for s in ((1, 4, 9, 32), (1, 2, 40, 32), (1, 2, 40, 32)))
    mask = torch.ones(1, 1, 9, 40, dtype=torch.bool).tril(31)
    a = cpu_kernels.attention(q, k, v, mask, 0.2)
    for t in range(9):
        assert torch.equal(cpu_kernels.attention(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], 0.2)[:, :, 0], a[:, :, t])
print("ok")
"""
    env = dict(os.environ, GRAFT_KERNELS_MARCH="x86-64-v3", GRAFT_KERNELS_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.split() == ["avx2", "ok"], r.stderr[-2000:]


@pytest.mark.parametrize("V", [49152, 1000, 37])
def test_sampling_draw_is_the_torch_draw(V):
    """verify.choose's draw on a CPU (cpu_kernels.gumbel_argmax: hashes in C++, torch's logs, noise for the
    tokens that can win alone) picks what the torch formula picks, (warped logits in float64 +
    position_noise).argmax: rows of three requests at five positions each, seeds above 2^32 too; flat,
    peaked and very peaked rows (few candidates); logits cut by top-k (-inf); bfloat16 and float16 logits
    with the temperature divided in the kernel; near-ties of two tokens one float32 step apart on either
    side; NaN, +inf and all -inf rows (torch's argmax: the first NaN, the first +inf, token 0); rows left out."""
    import verify as V_
    g = torch.Generator().manual_seed(4)
    B, N = 3, 5
    seed = torch.tensor([7, 2**40 + 3, 0])
    pos = torch.randint(0, 4096, (B, N), generator=g)
    th = V_.token_hash(V, "cpu")
    noise = V_.position_noise(seed[:, None], pos, V)                                   # (B, N, V) float64
    draw = lambda x, t=None: cpu_kernels.gumbel_argmax(x, seed, pos, th, t)           # noqa: E731
    for scale in (1.0, 8.0, 40.0):                      # flat and peaked rows
        x = torch.randn(B, N, V, generator=g) * scale
        x[1, 2, : V // 2] = float("-inf")                # (top-k's removed tokens)
        assert torch.equal(draw(x), (x.double() + noise).argmax(-1))
        t = torch.tensor([0.7, 1.0, 1.3])
        for dt in (torch.bfloat16, torch.float16):
            lg = (x / 4).to(dt)
            want = (V_.warp(lg, t, torch.zeros(B, dtype=torch.long), torch.ones(B), (True, False, False)).double()
                    + noise).argmax(-1)
            assert torch.equal(draw(lg, t), want)
    x = torch.full((B, N, V), float("-inf"))             # two tokens a row: the row's extremes of noise
    lo, hi = noise.argmin(-1), noise.argmax(-1)
    x.scatter_(-1, lo[..., None], 0.0)
    gap = (noise.gather(-1, lo[..., None]) - noise.gather(-1, hi[..., None]))[..., 0].float()   # (B, N)
    for steps in (-2, -1, 0, 1, 2):                      # the high-noise token's x one float32 step apart
        y, near = x.clone(), gap.clone()
        for _ in range(abs(steps)):
            near = torch.nextafter(near, torch.full_like(near, float("inf") if steps > 0 else float("-inf")))
        y.scatter_(-1, hi[..., None], near[..., None])
        assert torch.equal(draw(y), (y.double() + noise).argmax(-1)), steps
    x = torch.randn(B, N, V, generator=g)
    x[0, 1, 3] = x[0, 1, 5] = float("nan")
    x[1, 1, 2] = x[1, 1, 7] = float("inf")
    x[2, 3] = float("-inf")
    got = draw(x)
    assert (got[0, 1], got[1, 1], got[2, 3]) == (3, 2, 0) and torch.equal(got, (x.double() + noise).argmax(-1))
    real = torch.rand(B, N, generator=g) < 0.5           # a tree's padding rows are not drawn: 0
    assert torch.equal(cpu_kernels.gumbel_argmax(x, seed, pos, th, None, real), torch.where(real, got, 0))
