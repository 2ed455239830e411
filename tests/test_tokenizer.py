"""SentencePiece tokenizer.model checkpoints against sentencepiece itself and transformers' Llama tokenizer.

Tiny models are trained here by sentencepiece's own trainer (SentencePieceTrainer.train) on a few KB of
a Python standard-library source file: BPE and unigram, the default nmt_nfkc normalizer and identity,
user-defined and control symbols, byte fallback on and off. Text without special tokens must encode to
sentencepiece's own ids (BOS first) and decode to its text. Special tokens written in the text and
tokenizer_config.json's `legacy` are checked against transformers' LlamaTokenizer (test-only), built
from the same model's pieces with transformers' own generate_merges (reading a tokenizer.model itself
needs protobuf, which transformers' converter imports and this project does not install).
"""
import json
import random
import re
import textwrap

import pytest

import model as M
import tokenizer as TOK

CORPUS = open(textwrap.__file__, encoding="utf-8").read()[:12000] + (
    "\nnaïve café, Zürich — ½ ∑ 日本語 中文 🙂 ｶﾞ ﬁ ①\r\nline\tand\ttabs\r\n<tool>call</tool> x<tool>y\n")

# name: trainer options (on top of BPE, vocab 200, full character coverage)
MODELS = {
    "bpe-nfkc": dict(user_defined_symbols=["<tool>", "</tool>"], control_symbols=["<ctrl>"]),
    "unigram-nfkc": dict(model_type="unigram", vocab_size=150, user_defined_symbols=["<tool>", "</tool>"],
                         control_symbols=["<ctrl>"]),
    "bpe-identity-bytes": dict(normalization_rule_name="identity", remove_extra_whitespaces=False,
                               byte_fallback=True, vocab_size=400, user_defined_symbols=["<tool>"]),
    "unigram-nfkc-bytes": dict(model_type="unigram", byte_fallback=True, vocab_size=400,
                               user_defined_symbols=["<tool>"], control_symbols=["<ctrl>"]),
    # Llama-2's settings: BPE, identity, spaces kept, byte fallback, no symbols of its own
    "llama": dict(normalization_rule_name="identity", remove_extra_whitespaces=False, byte_fallback=True,
                  vocab_size=400, split_digits=True),
}


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    """name -> the trained .model file; all trained once (a fraction of a second each)."""
    import sentencepiece as spm
    d = tmp_path_factory.mktemp("spm")
    (d / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    out = {}
    for name, opts in MODELS.items():
        spm.SentencePieceTrainer.train(**{"input": str(d / "corpus.txt"), "model_prefix": str(d / name),
                                          "model_type": "bpe", "vocab_size": 200, "character_coverage": 1.0,
                                          "minloglevel": 2, **opts})
        out[name] = d / f"{name}.model"
    return out


def checkpoint(spm_models, tmp_path, name: str, **config):
    """A tokenizer folder as Llama-2-era checkpoints ship it: tokenizer.model + tokenizer_config.json."""
    d = tmp_path / f"{name}-{json.dumps(config, sort_keys=True)}"
    d.mkdir()
    (d / "tokenizer.model").write_bytes(spm_models[name].read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "unk_token": "<unk>", **config}))
    return TOK.Tokenizer(str(d))


def processor(spm_models, name: str):
    import sentencepiece as spm
    return spm.SentencePieceProcessor(model_file=str(spm_models[name]))


STRINGS = ["", " ", "  ", "   ", "\t", "\n", "\r\n", " \r\n ", "\r\n\r\n", "a\r\nb", "x \r\n y", "\t\tindent",
           "Once upon a time", "  leading", "trailing  ", "a  b   c", "def f(x):\n\treturn x  # done\r\n",
           "naïve café, Zürich — ½ ∑ 日本語 🙂", "ｶﾞ", "\xa0ﾞ", "ﬁ ①", "\u3000x\u00a0y", "e\u0301", "a▁b ▁",
           "x<tool>y", "<tool>call", "x <tool> y", "<tool>", "<tool><tool>", " <tool> ", "call</tool>",
           "<tool>x</tool>", "a<tool>\r\nb", "\r\n<tool>", "<tool>  x", "x  <tool>", "\t<tool>\t", "<to ol>"]
ALPHABET = ["a", "b", "x", "call", " ", "  ", "\r", "\n", "\r\n", "\t", "é", "ﬁ", "①", "\u3000", "\u00a0",
            "e\u0301", "中", "🙂", "\u200b", "ｶ", "ﾞ", "▁", "<tool>", "</tool>", "<to", "ol>"]


def random_strings(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 8))) for _ in range(n)]


# ----------------------------------------------------------------------------- item 8: sentencepiece's ids

@pytest.mark.parametrize("name", [n for n in MODELS if n != "llama"])
def test_sentencepiece_models_encode_like_sentencepiece(spm_models, tmp_path, name):
    """Whatever the normalizer, model type, byte fallback and symbols: sentencepiece's ids, BOS first,
    and sentencepiece's text back (where no <unk> was produced: decoding skips it)."""
    tok, sp = checkpoint(spm_models, tmp_path, name), processor(spm_models, name)
    for s in STRINGS + random_strings(400):
        want = sp.encode(s)
        assert tok.encode(s) == [sp.bos_id()] + want, repr(s)
        assert tok.encode(s, add_special_tokens=False) == want, repr(s)
        if sp.unk_id() not in want:
            assert tok.decode(tok.encode(s)) == sp.decode(want), repr(s)


@pytest.mark.parametrize("name", ["bpe-nfkc", "unigram-nfkc", "bpe-identity-bytes"])
def test_user_defined_symbols_are_matched_inside_the_normalized_text(spm_models, tmp_path, name):
    """The issue's cases: the dummy prefix goes in front of the text, not after the symbol, and no
    space is made up after it."""
    tok, sp = checkpoint(spm_models, tmp_path, name), processor(spm_models, name)
    pieces = lambda s: [sp.id_to_piece(i) for i in tok.encode(s, add_special_tokens=False)]
    assert pieces("x<tool>y") == ["▁", "x", "<tool>", "y"]
    got = pieces("<tool>call")
    assert got[:2] == ["▁", "<tool>"] and "".join(got[2:]) == "call"
    for s in ("x<tool>y", "<tool>call", "x <tool> y"):
        assert tok.decode(tok.encode(s)) == s


@pytest.mark.parametrize("name", ["bpe-nfkc", "unigram-nfkc-bytes"])
def test_control_symbols_in_the_text_are_their_tokens(spm_models, tmp_path, name):
    """Control pieces (<s>, </s>, control_symbols) and <unk> written in the text are those tokens, as in
    transformers and llama.cpp (sentencepiece itself spells them out); the text around them is encoded
    as sentencepiece encodes it (legacy: each part as a text of its own)."""
    tok, sp = checkpoint(spm_models, tmp_path, name), processor(spm_models, name)
    ctrl = sp.piece_to_id("<ctrl>")
    assert sp.is_control(ctrl)
    assert tok.encode("a<ctrl>b x") == [sp.bos_id()] + sp.encode("a") + [ctrl] + sp.encode("b x")
    assert tok.encode("<ctrl></s><unk>", add_special_tokens=False) == [ctrl, sp.eos_id(), sp.unk_id()]
    assert tok.decode(tok.encode("a<ctrl>b</s>")) == sp.decode(sp.encode("a") + sp.encode("b"))


# ----------------------------------------------------------------------------- item 9: legacy, BOS once

SPECIAL_STRINGS = ["Hi</s>there", "Hi</s> there", "Hi</s>  there", "<s>uns", "<s> uns", "</s>", "<s>", "<s><s>x",
                   "a</s></s>b", "a </s>  b", "x</s>\ty", "x</s>\r\ny", "tail</s>", "tail </s>", "</s>head",
                   "</s> head", "ünï 中文 🙂</s>é", "<unk>x", "x<unk> y", "def f():\n\treturn 1</s>\n",
                   "x<s> y</s>z", "USER: Hi ASSISTANT: Hello</s>USER: Bye ASSISTANT:", " lead</s>x",
                   "  lead</s> x", " ", " </s>", "\t</s>\t", "\r\n</s>\r\n", ""]
SPLIT = re.compile(r"(<s>|</s>|<unk>)")


def transformers_llama(sp, legacy: bool):
    """transformers' LlamaTokenizer on the pieces of `sp` (BPE merges by transformers' generate_merges)."""
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    return LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab), legacy=legacy, add_bos_token=True,
                          unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def once(ids: list) -> list:
    """transformers' ids with a BOS it put in front of a text that starts with BOS taken away."""
    return ids[1:] if ids[:2] == [1, 1] else ids


def parts_alone(sp, s: str) -> list:
    """Each part between special tokens encoded by sentencepiece as a text of its own (transformers 4's
    sentencepiece-backed LlamaTokenizer with legacy true; llama.cpp)."""
    ids = []
    for k, part in enumerate(SPLIT.split(s)):
        ids += [sp.piece_to_id(part)] if k % 2 else sp.encode(part)
    return ids


def test_legacy_false_puts_no_dummy_prefix_after_a_special_token(spm_models, tmp_path):
    """legacy false: `Hi</s>there` is `... </s> there` with no "▁" (a space written there stays one),
    as transformers gives. transformers 5's LlamaTokenizer adds no "▁" in front of a text that starts with
    a space, where sentencepiece (and transformers 4's sentencepiece-backed one) do: the start of
    such a string is checked against sentencepiece, the rest against transformers."""
    sp = processor(spm_models, "llama")
    tok, hf = checkpoint(spm_models, tmp_path, "llama", legacy=False), transformers_llama(sp, legacy=False)
    ids = lambda s: tok.encode(s, add_special_tokens=False)
    hi = sp.encode("Hi") + [sp.eos_id()]
    assert ids("Hi</s>there")[:len(hi)] == hi and sp.decode(ids("Hi</s>there")[len(hi):]) == "there"
    assert not sp.id_to_piece(ids("Hi</s>there")[len(hi)]).startswith("▁")
    assert ids("Hi</s> there") == hi + sp.encode("there")              # "▁there": the space, no prefix
    assert ids("Hi</s>there") != ids("Hi</s> there")
    for s in SPECIAL_STRINGS:
        head = SPLIT.split(s)[0]
        if head.startswith(" "):
            want = [1] + sp.encode(head) + hf.encode(s[len(head):], add_special_tokens=False)
        else:
            want = once(hf.encode(s))
        assert tok.encode(s) == want, repr(s)
        assert tok.decode(tok.encode(s)) == hf.decode(want, skip_special_tokens=True), repr(s)
    for s in STRINGS + random_strings(100, seed=1):         # no special token: sentencepiece's ids, as ever
        if "<tool>" not in s and "</tool>" not in s:
            assert tok.encode(s) == [1] + sp.encode(s), repr(s)


@pytest.mark.parametrize("config", [{"legacy": True}, {}], ids=["legacy-true", "legacy-absent"])
def test_legacy_true_encodes_each_part_as_a_text_of_its_own(spm_models, tmp_path, config):
    """legacy true, and a config that does not say (transformers 4's default, what Llama-2-era
    checkpoints were made with): every part after a special token gets the dummy prefix, as transformers
    gives; transformers 5 adds none in front of a part that starts with a space, where sentencepiece and
    transformers 4 do (` there` is `▁ ▁there`), so those are checked against sentencepiece part by part."""
    sp = processor(spm_models, "llama")
    tok, hf = checkpoint(spm_models, tmp_path, "llama", **config), transformers_llama(sp, legacy=True)
    for s in SPECIAL_STRINGS:
        if any(p.startswith(" ") for p in SPLIT.split(s)[::2]):
            want = once([1] + parts_alone(sp, s))
        else:
            want = once(hf.encode(s))
        assert tok.encode(s) == want, repr(s)
    assert tok.encode("Hi</s>there", add_special_tokens=False) == sp.encode("Hi") + [2] + sp.encode("there")


@pytest.mark.parametrize("legacy", [True, False, None])
def test_bos_is_never_added_twice(spm_models, tmp_path, tiny_ckpt, legacy):
    """A text that starts with BOS gets no second one (transformers would give `<s> <s> u n s`); a BOS
    further in is the text's own."""
    tok = checkpoint(spm_models, tmp_path, "llama", **({} if legacy is None else {"legacy": legacy}))
    sp = processor(spm_models, "llama")
    ids = tok.encode("<s>uns")
    assert ids[:1] == [1] and ids.count(1) == 1 and sp.decode(ids) == "uns"
    assert ids == ([1] + sp.encode("uns") if legacy is not False else once(transformers_llama(sp, False).encode("<s>uns")))
    assert tok.encode("x<s>y")[:1] == [1] and tok.encode("x<s>y").count(1) == 2
    assert tok.encode("<s>", add_special_tokens=False) == [1] == tok.encode("<s>")
    js = TOK.load_tokenizer(str(tiny_ckpt("llama2")))                # tokenizer.json: "<s> $A" post-processor
    plain = js.tk.encode("uns", add_special_tokens=False).ids
    assert js.tk.encode("<s>uns").ids == [1, 1] + plain               # what tokenizers itself gives
    assert js.encode("<s>uns") == [1] + plain == js.encode("uns")


def test_legacy_must_be_a_bool(spm_models, tmp_path):
    with pytest.raises(M.GraftError) as e:
        checkpoint(spm_models, tmp_path, "llama", legacy="no")
    assert "legacy must be true or false" in str(e.value) and "\n" not in str(e.value)


def test_text_that_is_not_unicode_is_one_line_error(spm_models, tmp_path, tiny_ckpt):
    """A lone surrogate (what Python makes of bytes that are not UTF-8 in argv) is refused in one line,
    not a traceback from sentencepiece or tokenizers."""
    for tok in (checkpoint(spm_models, tmp_path, "llama"), TOK.load_tokenizer(str(tiny_ckpt("llama2")))):
        with pytest.raises(M.GraftError) as e:
            tok.encode("a\udcff b")
        assert "not valid Unicode" in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- add_bos_token / add_eos_token

@pytest.mark.parametrize("bos, eos", [(False, False), (False, True), (True, True), (True, False)])
def test_bos_and_eos_follow_tokenizer_config_flags(spm_models, tmp_path, bos, eos):
    """tokenizer_config.json's add_bos_token / add_eos_token, as transformers' Llama tokenizer reads them."""
    sp = processor(spm_models, "llama")
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    hf = LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab), legacy=True, add_bos_token=bos,
                        add_eos_token=eos, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok = checkpoint(spm_models, tmp_path, "llama", add_bos_token=bos, add_eos_token=eos)
    for s in ["Once upon a time", "def f(x):\n\treturn x", ""]:     # (no leading space: see above)
        assert tok.encode(s) == hf.encode(s), repr(s)
        assert tok.encode(s, add_special_tokens=False) == sp.encode(s)


def test_malformed_bos_flag_is_one_line_error(spm_models, tmp_path):
    with pytest.raises(M.GraftError) as e:
        checkpoint(spm_models, tmp_path, "llama", add_bos_token="yes")
    assert "add_bos_token" in str(e.value) and "\n" not in str(e.value)
