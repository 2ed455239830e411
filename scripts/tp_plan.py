"""The memory plan of a sharded target (README, "Several devices"): per rank, the weights it holds
(tp.Shards: its heads and MLP columns, plus the replicated embedding, norms and lm_head), its KV cache
at a context, and the replicated EAGLE-3 head (weights and its one-layer cache). Counted from the
parameter shapes model.py and draft.py build (on the meta device: nothing is allocated), for the
public configs of the paper's targets and SpecForge-style heads (one layer at the target's width,
draft vocabulary 32000).

    python scripts/tp_plan.py                   # Qwen3-8B on 1, Qwen3-32B on 2, Qwen3-235B-A22B on 8
    python scripts/tp_plan.py --context 40960   # at the models' full context
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoint import hf_model_args  # noqa: E402
from draft import Eagle3, HeadConfig  # noqa: E402
from engine import DEFAULT_MAX_SEQ_LEN  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from tp import Shards  # noqa: E402

V = 151936
COMMON = dict(vocab_size=V, head_dim=128, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0,
              max_position_embeddings=40960, tie_word_embeddings=False)
# the Hub's config.json values (Qwen/Qwen3-8B, Qwen/Qwen3-32B, Qwen/Qwen3-235B-A22B)
TARGETS = {
    "Qwen3-8B": (1, dict(COMMON, architectures=["Qwen3ForCausalLM"], hidden_size=4096, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, intermediate_size=12288)),
    "Qwen3-32B": (2, dict(COMMON, architectures=["Qwen3ForCausalLM"], hidden_size=5120, num_hidden_layers=64,
                          num_attention_heads=64, num_key_value_heads=8, intermediate_size=25600)),
    "Qwen3-235B-A22B": (8, dict(COMMON, architectures=["Qwen3MoeForCausalLM"], hidden_size=4096, num_hidden_layers=94,
                                num_attention_heads=64, num_key_value_heads=4, intermediate_size=12288,
                                num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                                norm_topk_prob=True)),
}


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def plan(name: str, n: int, cfg: dict, context: int, size: int = 2) -> dict:
    full = hf_model_args(cfg)
    rank = Shards(full, 0, n).args if n > 1 else full
    with torch.device("meta"):
        whole, mine = count(Transformer(full)), count(Transformer(rank))
        layer = ModelArgs(dim=full.dim, n_layers=1, n_heads=full.n_heads, n_kv_heads=max(full.n_kv_heads, 8),
                          head_dim=128, intermediate_size=full.intermediate_size, vocab_size=V)
        head = count(Eagle3(HeadConfig(layer=layer, target_hidden=full.dim, vocab_size=V, draft_vocab_size=32000)))
    kv = 2 * full.n_layers * rank.n_kv_heads * full.head_dim * context * size
    head_kv = 2 * layer.n_kv_heads * layer.head_dim * context * size
    gb = lambda b: round(b / 1e9, 1)
    return {"model": name, "ranks": n, "weights_gb": gb(whole * size), "per_rank_weights_gb": gb(mine * size),
            "per_rank_kv_gb": gb(kv), "head_gb": gb(head * size), "head_kv_gb": gb(head_kv),
            "per_rank_total_gb": gb(mine * size + kv + head * size + head_kv)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=DEFAULT_MAX_SEQ_LEN)
    a = p.parse_args()
    print(f"bfloat16, context {a.context} tokens, batch 1 (GB = 1e9 bytes)")
    print("| target | GPUs | weights | weights a GPU | KV cache a GPU | head (+ its KV) | a GPU in all |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, cfg) in TARGETS.items():
        r = plan(name, n, cfg, a.context)
        print(f"| {name} | {n} | {r['weights_gb']} | {r['per_rank_weights_gb']} | {r['per_rank_kv_gb']} | "
              f"{r['head_gb']} (+{r['head_kv_gb']}) | {r['per_rank_total_gb']} |")
