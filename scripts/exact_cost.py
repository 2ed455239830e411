"""What exact mode costs a target pass: CPU ms of one forward over N tree nodes after a context of L
tokens, plain and exact interleaved in one process (one thread; CPU time, so a shared machine's load
inflates both alike).

    python scripts/exact_cost.py [--ckpt ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--dtype bfloat16]
                                 [--context 256] [--nodes 1,9,17,61] [--repeats 5]

Prints per N: plain ms, exact ms, and exact / plain (medians over --repeats rounds of both).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import model as M  # noqa: E402
from checkpoint import load_model  # noqa: E402


@torch.no_grad()
def pass_ms(m, L: int, N: int, exact: bool) -> float:
    """CPU ms of one verify-shaped pass: a tree of N nodes (a root and N - 1 children, positions L and
    L + 1) at cache rows L..L+N-1, after L committed rows."""
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
    for N in map(int, a.nodes.split(",")):
        pass_ms(m, a.context, N, False), pass_ms(m, a.context, N, True)        # first calls aside
        got = {False: [], True: []}
        for _ in range(a.repeats):
            for exact in (False, True):
                got[exact].append(pass_ms(m, a.context, N, exact))
        plain, exact = statistics.median(got[False]), statistics.median(got[True])
        print(f"N={N} after {a.context} tokens: plain {plain:.1f} ms, exact {exact:.1f} ms, exact/plain {exact / plain:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
