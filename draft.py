"""The EAGLE-3 draft head and tree drafting with checkpoints (its loader and writer: checkpoint.py).

EAGLE-3 (arXiv 2503.01840; the published heads of SafeAILab/EAGLE, SpecForge and AngelSlim). In short:
  fc          3*Ht -> H      fuses the target's low|mid|high features (depth 0 only)
  midlayer    one decoder layer whose attention reads [input_layernorm(emb), hidden_norm(hidden)] (2H wide)
  norm, lm_head              logits over the draft vocabulary; target id = draft id + d2t[draft id]
At depth > 0 the head is fed its own pre-norm output instead of target features.

Tree drafting (EAGLE-2/3): expand top_k children per beam node, score every node by the cumulative
draft log-probability of its path, keep the top_k best nodes of each level as the next beam; at the
end take the global top-`budget` nodes across levels. Graft stops the expansion early at checkpoint
depths when the best path's probability is low (graft.Eagle3Tree.draft reads `extend`'s and `level`'s
confidences at the checkpoints).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

import cpu_kernels
from model import (Attention, Block, KVCache, Linear, MLP, ModelArgs, RMSNorm, attention_mask, cache_rows, rope_at, rope_table,
                   use_kernels)


# ----------------------------------------------------------------------------- the head

@dataclass
class HeadConfig:
    layer: ModelArgs                 # the decoder layer (dim = H, heads, rope...)
    target_hidden: int               # Ht: width of each captured target feature
    vocab_size: int                  # V: the target's vocabulary
    draft_vocab_size: int            # Vd
    norm_before_residual: bool = False
    n_features: int = 3              # target features fc fuses (low|mid|high, or what the head declares)


class DraftLayer(nn.Module):
    """A Llama decoder layer whose attention input is [input_layernorm(emb), hidden_norm(hidden)]."""

    def __init__(self, a: ModelArgs, norm_before_residual: bool):
        super().__init__()
        self.hidden_norm = RMSNorm(a.dim, a.norm_eps)
        self.input_layernorm = RMSNorm(a.dim, a.norm_eps)
        self.self_attn = Attention(a, in_dim=2 * a.dim)
        self.post_attention_layernorm = RMSNorm(a.dim, a.norm_eps)
        self.mlp = MLP(a.dim, a.intermediate_size)
        self.norm_before_residual = norm_before_residual

    def forward(self, emb, hidden, rope, rows=None, mask=None, kv=None, steps_kv=None, keep=None, slots=None, want=None):
        if kv is not None and steps_kv is None and self.fused(hidden, mask):
            return self.fused_forward(emb, hidden, rope, rows, mask, kv, keep, slots, want)
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), h], dim=-1)       # (B, T, 2H): embedding first
        hidden = residual + self.self_attn(x, rope, rows, mask, kv, steps_kv, keep, slots)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def fused(self, x, mask) -> bool:
        """Whether one cpu_kernels.block call computes this layer: the target's fused route (Block.fused)
        without its exact mode, which a head does not need (what it drafts is verified anyway)."""
        a, m = self.self_attn, self.mlp
        return (Block.fuse and mask is not None and mask.dtype == torch.bool and not torch.compiler.is_compiling()
                and not torch.is_grad_enabled() and use_kernels(x) and x.dtype == a.q_proj.weight.dtype
                and not (a._forward_hooks or m._forward_hooks))

    def fused_forward(self, emb, hidden, rope, rows, mask, kv, keep, slots, want):
        a, m, (cache, i) = self.self_attn, self.mlp, kv
        mask = mask if mask.dim() == 4 else mask.view(1, 1, *mask.shape[-2:])           # (B|1, 1, T, n_keys)
        return cpu_kernels.block(hidden.contiguous(), self.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight,
                                 a.k_proj.bias, a.v_proj.weight, a.v_proj.bias, a.o_proj.weight, None, None,
                                 self.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight,
                                 m.down_proj.weight, rope[0][:, 0], rope[1][:, 0], cache.k[i], cache.v[i], rows, slots,
                                 mask, keep, a.n_heads, self.input_layernorm.eps, emb=emb.contiguous(),
                                 hn=self.hidden_norm.weight, nbr=self.norm_before_residual, want=want)


class Eagle3(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.config = c
        H = c.layer.dim
        self.fc = Linear(c.n_features * c.target_hidden, H, bias=False)
        self.midlayer = DraftLayer(c.layer, c.norm_before_residual)
        self.norm = RMSNorm(H, c.layer.norm_eps)
        self.lm_head = Linear(H, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: nn.Embedding | None = None   # the target's, unless the checkpoint has its own
        self.feature_cols = None     # its features' columns when the target captures more (a DFlash drafter's too)
        self.rope = None
        self.cache: KVCache | None = None

    def setup_caches(self, rows: int, batch: int = 1) -> KVCache:
        """The head's KV cache for `batch` requests of `rows` rows (rounded up), and its RoPE table."""
        p = self.fc.weight
        a = self.config.layer
        rows = cache_rows(rows)
        if self.rope is None or self.rope.shape[0] < rows:   # only grows: another engine's drafter on this
            self.rope = rope_table(a, rows).to(p.device)      # head (Engine.variant) keeps reading the same table
        self.cache = KVCache(1, batch, a.n_kv_heads, rows, a.head_dim, p.dtype, p.device)
        return self.cache

    def forward(self, hidden, ids, positions, rows=None, mask=None, fused: bool = True, steps_kv=None, cache=None,
                keep=None, slots=None, want=None):
        """hidden (B, T, 3*Ht) target features (fused=True) or (B, T, H) the head's own output;
        ids (B, T) the token *after* each feature. With rows (B, T): written there in `cache` (default
        the head's own; at its requests `slots`, default all), attention over rows 0..n_keys-1 under
        mask (B, T, n_keys). Returns the pre-norm output (B, T, H). steps_kv: earlier unrolled steps'
        keys/values (training only, see train.py); keep (B, T) bool: the real rows (padding writes
        zeros to the cache); want (B, T) bool: the rows whose output is read (a CPU's fused layer computes
        only their outputs, the others' being zeros; elsewhere every row's)."""
        if fused:
            hidden = self.fc(hidden if self.feature_cols is None else hidden.index_select(-1, self.feature_cols))
        if self.rope is None or self.rope.shape[0] < ids.shape[-1]:
            self.rope = rope_table(self.config.layer, ids.shape[-1]).to(hidden.device)
        rope = rope_at(self.rope, positions, hidden.dtype)
        emb = self.embed_tokens(ids).to(hidden.dtype)
        kv = None
        if rows is not None:
            kv = (cache if cache is not None else self.cache, 0)
            if mask.dim() == 3:
                mask = mask[:, None]                                   # (B, 1, T, n_keys)
        return self.midlayer(emb, hidden, rope, rows, mask, kv, steps_kv, keep, slots, want)

    def logprobs(self, out_hidden):
        """Log-probabilities over the draft vocabulary, float32 (..., Vd)."""
        return torch.log_softmax(self.lm_head(self.norm(out_hidden)).float(), dim=-1)

    def top_logprobs(self, out_hidden, k: int) -> tuple:
        """The k best draft tokens after each hidden state: (log-probabilities float32 (..., k), draft ids
        (..., k)), best first: logprobs(out_hidden).topk(k), which a CPU's kernels compute in one pass
        over each row (no Vd log-probabilities written out)."""
        w = self.lm_head.weight
        if (use_kernels(out_hidden) and out_hidden.dtype == w.dtype and not torch.compiler.is_compiling()
                and not torch.is_grad_enabled()):
            return cpu_kernels.norm_top_logprobs(out_hidden, self.norm.weight, self.norm.eps, w, k)
        return torch.log_softmax(self.lm_head(self.norm(out_hidden)).float(), dim=-1).topk(k, dim=-1)

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


# ----------------------------------------------------------------------------- tree drafting

class Drafter:
    """Tree drafting (EAGLE-2/3) for B requests at once, as static-shaped steps against the head's
    own KV cache (B, ...), kept in step with the target's.

    Request b's rows 0..Ld[b]-1 hold its committed draft rows (row t = target feature t + token t+1,
    position t); the rows after them are the round's scratch: the extend rows, then one block of top_k
    rows per level. Every candidate of a full tree has a fixed slot in (B, C) buffers,
    C = k + (D-1)k^2: level 1 (the root's k children) first, then k^2 per level; slots not drafted yet
    score -inf. A round is `extend` (the accepted path, which also expands level 1) and `level` up to
    D-1 times; each returns every request's best path probability so far (B,), which the host reads
    only at checkpoints."""

    def __init__(self, head: Eagle3, batch: int, max_seq_len: int, top_k: int = 10, depth: int = 8,
                 max_path: int = 16, chunk: int = 128):
        k, D, dev = top_k, depth, head.fc.weight.device
        self.head, self.top_k, self.depth, self.P = head, top_k, depth, max_path
        self.C = k + (D - 1) * k * k
        # room for max_seq_len committed rows and, after them, an extend, a prefill chunk or the levels' scratch
        self.cache = head.setup_caches(max_seq_len + max(max_path, chunk, (D - 1) * k) + 1, batch)
        z = lambda *s, dtype=torch.long: torch.zeros(*s, dtype=dtype, device=dev)
        H, dt = head.config.layer.dim, head.fc.weight.dtype
        self.Ld = z(batch)                                                        # committed draft rows
        self.scores = torch.full((batch, self.C), float("-inf"), device=dev)      # cumulative path log-prob
        self.tokens, self.parents = z(batch, self.C), z(batch, self.C) - 1         # target ids; -1 = the root
        self.beam_s, self.beam_tok = z(batch, k, dtype=torch.float32), z(batch, k)  # the beam: best k of the level
        self.beam_h, self.beam_at = z(batch, k, H, dtype=dt), z(batch, k)           # its outputs, candidate slots
        self.seen = z(batch, k, max((D - 1) * k, 1), dtype=torch.bool)            # scratch rows each beam node sees

    def buffers(self) -> list:
        return [self.Ld, self.scores, self.tokens, self.parents, self.beam_s, self.beam_tok, self.beam_h,
                self.beam_at, self.seen, self.head.rope, self.cache.bi, self.cache.hi] + self.cache.tensors() + (
            [self.head.feature_cols] if self.head.feature_cols is not None else [])

    def prefill(self, feats: torch.Tensor, ids: torch.Tensor, n: torch.Tensor, slot: torch.Tensor, cols: torch.Tensor):
        """Committed rows of request `slot` (1,) for a chunk of its prompt: feats (1, c, 3*Ht), ids (1, c)
        the token after each; the first n (0-d) are real (the rest pad the chunk). Its Ld advances by n."""
        c, dev = ids.shape[1], ids.device
        L = self.Ld.index_select(0, slot)                                          # (1,)
        rows = L[:, None] + torch.arange(c, device=dev)                            # (1, c)
        mask = attention_mask(torch.ones(c, c, dtype=torch.bool, device=dev).tril_(), L, cols)
        self.head(feats, ids, rows, rows, mask, fused=True, cache=self.cache,          # (keys and values only)
                  keep=(torch.arange(c, device=dev) < n)[None], slots=slot, want=torch.zeros_like(ids, dtype=torch.bool))
        self.Ld.index_add_(0, slot, n.view(1))

    def extend(self, feats: torch.Tensor, ids: torch.Tensor, n: torch.Tensor, cols: torch.Tensor,
               k: int | None = None) -> torch.Tensor:
        """Read each request's accepted path, then draft level 1. feats (B, P, 3*Ht) of the root and the
        accepted nodes, ids (B, P) the token after each (the last real one is the new root); the first
        n[b] of row b are real (0: an empty slot). The hidden state at row n-1 drafts the root's top k
        children; k <= top_k (default top_k): a round whose tree has at most k nodes needs no more, since
        a node's ancestors always rank above it (its candidates' slots then follow k's layout, the
        slots past it unused). Returns conf_0 (B,)."""
        head, k = self.head, k or self.top_k
        B, P = ids.shape
        dev = ids.device
        rows = self.Ld[:, None] + torch.arange(P, device=dev)                      # (B, P)
        mask = attention_mask(torch.ones(P, P, dtype=torch.bool, device=dev).tril_(), self.Ld, cols)
        keep = torch.arange(P, device=dev)[None] < n[:, None]                      # the path; the rest pads
        want = torch.arange(P, device=dev)[None] == (n - 1)[:, None]              # the new root's row: read
        out = head(feats, ids, rows, rows, mask, fused=True, cache=self.cache, keep=keep, want=want)  # (B, P, H)
        h_root = out.gather(1, (n - 1).clamp(min=0)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]  # (B, H)
        self.Ld.add_(n)
        s, t = head.top_logprobs(h_root, k)                                        # (B, k)
        tok = head.to_target(t)
        self.scores.fill_(float("-inf"))
        self.parents.fill_(-1)            # slots not drafted this round (another k's layout) hang at the root
        self.scores[:, :k] = s
        self.tokens[:, :k] = tok
        self.beam_s[:, :k].copy_(s)
        self.beam_tok[:, :k].copy_(tok)
        self.beam_h[:, :k].copy_(h_root[:, None].expand(-1, k, -1))
        self.beam_at[:, :k].copy_(torch.arange(k, device=dev).expand(B, k))
        self.seen.zero_()
        return s[:, 0].exp()

    def level(self, i: torch.Tensor, cols: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """Draft level i+2 of every request from its beam at level i+1 (i: 0-d, 0..D-2): one head
        forward over the B x k beam nodes (rows Ld + i*k.., position Ld + i), k children each (k as
        extend's), scored by their cumulative log-prob; the best k of each request become its next beam.
        Returns conf_{i+1} (B,)."""
        head, k = self.head, k or self.top_k
        B, _, W = self.seen.shape
        dev = i.device
        ar, cw = torch.arange(k, device=dev), torch.arange(W, device=dev)
        beam_s, beam_tok, beam_h, beam_at = self.beam_s[:, :k], self.beam_tok[:, :k], self.beam_h[:, :k], self.beam_at[:, :k]
        seen = self.seen[:, :k] | ((cw // k == i)[None, :] & (cw % k == ar[:, None]))[None]   # (B, k, W): + own row
        rows = self.Ld[:, None] + i * k + ar[None]                                 # (B, k)
        mask = attention_mask(seen, self.Ld, cols)                                 # (B, k, n_keys)
        out = head(beam_h, beam_tok, (self.Ld + i)[:, None].expand(B, k), rows, mask, fused=False,
                   cache=self.cache)                                               # (B, k, H)
        ps, pt = head.top_logprobs(out, k)                                         # (B, k, k)
        cu = (beam_s[:, :, None] + ps).reshape(B, k * k)                           # cumulative path log-probs
        tok = head.to_target(pt).reshape(B, k * k)
        at = k + i * k * k + torch.arange(k * k, device=dev)                       # this level's slots
        self.scores.index_copy_(1, at, cu)
        self.tokens.index_copy_(1, at, tok)
        self.parents.index_copy_(1, at, beam_at.repeat_interleave(k, dim=1))
        best, sel = cu.topk(k, dim=1)                                              # next beam
        beam_s.copy_(best)
        beam_tok.copy_(tok.gather(1, sel))
        beam_h.copy_(out.gather(1, (sel // k)[:, :, None].expand(-1, -1, out.shape[-1])))
        beam_at.copy_(at[sel])
        self.seen[:, :k].copy_(seen.gather(1, (sel // k)[:, :, None].expand(-1, -1, W)))
        return best[:, 0].exp()


def level_of(slots: torch.Tensor, k: int) -> torch.Tensor:
    """The draft level (1-based) of candidate slots (any shape)."""
    return torch.where(slots < k, 1, (slots - k) // (k * k) + 2)


def select(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, n: int) -> tuple:
    """The best n candidates of every request as a tree: scores, tokens, parents (B, C) ->
    (tokens (B, n), parents (B, n), slots (B, n), rank (B, n)), parents indexing into the selection
    (-1 = the root), parents first; rank: a node's place in the score order (0 = best). A stable sort
    keeps a parent ahead of a child with an equal score, so the best K of the selection (rank < K) are
    prefix-closed for every K (docs/graft.md section 2, step 2)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
    sel, back = torch.sort(order, dim=1)                            # slot order = parents first
    par = parents.gather(1, sel)
    pos = torch.searchsorted(sel, par.clamp(min=0))
    return tokens.gather(1, sel), torch.where(par < 0, -1, pos), sel, back
