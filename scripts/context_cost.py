"""What a target pass costs as the context grows: the one-token step and tree passes, and the
attention kernel's share of each.

    python scripts/context_cost.py --ckpt TARGET [--contexts 256,1024,2048,4096,8192] [--sizes 1,9,17] [--json-out F]

For each context length: the pass cost of each tree size N (calibrate.pass_cost: interleaved, the fastest
of --repeats samples, a monotone fit; N=1 is the decode step, larger N the verifier), and one profiled
pass per N that names the attention kernel scaled_dot_product_attention dispatched to (the profiler's
aten op) and the milliseconds it took, against the matrix products (aten::mm, the weights' read).
On a CPU the one-token pass is bound by reading the weights and the KV cache; a tree of N nodes reads
the same bytes but multiplies N*G query rows against every cached key (G query heads share a KV
head), so its attention grows with N x context in flops, which is what this measures.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cli as CLI  # noqa: E402
import calibrate as CAL  # noqa: E402
import engine as E  # noqa: E402
from graft import Config  # noqa: E402


@torch.no_grad()
def profiled_pass(eng, context: int, n: int, repeats: int = 3) -> dict:
    """One pass of n nodes after `context` random committed tokens, profiled: {"attention_kernel",
    "attention_ms", "mm_ms", "total_ms"} per pass (CPU self time, averaged over `repeats` passes)."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, eng.model.args.vocab_size, (context + n,), generator=g).to(eng.device)
    ar = eng.make("ar")
    eng.admit(0, E.Request(ids[:context].tolist()), ar)         # slot 0 holds the context
    tree, P = CAL.cost_tree(ids[context:context + n], eng.B)

    def one():                   # the pass pass_cost times, undone after it
        eng.steps.mark()
        if n == 1:
            eng.steps.decode(eng.root, eng.L, eng.active, eng.cols(1), eng.smp, eng.mode)
        else:
            eng.steps.verify(tree, eng.L, eng.active, eng.cols(n), eng.smp, eng.mode, P, False, eng.root)
        eng.L.fill_(context)
    one()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            one()
    eng.free(0, ar)
    ev = prof.key_averages()
    attn = [e for e in ev if "attention" in e.key and e.key.startswith("aten::_scaled_dot_product")]
    ms = lambda es: sum(e.self_cpu_time_total for e in es) / 1000 / repeats
    return {"attention_kernel": sorted({e.key for e in attn}), "attention_ms": round(ms(attn), 2),
            "mm_ms": round(ms([e for e in ev if e.key == "aten::mm"]), 2), "total_ms": round(ms(ev), 2)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--contexts", default="256,1024,2048,4096,8192")
    p.add_argument("--sizes", default="1,9,17")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    contexts, sizes = CLI.numbers("--contexts", a.contexts), CLI.numbers("--sizes", a.sizes)
    if 1 not in sizes:
        sizes = [1] + sizes
    path = CLI.resolve_checkpoint(a.ckpt)
    room = min(max(contexts) + max(sizes) + 16, CLI.tok_context(path))       # (a context past it is cut to it)
    # caches with room for the largest tree (a recycle tree of that many nodes: no head needed)
    eng = CLI.build_engine(path, None, "cpu", a.dtype, max_seq_len=room,
                           methods=[("ar", Config()), ("recycle", Config(recycle_size=max(max(sizes) - 1, 1)))])
    out = {"ckpt": a.ckpt, "dtype": a.dtype, "threads": torch.get_num_threads(), "contexts": {}}
    for c in contexts:
        used, ms = CAL.pass_cost(eng, sizes, context=c, repeats=a.repeats)
        prof = {n: profiled_pass(eng, used, n) for n in sizes}
        out["contexts"][used] = {"pass_ms": ms, "profile": prof}
        print(f"context {used:>6}: " + ", ".join(
            f"N={n}: {ms[n]:.1f} ms ({ms[n] / ms[1]:.2f}x; attention {prof[n]['attention_ms']:.1f}, mm {prof[n]['mm_ms']:.1f})"
            for n in sizes) + f"  kernel {','.join(prof[sizes[-1]]['attention_kernel'])}", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    CLI.run(main)
