"""GGUF checkpoints (llama.cpp's format, ggml-org/ggml docs/gguf.md): a .gguf file carries the config as
metadata under llama.cpp's key names, the tensors (float or block-quantized) and the tokenizer. It is
read with ggml-org's own `gguf` package. Quantized tensors are dequantized once, at load, to the
requested dtype: the dequantized weights *are* the model (every forward runs in that dtype)."""
import functools
import math
import os

import torch

from model import GraftError, ModelArgs, Transformer


# The checks every loader shares live here, below checkpoint.py (which imports this file, never the
# other way round): a value shortened for a one-line error, and a weight's values refused when not finite.
def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def check_finite(name: str, t: torch.Tensor):
    """Refuse a weight holding NaN or inf (one check per tensor, at load): such a model emits garbage
    while every decoding method still agrees with every other, so nothing downstream would notice.
    One sum per tensor: any NaN or inf makes it non-finite; only then (or when finite weights merely
    overflow the sum) is every element checked."""
    if t.is_floating_point() and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
        raise GraftError(f"weight {name} holds non-finite values (NaN or inf) in {str(t.dtype).replace('torch.', '')}")


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


def gguf_tensor(t, take=None) -> torch.Tensor:
    """One GGUF tensor (a gguf.ReaderTensor) as float32, in torch's dim order: GGUF lists dims innermost
    first, so ggml's [in, out] is torch's (out, in). Blocks are dequantized by gguf.quants.dequantize.
    take (tp.Shards.take of a 2-d tensor): only that part is dequantized. Rows (dim 0) are whole blocks
    and are cut before; columns (dim 1) run inside blocks, so rows are dequantized 1024 at a time and
    cut after, which bounds what a rank holds beyond its part. A type outside GGUF_TYPES is a GraftError."""
    from gguf import quants
    import numpy as np
    if t.tensor_type.name not in GGUF_TYPES:
        raise GraftError(f"GGUF tensor {t.name} is stored as {t.tensor_type.name}: supported are {', '.join(GGUF_TYPES)}")
    shape = [int(d) for d in reversed(t.shape.tolist())]
    rows = t.data.reshape(shape[0], -1) if len(shape) == 2 else t.data     # (out, bytes of a row)
    if take is not None and take[0] == 0:
        rows, shape[0] = np.concatenate([rows[a:b] for a, b in take[1]]), sum(b - a for a, b in take[1])
    if take is not None and take[0] == 1:
        cols = np.concatenate([np.arange(a, b) for a, b in take[1]])
        x = np.concatenate([quants.dequantize(rows[i:i + 1024], t.tensor_type).reshape(-1, shape[1])[:, cols]
                            for i in range(0, shape[0], 1024)])
    else:
        x = quants.dequantize(rows, t.tensor_type).reshape(shape)
    if not x.flags.writeable:  # F32 comes back as a view of the read-only mapping
        x = x.copy()
    return torch.from_numpy(x)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute of q/k rows: llama.cpp's Llama rotates adjacent
    pairs, model.py (like HF) rotates halves, so each head's rows go back from (d/2, 2) to (2, d/2)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf(path: str, device="cpu", dtype=torch.float32, shards=None) -> tuple:
    """(ModelArgs, state dict under model.py's names) from a .gguf file: every tensor mapped from
    llama.cpp's name (an unknown, missing or misshapen one is a GraftError before anything is
    dequantized), dequantized to `dtype` on `device`, Llama's q/k rows un-permuted, NaN/inf refused.
    A tied head (no output.weight) is left for load_model to tie. shards (tp.Shards, tensor
    parallelism): only this rank's part of each tensor is dequantized (gguf_tensor's take)."""
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
    a = shards.args if shards is not None else args                # the heads this rank holds
    for name, ours in names.items():
        w = gguf_tensor(tensors[name], shards.take(ours, expected[ours]) if shards is not None else None)
        if args.arch == "llama" and ours.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute(w, a.n_heads if "q_proj" in ours else a.n_kv_heads)   # within each head
        sd[ours] = w.to(device, dtype)
        check_finite(f"{path}: {name}", sd[ours])
    return args, sd
