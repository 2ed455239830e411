"""The target model: Llama (Llama-2/Vicuna, Llama-3.x) and Qwen3, written from scratch.

One file, readable top to bottom:
  ModelArgs        a dataclass built from the checkpoint's own config.json
  RoPE             a cos/sin table indexed by absolute position (tree nodes just pass positions)
  KVCache          a preallocated buffer written at explicit rows
  Transformer      forward(tokens, positions, cache_rows, mask) -> logits (+ EAGLE-3 features)
  checkpoints      local folder or hub id -> config + safetensors (single or sharded, memory-mapped)
  GGUF             a llama.cpp .gguf file -> config, dequantized weights and tokenizer from its metadata
  Tokenizer        tokenizer.json via `tokenizers`, chat template via jinja2, EOS ids

Nothing here knows about speculation: a tree is just tokens at some positions under some mask.
"""
import functools
import json
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


class GraftError(Exception):
    """Bad input (checkpoint, prompt, flags): the CLI prints the message on one line and exits."""


SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------- config

@dataclass
class ModelArgs:
    arch: str = "llama"                  # "llama" or "qwen3"
    vocab_size: int = 32000
    dim: int = 4096                      # hidden_size
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 128
    intermediate_size: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False                # Qwen3: RMSNorm over each head of q and k
    bos_token_id: int | None = None
    eos_token_ids: list = field(default_factory=list)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
        if arch is None:
            arch = {"llama": "llama", "qwen3": "qwen3"}.get(cfg.get("model_type", "")) if not archs else None
        if arch is None:
            raise GraftError(f"unsupported architecture {archs or cfg.get('model_type')}: "
                             f"supported are {', '.join(SUPPORTED)}")
        try:
            dim, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
            # transformers 5 keeps rope_theta inside rope_parameters, even when the type is "default"
            rope_theta = cfg.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0
            if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
                rope_scaling = None
            return cls(
                arch=arch,
                vocab_size=int(cfg["vocab_size"]),
                dim=dim,
                n_layers=int(cfg["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=int(cfg.get("head_dim") or dim // n_heads),
                intermediate_size=int(cfg["intermediate_size"]),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                qk_norm=arch == "qwen3",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise GraftError(f"malformed config.json: missing or bad field {e}") from None

    @property
    def capture_layers(self) -> tuple:
        """EAGLE-3 reads the residual stream at the *input* of these layers (eagle3.md section 2)."""
        L = self.n_layers  # tiny models may repeat a layer (L=5: 2, 2, 2); clamp for L < 5
        return tuple(sorted(min(max(i, 0), L - 1) for i in (2, L // 2, L - 3)))


# ----------------------------------------------------------------------------- RoPE

def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_pos: int) -> tuple:
    """Inverse frequencies (head_dim/2,) and the cos/sin scale, for plain, linear, llama3 and yarn RoPE."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if not scaling:
        return inv, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "freq_factors":  # GGUF rope_freqs.weight: llama.cpp divides each frequency by its factor
        return inv / torch.as_tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        orig = scaling["original_max_position_embeddings"]
        lo_wl, hi_wl = orig / scaling["low_freq_factor"], orig / scaling["high_freq_factor"]
        wl = 2 * math.pi / inv
        smooth = (orig / wl - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
        mid = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(wl < hi_wl, inv, torch.where(wl > lo_wl, inv / factor, mid)), 1.0
    if kind == "yarn":
        orig = scaling.get("original_max_position_embeddings") or max_pos
        attn = scaling.get("attention_factor")
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        get_m = lambda s, m=1.0: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
        if attn is None:
            attn = get_m(factor, mscale) / get_m(factor, mscale_all) if mscale and mscale_all else get_m(factor)
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
        corr = lambda rot: head_dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))
        lo, hi = corr(fast), corr(slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrap = 1 - ramp
        return inv / factor * (1 - extrap) + inv * extrap, float(attn)
    raise GraftError(f"unsupported rope_scaling type {kind!r}: supported are linear, llama3, yarn")


def rope_table(args: ModelArgs, max_seq_len: int) -> torch.Tensor:
    """(max_seq_len, 2, head_dim) float32: cos and sin of every absolute position, full width."""
    inv, scale = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)  # (S, hd/2)
    freqs = torch.cat([freqs, freqs], dim=-1)                                  # (S, hd)
    return torch.stack([freqs.cos() * scale, freqs.sin() * scale], dim=1)


def rope_at(table: torch.Tensor, positions: torch.Tensor, dtype) -> tuple:
    """cos, sin for these positions, (B or 1, 1, T, D) each, in the activations' dtype (as HF does);
    computed once per forward and shared by every layer."""
    cs = table[positions].to(dtype)                                            # (T, 2, D) or (B, T, 2, D)
    if cs.dim() == 3:
        cs = cs.unsqueeze(0)
    return cs[:, None, :, 0], cs[:, None, :, 1]


def apply_rope(x: torch.Tensor, rope: tuple) -> torch.Tensor:
    """Rotate-half RoPE (HF layout). x: (B, H, T, D); rope: cos, sin from rope_at."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def mask_bias(mask, dtype):
    """A bool mask (True = may attend) as an additive bias (0 or -inf), made once per forward: every
    layer would otherwise convert it again inside scaled_dot_product_attention."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, float("-inf")).to(dtype)


# ----------------------------------------------------------------------------- layers

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class KVCache(nn.Module):
    """Preallocated keys/values (B, H_kv, max_seq_len, D), written at explicit rows.

    `kv` (2, B, H_kv, max_seq_len, D), when given, is this layer's slice of a buffer shared by all
    layers, so that KV compaction moves every layer's rows in one gather and one copy."""

    def __init__(self, batch: int, n_kv: int, max_seq_len: int, head_dim: int, dtype, device, kv=None):
        super().__init__()
        if kv is None:
            kv = torch.zeros(2, batch, n_kv, max_seq_len, head_dim, dtype=dtype, device=device)
        self.register_buffer("k", kv[0], persistent=False)
        self.register_buffer("v", kv[1], persistent=False)

    def update(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: int):
        self.k.index_copy_(2, rows, k)
        self.v.index_copy_(2, rows, v)
        return self.k[:, :, :S], self.v[:, :, :S]


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, in_dim: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = a.n_heads, a.n_kv_heads, a.head_dim
        in_dim = in_dim or a.dim
        self.q_proj = nn.Linear(in_dim, a.n_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(in_dim, a.n_kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(in_dim, a.n_kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.norm_eps)
        self.qk_norm = a.qk_norm
        self.cache: KVCache | None = None

    def forward(self, x, rope, cache_rows=None, mask=None, steps_kv=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if cache_rows is not None:
            # the new rows go into the cache first; then every query attends over cache[:S] under `mask`
            k, v = self.cache.update(cache_rows, k, v, mask.shape[-1])
        elif steps_kv is not None:
            # EAGLE-3 training-time test: the keys of the earlier unrolled steps come first
            steps_kv.append((k, v))
            k, v = torch.cat([kv[0] for kv in steps_kv], 2), torch.cat([kv[1] for kv in steps_kv], 2)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.dim, a.norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.dim, a.norm_eps)
        self.mlp = MLP(a.dim, a.intermediate_size)

    def forward(self, x, rope, cache_rows=None, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache_rows, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Parameter names follow HF's (minus the leading `model.`), so checkpoints load by name."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.lm_head = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.max_seq_len = 0
        self.rope = None
        self.kv = None                      # (layers, 2, B, H_kv, S, D) once setup_caches ran

    def setup_caches(self, max_seq_len: int, batch: int = 1):
        """Preallocate the KV cache and the RoPE table for positions 0..max_seq_len-1. One buffer
        (layers, 2, B, H_kv, S, D) holds every layer's keys and values."""
        p, a = self.embed_tokens.weight, self.args
        self.max_seq_len = max_seq_len
        self.rope = rope_table(a, max_seq_len).to(p.device)
        self.kv = torch.zeros(a.n_layers, 2, batch, a.n_kv_heads, max_seq_len, a.head_dim, dtype=p.dtype,
                              device=p.device)
        for i, layer in enumerate(self.layers):
            layer.self_attn.cache = KVCache(batch, a.n_kv_heads, max_seq_len, a.head_dim, p.dtype, p.device,
                                            kv=self.kv[i])

    def move_cache_rows(self, src: torch.Tensor, dst_start: int):
        """KV compaction after verification: accepted rows `src` become rows dst_start.. in every layer
        (gather first, so overlapping source and destination rows are safe)."""
        n = src.numel()
        self.kv[..., dst_start:dst_start + n, :] = self.kv[..., src, :]

    def forward(self, tokens, positions, cache_rows=None, mask=None, capture=False):
        """tokens (B, T); positions (T,) or (B, T) absolute positions for RoPE.

        With a cache: the T new rows are written at `cache_rows` (T,) and attention reads cache rows
        0..S-1 under `mask` (T, S) bool (True = may attend). Without one (training): causal over T.
        Returns logits (B, T, V) and, with capture=True, the EAGLE-3 features (B, T, 3*dim): the
        residual stream at the input of layers 2, L//2 and L-3, concatenated low|mid|high.
        """
        if self.rope is None or (cache_rows is None and self.rope.shape[0] < tokens.shape[-1]):
            # no cache (training): positions are 0..T-1, so a table of T rows is enough
            self.rope = rope_table(self.args, tokens.shape[-1]).to(self.embed_tokens.weight.device)
        x = self.embed_tokens(tokens)                                 # (B, T, dim)
        # under CPU autocast (training) the activations' dtype varies by op: keep RoPE in float32 then
        rope = rope_at(self.rope, positions, torch.float32 if torch.is_autocast_enabled("cpu") else x.dtype)
        mask = mask_bias(mask, x.dtype)
        feats = []
        for i, layer in enumerate(self.layers):
            if capture:
                feats += [x] * self.args.capture_layers.count(i)
            x = layer(x, rope, cache_rows, mask)
        logits = self.lm_head(self.norm(x))                           # (B, T, V)
        if capture:
            return logits, torch.cat(feats, dim=-1)                   # (B, T, 3*dim)
        return logits


# ----------------------------------------------------------------------------- checkpoints

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.bin", "*.txt", "*.jinja"]


def resolve_checkpoint(ckpt: str, patterns=None) -> str:
    """A local folder, a .gguf file (or a folder holding exactly one and no config.json), or a Hugging
    Face hub id downloaded (json, safetensors, tokenizer) to the hub cache."""
    if is_gguf(ckpt):
        return ckpt
    if os.path.isdir(ckpt):
        return gguf_in_folder(ckpt) or ckpt
    if os.path.isfile(ckpt):
        raise GraftError(f"{ckpt} is a file but not a .gguf: pass a checkpoint folder, a .gguf file or a hub id")
    if ckpt.endswith(".gguf"):
        raise GraftError(f"GGUF file not found: {ckpt}")
    looks_like_hub = ckpt.count("/") == 1 and not ckpt.startswith((".", "/", "~")) and not os.path.exists(ckpt)
    if not looks_like_hub:
        raise GraftError(f"checkpoint folder not found: {ckpt}")
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(ckpt, allow_patterns=patterns or HUB_PATTERNS, local_files_only=offline)
    except Exception as e:  # hub errors are many and verbose; the user needs one line
        reason = type(e).__name__
        if offline or "offline" in str(e).lower() or "LocalEntryNotFound" in reason:
            raise GraftError(f"{ckpt} is not in the local hub cache and the hub is offline "
                             f"(HF_HUB_OFFLINE is set or there is no network)") from None
        raise GraftError(f"could not fetch {ckpt} from the hub: {reason}: {str(e).splitlines()[0][:200]}") from None


def read_config(path: str) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise GraftError(f"no config.json in {path}")
    try:
        with open(f) as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise GraftError(f"malformed config.json in {path}: {e}") from None


def weight_files(path: str) -> list:
    """The weight files of a checkpoint folder: model.safetensors or its shards, else (older checkpoints
    such as Vicuna's) pytorch_model.bin or its shards."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if os.path.isfile(os.path.join(path, index)) or os.path.isfile(os.path.join(path, single)):
            return _files_of(path, single, index)
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if found:
        return [os.path.join(path, f) for f in found]
    raise GraftError(f"no model.safetensors (or sharded index) in {path}")


def _files_of(path: str, single: str, index_name: str) -> list:
    index = os.path.join(path, index_name)
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                shards = sorted(set(json.load(fh)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise GraftError(f"malformed {index}: {e}") from None
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise GraftError(f"missing shard {missing[0]} listed in {index}")
        return [os.path.join(path, s) for s in shards]
    return [os.path.join(path, single)]


def check_finite(name: str, t: torch.Tensor) -> None:
    """Refuse a floating weight holding NaN or inf (a corrupt or badly converted checkpoint, or an fp32
    value past the range of the dtype it was cast to). One sum per tensor: any NaN or inf makes it
    non-finite; only then (or when finite weights merely overflow the sum) is every element checked."""
    if t.is_floating_point() and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
        raise GraftError(f"weight {name} holds NaN or inf values: refusing a corrupt checkpoint")


def read_safetensors(files: list, device="cpu", dtype=None, keep=None) -> dict:
    """Memory-mapped read; tensors are cast to `dtype` (floating ones only) on their way to `device`.
    A tensor holding NaN or inf is refused (check_finite)."""
    from safetensors import safe_open
    out = {}
    for f in files:
        if f.endswith(".bin"):  # weights_only: tensors only, never arbitrary pickled code
            try:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise GraftError(f"cannot read {f}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
            for name, t in sd.items():
                if keep is None or keep(name):
                    out[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).to(device)
                    check_finite(f"{f}: {name}", out[name])
            continue
        try:
            with safe_open(f, framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    if keep is not None and not keep(name):
                        continue
                    t = fh.get_tensor(name)
                    if dtype is not None and t.is_floating_point():
                        t = t.to(dtype)
                    out[name] = t.to(device)
                    check_finite(f"{f}: {name}", out[name])  # on the device: a GPU checks fastest
        except GraftError:
            raise
        except Exception as e:
            raise GraftError(f"cannot read {f}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    return out


# ----------------------------------------------------------------------------- GGUF checkpoints
#
# A .gguf file (llama.cpp's format, ggml-org/ggml docs/gguf.md) carries the config as metadata under
# llama.cpp's key names, the tensors (float or block-quantized) and the tokenizer. It is read with ggml-org's
# own `gguf` package. Quantized tensors are dequantized once, at load, to the requested dtype: the
# dequantized weights *are* the model (every forward runs in that dtype, never on the blocks).

GGUF_ARCHS = ("llama", "qwen3")
# ggml tensor types dequantized here (gguf.quants: a numpy port of ggml-quants.c's reference code)
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# the {arch}.* metadata read here. Any other key of the architecture describes something this engine does
# not implement (experts, sliding windows, logit scaling, partial RoPE...), so it is refused, not dropped.
GGUF_ARCH_KEYS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.finetuned", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
    "tensor_data_layout",  # informational: the layout of the source checkpoint
}
# llama.cpp tensor names (gguf.constants, written by convert_hf_to_gguf.py) -> model.py parameter names
GGUF_GLOBAL = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
GGUF_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
              "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def gguf_in_folder(path: str) -> str | None:
    """The one .gguf file of a folder that has no config.json; None when it has a config.json or no .gguf."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(found) > 1:
        raise GraftError(f"{path} holds {len(found)} .gguf files and no config.json: pass one of them as --ckpt")
    return os.path.join(path, found[0]) if found else None


@functools.cache
def _reader_class():
    import gguf
    import numpy as np

    class Reader(gguf.GGUFReader):
        """gguf.GGUFReader, faster. It slices its np.memmap once per metadata value (about 250k slices for a
        49k-token vocabulary) and np.memmap's per-slice bookkeeping makes that ~6 s; slicing a plain
        ndarray view of the same mapping gives the same arrays in a third of the time. This overrides
        the reader's slicing helper; tests/test_gguf.py compares the result with gguf.GGUFReader's."""

        def _get(self, offset, dtype, count=1, override_order=None):
            if "_plain" not in self.__dict__:
                self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = self._plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return Reader


@functools.lru_cache(maxsize=1)
def _gguf_open(path: str, size: int, mtime_ns: int) -> tuple:
    reader = _reader_class()(path)
    return reader, {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def gguf_read(path: str) -> tuple:
    """(gguf.GGUFReader, metadata dict of Python values) for a .gguf file, memory-mapped. The last file
    read stays open (keyed by size and mtime): the tokenizer and then the weights read the same file.
    Anything that is not a readable GGUF (truncated, foreign, bad strings) is a one-line GraftError."""
    st = os.stat(path)
    try:
        return _gguf_open(os.path.abspath(path), st.st_size, st.st_mtime_ns)
    except Exception as e:  # a broken file fails inside the reader in many ways; the user needs one line
        why = str(e).splitlines()[0][:200] if str(e) else ""
        raise GraftError(f"cannot read {path} as GGUF: {type(e).__name__}: {why}") from None


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def gguf_special_ids(meta: dict, vocab_size: int, path: str) -> tuple:
    """(bos id or None, eos ids) from tokenizer.ggml.*: EOS is eos_token_id plus the end-of-turn and
    end-of-message ids (eot, eom) when the file names them (an instruct model's <|im_end|>, <|eot_id|>)."""
    def tid(key):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size):
            raise GraftError(f"{path}: GGUF metadata tokenizer.ggml.{key} = {_short(v)} is not a token id "
                             f"(vocabulary of {vocab_size})")
        return v
    eos = [i for i in (tid("eos_token_id"), tid("eot_token_id"), tid("eom_token_id")) if i is not None]
    return tid("bos_token_id"), sorted(set(eos))


def gguf_model_args(meta: dict, tensors: dict, path: str) -> ModelArgs:
    """ModelArgs from GGUF metadata (llama.cpp's {arch}.* keys) and the tensor list (vocabulary size from
    token_embd, tied head when there is no output.weight, Llama-3.1 RoPE factors from rope_freqs).
    Every value is validated; a bad or unsupported one is a GraftError naming the key."""
    arch = meta.get("general.architecture")
    if meta.get("split.count", 1) != 1:
        raise GraftError(f"{path} is one part of a split GGUF ({_short(meta['split.count'])} files): "
                         f"merge them first (llama-gguf-split --merge)")
    if arch not in GGUF_ARCHS:
        raise GraftError(f"{path}: unsupported GGUF architecture {_short(arch)}: supported are {', '.join(GGUF_ARCHS)}")
    extra = sorted(k for k in meta if k.startswith(arch + ".") and k[len(arch) + 1:] not in GGUF_ARCH_KEYS)
    if extra:
        raise GraftError(f"{path}: GGUF metadata {extra[0]} = {_short(meta[extra[0]])} describes something "
                         f"this engine does not implement")

    def get(key, kind=int, default=None):
        v = meta.get(f"{arch}.{key}", default)
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
        if not (number and math.isfinite(v) and v > 0):
            got = "missing" if v is None else f"{_short(v)}"
            raise GraftError(f"{path}: GGUF metadata {arch}.{key} must be a positive "
                             f"{'integer' if kind is int else 'number'}, got {got}")
        return kind(v)

    dim, n_heads = get("embedding_length"), get("attention.head_count")
    n_kv = get("attention.head_count_kv", default=n_heads)        # llama.cpp's default: no GQA
    if f"{arch}.attention.key_length" not in meta and dim % n_heads:
        raise GraftError(f"{path}: embedding_length {dim} is not a multiple of head_count {n_heads} "
                         f"and there is no attention.key_length")
    head_dim = get("attention.key_length", default=dim // n_heads)
    if n_heads % n_kv:
        raise GraftError(f"{path}: head_count {n_heads} is not a multiple of head_count_kv {n_kv}")
    if get("attention.value_length", default=head_dim) != head_dim:
        raise GraftError(f"{path}: attention.value_length differs from key_length {head_dim}: not supported")
    if get("rope.dimension_count", default=head_dim) != head_dim:
        raise GraftError(f"{path}: RoPE rotates {meta[f'{arch}.rope.dimension_count']} of {head_dim} "
                         f"head dimensions: partial RoPE is not supported")
    emb = tensors.get("token_embd.weight")
    if emb is None or len(emb.shape) != 2:
        raise GraftError(f"{path}: GGUF file lacks a 2-d tensor token_embd.weight")
    vocab = int(emb.shape[1])                                     # GGUF lists dims innermost first
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != vocab:
        raise GraftError(f"{path}: {len(tokens)} tokens in tokenizer.ggml.tokens but token_embd has {vocab} rows")
    if f"{arch}.vocab_size" in meta and get("vocab_size") != vocab:
        raise GraftError(f"{path}: {arch}.vocab_size {meta[f'{arch}.vocab_size']} but token_embd has {vocab} rows")

    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        scaling = None
    elif kind == "linear":
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor", float)}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": get("rope.scaling.factor", float),
                   "original_max_position_embeddings": get("rope.scaling.original_context_length")}
        for ours, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if f"{arch}.rope.scaling.{key}" in meta:
                scaling[ours] = get(f"rope.scaling.{key}", float)
    else:
        raise GraftError(f"{path}: unsupported {arch}.rope.scaling.type {_short(kind)}: supported are none, linear, yarn")
    if "rope_freqs.weight" in tensors:  # convert_hf_to_gguf.py writes Llama 3.1's rope_type llama3 this way
        f = tensors["rope_freqs.weight"]
        if arch != "llama" or scaling is not None or tuple(int(d) for d in f.shape) != (head_dim // 2,):
            raise GraftError(f"{path}: unexpected rope_freqs.weight {tuple(int(d) for d in f.shape)} "
                             f"({arch}, head_dim {head_dim}, rope scaling {kind})")
        factors = gguf_tensor(f)
        if not (torch.isfinite(factors).all() and (factors > 0).all()):
            raise GraftError(f"{path}: rope_freqs.weight holds non-positive or non-finite factors")
        scaling = {"rope_type": "freq_factors", "factors": factors.tolist()}

    bos, eos = gguf_special_ids(meta, vocab, path)
    return ModelArgs(
        arch=arch, vocab_size=vocab, dim=dim, n_layers=get("block_count"), n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, intermediate_size=get("feed_forward_length"),
        norm_eps=get("attention.layer_norm_rms_epsilon", float),
        rope_theta=get("rope.freq_base", float, default=10000.0),  # llama.cpp's default
        rope_scaling=scaling, max_position_embeddings=get("context_length"),
        tie_word_embeddings="output.weight" not in tensors, qk_norm=arch == "qwen3",
        bos_token_id=bos, eos_token_ids=eos)


def gguf_tensor(t) -> torch.Tensor:
    """One GGUF tensor (a gguf.ReaderTensor) as float32, in torch's dim order: GGUF lists dims innermost
    first, so ggml's [in, out] is torch's (out, in). Blocks are dequantized by gguf.quants.dequantize.
    A type outside GGUF_TYPES is a GraftError."""
    from gguf import quants
    if t.tensor_type.name not in GGUF_TYPES:
        raise GraftError(f"GGUF tensor {t.name} is stored as {t.tensor_type.name}: supported are {', '.join(GGUF_TYPES)}")
    x = quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape.tolist())])
    if not x.flags.writeable:  # F32 comes back as a view of the read-only mapping
        x = x.copy()
    return torch.from_numpy(x)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute of q/k rows: llama.cpp's Llama rotates adjacent
    pairs, model.py (like HF) rotates halves, so each head's rows go back from (d/2, 2) to (2, d/2)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf(path: str, device="cpu", dtype=torch.float32) -> tuple:
    """(ModelArgs, state dict under model.py's names) from a .gguf file: every tensor mapped from
    llama.cpp's name (an unknown, missing or misshapen one is a GraftError before anything is
    dequantized), dequantized to `dtype` on `device`, Llama's q/k rows un-permuted, NaN/inf refused.
    A tied head (no output.weight) is left for load_model to tie."""
    reader, meta = gguf_read(path)
    tensors = {t.name: t for t in reader.tensors}
    args = gguf_model_args(meta, tensors, path)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    if args.tie_word_embeddings:
        del expected["lm_head.weight"]
    # the llama.cpp name of every tensor this config has
    names = {f"{g}.weight": f"{o}.weight" for g, o in GGUF_GLOBAL.items()}
    names |= {f"blk.{i}.{g}.weight": f"layers.{i}.{o}.weight" for i in range(args.n_layers) for g, o in GGUF_LAYER.items()}
    names = {g: o for g, o in names.items() if o in expected}
    for name, t in tensors.items():
        if name == "rope_freqs.weight":                           # already in args.rope_scaling
            continue
        if name not in names:
            raise GraftError(f"{path}: GGUF tensor {name} has no place in this {args.arch} model "
                             f"({args.n_layers} layers): not supported")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != expected[names[name]]:
            raise GraftError(f"{path}: GGUF tensor {name} has shape {shape}, the metadata implies "
                             f"{expected[names[name]]}")
        if t.tensor_type.name not in GGUF_TYPES:
            raise GraftError(f"{path}: GGUF tensor {name} is stored as {t.tensor_type.name}: "
                             f"supported are {', '.join(GGUF_TYPES)}")
    missing = [g for g in names if g not in tensors]
    if missing:
        raise GraftError(f"{path}: GGUF file lacks tensor {missing[0]} ({len(missing)} missing)")
    sd = {}
    for name, ours in names.items():
        w = gguf_tensor(tensors[name])
        if args.arch == "llama" and ours.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute(w, args.n_heads if "q_proj" in ours else args.n_kv_heads)
        sd[ours] = w.to(device, dtype)
        check_finite(f"{path}: {name}", sd[ours])
    return args, sd


# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe) by tokenizer.ggml.pre: applied
# in order, each splitting the pieces the one before left, matches and gaps alike kept as pieces.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"],   # also when pre is absent
    "gpt-2": [_GPT2_RE],
    "smollm": [r"\p{N}", _GPT2_RE],                                # digits one by one, then GPT-2's
    "llama-bpe": [_LLAMA3_RE], "llama3": [_LLAMA3_RE], "llama-v3": [_LLAMA3_RE],
    "qwen2": [_QWEN2_RE], "deepseek-r1-qwen": [_QWEN2_RE],
}
# llama.cpp's Llama-3 pre-tokenizer adds BOS by default and takes a piece that is itself a token whole
_GGUF_LLAMA3 = {"llama-bpe", "llama3", "llama-v3"}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6   # tokenizer.ggml.token_type


def _spm_merges(tokens: list, scores: list, types: list, path: str) -> list:
    """Ranked BPE merges that reproduce llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm): it
    repeatedly merges the adjacent pair whose concatenation is the best-scoring token, so every split of
    every normal token into two vocabulary pieces is a merge, ranked by that token's score."""
    ids = {t: i for i, t in enumerate(tokens)}
    out, seen = [], {}
    for i, t in enumerate(tokens):
        if types[i] not in (NORMAL, UNUSED) or len(t) < 2:
            continue
        if scores[i] in seen:  # ranked merges cannot express llama.cpp's leftmost-first tie-break
            raise GraftError(f"{path}: tokens {tokens[seen[scores[i]]]!r} and {t!r} share the score {scores[i]}: "
                             f"the merge order is not defined by tokenizer.ggml.scores")
        seen[scores[i]] = i
        out += [(-scores[i], ids[t[:k]], ids[t[k:]]) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids]
    out.sort()
    return [(tokens[a], tokens[b]) for _, a, b in out]


def gguf_tokenizer(meta: dict, path: str):
    """A tokenizers.Tokenizer rebuilt from GGUF tokenizer metadata to tokenize as llama.cpp does
    (src/llama-vocab.cpp); transformers is not needed.

    tokenizer.ggml.model "gpt2": byte-level BPE from tokens + merges, split first by the regexes of
    tokenizer.ggml.pre (GGUF_PRE; an unknown one is a GraftError). "llama": SentencePiece from tokens +
    scores, byte fallback to the <0xXX> tokens, spaces as "▁" with a dummy "▁" prefix unless
    tokenizer.ggml.add_space_prefix is false. Control and unknown tokens (token_type 3, 2) are special
    (matched whole, skipped when decoding), user-defined ones (4) are matched whole. BOS/EOS are added
    as tokenizer.ggml.add_bos_token/add_eos_token say, with llama.cpp's defaults (BOS for SentencePiece
    and Llama-3 BPE)."""
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors
    tokens, kind = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.model")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise GraftError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens string list")
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type", [NORMAL] * n)
    if not isinstance(types, list) or len(types) != n:
        raise GraftError(f"{path}: tokenizer.ggml.token_type does not give one type per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != n:
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise GraftError(f"{path}: token {dup!r} appears twice in tokenizer.ggml.tokens")
    try:
        if kind == "gpt2":
            pre = meta.get("tokenizer.ggml.pre", "default")
            if pre not in GGUF_PRE:
                raise GraftError(f"{path}: unsupported tokenizer.ggml.pre {_short(pre)}: supported are "
                                 f"{', '.join(GGUF_PRE)}")
            merges = meta.get("tokenizer.ggml.merges")
            if not isinstance(merges, list) or any(not isinstance(m, str) or m.find(" ", 1) < 0 for m in merges):
                raise GraftError(f"{path}: a byte-level BPE GGUF needs tokenizer.ggml.merges as 'left right' strings")
            pairs = [(m[:m.find(" ", 1)], m[m.find(" ", 1) + 1:]) for m in merges]  # as llama.cpp splits them
            tk = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=pre in _GGUF_LLAMA3))
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), "isolated") for r in GGUF_PRE[pre]]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            tk.decoder = decoders.ByteLevel()
            add_bos = pre in _GGUF_LLAMA3
        elif kind == "llama":
            scores = meta.get("tokenizer.ggml.scores")
            if not isinstance(scores, list) or len(scores) != n:
                raise GraftError(f"{path}: a SentencePiece GGUF needs one tokenizer.ggml.scores value per token")
            unk = meta.get("tokenizer.ggml.unknown_token_id")
            unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < n else None
            tk = HFTokenizer(models.BPE(vocab, _spm_merges(tokens, scores, types, path), unk_token=unk,
                                        byte_fallback=True, fuse_unk=True))
            # llama.cpp's SentencePiece path writes spaces as "▁" and puts one in front of the text and after
            # each special token (its tokenizer.ggml.remove_extra_whitespaces is not applied there either)
            prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
            tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁")] * bool(prefix)
                                                 + [normalizers.Replace(" ", "▁")])
            tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                           + [decoders.Strip(" ", 1, 0)] * bool(prefix))
            add_bos = True
        else:
            raise GraftError(f"{path}: unsupported tokenizer.ggml.model {_short(kind)}: supported are gpt2 "
                             f"(byte-level BPE) and llama (SentencePiece)")
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
        tk.add_tokens([AddedToken(t, special=False, normalized=False)
                       for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    except GraftError:
        raise
    except Exception as e:  # tokenizers rejecting the vocabulary or merges
        raise GraftError(f"{path}: bad GGUF tokenizer: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    bos, _ = gguf_special_ids(meta, n, path)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", add_bos)
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    for key, v in (("add_bos_token", add_bos), ("add_eos_token", add_eos),
                   ("add_space_prefix", meta.get("tokenizer.ggml.add_space_prefix", True))):
        if not isinstance(v, bool):
            raise GraftError(f"{path}: tokenizer.ggml.{key} = {_short(v)} is not a bool")
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise GraftError(f"{path}: the GGUF tokenizer adds {'BOS' if add_bos and bos is None else 'EOS'} "
                         f"but names no such token id")
    ends = [i for i, on in ((bos, add_bos), (eos, add_eos)) if on]
    if ends:
        tk.post_processor = processors.TemplateProcessing(
            single=[tokens[bos]] * bool(add_bos) + ["$A"] + [tokens[eos]] * bool(add_eos),
            special_tokens=[(tokens[i], i) for i in ends])
    return tk


def load_model(ckpt: str, device="cpu", dtype=torch.float32, max_seq_len: int | None = None) -> Transformer:
    """Build the model from its config and load its weights (a folder, a hub id or a .gguf file, see
    resolve_checkpoint); the KV cache holds max_seq_len positions (default: the model's own context)."""
    path = resolve_checkpoint(ckpt)
    if is_gguf(path):
        args, sd = read_gguf(path, device, dtype)
    else:
        args = ModelArgs.from_hf_config(read_config(path))
        sd = read_safetensors(weight_files(path), device, dtype, keep=lambda n: "rotary_emb" not in n)
        sd = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
    with torch.device("meta"):
        model = Transformer(args)
    tied = args.tie_word_embeddings or "lm_head.weight" not in sd  # a missing head can only be tied
    if tied and "embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    expected = dict(model.state_dict())
    missing = [k for k in expected if k not in sd]
    if missing:
        raise GraftError(f"checkpoint {path} lacks weight {missing[0]} ({len(missing)} missing)")
    for k, t in expected.items():
        if tuple(sd[k].shape) != tuple(t.shape):
            raise GraftError(f"weight {k} has shape {tuple(sd[k].shape)}, config implies {tuple(t.shape)}")
    model.load_state_dict({k: sd[k] for k in expected}, assign=True, strict=True)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    model.path = path
    model.eval()
    model.setup_caches(max_seq_len or args.max_position_embeddings)
    return model


# ----------------------------------------------------------------------------- tokenizer

def _read_json(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise GraftError(f"malformed {path}: {e}") from None


class Tokenizer:
    """tokenizer.json through `tokenizers`; special tokens and the chat template from tokenizer_config.json."""

    def __init__(self, path: str, model_args: ModelArgs | None = None):
        from tokenizers import Tokenizer as HFTokenizer
        f = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(f):
            raise GraftError(f"no tokenizer.json in {path}")
        self.tk = HFTokenizer.from_file(f)
        cfg = {}
        cf = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cf):
            cfg = _read_json(cf)
        self.chat_template = cfg.get("chat_template")
        jt = os.path.join(path, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(jt):
            with open(jt) as fh:
                self.chat_template = fh.read()
        tok = lambda v: v.get("content") if isinstance(v, dict) else v
        self.bos_token, self.eos_token = tok(cfg.get("bos_token")), tok(cfg.get("eos_token"))
        self.bos_id = model_args.bos_token_id if model_args else None
        if self.bos_id is None and self.bos_token:
            self.bos_id = self.tk.token_to_id(self.bos_token)
        eos = set(model_args.eos_token_ids if model_args else [])
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            g = _read_json(gen).get("eos_token_id")
            eos |= set([g] if isinstance(g, int) else (g or []))
        if self.eos_token and self.tk.token_to_id(self.eos_token) is not None:
            eos.add(self.tk.token_to_id(self.eos_token))
        self.eos_ids = sorted(eos)

    @classmethod
    def from_gguf(cls, path: str, model_args: ModelArgs | None = None) -> "Tokenizer":
        """The tokenizer a .gguf file describes in its metadata (gguf_tokenizer), its chat template
        (tokenizer.chat_template) and special tokens; BOS/EOS ids from model_args when given."""
        _, meta = gguf_read(path)
        self = cls.__new__(cls)
        self.tk = gguf_tokenizer(meta, path)
        tokens = meta["tokenizer.ggml.tokens"]
        bos, eos = gguf_special_ids(meta, len(tokens), path)
        if model_args is not None:
            bos, eos = model_args.bos_token_id, sorted(set(model_args.eos_token_ids) | set(eos))
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise GraftError(f"{path}: tokenizer.chat_template is not a string")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        self.chat_template, self.bos_id, self.eos_ids = template, bos, eos
        self.bos_token = tokens[bos] if bos is not None else None
        self.eos_token = tokens[eos_id] if eos_id in eos else None
        return self

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids if text else []
        if add_special_tokens and not ids and self.bos_id is not None:
            ids = [self.bos_id]  # an empty prompt is just BOS (generation "from BOS")
        return ids

    def decode(self, ids: list) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=True)

    def apply_chat(self, user_text: str) -> list:
        """Render one user turn with the checkpoint's own chat template, ready for the reply."""
        if not self.chat_template:
            raise GraftError("--chat: this checkpoint has no chat_template in tokenizer_config.json")
        import jinja2
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(GraftError(f"chat template: {msg}"))
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
        try:
            text = env.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": user_text}], add_generation_prompt=True,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", enable_thinking=False)
        except jinja2.TemplateError as e:
            raise GraftError(f"chat template: {type(e).__name__}: {e}") from None
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(ckpt: str, model_args: ModelArgs | None = None) -> Tokenizer:
    path = resolve_checkpoint(ckpt)
    if is_gguf(path):
        return Tokenizer.from_gguf(path, model_args)
    return Tokenizer(path, model_args or ModelArgs.from_hf_config(read_config(path)))
