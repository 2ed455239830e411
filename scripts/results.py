"""RESULTS.md and the README's results table, written from bench.py's JSON reports, never by hand.

    python scripts/results.py            # rewrite RESULTS.md and the README's table from the reports in results/
    python scripts/results.py --check    # exit 1 when either differs from what the reports give (the suite checks it)

SECTIONS below is the manifest: which report (`bench.py --json-out FILE.json`) makes which table, under
which heading, with a sentence or two that say what it measures. Every number comes from the report;
the command under each table is the report's own (`meta.command`), its --json-out pointed at the file
the table reads, so running it writes that file again. To publish a new run: run the command, put its
report in results/, name it here (or point an existing section at it), run this script, commit the
report with RESULTS.md. What the tables held before stays in git (`git log -p RESULTS.md`).

A table is a pivot: one row per dataset (and context, execution or batch size), one column per method.
A cell is `cell` filled from the row's figures, formatted: speedup, decode_speedup (over ar's, "0.89x"),
mat, mat_drafting (MAT of the rounds that drafted), plain_share and verify_peak_share (percentages),
tokens_per_s, decode_tokens_per_s, tokens_per_cpu_s, budget, policy. The baseline method (ar) gets
`base_cell`. A column says whether every output equalled ar's (bench's lossless check). kind "lossless"
instead counts, over several reports, the outputs identical to ar's; kind "weights" sets reports of one
command with and without --quantization side by side, each with the quality bench measured (meta.quality).
"""
import argparse
import datetime
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- scripts/results.py: begin -->", "<!-- scripts/results.py: end -->"


@dataclass
class Section:
    heading: str
    files: list                     # reports, relative to the repository root (one, or several for "lossless")
    note: str = ""                  # what the table measures (words only: the numbers are the table's)
    kind: str = "pivot"             # "pivot", "lossless" or "weights"
    methods: list | None = None     # the columns, in order (default: every method, as the report lists them)
    cell: str = "{decode_speedup} ({mat})"
    base_cell: str = "{decode_tokens_per_s}"
    legend: str = "a cell: decode-only speedup over `ar` (MAT); `ar`: its decode tokens/s"
    fix: list = field(default_factory=list)    # (old, new) in a recorded command: a path or name since changed
    readme: bool = False            # this table is also the README's


SMOL = "../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PACED = "a cell: decode-only speedup over `ar` (MAT of drafting rounds; share of plain rounds); `ar`: decode tokens/s"
BATCH = "a cell: total tokens/s over batched `ar`'s (MAT of drafting rounds; share of plain rounds); `ar`: its tokens/s"
SECTIONS = [
    Section("SmolLM2-135M-Instruct with its head: chat and code", ["results/cpu_smollm2.json"],
            "The demo pair (`python generate.py`'s) as a user runs it: greedy, bfloat16, one thread, exact, 128 tokens a "
            "prompt; budgets, depths and thresholds from the warm-up (`--budget auto`), rounds paced (docs/graft.md "
            "section 12). An Intel Xeon with AMX (docs/cpu.md).",
            cell="{decode_speedup} ({mat_drafting}, {plain_share})", legend=PACED, readme=True),
    Section("AVX2 only", ["results/cpu_smollm2_avx2.json"],
            "The same on an AVX2-only Zen 3, bfloat16 (the demo's dtype there; 3 nodes cost 1.2-1.35 "
            "tokens). In float32 `ar` decoded 28 / 26 tok/s, graft 1.17x / 1.39x that.",
            cell="{decode_speedup} ({mat_drafting}, {plain_share})", legend=PACED),
    Section("AVX-512 BF16 without AMX", ["results/cpu_smollm2_zen4.json"],
            "The same on a Zen 4 (`VDPBF16PS`; 5 nodes cost 1.12 tokens, 9 nodes 1.55-1.6).",
            cell="{decode_speedup} ({mat_drafting}, {plain_share})", legend=PACED),
    Section("AVX-512 BF16 without AMX, B = 4", ["results/cpu_smollm2_zen4_batch4.json"],
            "The Zen 4 at B = 4, greedy, 64 tokens a prompt, each stream three times, interleaved.",
            cell="{speedup} ({mat_drafting}, {plain_share})", base_cell="{tokens_per_s}", legend=BATCH,
            fix=[("/tmp/x/b4b.json", "results/cpu_smollm2_zen4_batch4.json")]),
    Section("Batches, paced", ["results/cpu_smollm2_batch.json"],
            "The demo pair at B = 1 and 4, greedy, bfloat16, one thread, each B warmed up; each request checked "
            "against `ar` alone; each stream three times, interleaved.",
            cell="{speedup} ({mat_drafting}, {plain_share})", base_cell="{tokens_per_s}",
            legend="a cell: total tokens/s over `ar`'s at the same B (MAT of drafting rounds; share of plain "
                   "rounds); `ar`: its tokens/s"),
    Section("Two threads", ["results/cpu_smollm2_t2.json"],
            "The demo pair on both cores (`--threads 2`): about as fast as on one "
            "(the cores share the memory's bandwidth).",
            cell="{decode_speedup} ({mat_drafting}, {plain_share})", legend=PACED),
    Section("Block drafting: SmolLM2-135M-Instruct with its DFlash drafter", ["results/dflash_smollm2.json"],
            "The shipped demo pair, the head and the DFlash drafter trained here, greedy, bfloat16, one thread, "
            "exact mode, 64 tokens a prompt.",
            fix=[("/work/h33/leg2", "checkpoints/smollm2-135m-instruct-eagle3")]),
    Section("Int8 weights (`--quantization int8`)", ["results/int8_smollm2_bf16.json", "results/int8_smollm2.json"],
            "The demo pair, greedy, one thread, exact: the target in bfloat16, then every linear (lm_head "
            "included) in int8, a scale a row, each warmed up. Perplexity on 2,048 held-out tokens; greedy "
            "agreement: tokens before an int8 output parts from bfloat16's ([costs](docs/cpu.md#int8-weights)).",
            kind="weights"),
    Section("The stdlib pair on six data sets", ["results/dflash_stdlib_fixed.json"],
            "The 4.3M stdlib target, its head and DFlash drafter, greedy, float32, one thread, paced: a step "
            "(~1.5 ms) costs about a head's draft, so the methods mostly take plain steps.",
            cell="{decode_speedup} ({mat_drafting}, {plain_share})", legend=PACED),
    Section("Retrieval sources: chat and code", ["results/sources_chat.json"],
            "graft with the continuation matrix alone, context matches alone, and both (`--ablate-sources`), "
            "before exact mode was the default: some bfloat16 outputs parted from `ar`'s at near-ties.",
            fix=[("/work/shared/", "../shared/")]),
    Section("Long context: lcc at 2,048 tokens", ["results/exact-default/smol_lcc_bf16.json"],
            "SmolLM2 continuing code files of exactly 2,048 tokens (the target's own head, bfloat16, exact, paced).",
            cell="{decode_speedup} ({mat_drafting}, {plain_share})", legend=PACED),
    Section("Batches", ["results/exact-default/smol_batch_bfloat16.json"],
            "Four requests a target pass, sampled (temperature 0.8, request i with seed 7 + i), every method "
            "at B = 4, paced; each request checked against its prompt decoded alone with `ar`.",
            cell="{speedup} ({mat_drafting}, {plain_share})", base_cell="{tokens_per_s}", legend=BATCH),
    Section("What exactness costs", ["results/exact-default/smol_cost.json"],
            "One process, interleaved prompt by prompt: `eager` is graft's linear with torch's attention "
            "(`--no-exact`), `exact` the default. Each execution's speedups are over its own `ar`."),
    Section("Block drafting, compiled", ["results/inductor_block.json"],
            "The block methods under inductor beside eager, the stdlib pair, a fixed cut (`--tail-threshold`)."),
    Section("Exact in every dtype", [f"results/exact-default/{n}.json" for n in (
        "stdlib_bfloat16", "stdlib_float16", "stdlib_lcc_bfloat16", "stdlib_lcc_float16", "stdlib_lcc2k_bfloat16",
        "stdlib_lcc2k_float16", "stdlib_batch", "smol_bf16", "smol_fp16", "smol_lcc_bf16", "smol_lcc_fp16",
        "smol_batch_bfloat16", "smol_batch_float16")],
            "Every output of every method against `ar`'s, token for token, in reduced precision (exact mode, the "
            "CPU default). Ablations ran as graft-root and graft-tail (today's graft-naive-*).",
            kind="lossless", fix=[("graft-root", "graft-naive-root"), ("graft-tail", "graft-naive-tail")]),
]

HEADER = """# Results

Written by `python scripts/results.py` from the JSON reports in `results/` (`bench.py --json-out`): edit
its manifest and run it, never this file. Under each table: when and where it ran, and the one command
that reproduces it. How to read and rerun each number: [docs/benchmarks.md](docs/benchmarks.md).

**MAT** (mean accepted tokens): tokens committed per round, i.e. per target pass, the bonus token
included; plain decoding (`ar`) has 1.00. **Speedup**: Spec-Bench's, the mean over prompts of a
method's tokens/s over `ar`'s in the same run; decode-only leaves out each prompt's prefill. Rates on a
shared machine move with its neighbours: compare within a table. No GPU has run any of this
([docs/gpu.md](docs/gpu.md)).
"""

DATASETS = {"mt_bench": "MT-bench", "humaneval": "HumanEval", "gsm8k": "GSM8K", "cnndm": "CNN/DM",
            "alpaca": "Alpaca", "stdlib": "stdlib", "lcc": "lcc", "repobench": "repobench", "longdoc": "longdoc"}


def load(path: str) -> dict:
    report = json.loads((ROOT / path).read_text())
    if not isinstance(report, dict) or "meta" not in report or "rows" not in report:
        raise SystemExit(f"{path}: not a bench.py report (meta and rows)")
    return report


def fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if key in ("speedup", "decode_speedup", "speedup_cpu"):
        return f"{v:.2f}x"
    if key in ("plain_share", "verify_peak_share"):
        return f"{100 * v:.0f}%"
    if key in ("tokens_per_s", "decode_tokens_per_s", "tokens_per_cpu_s"):
        return f"{v:.1f}"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def cell(template: str, row: dict) -> str:
    return template.format_map({k: fmt(k, v) for k, v in row.items()})


def command(meta: dict, path: str, fixes: list) -> str:
    """The report's command, as run from the repository root, writing this report again."""
    cmd = meta["command"]
    for old, new in fixes:
        cmd = cmd.replace(old, new)
    argv = shlex.split(cmd)
    if "--json-out" in argv:
        argv[argv.index("--json-out") + 1] = path
    else:
        argv += ["--json-out", path]
    return "python " + shlex.join(argv)


def machine(meta: dict) -> str:
    """Where a report ran, from its meta."""
    m = meta.get("machine", {})
    threads = m.get("torch_threads")
    peak = f" (multiply-add peak {meta['peak_gmacs']:.0f} GMAC/s)" if meta.get("peak_gmacs") else ""
    kernels = m.get("kernels")                   # (cli.machine records them on a CPU: the peak goes beside them)
    return (f"{m.get('cpu') or m.get('processor', '?')}, {m.get('cpu_count', '?')} cores"
            + (f", {kernels} kernels{peak}" if kernels else "")
            + (f", {threads} torch thread{'s' if threads != 1 else ''}" if threads else "")
            + f", torch {m.get('torch', '?')}"
            + ("" if kernels else ", " + (m.get("gpu") or ("the CPU" if m.get("device") == "cpu" else m.get("device", "?"))) + peak))


def when(meta: dict) -> datetime.datetime:
    return datetime.datetime.fromisoformat(meta["date"]).astimezone(datetime.timezone.utc)


def where(metas: list) -> str:
    """When and where reports ran: each machine once, the dates as a range."""
    times = sorted(when(m) for m in metas)
    span = f"{times[0]:%Y-%m-%d %H:%M} UTC" if len(times) == 1 else (
        f"{times[0]:%Y-%m-%d %H:%M} to " + (f"{times[-1]:%H:%M}" if times[-1].date() == times[0].date()
                                            else f"{times[-1]:%Y-%m-%d %H:%M}") + " UTC")
    return f"{span}, on {'; '.join(dict.fromkeys(machine(m) for m in metas))}"


def row_key(r: dict) -> tuple:
    """What a table row is: the dataset and, where they vary, the context, the execution, the batch."""
    return (r["dataset"], r.get("context"), r.get("execution"), r.get("batch"))


def pivot(s: Section, report: dict) -> str:
    rows = report["rows"]
    methods = s.methods or list(dict.fromkeys(r["method"] for r in rows))
    keys = list(dict.fromkeys(row_key(r) for r in rows))
    vary = [i for i in (1, 2, 3) if len({k[i] for k in keys}) > 1 or (i == 1 and any(k[1] for k in keys))]
    names = {1: "context", 2: "execution", 3: "B"}
    head = ["data set"] + [names[i] for i in vary] + [f"`{m}`" for m in methods] + ["lossless"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        got = {r["method"]: r for r in rows if row_key(r) == k}
        cells = [cell(s.base_cell if m == "ar" else s.cell, got[m]) if m in got else "-" for m in methods]
        checks = [got[m]["lossless"] for m in methods if m in got]
        ok = "yes" if all(c is True for c in checks) else "near-ties" if False not in checks else "no"
        out.append("| " + " | ".join([DATASETS.get(k[0], k[0])] + [str(k[i]) for i in vary] + cells + [ok]) + " |")
    return "\n".join(out) + f"\n\n({s.legend})"


def lossless(s: Section, reports: list) -> str:
    out = ["| report | target | dtype | data sets | B, decoding | methods beside `ar` | outputs identical to `ar`'s |",
           "|---|---|---|---|---|---|---|"]
    for path, rep in reports:
        meta, rows = rep["meta"], rep["rows"]
        runs = [r for r in rows if r["method"] != "ar"]
        n = lambda r: r.get("requests", r.get("prompts", 0))
        same = sum(n(r) for r in runs if r["lossless"] is True)
        sets = ", ".join(dict.fromkeys(DATASETS.get(r["dataset"], r["dataset"]) + (f"@{r['context']}" if r.get("context") else "")
                                       for r in rows))
        smp = meta.get("sampling", {})
        how = "greedy" if not smp.get("temperature") else f"T {smp['temperature']}, seed {smp.get('seed')}"
        out.append(f"| `{Path(path).name}` | {Path(meta['ckpt']).name} | {meta['dtype']} | {sets} | "
                   f"{','.join(map(str, meta.get('batch', [1])))}, {how} | {len({r['method'] for r in runs})} | "
                   f"{same} of {sum(n(r) for r in runs)} |")
    return "\n".join(out)


def weights(s: Section, reports: list) -> str:
    """One row per (report, dataset): the weights (the dtype, or --quantization), the methods' cells, and
    the quantized report's quality: held-out perplexity and greedy agreement with the float target."""
    methods = s.methods or list(dict.fromkeys(r["method"] for _, rep in reports for r in rep["rows"]))
    head = ["data set", "weights"] + [f"`{m}`" for m in methods] + ["lossless", "perplexity", "greedy agreement"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, rep in reports:
        meta, q = rep["meta"], rep["meta"].get("quality")
        kind = meta.get("quantization", "none")
        w = meta["dtype"] if kind == "none" else f"{kind} ({meta['dtype']} activations)"
        for d in dict.fromkeys(r["dataset"] for r in rep["rows"]):
            got = {r["method"]: r for r in rep["rows"] if r["dataset"] == d}
            cells = [cell(s.base_cell if m == "ar" else s.cell, got[m]) if m in got else "-" for m in methods]
            ok = "yes" if all(got[m]["lossless"] is True for m in got) else "no"
            ppl = f"{q['perplexity'][kind]} ({meta['dtype']}: {q['perplexity'][meta['dtype']]})" if q else "-"
            agree = (f"median {q['median_common_prefix']:g} of {meta['max_new_tokens']} tokens, {q['identical']} of "
                     f"{q['prompts']} identical") if q else "-"
            out.append("| " + " | ".join([DATASETS.get(d, d), w] + cells + [ok, ppl, agree]) + " |")
    return "\n".join(out) + f"\n\n({s.legend})"


def section(s: Section) -> str:
    reports = [(p, load(p)) for p in s.files]
    body = (pivot(s, reports[0][1]) if s.kind == "pivot" else weights(s, reports) if s.kind == "weights"
            else lossless(s, reports))
    runs = where([r["meta"] for _, r in reports])
    cmds = "\n".join(command(r["meta"], p, s.fix) for p, r in reports)
    return f"## {s.heading}\n\n{s.note}\n\n{body}\n\nRan {runs}.\n\n```bash\n{cmds}\n```\n"


def results_md() -> str:
    return HEADER + "".join("\n" + section(s) for s in SECTIONS)


def readme_block() -> str:
    s = next(s for s in SECTIONS if s.readme)
    (path, rep), = [(p, load(p)) for p in s.files]
    return (f"{BEGIN}\n{pivot(s, rep)}\n\n{s.note} Measured {when(rep['meta']):%Y-%m-%d} on a CPU (`{path}`; the "
            f"command and the other tables: [RESULTS.md](RESULTS.md)).\n{END}")


def readme_md(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block for the results table")
    a, b = text.index(BEGIN), text.index(END) + len(END)
    return text[:a] + readme_block() + text[b:]


def main(argv=None):
    p = argparse.ArgumentParser(description="Write RESULTS.md and the README's results table from bench.py's JSON "
                                            "reports (the manifest: SECTIONS in this file).")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs from what the "
                                                        "reports give")
    a = p.parse_args(argv)
    targets = {ROOT / "RESULTS.md": results_md(), ROOT / "README.md": readme_md((ROOT / "README.md").read_text())}
    stale = [f.name for f, text in targets.items() if not f.exists() or f.read_text() != text]
    if a.check:
        if stale:
            print(f"out of date: {', '.join(stale)} (run python scripts/results.py)", file=sys.stderr)
            return 1
        return 0
    for f, text in targets.items():
        if f.name in stale:
            f.write_text(text)
            print(f"wrote {f.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
