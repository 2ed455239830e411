"""graft's CPU kernels (cpu_kernels.cpp): a linear, an attention and a decoder layer, row-invariant by construction.

Why our own. On a CPU, torch's kernels pick their path by the number of rows: a one-row bfloat16
`F.linear` takes oneDNN's matrix-vector route, which re-lays the weight on every call and reads it at
a quarter of what a core can read; a 9-row pass takes a GEMM that rounds a row differently from the one-row
route, and SDPA with one query differs from the same query among sixteen. So plain decoding (one row)
and a verify pass (a tree of rows) part at near-ties in bfloat16, and the one-token step is slow. Each
output of these kernels is one fixed sequence of float32 operations whatever the rows beside it
(cpu_kernels.cpp says how), which makes a verified node's logits plain decoding's, bit for bit, in every
dtype; and the one-row linear streams its weight once, widened in registers.

    linear(x (..., K), W (N, K), b (N,) | None, scale (N,) | None) -> (..., N)
                                        x.dtype: float32, bfloat16 or float16; W: x's dtype, or int8 with a scale
    attention(q (B, H, T, D), k, v (B, H_kv, S, D), mask (B|1, 1, T, S) bool, scale) -> (B, H, T, D)
    block(x (B, T, dim), the layer's weights, cos, sin (B|1, T, D), k/v caches (B_c, H_kv, R, D) written at
          rows (B, T) of requests slots (B,) | None, mask (B|1, 1, T, S) bool, keep (B, T) | None, ...) -> (B, T, dim)

They are built from cpu_kernels.cpp by torch's C++ extension loader (the same compiler inductor uses on a
CPU) on first use, with -march=native, into ~/.cache/graft-kernels/<hash> (GRAFT_KERNELS_DIR; about
15 s once, then a load). Registered as torch ops (torch.ops.graft.*) with shape functions, so compiled graphs call them
too. Where they cannot be built (no compiler) or GRAFT_KERNELS=0 is set, `ready()` is False, one line
says why, and model.py uses torch's own kernels (and its slower padded exact mode).
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# The instruction set they are built for: this CPU's (native), or a lower one on demand, so that one
# machine can run (and test) another's path: GRAFT_KERNELS_MARCH=x86-64-v3 builds the AVX2 path (Zen 2/3,
# Haswell..) on an AVX-512 CPU (with ATEN_CPU_CAPABILITY=avx2, torch's own kernels follow).
MARCH = os.environ.get("GRAFT_KERNELS_MARCH", "native")
FLAGS = ["-O3", f"-march={MARCH}", "-ffp-contract=off",
         "--param=sra-max-scalarization-size-Ospeed=4096"]     # every FMA is written out; none is inferred
ON = False          # built and loaded: model.py routes CPU linears (and exact attention) here
_tried = False


def build_dir() -> Path:
    """Where the built library lives: a hash of the source, the flags, torch and this machine's CPU."""
    tag = hashlib.sha256(SOURCE.read_bytes() + repr((FLAGS, torch.__version__, torch.backends.cpu.get_cpu_capability(),
                                                    sorted(torch.cpu.get_capabilities()))).encode()).hexdigest()[:16]
    return Path(os.environ.get("GRAFT_KERNELS_DIR", Path.home() / ".cache" / "graft-kernels")) / tag


def ready() -> bool:
    """Build (once per machine) and load the kernels; True when model.py may use them. Never raises:
    without them graft runs on torch's kernels, which one line on stderr says."""
    global ON, _tried
    if _tried:
        return ON
    _tried = True
    if os.environ.get("GRAFT_KERNELS", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load
        d = build_dir()
        d.mkdir(parents=True, exist_ok=True)
        if not (d / "graft_kernels.so").exists():
            print(f"graft: building the CPU kernels (once; {d})", file=sys.stderr, flush=True)
        load("graft_kernels", [str(SOURCE)], extra_cflags=FLAGS, build_directory=str(d), is_python_module=False,
             verbose=False)
    except Exception as e:              # no compiler, no ninja, a read-only home: torch's kernels then
        lines = [ln for ln in str(e).splitlines() if "error" in ln.lower()] or str(e).splitlines() or [type(e).__name__]
        reason = lines[-1].strip()
        print(f"graft: CPU kernels unavailable ({reason[:200]}); using torch's (slower; bfloat16 not exact)",
              file=sys.stderr, flush=True)
        return False
    _register_shapes()
    ON = True
    return True


def _register_shapes():
    @torch.library.register_fake("graft::linear")
    def _(x, w, bias, scale=None):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake("graft::block")
    def _(x, *rest):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("graft::move_rows")
    def _(caches, src, dst):
        return None

    @torch.library.register_fake("graft::top_logprobs")
    def _(logits, k):
        shape = (*logits.shape[:-1], k)
        return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.long)

    @torch.library.register_fake("graft::norm_top_logprobs")
    def _(h, nw, eps, w, k):
        shape = (*h.shape[:-1], k)
        return h.new_empty(shape, dtype=torch.float32), h.new_empty(shape, dtype=torch.long)

    @torch.library.register_fake("graft::topk_rows")
    def _(x, k):
        shape = (*x.shape[:-1], k)
        return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.long)

    @torch.library.register_fake("graft::gumbel_argmax")
    def _(logits, seed, positions, th, temperature, real):
        return logits.new_empty(logits.shape[:-1], dtype=torch.long)

    @torch.library.register_fake("graft::tree_mask")
    def _(parents, valid, max_depth):
        B, N = parents.shape
        return parents.new_empty(B, N, N, dtype=torch.bool), parents.new_empty(B, N, dtype=torch.long)

    @torch.library.register_fake("graft::accept")
    def _(tokens, parents, valid, mask, depth, target, P):
        B, N = tokens.shape
        return tokens.new_empty(B, dtype=torch.long), tokens.new_empty(B, dtype=torch.long), tokens.new_empty(B, min(P, N), dtype=torch.long)

    @torch.library.register_fake("graft::retrieve")
    def _(M, under, parents, ranks):
        return under.new_empty(under.shape[0], parents.shape[0], dtype=torch.long)

    @torch.library.register_fake("graft::context_match")
    def _(ctx, clen, G, T):
        B = ctx.shape[0]
        return ctx.new_empty(B, T, dtype=torch.long), ctx.new_empty(B, T, dtype=torch.bool), ctx.new_empty(B, dtype=torch.long)

    @torch.library.register_fake("graft::tree_learn")
    def _(*args):
        return None

    @torch.library.register_fake("graft::graft_trees")
    def _(d_tok, d_par, kept, r_tok, r_score, t_parents, t_depth, t_ranks, anchor, free):
        return d_tok.new_empty(d_tok.shape), d_tok.new_empty(d_tok.shape), kept.new_empty(d_tok.shape), d_tok.new_empty(d_tok.shape)

    @torch.library.register_fake("graft::layers")
    def _(x, *rest):
        return torch.empty_like(x, memory_format=torch.contiguous_format), [x.new_empty(x.shape) for _ in rest[24]]

    @torch.library.register_fake("graft::attention")
    def _(q, k, v, mask, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def isa() -> str | None:
    """The vector instructions the kernels were built with: "avx512_bf16+amx" (bfloat16 linears on AMX
    tiles, packed weights), "avx512_bf16" (VDPBF16PS), "avx512", "avx2" or "portable" (plain loops); None
    when they are not built."""
    return torch.ops.graft.isa() if ready() else None


def peak(dtype: torch.dtype, seconds: float = 0.05) -> float:
    """The core's multiply-add peak, GMAC/s, for a linear in `dtype`: the instruction the linear's
    inner loop runs (bfloat16: AMX's TDPBF16PS where the linear runs on AMX, else VDPBF16PS where the CPU
    has it; else FMA), in registers, measured now for about `seconds` on the calling thread. What a pass's GMAC/s is a share of (bench.py)."""
    return torch.ops.graft.peak(dtype, seconds)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) W^T (+ b): (..., N). W (N, K) of x's dtype, or int8 (quant.py) with its float32 scale (N,):
    y = sum_k x W[n, k] * scale[n] + b[n], the scale applied to the finished sum, after the same sequence of
    float32 operations a float W runs (its integers widened in registers). Errors: RuntimeError for dtypes
    or shapes that do not fit."""
    return torch.ops.graft.linear(x, w, b, scale)


def move_rows(caches: list, src: torch.Tensor, dst: torch.Tensor):
    """KV compaction for every cache (B, H_kv, R, D) in one call: request b's rows src[b] become its rows
    dst[b] (src, dst (B, n)), all read before any is written (model.KVCache.move_rows)."""
    torch.ops.graft.move_rows(caches, src, dst)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple:
    """The k best tokens of each row of logits (..., V): (log-probabilities float32 (..., k), indices
    (..., k)), best first (ties: the lower index): log_softmax then topk in one pass over each row."""
    return torch.ops.graft.top_logprobs(logits, k)


def norm_top_logprobs(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor, k: int) -> tuple:
    """A head's k best tokens after each hidden state h (..., H): its final RMSNorm (norm_weight, eps),
    its lm_head W (V, H), then top_logprobs, in one call: (log-probabilities float32 (..., k), ids)."""
    return torch.ops.graft.norm_top_logprobs(h, norm_weight, eps, w, k)


def topk_rows(x: torch.Tensor, k: int) -> tuple:
    """The k largest values of each row of x (..., V) and their indices, best first, ties to the lower
    index (k = 1: argmax, first max): (values float32 (..., k), indices (..., k)). One pass a row, 16
    values at a time, no sort."""
    return torch.ops.graft.topk_rows(x, k)


def gumbel_argmax(logits: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor, th: torch.Tensor,
                  temperature: torch.Tensor | None = None, real: torch.Tensor | None = None) -> torch.Tensor:
    """verify.choose's draw: per row of x = logits / temperature (B, N, V) (float32 x when temperature is None:
    warped already; else logits float32, bfloat16 or float16, temperature (B,) > 0), the argmax of x + the
    Gumbel noise verify.position_noise makes for (seed (B,), positions (B, N)) from the token hashes th (V,):
    the same float64 bits (its logs are torch's), ties to the lower index; noise only for the tokens that can
    win; real (B, N) bool: the rows drawn (None: all; another row's result is 0: a tree's padding, whose
    logits are zeros, would cost a draw over the whole vocabulary). Returns (B, N) int64."""
    return torch.ops.graft.gumbel_argmax(logits, seed, positions, th, temperature, real)


def plain_learn(logits, tokens, valid, nxt, active, feats, M, written, ctx, clen, pend_feats, pend_ids, pend_n):
    """graft.plain_learn's writes in one call (the same values): logits (B, V), tokens, nxt, active (B,) int64,
    valid (B,) bool, feats (B, F); each group (M and written; ctx and clen; pend_feats, pend_ids and pend_n)
    None where the method keeps none. Writes in place, returns nothing."""
    torch.ops.graft.plain_learn(logits, tokens, valid, nxt, active, feats, M, written, ctx, clen, pend_feats,
                                pend_ids, pend_n)


def tree_mask(parents, valid, max_depth: int) -> tuple:
    """verify.tree_mask in C++: parents, valid (B, N) -> (mask (B, N, N) bool, depth (B, N) int64), the same
    as the torch version's."""
    return torch.ops.graft.tree_mask(parents, valid, max_depth)


def accept(tokens, parents, valid, mask, depth, target, P: int) -> tuple:
    """verify.accept in C++: (A (B,), bonus (B,), path (B, min(P, N))), the same as the torch version's."""
    return torch.ops.graft.accept(tokens, parents, valid, mask, depth, target, P)


def retrieve(M, under, parents, ranks) -> torch.Tensor:
    """graft.retrieve in C++: M (B, V + 1, k) int32, under (B,), a template's parents and ranks (n,) ->
    (B, n) int64, the same as the torch version's."""
    return torch.ops.graft.retrieve(M, under, parents, ranks)


def context_match(ctx, clen, G: int, T: int) -> tuple:
    """graft.context_match in C++: ctx (B, S), clen (B,) -> (tokens (B, T), real (B, T), m (B,)), the same
    as the torch version's."""
    return torch.ops.graft.context_match(ctx, clen, G, T)


def tree_learn(logits, tokens, valid, path, A, bonus, active, feats, M, written, ctx, clen, pend_feats, pend_ids, pend_n):
    """graft.learn's writes in one call (the same values): logits (B, N, V), tokens, valid (B, N), path
    (B, P), A, bonus, active (B,) int64, feats (B, P, F); each group (M and written; ctx and clen;
    pend_feats, pend_ids and pend_n) None where the method keeps none. Writes in place, returns nothing."""
    torch.ops.graft.tree_learn(logits, tokens, valid, path, A, bonus, active, feats, M, written, ctx, clen,
                               pend_feats, pend_ids, pend_n)


def graft_trees(d_tok, d_par, kept, r_tok, r_score, t_parents, t_depth, t_ranks, anchor, free) -> tuple:
    """graft.graft_trees with a retrieval tree (its template's parents, depths and ranks), in C++ loops:
    (tokens, parents, valid, retrieved), each (B, n), the same as the torch version's."""
    return torch.ops.graft.graft_trees(d_tok, d_par, kept, r_tok, r_score, t_parents, t_depth, t_ranks, anchor, free)


def attention(q, k, v, mask, scale: float) -> torch.Tensor:
    return torch.ops.graft.attention(q, k, v, mask, scale)


def layers(x, *weights_and_step, scales=()) -> tuple:
    """Every decoder layer of a target in one call (model.Transformer.fused_layers): block() layer after
    layer, each weight a list with one entry a layer, then the RoPE rows, the caches (lists), rows, slots,
    mask, keep, the head count, eps, and the layers whose input to return (capture). scales: int8 weights'
    scales, 7 a layer in block()'s order (empty: float weights). Returns (x, [captured])."""
    return torch.ops.graft.layers(x, *weights_and_step, list(scales))


def block(x, *weights_and_step, emb=None, hn=None, nbr=False, scales=(), want=None) -> torch.Tensor:
    """One decoder layer (model.Block with a dense MLP), exact, in one call: model.Block.fused_forward
    passes its weights, the RoPE rows, the KV cache (written at `rows`), the mask and the head count. An
    EAGLE-3 head's layer (draft.DraftLayer.fused_forward) adds emb (B, T, dim), the token embeddings its
    attention reads beside hidden_norm(x), that norm's weight hn (dim,), and nbr (norm_before_residual).
    scales: with int8 weights (quant.py), their float32 scales (N,) for q, k, v, o, gate, up, down.
    want (B, T) bool: the rows whose output is read; the others only write their keys and values (no q,
    attention, o_proj nor MLP) and output zeros. A wanted row's output is the same bits either way."""
    return torch.ops.graft.block(x, *weights_and_step, list(scales), emb, hn, nbr, want)
