"""The EAGLE-3 draft head, its checkpoint loader, and tree drafting with checkpoints.

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
import json
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from model import (Attention, Fields, GraftError, KVCache, MLP, ModelArgs, RMSNorm, attention_mask, cache_rows,
                   check_finite, read_config, read_rope, read_safetensors, resolve_checkpoint, rope_at, rope_table)


# ----------------------------------------------------------------------------- the head

@dataclass
class HeadConfig:
    layer: ModelArgs                 # the decoder layer (dim = H, heads, rope...)
    target_hidden: int               # Ht: width of each captured target feature
    vocab_size: int                  # V: the target's vocabulary
    draft_vocab_size: int            # Vd
    norm_before_residual: bool = False
    n_features: int = 3              # target features fc fuses (low|mid|high, or what the head declares)


def head_config(cfg, what: str = "draft head config.json") -> HeadConfig:
    """Read any published EAGLE-3 config.json: official/SpecForge/AngelSlim (Llama-style keys at the
    top) or speculators-style (the layer's keys under `transformer_layer_config`). Every field is
    checked (model.Fields); RoPE settings go through model.read_rope, the target's reader, so
    `rope_parameters` (transformers 5) and `rope_theta` (transformers 4) read the same. A head that
    states no rope_theta runs at 10000, as the official Llama-3.1 head does (eagle3.md section 1.3).
    Errors: GraftError, one line."""
    c = Fields(cfg, what)
    archs = c.get("architectures", list, [])
    known = {"LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator"}
    if archs and not set(archs) & known:
        raise GraftError(f"unsupported draft head architecture {archs}: supported are {', '.join(sorted(known))}")
    layer_cfg = c.get("transformer_layer_config", dict, None) or cfg
    lc = Fields(layer_cfg, what)
    if lc.get("hidden_act", str, "silu") != "silu":
        raise GraftError(f"{what}: hidden_act {layer_cfg['hidden_act']!r} is not supported (only silu)")
    H, nh = lc.int("hidden_size"), lc.int("num_attention_heads")
    nkv = lc.int("num_key_value_heads", nh)
    if nh % nkv:
        raise GraftError(f"{what}: num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}")
    hd = lc.int("head_dim", None)
    if hd is None and H % nh:
        raise GraftError(f"{what}: hidden_size {H} is not a multiple of num_attention_heads {nh}")
    hd = hd or H // nh
    if hd % 2:
        raise GraftError(f"{what}: head_dim {hd} is odd; RoPE rotates pairs")
    V = c.int("vocab_size", None) or lc.int("vocab_size")
    theta, scaling = read_rope(layer_cfg, what)
    layer = ModelArgs(arch="llama", vocab_size=lc.int("vocab_size", V), dim=H, n_layers=1, n_heads=nh,
                      n_kv_heads=nkv, head_dim=hd, intermediate_size=lc.int("intermediate_size"),
                      norm_eps=lc.float("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
                      max_position_embeddings=lc.int("max_position_embeddings", 2048),
                      attention_bias=lc.get("attention_bias", bool, False))
    return HeadConfig(layer=layer, target_hidden=c.int("target_hidden_size", H), vocab_size=V,
                      draft_vocab_size=c.int("draft_vocab_size", V),
                      norm_before_residual=c.get("norm_before_residual", bool, False))


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


# ----------------------------------------------------------------------------- loading

INT_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}

def normalize_names(sd: dict) -> dict:
    """Map every published naming onto ours: `model.` prefix, `layers.0.` for `midlayer.`,
    `draft_id_to_target_id` for `d2t`; rotary buffers dropped."""
    out = {}
    for k, v in sd.items():
        if "rotary_emb" in k:
            continue
        if k.startswith("model."):
            k = k[len("model."):]
        if k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0."):]
        elif k.startswith("layers."):
            raise GraftError(f"draft heads with more than one layer are not supported (found {k})")
        if k == "draft_id_to_target_id":
            k = "d2t"
        out[k] = v
    return out


def read_head_weights(path: str) -> dict:
    """model.safetensors, else pytorch_model.bin (weights_only=True: tensors, never pickled code)."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        f = os.path.join(path, name)
        if os.path.isfile(f):
            return read_safetensors([f])
    raise GraftError(f"no model.safetensors or pytorch_model.bin in draft head folder {path}")


def load_head(ckpt: str, target, device=None, dtype=None) -> Eagle3:
    """Load a published EAGLE-3 head for `target` (a model.Transformer), checking that it fits."""
    path = resolve_checkpoint(ckpt, patterns=["*.json", "*.safetensors", "*.bin"])
    cfg = read_config(path)
    c = head_config(cfg)
    sd = normalize_names(read_head_weights(path))
    ta = target.args
    device = device or target.embed_tokens.weight.device
    dtype = dtype or target.embed_tokens.weight.dtype
    # infer what the config may leave out from the tensors themselves
    if "fc.weight" not in sd:
        raise GraftError(f"draft head {path} has no fc.weight: not an EAGLE-3 head")
    points = aux_layers(cfg, ta.n_layers) or ta.capture_layers      # the target features the head reads
    if sd["fc.weight"].dim() != 2 or sd["fc.weight"].shape[1] % len(points):
        raise GraftError(f"draft head fc.weight has shape {tuple(sd['fc.weight'].shape)}: it fuses {len(points)} "
                         f"target features, so its input width must be a multiple of {len(points)}")
    c.target_hidden = sd["fc.weight"].shape[1] // len(points)
    c.n_features = len(points)
    if "lm_head.weight" in sd:
        c.draft_vocab_size = sd["lm_head.weight"].shape[0]
    if c.target_hidden != ta.dim:
        raise GraftError(f"draft head does not fit the target: it reads target features of width "
                         f"{c.target_hidden} (fc takes {len(points) * c.target_hidden}), the target's hidden size is {ta.dim}")
    if c.vocab_size != ta.vocab_size:
        raise GraftError(f"draft head does not fit the target: head vocab_size {c.vocab_size}, "
                         f"target vocab_size {ta.vocab_size}")
    for name, kinds in (("d2t", INT_DTYPES), ("t2d", INT_DTYPES | {torch.bool})):
        if name in sd and sd[name].dtype not in kinds:
            raise GraftError(f"draft head {path}: {name} must be an integer tensor, found "
                             f"{str(sd[name].dtype).replace('torch.', '')}")
    own_embed = "embed_tokens.weight" in sd
    if not own_embed and c.layer.dim != ta.dim:
        raise GraftError(f"draft head has no embedding and its hidden size {c.layer.dim} differs from the "
                         f"target's {ta.dim}, so it cannot share the target's")
    with torch.device("meta"):
        head = Eagle3(c)
    if "lm_head.weight" not in sd:  # no draft vocabulary: the head predicts with the target's own head
        sd["lm_head.weight"] = target.lm_head.weight
    if c.draft_vocab_size == c.vocab_size:
        sd["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)   # identity mapping
    elif "d2t" not in sd:
        if "t2d" not in sd or int(sd["t2d"].sum()) != c.draft_vocab_size:
            raise GraftError(f"draft head {path} has a reduced vocabulary ({c.draft_vocab_size}) but no d2t "
                             f"(or t2d) mapping to target ids")
        used = sd["t2d"].bool().nonzero().flatten()
        sd["d2t"] = used - torch.arange(used.numel())
    expected = head.state_dict()
    unknown = sorted(set(sd) - set(expected) - {"t2d", "embed_tokens.weight"})
    if unknown:  # e.g. SpecForge's fc_norm.*: ignoring them would draft from the wrong features
        raise GraftError(f"draft head {path} has weights this engine does not support: {', '.join(unknown[:4])}")
    for k, t in expected.items():
        if k not in sd:
            raise GraftError(f"draft head {path} lacks weight {k}")
        if tuple(sd[k].shape) != tuple(t.shape):
            raise GraftError(f"draft head weight {k} has shape {tuple(sd[k].shape)}, expected {tuple(t.shape)}")
    for k in expected:
        if k != "d2t" and not sd[k].is_floating_point():
            raise GraftError(f"draft head weight {k} is {str(sd[k].dtype).replace('torch.', '')}, not floating-point")
    state = {k: (sd[k].to(device, dtype) if sd[k].is_floating_point() else sd[k].to(device).long())
             for k in expected}
    for k, t in state.items():
        check_finite(f"draft head {k}", t)
    head.load_state_dict(state, assign=True, strict=True)
    ids = head.d2t + torch.arange(c.draft_vocab_size, device=device)
    if int(ids.max()) >= ta.vocab_size or int(ids.min()) < 0:
        raise GraftError("draft head d2t maps draft ids outside the target vocabulary")
    if "t2d" in sd and c.draft_vocab_size != c.vocab_size:       # both maps given: they must agree
        t2d = sd["t2d"]
        if tuple(t2d.shape) != (ta.vocab_size,) or not torch.equal(t2d.bool().nonzero().flatten().cpu(), torch.sort(ids).values.cpu()):
            raise GraftError(f"draft head {path}: d2t and t2d name different draft vocabularies")
    if own_embed and tuple(sd["embed_tokens.weight"].shape) != (ta.vocab_size, c.layer.dim):
        raise GraftError(f"draft head embed_tokens has shape {tuple(sd['embed_tokens.weight'].shape)}, "
                         f"expected {(ta.vocab_size, c.layer.dim)}")
    if own_embed:
        check_finite("draft head embed_tokens.weight", sd["embed_tokens.weight"].float())
        head.embed_tokens = nn.Embedding.from_pretrained(sd["embed_tokens.weight"].to(device, dtype))
    else:
        head.embed_tokens = target.embed_tokens
    head.path = path
    target.capture_layers = tuple(points)       # the target now captures what this head reads
    return head.eval()


def aux_layers(cfg: dict, n_layers: int) -> tuple | None:
    """The target features a head declares, as the layers whose input is captured (0..L, L = the last
    layer's output), or None (the default: inputs of layers 2, L//2, L-3). Two conventions meet here
    (eagle3.md section 2): SGLang/SpecForge nest `eagle_config.eagle_aux_hidden_state_layer_ids` and
    count outputs of layers (so +1); vLLM and speculators configs put the key at the top and count
    inputs of layers. Errors: GraftError for ids that are not layers of this target."""
    c = Fields(cfg, "draft head config.json")
    nested = Fields(c.get("eagle_config", dict, {}), "draft head eagle_config").get(
        "eagle_aux_hidden_state_layer_ids", list, None)
    top = c.get("eagle_aux_hidden_state_layer_ids", list, None)
    if nested is None and top is None:
        return None
    ids = nested if nested is not None else top
    points = [i + 1 for i in ids] if nested is not None and all(type(i) is int for i in ids) else ids
    if not points or not all(type(i) is int and 0 <= i <= n_layers for i in points):
        raise GraftError(f"draft head config.json: eagle_aux_hidden_state_layer_ids {ids!r:.80} are not layers of "
                         f"this {n_layers}-layer target")
    return tuple(sorted(points))


def save_head(head: Eagle3, out_dir: str, t2d: torch.Tensor | None = None, extra_config: dict | None = None):
    """Write a head in the official published format: config.json (LlamaForCausalLM + draft_vocab_size,
    no embedding) and model.safetensors with fc / midlayer.* / norm / lm_head / d2t / t2d."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    c = head.config
    a = c.layer
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.dim,
           "intermediate_size": a.intermediate_size, "num_attention_heads": a.n_heads,
           "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "num_hidden_layers": 1,
           "max_position_embeddings": a.max_position_embeddings, "rms_norm_eps": a.norm_eps,
           "rope_theta": a.rope_theta, "hidden_act": "silu", "vocab_size": c.vocab_size,
           "draft_vocab_size": c.draft_vocab_size,
           "tie_word_embeddings": False, "torch_dtype": str(head.fc.weight.dtype).replace("torch.", "")}
    if c.target_hidden != a.dim:  # only when it differs: the official loader then expects its own embedding
        cfg["target_hidden_size"] = c.target_hidden
    cfg.update(extra_config or {})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    sd = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()
          if not k.startswith("embed_tokens")}
    if t2d is None:
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[head.to_target(torch.arange(c.draft_vocab_size, device=head.d2t.device)).cpu()] = True
    sd["t2d"] = t2d.cpu()
    save_file(sd, os.path.join(out_dir, "model.safetensors"))


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
