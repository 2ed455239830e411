"""Shared test helpers: tiny random checkpoints, the transformers reference, the shared pretrained model.

Everything runs on CPU in float32. `transformers` is a test-only dependency: it builds the tiny
checkpoints (so they are real Hugging Face folders, written by `save_pretrained`) and serves as the
reference implementation the engine is compared against.

What other test files can use:

  make_tiny_model(path, kind, seed=0, **overrides) -> Path
        write a tiny random checkpoint folder (config.json, model.safetensors, generation_config.json,
        tokenizer.json, tokenizer_config.json). kind: "llama2" | "llama31" | "qwen3" (see KINDS).
  tiny_ckpt (session fixture)   tiny_ckpt(kind, seed=0, **overrides) -> Path, built once per session
  hf_model(path)                the transformers model of a checkpoint folder (cached, eval, float32)
  hf_greedy(path, ids, n)       transformers' own `generate(do_sample=False)`, EOS disabled: n new ids
  reference_greedy(model, ids, n, eos_ids=())
                                the plain one-token-at-a-time greedy loop over model.py's KV cache,
                                the oracle that speculative decoding must reproduce token for token
  SHARED, needs_shared          ../shared (next to the repo root) and a skip marker for when it is absent
  STORIES, STORIES_TEXT, STORIES_IDS64
                                the pretrained stories260K-hf folder and its golden greedy output
"""
import functools
import json
import sys
from pathlib import Path

import pytest
import torch

from graft import METHODS as _METHODS

# The methods every engine runs, with or without a DFlash drafter: the suites that parametrize over
# methods on engines built without one take these; tests/test_dflash.py runs the block methods.
NO_BLOCK = [m for m, c in _METHODS.items() if not c.needs_block]

# Tiny models gain nothing from intra-op threads, and on a small shared machine (2 cores, other
# processes busy) torch's thread pool can make a 5 ms forward take a second. One thread, always.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cpu_kernels  # noqa: E402

# Build graft's CPU kernels once, before any test: the CLI runs in subprocesses then find them built
# (a first build prints one line, which a test of one-line errors must not see).
cpu_kernels.ready()


@pytest.fixture(autouse=True)
def unpaced(monkeypatch):
    """Every round drafts (engine.PACE off) unless a test asks for pacing (Config(pace=True), --pace): on
    these tiny models no tree pays for its cost, so the pacer would take plain steps almost always and
    the drafting machinery, which most tests examine, would hardly run. tests/test_pacing.py tests the pacer.
    (Subprocesses run the faces as a user would: paced.)"""
    import engine
    monkeypatch.setattr(engine, "PACE", False)


# ----------------------------------------------------------------------------- shared data

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is missing")

STORIES = SHARED / "models" / "stories260K-hf"
# ../shared/models/SOURCES.md: greedy decoding from BOS alone, 120 new tokens
STORIES_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high.\n"
    "Lily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't know what to do. "
    "She said, \"I want to play with your ball, but"
)
STORIES_IDS64 = [
    403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
    410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352,
    266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267, 414, 270, 333, 415,
    426, 13, 438, 310,
]
STORIES_PROMPT_IDS = [1, 403, 407, 261, 378]   # encode("Once upon a time") with BOS

# ----------------------------------------------------------------------------- tiny tokenizer

UNK, BOS, EOS = 0, 1, 2
SPECIAL = ["<unk>", "<s>", "</s>"]
# a simple chat template (llama31 and qwen3 kinds carry it; llama2 has none, like the real Llama-2 base)
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_CORPUS = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big red ball. The ball was in the tree and the girl was sad. Her mom said "
    "that they would get the ball together. They were happy and they played all day in the sun."
)


def _bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def make_tokenizer(path, vocab_size: int = 300, chat_template: str | None = None) -> None:
    """Write a byte-level BPE tokenizer.json (+ tokenizer_config.json) with exactly `vocab_size` ids.

    ids 0,1,2 = <unk>,<s>,</s>; ids 3..258 = the 256 bytes (byte b is id 3+b, as in stories260K);
    the rest are merges learned greedily from a fixed sentence, so every model id decodes to text.
    Encoding prepends BOS. Deterministic: no randomness, ties broken by the pair's characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    path = Path(path)
    b2u = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    words = [[b2u[c] for c in ((" " if i else "") + w).encode()] for i, w in enumerate(_CORPUS.split(" "))]
    merges = []
    while len(vocab) < vocab_size:
        counts = {}
        for w in words:
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        vocab[best[0] + best[1]] = len(vocab)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i:i + 2] = [best[0] + best[1]]
                i += 1
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tk.add_special_tokens(SPECIAL)
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", BOS)])
    tk.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}
    if chat_template:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


# ----------------------------------------------------------------------------- tiny models

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
               num_attention_heads=4, max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS,
               hidden_act="silu")
KINDS = {
    # Llama-2 / Vicuna style: MHA, tied embeddings, plain RoPE
    "llama2": dict(_COMMON, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0,
                   rms_norm_eps=1e-5),
    # Llama-3.1 style: GQA, untied, llama3 RoPE scaling that really changes frequencies at this size
    "llama31": dict(_COMMON, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
                    rope_scaling=dict(LLAMA3_SCALING), rms_norm_eps=1e-5),
    # Qwen3 style: head_dim (32) != hidden/heads (16), GQA, per-head q/k RMSNorm, untied
    "qwen3": dict(_COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                  rope_theta=1000000.0, rms_norm_eps=1e-6),
}
# capture layers for 8 layers: inputs of layers 2, L//2, L-3
TINY_CAPTURE_LAYERS = (2, 4, 5)


def make_tiny_model(path, kind: str, seed: int = 0, weight_std: float = 0.2, **overrides) -> Path:
    """Build a tiny random-weight checkpoint of `kind` with transformers and save it to `path` (float32).

    Sizes: vocab 300, hidden 64, 8 layers, 4 heads, intermediate 128, max_position_embeddings 256.
    `overrides` are passed to the transformers config (e.g. rope_scaling={...}, num_hidden_layers=4,
    tie_word_embeddings=False); rope_scaling=None removes the kind's scaling.
    Weights: every matrix ~ N(0, weight_std) and every norm weight ~ 1 + N(0, 0.1). With std 0.2 the
    logits are far from uniform and greedy generations vary (about 20 distinct ids in 24; transformers'
    own init, or std 0.1, falls into repeating one token), and a norm loaded wrongly cannot hide
    behind ones.
    Also writes a byte-level tokenizer (see make_tokenizer) with the model's vocab size.
    Returns the folder as a Path."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kw = dict(KINDS[kind], **overrides)
    if kw.get("rope_scaling") is None:
        kw.pop("rope_scaling", None)
    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if kind == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():   # tied parameters are listed once
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(weight_std * torch.randn(p.shape, generator=g))
    model.generation_config.eos_token_id = EOS
    model.generation_config.bos_token_id = BOS
    model.save_pretrained(str(path), safe_serialization=True)
    make_tokenizer(path, kw["vocab_size"], None if kind == "llama2" else TINY_CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory fixture: tiny_ckpt(kind, seed=0, **overrides) -> Path, each distinct checkpoint built once."""
    cache = {}

    def get(kind: str, seed: int = 0, **overrides) -> Path:
        key = (kind, seed, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            cache[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{kind}"), kind, seed, **overrides)
        return cache[key]

    return get


# ----------------------------------------------------------------------------- references

@functools.lru_cache(maxsize=16)
def _hf_model_cached(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_model(path):
    """The transformers model of a checkpoint folder (float32, eval mode, cached per folder)."""
    return _hf_model_cached(str(path))


@torch.no_grad()
def hf_greedy(path, ids: list, n: int) -> list:
    """transformers' generate(do_sample=False) with EOS disabled: exactly n new token ids."""
    from transformers import GenerationConfig
    gc = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
                          pad_token_id=0, bos_token_id=BOS)
    out = hf_model(path).generate(torch.tensor([ids]), generation_config=gc)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def reference_greedy(model, ids: list, n: int, eos_ids=()) -> list:
    """Plain greedy decoding through model.py's KV cache: prefill, then one token per forward.

    Uses the cache layout the engine uses (rows = positions, causal mask over rows 0..p).
    Returns the new ids (at most n; stops after emitting a token in eos_ids)."""
    if n <= 0:
        return []
    T = len(ids)
    pos = torch.arange(T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    logits = model(torch.tensor([ids]), pos, rows=pos, mask=mask)
    out = []
    for p in range(T, T + n):
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok in eos_ids or len(out) == n:
            break
        rows = torch.tensor([p])
        logits = model(torch.tensor([[tok]]), rows, rows=rows, mask=torch.ones(1, p + 1, dtype=torch.bool))
    return out


# ----------------------------------------------------------------------------- compile checks, beside the suite

_COMPILE = {}
COMPILE_TESTS = "test_engine.py::test_compiled"       # the tests that read tests/compile_check.py's results


def pytest_collection_modifyitems(session, config, items):
    """The tests that read the compile checks run last: the checks have the whole suite's time."""
    items.sort(key=lambda it: COMPILE_TESTS in it.nodeid)


def pytest_collection_finish(session):
    """Start tests/compile_check.py when a test reading it is selected: compiling takes minutes, so it
    runs on the second core while the rest of the suite runs (the suite itself is one thread)."""
    import os
    import subprocess
    import tempfile
    if any(COMPILE_TESTS in item.nodeid for item in session.items):
        out = os.path.join(tempfile.mkdtemp(), "compile.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        _COMPILE["proc"] = subprocess.Popen([sys.executable, str(ROOT / "tests" / "compile_check.py"), out],
                                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _COMPILE["out"] = out


def pytest_sessionfinish(session, exitstatus):
    """A session that ends before reading the compile checks (-x, a selection, Ctrl-C) stops them: they
    would otherwise compile on, orphaned, for minutes."""
    proc = _COMPILE.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def compile_result(section: str) -> dict:
    """One section of the compile checks' results (waits for them)."""
    proc = _COMPILE.get("proc")
    if proc is None:
        pytest.skip("the compile checks were not started")
    proc.wait(timeout=1800)
    got = json.loads(Path(_COMPILE["out"]).read_text()).get(section, {"error": "section did not run"})
    assert "error" not in got, got["error"]
    return got
