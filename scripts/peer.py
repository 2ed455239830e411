"""The peer: transformers' own generate() on the same model and prompts as a bench.py run.

    python scripts/peer.py --ckpt checkpoints/stdlib-qwen3 --datasets humaneval --limit 40 \
        --max-new-tokens 128 --threads 1 [--static] --json-out peer.json
    OMP_NUM_THREADS=1 python scripts/peer.py --ckpt ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --chat \
        --dtype bfloat16 --threads 1 --datasets mt_bench --limit 3 --max-new-tokens 64 \
        --draft checkpoints/smollm2-135m-instruct-eagle3              # + graft, and the bandwidth line

Greedy, the prompts bench.py would read (data.load_dataset, our tokenizer, so the ids are the same),
stopping at the same EOS ids. Reports Spec-Bench's tokens/s (mean over prompts) of transformers and,
in the same process, interleaved prompt by prompt, of our plain decoding (ar) eager as generate.py runs
it (on a CPU: cpu_kernels.py's kernels, exact mode), eager on torch's own kernels (`torch_eager`; --no-torch-kernels
skips it) and compiled (inductor, not exact; --no-ours-compiled skips it), and whether every output equals ours. --static uses transformers' static KV cache
with its forward compiled (its documented fast path). A .gguf checkpoint: transformers gets graft's
own dequantized weights (the same weights, bit for bit, in a Llama or Qwen3 model of transformers';
--hf-gguf instead reads the file with transformers' GGUF loader, which needs the `accelerate` package).
--draft also runs graft (budget 8, thresholds 0.3/0.2/0.05, no warm-up) eager and compiled, and reports
its speedup over the faster of our ar and transformers'. The last line is the one-token step against
the memory: weight bytes a token x the fastest ar's tokens/s, beside this core's measured read and
copy bandwidth (scripts/linear_paths.py). transformers is a test requirement (pip install -r
requirements.txt), not a runtime one.
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
import cpu_kernels  # noqa: E402
import engine as E  # noqa: E402
import verify as V  # noqa: E402
from data import load_dataset  # noqa: E402
from graft import Config  # noqa: E402
from linear_paths import machine_bandwidth  # noqa: E402


def hf_same_weights(model, dtype):
    """A transformers model (Llama or Qwen3) holding graft's own weights: the same config, the same tensors."""
    import transformers
    a = model.args
    cls = {"llama": "Llama", "qwen3": "Qwen3"}.get(a.arch)
    if cls is None or a.n_experts:
        raise SystemExit(f"--ckpt: no transformers twin for arch {a.arch!r} here; use --hf-gguf")
    cfg = getattr(transformers, f"{cls}Config")(
        vocab_size=a.vocab_size, hidden_size=a.dim, num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim, intermediate_size=a.intermediate_size,
        rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta, rope_scaling=a.rope_scaling,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings,
        attention_bias=a.attention_bias, bos_token_id=a.bos_token_id, eos_token_id=a.eos_token_ids or None)
    hf = getattr(transformers, f"{cls}ForCausalLM")(cfg).to(dtype)
    sd = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if [k for k in missing if "rotary" not in k] or unexpected:
        raise SystemExit(f"transformers twin: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hf


def weight_bytes(model) -> int:
    """Bytes of weights a one-token step of a dense model reads: every parameter but the embedding
    table, of which it reads one row (a tied lm_head reads it whole: counted once)."""
    seen, n = set(), 0
    for name, t in model.named_parameters(remove_duplicate=False):
        if t.data_ptr() in seen or (name == "embed_tokens.weight" and not model.args.tie_word_embeddings):
            continue
        seen.add(t.data_ptr())
        n += t.nbytes
    return n


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
    p.add_argument("--torch-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="also time our eager ar on torch's own kernels, not cpu_kernels.py's (default: on)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--draft", default=None, help="also run graft with this head (budget 8, fixed thresholds)")
    p.add_argument("--hf-gguf", action="store_true", help="transformers reads the .gguf itself (needs accelerate)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM
    exact = cpu_kernels.ready()                   # generate.py's default on a CPU (cli.check_args)
    eng = CLI.build_engine(a.ckpt, a.draft, dtype=a.dtype, max_seq_len=2048, exact=exact)
    dtype = getattr(torch, a.dtype)
    if a.ckpt.endswith(".gguf") and not a.hf_gguf:
        hf = hf_same_weights(eng.model, dtype)
    elif a.ckpt.endswith(".gguf"):
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
    graft_cfg = Config(budget=8, thresholds={0: 0.3, 1: 0.2, 5: 0.05})
    ours = {"eager": (eng, E.make_method(eng, "ar"))}
    if a.draft:
        ours["graft_eager"] = (eng, E.make_method(eng, "graft", graft_cfg))
    if a.torch_kernels and cpu_kernels.ON:
        t = eng.variant(compile=False, exact=False)
        ours["torch_eager"] = (t, E.make_method(t, "ar"))
        if a.draft:
            ours["graft_torch_eager"] = (t, E.make_method(t, "graft", graft_cfg))
    if a.ours_compiled:
        c = eng.variant(compile=True, exact=False)
        ours["compiled"] = (c, E.make_method(c, "ar"))
        if a.draft:
            ours["graft_compiled"] = (c, E.make_method(c, "graft", graft_cfg))
        E.compile_warmup(c, [m for e, m in ours.values() if e is c])
    if "torch_eager" in ours:             # its first calls (torch's kernels) before the clock
        cpu_kernels.ON = False
        E.generate(ours["torch_eager"][0], ours["torch_eager"][1], [1, 2, 3], 4, V.Sampling(), ())
        cpu_kernels.ON = True
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
                on, cpu_kernels.ON = cpu_kernels.ON, cpu_kernels.ON and "torch" not in x
                try:
                    res = E.generate(e, m, ids, a.max_new_tokens, V.Sampling(), eng.tokenizer.eos_ids)
                finally:
                    cpu_kernels.ON = on
                row[f"ours_{x}_tokens_per_s"] = res.tokens_per_s
                row[f"ours_{x}_same"] = res.tokens == out
                ok &= res.tokens == out
            same += ok
            rows.append(row)
    mean = lambda k: round(sum(r[k] for r in rows) / len(rows), 2)
    report = {"ckpt": a.ckpt, "static_compiled": a.static, "dtype": a.dtype, "threads": torch.get_num_threads(),
              "prompts": len(rows), "tokens_per_s": mean("tokens_per_s"),
              **{f"ours_{x}_tokens_per_s": mean(f"ours_{x}_tokens_per_s") for x in ours},
              **{f"ours_{x}_over_transformers": round(mean(f"ours_{x}_tokens_per_s") / mean("tokens_per_s"), 3)
                 for x in ours},
              "same_as_ours": same, **{f"ours_{x}_same": sum(r[f"ours_{x}_same"] for r in rows) for x in ours}, "wall_seconds": round(time.time() - t_all, 1), "rows": rows}
    ars = {"transformers": report["tokens_per_s"], **{f"ours_{x}": report[f"ours_{x}_tokens_per_s"] for x in ours
                                                      if not x.startswith("graft")}}
    fastest = max(ars, key=ars.get)
    for x in ours:
        if x.startswith("graft"):
            report[f"ours_{x}_over_fastest_ar"] = round(report[f"ours_{x}_tokens_per_s"] / ars[fastest], 3)
    bw, wb = machine_bandwidth(), weight_bytes(eng.model)
    report.update(fastest_ar=fastest, weight_mb_per_token=round(wb / 1e6, 1), **{k: round(v, 1) for k, v in bw.items()})
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
    for x, tps in ars.items():
        print(f"{x} ar: {tps:.1f} tokens/s x {wb / 1e6:.0f} MB a token = {tps * wb / 1e9:.1f} GB/s of weights, "
              f"{100 * tps * wb / 1e9 / bw['read_gbs']:.0f}% of this core's read bandwidth ({bw['read_gbs']:.1f} GB/s; "
              f"copy {bw['copy_gbs']:.1f}); bound {bw['read_gbs'] * 1e9 / wb:.0f} tokens/s")
    return report


if __name__ == "__main__":
    main()
