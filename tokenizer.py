"""Tokenizers: tokenizer.json through `tokenizers`, a SentencePiece tokenizer.model through sentencepiece,
a GGUF file's vocabulary rebuilt as llama.cpp tokenizes; special tokens, EOS ids, sandboxed chat
templates and Vicuna's built-in format."""
import json
import os
import re

from checkpoint import Fields, _short, hf_model_args, is_gguf, read_config, read_json, resolve_checkpoint
from model import GraftError, ModelArgs


# ----------------------------------------------------------------------------- GGUF vocabularies

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe) by tokenizer.ggml.pre: applied
# in order, each splitting the pieces the one before left, matches and gaps alike kept as pieces.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"],   # also when pre is absent
    "gpt-2": [_GPT2_RE],
    "smollm": [r"\p{N}", _GPT2_RE],                                # digits one by one, then GPT-2's
    "llama-bpe": [_LLAMA3_RE], "llama3": [_LLAMA3_RE], "llama-v3": [_LLAMA3_RE],
    "qwen2": [_QWEN2_RE], "deepseek-r1-qwen": [_QWEN2_RE],
}
# llama.cpp's Llama-3 pre-tokenizer adds BOS by default and takes a piece that is itself a token whole
_GGUF_LLAMA3 = {"llama-bpe", "llama3", "llama-v3"}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6   # tokenizer.ggml.token_type


def _spm_merges(tokens: list, scores: list, types: list, path: str) -> list:
    """Ranked BPE merges that reproduce llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm): it
    repeatedly merges the adjacent pair whose concatenation is the best-scoring token, so every split of
    every normal token into two vocabulary pieces is a merge, ranked by that token's score."""
    ids = {t: i for i, t in enumerate(tokens)}
    out, seen = [], {}
    for i, t in enumerate(tokens):
        if types[i] not in (NORMAL, UNUSED) or len(t) < 2:
            continue
        if scores[i] in seen:  # ranked merges cannot express llama.cpp's leftmost-first tie-break
            raise GraftError(f"{path}: tokens {tokens[seen[scores[i]]]!r} and {t!r} share the score {scores[i]}: "
                             f"the merge order is not defined by tokenizer.ggml.scores")
        seen[scores[i]] = i
        out += [(-scores[i], ids[t[:k]], ids[t[k:]]) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids]
    out.sort()
    return [(tokens[a], tokens[b]) for _, a, b in out]


def gguf_tokenizer(meta: dict, path: str, model=None):
    """A tokenizers.Tokenizer rebuilt from GGUF tokenizer metadata to tokenize as llama.cpp does
    (src/llama-vocab.cpp); transformers is not needed.

    tokenizer.ggml.model "gpt2": byte-level BPE from tokens + merges, split first by the regexes of
    tokenizer.ggml.pre (GGUF_PRE; an unknown one is a GraftError). "llama": SentencePiece from tokens +
    scores, byte fallback to the <0xXX> tokens, spaces as "▁" with a dummy "▁" prefix unless
    tokenizer.ggml.add_space_prefix is false. Control and unknown tokens (token_type 3, 2) are special
    (matched whole, skipped when decoding), user-defined ones (4) are matched whole. BOS/EOS are added
    as tokenizer.ggml.add_bos_token/add_eos_token say, with llama.cpp's defaults (BOS for SentencePiece
    and Llama-3 BPE). `model`, a tokenizers model, replaces the SentencePiece merges (a unigram
    tokenizer.model's Unigram)."""
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors
    tokens, kind = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.model")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise GraftError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens string list")
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type", [NORMAL] * n)
    if not isinstance(types, list) or len(types) != n:
        raise GraftError(f"{path}: tokenizer.ggml.token_type does not give one type per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != n:
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise GraftError(f"{path}: token {dup!r} appears twice in tokenizer.ggml.tokens")
    try:
        if kind == "gpt2":
            pre = meta.get("tokenizer.ggml.pre", "default")
            if pre not in GGUF_PRE:
                raise GraftError(f"{path}: unsupported tokenizer.ggml.pre {_short(pre)}: supported are "
                                 f"{', '.join(GGUF_PRE)}")
            merges = meta.get("tokenizer.ggml.merges")
            if not isinstance(merges, list) or any(not isinstance(m, str) or m.find(" ", 1) < 0 for m in merges):
                raise GraftError(f"{path}: a byte-level BPE GGUF needs tokenizer.ggml.merges as 'left right' strings")
            pairs = [(m[:m.find(" ", 1)], m[m.find(" ", 1) + 1:]) for m in merges]  # as llama.cpp splits them
            tk = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=pre in _GGUF_LLAMA3))
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), "isolated") for r in GGUF_PRE[pre]]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            tk.decoder = decoders.ByteLevel()
            add_bos = pre in _GGUF_LLAMA3
        elif kind == "llama":
            scores = meta.get("tokenizer.ggml.scores")
            if not isinstance(scores, list) or len(scores) != n:
                raise GraftError(f"{path}: a SentencePiece GGUF needs one tokenizer.ggml.scores value per token")
            unk = meta.get("tokenizer.ggml.unknown_token_id")
            unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < n else None
            tk = HFTokenizer(model if model is not None else models.BPE(
                vocab, _spm_merges(tokens, scores, types, path), unk_token=unk, byte_fallback=True, fuse_unk=True))
            # llama.cpp's SentencePiece path writes spaces as "▁" and puts one in front of the text and after
            # each special token (its tokenizer.ggml.remove_extra_whitespaces is not applied there either)
            prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
            tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁")] * bool(prefix)
                                                 + [normalizers.Replace(" ", "▁")])
            tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                           + [decoders.Strip(" ", 1, 0)] * bool(prefix))
            add_bos = True
        else:
            raise GraftError(f"{path}: unsupported tokenizer.ggml.model {_short(kind)}: supported are gpt2 "
                             f"(byte-level BPE) and llama (SentencePiece)")
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
        tk.add_tokens([AddedToken(t, special=False, normalized=False)
                       for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    except GraftError:
        raise
    except Exception as e:  # tokenizers rejecting the vocabulary or merges
        raise GraftError(f"{path}: bad GGUF tokenizer: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    from gguf_checkpoint import gguf_special_ids
    bos, _ = gguf_special_ids(meta, n, path)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", add_bos)
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    for key, v in (("add_bos_token", add_bos), ("add_eos_token", add_eos),
                   ("add_space_prefix", meta.get("tokenizer.ggml.add_space_prefix", True))):
        if not isinstance(v, bool):
            raise GraftError(f"{path}: tokenizer.ggml.{key} = {_short(v)} is not a bool")
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise GraftError(f"{path}: the GGUF tokenizer adds {'BOS' if add_bos and bos is None else 'EOS'} "
                         f"but names no such token id")
    ends = [i for i, on in ((bos, add_bos), (eos, add_eos)) if on]
    if ends:
        tk.post_processor = processors.TemplateProcessing(
            single=[tokens[bos]] * bool(add_bos) + ["$A"] + [tokens[eos]] * bool(add_eos),
            special_tokens=[(tokens[i], i) for i in ends])
    return tk


# ----------------------------------------------------------------------------- SentencePiece tokenizer.model

def _proto(buf: bytes):
    """The (field number, value) pairs of a protobuf message (wire types 0, 1, 2, 5): the few fields of
    sentencepiece_model.proto read below, without a protobuf library."""
    def varint(i):
        v = shift = 0
        while True:
            b = buf[i]
            v |= (b & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if b < 0x80:
                return v, i
    i = 0
    while i < len(buf):
        key, i = varint(i)
        wire = key & 7
        if wire == 0:
            v, i = varint(i)
        elif wire == 2:
            n, i = varint(i)
            v, i = buf[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            v, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"wire type {wire}")
        yield key >> 3, v


def _spm_load(file: str):
    """The sentencepiece library's processor for the SentencePiece model `file`, which it reads and checks.
    Errors: GraftError, one line (no sentencepiece package, not a SentencePiece model, a damaged one)."""
    try:
        import sentencepiece
    except ImportError:
        raise GraftError(f"{file}: reading a SentencePiece tokenizer.model needs the sentencepiece package "
                         f"(pip install sentencepiece)") from None
    try:
        return sentencepiece.SentencePieceProcessor(model_file=file)
    except Exception as e:     # not a SentencePiece model, or a damaged one
        raise GraftError(f"cannot read {file} as a SentencePiece model: {str(e).splitlines()[0][:200]}") from None


def sentencepiece_tokenizer(file: str):
    """A tokenizers.Tokenizer with the vocabulary of the SentencePiece model `file` (tokenizer.model:
    Llama-2, Vicuna), for decoding; encoding goes through sentencepiece itself (SentencePieceEncoder).
    Pieces, scores, types and the encoding settings come from the model's protobuf (TrainerSpec
    model_type, byte_fallback; NormalizerSpec name, precompiled_charsmap, add_dummy_prefix,
    remove_extra_whitespaces). BPE models become merges ranked by score, unigram models a Unigram
    model. Errors: GraftError, one line."""
    import struct
    from tokenizers import Regex, models, normalizers
    sp = _spm_load(file)
    try:
        pieces, trainer, norm = [], {}, {}
        for f, v in _proto(sp.serialized_model_proto()):
            if f == 1:
                p = dict(_proto(v))
                pieces.append((p[1].decode("utf-8"), struct.unpack("<f", p.get(2, b"\0\0\0\0"))[0], p.get(3, NORMAL)))
            elif f == 2:
                trainer = dict(_proto(v))
            elif f == 3:
                norm = dict(_proto(v))
    except Exception as e:     # a protobuf this reader does not follow
        raise GraftError(f"cannot read {file} as a SentencePiece model: {str(e).splitlines()[0][:200]}") from None
    kind = trainer.get(3, 1)                                 # ModelType: UNIGRAM = 1, BPE = 2
    if kind not in (1, 2):
        raise GraftError(f"{file}: SentencePiece model type {kind} is not supported (unigram and BPE are)")
    tokens, scores, types = [p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces]
    prefix, squeeze = bool(norm.get(3, 1)), bool(norm.get(4, 1))
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.add_space_prefix": prefix,
            "tokenizer.ggml.unknown_token_id": sp.unk_id(), "tokenizer.ggml.add_bos_token": sp.bos_id() >= 0}
    for key, i in (("bos", sp.bos_id()), ("eos", sp.eos_id())):
        if i >= 0:
            meta[f"tokenizer.ggml.{key}_token_id"] = i
    # unigram: scores are log-probabilities, no merge order (scores may tie)
    unigram = models.Unigram(list(zip(tokens, scores)), sp.unk_id(), bool(trainer.get(35, 0))) if kind == 1 else None
    tk = gguf_tokenizer(meta, file, unigram)
    steps = []
    name = norm.get(1, b"identity").decode()
    if name != "identity" and norm.get(2):
        steps.append(normalizers.Precompiled(norm[2]))       # the model's own character map (NFKC-style)
    if squeeze:                                              # leading, trailing and repeated spaces go
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A | \z"), "")]
    tk.normalizer = normalizers.Sequence(steps + [normalizers.Prepend("▁")] * prefix + [normalizers.Replace(" ", "▁")])
    return tk


class SentencePieceEncoder:
    """Text to ids for a SentencePiece tokenizer.model through the sentencepiece library itself, plus
    what transformers' Llama tokenizer adds on top: control and unknown pieces written in the text
    (<s>, </s>, <unk>) are those tokens, longest first, and the text between them is encoded part by
    part. `legacy` (tokenizer_config.json) says how a part after such a token starts. True (transformers'
    legacy behaviour, and llama.cpp's): as a text of its own, dummy prefix included (`Hi</s>there` gives
    `▁there`). False: no dummy prefix (`there`), a leading space kept as one `▁`; the model without its
    dummy prefix encodes "<unk>" + part and the pieces of "<unk>" are cut off, as transformers does.
    Text without such tokens gives sentencepiece's own ids either way. Errors: GraftError, one line."""

    def __init__(self, file: str, legacy: bool = True):
        import sentencepiece
        self.file, self.legacy, self.sp = file, legacy, _spm_load(file)
        sp = self.sp
        self.bos = sp.bos_id() if sp.bos_id() >= 0 else None
        self.special = {sp.id_to_piece(i): i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
        self.split = re.compile("(" + "|".join(re.escape(t) for t in sorted(self.special, key=len, reverse=True)) + ")")
        # protobuf merges a repeated message field into the first: this second normalizer_spec (field 3) holds
        # only add_dummy_prefix (its field 3) = false, so this is the same model without the dummy prefix
        self.no_prefix = sentencepiece.SentencePieceProcessor(model_proto=sp.serialized_model_proto() + b"\x1a\x02\x18\x00")
        self.unk = sp.id_to_piece(sp.unk_id())
        self.unk_ids = self.no_prefix.encode(self.unk)

    def encode(self, text: str) -> list:
        """The ids of `text`, no BOS or EOS added."""
        parts = self.split.split(text)          # text, special token, text, ...: odd places are special tokens
        ids = []
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(self.special[part])
            elif not part:
                continue
            elif self.legacy or k == 0:
                ids += self.sp.encode(part)
            elif part.startswith((" ", "▁")):
                got = self.no_prefix.encode(self.unk + part)
                if got[:len(self.unk_ids)] != self.unk_ids:
                    raise GraftError(f"{self.file}: cannot encode {_short(part)} after a special token with legacy "
                                     f"false: the pieces of {self.unk} merge with the text that follows")
                ids += got[len(self.unk_ids):]
            else:
                ids += self.no_prefix.encode(part)
        return ids


def is_vicuna(path: str) -> bool:
    """A checkpoint that says it is Vicuna: its config's _name_or_path, or its folder or hub id, names it."""
    cfg = os.path.join(path, "config.json")
    name = read_json(cfg).get("_name_or_path", "") if os.path.isfile(cfg) else ""
    return "vicuna" in f"{name} {os.path.abspath(path)}".lower()


# The Vicuna v1.1 conversation format (FastChat's "vicuna_v1.1"), for checkpoints that say they are
# Vicuna and carry no chat template of their own.
VICUNA_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = 'A chat between a curious user and an artificial intelligence assistant. The "
    "assistant gives helpful, detailed, and polite answers to the user\\'s questions.' %}{% set rest = messages %}"
    "{% endif %}{{ system + ' ' }}{% for m in rest %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


# ----------------------------------------------------------------------------- chat templates and the Tokenizer

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
    """tokenizer.json through `tokenizers`, or a SentencePiece tokenizer.model through sentencepiece
    (SentencePieceEncoder, with tokenizer_config.json's `legacy`; decoding through `tokenizers`); special
    tokens and the chat template from tokenizer_config.json."""
    spm = None                             # the SentencePieceEncoder of a tokenizer.model

    def __init__(self, path: str, model_args: ModelArgs | None = None):
        from tokenizers import Tokenizer as HFTokenizer
        f, spm_file = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer.model")
        cf = os.path.join(path, "tokenizer_config.json")
        cfg = Fields(read_json(cf) if os.path.isfile(cf) else {}, "tokenizer_config.json")
        if os.path.isfile(f):
            try:
                self.tk = HFTokenizer.from_file(f)
            except Exception as e:     # the Rust side reports bad JSON and bad models alike as Exception
                raise GraftError(f"malformed tokenizer.json in {path}: {str(e).splitlines()[0][:200]}") from None
        elif os.path.isfile(spm_file):     # Llama-2 era checkpoints (Vicuna) ship only SentencePiece's model
            # transformers 4.x reads a missing `legacy` as true (the behaviour Llama-2-era checkpoints were
            # made with), 5.x as false; a checkpoint that does not say keeps the legacy behaviour
            legacy = cfg.obj.get("legacy")
            if legacy is not None and not isinstance(legacy, bool):
                raise GraftError(f"malformed tokenizer_config.json in {path}: legacy must be true or false, "
                                 f"not {_short(legacy)}")
            # add_bos_token / add_eos_token: what transformers' Llama tokenizer adds (defaults true, false)
            self.add_ends = []
            for name, default in (("add_bos_token", True), ("add_eos_token", False)):
                on = cfg.obj.get(name, default)
                if not isinstance(on, bool):
                    raise GraftError(f"malformed tokenizer_config.json in {path}: {name} must be true or false, "
                                     f"not {_short(on)}")
                self.add_ends.append(on)
            self.tk = sentencepiece_tokenizer(spm_file)
            self.spm = SentencePieceEncoder(spm_file, legacy is not False)
            for on, name, i in zip(self.add_ends, ("BOS", "EOS"), (self.spm.sp.bos_id(), self.spm.sp.eos_id())):
                if on and i < 0:
                    raise GraftError(f"tokenizer_config.json in {path} adds {name}, which {spm_file} does not have")
        else:
            raise GraftError(f"no tokenizer.json or tokenizer.model in {path}")
        self.chat_template = pick_chat_template(cfg.obj.get("chat_template"), "tokenizer_config.json")
        jt = os.path.join(path, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(jt):
            try:
                with open(jt, "rb") as fh:
                    self.chat_template = fh.read().decode("utf-8")
            except UnicodeDecodeError:
                raise GraftError(f"chat_template.jinja in {path} is not UTF-8 text") from None
        if self.chat_template is None and is_vicuna(path):
            self.chat_template = VICUNA_TEMPLATE
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

    @classmethod
    def from_gguf(cls, path: str, model_args: ModelArgs | None = None) -> "Tokenizer":
        """The tokenizer a .gguf file describes in its metadata (gguf_tokenizer), its chat template
        (tokenizer.chat_template) and special tokens; BOS/EOS ids from model_args when given."""
        from gguf_checkpoint import gguf_read, gguf_special_ids
        _, meta = gguf_read(path)
        self = cls.__new__(cls)
        self.tk = gguf_tokenizer(meta, path)
        tokens = meta["tokenizer.ggml.tokens"]
        bos, eos = gguf_special_ids(meta, len(tokens), path)
        if model_args is not None:
            bos, eos = model_args.bos_token_id, sorted(set(model_args.eos_token_ids) | set(eos))
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise GraftError(f"{path}: tokenizer.chat_template is not a string")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        self.chat_template, self.bos_id, self.eos_ids = template, bos, eos
        self.bos_token = tokens[bos] if bos is not None else None
        self.eos_token = tokens[eos_id] if eos_id in eos else None
        tok = lambda key: (tokens[meta[key]] if isinstance(meta.get(key), int) and 0 <= meta[key] < len(tokens)
                           else None)
        self.special = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                        "unk_token": tok("tokenizer.ggml.unknown_token_id"),
                        "pad_token": tok("tokenizer.ggml.padding_token_id")}
        if model_args is not None:
            self.check_fits(model_args, path)
        return self

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        """The ids of `text`; with add_special_tokens, the tokenizer's BOS (and whatever else its
        post-processor adds), but never a second BOS in front of a text that starts with the BOS token
        (transformers and llama.cpp would give two). Text that is not valid Unicode (a lone surrogate, as
        Python makes of bytes that are not UTF-8) is a GraftError."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise GraftError(f"the text is not valid Unicode: {e.reason} at character {e.start} "
                             f"({text[e.start]!r})") from None
        if self.spm is not None:
            ids = self.spm.encode(text)
            add_bos, add_eos = self.add_ends if add_special_tokens else (False, False)
            if add_bos and self.spm.bos is not None and ids[:1] != [self.spm.bos]:
                ids = [self.spm.bos] + ids
            if add_eos and self.spm.sp.eos_id() >= 0:
                ids = ids + [self.spm.sp.eos_id()]
        else:
            ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids if text else []
            if add_special_tokens and len(ids) > 1 and ids[0] == ids[1]:
                plain = self.tk.encode(text, add_special_tokens=False).ids
                if plain[:1] == ids[:1] and ids[1:1 + len(plain)] == plain:   # the added first token is the text's
                    ids = ids[1:]
        if add_special_tokens and not ids and self.bos_id is not None and (self.spm is None or self.add_ends[0]):
            ids = [self.bos_id]  # an empty prompt is just BOS (generation "from BOS")
        return ids

    def decode(self, ids: list) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=True)

    def render(self, messages: list, add_generation_prompt: bool = True, **context) -> str:
        """The checkpoint's chat template rendered for `messages`, with its special tokens in scope."""
        if not self.chat_template:
            raise GraftError("--chat: this checkpoint has no chat_template in tokenizer_config.json (and is not "
                             "a Vicuna model, whose v1.1 format is built in)")
        specials = {k: v for k, v in self.special.items() if v is not None}
        return render_chat(self.chat_template, messages, add_generation_prompt, **{**specials, **context})

    def apply_chat(self, user_text: str) -> list:
        """One user turn rendered with the checkpoint's own chat template, ready for the reply
        (enable_thinking=False: Qwen3 templates then skip the reasoning block), as token ids."""
        text = self.render([{"role": "user", "content": user_text}], True, enable_thinking=False)
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(ckpt: str, model_args: ModelArgs | None = None) -> Tokenizer:
    path = resolve_checkpoint(ckpt)
    if is_gguf(path):
        from gguf_checkpoint import gguf_model_args, gguf_read
        reader, meta = gguf_read(path)
        if model_args is None and len(reader.tensors):     # a file with weights: check them against each other
            model_args = gguf_model_args(meta, {t.name: t for t in reader.tensors}, path)
        return Tokenizer.from_gguf(path, model_args)
    return Tokenizer(path, model_args or hf_model_args(read_config(path)))
