"""The target model: Llama (Llama-2/Vicuna, Llama-3.x) and Qwen3, written from scratch.

One file, readable top to bottom:
  ModelArgs        a dataclass built from the checkpoint's own config.json
  RoPE             a cos/sin table indexed by absolute position (tree nodes just pass positions)
  KVCache          a preallocated buffer written at explicit rows
  Transformer      forward(tokens, positions, cache_rows, mask) -> logits (+ EAGLE-3 features)
  checkpoints      local folder or hub id -> config + safetensors (single or sharded, memory-mapped)
  Tokenizer        tokenizer.json via `tokenizers`, chat template via jinja2, EOS ids

Nothing here knows about speculation: a tree is just tokens at some positions under some mask.
"""
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
            arch = {"llama": "llama", "qwen3": "qwen3"}.get(c.get("model_type", str, ""))
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
        theta, scaling = read_rope(cfg, what)
        return cls(
            arch=arch, vocab_size=vocab, dim=dim, n_layers=c.int("num_hidden_layers"), n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, intermediate_size=c.int("intermediate_size"),
            norm_eps=c.float("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=c.int("max_position_embeddings", 4096),
            tie_word_embeddings=c.get("tie_word_embeddings", bool, False),
            attention_bias=c.get("attention_bias", bool, False), qk_norm=arch == "qwen3",
            bos_token_id=c.int("bos_token_id", None, lo=0, hi=vocab - 1),
            eos_token_ids=c.ids("eos_token_id", vocab))

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

    def forward(self, x, rope, rows=None, mask=None, kv=None, steps_kv=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if kv is not None:
            # the new rows go into the cache first; then every query reads cache rows 0..n_keys-1
            kc, vc = kv
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

    def forward(self, x, rope, rows=None, mask=None, kv=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, rows, mask, kv)
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
        self.max_seq_len = 0                # committed tokens the cache holds (prompt + generated)
        self.rope = None
        self.cache: KVCache | None = None

    def setup_caches(self, max_seq_len: int, batch: int = 1, slack: int = 0):
        """Preallocate the KV cache and the RoPE table. `max_seq_len` committed tokens fit; `slack`
        rows more hold the uncommitted rows of a round (a tree, a padded prefill chunk) at the end, so
        a step never needs a shape that depends on how full the cache is."""
        p, a = self.embed_tokens.weight, self.args
        self.max_seq_len = max_seq_len
        rows = max_seq_len + slack
        self.rope = rope_table(a, rows).to(p.device)
        self.cache = KVCache(a.n_layers, batch, a.n_kv_heads, rows, a.head_dim, p.dtype, p.device)

    def forward(self, tokens, positions, rows=None, mask=None, capture=False, cache=None):
        """tokens (B, T); positions (T,) or (B, T) absolute positions for RoPE.

        With `rows` (T,): the T new rows are written there in `cache` (default: the model's own) and
        attention reads cache rows 0..n_keys-1 under `mask` (T, n_keys) bool (True = may attend).
        Without (training): causal over the T tokens. Returns logits (B, T, V) and, with
        capture=True, the EAGLE-3 features (B, T, 3*dim): the residual stream at the input of layers
        2, L//2 and L-3, concatenated low|mid|high.
        """
        if self.rope is None or (rows is None and self.rope.shape[0] < tokens.shape[-1]):
            # no cache (training): positions are 0..T-1, so a table of T rows is enough
            self.rope = rope_table(self.args, tokens.shape[-1]).to(self.embed_tokens.weight.device)
        cache = cache if cache is not None else self.cache
        x = self.embed_tokens(tokens)                                 # (B, T, dim)
        # under CPU autocast (training) the activations' dtype varies by op: keep RoPE in float32 then
        rope = rope_at(self.rope, positions, torch.float32 if torch.is_autocast_enabled("cpu") else x.dtype)
        mask = mask_bias(mask, x.dtype)
        feats = []
        for i, layer in enumerate(self.layers):
            if capture:
                feats += [x] * self.args.capture_layers.count(i)
            x = layer(x, rope, rows, mask, cache.layer(i) if rows is not None else None)
        logits = self.lm_head(self.norm(x))                           # (B, T, V)
        if capture:
            return logits, torch.cat(feats, dim=-1)                   # (B, T, 3*dim)
        return logits


# ----------------------------------------------------------------------------- checkpoints

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.bin", "*.txt", "*.jinja"]


def resolve_checkpoint(ckpt: str, patterns=None) -> str:
    """A local folder, or a Hugging Face hub id downloaded (json, safetensors, tokenizer) to the hub cache."""
    if os.path.isdir(ckpt):
        return ckpt
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
    while every decoding method still agrees with every other, so nothing downstream would notice."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
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


def load_model(ckpt: str, device="cpu", dtype=torch.float32, max_seq_len: int | None = None) -> Transformer:
    """Build the model from its config and load its weights; the KV cache holds max_seq_len positions
    (default: the model's own context).

    The files must agree with each other both ways: every weight the config implies is there with its
    shape, and every tensor in the files is one the model uses (an lm_head stored beside tied
    embeddings must equal them). Errors: GraftError, one line."""
    path = resolve_checkpoint(ckpt)
    args = ModelArgs.from_hf_config(read_config(path))
    n_cache = cache_budget(args, max_seq_len, dtype, device)
    files = weight_files(path)
    with torch.device("meta"):
        model = Transformer(args)
    sd = read_safetensors(files, device, dtype, keep=lambda n: "rotary_emb" not in n)
    sd = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
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
    """tokenizer.json through `tokenizers`; special tokens and the chat template from tokenizer_config.json."""

    def __init__(self, path: str, model_args: ModelArgs | None = None):
        from tokenizers import Tokenizer as HFTokenizer
        f = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(f):
            raise GraftError(f"no tokenizer.json in {path}")
        try:
            self.tk = HFTokenizer.from_file(f)
        except Exception as e:     # the Rust side reports bad JSON and bad models alike as Exception
            raise GraftError(f"malformed tokenizer.json in {path}: {str(e).splitlines()[0][:200]}") from None
        cf = os.path.join(path, "tokenizer_config.json")
        cfg = Fields(read_json(cf) if os.path.isfile(cf) else {}, "tokenizer_config.json")
        self.chat_template = pick_chat_template(cfg.obj.get("chat_template"), "tokenizer_config.json")
        jt = os.path.join(path, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(jt):
            try:
                with open(jt, "rb") as fh:
                    self.chat_template = fh.read().decode("utf-8")
            except UnicodeDecodeError:
                raise GraftError(f"chat_template.jinja in {path} is not UTF-8 text") from None
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids if text else []
        if add_special_tokens and not ids and self.bos_id is not None:
            ids = [self.bos_id]  # an empty prompt is just BOS (generation "from BOS")
        return ids

    def decode(self, ids: list) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=True)

    def render(self, messages: list, add_generation_prompt: bool = True, **context) -> str:
        """The checkpoint's chat template rendered for `messages`, with its special tokens in scope."""
        if not self.chat_template:
            raise GraftError("--chat: this checkpoint has no chat_template in tokenizer_config.json")
        specials = {k: v for k, v in self.special.items() if v is not None}
        return render_chat(self.chat_template, messages, add_generation_prompt, **{**specials, **context})

    def apply_chat(self, user_text: str) -> list:
        """One user turn rendered with the checkpoint's own chat template, ready for the reply
        (enable_thinking=False: Qwen3 templates then skip the reasoning block), as token ids."""
        text = self.render([{"role": "user", "content": user_text}], True, enable_thinking=False)
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(ckpt: str, model_args: ModelArgs | None = None) -> Tokenizer:
    path = resolve_checkpoint(ckpt)
    return Tokenizer(path, model_args or ModelArgs.from_hf_config(read_config(path)))
