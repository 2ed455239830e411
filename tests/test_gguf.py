"""GGUF checkpoints: read_gguf and gguf_tokenizer against transformers' own GGUF reading, every
supported tensor type against ggml's reference dequantization, tokenizers rebuilt from metadata against
the tokenizer.json they came from, the real SmolLM2-135M-Instruct Q4_1 file from ../shared, and
one-line errors for bad files.

The tiny GGUF files are written here the way llama.cpp's convert_hf_to_gguf.py writes them: its key and
tensor names (from gguf.Keys / gguf.TENSOR_NAMES), Llama's q/k rows permuted for interleaved RoPE, norms
kept F32, Llama-3 RoPE scaling as a rope_freqs tensor, special tokens, merges and chat template through
gguf.SpecialVocab. CPU, float32.
"""
import functools
import json
import logging
import math
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file

import calibrate as CAL
import checkpoint as CK
import cli as CLI
import gguf_checkpoint as GG
import model as M
import tokenizer as TOK
from conftest import SHARED, STORIES, STORIES_IDS64, STORIES_TEXT, needs_shared, reference_greedy

logging.getLogger("gguf").setLevel(logging.ERROR)   # SpecialVocab's notes about the tiny tokenizer.json

TOL = 1e-4
K = gguf.Keys
SMOL = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
needs_smol = pytest.mark.skipif(not SMOL.is_file(), reason=f"{SMOL} is missing")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def maxdiff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def forward(model, ids: list):
    return model(torch.tensor([ids]), torch.arange(len(ids)))


def error_of(fn, *args) -> str:
    with pytest.raises(M.GraftError) as e:
        fn(*args)
    msg = str(e.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


# ----------------------------------------------------------------------------- writing GGUF files

HF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
HF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> llama.cpp's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for rope_type llama3: one divisor per frequency."""
    rs, theta = cfg["rope_parameters"], cfg["rope_parameters"]["rope_theta"]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    orig, lo, hi, factor = (rs["original_max_position_embeddings"], rs["low_freq_factor"], rs["high_freq_factor"],
                            rs["factor"])
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < orig / hi:
            out.append(1.0)
        elif wl > orig / lo:
            out.append(factor)
        else:
            smooth = (orig / wl - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def model_parts(src: Path, qtype: str = "F32") -> tuple:
    """(arch, metadata, tensors) of an HF folder as convert_hf_to_gguf.py converts it; tensors map
    name -> (numpy array, raw ggml type or None)."""
    cfg = json.loads((src / "config.json").read_text())
    arch = "qwen3" if cfg["model_type"] == "qwen3" else "llama"
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // H
    rp = cfg.get("rope_parameters") or {}
    a = dict(arch=arch)
    meta = {K.LLM.BLOCK_COUNT.format(**a): cfg["num_hidden_layers"],
            K.LLM.CONTEXT_LENGTH.format(**a): cfg["max_position_embeddings"],
            K.LLM.EMBEDDING_LENGTH.format(**a): cfg["hidden_size"],
            K.LLM.FEED_FORWARD_LENGTH.format(**a): cfg["intermediate_size"],
            K.Attention.HEAD_COUNT.format(**a): H, K.Attention.HEAD_COUNT_KV.format(**a): KV,
            K.Rope.FREQ_BASE.format(**a): float(cfg.get("rope_theta") or rp["rope_theta"]),
            K.Attention.LAYERNORM_RMS_EPS.format(**a): float(cfg["rms_norm_eps"])}
    if arch == "qwen3":
        meta |= {K.Attention.KEY_LENGTH.format(**a): hd, K.Attention.VALUE_LENGTH.format(**a): hd}
    else:
        meta |= {K.LLM.VOCAB_SIZE.format(**a): cfg["vocab_size"], K.Rope.DIMENSION_COUNT.format(**a): hd}
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        base, _, suffix = name.rpartition(".")
        if base in HF_GLOBAL:
            gname = f"{HF_GLOBAL[base]}.{suffix}"
        else:
            _, _, i, rest = base.split(".", 3)
            gname = f"blk.{i}.{HF_LAYER[rest]}.{suffix}"
        x = t.float()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            x = permute(x, H if base.endswith("q_proj") else KV)
        x = x.numpy()
        if x.ndim == 1 or qtype == "F32":
            tensors[gname] = (x, None)
        elif qtype == "F16":
            tensors[gname] = (x.astype(np.float16), None)
        else:
            tensors[gname] = (gguf.quants.quantize(x, QT[qtype]), QT[qtype])
    if rp.get("rope_type") == "llama3":
        tensors[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"] = (llama3_rope_factors(cfg, hd), None)
    return arch, meta, tensors


def bpe_tokenizer_meta(src: Path, pre: str = "gpt-2") -> dict:
    """A byte-level tokenizer.json as convert_hf_to_gguf.py's _set_vocab_gpt2 writes it."""
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"]) | {t["content"]: t["id"] for t in tok["added_tokens"]}
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    sv = gguf.SpecialVocab(src, load_merges=True, n_vocab=len(tokens))
    meta = {K.Tokenizer.MODEL: "gpt2", K.Tokenizer.PRE: pre, K.Tokenizer.LIST: tokens,
            K.Tokenizer.TOKEN_TYPE: [int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
                                     for i in range(len(tokens))],
            K.Tokenizer.MERGES: sv.merges}
    meta |= {getattr(K.Tokenizer, f"{typ.upper()}_ID"): i for typ, i in sv.special_token_ids.items()}
    meta |= {getattr(K.Tokenizer, f"ADD_{typ.upper()}"): on for typ, on in sv.add_special_token.items()}
    if sv.chat_template:
        meta[K.Tokenizer.CHAT_TEMPLATE] = sv.chat_template
    return meta


def write_gguf(path: Path, arch: str, meta: dict, tensors: dict) -> Path:
    """Write metadata with the writer's own types (ints as uint32, floats as float32, int lists as
    int32 arrays) and the tensors, through gguf.GGUFWriter; meta may override general.architecture."""
    meta = dict(meta)
    w = gguf.GGUFWriter(str(path), meta.pop("general.architecture", arch))
    for k, v in meta.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, v)
    for name, (x, raw) in tensors.items():
        w.add_tensor(name, x, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_gguf(src: Path, path: Path, qtype: str = "F32", edit=None) -> Path:
    """The tiny HF folder `src` as a .gguf at `path`; edit(meta, tensors) may change it before writing."""
    arch, meta, tensors = model_parts(src, qtype)
    meta |= bpe_tokenizer_meta(src)
    if edit:
        edit(meta, tensors)
    return write_gguf(path, arch, meta, tensors)


# The tiny pair compared with transformers: a tied GQA Llama (the k permutation uses the KV head count)
# and a Qwen3 whose head_dim (128) differs from hidden/heads (16). transformers 5.24's GGUF config
# mapping ignores qwen3.attention.key_length and uses Qwen3Config's default head_dim, 128, so that is
# the size a file must have for transformers to read it right (real Qwen3 checkpoints all use 128).
TINY = {"llama": ("llama2", {"num_key_value_heads": 2}), "qwen3": ("qwen3", {"head_dim": 128})}


@pytest.fixture(scope="module")
def tiny(tiny_ckpt, tmp_path_factory):
    """tiny(arch, qtype) -> (HF folder, .gguf path), each written once per module."""
    root, cache = tmp_path_factory.mktemp("gguf"), {}

    def get(arch: str, qtype: str = "F32"):
        if (arch, qtype) not in cache:
            kind, over = TINY[arch]
            src = tiny_ckpt(kind, **over)
            cache[arch, qtype] = src, tiny_gguf(src, root / f"{arch}-{qtype}.gguf", qtype)
        return cache[arch, qtype]

    return get


@functools.lru_cache(maxsize=8)
def hf_gguf_model(path: str):
    """transformers' reading of a GGUF file: the config AutoConfig builds from its metadata and the
    weights load_gguf_checkpoint gives (gguf dequantization, Llama q/k un-permutation, name mapping),
    loaded strictly. This is what from_pretrained(folder, gguf_file=...) runs, minus its refusal to start
    without `accelerate`, a package this project does not depend on."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    p = Path(path)
    cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    sd = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(sd, strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys == (["lm_head.weight"] if cfg.tie_word_embeddings else [])
    model.tie_weights()
    return model


IDS = [1] + torch.randint(3, 300, (47,), generator=torch.Generator().manual_seed(1)).tolist()


# ----------------------------------------------------------------------------- parity

@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_match_transformers_reading_the_same_file(tiny, arch, qtype):
    src, path = tiny(arch, qtype)
    ours = forward(CK.load_model(str(path)), IDS)
    ref = hf_gguf_model(str(path))(torch.tensor([IDS])).logits
    assert ours.shape == ref.shape == (1, 48, 300)
    assert maxdiff(ours, ref) < TOL
    if qtype != "F32":   # the file really holds rounded weights: the model is not the float32 one
        assert maxdiff(ours, forward(CK.load_model(str(src)), IDS)) > 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_f32_gguf_is_the_safetensors_model(tiny, arch):
    src, path = tiny(arch)
    g, s = CK.load_model(str(path)), CK.load_model(str(src))
    assert g.args.head_dim == s.args.head_dim and g.args.n_kv_heads == s.args.n_kv_heads == 2
    assert g.args.tie_word_embeddings is s.args.tie_word_embeddings is (arch == "llama")
    assert (g.lm_head.weight is g.embed_tokens.weight) is (arch == "llama")
    sd_g, sd_s = g.state_dict(), s.state_dict()
    assert sd_g.keys() == sd_s.keys()
    for k in sd_s:   # F32 round trip: bit-identical, q/k rows included (un-permuted)
        assert torch.equal(sd_g[k], sd_s[k]), k


def test_llama3_rope_freqs_match_the_rope_scaling(tiny_ckpt, tmp_path):
    """Llama 3.1's rope_type llama3 reaches a GGUF as rope_freqs.weight (one divisor per frequency):
    the same model as the safetensors one, over positions past the original 64-token context; without
    the factors it is not."""
    src = tiny_ckpt("llama31")
    g = CK.load_model(str(tiny_gguf(src, tmp_path / "l31.gguf")))
    plain = CK.load_model(str(tiny_gguf(src, tmp_path / "plain.gguf", edit=lambda m, t: t.pop("rope_freqs.weight"))))
    assert g.args.rope_scaling["rope_type"] == "freq_factors" and plain.args.rope_scaling is None
    ids = [1] + list(range(3, 102))
    ref = forward(CK.load_model(str(src)), ids)
    assert maxdiff(forward(g, ids), ref) < TOL
    assert maxdiff(forward(plain, ids), ref) > 1e-2


@pytest.mark.parametrize("meta, want", [
    ({"type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    ({"type": "yarn", "factor": 4.0, "original_context_length": 64},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
])
def test_rope_scaling_metadata_becomes_the_hf_scaling(tiny, tmp_path, meta, want):
    """{arch}.rope.scaling.* as convert_hf_to_gguf.py writes it -> the rope_scaling dict that
    test_model.py checks against transformers (ROPE_VARIANTS)."""
    src, _ = tiny("llama")
    path = tiny_gguf(src, tmp_path / "r.gguf", edit=lambda m, t: m.update(
        {f"llama.rope.scaling.{k}": v for k, v in meta.items()}))
    assert CK.load_model(str(path), max_seq_len=8).args.rope_scaling == want


def test_bfloat16_load(tiny):
    _, path = tiny("qwen3")
    model = CK.load_model(str(path), dtype=torch.bfloat16, max_seq_len=32)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    logits = forward(model, IDS[:16])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


@needs_shared
def test_stories_gguf_gives_the_documented_text(tmp_path):
    """The pretrained stories260K as an F32 GGUF with its SentencePiece tokenizer: greedy from BOS."""
    path = write_gguf(tmp_path / "stories.gguf", *stories_parts())
    model, tok = CK.load_model(str(path)), TOK.load_tokenizer(str(path))
    assert model.args.n_kv_heads == 4 and model.args.tie_word_embeddings
    model.setup_caches(model.max_seq_len)          # the model's own cache (one request), for the reference loop
    out = reference_greedy(model, tok.encode(""), 120)
    assert out[:64] == STORIES_IDS64
    assert tok.decode(out) == STORIES_TEXT


# ----------------------------------------------------------------------------- dequantization

def f16(rng, n):
    """n random finite float16 scales, as raw bytes (n, 2)."""
    return rng.uniform(-1, 1, n).astype(np.float16).view(np.uint8).reshape(n, 2)


def as_f32(b):
    return b.copy().view(np.float16).astype(np.float64).ravel()


def scale_min_k4(j, q):
    """ggml-quants.c get_scale_min_k4."""
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_block(kind: str, b: np.ndarray) -> list:
    """One block dequantized by a transcription of ggml-quants.c's dequantize_row_* reference loops."""
    b = [int(x) for x in b]
    h = lambda i: float(np.frombuffer(bytes(b[i:i + 2]), np.float16)[0])
    s8 = lambda x: x - 256 if x > 127 else x
    if kind == "Q8_0":
        return [h(0) * s8(x) for x in b[2:34]]
    if kind == "Q4_0":
        return [h(0) * ((q & 0xF) - 8) for q in b[2:18]] + [h(0) * ((q >> 4) - 8) for q in b[2:18]]
    if kind == "Q4_1":
        return [h(0) * (q & 0xF) + h(2) for q in b[4:20]] + [h(0) * (q >> 4) + h(2) for q in b[4:20]]
    if kind in ("Q5_0", "Q5_1"):
        d, m, qh, qs = (h(0), 0.0, b[2:6], b[6:22]) if kind == "Q5_0" else (h(0), h(2), b[4:8], b[8:24])
        qh = int.from_bytes(bytes(qh), "little")
        off = -16 if kind == "Q5_0" else 0
        lo = [((qs[j] & 0xF) | (((qh >> j) << 4) & 0x10)) + off for j in range(16)]
        hi = [((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) + off for j in range(16)]
        return [d * x + m for x in lo + hi]
    if kind in ("Q4_K", "Q5_K"):
        d, dmin, sc = h(0), h(2), b[4:16]
        qh, ql = (None, b[16:144]) if kind == "Q4_K" else (b[16:48], b[48:176])
        y, u1, u2 = [], 1, 2
        for j in range(4):                       # 64 values per step, two 32-value sub-blocks
            (s1, m1), (s2, m2) = scale_min_k4(2 * j, sc), scale_min_k4(2 * j + 1, sc)
            q = ql[32 * j:32 * j + 32]
            hb1 = [16 if qh and qh[l] & u1 else 0 for l in range(32)]
            hb2 = [16 if qh and qh[l] & u2 else 0 for l in range(32)]
            y += [d * s1 * ((q[l] & 0xF) + hb1[l]) - dmin * m1 for l in range(32)]
            y += [d * s2 * ((q[l] >> 4) + hb2[l]) - dmin * m2 for l in range(32)]
            u1, u2 = u1 << 2, u2 << 2
        return y
    if kind == "Q6_K":
        ql, qh, sc, d = b[0:128], b[128:192], [s8(x) for x in b[192:208]], h(208)
        y = [0.0] * 256
        for n in range(2):
            L, Hh, S = ql[64 * n:64 * n + 64], qh[32 * n:32 * n + 32], sc[8 * n:8 * n + 8]
            for l in range(32):
                i = l // 16
                y[128 * n + l] = d * S[i] * (((L[l] & 0xF) | (((Hh[l] >> 0) & 3) << 4)) - 32)
                y[128 * n + l + 32] = d * S[i + 2] * (((L[l + 32] & 0xF) | (((Hh[l] >> 2) & 3) << 4)) - 32)
                y[128 * n + l + 64] = d * S[i + 4] * (((L[l] >> 4) | (((Hh[l] >> 4) & 3) << 4)) - 32)
                y[128 * n + l + 96] = d * S[i + 6] * (((L[l + 32] >> 4) | (((Hh[l] >> 6) & 3) << 4)) - 32)
        return y
    raise AssertionError(kind)


# where each block type keeps its float16 fields (byte offsets)
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [208]}


def one_tensor_file(path, data: np.ndarray, raw=None) -> torch.Tensor:
    """Write one tensor named w, read it back through gguf_checkpoint.gguf_tensor."""
    write_gguf(path, "llama", {}, {"w": (data, raw)})
    reader, _ = GG.gguf_read(str(path))
    return GG.gguf_tensor(reader.tensors[0])


@pytest.mark.parametrize("kind", list(F16_FIELDS))
def test_block_dequantization_matches_ggml_reference(tmp_path, kind):
    """Random blocks (every bit pattern of the quants, random finite scales), 2 rows of 512 values."""
    rng = np.random.default_rng(0)
    block, size = gguf.GGML_QUANT_SIZES[QT[kind]]
    rows = rng.integers(0, 256, (2, 512 // block, size), dtype=np.uint8)
    for off in F16_FIELDS[kind]:
        rows[:, :, off:off + 2] = f16(rng, rows.shape[0] * rows.shape[1]).reshape(2, -1, 2)
    got = one_tensor_file(tmp_path / "q.gguf", rows.reshape(2, -1), QT[kind])
    ref = torch.tensor([[v for blk in row for v in ref_block(kind, blk)] for row in rows], dtype=torch.float64)
    assert got.shape == (2, 512) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_float_types_dequantize_exactly(tmp_path):
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(one_tensor_file(tmp_path / "f32.gguf", x.numpy()), x)
    h = x.half()
    assert torch.equal(one_tensor_file(tmp_path / "f16.gguf", h.numpy()), h.float())
    bf = x.bfloat16()
    raw = bf.view(torch.int16).numpy().view(np.uint8)         # llama.cpp's BF16: the top 16 bits
    assert torch.equal(one_tensor_file(tmp_path / "bf16.gguf", raw, QT.BF16), bf.float())


# ----------------------------------------------------------------------------- tokenizers

TEXTS = ["", "Hello world", "  leading and  double  spaces ", "tabs\tand\nnew\n\nlines", "digits 1234567 and 3.14",
         "def f(x):\n    return x**2  # square", "naïve café, Zürich — ½ ∑ 日本語", "emoji 😀🚀 done",
         "Once upon a time, there was a little girl named Lily.", "it's don't we'll THEY'RE", "<s>inline special</s>"]


def once(ids: list) -> list:
    """A reference's ids without the second BOS it puts in front of a text that starts with BOS
    (Tokenizer.encode never adds BOS twice)."""
    return ids[1:] if ids[:2] == [1, 1] else ids


def test_bpe_tokenizer_from_metadata_encodes_like_tokenizer_json(tiny):
    from tokenizers import Tokenizer as TK
    src, path = tiny("llama")
    ours, ref = TOK.load_tokenizer(str(path)), TK.from_file(str(src / "tokenizer.json"))
    for t in TEXTS:
        assert ours.encode(t) == once(ref.encode(t).ids), repr(t)
        assert ours.encode(t, add_special_tokens=False) == ref.encode(t, add_special_tokens=False).ids, repr(t)
    assert ours.decode(ours.encode("Once upon a time")) == "Once upon a time"
    assert (ours.bos_id, ours.eos_ids, ours.bos_token, ours.eos_token) == (1, [2], "<s>", "</s>")


def test_chat_template_comes_from_metadata(tiny):
    src, path = tiny("qwen3")
    g, s = TOK.load_tokenizer(str(path)), TOK.load_tokenizer(str(src))
    assert g.chat_template == s.chat_template and g.chat_template
    assert g.apply_chat("Hi there") == s.apply_chat("Hi there")


def stories_parts() -> tuple:
    """stories260K-hf as convert_hf_to_gguf.py would write it with its tokenizer.model
    (_set_vocab_sentencepiece: pieces, scores and types from SentencePiece; add_space_prefix and
    remove_extra_whitespaces from the model's normalizer, both true, see ../shared/models/SOURCES.md)."""
    import sentencepiece as spm
    arch, meta, tensors = model_parts(STORIES)
    sp = spm.SentencePieceProcessor(model_file=str(SHARED / "models" / "stories260K" / "tok512.model"))
    n = sp.get_piece_size()
    kind = lambda i: (gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                      else gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.BYTE if sp.is_byte(i)
                      else gguf.TokenType.NORMAL)
    meta |= {K.Tokenizer.MODEL: "llama", K.Tokenizer.PRE: "default",
             K.Tokenizer.LIST: [sp.id_to_piece(i) for i in range(n)],
             K.Tokenizer.SCORES: [float(sp.get_score(i)) for i in range(n)],
             K.Tokenizer.TOKEN_TYPE: [int(kind(i)) for i in range(n)],
             K.Tokenizer.BOS_ID: sp.bos_id(), K.Tokenizer.EOS_ID: sp.eos_id(), K.Tokenizer.UNK_ID: sp.unk_id(),
             K.Tokenizer.ADD_BOS: True, K.Tokenizer.ADD_EOS: False, K.Tokenizer.ADD_PREFIX: True,
             K.Tokenizer.REMOVE_EXTRA_WS: True}
    return arch, meta, tensors


@needs_shared
def test_sentencepiece_tokenizer_from_metadata_encodes_like_tokenizer_json(tmp_path):
    """llama.cpp's SentencePiece path (dummy "▁" prefix, spaces as "▁", byte fallback) equals the
    tokenizer.json rebuilt from the same tok512.model; neither drops repeated spaces."""
    from tokenizers import Tokenizer as TK
    arch, meta, _ = stories_parts()
    ref = TK.from_file(str(STORIES / "tokenizer.json"))
    assert meta[K.Tokenizer.LIST] == sorted(ref.get_vocab(), key=ref.get_vocab().get)
    ours = TOK.load_tokenizer(str(write_gguf(tmp_path / "spm.gguf", arch, meta, {})))
    for t in TEXTS:
        assert ours.encode(t) == once(ref.encode(t).ids), repr(t)
    assert ours.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert ours.encode("😀", add_special_tokens=False)[-4:] == [3 + b for b in "😀".encode()]  # <0xF0>...
    assert ours.decode(ours.encode("naïve café 😀")) == "naïve café 😀"   # byte fallback round trip


# the Split pattern of Meta's Llama-3 tokenizer.json (quoted in llama.cpp's llama-vocab.cpp)
LLAMA3_ORIGINAL = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_pre_tokenizer_regexes_equal_the_originals():
    """llama.cpp spells the (?i:...) contractions of Llama-3's and Qwen2's regexes out; they must split
    text exactly as the originals do (Qwen2's: transformers' copy)."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2
    text = " ".join(TEXTS) + " I'M HE'S we'Ll 12345678 \r\n\r\n  x"
    split = lambda r: [p for p, _ in pre_tokenizers.Split(Regex(r), "isolated").pre_tokenize_str(text)]
    assert split(TOK.GGUF_PRE["llama-bpe"][0]) == split(LLAMA3_ORIGINAL)
    assert split(TOK.GGUF_PRE["qwen2"][0]) == split(QWEN2)
    assert "HE'S" not in split(LLAMA3_ORIGINAL) and "'S" in split(LLAMA3_ORIGINAL)   # case-insensitive


def test_unknown_pre_tokenizer_is_an_error(tiny_ckpt, tmp_path):
    src = tiny_ckpt("llama2")
    path = tiny_gguf(src, tmp_path / "x.gguf", edit=lambda m, t: m.update({K.Tokenizer.PRE: "falcon"}))
    msg = error_of(TOK.load_tokenizer, str(path))
    assert "tokenizer.ggml.pre 'falcon'" in msg and "smollm" in msg


# ----------------------------------------------------------------------------- SmolLM2-135M-Instruct (real)

SMOL_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "Give me three tips for staying healthy."]
# transformers 5.24 + accelerate 1.15: AutoModelForCausalLM.from_pretrained(models, gguf_file=SMOL, dtype=float32)
# and generate(do_sample=False, max_new_tokens=24) on AutoTokenizer's chat rendering of each prompt
# (it stops after <|im_end|>, id 2). Recorded because that load takes ~35 s on this machine; the live
# comparison is test_smollm2_matches_transformers_live, which runs where accelerate is installed.
SMOL_GREEDY = [
    [504, 3575, 282, 4649, 314, 7042, 30, 2],
    [504, 6147, 282, 260, 3426, 28, 253, 13879, 6122, 28, 198, 49, 9154, 303, 5082, 282, 260, 10393, 28, 198, 49,
     13151, 282, 260],
    [33, 30, 13138, 22892, 42, 26883, 7568, 282, 913, 28, 2117, 981, 260, 2817, 30, 216, 34, 30, 16478, 253, 8609,
     2714, 42, 330],
]


@pytest.fixture(scope="module")
def smol():
    model = CK.load_model(str(SMOL), max_seq_len=128)
    model.setup_caches(model.max_seq_len)          # the model's own cache (one request), for the reference loop
    return model, TOK.load_tokenizer(str(SMOL))


@needs_smol
def test_smollm2_config_and_special_tokens(smol):
    model, tok = smol
    a = model.args
    assert (a.arch, a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert (a.intermediate_size, a.vocab_size, a.rope_theta, a.tie_word_embeddings) == (1536, 49152, 100000.0, True)
    assert (tok.bos_id, tok.eos_ids, tok.eos_token) == (1, [2], "<|im_end|>")
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False)     # SmolLM2 adds no BOS


@needs_smol
def test_smollm2_tokenizer_matches_transformers_gguf_tokenizer(smol):
    from transformers import AutoTokenizer
    _, tok = smol
    ref = AutoTokenizer.from_pretrained(str(SMOL.parent), gguf_file=SMOL.name)
    for p in SMOL_PROMPTS:
        text = ref.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat(p) == ref(text, add_special_tokens=False).input_ids
    assert tok.encode("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False)[0] == 1


@needs_smol
def test_smollm2_splits_digits_one_by_one(smol):
    """tokenizer.ggml.pre "smollm": llama.cpp (and SmolLM2's own tokenizer.json) isolate every digit
    before the GPT-2 split; transformers' GGUF tokenizer does not know this pre-tokenizer."""
    _, tok = smol
    assert [tok.decode([i]) for i in tok.encode("In 2024")] == ["In", " ", "2", "0", "2", "4"]


@needs_smol
def test_smollm2_greedy_matches_transformers(smol):
    model, tok = smol
    for p, want in zip(SMOL_PROMPTS, SMOL_GREEDY):
        assert reference_greedy(model, tok.apply_chat(p), 24, tok.eos_ids) == want, p
    assert tok.decode(SMOL_GREEDY[0]) == "The capital of France is Paris."


@needs_smol
def test_smollm2_matches_transformers_live(smol):
    pytest.importorskip("accelerate", reason="transformers' GGUF from_pretrained needs accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = smol
    ref = AutoModelForCausalLM.from_pretrained(str(SMOL.parent), gguf_file=SMOL.name, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(str(SMOL.parent), gguf_file=SMOL.name)
    for p in SMOL_PROMPTS:
        ids = tok.apply_chat(p)
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)[0, len(ids):].tolist()
        assert reference_greedy(model, ids, 24, [ref_tok.eos_token_id]) == out, p


# ----------------------------------------------------------------------------- resolving, engine, cache key

def test_folder_with_one_gguf_loads_it(tiny, tmp_path):
    _, path = tiny("llama")
    d = tmp_path / "one"
    d.mkdir()
    shutil.copy(path, d / "m.gguf")
    assert CK.resolve_checkpoint(str(d)) == str(d / "m.gguf")
    model = CK.load_model(str(d))
    assert model.path == str(d / "m.gguf")
    shutil.copy(path, d / "n.gguf")
    assert "2 .gguf files" in error_of(CK.resolve_checkpoint, str(d))


def test_folder_with_config_json_stays_a_folder(tiny, tmp_path):
    src, path = tiny("llama")
    d = tmp_path / "hf"
    shutil.copytree(src, d)
    shutil.copy(path, d / "m.gguf")
    assert CK.resolve_checkpoint(str(d)) == str(d)


def test_build_engine_and_warmup_key_stamp_the_file(tiny, tmp_path):
    _, path = tiny("qwen3")
    f = tmp_path / "m.gguf"
    shutil.copy(path, f)
    eng = CLI.build_engine(str(f), max_seq_len=64)
    assert eng.model.args.arch == "qwen3" and eng.tokenizer.encode("a b")[0] == 1
    key = CAL.state_path_for(eng, "x")
    assert CAL.state_path_for(eng, "x") == key
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))       # the same bytes, touched: the same model
    assert CAL.state_path_for(eng, "x") == key
    data = bytearray(f.read_bytes())
    data[-1] ^= 1                                                   # one weight bit changed, times kept
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert CAL.state_path_for(eng, "x") != key


# ----------------------------------------------------------------------------- bad files

@pytest.fixture
def bad(tiny_ckpt, tmp_path):
    """bad(edit) -> the load error of the tiny Llama GGUF after edit(meta, tensors)."""
    def get(edit) -> str:
        src = tiny_ckpt(TINY["llama"][0], **TINY["llama"][1])
        return error_of(CK.load_model, str(tiny_gguf(src, tmp_path / "bad.gguf", edit=edit)))
    return get


def test_error_unsupported_architecture(bad):
    msg = bad(lambda m, t: m.update({"general.architecture": "gpt2"}))
    assert "unsupported GGUF architecture 'gpt2'" in msg and "llama, qwen3" in msg


def test_error_missing_tensor(bad):
    assert "lacks tensor blk.3.ffn_up.weight (1 missing)" in bad(lambda m, t: t.pop("blk.3.ffn_up.weight"))


def test_error_wrong_shape(bad):
    msg = bad(lambda m, t: t.update({"blk.2.attn_k.weight": (np.zeros((64, 64), np.float32), None)}))
    assert "blk.2.attn_k.weight has shape (64, 64), the metadata implies (32, 64)" in msg


def test_error_unknown_tensor(bad):
    msg = bad(lambda m, t: t.update({"blk.0.attn_q.bias": (np.zeros(64, np.float32), None)}))
    assert "blk.0.attn_q.bias has no place" in msg


def test_error_unsupported_quant_type(bad):
    raw = np.random.default_rng(0).integers(0, 256, (128, 2 * 18), dtype=np.uint8)   # 128 x 64 in IQ4_NL
    msg = bad(lambda m, t: t.update({"blk.1.ffn_up.weight": (raw, QT.IQ4_NL)}))
    assert "blk.1.ffn_up.weight is stored as IQ4_NL" in msg and "Q4_K" in msg


def test_error_nan_weight(bad):
    def edit(m, t):
        t["blk.1.attn_v.weight"][0][3, 5] = np.nan
    msg = bad(edit)
    assert "blk.1.attn_v.weight holds non-finite values" in msg


def test_error_unsupported_metadata(bad):
    msg = bad(lambda m, t: m.update({"llama.expert_count": 8}))
    assert "llama.expert_count = 8" in msg


def test_error_bad_head_counts(bad):
    assert "not a multiple of head_count_kv 3" in bad(lambda m, t: m.update({"llama.attention.head_count_kv": 3}))
    assert "llama.block_count must be a positive integer, got missing" in bad(lambda m, t: m.pop("llama.block_count"))


def test_error_truncated_and_garbage_files(tiny, tmp_path):
    _, path = tiny("llama")
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4)
    (tmp_path / "text.gguf").write_text("not a model\n")
    (tmp_path / "empty.gguf").write_bytes(b"")
    for name in ("cut", "junk", "text", "empty"):
        msg = error_of(CK.load_model, str(tmp_path / f"{name}.gguf"))
        assert msg.startswith(f"cannot read {tmp_path / name}.gguf as GGUF"), msg
        assert msg == error_of(TOK.load_tokenizer, str(tmp_path / f"{name}.gguf"))


def test_error_file_that_is_not_gguf_or_is_missing(tmp_path, monkeypatch):
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert "is a file but not a .gguf" in error_of(CK.load_model, str(tmp_path / "weights.bin"))
    monkeypatch.chdir(tmp_path)     # "models/x.gguf" has the shape of a hub id; it is a missing file
    assert error_of(CK.load_model, "models/x.gguf") == "GGUF file not found: models/x.gguf"


def test_fast_reader_reads_what_gguf_reader_reads(tiny):
    """model.py's GGUFReader subclass only changes how the mapping is sliced."""
    _, path = tiny("qwen3", "Q8_0")
    ours, ref = GG.gguf_read(str(path))[0], gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(ref.fields)
    assert all(ours.fields[k].contents() == ref.fields[k].contents() for k in ref.fields)
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == \
           [(t.name, t.tensor_type, t.shape.tolist()) for t in ref.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, ref.tensors))
