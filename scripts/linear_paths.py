"""Candidate CPU linear paths, side by side, per linear shape of a model and per number of rows M.

    OMP_NUM_THREADS=1 python scripts/linear_paths.py                      # SmolLM2-135M's shapes, bf16 and fp32
    OMP_NUM_THREADS=1 python scripts/linear_paths.py --dtypes bfloat16 --ms 1,9 --compiled
    OMP_NUM_THREADS=1 python scripts/linear_paths.py --step [--dtypes bfloat16] [--freezing]   # the whole model

Issue 34: a one-token step reads every weight once, so a linear at M = 1 should read its weight at the
machine's memory bandwidth. Measured here, for each candidate: microseconds per linear and the weight
bytes it reads per second (GB/s), beside the machine's own read and copy bandwidth.

Weights come from DRAM, as in a real step: each candidate cycles through a pool of distinct copies of
the weight (together at least --pool-mb, several times the last-level cache), so no weight is
cache-hot when it is read; one timed call is a sweep over the whole pool, its time divided by the pool
size. Candidates are interleaved sweep by sweep and the median sweep counts (the machine is shared).

Candidates (the ones that do not apply to a dtype are skipped, with the reason printed once):
  linear      F.linear(x, W): oneDNN brgemm matmul (bf16, weights re-laid per call), MKL (fp32), torch's gemv (fp16)
  graft       cpu_kernels.linear (cpu_kernels.cpp): the weight streamed once, row-invariant; what model.Linear runs on a CPU
  t_matmul    x @ Wt with Wt = W.t().contiguous() stored: the other gemv orientation
  onednn      torch.ops.mkldnn._linear_pointwise on weights reordered once by
              torch.ops.mkldnn._reorder_linear_weight: what inductor's freezing pass emits for bf16/fp16
  mkl_packed  torch.ops.mkl._mkl_linear on torch.ops.mkl._mkl_reorder_linear_weight: inductor's fp32 freezing path
  fp16_store  fp16 weights and activations through F.linear (torch's fp16 gemv at M = 1), cast back
  --compiled adds, compiled once per (shape, M), the pool in one graph:
  ind_gemv    inductor on (x.float() * W.float()).sum(-1): a generated C++ reduction, weights as inputs
              (an earlier candidate for the compiled one-row path)

--step times the whole model instead (SmolLM2-135M-Instruct's GGUF, or --ckpt), one token and a
9-row pass at a context of 200, on torch's kernels and on cpu_kernels.py's, plain and exact, eager and
compiled (inductor, as the engine compiles its steps), interleaved: the one-token step's weight bytes
per second and the 9-row pass's cost in one-token passes. --freezing adds
inductor's own CPU linear paths over F.linear: freezing=True (weights prepacked for oneDNN at compile
time, what inductor does for a frozen CPU graph) and, with it, max-autotune with the CPP GEMM templates.
"""
import argparse
import statistics
import sys
import time

from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cpu_kernels  # noqa: E402
import model as M  # noqa: E402

# SmolLM2-135M: dim 576, 9 heads and 3 KV heads of 64, MLP 1536, vocabulary 49152 (tied). (N, K): out, in.
SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
          "down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}


def machine_bandwidth(mb: int = 512) -> dict:
    """One core's read bandwidth (a float32 sum over `mb` MB) and copy bandwidth (bytes read per second
    of a copy of that tensor; a copy also writes as many). Medians of 7."""
    a = torch.ones(mb * 2**20 // 4)
    b = torch.empty_like(a)
    reads, copies = [], []
    for _ in range(7):
        t = time.perf_counter(); a.sum(); reads.append(time.perf_counter() - t)
        t = time.perf_counter(); b.copy_(a); copies.append(time.perf_counter() - t)
    return {"read_gbs": a.nbytes / statistics.median(reads) / 1e9, "copy_gbs": a.nbytes / statistics.median(copies) / 1e9}


def candidates(ws, dtype, compiled: bool, skipped: dict):
    """name -> (callable(x) doing one sweep over the pool, compile seconds)."""
    out = {"linear": (lambda x: [F.linear(x, w) for w in ws], 0.0)}
    if cpu_kernels.ready():
        out["graft"] = (lambda x: [cpu_kernels.linear(x, w) for w in ws], 0.0)
    wts = [w.t().contiguous() for w in ws]
    out["t_matmul"] = (lambda x: [x @ w for w in wts], 0.0)
    if dtype in (torch.bfloat16, torch.float16):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
        out["onednn"] = (lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed], 0.0)
    else:
        skipped["onednn"] = "fp32: inductor's freezing packs fp32 for MKL, not oneDNN (mkl_packed)"
    if dtype == torch.float32 and torch._C.has_mkl:
        mk = [(torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w) for w in ws]
        out["mkl_packed"] = (lambda x: [torch.ops.mkl._mkl_linear(x, p, w, None, x.shape[0]) for p, w in mk], 0.0)
    if dtype != torch.float16:
        hs = [w.half() for w in ws]
        out["fp16_store"] = (lambda x: [F.linear(x.half(), h).to(dtype) for h in hs], 0.0)
    if not compiled:
        return out
    import torch._inductor.config as icfg
    icfg.cpp.threads = torch.get_num_threads()

    def gemv(x, ws):            # the whole pool in one graph: one call's overhead, as in a compiled step
        return [(x.float()[:, None, :] * w.float()[None]).sum(-1).to(x.dtype) for w in ws]
    t = time.perf_counter()
    cg = torch.compile(gemv, dynamic=False)
    cg(torch.zeros(1, ws[0].shape[1], dtype=dtype), ws)
    out["ind_gemv"] = (lambda x: cg(x, ws), time.perf_counter() - t)
    return out


def step_paths(a):
    """The whole model's one-token step and 9-row pass with each path (see --step)."""
    from checkpoint import load_model
    cpu_kernels.ready()
    # name: (cpu_kernels.py's kernels, exact mode, inductor options or None for eager)
    paths = {"eager torch": (False, False, None), "eager torch exact (padded)": (False, True, None)}
    if cpu_kernels.ON:
        paths.update({"eager kernels": (True, False, None), "eager kernels exact (default)": (True, True, None)})
    paths["compiled torch"] = (False, False, {})
    if cpu_kernels.ON:
        paths["compiled kernels"] = (True, False, {})
    if a.freezing:
        paths["compiled torch freezing"] = (False, False, {"freezing": True})
        paths["compiled torch freezing max-autotune CPP"] = (
            False, False, {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"})
    import torch._inductor.config as icfg
    icfg.cpp.threads = torch.get_num_threads()
    for dname in a.dtypes.split(","):
        dtype = getattr(torch, dname)
        model = load_model(a.ckpt, dtype=dtype, max_seq_len=512)
        model.setup_caches(512, 1, slack=64)
        wb = sum(t.nbytes for n, t in model.named_parameters() if n != "embed_tokens.weight" or model.args.tie_word_embeddings)
        L = 200

        def inputs(T):
            pos = torch.arange(L, L + T)[None]
            return torch.zeros(1, T, dtype=torch.long), pos, pos.clone(), torch.ones(1, T, L + T, dtype=torch.bool)
        runs, compile_s = {}, {}
        for name, (on, exact, opts) in paths.items():
            ns = {"model": model}
            exec(f"def fwd_{len(runs)}(*a):\n    return model(*a)\n", ns)       # a code object (dynamo cache) each
            f = ns[f"fwd_{len(runs)}"]
            if opts is not None:
                f = torch.compile(f, dynamic=False, options=opts)

            def run(args, f=f, on=on, exact=exact):
                cpu_kernels.ON = on
                M.set_exact(model, exact)
                with torch.no_grad():
                    return f(*args)
            t = time.perf_counter()
            run(inputs(1)), run(inputs(9))
            compile_s[name], runs[name] = time.perf_counter() - t, run
        ts = {(k, T): [] for k in runs for T in (1, 9)}
        for _ in range(a.reps):
            for k, run in runs.items():
                for T in (1, 9):
                    args = inputs(T)
                    run(args)
                    t = time.perf_counter(); run(args); ts[k, T].append(time.perf_counter() - t)
        bw = machine_bandwidth()
        print(f"{dname}: {wb / 1e6:.0f} MB of weights a token; read {bw['read_gbs']:.1f} GB/s, copy {bw['copy_gbs']:.1f} GB/s")
        print("| path | one token, ms | tokens/s | weight GB/s | % of read | 9 rows, ms | 9 rows / 1 | first calls, s |")
        print("|---|---|---|---|---|---|---|---|")
        for k in runs:
            t1, t9 = statistics.median(ts[k, 1]), statistics.median(ts[k, 9])
            print(f"| {dname} {k} | {t1 * 1e3:.2f} | {1 / t1:.1f} | {wb / t1 / 1e9:.1f} | {100 * wb / t1 / 1e9 / bw['read_gbs']:.0f}% "
                  f"| {t9 * 1e3:.2f} | {t9 / t1:.2f} | {compile_s[k]:.0f} |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--ms", default="1,2,9,17", help="rows per call: 1 = one-token step, 9 = a 9-node tree")
    p.add_argument("--shapes", default=",".join(k.split()[0] for k in SHAPES), help="by first word: q/o,k/v,gate/up,down,lm_head")
    p.add_argument("--pool-mb", type=int, default=128, help="weights per pool, MB (the L3 here is 32)")
    p.add_argument("--reps", type=int, default=9, help="timed sweeps per candidate, interleaved")
    p.add_argument("--compiled", action="store_true", help="also the inductor candidates (compiles a few minutes)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--step", action="store_true", help="the whole model's step with each path (see above)")
    p.add_argument("--freezing", action="store_true", help="--step: also inductor with freezing=True")
    p.add_argument("--ckpt", default=str(Path(__file__).resolve().parents[2] / "shared/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.step:
        return step_paths(a)
    torch.manual_seed(0)
    bw = machine_bandwidth()
    print(f"torch {torch.__version__}, {a.threads} thread(s); machine: read {bw['read_gbs']:.1f} GB/s "
          f"(float32 sum of 512 MB), copy {bw['copy_gbs']:.1f} GB/s (bytes read per second)")
    print("| dtype | shape (N x K) | M | " + "candidate: us per linear, weight GB/s ... |")
    wanted = a.shapes.split(",")
    for dname in a.dtypes.split(","):
        dtype = getattr(torch, dname)
        skipped = {}
        for label, (N, K) in SHAPES.items():
            if label.split()[0] not in wanted:
                continue
            nbytes = N * K * dtype.itemsize
            n = max(2, -(-a.pool_mb * 2**20 // nbytes))
            ws = [(torch.randn(N, K) / K**0.5).to(dtype) for _ in range(n)]
            for rows in [int(m) for m in a.ms.split(",")]:
                torch._dynamo.reset()
                cands = candidates(ws, dtype, a.compiled, skipped)
                x = torch.randn(rows, K).to(dtype)
                ref = F.linear(x.float(), ws[0].float())
                for name, (f, _) in cands.items():      # warm up, and check each computes the same linear
                    y = f(x)[0].float()
                    err = (y - ref).abs().max().item() / ref.abs().max().item()
                    if err > 2e-2:
                        sys.exit(f"{name} {label} M={rows}: relative error {err:.3g}: not the same linear")
                times = {k: [] for k in cands}
                with torch.no_grad():
                    for _ in range(a.reps):
                        for name, (f, _) in cands.items():
                            t = time.perf_counter(); f(x); times[name].append((time.perf_counter() - t) / n)
                cells = []
                for name, ts in times.items():
                    s = statistics.median(ts)
                    comp = cands[name][1]
                    cells.append(f"{name} {s * 1e6:.0f} us {nbytes / s / 1e9:.1f}" + (f" (compile {comp:.0f}s)" if comp else ""))
                print(f"| {dname} | {label} | {rows} | " + " | ".join(cells) + " |", flush=True)
        for k, why in skipped.items():
            print(f"  {dname}: {k} skipped: {why}")


if __name__ == "__main__":
    main()
