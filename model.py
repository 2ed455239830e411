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

import cpu_kernels


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
    """cos, sin for these positions, (B or 1, 1, T, D) each, in the activations' dtype (as HF does); once per forward."""
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
    """A bool mask (True = may attend) as an additive bias (0 or -inf), made once per forward (not per layer in SDPA)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, float("-inf")).to(dtype)


# ----------------------------------------------------------------------------- kernels and exact mode
# On a CPU every linear goes through cpu_kernels.py's linear (when it could be built): each output row is
# one fixed sequence of float32 operations whatever the rows beside it, and a one-row pass streams the
# weight once (torch's one-row bfloat16 path reads it at a third of that). Exact mode (a tree node's
# logits equal plain decoding's bit for bit, every dtype) adds cpu_kernels.py's attention, which reads a
# query's visible keys in position order, and, eager, runs each dense layer as one cpu_kernels.block call.
# Without the kernels (no compiler, a GPU), exact mode pads matmul rows to a multiple of EXACT_ROWS
# (oneDNN/MKL: bf16/fp16 rows agree for every M >= 2; float32 rows for M a multiple of 4 or >= 12 on a
# Zen core, but only M >= 16 on a one-thread Sapphire Rapids core, hence 16; scripts/exactness.py) and
# reduces keys in blocks of EXACT_BLOCK absolute positions (exact_attention). tests/test_exact.py checks both.
EXACT_ROWS, EXACT_ROWS_F32, EXACT_BLOCK = 4, 16, 64


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., n, K) with zero rows appended to make n a multiple of EXACT_ROWS (float32: EXACT_ROWS_F32)."""
    return F.pad(x, (0, 0, 0, -x.shape[-2] % (EXACT_ROWS_F32 if x.dtype == torch.float32 else EXACT_ROWS)))


def use_kernels(x: torch.Tensor) -> bool:
    """Whether cpu_kernels.py computes this CPU step (built once, on first use; never while tracing)."""
    return x.device.type == "cpu" and (cpu_kernels.ON if torch.compiler.is_compiling() else cpu_kernels.ready())


def fused_step(x: torch.Tensor, mask) -> bool:
    """Block.fused's step-wide half: eager, CPU, no gradient, a bool mask."""
    return (mask is not None and mask.dtype == torch.bool and not torch.compiler.is_compiling()
            and not torch.is_grad_enabled() and use_kernels(x))


class Linear(nn.Linear):
    """nn.Linear through cpu_kernels.linear on a CPU (inference); else F.linear, with rows padded in exact
    mode so that one-row (GEMV) and few-row passes take the batched GEMM kernel."""
    exact = False

    def forward(self, x):
        if (use_kernels(x) and x.dtype == self.weight.dtype
                and not (torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad))):
            return cpu_kernels.linear(x, self.weight, self.bias)
        if not self.exact:
            return F.linear(x, self.weight, self.bias)
        h = pad_rows(x.reshape(-1, x.shape[-1]))                                  # (n padded, K)
        return F.linear(h, self.weight, self.bias)[:x.shape[:-1].numel()].reshape(*x.shape[:-1], -1)


def set_exact(module: nn.Module, on: bool):
    """Switch exact mode for every layer of a model (or head)."""
    for m in module.modules():
        if hasattr(type(m), "exact"):
            m.exact = on


def silu(x: torch.Tensor, exact: bool) -> torch.Tensor:
    """F.silu; in exact mode on float32 composed of exp, add and div, which round alike in torch's
    vectorized loop and its scalar tail (F.silu's two paths differ in the last bit)."""
    return x / (1 + torch.exp(-x)) if exact and x.dtype == torch.float32 else F.silu(x)


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
        self.rows, self.used = rows, [0] * batch     # used[b]: request b's rows from it on are zeros (clear keeps it)
        # index grids for the writes and moves (request, head): made once, read by every step
        self.bi = torch.arange(batch, device=device)[:, None, None]                 # (B, 1, 1)
        self.hi = torch.arange(n_kv, device=device)[None, :, None]                  # (1, H_kv, 1)

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor | None):
        """Layer i's new keys and values k, v (B', H_kv, T, D) at rows (B', T) of the requests `slots`
        (B',) (None: every request, B' = B). One indexed write, whatever B' and T are."""
        b = self.bi if slots is None else slots[:, None, None]                                # (B', 1, 1)
        self.k[i].index_put_((b, self.hi, rows[:, None, :]), k.to(self.k[i].dtype))      # (no-op but under autocast)
        self.v[i].index_put_((b, self.hi, rows[:, None, :]), v.to(self.v[i].dtype))

    def mark(self, b: int, n: int):
        """Rows 0..n-1 of request b may hold values (a write there, or anyone's: a test's poison)."""
        self.used[b] = max(self.used[b], min(n, self.rows))

    def clear(self, b: int):
        """Zero request b's rows that may hold values (mark) in every layer (Engine.seat, admitting a request)."""
        for t in self.k + self.v:
            t[b, :, :self.used[b]].zero_()
        self.used[b] = 0

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
        if use_kernels(src) and not torch.compiler.is_compiling():
            return cpu_kernels.move_rows(self.k + self.v, src, dst)     # every layer in one call
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
    exact = False

    def __init__(self, a: ModelArgs, in_dim: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = a.n_heads, a.n_kv_heads, a.head_dim
        in_dim = in_dim or a.dim
        self.q_proj = Linear(in_dim, a.n_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = Linear(in_dim, a.n_kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = Linear(in_dim, a.n_kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.norm_eps)
        self.qk_norm = a.qk_norm

    def forward(self, x, rope, rows=None, mask=None, kv=None, steps_kv=None, keep=None, slots=None, pos=None):
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
        if self.exact and kv is not None:
            y = cpu_kernels.attention(q, k, v, mask, self.hd ** -0.5) if use_kernels(q) else exact_attention(q, k, v, mask, rows, pos)
        elif mask is None:
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


def exact_attention(q, k, v, mask, rows, pos=None, block: int = EXACT_BLOCK):
    """Attention whose result for a query is a function of its position's keys alone, bit for bit.

    q (B, H, T, D); k, v (B, H_kv, S, D) the cache rows 0..S-1; mask (B, 1, T, S) bool; rows (B, T) the
    new rows (rows[:, 0] = L: rows 0..L-1 hold positions 0..L-1); pos (B, T) the new rows' positions,
    or None when every row is its own position (decode, prefill). Returns (B, H, T, D) in q's dtype.
    Keys are reduced in blocks of `block` absolute positions, each the same float32 matmuls of padded
    rows (q.k, then p@[v | 1] for the block's sums), the blocks summed in position order (cumsum: a
    sequential sum, so masked blocks, exact zeros, change nothing), after one max over every key (exact
    in any order). A tree node's keys (pos given) are the full committed blocks read in place, then its
    tail gathered into position order: the committed rows of the last partial block and its ancestors,
    padded with masked zero keys; plain decoding reads the same blocks, in place."""
    B, H, T, D = q.shape
    Hkv, S, G = k.shape[1], k.shape[2], H // k.shape[1]
    M, dev = G * T, q.device
    rows, mask = rows.expand(B, T), mask.expand(B, 1, T, S)[:, 0]                      # (B, T), (B, T, S)
    nb = -(-S // block)
    R = nb * block + 1                                 # whole blocks, then a zero row (a tail's masked keys)
    kf = F.pad(k.float(), (0, 0, 0, R - S))                                           # (B, H_kv, R, D)
    vf = torch.cat([F.pad(v.float(), (0, 0, 0, R - S)), torch.ones(B, Hkv, R, 1, device=dev)], -1)   # [v | 1]
    kc, vc = kf[:, :, :-1].view(B, Hkv, nb, block, D), vf[:, :, :-1].view(B, Hkv, nb, block, D + 1)
    see = F.pad(mask, (0, nb * block - S))                                            # (B, T, nb*block)
    qf = q.float().reshape(B, Hkv, M, D) * D ** -0.5                                  # row g*T + t
    s = torch.matmul(pad_rows(qf)[:, :, None], kc.transpose(-1, -2))[..., :M, :]      # (B, Hkv, nb, M, block)
    see = see.view(B, 1, T, nb, block).transpose(2, 3).repeat(1, 1, 1, G, 1)          # (B, 1, nb, M, block)
    parts = [(s, see, vc)]
    if pos is not None:
        L = rows[:, 0]
        Lb = L - L % block                                                            # (B,) the tail's start
        parts[0] = (s, see & (torch.arange(nb * block, device=dev) < Lb[:, None]).view(B, 1, nb, 1, block), vc)
        tw = -(-(block - 1 + T) // block) * block
        tp = Lb[:, None] + torch.arange(tw, device=dev)                               # (B, tw) tail positions
        new = mask.gather(2, rows[:, None, :].expand(B, T, T))                        # (B, T, T) t sees row j
        col = torch.where(new, (pos - Lb[:, None])[:, None, :], tw)                   # j's tail column (tw: none)
        old = (tp < L[:, None])[:, None] & mask.gather(2, tp.clamp(max=S - 1)[:, None].expand(B, T, tw))
        spare = torch.zeros(B, T, 1, dtype=torch.long, device=dev)
        trow = torch.cat([tp[:, None].expand(B, T, tw), spare], 2).scatter(2, col, rows[:, None].expand(B, T, T))
        tsee = torch.cat([old, spare.bool()], 2).scatter(2, col, new)[..., :tw]     # (B, T, tw)
        trow = torch.where(tsee, trow[..., :tw], R - 1)                               # unseen: the zero row
        idx = (trow[:, None] + (torch.arange(B * Hkv, device=dev) * R).view(B, Hkv, 1, 1)).flatten()
        nt = tw // block
        kt = kf.view(-1, D).index_select(0, idx).view(B, Hkv, T, nt, block, D)
        vt = vf.view(-1, D + 1).index_select(0, idx).view(B, Hkv, T, nt, block, D + 1)
        qt = pad_rows(qf.view(B, Hkv, G, T, D).transpose(2, 3))                       # (B, H_kv, T, G', D)
        st = torch.matmul(qt[:, :, :, None], kt.transpose(-1, -2))[..., :G, :]        # (B, H_kv, T, nt, G, block)
        st = st.permute(0, 1, 3, 4, 2, 5).reshape(B, Hkv, nt, M, block)
        tsee = tsee.view(B, 1, T, nt, block).transpose(2, 3).repeat(1, 1, 1, G, 1)
        parts.append((st, tsee, vt))
    s = torch.cat([torch.where(m, x, float("-inf")) for x, m, _ in parts], 2)       # (B, H_kv, blocks, M, block)
    top = s.amax(dim=(2, 4), keepdim=True)
    p = torch.exp(s - torch.where(top == float("-inf"), 0.0, top))                    # masked: exactly 0
    o = [torch.matmul(pad_rows(p[:, :, :nb]), vc)[..., :M, :]]                        # (B, H_kv, nb, M, D+1)
    if pos is not None:
        pt = pad_rows(p[:, :, nb:].view(B, Hkv, nt, G, T, block).permute(0, 1, 4, 2, 3, 5))   # (B, H_kv, T, nt, G', block)
        ot = torch.matmul(pt, parts[1][2])[..., :G, :]                                # (B, H_kv, T, nt, G, D+1)
        o.append(ot.permute(0, 1, 3, 4, 2, 5).reshape(B, Hkv, nt, M, D + 1))
    o = torch.cat(o, 2).cumsum(2)[:, :, -1]                                           # (B, H_kv, M, D+1)
    return (o[..., :D] / o[..., D:]).reshape(B, H, T, D).to(q.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    exact = False

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(silu(self.gate_proj(x), self.exact) * self.up_proj(x))


class MoE(nn.Module):
    """Qwen3-MoE's sparse block: a router scores n_experts SwiGLU experts per token (softmax in
    float32), keeps the top k (renormalised with norm_topk_prob), and mixes their outputs by those
    weights. The experts' weights are stacked, (E, I, D) and (E, D, I), so a step picks the chosen ones
    with static shapes: for a few tokens (N*k <= E: decoding, a small tree) it gathers the N*k chosen
    experts' weights (gpt-fast's Mixtral port); for more it runs every expert on every token and
    mixes with a dense routing matrix, so each expert's weights are read once."""

    exact = False

    def __init__(self, a: ModelArgs):
        super().__init__()
        E, I, D = a.n_experts, a.moe_intermediate_size, a.dim
        self.k, self.norm_topk = a.n_experts_per_tok, a.norm_topk_prob
        self.gate = Linear(D, E, bias=False)                        # the router
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
        if h.shape[0] * self.k <= E and not self.exact:       # gather the chosen experts: (N, k, I, D)
            a = F.silu(torch.einsum("nd,nkid->nki", h, self.w_gate[idx])) * torch.einsum("nd,nkid->nki", h, self.w_up[idx])
            y = (torch.einsum("nki,nkdi->nkd", a, self.w_down[idx]) * w[..., None]).sum(1)
        else:                              # every expert on every token: (E, N, I)
            r = torch.zeros(h.shape[0], E, dtype=h.dtype, device=h.device).scatter(1, idx, w)   # (N, E)
            if self.exact:                 # exact: rows padded, every expert's output, mixed in expert order
                hp = pad_rows(h)
                a = silu(hp @ self.w_gate.transpose(1, 2), True) * (hp @ self.w_up.transpose(1, 2))   # (E, N', I)
                y = ((a @ self.w_down.transpose(1, 2))[:, :h.shape[0]] * r.T[:, :, None]).cumsum(0)[-1]
            else:
                a = F.silu(torch.einsum("nd,eid->eni", h, self.w_gate)) * torch.einsum("nd,eid->eni", h, self.w_up)
                y = torch.einsum("eni,edi,ne->nd", a, self.w_down, r)
        return y.reshape(B, T, D)


class Block(nn.Module):
    exact = False
    fuse = True         # exact eager CPU steps run the whole layer as one cpu_kernels.block call

    def __init__(self, a: ModelArgs, i: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(a.dim, a.norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.dim, a.norm_eps)
        sparse = bool(a.sparse_layers) and a.sparse_layers[i]
        self.mlp = MoE(a) if sparse else MLP(a.dim, a.intermediate_size)

    def forward(self, x, rope, rows=None, mask=None, kv=None, keep=None, slots=None, pos=None):
        if kv is not None and self.fused(x, mask):
            return self.fused_forward(x, rope, rows, mask, kv, keep, slots)
        x = x + self.self_attn(self.input_layernorm(x), rope, rows, mask, kv, keep=keep, slots=slots, pos=pos)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused(self, x, mask) -> bool:
        """Whether cpu_kernels.block computes this step: exact mode, eager, CPU, no gradient, a dense MLP, a
        bool mask, and no hooks (tp.py's all-reduces) on the parts. The same arithmetic as the modules
        (cpu_kernels.cpp), minus ~60 small torch ops a layer, which cost more than a token's weights take to read."""
        return fused_step(x, mask) and self.fusable(x.dtype)

    def fusable(self, dtype) -> bool:
        """Block.fused's per-layer half: exact mode, a dense MLP of this dtype (or int8), no hooks."""
        a, m = self._modules["self_attn"], self._modules["mlp"]
        return (self.exact and self.fuse and isinstance(m, MLP) and not (a._forward_hooks or m._forward_hooks)
                and m._modules["gate_proj"]._parameters["weight"].dtype in (dtype, torch.int8))

    # The fused route's arguments are read through the modules' own dicts, as nn.Module.__getattr__ would find
    # them (a replaced one is seen at once): its fallback costs ~1 us a lookup, ~1,200 a step (~1.5 ms).
    def fused_weights(self) -> tuple:
        a, m = self._modules["self_attn"], self._modules["mlp"]
        am, mm = a._modules, m._modules
        q, k, v, o = (am[n]._parameters for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        qn, kn = (am["q_norm"]._parameters["weight"], am["k_norm"]._parameters["weight"]) if a.qk_norm else (None, None)
        return (self._modules["input_layernorm"]._parameters["weight"], q["weight"], q.get("bias"), k["weight"],
                k.get("bias"), v["weight"], v.get("bias"), o["weight"], qn, kn,
                self._modules["post_attention_layernorm"]._parameters["weight"],
                mm["gate_proj"]._parameters["weight"], mm["up_proj"]._parameters["weight"], mm["down_proj"]._parameters["weight"])

    def fused_scales(self) -> list:
        """An int8 layer's scales (quant.py), q k v o gate up down; [] for float weights."""
        a, m = self._modules["self_attn"]._modules, self._modules["mlp"]._modules
        lins = (a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"], m["gate_proj"], m["up_proj"], m["down_proj"])
        return [p._buffers["scale"] for p in lins] if lins[0]._buffers.get("scale") is not None else []

    def fused_forward(self, x, rope, rows, mask, kv, keep, slots):
        return cpu_kernels.block(x, *self.fused_weights(), rope[0][:, 0], rope[1][:, 0], kv[0].k[kv[1]], kv[0].v[kv[1]], rows, slots,
                                 mask, keep, self.self_attn.n_heads, self.input_layernorm.eps, scales=self.fused_scales())


class Transformer(nn.Module):
    """Parameter names follow HF's (minus the leading `model.`), so checkpoints load by name."""
    exact = False     # exact mode (set_exact): every row's logits independent of the rows beside it

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.n_layers))
        self.capture_layers = a.capture_layers     # EAGLE-3 feature points; a head may declare its own
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.lm_head = Linear(a.dim, a.vocab_size, bias=False)
        self.max_seq_len = 0                # committed tokens the cache holds (prompt + generated)
        self.rope = None
        self.cache: KVCache | None = None

    def setup_caches(self, max_seq_len: int, batch: int = 1, slack: int = 0):
        """Preallocate the KV cache and the RoPE table. `max_seq_len` committed tokens fit; `slack`
        rows more hold the uncommitted rows of a round (a tree, a padded prefill chunk) at the end, so
        a step never needs a shape that depends on how full the cache is."""
        p, a = self.embed_tokens.weight, self.args
        if p.device.type == "cpu":
            cpu_kernels.ready()             # built before any step is traced: compiled steps then call them too
        self.max_seq_len = max_seq_len
        rows = cache_rows(max_seq_len + slack)
        self.rope = rope_table(a, rows).to(p.device)
        self.cache = KVCache(a.n_layers, batch, a.n_kv_heads, rows, a.head_dim, p.dtype, p.device)

    def fused_layers(self, x, rope, rows, mask, cache, keep, slots, points) -> tuple:
        """Every layer as Block.fused_forward runs it, in one cpu_kernels.layers call (no Python between
        layers), with the inputs of the layers `points` (capture). Returns (x, [captured])."""
        per = zip(*(b.fused_weights() for b in self.layers))                  # each weight: a list, a layer each
        return cpu_kernels.layers(x, *map(list, per), rope[0][:, 0], rope[1][:, 0], cache.k, cache.v, rows, slots, mask,
                                  keep, self.args.n_heads, self.args.norm_eps, list(points),
                                  scales=[s for b in self.layers for s in b.fused_scales()])

    def forward(self, tokens, positions, rows=None, mask=None, capture=False, cache=None, keep=None, slots=None,
                last=None):
        """tokens (B, T); positions (B, T) absolute positions for RoPE ((T,): the same for every row).

        With `rows` (B, T) (or (T,)): the T new rows of each request are written there in `cache`
        (default: the model's own), at the cache's requests `slots` (B,) (default: all, in order), and
        attention reads cache rows 0..n_keys-1 under `mask` (B, T, n_keys) bool (True = may attend);
        `keep` (B, T) bool marks the real rows (padding writes zeros to the cache, see Attention).
        Without (training): causal over the T tokens. Returns logits (B, T, V), or with `last` (B,) row
        last[b]'s alone (B, 1, V) (a prefill: the lm_head is a fifth of a small model's work), and, with
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
        mask = mask if self.exact else mask_bias(mask, x.dtype)
        # exact attention gathers a tree's keys into position order; rows that are their positions need not
        pos = None if positions is rows or tokens.shape[1] == 1 else positions.expand(*tokens.shape)
        feats, points = [], self.capture_layers
        fused = rows is not None and fused_step(x, mask) and all(b.fusable(x.dtype) for b in self.layers)
        if fused:                                                     # one kernel call, every layer
            x, feats = self.fused_layers(x, rope, rows, mask, cache, keep, slots, points if capture else ())
        else:
            for i, layer in enumerate(self.layers):
                if capture:
                    feats += [x] * points.count(i)
                x = layer(x, rope, rows, mask, (cache, i) if rows is not None else None, keep, slots, pos)
            if capture:                      # "the input of layer L": the last layer's output, before the norm
                feats += [x] * points.count(len(self.layers))
        if last is not None:                                          # (B, 1, dim): the rows that choose a token
            x, keep = x.gather(1, last.view(-1, 1, 1).expand(-1, 1, x.shape[-1])), None
        x, real = self.norm(x), None if not fused or keep is None or bool(keep.all()) else keep.expand(x.shape[:-1])
        # an eager CPU pass: the real rows' logits only; a padding row left the fused layers zeros (no bias)
        logits = self.lm_head(x) if real is None else x.new_zeros(*x.shape[:-1], self.args.vocab_size)   # (B, T, V)
        if real is not None:
            logits[real] = self.lm_head(x[real])                      # (real rows, V)
        if capture:
            return logits, torch.cat(feats, dim=-1)                   # (B, T, n*dim)
        return logits
