"""Kernel-level facts behind exact decoding (issue 29): for which M is a row of x @ W.T (F.linear)
bit-identical to the same row computed among other rows, per linear shape of the supported models,
dtype and thread count; and the same for the matmuls attention is made of.

    python scripts/exactness.py [--threads 1,2] [--dtypes float32,bfloat16,float16] [--mmax 61]

Prints, per (shape, dtype, threads): the values of M in 1..mmax (and a few larger: prefill chunks,
B > 1 trees) at which row 0 and row M-1 of a batch differ from the same rows computed alone,
and the same padded as model.pad_rows pads them (model.Linear in exact mode). `all same` is what the exact path needs.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import model as M  # noqa: E402

# (K, N) of every linear: SmolLM2-135M (and its EAGLE-3 head), stories260K, the stdlib Qwen3 pair,
# the tests' tiny Llama/Qwen3 (hidden 64, 4 heads, head_dim 16 or 32) and Qwen3-MoE (router, experts)
SHAPES = {
    "smollm2": [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152), (1728, 576), (1152, 576), (576, 8192)],
    "stories260K": [(64, 64), (64, 32), (64, 172), (172, 64), (64, 512)],
    "stdlib-qwen3": [(192, 256), (192, 128), (256, 192), (192, 512), (512, 192), (192, 4096), (576, 192)],
    "tiny": [(64, 64), (64, 32), (64, 128), (128, 64), (64, 300), (64, 128), (128, 64)],
    "tiny-moe": [(64, 8), (64, 32), (32, 64), (64, 96), (96, 64)],
}
EXTRA_M = (64, 96, 128, 183, 256, 488)


def linear_rows(dtype, threads: int, mmax: int, exact: bool) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    bad = {}
    for name, shapes in SHAPES.items():
        for K, N in shapes:
            W = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
            x = torch.randn(max(EXTRA_M), K, generator=g).to(dtype)
            f = (lambda a, w: F.linear(M.pad_rows(a), w)[:a.shape[0]]) if exact else F.linear
            ref = torch.cat([f(x[i:i + 1], W) for i in range(x.shape[0])])          # each row alone
            diff = [m for m in [*range(1, mmax + 1), *EXTRA_M] if not torch.equal(f(x[:m], W), ref[:m])]
            bad[(name, K, N)] = diff
    return bad


def attention_rows(dtype, threads: int) -> dict:
    """One query alone (a decode step) against the same query among a 61-node chain read in place (a
    prefill chunk) and gathered as a tree's tail (verify), at every depth: the depths that differ, for
    torch's SDPA (folded as grouped_attention) and for model.exact_attention."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    out = {}
    H, Hkv, D, T = 9, 3, 64, 61
    for L in (0, 5, 63, 64, 200, 1000):
        k = torch.randn(1, Hkv, L + T, D, generator=g).to(dtype)
        v = torch.randn(1, Hkv, L + T, D, generator=g).to(dtype)
        q = torch.randn(1, H, T, D, generator=g).to(dtype)
        mask = torch.cat([torch.ones(T, L, dtype=torch.bool), torch.ones(T, T, dtype=torch.bool).tril()], 1)
        rows = torch.arange(L, L + T)[None]
        alone = [(q[:, :, t:t + 1], k[:, :, :L + t + 1], v[:, :, :L + t + 1], torch.ones(1, 1, 1, L + t + 1, dtype=torch.bool),
                  rows[:, t:t + 1]) for t in range(T)]
        sdpa = M.grouped_attention(q, k, v, mask)
        sdpa1 = torch.cat([M.grouped_attention(*a[:4]) for a in alone], 2)
        ex1 = torch.cat([M.exact_attention(*a) for a in alone], 2)
        chain = M.exact_attention(q, k, v, mask[None, None], rows)
        tree = M.exact_attention(q, k, v, mask[None, None], rows, rows.clone())
        out[L] = [[t for t in range(T) if not torch.equal(x[:, :, t], one[:, :, t])]
                  for x, one in ((sdpa, sdpa1), (chain, ex1), (tree, ex1))]
        out[L].append((ex1.float() - sdpa1.float()).abs().max().item())
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--mmax", type=int, default=61)
    p.add_argument("--no-attention", action="store_true")
    a = p.parse_args()
    for dt in a.dtypes.split(","):
        dtype = getattr(torch, dt)
        for th in map(int, a.threads.split(",")):
            for exact in (False, True):
                bad = linear_rows(dtype, th, a.mmax, exact)
                worst = {k: v for k, v in bad.items() if v}
                tag = "padded (exact)" if exact else "F.linear"
                print(f"{tag} {dt} threads={th}: " + ("all same" if not worst else
                      "; ".join(f"{n} {K}x{N}: M in {v[:12]}{'...' if len(v) > 12 else ''}" for (n, K, N), v in worst.items())),
                      flush=True)
            if not a.no_attention:
                for L, (sdpa, chain, tree, err) in attention_rows(dtype, th).items():
                    print(f"attention {dt} threads={th} L={L}: SDPA among 61 vs alone differs at {len(sdpa)}/61 depths; "
                          f"exact_attention differs at {len(chain)} (in place), {len(tree)} (tree tail); "
                          f"exact vs SDPA max |diff| {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
