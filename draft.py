"""The EAGLE-3 draft head and tree drafting with checkpoints (its loader and writer: checkpoint.py).

Spec: ../shared/reference/eagle3.md (sections 1, 3, 4). In short:
  fc          3*Ht -> H      fuses the target's low|mid|high features (depth 0 only)
  midlayer    one decoder layer whose attention reads [input_layernorm(emb), hidden_norm(hidden)] (2H wide)
  norm, lm_head              logits over the draft vocabulary; target id = draft id + d2t[draft id]
At depth > 0 the head is fed its own pre-norm output instead of target features.

Tree drafting (EAGLE-2/3): expand top_k children per beam node, score every node by the cumulative
draft log-probability of its path, keep the top_k best nodes of each level as the next beam; at the
end take the global top-`budget` nodes across levels. Graft stops the expansion early at checkpoint
depths when the best path's probability is low (`Drafter.draft(..., thresholds=...)`).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

from model import Attention, KVCache, MLP, ModelArgs, RMSNorm, attention_mask, cache_rows, rope_at, rope_table


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

    def forward(self, emb, hidden, rope, rows=None, mask=None, kv=None, steps_kv=None, keep=None):
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), h], dim=-1)       # (B, T, 2H): embedding first
        hidden = residual + self.self_attn(x, rope, rows, mask, kv, steps_kv, keep)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.config = c
        H = c.layer.dim
        self.fc = nn.Linear(c.n_features * c.target_hidden, H, bias=False)
        self.midlayer = DraftLayer(c.layer, c.norm_before_residual)
        self.norm = RMSNorm(H, c.layer.norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: nn.Embedding | None = None   # the target's, unless the checkpoint has its own
        self.rope = None
        self.cache: KVCache | None = None

    def setup_caches(self, rows: int):
        p = self.fc.weight
        a = self.config.layer
        rows = cache_rows(rows)
        self.rope = rope_table(a, rows).to(p.device)
        self.cache = KVCache(1, 1, a.n_kv_heads, rows, a.head_dim, p.dtype, p.device)

    def forward(self, hidden, ids, positions, rows=None, mask=None, fused: bool = True, steps_kv=None, cache=None,
                keep=None):
        """hidden (B, T, 3*Ht) target features (fused=True) or (B, T, H) the head's own output;
        ids (B, T) the token *after* each feature. With rows (T,): written there in `cache` (default
        the head's own), attention over rows 0..n_keys-1 under mask (T, n_keys). Returns the pre-norm
        output (B, T, H). steps_kv: earlier unrolled steps' keys/values (training only, see train.py);
        keep (T,) bool: the real rows (padding writes zeros to the cache)."""
        if fused:
            hidden = self.fc(hidden)
        if self.rope is None or self.rope.shape[0] < ids.shape[-1]:
            self.rope = rope_table(self.config.layer, ids.shape[-1]).to(hidden.device)
        rope = rope_at(self.rope, positions, hidden.dtype)
        emb = self.embed_tokens(ids).to(hidden.dtype)
        kv = None
        if rows is not None:
            kv = (cache if cache is not None else self.cache).layer(0)
        return self.midlayer(emb, hidden, rope, rows, mask, kv, steps_kv, keep)

    def logprobs(self, out_hidden):
        """Log-probabilities over the draft vocabulary, float32 (..., Vd)."""
        return torch.log_softmax(self.lm_head(self.norm(out_hidden)).float(), dim=-1)

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


# ----------------------------------------------------------------------------- tree drafting

class Drafter:
    """Tree drafting (EAGLE-2/3) as static-shaped steps against the head's own KV cache, kept in step
    with the target's.

    Rows 0..Ld-1 of the head's cache hold committed draft rows (row t = target feature t + token t+1,
    position t); the rows after them are the round's scratch: the extend rows, then one block of top_k
    rows per level. Every candidate of a full tree has a fixed slot in (C,) buffers, C = k + (D-1)k^2:
    level 1 (the root's k children) first, then k^2 per level; slots not drafted yet score -inf.
    A round is `extend` (the accepted path, which also expands level 1) and `level` up to D-1 times;
    each returns the best path's probability so far, which the host reads only at checkpoints."""

    def __init__(self, head: Eagle3, max_seq_len: int, top_k: int = 10, depth: int = 8, max_path: int = 16,
                 chunk: int = 128):
        self.head, self.top_k, self.depth = head, top_k, depth
        self.setup(max_seq_len, max_path, chunk)

    def setup(self, max_seq_len: int, max_path: int, chunk: int):
        """Allocate the head's cache and the round's buffers: room for max_seq_len committed rows and,
        after them, an extend of max_path rows, a prefill chunk, or the levels' scratch rows."""
        k, D, dev = self.top_k, self.depth, self.head.fc.weight.device
        self.max_seq_len, self.P, self.chunk = max_seq_len, max_path, chunk
        self.C = k + (D - 1) * k * k
        self.head.setup_caches(max_seq_len + max(max_path, chunk, (D - 1) * k) + 1)
        self.Ld = torch.zeros((), dtype=torch.long, device=dev)           # committed draft rows
        self.Ld_host = 0                                                   # and its mirror on the host
        self.scores = torch.full((self.C,), float("-inf"), device=dev)   # cumulative path log-prob
        self.tokens = torch.zeros(self.C, dtype=torch.long, device=dev)  # target ids
        self.parents = torch.full((self.C,), -1, dtype=torch.long, device=dev)
        H = self.head.config.layer.dim
        self.beam_s = torch.zeros(k, device=dev)                          # the beam: best k of the level
        self.beam_tok = torch.zeros(k, dtype=torch.long, device=dev)
        self.beam_h = torch.zeros(k, H, dtype=self.head.fc.weight.dtype, device=dev)
        self.beam_at = torch.zeros(k, dtype=torch.long, device=dev)       # their candidate slots
        self.seen = torch.zeros(k, max((D - 1) * k, 1), dtype=torch.bool, device=dev)  # scratch rows seen

    def buffers(self) -> list:
        return [self.Ld, self.scores, self.tokens, self.parents, self.beam_s, self.beam_tok, self.beam_h,
                self.beam_at, self.seen] + self.head.cache.tensors()

    def reset(self):
        self.Ld.zero_()
        self.Ld_host = 0

    def prefill(self, feats: torch.Tensor, ids: torch.Tensor, n: int, cols: torch.Tensor):
        """Committed rows for a chunk of the prompt: feats (c, 3*Ht), ids (c,) the token after each;
        the first n are real (the rest pad the chunk). Ld advances by n."""
        c, dev = ids.numel(), ids.device
        rows = self.Ld + torch.arange(c, device=dev)
        mask = attention_mask(torch.ones(c, c, dtype=torch.bool, device=dev).tril_(), self.Ld, cols)
        self.head(feats[None], ids[None], rows, rows, mask, fused=True, keep=torch.arange(c, device=dev) < n)
        self.Ld.add_(n)

    def extend(self, feats: torch.Tensor, ids: torch.Tensor, n: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Read the accepted path, then draft level 1. feats (P, 3*Ht) of the root and accepted nodes,
        ids (P,) the token after each (the last real one is the new root); the first n (0-d) are real.
        The hidden state at row n-1 drafts the root's top_k children. Returns conf_0 (0-d)."""
        head, k, dev = self.head, self.top_k, ids.device
        P = ids.numel()
        rows = self.Ld + torch.arange(P, device=dev)
        mask = attention_mask(torch.ones(P, P, dtype=torch.bool, device=dev).tril_(), self.Ld, cols)
        keep = torch.arange(P, device=dev) < n                                     # the path; the rest pads
        out = head(feats[None], ids[None], rows, rows, mask, fused=True, keep=keep)[0]   # (P, H)
        h_root = out.index_select(0, (n - 1).view(1))                              # (1, H)
        self.Ld.add_(n)
        s, t = head.logprobs(h_root).topk(k, dim=-1)                               # (1, k)
        self.scores.fill_(float("-inf"))
        self.scores[:k] = s[0]
        self.tokens[:k] = head.to_target(t[0])
        self.parents[:k] = -1
        self.beam_s.copy_(s[0])
        self.beam_tok.copy_(self.tokens[:k])
        self.beam_h.copy_(h_root.expand(k, -1))
        self.beam_at.copy_(torch.arange(k, device=dev))
        self.seen.zero_()
        return s[0, 0].exp()

    def level(self, i: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Draft level i+2 from the beam at level i+1 (i: 0-d, 0..D-2): one head forward over the k
        beam nodes (rows Ld + i*k.., position Ld + i), top_k children each, scored by their
        cumulative log-prob; the best k become the next beam. Returns conf_{i+1} (0-d)."""
        head, k, dev = self.head, self.top_k, i.device
        ar = torch.arange(k, device=dev)
        block = torch.arange(self.seen.shape[1], device=dev) // k == i             # this level's rows
        seen = self.seen | (block[None, :] & (torch.arange(self.seen.shape[1], device=dev) % k == ar[:, None]))
        rows = self.Ld + i * k + ar
        mask = attention_mask(seen, self.Ld, cols)                                 # (k, n_keys)
        out = head(self.beam_h[None], self.beam_tok[None], (self.Ld + i).expand(k), rows, mask, fused=False)[0]
        ps, pt = head.logprobs(out).topk(k, dim=-1)                                # (k, k)
        cu = (self.beam_s[:, None] + ps).flatten()                                 # cumulative path log-probs
        tok = head.to_target(pt).flatten()
        at = k + i * k * k + torch.arange(k * k, device=dev)                       # this level's slots
        self.scores.index_copy_(0, at, cu)
        self.tokens.index_copy_(0, at, tok)
        self.parents.index_copy_(0, at, self.beam_at.repeat_interleave(k))
        best, sel = cu.topk(k)                                                     # next beam
        self.beam_s.copy_(best)
        self.beam_tok.copy_(tok.index_select(0, sel))
        self.beam_h.copy_(out.index_select(0, sel // k))
        self.beam_at.copy_(at.index_select(0, sel))
        self.seen.copy_(seen.index_select(0, sel // k))
        return best[0].exp()


def select(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, n: int) -> tuple:
    """The best n candidates as a tree: (tokens (n,), parents (n,), slots (n,)) with parents indexing
    into the selection (-1 = the root), parents first. A stable sort keeps a parent ahead of a child
    with an equal score, so the selection is always prefix-closed (GRAFT.md section 2, step 2)."""
    order = torch.sort(scores, descending=True, stable=True).indices[:n]
    sel = torch.sort(order).values                                  # slot order = parents first
    par = parents.index_select(0, sel)
    pos = torch.searchsorted(sel, par.clamp(min=0))
    return tokens.index_select(0, sel), torch.where(par < 0, -1, pos), sel


def deepest(slots: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """Index within a selection (slots from `select`) of the end of its best deepest path: the
    highest-scoring node on the deepest selected level (the tail ablation grafts retrieval there)."""
    level = torch.where(slots < k, 1, (slots - k) // (k * k) + 2)
    key = torch.where(level == level.max(), scores.index_select(0, slots), float("-inf"))
    return key.argmax()
