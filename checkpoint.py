"""Checkpoints: config.json read and checked, safetensors/.bin files (single or sharded, memory-mapped),
hub ids, `load_model`, and the EAGLE-3 head's loader and writer. A .gguf path is handed to
gguf_checkpoint.py (whose `gguf` package is imported only then). Imports go one way: this file takes
gguf_checkpoint's reader and the checks both loaders share (check_finite, _short), and gguf_checkpoint.py
never imports this file."""
import json
import math
import os

import torch
import torch.nn as nn

from dflash import DFlash, DFlashConfig, default_layer_ids
from draft import Eagle3, HeadConfig
from gguf_checkpoint import _short, check_finite
from model import GraftError, ModelArgs, Transformer

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


def read_heads(c: Fields, what: str) -> tuple:
    """(hidden_size, num_attention_heads, num_key_value_heads, head_dim) of a config (a target's or a
    head's layer), checked: the query heads a multiple of the KV heads, head_dim given or a divisor of
    the width, and even (RoPE rotates pairs). Errors: GraftError naming the field."""
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
    return dim, n_heads, n_kv, head_dim


def hf_model_args(cfg, what: str = "config.json") -> ModelArgs:
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
    dim, n_heads, n_kv, head_dim = read_heads(c, what)
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
    return ModelArgs(
        arch=arch, vocab_size=vocab, dim=dim, n_layers=layers, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=head_dim, intermediate_size=c.int("intermediate_size"),
        norm_eps=c.float("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=c.int("max_position_embeddings", 4096),
        tie_word_embeddings=c.get("tie_word_embeddings", bool, False),
        attention_bias=c.get("attention_bias", bool, False), qk_norm=arch in ("qwen3", "qwen3_moe"),
        bos_token_id=c.int("bos_token_id", None, lo=0, hi=vocab - 1),
        eos_token_ids=c.ids("eos_token_id", vocab), **moe)


# ----------------------------------------------------------------------------- checkpoints

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.bin", "*.txt", "*.jinja"]


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


class NotCached(GraftError):
    """A hub id that is not in the local hub cache while the hub cannot be reached."""

    def __init__(self, ckpt: str):
        self.ckpt = ckpt
        super().__init__(f"{ckpt} is not in the local hub cache and the hub is offline or unreachable "
                         f"(HF_HUB_OFFLINE is set or there is no network): run `hf download {ckpt}` where there is "
                         f"one, or pass a local folder")


HEAD_PATTERNS = ["*.json", "*.safetensors", "*.bin"]


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
            raise NotCached(ckpt) from None
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


REMAP_BYTES = 64 * 2 ** 20


def read_safetensors(files: list, device="cpu", dtype=None, keep=None, shards=None) -> dict:
    """Memory-mapped read; tensors are cast to `dtype` (floating ones only) on their way to `device`.
    pytorch_model*.bin files are read with weights_only=True (tensors and plain containers, never
    pickled code) and must hold a dict of tensors. shards (tp.Shards, tensor parallelism): only this
    rank's part of each tensor is read (safetensors slices). Errors: GraftError, one line."""
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
            for name, t in sd.items():
                if keep is None or keep(name):
                    take = shards.take(name, t.shape) if shards else None
                    out[name] = cast(t if take is None else shards.cut(t, take))
            continue
        try:
            names, i = None, 0
            while names is None or i < len(names):
                # Under TP every tensor is a copy of this rank's part, and the file is mapped again after
                # each REMAP_BYTES: the pages a read touched (and the kernel's readahead) then leave this
                # process, so a rank's peak memory is its part plus one window, not the whole file.
                with safe_open(f, framework="pt", device="cpu") as fh:
                    names = [n for n in fh.keys() if keep is None or keep(n)] if names is None else names
                    mapped = 0
                    while i < len(names) and (shards is None or mapped < REMAP_BYTES):
                        name, i = names[i], i + 1
                        if shards is None:
                            out[name] = cast(fh.get_tensor(name))
                            continue
                        part = fh.get_slice(name)
                        take = shards.take(name, part.get_shape())
                        out[name] = cast(fh.get_tensor(name).clone() if take is None else shards.cut(part, take))
                        mapped += math.prod(part.get_shape()) * out[name].element_size()
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


def load_model(ckpt: str, device="cpu", dtype=torch.float32, max_seq_len: int | None = None,
               shards=None) -> Transformer:
    """Build the model from its config and load its weights (a folder, a hub id or a .gguf file, see
    resolve_checkpoint); the KV cache holds max_seq_len positions (default: the model's own context).
    shards (tp.Shards, tensor parallelism): build and read this rank's part only (its heads, its MLP
    columns), checked against the shapes of that part, and connect its all-reduces.

    The files must agree with each other both ways: every weight the config implies is there with its
    shape, and every tensor in the files is one the model uses (an lm_head stored beside tied
    embeddings must equal them). Errors: GraftError, one line."""
    path = resolve_checkpoint(ckpt)
    if is_gguf(path):
        from gguf_checkpoint import gguf_model_args, gguf_read, read_gguf
        reader, meta = gguf_read(path)
        args = gguf_model_args(meta, {t.name: t for t in reader.tensors}, path)
    else:
        args = hf_model_args(read_config(path))
    args = shards.args if shards is not None else args              # this rank's heads and widths
    n_cache = cache_budget(args, max_seq_len, dtype, device)        # before a single weight is read
    if is_gguf(path):
        _, sd = read_gguf(path, device, dtype, shards)
    else:
        sd = read_safetensors(weight_files(path), device, dtype, keep=lambda n: "rotary_emb" not in n, shards=shards)
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
    if shards is not None:
        shards.connect(model)
    model.path = path
    model.eval()
    model.max_seq_len = n_cache            # the engine allocates the caches, for as many requests as it serves
    return model


# ----------------------------------------------------------------------------- the EAGLE-3 head

def head_config(cfg, what: str = "draft head config.json") -> HeadConfig:
    """Read any published EAGLE-3 config.json: official/SpecForge/AngelSlim (Llama-style keys at the
    top) or speculators-style (the layer's keys under `transformer_layer_config`). Every field is
    checked (Fields); RoPE settings go through read_rope, the target's reader, so
    `rope_parameters` (transformers 5) and `rope_theta` (transformers 4) read the same. A head that
    states no rope_theta runs at 10000, as the official Llama-3.1 head does (SafeAILab/EAGLE's cnets.py).
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
    H, nh, nkv, hd = read_heads(lc, what)
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
    path = resolve_checkpoint(ckpt, patterns=HEAD_PATTERNS)
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
    (as SGLang and vLLM read them): SGLang/SpecForge nest `eagle_config.eagle_aux_hidden_state_layer_ids` and
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


# ----------------------------------------------------------------------------- the DFlash drafter

def dflash_config(cfg, target_args: ModelArgs, what: str = "DFlash drafter config.json") -> DFlashConfig:
    """Read a DFlash drafter's config.json as z-lab publishes it (a Qwen3 config with architectures
    ["DFlashDraftModel"], `block_size` at the top or in `dflash_config`, and `dflash_config`'s
    `mask_token_id` and `target_layer_ids`) and check it against the target it drafts for.
    Errors: GraftError, one line naming the field, for anything malformed or that does not fit."""
    c = Fields(cfg, what)
    archs = c.get("architectures", list, [])
    if "DFlashDraftModel" not in archs:
        raise GraftError(f"{what}: architectures {archs!r:.60} is not ['DFlashDraftModel']: not a DFlash drafter")
    d = Fields(c.get("dflash_config", dict), f"{what} dflash_config")
    if c.get("hidden_act", str, "silu") != "silu":
        raise GraftError(f"{what}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if c.get("attention_bias", bool, False) or c.get("use_sliding_window", bool, False):
        raise GraftError(f"{what}: attention_bias and sliding-window layers are not supported")
    H, nh, nkv, hd = read_heads(c, what)
    ta = target_args
    for key, mine, theirs in (("hidden_size", H, ta.dim), ("vocab_size", c.int("vocab_size", ta.vocab_size), ta.vocab_size),
                              ("num_target_layers", c.int("num_target_layers", ta.n_layers), ta.n_layers)):
        if mine != theirs:
            raise GraftError(f"DFlash drafter does not fit the target: its {key} is {mine}, the target's is {theirs}")
    n = c.int("num_hidden_layers")
    theta, scaling = read_rope(cfg, what)
    layer = ModelArgs(arch="qwen3", vocab_size=ta.vocab_size, dim=H, n_layers=n, n_heads=nh, n_kv_heads=nkv,
                      head_dim=hd, intermediate_size=c.int("intermediate_size"), norm_eps=c.float("rms_norm_eps", 1e-6),
                      rope_theta=theta, rope_scaling=scaling,
                      max_position_embeddings=c.int("max_position_embeddings", ta.max_position_embeddings), qk_norm=True)
    ids = d.get("target_layer_ids", list, None)
    ids = list(default_layer_ids(ta.n_layers, n)) if ids is None else ids
    if not ids or not all(type(i) is int and 0 <= i <= ta.n_layers - 2 for i in ids):
        raise GraftError(f"{what}: target_layer_ids {ids!r:.60} are not layers 0..{ta.n_layers - 2} of this "
                         f"{ta.n_layers}-layer target")
    block = d.int("block_size", None, lo=2, hi=64) or c.int("block_size", lo=2, hi=64)
    return DFlashConfig(layer, n, block, d.int("mask_token_id", lo=0, hi=ta.vocab_size - 1), tuple(ids))


def load_dflash(ckpt: str, target, device=None, dtype=None) -> DFlash:
    """Load a DFlash drafter (a local folder or hub id in z-lab's layout: config.json and
    model.safetensors with fc, hidden_norm, norm and layers.N.*) for `target`, every tensor's name
    and shape checked. Errors: GraftError, one line."""
    path = resolve_checkpoint(ckpt, patterns=HEAD_PATTERNS)
    c = dflash_config(read_config(path), target.args)
    sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in read_head_weights(path).items()
          if "rotary_emb" not in k}
    with torch.device("meta"):
        model = DFlash(c)
    expected = model.state_dict()
    unknown = sorted(set(sd) - set(expected))
    if unknown:
        raise GraftError(f"DFlash drafter {path} has weights this engine does not know: {', '.join(unknown[:4])}")
    for k, t in expected.items():
        if k not in sd:
            raise GraftError(f"DFlash drafter {path} lacks weight {k}")
        if tuple(sd[k].shape) != tuple(t.shape) or not sd[k].is_floating_point():
            raise GraftError(f"DFlash drafter weight {k} has shape {tuple(sd[k].shape)} "
                             f"{str(sd[k].dtype).replace('torch.', '')}, expected {tuple(t.shape)} floating-point")
    device = device or target.embed_tokens.weight.device
    dtype = dtype or target.embed_tokens.weight.dtype
    state = {k: sd[k].to(device, dtype) for k in expected}
    for k, t in state.items():
        check_finite(f"DFlash drafter {k}", t)
    model.load_state_dict(state, assign=True, strict=True)
    model._target, model.path = (target,), path
    return model.eval()


def save_dflash(model: DFlash, out_dir: str, extra_config: dict | None = None):
    """Write a drafter in z-lab's published layout: config.json (a Qwen3 config, architectures
    ["DFlashDraftModel"], block_size, dflash_config) and model.safetensors (no embedding, no lm_head)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    c, a = model.config, model.config.layer
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": a.dim,
           "intermediate_size": a.intermediate_size, "num_attention_heads": a.n_heads,
           "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "num_hidden_layers": c.n_layers,
           "max_position_embeddings": a.max_position_embeddings, "rms_norm_eps": a.norm_eps,
           "rope_theta": a.rope_theta, "hidden_act": "silu", "attention_bias": False, "vocab_size": a.vocab_size,
           "num_target_layers": model.target.args.n_layers if model.target is not None else None,
           "block_size": c.block_size, "tie_word_embeddings": False,
           "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
           "torch_dtype": str(model.fc.weight.dtype).replace("torch.", "")}
    cfg.update(extra_config or {})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump({k: v for k, v in cfg.items() if v is not None}, fh, indent=2)
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()},
              os.path.join(out_dir, "model.safetensors"))
