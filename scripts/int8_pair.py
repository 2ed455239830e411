"""Plain decoding with float weights beside the same target with int8 weights, interleaved prompt by prompt.

    OMP_NUM_THREADS=1 python scripts/int8_pair.py --limit 8 --max-new-tokens 64

Two bench.py runs, one with --quantization int8, see the machine at two different moments; on a shared
machine a neighbour's load moves both by more than the difference being measured. Here both engines live
in one process and take turns on every prompt (ar, greedy, exact mode), so each prompt's pair of rates
meets the same neighbours. Prints each prompt's decode tokens/s (after the first token) and TTFT, and the
medians' ratios. Speed only: bench.py --quantization int8 reports quality.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import cli as CLI  # noqa: E402
import data as DATA  # noqa: E402
import engine as E  # noqa: E402
from verify import Sampling  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default=None, help="target (default: the demo SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dataset", default="mt_bench")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ckpt = a.ckpt or DATA.demo_model()
    engs = {q: CLI.build_engine(ckpt, None, "cpu", a.dtype, 1024, exact=True, quantization=q) for q in ("none", "int8")}
    e0 = engs["none"]
    prompts = [e0.tokenizer.apply_chat(t) for t in DATA.load_dataset(a.dataset, a.limit, e0)]
    decode, ttft = {q: [] for q in engs}, {q: [] for q in engs}
    for p_ in prompts:
        for q, e in engs.items():
            E.generate(e, e.make("ar"), p_[:8], 4, Sampling())          # first-call costs off the clock
            t0 = time.perf_counter()
            r = E.generate(e, e.make("ar"), p_, a.max_new_tokens, Sampling(), e.tokenizer.eos_ids)
            took, first = time.perf_counter() - t0, r.times.get("prefill", 0.0)
            decode[q].append((len(r.tokens) - 1) / max(took - first, 1e-9))
            ttft[q].append(1000 * first)
        print(f"prompt {len(decode['none'])}: decode tok/s {decode['none'][-1]:.1f} -> {decode['int8'][-1]:.1f}, "
              f"TTFT ms {ttft['none'][-1]:.0f} -> {ttft['int8'][-1]:.0f}", flush=True)
    med = {k: {q: statistics.median(v[q]) for q in engs} for k, v in (("decode", decode), ("ttft", ttft))}
    print(f"{len(prompts)} prompts, {a.dtype} against int8: median decode tok/s {med['decode']['none']:.1f} -> "
          f"{med['decode']['int8']:.1f} ({med['decode']['int8'] / med['decode']['none']:.2f}x); median TTFT ms "
          f"{med['ttft']['none']:.0f} -> {med['ttft']['int8']:.0f}")


if __name__ == "__main__":
    main()
