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
import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


class GraftError(Exception):
    """Bad input (checkpoint, prompt, flags): the CLI prints the message on one line and exits."""


SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------- config

_REQUIRED = object()
_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "true or false"}


class Fields:
    """Typed reads of one JSON object read from a file (a config), with one-line errors that name the
    file and the field. A field set to null counts as absent, as transformers treats it."""

    def __init__(self, obj, what: str):
        if not isinstance(obj, dict):
            raise GraftError(f"{what}: expected a JSON object, got {type(obj).__name__}")
        self.obj, self.what = obj, what

    def _raw(self, key, default):
        v = self.obj.get(key)
        if v is None:
            if default is _REQUIRED:
                raise GraftError(f"malformed {self.what}: missing field {key!r}")
            return _REQUIRED
        return v

    def get(self, key, kind, default=_REQUIRED):
        v = self._raw(key, default)
        if v is _REQUIRED:
            return default
        if not isinstance(v, kind):
            raise GraftError(f"malformed {self.what}: {key} must be {_JSON_TYPES[kind]}, got {v!r:.60}")
        return v

    def int(self, key, default=_REQUIRED, lo: int = 1, hi: int = 2 ** 31 - 1):
        v = self._raw(key, default)
        if v is _REQUIRED:
            return default
        if type(v) is not int or not lo <= v <= hi:
            raise GraftError(f"malformed {self.what}: {key} must be an integer in [{lo}, {hi}], got {v!r:.60}")
        return v

    def float(self, key, default=_REQUIRED, positive: bool = True):
        v = self._raw(key, default)
        if v is _REQUIRED:
            return default
        if type(v) not in (int, float) or not math.isfinite(v) or (positive and v <= 0):
            raise GraftError(f"malformed {self.what}: {key} must be a finite {'positive ' if positive else ''}"
                             f"number, got {v!r:.60}")
        return float(v)

    def ids(self, key, vocab: int) -> list:
        """A token id or a list of them (EOS may be several), each in [0, vocab)."""
        v = self._raw(key, [])
        if v is _REQUIRED or v == []:
            return []
        ids = v if isinstance(v, list) else [v]
        if not all(type(i) is int and 0 <= i < vocab for i in ids):
            raise GraftError(f"malformed {self.what}: {key} must be token ids in [0, {vocab}), got {v!r:.60}")
        return list(ids)


# the keys each RoPE scaling type needs (transformers' rope_config_validation), all positive numbers
ROPE_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def read_rope(cfg: dict, what: str, default_theta: float = 10000.0) -> tuple:
    """(rope_theta, rope_scaling or None) from a config, in either form transformers writes:
    `rope_theta` + `rope_scaling` at the top (transformers 4), or both inside `rope_parameters`
    (transformers 5). One reader for targets and draft heads, so both read RoPE the same way.
    `dynamic` NTK scaling only acts past max_position_embeddings, which the cache never reaches, so
    it reads as plain RoPE. Errors: GraftError for an unknown type or a missing or bad key."""
    c = Fields(cfg, what)
    params, scaling = c.get("rope_parameters", dict, None), c.get("rope_scaling", dict, None)
    theta = cfg.get("rope_theta")
    if theta is None:
        theta = (params or {}).get("rope_theta", (scaling or {}).get("rope_theta", default_theta))
    theta = Fields({"rope_theta": theta}, what).float("rope_theta")
    scaling = scaling or params
    if not scaling:
        return theta, None
    s = Fields(scaling, f"{what} rope_scaling")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default", "dynamic"):
        return theta, None
    if kind not in ROPE_KEYS:
        raise GraftError(f"unsupported rope_scaling type {kind!r}: supported are linear, llama3, yarn")
    for key in ROPE_KEYS[kind]:
        s.float(key)
    for key in ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim"):
        s.float(key, None)
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise GraftError(f"malformed {what}: llama3 rope_scaling needs high_freq_factor > low_freq_factor")
    return theta, dict(scaling)


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
    # Qwen3-MoE: layers whose MLP is a sparse block of n_experts experts, top-k routed
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple = ()            # per layer: True = sparse MoE block, False = dense MLP

    @classmethod
    def from_hf_config(cls, cfg, what: str = "config.json") -> "ModelArgs":
        """Read a transformers config.json (Llama or Qwen3), checking every field it uses.

        Errors: GraftError, one line naming the file and the field, for anything malformed,
        inconsistent (heads that do not divide, an odd head_dim) or unsupported (another
        architecture, activation or RoPE type). Nothing is guessed from a bad value."""
        c = Fields(cfg, what)
        archs = c.get("architectures", list, [])
        if not all(isinstance(a, str) for a in archs):
            raise GraftError(f"{what}: architectures must be a list of names")
        arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
        if arch is None and not archs:
            arch = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}.get(c.get("model_type", str, ""))
        if arch is None:
            raise GraftError(f"unsupported architecture {archs or cfg.get('model_type')}: "
                             f"supported are {', '.join(SUPPORTED)}")
        if c.get("hidden_act", str, "silu") != "silu":
            raise GraftError(f"{what}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        for flag in ("mlp_bias", "use_sliding_window"):
            if c.get(flag, bool, False):
                raise GraftError(f"{what}: {flag}=true is not supported")
        dim, n_heads = c.int("hidden_size"), c.int("num_attention_heads")
        n_kv = c.int("num_key_value_heads", n_heads)
        if n_heads % n_kv:
            raise GraftError(f"{what}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        head_dim = c.int("head_dim", None)
        if head_dim is None:
            if dim % n_heads:
                raise GraftError(f"{what}: hidden_size {dim} is not a multiple of num_attention_heads {n_heads} "
                                 f"and there is no head_dim")
            head_dim = dim // n_heads
        if head_dim % 2:
            raise GraftError(f"{what}: head_dim {head_dim} is odd; RoPE rotates pairs")
        vocab = c.int("vocab_size")
        layers = c.int("num_hidden_layers")
        theta, scaling = read_rope(cfg, what)
        moe = {}
        if arch == "qwen3_moe":        # transformers' Qwen3MoeConfig (num_local_experts: transformers 5's name)
            E = c.int("num_experts", None) or c.int("num_local_experts")
            step = c.int("decoder_sparse_step", 1)
            dense = c.get("mlp_only_layers", list, [])
            if not all(type(i) is int and 0 <= i < layers for i in dense):
                raise GraftError(f"malformed {what}: mlp_only_layers must be layer indices in [0, {layers})")
            moe = dict(n_experts=E, n_experts_per_tok=c.int("num_experts_per_tok", hi=E),
                       moe_intermediate_size=c.int("moe_intermediate_size"),
                       norm_topk_prob=c.get("norm_topk_prob", bool, False),
                       sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)))
        return cls(
            arch=arch, vocab_size=vocab, dim=dim, n_layers=layers, n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, intermediate_size=c.int("intermediate_size"),
            norm_eps=c.float("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=c.int("max_position_embeddings", 4096),
            tie_word_embeddings=c.get("tie_word_embeddings", bool, False),
            attention_bias=c.get("attention_bias", bool, False), qk_norm=arch in ("qwen3", "qwen3_moe"),
            bos_token_id=c.int("bos_token_id", None, lo=0, hi=vocab - 1),
            eos_token_ids=c.ids("eos_token_id", vocab), **moe)

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


def cache_rows(n: int) -> int:
    """n rounded up to a multiple of 16. With full attention a step reads every row, and the
    memory-efficient SDPA kernel pads a mask whose last dimension is not 16-aligned on every call."""
    return -(-n // 16) * 16


class KVCache:
    """Keys and values of every layer, (B, H_kv, rows, D) each, preallocated and written at explicit
    rows (gpt-fast's static cache). A plain object, not module buffers: compiled steps take it as an
    input (inductor's freezing would fold buffers into constants), and every layer's k and v are
    separate tensors, so that writing a row never rewrites a shared base."""

    def __init__(self, n_layers: int, batch: int, n_kv: int, rows: int, head_dim: int, dtype, device):
        shape = (batch, n_kv, rows, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.rows = rows

    def layer(self, i: int) -> tuple:
        return self.k[i], self.v[i]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor):
        """KV compaction: rows `src` (n,) become rows `dst` (n,) in every layer. Gathered first, so
        overlapping source and destination rows are safe."""
        for t in self.k + self.v:
            t.index_copy_(2, dst, t.index_select(2, src))

    def tensors(self) -> list:
        return self.k + self.v


def attention_mask(tree: torch.Tensor, L: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Which cache rows each of N new rows may read: (N, n_keys) bool, n_keys = cols.numel().

    The round's rows start at cache row L (the committed length, a 0-d tensor) and span W rows;
    tree (N, W) says which of them each new row sees (itself and its ancestors; a causal triangle for
    a prefill chunk). Committed rows (< L) are visible to all, rows past the round's to none. `cols` is
    arange(n_keys): the whole cache (a static shape, for CUDA graphs) or just the rows up to the
    round's last (a size that varies; on a CPU reading less is faster)."""
    N, W = tree.shape
    rel = cols[None, :] - L                                            # (1, n_keys): row - L
    inside = (rel >= 0) & (rel < W)
    seen = tree.gather(1, rel.clamp(0, W - 1).expand(N, -1))          # (N, n_keys)
    return (rel < 0) | (inside & seen)


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

    def forward(self, x, rope, rows=None, mask=None, kv=None, steps_kv=None, keep=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if kv is not None:
            # the new rows go into the cache first; then every query reads cache rows 0..n_keys-1.
            # Padding rows (keep False) write zeros: a row nobody may see must still be finite, since
            # with full attention its keys and values meet the mask's zero weights (0 * NaN = NaN).
            kc, vc = kv
            if keep is not None:
                k = torch.where(keep[:, None], k, 0.0)
                v = torch.where(keep[:, None], v, 0.0)
            kc.index_copy_(2, rows, k)
            vc.index_copy_(2, rows, v)
            n_keys = mask.shape[-1]
            k, v = kc[:, :, :n_keys], vc[:, :, :n_keys]
        elif steps_kv is not None:
            # EAGLE-3 training-time test: the keys of the earlier unrolled steps come first
            steps_kv.append((k, v))
            k, v = torch.cat([kv[0] for kv in steps_kv], 2), torch.cat([kv[1] for kv in steps_kv], 2)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        else:
            y = grouped_attention(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


def grouped_attention(q, k, v, mask):
    """Masked grouped-query attention without expanding K and V: the G = H / H_kv query heads that
    share a KV head become G*T query rows against it, and the mask is tiled to match.

    q (B, H, T, D); k, v (B, H_kv, S, D); mask (T, S), or (B, 1, T, S) for a batch, bool or additive
    (no per-head masks). Returns (B, H, T, D).
    Why: with a mask, flash attention is out and the memory-efficient kernel takes no GQA (torch 2.11
    on CUDA), so `enable_gqa=True` lands on the math kernel, which copies K and V to every query head
    and upcasts them: the whole cache, several times per layer per step. Folded, every backend sees
    plain multi-head attention with H_kv heads (query head h reads KV head h // G, as HF's repeat_kv)."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if H == Hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, D)                                   # row g*T + t: head kv*G + g, token t
    tiled = mask.repeat(*[1] * (mask.dim() - 2), G, 1)                  # (..., G*T, S): row g*T + t is row t
    y = F.scaled_dot_product_attention(qg, k, v, attn_mask=tiled)      # (B, H_kv, G*T, D)
    return y.reshape(B, H, T, D)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Qwen3-MoE's sparse block: a router scores n_experts SwiGLU experts per token (softmax in
    float32), keeps the top k (renormalised with norm_topk_prob), and mixes their outputs by those
    weights. The experts' weights are stacked, (E, I, D) and (E, D, I), so a step picks the chosen ones
    with static shapes: for a few tokens (N*k <= E: decoding, a small tree) it gathers the N*k chosen
    experts' weights (gpt-fast's Mixtral port); for more it runs every expert on every token and
    mixes with a dense routing matrix, so each expert's weights are read once."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        E, I, D = a.n_experts, a.moe_intermediate_size, a.dim
        self.k, self.norm_topk = a.n_experts_per_tok, a.norm_topk_prob
        self.gate = nn.Linear(D, E, bias=False)                        # the router
        self.w_gate = nn.Parameter(torch.empty(E, I, D))
        self.w_up = nn.Parameter(torch.empty(E, I, D))
        self.w_down = nn.Parameter(torch.empty(E, D, I))

    def route(self, h):
        """h (N, D) -> the chosen experts (N, k) and their weights (N, k) in h's dtype."""
        probs = torch.softmax(self.gate(h).float(), dim=-1)
        w, idx = probs.topk(self.k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        return idx, w.to(h.dtype)

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)                                                 # (N, D)
        idx, w = self.route(h)
        E = self.w_gate.shape[0]
        if h.shape[0] * self.k <= E:       # gather the chosen experts: (N, k, I, D)
            a = F.silu(torch.einsum("nd,nkid->nki", h, self.w_gate[idx])) * torch.einsum("nd,nkid->nki", h, self.w_up[idx])
            y = (torch.einsum("nki,nkdi->nkd", a, self.w_down[idx]) * w[..., None]).sum(1)
        else:                              # every expert on every token: (E, N, I)
            a = F.silu(torch.einsum("nd,eid->eni", h, self.w_gate)) * torch.einsum("nd,eid->eni", h, self.w_up)
            r = torch.zeros(h.shape[0], E, dtype=h.dtype, device=h.device).scatter(1, idx, w)   # (N, E)
            y = torch.einsum("eni,edi,ne->nd", a, self.w_down, r)
        return y.reshape(B, T, D)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, i: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(a.dim, a.norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.dim, a.norm_eps)
        sparse = bool(a.sparse_layers) and a.sparse_layers[i]
        self.mlp = MoE(a) if sparse else MLP(a.dim, a.intermediate_size)

    def forward(self, x, rope, rows=None, mask=None, kv=None, keep=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, rows, mask, kv, keep=keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Parameter names follow HF's (minus the leading `model.`), so checkpoints load by name."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.n_layers))
        self.capture_layers = a.capture_layers     # EAGLE-3 feature points; a head may declare its own
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.lm_head = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.max_seq_len = 0                # committed tokens the cache holds (prompt + generated)
        self.rope = None
        self.cache: KVCache | None = None

    def setup_caches(self, max_seq_len: int, batch: int = 1, slack: int = 0):
        """Preallocate the KV cache and the RoPE table. `max_seq_len` committed tokens fit; `slack`
        rows more hold the uncommitted rows of a round (a tree, a padded prefill chunk) at the end, so
        a step never needs a shape that depends on how full the cache is."""
        p, a = self.embed_tokens.weight, self.args
        self.max_seq_len = max_seq_len
        rows = cache_rows(max_seq_len + slack)
        self.rope = rope_table(a, rows).to(p.device)
        self.cache = KVCache(a.n_layers, batch, a.n_kv_heads, rows, a.head_dim, p.dtype, p.device)

    def forward(self, tokens, positions, rows=None, mask=None, capture=False, cache=None, keep=None):
        """tokens (B, T); positions (T,) or (B, T) absolute positions for RoPE.

        With `rows` (T,): the T new rows are written there in `cache` (default: the model's own) and
        attention reads cache rows 0..n_keys-1 under `mask` (T, n_keys) bool (True = may attend);
        `keep` (T,) bool marks the real rows (padding writes zeros to the cache, see Attention).
        Without (training): causal over the T tokens. Returns logits (B, T, V) and, with
        capture=True, the EAGLE-3 features (B, T, n*dim): the residual stream at the input of the
        layers in self.capture_layers (2, L//2 and L-3 unless a head declares others; L = the output of
        the last layer, before the norm), concatenated low to high.
        """
        if self.rope is None or (rows is None and self.rope.shape[0] < tokens.shape[-1]):
            # no cache (training): positions are 0..T-1, so a table of T rows is enough
            self.rope = rope_table(self.args, tokens.shape[-1]).to(self.embed_tokens.weight.device)
        cache = cache if cache is not None else self.cache
        x = self.embed_tokens(tokens)                                 # (B, T, dim)
        # under CPU autocast (training) the activations' dtype varies by op: keep RoPE in float32 then
        rope = rope_at(self.rope, positions, torch.float32 if torch.is_autocast_enabled("cpu") else x.dtype)
        mask = mask_bias(mask, x.dtype)
        feats, points = [], self.capture_layers
        for i, layer in enumerate(self.layers):
            if capture:
                feats += [x] * points.count(i)
            x = layer(x, rope, rows, mask, cache.layer(i) if rows is not None else None, keep)
        if capture:                          # "the input of layer L": the last layer's output, before the norm
            feats += [x] * points.count(len(self.layers))
        logits = self.lm_head(self.norm(x))                           # (B, T, V)
        if capture:
            return logits, torch.cat(feats, dim=-1)                   # (B, T, n*dim)
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


def read_json(path: str, what: str | None = None):
    """A JSON file, strictly UTF-8. Errors: GraftError (one line) for unreadable or malformed files."""
    what = what or os.path.basename(path)
    try:
        with open(path, "rb") as fh:
            return json.loads(fh.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise GraftError(f"malformed {what} in {os.path.dirname(path) or '.'}: {str(e).splitlines()[0][:200]}") from None
    except OSError as e:
        raise GraftError(f"cannot read {path}: {e.strerror or e}") from None


def read_config(path: str) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise GraftError(f"no config.json in {path}")
    return read_json(f, "config.json")


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


def check_finite(name: str, t: torch.Tensor):
    """Refuse a weight holding NaN or inf (one check per tensor, at load): such a model emits garbage
    while every decoding method still agrees with every other, so nothing downstream would notice.
    One sum per tensor: any NaN or inf makes it non-finite; only then (or when finite weights merely
    overflow the sum) is every element checked."""
    if t.is_floating_point() and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
        raise GraftError(f"weight {name} holds non-finite values (NaN or inf) in {str(t.dtype).replace('torch.', '')}")


def read_safetensors(files: list, device="cpu", dtype=None, keep=None) -> dict:
    """Memory-mapped read; tensors are cast to `dtype` (floating ones only) on their way to `device`.
    pytorch_model*.bin files are read with weights_only=True (tensors and plain containers, never
    pickled code) and must hold a dict of tensors. Errors: GraftError, one line."""
    from safetensors import safe_open
    out = {}
    cast = lambda t: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).to(device)
    for f in files:
        if f.endswith(".bin"):
            try:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise GraftError(f"cannot read {f}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
            if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                                   for k, t in sd.items()):
                raise GraftError(f"{f} does not hold a dict of named tensors (found {type(sd).__name__})")
            out.update({name: cast(t) for name, t in sd.items() if keep is None or keep(name)})
            continue
        try:
            with safe_open(f, framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    if keep is None or keep(name):
                        out[name] = cast(fh.get_tensor(name))
        except Exception as e:
            raise GraftError(f"cannot read {f}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    return out


def cache_budget(args: ModelArgs, max_seq_len, dtype=torch.float32, device="cpu") -> int:
    """The KV cache length to allocate: max_seq_len (default: the model's context), checked before any
    weight loads. Refused: not a positive integer, beyond the model's context (RoPE and the model's
    training end there), or a cache larger than the memory there is."""
    n = args.max_position_embeddings if max_seq_len is None else max_seq_len
    if type(n) is not int or n < 1:
        raise GraftError(f"--max-seq-len must be a positive integer, got {n!r}")
    if n > args.max_position_embeddings:
        raise GraftError(f"--max-seq-len {n} exceeds the model's context (max_position_embeddings "
                         f"{args.max_position_embeddings})")
    need = 2 * args.n_layers * args.n_kv_heads * args.head_dim * n * torch.empty(0, dtype=dtype).element_size()
    free = free_memory(device)
    if free is not None and need > free:
        raise GraftError(f"a KV cache of {n} positions needs {need / 2**30:.1f} GiB, more than the "
                         f"{free / 2**30:.1f} GiB free on {device}: lower --max-seq-len")
    return n


def free_memory(device) -> int | None:
    """Bytes free on a device (None when unknown)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


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


def gguf_tokenizer(meta: dict, path: str, model=None):
    """A tokenizers.Tokenizer rebuilt from GGUF tokenizer metadata to tokenize as llama.cpp does
    (src/llama-vocab.cpp); transformers is not needed.

    tokenizer.ggml.model "gpt2": byte-level BPE from tokens + merges, split first by the regexes of
    tokenizer.ggml.pre (GGUF_PRE; an unknown one is a GraftError). "llama": SentencePiece from tokens +
    scores, byte fallback to the <0xXX> tokens, spaces as "▁" with a dummy "▁" prefix unless
    tokenizer.ggml.add_space_prefix is false. Control and unknown tokens (token_type 3, 2) are special
    (matched whole, skipped when decoding), user-defined ones (4) are matched whole. BOS/EOS are added
    as tokenizer.ggml.add_bos_token/add_eos_token say, with llama.cpp's defaults (BOS for SentencePiece
    and Llama-3 BPE). `model`, a tokenizers model, replaces the SentencePiece merges (a unigram
    tokenizer.model's Unigram)."""
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
            tk = HFTokenizer(model if model is not None else models.BPE(
                vocab, _spm_merges(tokens, scores, types, path), unk_token=unk, byte_fallback=True, fuse_unk=True))
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


# ----------------------------------------------------------------------------- SentencePiece tokenizer.model

def _proto(buf: bytes):
    """The (field number, value) pairs of a protobuf message (wire types 0, 1, 2, 5): the few fields of
    sentencepiece_model.proto read below, without a protobuf library."""
    def varint(i):
        v = shift = 0
        while True:
            b = buf[i]
            v |= (b & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if b < 0x80:
                return v, i
    i = 0
    while i < len(buf):
        key, i = varint(i)
        wire = key & 7
        if wire == 0:
            v, i = varint(i)
        elif wire == 2:
            n, i = varint(i)
            v, i = buf[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            v, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"wire type {wire}")
        yield key >> 3, v


def _spm_load(file: str):
    """The sentencepiece library's processor for the SentencePiece model `file`, which it reads and checks.
    Errors: GraftError, one line (no sentencepiece package, not a SentencePiece model, a damaged one)."""
    try:
        import sentencepiece
    except ImportError:
        raise GraftError(f"{file}: reading a SentencePiece tokenizer.model needs the sentencepiece package "
                         f"(pip install sentencepiece)") from None
    try:
        return sentencepiece.SentencePieceProcessor(model_file=file)
    except Exception as e:     # not a SentencePiece model, or a damaged one
        raise GraftError(f"cannot read {file} as a SentencePiece model: {str(e).splitlines()[0][:200]}") from None


def sentencepiece_tokenizer(file: str):
    """A tokenizers.Tokenizer with the vocabulary of the SentencePiece model `file` (tokenizer.model:
    Llama-2, Vicuna), for decoding and the vocabulary; Tokenizer encodes with sentencepiece itself
    (SentencePieceEncoder). Its pieces, scores and types, and the settings that change what is encoded,
    are read from the model's protobuf (sentencepiece_model.proto: TrainerSpec model_type, byte_fallback;
    NormalizerSpec name, precompiled_charsmap, add_dummy_prefix, remove_extra_whitespaces). BPE models
    become BPE merges ranked by score (as for GGUF's SentencePiece vocabularies), unigram models a Unigram
    model. Its own encode (BOS first) equals sentencepiece's on plain text, but not around user-defined
    symbols (matched before the dummy prefix is added, where sentencepiece matches them inside the
    normalized text) nor where the `tokenizers` Precompiled normalizer departs from sentencepiece's.
    Errors: GraftError, one line."""
    import struct
    from tokenizers import Regex, models, normalizers
    sp = _spm_load(file)
    try:
        pieces, trainer, norm = [], {}, {}
        for f, v in _proto(sp.serialized_model_proto()):
            if f == 1:
                p = dict(_proto(v))
                pieces.append((p[1].decode("utf-8"), struct.unpack("<f", p.get(2, b"\0\0\0\0"))[0], p.get(3, NORMAL)))
            elif f == 2:
                trainer = dict(_proto(v))
            elif f == 3:
                norm = dict(_proto(v))
    except Exception as e:     # a protobuf this reader does not follow
        raise GraftError(f"cannot read {file} as a SentencePiece model: {str(e).splitlines()[0][:200]}") from None
    kind = trainer.get(3, 1)                                 # ModelType: UNIGRAM = 1, BPE = 2
    if kind not in (1, 2):
        raise GraftError(f"{file}: SentencePiece model type {kind} is not supported (unigram and BPE are)")
    tokens, scores, types = [p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces]
    prefix, squeeze = bool(norm.get(3, 1)), bool(norm.get(4, 1))
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.add_space_prefix": prefix,
            "tokenizer.ggml.unknown_token_id": sp.unk_id(), "tokenizer.ggml.add_bos_token": sp.bos_id() >= 0}
    for key, i in (("bos", sp.bos_id()), ("eos", sp.eos_id())):
        if i >= 0:
            meta[f"tokenizer.ggml.{key}_token_id"] = i
    # unigram: scores are log-probabilities, no merge order (scores may tie)
    unigram = models.Unigram(list(zip(tokens, scores)), sp.unk_id(), bool(trainer.get(35, 0))) if kind == 1 else None
    tk = gguf_tokenizer(meta, file, unigram)
    steps = []
    name = norm.get(1, b"identity").decode()
    if name != "identity" and norm.get(2):
        steps.append(normalizers.Precompiled(norm[2]))       # the model's own character map (NFKC-style)
    if squeeze:                                              # leading, trailing and repeated spaces go
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A | \z"), "")]
    tk.normalizer = normalizers.Sequence(steps + [normalizers.Prepend("▁")] * prefix + [normalizers.Replace(" ", "▁")])
    return tk


class SentencePieceEncoder:
    """Text to ids for a checkpoint's SentencePiece tokenizer.model, through the sentencepiece library
    itself: its normalizer (nmt_nfkc, identity, ...), dummy prefix, whitespace handling, user-defined
    symbols (matched inside the normalized text, so `x<tool>y` is `▁ x <tool> y`) and byte fallback are
    sentencepiece's own. What transformers' Llama tokenizer adds on top (transformers 4.x
    LlamaTokenizer, the sentencepiece-backed one; 5.x keeps its `_tokenize` as SentencePieceBackend's):
    the model's control and unknown pieces written in the text (<s>, </s>, <unk>, control_symbols) are
    those tokens, longest first, and the text between them is encoded part by part. `legacy`
    (tokenizer_config.json) says how a part after such a token starts. True (transformers' legacy
    behaviour, and llama.cpp's): as a text of its own, dummy prefix included (`Hi</s>there` gives
    `▁there`; `Hi</s> there` what sentencepiece gives for ` there`). False: with no dummy prefix
    (`there`), a leading space kept as one `▁` (`▁there`): the model with NormalizerSpec
    add_dummy_prefix false encodes "<unk>" + part and the pieces of "<unk>" are cut off, as transformers
    does. The start of the text is encoded as sentencepiece encodes it either way, so text without such
    tokens gives sentencepiece's own ids whatever `legacy` says. Errors: GraftError, one line."""

    def __init__(self, file: str, legacy: bool = True):
        import sentencepiece
        self.file, self.legacy, self.sp = file, legacy, _spm_load(file)
        sp = self.sp
        self.bos = sp.bos_id() if sp.bos_id() >= 0 else None
        self.special = {sp.id_to_piece(i): i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
        self.split = re.compile("(" + "|".join(re.escape(t) for t in sorted(self.special, key=len, reverse=True)) + ")")
        # protobuf merges a repeated message field into the first: this second normalizer_spec (field 3) holds
        # only add_dummy_prefix (its field 3) = false, so this is the same model without the dummy prefix
        self.no_prefix = sentencepiece.SentencePieceProcessor(model_proto=sp.serialized_model_proto() + b"\x1a\x02\x18\x00")
        self.unk = sp.id_to_piece(sp.unk_id())
        self.unk_ids = self.no_prefix.encode(self.unk)

    def encode(self, text: str) -> list:
        """The ids of `text`, no BOS or EOS added."""
        parts = self.split.split(text)          # text, special token, text, ...: odd places are special tokens
        ids = []
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(self.special[part])
            elif not part:
                continue
            elif self.legacy or k == 0:
                ids += self.sp.encode(part)
            elif part.startswith((" ", "▁")):
                got = self.no_prefix.encode(self.unk + part)
                if got[:len(self.unk_ids)] != self.unk_ids:
                    raise GraftError(f"{self.file}: cannot encode {_short(part)} after a special token with legacy "
                                     f"false: the pieces of {self.unk} merge with the text that follows")
                ids += got[len(self.unk_ids):]
            else:
                ids += self.no_prefix.encode(part)
        return ids


def is_vicuna(path: str) -> bool:
    """A checkpoint that says it is Vicuna: its config's _name_or_path, or its folder or hub id, names it."""
    cfg = os.path.join(path, "config.json")
    name = read_json(cfg).get("_name_or_path", "") if os.path.isfile(cfg) else ""
    return "vicuna" in f"{name} {os.path.abspath(path)}".lower()


# The Vicuna v1.1 conversation format (FastChat's "vicuna_v1.1"), for checkpoints that say they are
# Vicuna and carry no chat template of their own.
VICUNA_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = 'A chat between a curious user and an artificial intelligence assistant. The "
    "assistant gives helpful, detailed, and polite answers to the user\\'s questions.' %}{% set rest = messages %}"
    "{% endif %}{{ system + ' ' }}{% for m in rest %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def stack_experts(sd: dict, args: ModelArgs, path: str) -> dict:
    """Qwen3-MoE checkpoints keep each expert as its own MLP, layers.i.mlp.experts.e.{gate,up,down}_proj
    (the Hub's files, and what transformers' save_pretrained writes); transformers 5 fuses them in
    memory as experts.gate_up_proj (E, 2I, D) and experts.down_proj (E, D, I), also accepted. Either
    becomes the MoE block's stacked w_gate, w_up (E, I, D) and w_down (E, D, I). An expert missing is a
    GraftError; one beyond n_experts stays in `sd` and is refused as an unknown weight."""
    for i, sparse in enumerate(args.sparse_layers):
        if not sparse:
            continue
        p = f"layers.{i}.mlp."
        if p + "experts.gate_up_proj" in sd:
            gu = sd.pop(p + "experts.gate_up_proj")
            sd[p + "w_gate"], sd[p + "w_up"] = gu.chunk(2, dim=1)
            sd[p + "w_down"] = sd.pop(p + "experts.down_proj")
            continue
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            names = [f"{p}experts.{e}.{theirs}.weight" for e in range(args.n_experts)]
            missing = [n for n in names if n not in sd]
            if missing:
                raise GraftError(f"checkpoint {path} lacks expert weight {missing[0]} ({len(missing)} missing)")
            sd[p + ours] = torch.stack([sd.pop(n) for n in names])
    return sd


def load_model(ckpt: str, device="cpu", dtype=torch.float32, max_seq_len: int | None = None) -> Transformer:
    """Build the model from its config and load its weights (a folder, a hub id or a .gguf file, see
    resolve_checkpoint); the KV cache holds max_seq_len positions (default: the model's own context).

    The files must agree with each other both ways: every weight the config implies is there with its
    shape, and every tensor in the files is one the model uses (an lm_head stored beside tied
    embeddings must equal them). Errors: GraftError, one line."""
    path = resolve_checkpoint(ckpt)
    if is_gguf(path):
        reader, meta = gguf_read(path)
        args = gguf_model_args(meta, {t.name: t for t in reader.tensors}, path)
    else:
        args = ModelArgs.from_hf_config(read_config(path))
    n_cache = cache_budget(args, max_seq_len, dtype, device)        # before a single weight is read
    if is_gguf(path):
        _, sd = read_gguf(path, device, dtype)
    else:
        sd = read_safetensors(weight_files(path), device, dtype, keep=lambda n: "rotary_emb" not in n)
        sd = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
    sd = stack_experts(sd, args, path)
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_word_embeddings and "lm_head.weight" in sd and "embed_tokens.weight" in sd:
        if not torch.equal(sd["lm_head.weight"], sd["embed_tokens.weight"]):
            raise GraftError(f"config.json in {path} ties the embeddings, but the checkpoint's lm_head.weight "
                             f"differs from embed_tokens.weight")
    if args.tie_word_embeddings and "embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    expected = dict(model.state_dict())
    missing = [k for k in expected if k not in sd]
    if missing:
        raise GraftError(f"checkpoint {path} lacks weight {missing[0]} ({len(missing)} missing)")
    unknown = sorted(set(sd) - set(expected))
    if unknown:      # e.g. biases the config says are absent: ignoring them would run another model
        raise GraftError(f"checkpoint {path} has weights this config does not use: {', '.join(unknown[:3])}"
                         + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""))
    for k, t in expected.items():
        if tuple(sd[k].shape) != tuple(t.shape):
            raise GraftError(f"weight {k} has shape {tuple(sd[k].shape)}, config implies {tuple(t.shape)}")
        if not sd[k].is_floating_point():
            raise GraftError(f"weight {k} is {str(sd[k].dtype).replace('torch.', '')}, not a floating-point tensor")
        check_finite(k, sd[k])
    model.load_state_dict({k: sd[k] for k in expected}, assign=True, strict=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.path = path
    model.eval()
    model.setup_caches(n_cache)
    return model


# ----------------------------------------------------------------------------- tokenizer

def pick_chat_template(value, what: str) -> str | None:
    """The template string of a tokenizer config: a string, or (the Hub allows it) a list of named
    templates, of which the one named `default` is the chat template."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        if "default" not in named:
            raise GraftError(f"{what}: chat_template lists {sorted(named)} but none named 'default'")
        return named["default"]
    raise GraftError(f"malformed {what}: chat_template must be a string or a list of named templates")


def _plain(value):
    """Chat-template inputs rebuilt from plain JSON types, so a template sees no object with methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(f"chat template input of type {type(value).__name__}")


def _template_env():
    """jinja2's immutable sandbox with the helpers Hub chat templates use (those transformers gives them):
    `raise_exception`, `strftime_now`, `tojson` with its json.dumps options, loop controls, and a no-op
    `{% generation %}` block. The sandbox refuses attribute access to Python internals, so a template
    cannot reach `os` or anything else through `__globals__` and friends."""
    import datetime
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):        # training-time marker of assistant spans; renders its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def render_chat(template: str, messages: list, add_generation_prompt: bool = True, **context) -> str:
    """Render a chat template the way transformers' apply_chat_template does (same sandbox, helpers and
    variables: messages, add_generation_prompt, the special tokens, extra keywords such as
    enable_thinking). Errors: GraftError, one line, for a template that fails to parse or to render
    (a division by zero, a type error, a raise_exception, a sandbox violation)."""
    try:
        return _template_env().from_string(template).render(
            messages=_plain(messages), add_generation_prompt=add_generation_prompt, tools=None, documents=None,
            **_plain(context))
    except GraftError:
        raise
    except Exception as e:      # jinja2 errors, and whatever Python raises inside the template
        raise GraftError(f"chat template: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None


class Tokenizer:
    """tokenizer.json through `tokenizers`, or a SentencePiece tokenizer.model through sentencepiece
    (SentencePieceEncoder, with tokenizer_config.json's `legacy`; decoding through `tokenizers`); special
    tokens and the chat template from tokenizer_config.json."""
    spm = None                             # the SentencePieceEncoder of a tokenizer.model

    def __init__(self, path: str, model_args: ModelArgs | None = None):
        from tokenizers import Tokenizer as HFTokenizer
        f, spm_file = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer.model")
        cf = os.path.join(path, "tokenizer_config.json")
        cfg = Fields(read_json(cf) if os.path.isfile(cf) else {}, "tokenizer_config.json")
        if os.path.isfile(f):
            try:
                self.tk = HFTokenizer.from_file(f)
            except Exception as e:     # the Rust side reports bad JSON and bad models alike as Exception
                raise GraftError(f"malformed tokenizer.json in {path}: {str(e).splitlines()[0][:200]}") from None
        elif os.path.isfile(spm_file):     # Llama-2 era checkpoints (Vicuna) ship only SentencePiece's model
            # transformers 4.x reads a missing `legacy` as true (the behaviour Llama-2-era checkpoints were
            # made with), 5.x as false; a checkpoint that does not say keeps the legacy behaviour
            legacy = cfg.obj.get("legacy")
            if legacy is not None and not isinstance(legacy, bool):
                raise GraftError(f"malformed tokenizer_config.json in {path}: legacy must be true or false, "
                                 f"not {_short(legacy)}")
            self.tk = sentencepiece_tokenizer(spm_file)
            self.spm = SentencePieceEncoder(spm_file, legacy is not False)
        else:
            raise GraftError(f"no tokenizer.json or tokenizer.model in {path}")
        self.chat_template = pick_chat_template(cfg.obj.get("chat_template"), "tokenizer_config.json")
        jt = os.path.join(path, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(jt):
            try:
                with open(jt, "rb") as fh:
                    self.chat_template = fh.read().decode("utf-8")
            except UnicodeDecodeError:
                raise GraftError(f"chat_template.jinja in {path} is not UTF-8 text") from None
        if self.chat_template is None and is_vicuna(path):
            self.chat_template = VICUNA_TEMPLATE
        self.special = {}                  # bos_token, eos_token, ...: the strings templates may print
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = cfg.obj.get(name)
            v = v.get("content") if isinstance(v, dict) else v
            if v is not None and not isinstance(v, str):
                raise GraftError(f"malformed tokenizer_config.json: {name} must be a string")
            if v is not None and name in ("bos_token", "eos_token") and self.tk.token_to_id(v) is None:
                raise GraftError(f"tokenizer_config.json names {name} {v!r}, which tokenizer.json does not have")
            self.special[name] = v
        self.bos_token, self.eos_token = self.special["bos_token"], self.special["eos_token"]
        self.bos_id = model_args.bos_token_id if model_args else None
        if self.bos_id is None and self.bos_token:
            self.bos_id = self.tk.token_to_id(self.bos_token)
        eos = set(model_args.eos_token_ids if model_args else [])
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            vocab = model_args.vocab_size if model_args else self.tk.get_vocab_size()
            eos |= set(Fields(read_json(gen), "generation_config.json").ids("eos_token_id", vocab))
        if self.eos_token:
            eos.add(self.tk.token_to_id(self.eos_token))
        self.eos_ids = sorted(eos)
        if model_args is not None:
            self.check_fits(model_args, path)

    def check_fits(self, args: ModelArgs, where: str):
        """The tokenizer and the config must agree: every id the tokenizer can produce, and the BOS and
        EOS ids, are rows of the model's embedding."""
        top = max(self.tk.get_vocab(with_added_tokens=True).values(), default=-1)
        if top >= args.vocab_size:
            raise GraftError(f"the tokenizer in {where} produces id {top}, beyond the model's vocab_size "
                             f"{args.vocab_size}")
        for name, i in [("bos", self.bos_id)] + [("eos", e) for e in self.eos_ids]:
            if i is not None and not 0 <= i < args.vocab_size:
                raise GraftError(f"{name} token id {i} in {where} is outside the vocabulary ({args.vocab_size})")

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
        tok = lambda key: (tokens[meta[key]] if isinstance(meta.get(key), int) and 0 <= meta[key] < len(tokens)
                           else None)
        self.special = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                        "unk_token": tok("tokenizer.ggml.unknown_token_id"),
                        "pad_token": tok("tokenizer.ggml.padding_token_id")}
        if model_args is not None:
            self.check_fits(model_args, path)
        return self

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        """The ids of `text`; with add_special_tokens, the tokenizer's BOS (and whatever else its
        post-processor adds), but never a second BOS in front of a text that starts with the BOS token
        (transformers and llama.cpp would give two). Text that is not valid Unicode (a lone surrogate, as
        Python makes of bytes that are not UTF-8) is a GraftError."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise GraftError(f"the text is not valid Unicode: {e.reason} at character {e.start} "
                             f"({text[e.start]!r})") from None
        if self.spm is not None:
            ids = self.spm.encode(text)
            if add_special_tokens and self.spm.bos is not None and ids[:1] != [self.spm.bos]:
                ids = [self.spm.bos] + ids
        else:
            ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids if text else []
            if add_special_tokens and len(ids) > 1 and ids[0] == ids[1]:
                plain = self.tk.encode(text, add_special_tokens=False).ids
                if plain[:1] == ids[:1] and ids[1:1 + len(plain)] == plain:   # the added first token is the text's
                    ids = ids[1:]
        if add_special_tokens and not ids and self.bos_id is not None:
            ids = [self.bos_id]  # an empty prompt is just BOS (generation "from BOS")
        return ids

    def decode(self, ids: list) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=True)

    def render(self, messages: list, add_generation_prompt: bool = True, **context) -> str:
        """The checkpoint's chat template rendered for `messages`, with its special tokens in scope."""
        if not self.chat_template:
            raise GraftError("--chat: this checkpoint has no chat_template in tokenizer_config.json (and is not "
                             "a Vicuna model, whose v1.1 format is built in)")
        specials = {k: v for k, v in self.special.items() if v is not None}
        return render_chat(self.chat_template, messages, add_generation_prompt, **{**specials, **context})

    def apply_chat(self, user_text: str) -> list:
        """One user turn rendered with the checkpoint's own chat template, ready for the reply
        (enable_thinking=False: Qwen3 templates then skip the reasoning block), as token ids."""
        text = self.render([{"role": "user", "content": user_text}], True, enable_thinking=False)
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(ckpt: str, model_args: ModelArgs | None = None) -> Tokenizer:
    path = resolve_checkpoint(ckpt)
    if is_gguf(path):
        reader, meta = gguf_read(path)
        if model_args is None and len(reader.tensors):     # a file with weights: check them against each other
            model_args = gguf_model_args(meta, {t.name: t for t in reader.tensors}, path)
        return Tokenizer.from_gguf(path, model_args)
    return Tokenizer(path, model_args or ModelArgs.from_hf_config(read_config(path)))
