"""The target model: Llama (Llama-2/Vicuna, Llama-3.x), Qwen3 and Qwen3-MoE, written from scratch.

One file, readable top to bottom, torch only (the loaders are checkpoint.py, gguf_checkpoint.py, tokenizer.py):
  ModelArgs        a plain dataclass (checkpoint.hf_model_args reads it from config.json)
  RoPE             a cos/sin table indexed by absolute position (tree nodes just pass positions)
  KVCache          a preallocated buffer written at explicit rows
  Transformer      forward(tokens, positions, cache_rows, mask) -> logits (+ EAGLE-3 features)

Nothing here knows about speculation: a tree is just tokens at some positions under some mask.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


class GraftError(Exception):
    """Bad input (checkpoint, prompt, flags): the CLI prints the message on one line and exits."""


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

    @property
    def capture_layers(self) -> tuple:
        """EAGLE-3 reads the residual stream at the *input* of these layers (EAGLE-3's target-side capture, SafeAILab/EAGLE)."""
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
        # index grids for the writes and moves (request, head): made once, read by every step
        self.bi = torch.arange(batch, device=device)[:, None, None]                 # (B, 1, 1)
        self.hi = torch.arange(n_kv, device=device)[None, :, None]                  # (1, H_kv, 1)

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor | None):
        """Layer i's new keys and values k, v (B', H_kv, T, D) at rows (B', T) of the requests `slots`
        (B',) (None: every request, B' = B). One indexed write, whatever B' and T are."""
        b = self.bi if slots is None else slots[:, None, None]                                # (B', 1, 1)
        self.k[i].index_put_((b, self.hi, rows[:, None, :]), k)
        self.v[i].index_put_((b, self.hi, rows[:, None, :]), v)

    def clear(self, b: int):
        """Zero request b's rows in every layer (Engine.seat, when a request takes the slot)."""
        for t in self.k + self.v:
            t[b].zero_()

    def read(self, i: int, n_keys: int, slots: torch.Tensor | None) -> tuple:
        """Layer i's cache rows 0..n_keys-1, (B', H_kv, n_keys, D) each: a view for every request, a
        gathered copy for the requests `slots` (a prefill of one request)."""
        k, v = self.k[i], self.v[i]
        if slots is not None:
            k, v = k.index_select(0, slots), v.index_select(0, slots)
        return k[:, :, :n_keys], v[:, :, :n_keys]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor):
        """KV compaction: request b's rows src[b] become its rows dst[b] in every layer; src, dst (B, n).
        Gathered first, so overlapping source and destination rows are safe."""
        s, d = src[:, None, :], dst[:, None, :]                                                # (B, 1, n)
        for t in self.k + self.v:
            t.index_put_((self.bi, self.hi, d), t[self.bi, self.hi, s])

    def tensors(self) -> list:
        return self.k + self.v


def attention_mask(tree: torch.Tensor, L: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Which cache rows each of N new rows of every request may read: (B, N, n_keys) bool.

    Request b's round starts at cache row L[b] (its committed length; L (B,)) and spans W rows;
    tree (B, N, W) (or (N, W), the same for every request) says which of them each new row sees
    (itself and its ancestors; a causal triangle for a prefill chunk). Committed rows (< L) are
    visible to all, rows past the round's to none. `cols` is arange(n_keys): the whole cache (a
    static shape, for CUDA graphs) or just the rows up to the round's last (a size that varies; on a
    CPU reading less is faster)."""
    B = L.shape[0]
    tree = tree.expand(B, *tree.shape[-2:])
    N, W = tree.shape[1:]
    rel = cols[None, None, :] - L[:, None, None]                       # (B, 1, n_keys): row - L
    inside = (rel >= 0) & (rel < W)
    seen = tree.gather(2, rel.clamp(0, W - 1).expand(B, N, -1))       # (B, N, n_keys)
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

    def forward(self, x, rope, rows=None, mask=None, kv=None, steps_kv=None, keep=None, slots=None):
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
            cache, i = kv
            if keep is not None:      # (T,) or (B, T)
                keep = keep.reshape(-1, 1, T, 1)
                k, v = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
            cache.write(i, k, v, rows.expand(B, T), slots)
            k, v = cache.read(i, mask.shape[-1], slots)
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

    q (B, H, T, D); k, v (B, H_kv, S, D); mask (B, 1, T, S) (or (T, S) for every request), bool or additive
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

    def forward(self, x, rope, rows=None, mask=None, kv=None, keep=None, slots=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, rows, mask, kv, keep=keep, slots=slots)
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

    def forward(self, tokens, positions, rows=None, mask=None, capture=False, cache=None, keep=None, slots=None):
        """tokens (B, T); positions (B, T) absolute positions for RoPE ((T,): the same for every row).

        With `rows` (B, T) (or (T,)): the T new rows of each request are written there in `cache`
        (default: the model's own), at the cache's requests `slots` (B,) (default: all, in order), and
        attention reads cache rows 0..n_keys-1 under `mask` (B, T, n_keys) bool (True = may attend);
        `keep` (B, T) bool marks the real rows (padding writes zeros to the cache, see Attention).
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
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]                                      # (B, 1, T, n_keys): every head alike
        mask = mask_bias(mask, x.dtype)
        feats, points = [], self.capture_layers
        for i, layer in enumerate(self.layers):
            if capture:
                feats += [x] * points.count(i)
            x = layer(x, rope, rows, mask, (cache, i) if rows is not None else None, keep, slots)
        if capture:                          # "the input of layer L": the last layer's output, before the norm
            feats += [x] * points.count(len(self.layers))
        logits = self.lm_head(self.norm(x))                           # (B, T, V)
        if capture:
            return logits, torch.cat(feats, dim=-1)                   # (B, T, n*dim)
        return logits
