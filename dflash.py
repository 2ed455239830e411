"""DFlash: a block drafter that guesses a whole block of tokens in one forward (docs/graft.md section 11).

The published drafter (z-lab's DFlash, e.g. Qwen3-8B-DFlash-b16), written from scratch here:
  fc, hidden_norm   the target's hidden states after a few of its layers (target_layer_ids),
                    concatenated k*H wide, projected to H and RMS-normed: the *context*
  layers            Qwen3 decoder layers (q/k norms, GQA, SwiGLU) whose queries come from the block alone
                    and whose keys and values are the context's and the block's, through the same
                    k/v projections; RoPE at absolute positions; no causal mask inside the block
  norm              then the target's own lm_head (the drafter has no embedding and no lm_head)
A block is the last committed token followed by block_size - 1 mask tokens (embedded by the target's
embedding); one forward reads the lm_head at positions 1.. of the block: block_size - 1 guesses.
The context's keys and values are cached (rows = positions, as the target's cache); after each
round the accepted tokens' features extend it and the block's rows are scratch for the next round.
Its loader and writer: checkpoint.load_dflash, checkpoint.save_dflash.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

from model import Block, KVCache, ModelArgs, RMSNorm, apply_rope, attention_mask, mask_bias, rope_at, rope_table


@dataclass
class DFlashConfig:
    layer: ModelArgs                 # every decoder layer (dim = the target's H, heads, RoPE)
    n_layers: int
    block_size: int                  # the committed token + block_size - 1 guesses
    mask_token_id: int               # the id whose embedding fills the block after its first token
    target_layer_ids: tuple          # the target layers whose *outputs* form the context (published convention)


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple:
    """The published default: one target layer per draft layer, evenly from layer 1 to L-3 (one draft
    layer: the middle one)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def context_kv(attn, ctx, rope, rows, keep, cache: KVCache, i: int, slots=None):
    """Layer i's keys and values of context rows: ctx (B, T, H) the projected features at `rows`
    (B, T) (their positions); keep (B, T) bool, padding writes zeros (CUDA-graph contract rule 4)."""
    B, T, _ = ctx.shape
    k = attn.k_norm(attn.k_proj(ctx).view(B, T, attn.n_kv, attn.hd)).transpose(1, 2)    # (B, H_kv, T, D)
    v = attn.v_proj(ctx).view(B, T, attn.n_kv, attn.hd).transpose(1, 2)
    k, keep = apply_rope(k, rope), keep[:, None, :, None]
    cache.write(i, torch.where(keep, k, 0.0), torch.where(keep, v, 0.0), rows, slots)


class DFlash(nn.Module):
    """The drafter's weights, named as published (layers.N.*, norm, fc, hidden_norm). The target's
    embedding and lm_head are read through `target` (not submodules: they are not the drafter's)."""

    def __init__(self, c: DFlashConfig, target=None):
        super().__init__()
        self.config, H = c, c.layer.dim
        self.layers = nn.ModuleList(Block(c.layer) for _ in range(c.n_layers))
        self.norm = RMSNorm(H, c.layer.norm_eps)
        self.fc = nn.Linear(len(c.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.layer.norm_eps)
        self._target = (target,)                 # a tuple: not registered as a submodule
        self.rope = None

    @property
    def target(self):
        return self._target[0]

    def forward(self, feats, ctx_rows, ctx_keep, ids, rows, pos, mask, cache: KVCache, slots=None):
        """Write the context rows, then run the block. feats (B, Tc, k*H) the target's features at
        ctx_rows (B, Tc) (= their positions), ctx_keep (B, Tc) the real ones; ids (B, T) the block's
        tokens at cache rows `rows` and positions `pos` (B, T); mask (B, T, n_keys) bool, what each
        block row reads of cache rows 0..n_keys-1 (ids None: context only). Returns the normed hidden
        states (B, T, H) (None without a block)."""
        dt = self.fc.weight.dtype
        if self.rope is None or self.rope.shape[0] < cache.rows:     # (set before compiling: BlockDrafter)
            self.rope = rope_table(self.config.layer, cache.rows).to(feats.device)
        ctx = self.hidden_norm(self.fc(feats.to(dt)))                                  # (B, Tc, H)
        rc = rope_at(self.rope, ctx_rows, dt)
        x = None if ids is None else self.target.embed_tokens(ids).to(dt)               # (B, T, H)
        rb = None if ids is None else rope_at(self.rope, pos, dt)
        bias = None if ids is None else mask_bias(mask[:, None], dt)                  # (B, 1, T, n_keys)
        for i, layer in enumerate(self.layers):
            context_kv(layer.self_attn, ctx, rc, ctx_rows, ctx_keep, cache, i, slots)
            if x is not None:
                x = layer(x, rb, rows, bias, (cache, i), slots=slots)
        return None if x is None else self.norm(x)

    def logprobs(self, h):
        """Log-probabilities over the target's vocabulary, float32 (..., V), from its lm_head."""
        return torch.log_softmax(self.target.lm_head(h).float(), dim=-1)


def feature_columns(captured: tuple, wanted: tuple, dim: int) -> list:
    """The columns of the target's captured features (captured: the layers whose input is captured,
    sorted, repeats allowed; dim wide each) that hold `wanted`, in wanted's order: a drafter reads
    its own features when the target captures another drafter's too."""
    free, cols = list(captured), []
    for w in wanted:
        i = next(j for j, c in enumerate(free) if c == w)
        free[i] = None
        cols += range(i * dim, (i + 1) * dim)
    return cols


def share_features(target, dflash: DFlash, head=None) -> list:
    """Make the target capture what the drafter (and an EAGLE-3 head beside it) reads: the union of
    their layers; the head's feature_cols pick its own. Returns the drafter's columns."""
    mine = tuple(i + 1 for i in dflash.config.target_layer_ids)        # outputs of layer i = inputs of i+1
    theirs = tuple(target.capture_layers) if head is not None else ()
    target.capture_layers = tuple(sorted(theirs + mine))
    dim = target.args.dim
    if head is not None:
        head.feature_cols = torch.tensor(feature_columns(target.capture_layers, theirs, dim),
                                         device=target.embed_tokens.weight.device)
    return feature_columns(target.capture_layers, mine, dim)


class BlockDrafter:
    """Block drafting for B requests at once, static-shaped, against the drafter's own KV cache
    (B, ...), which holds the context rows of each request: row t = position t, Ld[b] of them
    committed (the target's committed length once a round's context is written). Each round's
    `draft` writes the accepted path's features, then runs the block at rows Ld..Ld+block-1 and
    leaves its block_size - 1 guesses and their confidences (the drafter's softmax probability of
    each guess) in static buffers (tokens, conf). cols: the feature columns of its target layers in
    the target's captured features (None: all, in order)."""

    def __init__(self, model: DFlash, batch: int, rows: int, cols=None):
        c, p = model.config, model.fc.weight
        self.model, self.block = model, c.block_size
        self.cache = KVCache(c.n_layers, batch, c.layer.n_kv_heads, rows, c.layer.head_dim, p.dtype, p.device)
        if model.rope is None or model.rope.shape[0] < rows:    # only grows: another engine on this drafter
            model.rope = rope_table(c.layer, rows).to(p.device)    # keeps reading the same table
        z = lambda *s, dtype=torch.long: torch.zeros(*s, dtype=dtype, device=p.device)
        self.Ld = z(batch)                                                     # committed context rows
        self.tokens, self.conf = z(batch, self.block - 1), z(batch, self.block - 1, dtype=torch.float32)
        self.mask_ids = torch.full((self.block - 1,), c.mask_token_id, dtype=torch.long, device=p.device)
        self.cols = None if cols is None else torch.as_tensor(cols, dtype=torch.long, device=p.device)

    def buffers(self) -> list:
        return [self.Ld, self.tokens, self.conf, self.mask_ids, self.model.rope, self.cache.bi, self.cache.hi] + (
            [self.cols] if self.cols is not None else []) + self.cache.tensors()

    def features(self, feats):
        return feats if self.cols is None else feats.index_select(-1, self.cols)

    def prefill(self, feats: torch.Tensor, n: torch.Tensor, slot: torch.Tensor):
        """Context rows of request `slot` (1,) for a chunk of its prompt: feats (1, c, F) of its tokens,
        the first n (0-d) real. Its Ld advances by n."""
        c = feats.shape[1]
        rows = self.Ld.index_select(0, slot)[:, None] + torch.arange(c, device=feats.device)   # (1, c)
        keep = (torch.arange(c, device=feats.device) < n)[None]
        self.model(self.features(feats), rows, keep, None, None, None, None, self.cache, slots=slot)
        self.Ld.index_add_(0, slot, n.view(1))

    def context(self, feats: torch.Tensor, n: torch.Tensor):
        """Context rows alone (graft.BlockDraft.catch_up): feats (B, P, F) of each request's pending rows, the
        first n[b] real; Ld advances by n. A row is a function of its features and position alone: the next
        draft reads the rows it would have written itself."""
        P = feats.shape[1]
        rows = self.Ld[:, None] + torch.arange(P, device=feats.device)                   # (B, P)
        keep = torch.arange(P, device=feats.device)[None] < n[:, None]
        self.model(self.features(feats), rows, keep, None, None, None, None, self.cache)
        self.Ld.add_(n)

    def draft(self, feats: torch.Tensor, n: torch.Tensor, root: torch.Tensor, cols: torch.Tensor):
        """One block per request: feats (B, P, F) of the last round's root and accepted nodes (the first
        n[b] real; 0: nothing new, or an empty slot) extend the context, then the block [root, mask,
        ...] at positions Ld..Ld+block-1 reads every context row and the whole block (cols: the cache
        rows attention reads). Writes tokens (B, block-1) (each position's most likely token) and conf
        (B, block-1) (its probability under the drafter's softmax)."""
        B, P, _ = feats.shape
        dev, S = feats.device, self.block
        rows = self.Ld[:, None] + torch.arange(P, device=dev)                             # (B, P)
        keep = torch.arange(P, device=dev)[None] < n[:, None]
        self.Ld.add_(n)
        ids = torch.cat([root[:, None], self.mask_ids[None].expand(B, -1)], 1)            # (B, S)
        at = self.Ld[:, None] + torch.arange(S, device=dev)                               # (B, S)
        mask = attention_mask(torch.ones(S, S, dtype=torch.bool, device=dev), self.Ld, cols)
        h = self.model(self.features(feats), rows, keep, ids, at, at, mask, self.cache)    # (B, S, H)
        best, tok = self.model.logprobs(h[:, 1:]).max(-1)                                 # (B, S-1)
        self.tokens.copy_(tok)
        self.conf.copy_(best.exp())
