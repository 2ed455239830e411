"""How far a prompt-lookup chain gets, by the length n of the n-gram that matched: the numbers behind
pld's pacing by kind (graft.PromptLookup.shadow, engine.Pacer.kinds; docs/graft.md section 12).

    python scripts/pld_kinds.py [--ckpt CKPT] [--datasets mt_bench,humaneval] [--limit 24]
                                [--max-new-tokens 128] [--pld-tokens 5] [--dtype bfloat16]

Greedy plain decoding writes each prompt's answer (chat template on); a chain depends on the committed
tokens alone, so the chain graft.lookup proposes at every position is scored against the answer as the
pacer scores it: its matching prefix + 1 (what a drafting round would commit), once it mismatches or is
all decoded (a chain the answer ends before settling is left out, as in the engine). Prints per dataset
and n (0: no match) the positions and the mean tokens a drafting round would commit. No timing: the
numbers are properties of the text and the model, the same on any machine.
"""
import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import api  # noqa: E402
from cli import run  # noqa: E402
import data  # noqa: E402
from graft import lookup, settle  # noqa: E402
from model import GraftError  # noqa: E402


def scores(ids: list, answer: list, ngram: int, n_tokens: int) -> dict:
    """{n: [tokens a drafting round at each settled position would commit]} over one answer."""
    out = defaultdict(list)
    for t in range(len(answer)):                   # the root: answer[t]; the chain guesses answer[t + 1:]
        n, chain = lookup(ids + answer[:t + 1], ngram, n_tokens)
        got = settle(answer[t + 1:t + 1 + len(chain)], chain) if chain else 1
        if got:
            out[n].append(got)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default=None, help="a target (default: the shipped SmolLM2-135M-Instruct)")
    p.add_argument("--datasets", default="mt_bench,humaneval")
    p.add_argument("--limit", type=int, default=24, help="prompts a dataset")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--pld-tokens", type=int, default=5, help="the chain's length (as generate.py's)")
    p.add_argument("--ngram", type=int, default=3, help="the longest n-gram matched")
    p.add_argument("--dtype", default=None, help="default: the demo's for this CPU")
    a = p.parse_args(argv)
    if min(a.limit, a.max_new_tokens, a.pld_tokens, a.ngram) < 1:
        raise GraftError("--limit, --max-new-tokens, --pld-tokens and --ngram must be >= 1")
    llm = api.load(a.ckpt, method="ar", warmup=0, **({"dtype": a.dtype} if a.dtype else {}))
    for name in a.datasets.split(","):
        got = defaultdict(list)
        for text in data.load_dataset(name, a.limit, llm.engine):
            ids = llm.encode(text, chat=True)
            answer = llm.generate(ids, max_new_tokens=a.max_new_tokens).tokens
            for n, xs in scores(ids, answer, a.ngram, a.pld_tokens).items():
                got[n] += xs
        total = sum(len(xs) for xs in got.values())
        print(f"{name}: {total} positions, {a.limit} prompts")
        for n in sorted(got):
            xs = got[n]
            print(f"  n = {n}: {len(xs):5d} positions ({100 * len(xs) / total:4.1f}%), a drafting round would "
                  f"commit {sum(xs) / len(xs):.2f} tokens" + (" (no chain: drafting cannot gain)" if n == 0 else ""))


if __name__ == "__main__":
    run(main)
