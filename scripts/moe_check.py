"""The MoE check: what a Qwen3-MoE target costs to decode and to verify, with random weights.

    python scripts/moe_check.py --out moe.json                 # a CPU: Qwen3-30B-A3B's shape scaled down
    python scripts/moe_check.py --full --out moe_gpu.json      # a GPU: Qwen3-30B-A3B's own shape, bf16

Qwen3-30B-A3B: 48 layers, hidden 2048, 32/4 heads of 128, 128 experts of intermediate 768, 8 per token,
vocabulary 151936. Scaled down (the default): 8 layers, hidden 512, 8/2 heads of 64, the same 128
experts and 8 per token with intermediate 192, vocabulary 8192 - the routing, and so the experts a tree
touches, keep their shape. Reports plain decoding (ms per token, tokens/s), the verify pass at 1, 17
and 61 nodes, and how many distinct experts a pass of N nodes routes to per layer: a token reads 8
experts, a 61-node tree up to 61 x 8 of 128, which is why verifying costs more on an MoE than on a
dense model of the same active size.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import calibrate as CAL  # noqa: E402
import engine as E  # noqa: E402
from graft import ContinuationMatrix  # noqa: E402
from model import ModelArgs, MoE, Transformer  # noqa: E402
from verify import Sampling  # noqa: E402

A3B = dict(arch="qwen3_moe", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
           intermediate_size=6144, n_experts=128, n_experts_per_tok=8, moe_intermediate_size=768,
           norm_topk_prob=True, qk_norm=True, rope_theta=1e6, max_position_embeddings=40960)
SMALL = dict(A3B, vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64,
             intermediate_size=1536, moe_intermediate_size=192)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="Qwen3-30B-A3B's own shape (a GPU)")
    p.add_argument("--out", default="moe_check.json")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cuda = torch.cuda.is_available() and a.full
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    args = ModelArgs(**(A3B if a.full else SMALL), sparse_layers=(True,) * (48 if a.full else 8))
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(args).to(dtype)
    with torch.no_grad():
        for q in model.parameters():
            q.normal_(0, 0.02) if q.dim() > 1 else q.fill_(1.0)
    model.path, model.max_seq_len = "random", 1024
    eng = E.Engine(model, None, None, ContinuationMatrix(args.vocab_size, 8, device=device), nodes=61,
                   path=CAL.COST_PATH, compile=cuda, window=not cuda)      # room for pass_cost's 61-node trees
    prompt = torch.randint(0, args.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    E.generate(eng, E.make_method(eng, "ar"), prompt, 4, Sampling(), ())
    r = E.generate(eng, E.make_method(eng, "ar"), prompt, a.tokens, Sampling(), ())
    ms = r.times["verify"] / r.rounds * 1000
    ctx, cost = CAL.pass_cost(eng, [1, 17, 61], context=128, repeats=5)

    touched = {}                          # distinct experts routed to, per layer, for a pass of N tokens
    def count(module, inputs, out, n=[0]):
        idx, _ = module.route(inputs[0].reshape(-1, inputs[0].shape[-1]))
        touched.setdefault(inputs[0].shape[1], []).append(int(idx.unique().numel()))
    hooks = [b.mlp.register_forward_hook(count) for b in model.layers if isinstance(b.mlp, MoE)]
    with torch.no_grad():
        for n in (1, 17, 61):
            x = torch.randint(0, args.vocab_size, (1, n), device=device)
            model(x, torch.arange(n, device=device))
    for h in hooks:
        h.remove()
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype).replace("torch.", ""),
              "shape": "Qwen3-30B-A3B" if a.full else "Qwen3-30B-A3B scaled down (8 layers, hidden 512)",
              "threads": torch.get_num_threads(), "ar_ms_per_token": round(ms, 3), "ar_tokens_per_s": round(1000 / ms, 2),
              "verify_ms": {str(k): v for k, v in cost.items()}, "verify_context": ctx,
              "verify_over_1": {str(k): round(v / cost[1], 3) for k, v in cost.items()},
              "distinct_experts_per_layer": {str(n): round(sum(v) / len(v), 1) for n, v in sorted(touched.items())},
              "experts": args.n_experts, "experts_per_token": args.n_experts_per_tok}
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
