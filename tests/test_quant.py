"""Weight-only int8 (quant.py, --quantization int8): the kernel's int8 rows, the quantized layer against a
float reference, the fused layer, and every method lossless on an int8 target."""
import pytest
import torch

import api
import cpu_kernels
import model as M
import quant
from calibrate import state_path_for
from cli import ArgumentParser, add_engine_flags, build_engine
from conftest import ROOT
from model import GraftError
from test_exact import not_ar, rows_differ, tiny
from test_lossless import random_head

kernels = pytest.mark.skipif(not cpu_kernels.ready(), reason="graft's CPU kernels did not build here")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_int8_rows_round_to_the_nearest_step():
    """One symmetric scale a row, max |W| / 127: every weight within half a step of q * scale, the row's
    largest at +-127, an all-zero row all zeros."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(9, 70, generator=g) * torch.logspace(-3, 1, 9)[:, None]
    w[4] = 0
    q, scale = quant.int8_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape and scale.shape == (9,)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert q.abs().amax(1).tolist() == [127] * 4 + [0] + [127] * 4
    assert (q[4] == 0).all()


@kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_linear_is_the_scaled_product_and_row_invariant(dtype):
    """cpu_kernels.linear with an int8 W: (x q^T) * scale + b within the dtype's rounding of float64, odd K
    (a masked tail) and N (a partial tile); a row's output the same bits for M = 1..40 rows around it."""
    g = torch.Generator().manual_seed(1)
    for N, K in ((37, 67), (64, 576), (5, 33), (19, 1536)):
        q, scale = quant.int8_rows(torch.randn(N, K, generator=g) / K ** 0.5)
        b = torch.randn(N, generator=g).to(dtype)
        xs = torch.randn(40, K, generator=g).to(dtype)
        y = cpu_kernels.linear(xs, q, b, scale)
        ref = (xs.double() @ q.double().T) * scale.double() + b.double()
        tol = 2e-6 if dtype == torch.float32 else 1e-2
        assert (y.double() - ref).abs().max() <= tol * ref.abs().max(), (N, K)
        for m in range(1, 41):
            assert torch.equal(cpu_kernels.linear(xs[:m], q, b, scale), y[:m]), (N, K, m)
            assert torch.equal(cpu_kernels.linear(xs[m - 1:m], q, b, scale)[0], y[m - 1]), (N, K, m)


@kernels
def test_two_threads_split_int8_outputs_never_sums():
    g = torch.Generator().manual_seed(4)
    q, scale = quant.int8_rows(torch.randn(576, 1536, generator=g))
    x = torch.randn(9, 1536, generator=g).bfloat16()
    n = torch.get_num_threads()
    try:
        got = []
        for t in (1, 2):
            torch.set_num_threads(t)
            got += [cpu_kernels.linear(x, q, None, scale), cpu_kernels.linear(x[:1], q, None, scale)]
    finally:
        torch.set_num_threads(n)
    assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[3]) and torch.equal(got[1][0], got[0][0])


@kernels
def test_int8_linear_refuses_what_does_not_fit():
    q, scale = quant.int8_rows(torch.randn(8, 16))
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="an int8 W takes its scales"):
        cpu_kernels.linear(x, q)
    with pytest.raises(RuntimeError, match="an int8 W takes its scales"):
        cpu_kernels.linear(x, q, None, scale[:4])
    with pytest.raises(RuntimeError, match="a scale only with an int8 W"):
        cpu_kernels.linear(x, torch.randn(8, 16), None, scale)


@kernels
def test_a_compiled_int8_linear_runs_the_kernel():
    """Registered with a shape function that takes the scale: inductor's graph calls the int8 kernel,
    the same bits as eager."""
    torch.manual_seed(3)
    q8 = quant.Int8Linear(M.Linear(64, 48, bias=True).bfloat16())
    x = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(torch.compile(q8)(x), q8(x))


@pytest.mark.parametrize("route", ["kernels", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_quantized_layer_is_the_float_layer_within_its_rounding(route, dtype, monkeypatch):
    """Int8Linear against the float layer it replaced: within the weights' rounding (half a step a
    weight) plus the dtype's; the same on torch's route (no kernels), which dequantizes on the fly."""
    if route == "kernels" and not cpu_kernels.ready():
        pytest.skip("graft's CPU kernels did not build here")
    if route == "torch":
        monkeypatch.setattr(cpu_kernels, "ON", False)
        monkeypatch.setattr(cpu_kernels, "_tried", True)
    torch.manual_seed(2)
    lin = M.Linear(96, 40, bias=True).to(dtype)
    x = torch.randn(7, 96).to(dtype)
    want = x.double() @ lin.weight.double().T + lin.bias.double()
    q8 = quant.Int8Linear(lin)
    with torch.no_grad():
        got = q8(x).double()
    assert got.shape == want.shape
    step = x.double().abs() @ (q8.scale.double()[:, None] / 2).expand(40, 96).T     # |x| . half a step
    tol = step + (2e-6 if dtype == torch.float32 else 1e-2) * want.abs().max()
    assert ((got - want).abs() <= tol).all()
    assert q8.weight.dtype == torch.int8 and q8.scale.dtype == torch.float32


@kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_int8_models_rows_do_not_depend_on_the_rows_beside_it(arch, dtype):
    """The tiny targets of test_exact quantized (every linear and the lm_head int8), exact mode: a tree
    node's logits are plain decoding's at its position, bit for bit, for trees of M = 2..40 nodes and a
    prefill chunk, on the fused route (one kernel call for every layer) and on the modules' route; and
    the two routes agree (bit for bit in bfloat16)."""
    m = quant.quantize(tiny(arch, dtype))
    assert all(type(x) is quant.Int8Linear for x in m.modules() if isinstance(x, M.Linear))
    assert m.quantization == "int8" and len(m.layers[0].fused_scales()) == 7
    M.set_exact(m, True)
    assert rows_differ(m, 37, (2, 9, 17, 40)) == []
    for b in m.layers:
        b.fuse = False
    assert rows_differ(m, 37, (9,)) == []
    t = torch.arange(5)[None]
    mask = M.attention_mask(torch.ones(5, 5, dtype=torch.bool).tril(), torch.tensor([0]), torch.arange(5))
    with torch.no_grad():
        modules = m(t, t, t, mask)
        for b in m.layers:
            b.fuse = True
        fused = m(t, t, t, mask)
    # the same linears either way; in float32 the modules' silu (torch's exp) and the kernel's differ in the last bit
    assert torch.equal(fused, modules) if dtype == torch.bfloat16 else torch.allclose(fused, modules, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_fallback_is_exact_on_int8_too(arch, monkeypatch):
    """Without the kernels (torch's, exact mode: padded float32 rows, blocked attention) an int8 target's
    tree rows are still plain decoding's."""
    monkeypatch.setattr(cpu_kernels, "ON", False)
    monkeypatch.setattr(cpu_kernels, "_tried", True)
    m = quant.quantize(tiny(arch, torch.bfloat16))
    M.set_exact(m, True)
    assert rows_differ(m, 60, (1, 2, 3, 9, 17)) == []


def test_quantize_checks_its_input():
    m = tiny("llama", torch.float32)
    with pytest.raises(GraftError, match="--quantization must be one of none, int8"):
        quant.quantize(m, "int4")
    assert quant.quantize(m, "none") is m and not hasattr(m, "quantization")
    kept = quant.quantize(tiny("llama", torch.float32), lm_head=False)
    assert type(kept.lm_head) is M.Linear and type(kept.layers[0].mlp.down_proj) is quant.Int8Linear
    with pytest.raises(GraftError, match="already quantized"):
        quant.quantize(kept)
    moe = quant.quantize(tiny("qwen3-moe", torch.float32))
    assert type(moe.layers[0].mlp.gate) is M.Linear          # a MoE's router stays float


def test_the_flag_lists_its_choices():
    p = ArgumentParser()
    add_engine_flags(p)
    assert p.parse_args([]).quantization == "none"
    assert p.parse_args(["--quantization", "int8"]).quantization == "int8"
    with pytest.raises(GraftError, match="invalid choice: 'int4'.*'none', 'int8'"):
        p.parse_args(["--quantization", "int4"])
    with pytest.raises(GraftError, match="quantization= takes one of none, int8, got 'fp8'"):
        api.load(quantization="fp8")


@kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_method_equals_ar_on_an_int8_target(dtype):
    """The stdlib pair with its target int8 (the head float), exact mode: every method at B = 1 and B = 3
    (four prompts, greedy and seeded sampling side by side) returns what `ar` on the int8 target returns
    for each prompt alone; the warm-up cache is keyed apart from the float target's."""
    ck = str(ROOT / "checkpoints")
    engines = {B: build_engine(f"{ck}/stdlib-qwen3", f"{ck}/stdlib-qwen3-eagle3", dtype=dtype, max_seq_len=128,
                               batch=B, exact=True, quantization="int8") for B in (1, 3)}
    eng = engines[1]
    assert eng.model.quantization == "int8" and eng.model.lm_head.weight.dtype == torch.int8
    assert eng.drafter.head.fc.weight.dtype != torch.int8                  # the head stays float
    assert not_ar(engines) == []
    float_eng = build_engine(f"{ck}/stdlib-qwen3", dtype=dtype, max_seq_len=128, exact=True)
    assert state_path_for(float_eng) != state_path_for(eng)


def test_bench_reports_what_int8_costs(tiny_ckpt, tmp_path, capsys):
    """bench --quantization int8: the float target's greedy outputs and perplexity first, then the int8
    target's, in the report (meta.quality), and the methods run on the int8 target, lossless."""
    import json
    import bench
    target = tiny_ckpt("llama31")
    head = random_head(target, tmp_path / "head")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in ("Once upon a time", "The ball was", "One day")))
    out = tmp_path / "r.json"
    bench.main(["--ckpt", str(target), "--draft", str(head), "--methods", "ar,graft", "--datasets", str(prompts),
                "--max-new-tokens", "8", "--warmup", "1", "--no-cache", "--quantization", "int8", "--json-out", str(out)])
    meta, rows = (r := json.loads(out.read_text()))["meta"], r["rows"]
    q = meta["quality"]
    assert meta["quantization"] == "int8" and q["prompts"] == 3 and len(q["common_prefix"]) == 3
    assert all(0 <= n <= 8 for n in q["common_prefix"]) and q["median_common_prefix"] == sorted(q["common_prefix"])[1]
    assert set(q["perplexity"]) == {"float32", "int8"} and all(p > 1 for p in q["perplexity"].values())
    assert [x["method"] for x in rows] == ["ar", "graft"] and all(x["lossless"] is True for x in rows)
    assert "int8: perplexity" in capsys.readouterr().err
    out2 = tmp_path / "batch.json"                    # batched: the same report fields, every B on the int8 target
    bench.main(["--ckpt", str(target), "--draft", str(head), "--methods", "ar,graft", "--datasets", str(prompts),
                "--max-new-tokens", "8", "--warmup", "1", "--no-cache", "--quantization", "int8", "--batch", "1,2",
                "--json-out", str(out2)])
    meta2, rows2 = (r := json.loads(out2.read_text()))["meta"], r["rows"]
    assert meta2["quantization"] == "int8" and meta2["quality"]["common_prefix"] == q["common_prefix"]
    assert rows2 and all(x["lossless"] is True for x in rows2)
