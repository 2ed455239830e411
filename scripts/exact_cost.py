"""What exact mode and graft's CPU kernels cost a target pass: CPU ms of one forward over N tree nodes
after a context of L tokens, four variants interleaved in one process (one thread; CPU time, so a
shared machine's load inflates all alike): torch's kernels plain and exact (padded rows, blocked
attention), cpu_kernels.py plain (its linear, SDPA) and exact (its linear and attention).

    python scripts/exact_cost.py [--ckpt ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--dtype bfloat16]
                                 [--context 256] [--nodes 1,9,17,61] [--repeats 5]

Prints per N the median ms of each variant over --repeats rounds, and each over `torch plain`.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cpu_kernels  # noqa: E402
import model as M  # noqa: E402
from checkpoint import load_model  # noqa: E402


@torch.no_grad()
def pass_ms(m, L: int, N: int, variant: tuple) -> float:
    """CPU ms of one verify-shaped pass: a tree of N nodes (a root and N - 1 children, positions L and
    L + 1) at cache rows L..L+N-1, after L committed rows."""
    cpu_kernels.ON, exact = variant
    M.set_exact(m, exact)
    tree = torch.eye(N, dtype=torch.bool)
    tree[:, 0] = True
    rows = L + torch.arange(N)[None]
    pos = L + tree.sum(-1)[None] - 1
    mask = M.attention_mask(tree, torch.tensor([L]), torch.arange(L + N))
    tokens = torch.randint(0, m.args.vocab_size, (1, N))
    t = time.process_time()
    m(tokens, pos, rows, mask)
    return (time.process_time() - t) * 1000


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--nodes", default="1,9,17,61")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    m = load_model(a.ckpt, dtype=getattr(torch, a.dtype), max_seq_len=a.context + 64)
    m.setup_caches(a.context + 64, 1, 64)
    variants = {"torch plain": (False, False), "torch exact": (False, True)}
    if cpu_kernels.ready():
        variants.update({"kernels plain": (True, False), "kernels exact": (True, True)})
    for N in map(int, a.nodes.split(",")):
        for v in variants.values():                                            # first calls aside
            pass_ms(m, a.context, N, v)
        got = {k: [] for k in variants}
        for _ in range(a.repeats):
            for k, v in variants.items():
                got[k].append(pass_ms(m, a.context, N, v))
        ms = {k: statistics.median(x) for k, x in got.items()}
        base = ms["torch plain"]
        print(f"N={N} after {a.context} tokens: " + ", ".join(f"{k} {t:.1f} ms ({t / base:.2f})" for k, t in ms.items()),
              flush=True)


if __name__ == "__main__":
    main()
