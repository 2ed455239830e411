"""The peer: transformers' own generate() on the same model and prompts as a bench.py run.

    python scripts/peer.py --ckpt checkpoints/stdlib-qwen3 --datasets humaneval --limit 40 \
        --max-new-tokens 128 --threads 1 [--static] --json-out peer.json

Greedy, the prompts bench.py would read (data.load_dataset, our tokenizer, so the ids are the same),
stopping at the same EOS ids. Reports Spec-Bench's tokens/s (mean over prompts) of transformers and,
in the same process, interleaved prompt by prompt, of our plain decoding (ar) eager and compiled
(inductor; --no-ours-compiled skips it), and whether every output equals ours. --static uses transformers' static KV cache
with its forward compiled (its documented fast path). A .gguf checkpoint is read by transformers'
own GGUF loader (from_pretrained(..., gguf_file=), which needs the `accelerate` package).
transformers is a test requirement (pip install -r requirements.txt), not a runtime one.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cli as CLI  # noqa: E402
import engine as E  # noqa: E402
import verify as V  # noqa: E402
from data import load_dataset  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--datasets", default="humaneval")
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--static", action="store_true", help="static KV cache + compiled forward")
    p.add_argument("--ours-compiled", action=argparse.BooleanOptionalAction, default=True,
                   help="also time our compiled ar (default: on)")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM
    eng = CLI.build_engine(a.ckpt, dtype=a.dtype, max_seq_len=2048)
    dtype = getattr(torch, a.dtype)
    if a.ckpt.endswith(".gguf"):
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(a.ckpt)),
                                                  gguf_file=os.path.basename(a.ckpt), dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=dtype)
    hf.eval()
    eos = eng.tokenizer.eos_ids or None
    kw = dict(do_sample=False, max_new_tokens=a.max_new_tokens, eos_token_id=eos, pad_token_id=(eos or [0])[0])
    if a.static:       # our compiled forward, and transformers compiles nothing itself (on CUDA it would, around ours)
        kw.update(cache_implementation="static", disable_compile=True)
        hf.forward = torch.compile(hf.forward, fullgraph=True)
    ours = {"eager": (eng, E.make_method(eng, "ar"))}
    if a.ours_compiled:
        c = eng.variant(compile=True)
        ours["compiled"] = (c, E.make_method(c, "ar"))
        E.compile_warmup(c, [ours["compiled"][1]])
    rows, same, t_all = [], 0, time.time()
    for d in a.datasets.split(","):
        texts = load_dataset(d, a.limit, eng)
        for text in texts:
            ids = eng.tokenizer.apply_chat(text) if a.chat else eng.tokenizer.encode(text)
            x = torch.tensor([ids])
            with torch.no_grad():
                if not rows:
                    hf.generate(x, **dict(kw, max_new_tokens=8))        # first-call costs, compile
                t0 = time.perf_counter()
                out = hf.generate(x, **kw)[0, len(ids):].tolist()
                secs = time.perf_counter() - t0
            row = {"dataset": d, "tokens": len(out), "seconds": round(secs, 4), "tokens_per_s": len(out) / secs}
            ok = True
            for x, (e, m) in ours.items():
                res = E.generate(e, m, ids, a.max_new_tokens, V.Sampling(), eng.tokenizer.eos_ids)
                row[f"ours_{x}_tokens_per_s"] = res.tokens_per_s
                ok &= res.tokens == out
            same += ok
            rows.append(row)
    mean = lambda k: round(sum(r[k] for r in rows) / len(rows), 2)
    report = {"ckpt": a.ckpt, "static_compiled": a.static, "dtype": a.dtype, "threads": torch.get_num_threads(),
              "prompts": len(rows), "tokens_per_s": mean("tokens_per_s"),
              **{f"ours_{x}_tokens_per_s": mean(f"ours_{x}_tokens_per_s") for x in ours},
              **{f"ours_{x}_over_transformers": round(mean(f"ours_{x}_tokens_per_s") / mean("tokens_per_s"), 3)
                 for x in ours},
              "same_as_ours": same, "wall_seconds": round(time.time() - t_all, 1), "rows": rows}
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
    return report


if __name__ == "__main__":
    main()
