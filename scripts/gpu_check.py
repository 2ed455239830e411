"""The GPU check: what the compiled engine does on a card, in one JSON, for whoever is lent a GPU.

    python scripts/gpu_check.py --out gpu_check.json          # a GPU: shapes of Qwen3-8B, bf16
    python scripts/gpu_check.py --tiny --out tiny.json        # the same code on a CPU, tiny shapes (CI)

Random weights shaped like Qwen3-8B (36 layers, hidden 4096, 32/8 heads, head_dim 128, intermediate
12288, vocab 151936) and a random EAGLE-3 head shaped like the published Qwen3-8B heads (one layer,
hidden 4096, draft vocabulary 32000): the costs of real weights without downloading any. It reports
  - plain decoding (ar), eager and compiled: ms per token, tokens/s, and the fraction of the card's
    memory bandwidth it uses (weight bytes read per token x tokens/s / peak);
  - the verify pass at 1, 17, 33 and 61 nodes (compiled), and one draft level;
  - a whole Graft round at each pruning stage (forced with thresholds of 0 and 2), phase by phase;
  - transformers' own generate() on the same weights, eager and with its static cache compiled (the
    peer a user would reach for). transformers is a test requirement: pip install -r requirements.txt.
With random weights the head's drafts are never accepted: every number here is a cost, not a speedup.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import generate as G  # noqa: E402
from draft import Drafter, Eagle3, HeadConfig  # noqa: E402
from graft import Config, ContinuationMatrix  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from verify import Sampling  # noqa: E402

QWEN3_8B = dict(arch="qwen3", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                intermediate_size=12288, norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, qk_norm=True)
TINY = dict(QWEN3_8B, vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128)
HEAD_8B = dict(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate_size=12288, draft_vocab=32000)
HEAD_TINY = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128, draft_vocab=256)
# nominal HBM bandwidth, bytes/s, by the name torch reports (the measured copy bandwidth is reported too)
PEAK = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
        "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "RTX 4090": 1.008e12}


def random_target(a: ModelArgs, device, dtype) -> Transformer:
    with torch.device(device):
        m = Transformer(a).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    m.path = "random"
    return m.eval()


def random_head(target: Transformer, h: dict, device, dtype) -> Eagle3:
    a = target.args
    layer = ModelArgs(arch="llama", vocab_size=a.vocab_size, dim=h["dim"], n_layers=1, n_heads=h["n_heads"],
                      n_kv_heads=h["n_kv_heads"], head_dim=h["head_dim"], intermediate_size=h["intermediate_size"],
                      norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=a.max_position_embeddings)
    with torch.device(device):
        head = Eagle3(HeadConfig(layer=layer, target_hidden=a.dim, vocab_size=a.vocab_size,
                                 draft_vocab_size=h["draft_vocab"])).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        head.d2t.copy_(torch.arange(h["draft_vocab"], device=device) * (a.vocab_size // h["draft_vocab"] - 1))
    head.embed_tokens = target.embed_tokens
    head.path = "random"
    return head.eval()


def engine(model, head, compile: bool, backend: str, args) -> G.Engine:
    drafter = Drafter(head, model.max_seq_len, top_k=10, depth=8, chunk=args.chunk)
    matrix = ContinuationMatrix(model.args.vocab_size, 8, device=model.embed_tokens.weight.device)
    window = not (compile and model.embed_tokens.weight.is_cuda)
    return G.Engine(model, None, drafter, matrix, compile=compile, window=window, chunk=args.chunk, backend=backend)


def weight_bytes(model) -> int:
    """Bytes a decoding step reads: every weight but the embedding table (one row of it is read)."""
    embed = model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed or model.args.tie_word_embeddings)


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy (reads and writes counted)."""
    x = torch.empty(256 * 2 ** 20 // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    G.sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    G.sync(device)
    return 2 * x.numel() * x.element_size() * 10 / (time.perf_counter() - t0)


def decode_ms(eng, prompt: list, n: int) -> float:
    r = G.generate(eng, G.make_method(eng, "ar"), prompt, n, Sampling(), ())
    return r.times["verify"] / max(r.rounds, 1) * 1000


def graft_rounds(eng, prompt: list, n: int, budget: int) -> dict:
    """A whole Graft round at each stage, forced by thresholds (0: never prune, 2: always), ms per phase."""
    out = {}
    for stage in (None, 0, 1, 5):
        th = {c: (2.0 if stage is not None and c == stage else 0.0) for c in (0, 1, 5)}
        m = G.make_method(eng, "graft", Config(budget=budget, thresholds=th))
        G.generate(eng, m, prompt, 4, Sampling(), ())                     # compile / warm
        r = G.generate(eng, m, prompt, n, Sampling(), ())
        ms = {k: round(v / r.rounds * 1000, 3) for k, v in r.times.items() if k != "prefill"}
        out["full" if stage is None else str(stage)] = dict(ms, total=round(sum(ms.values()), 3),
                                                            overhead=round(1 - ms["verify"] / sum(ms.values()), 4))
    return out


def draft_level_ms(eng, prompt: list) -> float:
    m = G.make_method(eng, "eagle3", Config(budget=60))
    r = G.generate(eng, m, prompt, 8, Sampling(), ())
    r = G.generate(eng, m, prompt, 16, Sampling(), ())
    return r.times["draft"] / max(r.draft_forwards, 1) * 1000


def transformers_peer(model, prompt: list, n: int, device, compiled: bool) -> dict:
    """transformers' generate() on the same weights (greedy, no EOS): ms per new token."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    a = model.args
    cfg = Qwen3Config(vocab_size=a.vocab_size, hidden_size=a.dim, num_hidden_layers=a.n_layers,
                      num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim,
                      intermediate_size=a.intermediate_size, rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta,
                      max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=False)
    with torch.device(device):
        hf = Qwen3ForCausalLM(cfg).to(dtype_of(model)).eval()
    sd = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in model.state_dict().items()}
    hf.load_state_dict(sd, strict=True)
    kw = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    if compiled:        # transformers' documented fast path: a static cache and a compiled forward
        kw["cache_implementation"] = "static"
        opts = dict(mode="reduce-overhead") if str(device).startswith("cuda") else dict(backend="aot_eager")
        hf.forward = torch.compile(hf.forward, fullgraph=True, **opts)
    x = torch.tensor([prompt], device=device)
    with torch.no_grad():
        hf.generate(x, **dict(kw, max_new_tokens=8, min_new_tokens=8))          # compile / warm
        G.sync(device)
        t0 = time.perf_counter()
        hf.generate(x, **dict(kw, max_new_tokens=1, min_new_tokens=1))
        G.sync(device)
        t1 = time.perf_counter()
        hf.generate(x, **kw)
        G.sync(device)
        t2 = time.perf_counter()
    del hf
    # the 1-token run is the prefill: what remains is n-1 decoding steps
    return {"ms_per_token": round(((t2 - t1) - (t1 - t0)) / (n - 1) * 1000, 3)}


def dtype_of(model):
    return model.embed_tokens.weight.dtype


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (what CI runs)")
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--tokens", type=int, default=256, help="tokens decoded per timing")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--no-peer", action="store_true", help="skip transformers' generate()")
    args = p.parse_args(argv)
    t_start = time.time()
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    backend = "inductor" if cuda else "aot_eager"          # CPU: trace and functionalise only (fast)
    a = ModelArgs(**(TINY if args.tiny else QWEN3_8B))
    n = args.tokens
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype).replace("torch.", ""),
              "shapes": "tiny" if args.tiny else "Qwen3-8B", "torch": torch.__version__, "tokens": n}
    torch.manual_seed(0)
    model = random_target(a, device, dtype)
    model.max_seq_len = 1024
    head = random_head(model, HEAD_TINY if args.tiny else HEAD_8B, device, dtype)
    prompt = torch.randint(0, a.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    wb = weight_bytes(model)
    peak = next((v for k, v in PEAK.items() if k in report["device"]), None)
    report["weight_bytes"] = wb
    report["peak_bytes_per_s"] = {"nominal": peak, "measured_copy": round(copy_bandwidth(device))}

    def ar(eng):
        decode_ms(eng, prompt, 8)                                  # compile / warm
        ms = decode_ms(eng, prompt, n)
        bw = wb / (ms / 1000)
        return {"ms_per_token": round(ms, 3), "tokens_per_s": round(1000 / ms, 1),
                "bandwidth_fraction": round(bw / peak, 4) if peak else None,
                "bandwidth_fraction_of_copy": round(bw / report["peak_bytes_per_s"]["measured_copy"], 4)}

    eager = engine(model, head, False, backend, args)
    report["ar"] = {"eager": ar(eager)}
    comp = engine(model, head, True, backend, args)
    t0 = time.perf_counter()
    report["ar"]["compiled"] = ar(comp)
    ctx, cost = G.pass_cost(comp, [1, 17, 33, 61], context=128, repeats=10)
    report["verify_ms"] = {"context": ctx, **{str(k): v for k, v in cost.items()}}
    report["verify_ms"]["61_over_1"] = round(cost[61] / cost[1], 3)
    report["draft_level_ms"] = round(draft_level_ms(comp, prompt), 3)
    report["graft_round_ms"] = graft_rounds(comp, prompt, n, budget=60)
    report["engine_seconds_incl_compile"] = round(time.perf_counter() - t0, 1)
    if not args.no_peer:
        try:
            report["transformers"] = {"eager": transformers_peer(model, prompt, n, device, False),
                                      "static_compiled": transformers_peer(model, prompt, n, device, True)}
            ours = report["ar"]["compiled"]["ms_per_token"]
            for k, v in report["transformers"].items():
                v["ours_compiled_speedup"] = round(v["ms_per_token"] / ours, 3)
        except ImportError:
            report["transformers"] = "not installed (pip install -r requirements.txt)"
    report["wall_seconds"] = round(time.time() - t_start, 1)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
