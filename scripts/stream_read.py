"""How fast graft's linear reads a weight that streams from memory: for each shape, enough copies of W
to exceed the caches (200 MB), one pass over all of them per timing, best of --repeats; prints GB/s of
weights read per shape and per number of rows M (and M rows' time over one row's).

    OMP_NUM_THREADS=1 python scripts/stream_read.py [--ms 1,9,17] [--dtype bfloat16] [--repeats 5]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cpu_kernels  # noqa: E402

SHAPES = ((49152, 576), (1536, 576), (576, 1536), (576, 576), (192, 576))     # SmolLM2-135M's linears (N, K)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="1,9,17")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if not cpu_kernels.ready():
        raise SystemExit("graft's CPU kernels did not build here")
    dt = getattr(torch, a.dtype)
    for N, K in SHAPES:
        ws = [torch.randn(N, K).to(dt) for _ in range(max(1, 200_000_000 // (N * K * dt.itemsize)))]
        one = None
        for M in map(int, a.ms.split(",")):
            x = torch.randn(M, K).to(dt)
            best = float("inf")
            for _ in range(a.repeats):
                t = time.perf_counter()
                for w in ws:
                    cpu_kernels.linear(x, w)
                best = min(best, (time.perf_counter() - t) / len(ws))
            one = one or best
            print(f"{N:6d} x {K:4d}  M={M:3d}: {best * 1e6:8.1f} us  {N * K * dt.itemsize / best / 1e9:5.1f} GB/s"
                  f"  ({best / one:.2f}x one row)")


if __name__ == "__main__":
    main()
