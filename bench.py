"""Benchmark every method on the standard prompt sets: speedup, MAT and a losslessness check.

    python bench.py --ckpt TARGET [--draft HEAD] --methods ar,eagle3,prune,graft --datasets mt_bench,humaneval \
        --limit 40 --max-new-tokens 128 --json-out FILE

One engine serves every prompt, like a server: it is warmed up once (continuation matrix, hit rates,
thresholds) and each method keeps its own state across prompts and datasets. `ar` always runs: it is
the baseline for the speedup (Spec-Bench's definition: mean per-prompt tokens/s over ar's) and the
reference every other method must reproduce token for token. Any mismatch is printed and the exit
code is 1. Stdout: a markdown table, then the whole report as one line of JSON.
"""
import argparse
import copy
import dataclasses
import datetime
import gzip
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

import generate as G
from model import GraftError
import train
from train import STORIES, ensure_stories_head, sample_openings
from verify import Sampling

# ----------------------------------------------------------------------------- datasets

# name -> (file under shared/data, field holding the prompt); "turns" = first turn (MT-bench style)
FILES = {
    "spec_bench": ("spec_bench/question.jsonl", "turns"),
    "mt_bench": ("mt_bench/question.jsonl", "turns"),
    "humaneval": ("humaneval/HumanEval.jsonl.gz", "prompt"),   # raw code, no instruction
    "eagle_humaneval": ("eagle_humaneval/question.jsonl", "turns"),
    "gsm8k": ("gsm8k/test.jsonl", "question"),
    "eagle_gsm8k": ("eagle_gsm8k/question.jsonl", "turns"),
    "alpaca": ("eagle_alpaca/question.jsonl", "turns"),
    "cnndm": ("eagle_sum/question.jsonl", "turns"),
    "eagle_qa": ("eagle_qa/question.jsonl", "turns"),
    "sharegpt": ("sharegpt_sample/sharegpt_sample.json", "conversations"),
}
SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                         "translation", "summarization", "qa", "math_reasoning", "rag")
GENERATED = ("stories", "stdlib")      # made at run time, not read from shared/data
GENERATED_DEFAULT = 80                 # their size without --limit (the EAGLE subsets' size)

# stdlib hook: an explicit list of held-out source files (or GRAFT_STDLIB_FILES, a file with one path per
# line) takes precedence; otherwise train.py's held-out split of the stdlib (the files the demo code
# target never trains on), so that no benchmarked snippet was seen in training.
STDLIB_FILES: list | None = None


def data_dir() -> Path:
    """../shared/data next to the repository, or $GRAFT_SHARED/data."""
    shared = os.environ.get("GRAFT_SHARED")
    return (Path(shared) if shared else Path(__file__).resolve().parent.parent / "shared") / "data"


def check_dataset(name: str):
    """Fail fast (before loading any model) on an unknown name or a missing file."""
    if name in GENERATED or os.path.isfile(name):
        return
    base, _, cat = name.partition(":")
    if base == "spec_bench" and cat and cat not in SPEC_BENCH_CATEGORIES:
        raise GraftError(f"unknown Spec-Bench category {cat!r}: one of {', '.join(SPEC_BENCH_CATEGORIES)}")
    if base not in FILES or (cat and base != "spec_bench"):
        raise GraftError(f"unknown dataset {name!r}: use {', '.join(list(FILES) + list(GENERATED))}, "
                         f"spec_bench:<category> or a path to a .jsonl file")
    if not (data_dir() / FILES[base][0]).is_file():
        raise GraftError(f"dataset {name}: {data_dir() / FILES[base][0]} not found (set GRAFT_SHARED)")


def read_records(path: Path) -> list:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return [json.loads(l) for l in fh if l.strip()]


def stdlib_prompts(limit: int) -> list:
    """40-line Python snippets from held-out files: STDLIB_FILES / $GRAFT_STDLIB_FILES when given,
    else train.py's held-out split of the stdlib (files the demo target never trained on)."""
    listed = STDLIB_FILES
    if listed is None and os.environ.get("GRAFT_STDLIB_FILES"):
        listed = [l.strip() for l in open(os.environ["GRAFT_STDLIB_FILES"]) if l.strip()]
    if listed is None:
        return train.stdlib_snippets(heldout=True, n=limit, lines=40)
    snippets = []
    for f in listed:        # the beginning of each file, evenly spaced picks: deterministic
        lines = Path(f).read_text(errors="replace").splitlines()[:40]
        if sum(1 for l in lines if l.strip()) >= 20:        # skip stubs: too little to continue
            snippets.append("\n".join(lines) + "\n")
    n = min(limit, len(snippets))
    return [snippets[i * len(snippets) // n] for i in range(n)]


def load_dataset(name: str, limit: int | None, eng) -> list:
    """The prompt texts of a dataset, the first `limit` of them."""
    if name == "stories":       # held out: the head's training openings are sampled with seed 0
        return sample_openings(eng.model, eng.tokenizer, limit or GENERATED_DEFAULT, seed=1)
    if name == "stdlib":
        return stdlib_prompts(limit or GENERATED_DEFAULT)
    if os.path.isfile(name):
        return G.read_prompts(name)[:limit]
    base, _, cat = name.partition(":")
    path, field = FILES[base]
    recs = [r for r in read_records(data_dir() / path) if not cat or r.get("category") == cat]
    if field == "turns":
        texts = [r["turns"][0] for r in recs]
    elif field == "conversations":
        texts = [next(t["value"] for t in r["conversations"] if t["from"] == "human") for r in recs]
    else:
        texts = [r[field] for r in recs]
    return texts[:limit]


# ----------------------------------------------------------------------------- measuring

@dataclasses.dataclass
class Row:
    """Totals for one (dataset, method, budget) over its prompts."""
    dataset: str
    method: str
    budget: int | None
    skipped: int = 0
    tps: list = dataclasses.field(default_factory=list)    # per-prompt tokens/s
    tot: dict = dataclasses.field(default_factory=dict)    # summed Result counters
    stages: dict = dataclasses.field(default_factory=dict)
    mismatches: int = 0

    def add(self, res: G.Result):
        self.tps.append(res.tokens_per_s)
        for k in ("rounds", "committed", "draft_forwards", "verified", "from_retrieval", "accepted", "seconds"):
            self.tot[k] = self.tot.get(k, 0) + getattr(res, k)
        self.tot["tokens"] = self.tot.get("tokens", 0) + len(res.tokens)
        for s, n in res.stages.items():
            key = "full" if s is None else str(s)      # full = not pruned: drafted to full depth
            self.stages[key] = self.stages.get(key, 0) + n

    def report(self, ar_tps: float) -> dict:
        t, r = self.tot, max(self.tot.get("rounds", 0), 1)
        mean = sum(self.tps) / len(self.tps) if self.tps else None     # None: every prompt was skipped
        return {"dataset": self.dataset, "method": self.method, "budget": self.budget,
                "prompts": len(self.tps), "skipped": self.skipped,
                "mat": round(t["committed"] / r, 4) if self.tps else None,
                "tokens_per_s": round(mean, 2) if mean else None,
                "speedup": round(mean / ar_tps, 4) if mean and ar_tps else None,
                "draft_forwards_per_round": round(t.get("draft_forwards", 0) / r, 4),
                "verified_per_round": round(t.get("verified", 0) / r, 4),
                "retrieval_share": round(t.get("from_retrieval", 0) / max(t.get("accepted", 0), 1), 4),
                "stages": dict(sorted(self.stages.items())) if self.method in G.NEEDS_HEAD else {},
                "tokens": t.get("tokens", 0), "seconds": round(t.get("seconds", 0.0), 3),
                "lossless": self.mismatches == 0}


@torch.no_grad()
def pass_cost(model, sizes: list, context: int = 256, repeats: int = 20) -> tuple:
    """Milliseconds per target pass over a tree of N nodes after `context` committed tokens: the price
    of verifying a budget. On a GPU it barely grows with N; on a CPU it does, which is what sets the
    best budget there. (A chain; the cost does not depend on the tree's shape.) Returns (context used,
    {N: ms}): the context shrinks when max_seq_len leaves no room for it."""
    dev = model.embed_tokens.weight.device
    context = max(1, min(context, model.max_seq_len - max(sizes)))
    ids = torch.randint(0, model.args.vocab_size, (context + max(sizes),), generator=torch.Generator().manual_seed(0)).to(dev)
    pos = torch.arange(context, device=dev)
    model(ids[None, :context], pos, pos, torch.ones(context, context, dtype=torch.bool, device=dev).tril_())
    out = {}
    for n in sizes:
        rows = torch.arange(context, context + n, device=dev)
        mask = torch.ones(n, context + n, dtype=torch.bool, device=dev).tril_(context)
        for i in range(repeats + 3):                 # 3 untimed passes first
            if i == 3:
                G.sync(dev)
                t0 = time.perf_counter()
            model(ids[None, context:context + n], rows, rows, mask)
        G.sync(dev)
        out[n] = round((time.perf_counter() - t0) / repeats * 1000, 3)
    return context, out


def first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def bar(done: int, total: int, t0: float, what: str):
    w, el = 30, time.time() - t0
    n = int(w * done / max(total, 1))
    eta = el / max(done, 1) * (total - done)
    sys.stderr.write(f"\r[{'#' * n}{'.' * (w - n)}] {done}/{total} {el:.0f}s<{eta:.0f}s {what:<28.28}")
    sys.stderr.flush()


def table(rows: list, sweep: bool) -> str:
    cols = ["dataset", "method"] + (["budget"] if sweep else []) + [
        "prompts", "skipped", "mat", "tokens_per_s", "speedup", "draft_forwards_per_round", "verified_per_round",
        "retrieval_share", "stages", "lossless"]
    head = ["dataset", "method"] + (["budget"] if sweep else []) + [
        "prompts", "skipped", "MAT", "tok/s", "speedup", "draft fwd/round", "verified/round", "retrieval share",
        "stages", "lossless"]
    fmt = lambda v: ("-" if v is None else f"{v:.2f}" if isinstance(v, float) else
                     " ".join(f"{k}:{n}" for k, n in v.items()) or "-" if isinstance(v, dict) else str(v))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows])


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Benchmark speculative decoding methods (speedup, MAT, lossless).")
    p.add_argument("--ckpt", required=True, help="target: a local HF folder, a .gguf file or a hub id")
    p.add_argument("--draft", default=None, help="EAGLE-3 head (default: known mapping; stories260K: trained)")
    p.add_argument("--methods", default="ar,eagle3,prune,graft")
    p.add_argument("--datasets", default="mt_bench")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each dataset (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json-out", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--budget", type=int, default=None, help="default: 60 on a GPU, generate.CPU_BUDGET on a CPU")
    p.add_argument("--budgets", default=None, help="sweep: run every method at each budget, e.g. 16,32,60")
    p.add_argument("--draft-top-k", type=int, default=10)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--checkpoints", default="0,1,5")
    p.add_argument("--keep", default=None, help="fixed keep sizes (default: 8/24/40 scaled to the budget)")
    p.add_argument("--thresholds", default=None, help="override the calibrated taus")
    p.add_argument("--recycle-size", type=int, default=80, help="nodes of the recycle method's retrieval tree")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="apply the checkpoint's chat template")
    p.add_argument("--warmup", type=int, default=5, help="warm-up generations (0 = none)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the warm-up cache")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    t_start = time.time()
    if a.threads:
        torch.set_num_threads(a.threads)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    for m in methods:
        if m not in G.METHODS:
            raise GraftError(f"unknown method {m!r}: choose from {', '.join(G.METHODS)}")
    methods = ["ar"] + [m for m in dict.fromkeys(methods) if m != "ar"]   # ar first, always: the baseline
    datasets = [d.strip() for d in a.datasets.split(",") if d.strip()]
    for d in datasets:
        check_dataset(d)
    a.budget = a.budget or G.default_budget(a.device)
    budgets = G.numbers("--budgets", a.budgets) if a.budgets else [a.budget]
    if a.temperature < 0 or not 0 < a.top_p <= 1 or a.top_k < 0:
        raise GraftError("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    if a.limit is not None and a.limit < 1:
        raise GraftError("--limit must be at least 1")
    need_head = any(m in G.NEEDS_HEAD for m in methods)
    draft = a.draft or (G.KNOWN_HEADS.get(a.ckpt) if need_head else None)
    if need_head and not draft and os.path.realpath(a.ckpt) == os.path.realpath(STORIES):
        draft = ensure_stories_head()              # trained into the cache on first use (~2 min)
    if need_head and not draft:
        raise GraftError(f"{', '.join(m for m in methods if m in G.NEEDS_HEAD)} need an EAGLE-3 head: pass --draft")
    dtype = a.dtype or ("bfloat16" if str(a.device).startswith("cuda") else "float32")
    eng = G.build_engine(a.ckpt, draft if need_head else None, a.device, dtype, a.max_seq_len, a.draft_top_k, a.depth)
    log = lambda s: print(s, file=sys.stderr)
    if a.warmup > 0 and any(m in G.NEEDS_MATRIX | {"prune"} for m in methods):
        G.warm_up(eng, G.config_from_args(a, methods[-1]), rounds=a.warmup, use_cache=not a.no_cache,
                  chat=a.chat, log=log)

    # One method object per (method, budget), kept for the whole run. Each gets its own copy of the
    # warmed-up matrix: otherwise whichever method ran before would have fed the others' retrieval.
    runs = {("ar", None): G.make_method(eng, G.Config(method="ar"))}
    for m in methods[1:]:
        for b in budgets:
            own = dataclasses.replace(eng, matrix=copy.deepcopy(eng.matrix)) if m in G.NEEDS_MATRIX else eng
            runs[(m, b)] = G.make_method(own, G.config_from_args(argparse.Namespace(**{**vars(a), "budget": b}), m))
    sampling = Sampling(a.temperature, a.top_p, a.top_k, a.seed)
    # one short untimed generation per run (a warm-up prompt, so no benchmark prompt leaks into the
    # matrix): first-call costs (allocator, kernel selection) would otherwise land on the first prompt
    w = eng.tokenizer.encode(G.WARMUP_PROMPTS[0])[:eng.model.max_seq_len - 16]
    for meth in runs.values():
        G.generate(eng.model, meth, w, 16, sampling, eng.tokenizer.eos_ids)

    cost_context, cost = pass_cost(eng.model, sorted({1} | {b + 1 for b in budgets}))

    prompts, skipped = {}, {}
    for d in datasets:     # encode everything first: the progress bar knows its total, errors come early
        enc = eng.tokenizer.apply_chat if a.chat else eng.tokenizer.encode
        ids = [enc(t) for t in load_dataset(d, a.limit, eng)]
        fits = [x for x in ids if len(x) + a.max_new_tokens <= eng.model.max_seq_len]   # never truncate
        prompts[d], skipped[d] = fits, len(ids) - len(fits)
        if skipped[d]:
            log(f"{d}: skipped {skipped[d]} of {len(ids)} prompts longer than --max-seq-len "
                f"{eng.model.max_seq_len} minus --max-new-tokens {a.max_new_tokens}")

    rows, mismatches, done, t0 = [], [], 0, time.time()
    total = sum(len(p) for p in prompts.values()) * len(runs)
    for d in datasets:
        acc = {k: Row(d, k[0], k[1], skipped[d]) for k in runs}
        for i, ids in enumerate(prompts[d]):
            # every method on this prompt before the next prompt: slow drifts of a shared machine's load
            # then hit all methods alike instead of whichever ran last
            base = None
            for (m, b), meth in runs.items():
                bar(done, total, t0, f"{Path(d).name} {m}" + (f"@{b}" if len(budgets) > 1 and b else ""))
                res = G.generate(eng.model, meth, ids, a.max_new_tokens, sampling, eng.tokenizer.eos_ids)
                acc[(m, b)].add(res)
                base = res.tokens if m == "ar" else base
                if res.tokens != base:
                    acc[(m, b)].mismatches += 1
                    pos = first_difference(res.tokens, base)
                    mismatches.append({"dataset": d, "method": m, "budget": b, "prompt": i, "position": pos})
                    sys.stderr.write(f"\nMISMATCH dataset={d} method={m} budget={b} prompt={i} first differing "
                                     f"position={pos}\n")
                done += 1
        ar_tps = acc[("ar", None)].report(0)["tokens_per_s"]
        rows += [r.report(ar_tps) for r in acc.values()]
    bar(done, total, t0, "done")
    sys.stderr.write("\n")

    sweep = len(budgets) > 1
    report = {"meta": {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__, "device": str(a.device),
                    "gpu": torch.cuda.get_device_name() if str(a.device).startswith("cuda") else None},
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["bench.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "ckpt": a.ckpt, "draft": draft, "dtype": dtype, "max_seq_len": eng.model.max_seq_len,
        "max_new_tokens": a.max_new_tokens, "limit": a.limit, "chat": a.chat, "budgets": budgets,
        "sampling": {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k, "seed": a.seed},
        "warmup": a.warmup, "thresholds": {str(c): round(t, 4) for c, t in (eng.thresholds or {}).items()},
        "hit_rates": [round(x, 4) for x in eng.hit_rates] if eng.hit_rates else None,
        "datasets": {d: {"prompts": len(prompts[d]), "skipped": skipped[d]} for d in datasets},
        "pass_ms": {str(n): ms for n, ms in cost.items()}, "pass_context": cost_context,
        "mismatches": mismatches, "wall_seconds": round(time.time() - t_start, 1)},
        "rows": rows}
    print(table(rows, sweep))
    print(f"\ntarget pass (ms) over N nodes after {cost_context} tokens: " +
          ", ".join(f"N={n}: {ms:.2f} ({ms / cost[1]:.2f}x N=1)" for n, ms in cost.items()))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if mismatches:
        log(f"{len(mismatches)} outputs differ from ar: NOT lossless")
    print(json.dumps(report, separators=(",", ":")))
    return report


def cli(argv=None):
    try:
        report = main(argv)
    except GraftError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    if report["meta"]["mismatches"]:
        sys.exit(1)


if __name__ == "__main__":
    cli()
