"""Hard inputs: files from a checkpoint never run code, output is never lost, no bad input passes.

Each test builds its small bad input itself (copies of tiny random checkpoints, payload files) and
checks one behaviour: a one-line GraftError, a marker file that must not appear, stdout that equals
the final text, a count that matches what was returned.
"""
import json
import math
import os
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import bench
import calibrate as CAL
import cpu_kernels
import checkpoint as CK
import cli as CLI
import data as DATA
import engine as E
import generate as GEN
import graft as GR
import graft
import model as M
import tokenizer as TOK
import train
from conftest import ROOT, make_tokenizer
from test_lossless import random_head
from verify import Sampling

DEMO = ROOT / "checkpoints" / "stdlib-qwen3"


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    """A private copy of the tiny Llama-3.1-style checkpoint, free to break."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("llama31"), dst)
    return dst


def edit_json(path: Path, **changes):
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


# ============================================================================ 1. chat templates

PAYLOADS = [
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__.os.system('touch MARKER') }}",
    "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c(['touch', 'MARKER']) }}{% endif %}{% endfor %}",
    "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch MARKER') }}",
]


@pytest.mark.parametrize("payload", PAYLOADS, ids=range(len(PAYLOADS)))
def test_chat_template_cannot_run_code(ckpt, tmp_path, payload):
    marker = tmp_path / "marker"
    edit_json(ckpt / "tokenizer_config.json", chat_template=payload.replace("MARKER", str(marker)))
    tok = TOK.load_tokenizer(str(ckpt))
    with pytest.raises(M.GraftError) as e:
        tok.apply_chat("hi")
    assert one_line(e).startswith("chat template")
    assert not marker.exists()


def render(template, messages=None, **kw):
    return TOK.render_chat(template, messages or [{"role": "user", "content": "hi"}], True, **kw)


def test_template_raise_exception_is_one_line_error():
    with pytest.raises(M.GraftError) as e:
        render("{{ raise_exception('roles must alternate') }}")
    assert "roles must alternate" in one_line(e)


@pytest.mark.parametrize("template", ["{{ 1/0 }}", "{{ 'a' + 1 }}", "{{ messages[0].content.nope() }}",
                                      "{% for %}", "{{ range(10**9) | list | length }}"])
def test_template_failing_at_render_is_one_line_error(template):
    with pytest.raises(M.GraftError) as e:
        render(template)
    assert one_line(e).startswith("chat template")


def test_template_helpers():
    import datetime
    t = ("{{ strftime_now('%Y') }}|{{ messages | tojson }}|{{ {'a': [1, 2]} | tojson(indent=2) }}|"
         "{{ {'b': 1, 'a': 'é'} | tojson(separators=(',', ':'), ensure_ascii=True, sort_keys=True) }}|"
         "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}"
         "{{ i }}{% endfor %}|{% generation %}kept{% endgeneration %}")
    got = render(t).split("|")
    assert got[0] == str(datetime.datetime.now().year)
    assert got[1] == '[{"role": "user", "content": "hi"}]'
    assert got[2] == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    assert got[3] == '{"a":"\\u00e9","b":1}'
    assert got[4] == "02" and got[5] == "kept"


def test_named_templates_use_default(ckpt):
    edit_json(ckpt / "tokenizer_config.json", chat_template=[
        {"name": "tool_use", "template": "TOOLS {{ messages[0].content }}"},
        {"name": "default", "template": "DEFAULT {{ messages[0].content }}"}])
    assert TOK.load_tokenizer(str(ckpt)).render([{"role": "user", "content": "x"}]) == "DEFAULT x"


def test_named_templates_without_default_are_refused(ckpt):
    edit_json(ckpt / "tokenizer_config.json", chat_template=[{"name": "tool_use", "template": "T"}])
    with pytest.raises(M.GraftError) as e:
        TOK.load_tokenizer(str(ckpt))
    assert "default" in one_line(e)


# Templates written for these tests in the shape of the published ones (the real files are not in
# this repository): the jinja features they lean on are what must render as transformers renders them.
QWEN3_STYLE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=messages|length - 1, seen=false) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == 'user' and not ns.seen %}
        {%- set ns.last_user = index %}{%- set ns.seen = true %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_user and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA31_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Knowledge cutoff: 2023\\nToday: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant', 'ipython'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

VICUNA_STYLE = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
                "{% set loop_messages = messages[1:] %}{% else %}{% set system = 'A chat between a curious user "
                "and an artificial intelligence assistant.' %}{% set loop_messages = messages %}{% endif %}"
                "{{ system }}{% for message in loop_messages %}"
                "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                "{% endif %}{% if message['role'] == 'user' %}{{ ' USER: ' + message['content'].strip() }}"
                "{% else %}{{ ' ASSISTANT: ' + message['content'].strip() + eos_token }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ ' ASSISTANT:' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "  Hi\n"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "über 中文 🙂"}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "again"}],
]


@pytest.mark.parametrize("template", [QWEN3_STYLE, LLAMA31_STYLE, VICUNA_STYLE], ids=["qwen3", "llama31", "vicuna"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_template_renders_like_transformers(ckpt, template, conv):
    from transformers import AutoTokenizer
    edit_json(ckpt / "tokenizer_config.json", chat_template=template)
    ours = TOK.load_tokenizer(str(ckpt)).render(CONVERSATIONS[conv], True, enable_thinking=False)
    ref = AutoTokenizer.from_pretrained(str(ckpt)).apply_chat_template(
        CONVERSATIONS[conv], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert ours == ref


# ============================================================================ 2. no pickles

class Payload:
    """Unpickling this runs `open(marker, 'w')`: the classic __reduce__ attack."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def train_argv(target, prompts, out, steps):
    return ["eagle3", "--ckpt", str(target), "--prompts", str(prompts), "--out", str(out), "--device", "cpu",
            "--new-tokens", "8", "--steps", str(steps), "--batch", "2", "--seq-len", "16", "--ttt", "2",
            "--draft-vocab", "100", "--log-every", "1", "--save-every", "1", "--gen-batch", "4"]


def test_training_resume_cannot_run_code_and_resumes(tiny_ckpt, tmp_path, capsys):
    target = tiny_ckpt("llama31")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\nThe ball was red\nShe saw a tree\n")
    out = tmp_path / "head"
    out.mkdir()
    marker = tmp_path / "marker"
    for name in ("train_state.pt", "train_data.pt"):       # what older versions read with pickle
        with open(out / name, "wb") as fh:
            pickle.dump({"head": Payload(marker)}, fh)
    train.main(train_argv(target, prompts, out, 2))
    assert not marker.exists()
    assert (out / "train_state.safetensors").is_file() and (out / "model.safetensors").is_file()
    capsys.readouterr()
    train.main(train_argv(target, prompts, out, 3))
    assert "resumed at step 2" in capsys.readouterr().err
    assert not marker.exists()


def test_malformed_resume_state_is_one_line_error(tiny_ckpt, tmp_path):
    target = tiny_ckpt("llama31")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\n")
    out = tmp_path / "head"
    out.mkdir()
    (out / "train_state.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(M.GraftError) as e:
        train.main(train_argv(target, prompts, out, 2))
    assert "--restart" in one_line(e)


def test_no_full_unpickling_anywhere():
    """Every torch.load in the project asks for weights_only=True (checkpoints .bin files)."""
    import re
    for f in ROOT.glob("*.py"):
        for call in re.findall(r"torch\.load\([^)]*\)", f.read_text()):
            assert "weights_only=True" in call, (f.name, call)


# ============================================================================ 3. streaming

class ByteTokenizer:
    """A fake tokenizer: token i is byte i; decode is UTF-8 with replacement, as byte-level BPE decodes."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


class Sink:
    def __init__(self):
        self.parts = []

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass


@pytest.mark.parametrize("text", ["中文 and emoji 🙂🙃 mixed", "ascii only", "\xe9t\xe9 🙂", "🙂"])
def test_stream_never_loses_split_characters(text):
    data = list(text.encode())
    sink = Sink()
    s = CLI.TextStream(ByteTokenizer(), sink)
    for n in range(1, len(data) + 1):            # one byte per round: every character arrives split
        s(data[:n])
        assert "\ufffd" not in "".join(sink.parts)
    final = s.finish(data)
    assert final == text and "".join(sink.parts) == text + "\n"


def test_stream_keeps_replacement_chars_of_invalid_bytes():
    data = [0x61, 0xE4, 0x62, 0xFF, 0x63]          # a lead byte cut by ASCII, and a byte never valid
    sink = Sink()
    s = CLI.TextStream(ByteTokenizer(), sink)
    for n in range(1, len(data) + 1):
        s(data[:n])
    final = s.finish(data)
    assert "".join(sink.parts) == final + "\n" == "a\ufffdb\ufffdc\n"


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_stream_equals_final_text_random_qwen3_demo_tokenizer(tiny_ckpt, tmp_path, capsys, seed):
    """The probe of the issue: a tiny random Qwen3 with the demo tokenizer, sampled at temperature 1."""
    src = tiny_ckpt("qwen3", vocab_size=4096)
    ck = tmp_path / "q"
    shutil.copytree(src, ck)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, ck / f)
    edit_json(ck / "config.json", eos_token_id=0, bos_token_id=...)
    edit_json(ck / "generation_config.json", eos_token_id=0, bos_token_id=...)
    out = GEN.main(["--ckpt", str(ck), "--method", "ar", "--prompt", "def f(x):", "--max-new-tokens", "48",
                  "--temperature", "1", "--seed", str(seed), "--max-seq-len", "128"])
    stdout = capsys.readouterr().out
    assert stdout == out["text"] + "\n"
    assert out["text"] == TOK.load_tokenizer(str(ck)).decode(out["tokens"])


def rigged_byte_model(tiny_ckpt, tmp_path, text: str) -> Path:
    """A Qwen3 with the demo tokenizer whose greedy output cycles through `text` byte by byte: its
    layers are zeroed (the residual stream is the embedding), token i of the cycle has its own basis
    vector and the lm_head maps it to token i+1. Every multi-byte character is split across tokens."""
    from tokenizers import Tokenizer
    from tokenizers.pre_tokenizers import ByteLevel
    tk = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    alphabet = {b: c for b, c in zip(range(256), _byte_chars())}
    chain = [tk.token_to_id(alphabet[b]) for b in text.encode()]
    assert None not in chain and len(set(chain)) == len(chain)
    ck = tmp_path / "rigged"
    shutil.copytree(tiny_ckpt("qwen3", vocab_size=4096), ck)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, ck / f)
    edit_json(ck / "config.json", eos_token_id=0, bos_token_id=...)
    edit_json(ck / "generation_config.json", eos_token_id=0, bos_token_id=...)
    sd = load_file(str(ck / "model.safetensors"))
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k].zero_()
    emb, head = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    emb.mul_(0.01)
    head.zero_()
    for i, t in enumerate(chain):
        emb[t].zero_()
        emb[t, i] = 1.0
        head[chain[(i + 1) % len(chain)], i] = 10.0
    sd["model.norm.weight"].fill_(1.0)
    save_file(sd, str(ck / "model.safetensors"), metadata={"format": "pt"})
    return ck, tk.decode([chain[0]])


def _byte_chars():
    """GPT-2's byte -> printable character map, in byte order (the ByteLevel alphabet)."""
    from conftest import _bytes_to_unicode
    m = _bytes_to_unicode()
    return [m[b] for b in range(256)]


def test_stream_equals_final_text_when_characters_split(tiny_ckpt, tmp_path, capsys):
    ck, first = rigged_byte_model(tiny_ckpt, tmp_path, "a\U0001F642\u4e2d\u00e9")   # a, emoji, CJK, e-acute
    out = GEN.main(["--ckpt", str(ck), "--method", "ar", "--prompt", first, "--max-new-tokens", "40",
                  "--max-seq-len", "128"])
    stdout = capsys.readouterr().out
    assert "\U0001F642\u4e2d\u00e9" in out["text"]
    assert stdout == out["text"] + "\n"


# ============================================================================ 4. prompt files

def test_prompt_file_is_the_whole_file(ckpt, tmp_path, capsys):
    text = "line one\nline two with a literal \\n in it\n\n  indented third\n"
    f = tmp_path / "prompt.txt"
    f.write_text(text)
    out = GEN.main(["--ckpt", str(ckpt), "--method", "ar", "--prompt-file", str(f), "--max-new-tokens", "2"])
    assert out["prompt_tokens"] == len(TOK.load_tokenizer(str(ckpt)).encode(text))


@pytest.mark.parametrize("content", [b"\xff\xfe\x00h\x00i", b"caf\xe9\n", b"ok\x00bytes"], ids=["utf16", "latin1", "nul"])
def test_binary_or_non_utf8_prompt_file_is_one_line_error(ckpt, tmp_path, content):
    f = tmp_path / "p.bin"
    f.write_bytes(content)
    with pytest.raises(M.GraftError) as e:
        GEN.main(["--ckpt", str(ckpt), "--prompt-file", str(f)])
    assert str(f) in one_line(e)


def test_non_utf8_warmup_file_is_one_line_error(ckpt, tmp_path):
    f = tmp_path / "w.txt"
    f.write_bytes(b"fine\n\xc3(\n")
    with pytest.raises(M.GraftError) as e:
        GEN.main(["--ckpt", str(ckpt), "--prompt", "x", "--warmup-file", str(f)])
    assert "not UTF-8" in one_line(e)


# ============================================================================ 5. bench interrupted

def interrupted_bench(tiny_ckpt, tmp_path, monkeypatch, texts: str, runs: int) -> list:
    """bench.py on ar and pld over `texts`, interrupted (Ctrl-C) after `runs` timed runs; returns the runs file's lines."""
    target = tiny_ckpt("llama31")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(texts)
    real, calls = E.generate, {"n": 0}

    def interrupted_generate(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 2 + runs + 1:      # 2 untimed first calls, then the timed runs
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(E, "generate", interrupted_generate)
    with pytest.raises(SystemExit) as e:
        bench.cli(["--ckpt", str(target), "--methods", "ar,pld", "--datasets", str(prompts), "--max-new-tokens",
                   "8", "--warmup", "0", "--json-out", str(tmp_path / "r.json"), "--max-seq-len", "64"])
    assert e.value.code == 130
    return [json.loads(l) for l in (tmp_path / "r.jsonl").read_text().splitlines()]


def test_bench_interrupted_keeps_finished_runs(tiny_ckpt, tmp_path, monkeypatch, capsys):
    lines = interrupted_bench(tiny_ckpt, tmp_path, monkeypatch, "Once upon a time\nThe ball\nShe saw\nOne day\n", 5)
    out = capsys.readouterr().out
    assert len(lines) == 5 and [l["method"] for l in lines] == ["ar", "pld"] * 2 + ["ar"]
    assert all(l["same_as_ar"] for l in lines)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["meta"]["interrupted"] and report["meta"]["runs_done"] == 5
    assert {(r["method"], r["prompts"]) for r in report["rows"]} == {("ar", 3), ("pld", 2)}
    assert "| ar | 3 | 0 |" in out and "| pld | 2 | 0 |" in out


def test_bench_interrupted_before_a_prompts_ar_says_what_it_left_out(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """Every other prompt runs its methods in reverse, ar last: a run that finished before its prompt's ar (the
    reference it is checked against) is left out of an interrupted report, and the message says so."""
    # prompt 0's ar and pld, prompt 1's pld; then its ar is interrupted
    lines = interrupted_bench(tiny_ckpt, tmp_path, monkeypatch, "Once upon a time\nThe ball\nShe saw\n", 3)
    assert "1 run(s) of the last prompt left out: its ar had not run" in capsys.readouterr().err
    assert [(l["prompt"], l["method"]) for l in lines] == [(0, "ar"), (0, "pld")]


# ============================================================================ 6. the warm-up cache

@pytest.fixture
def engine_with_head(tiny_ckpt, tmp_path):
    target = tiny_ckpt("llama31")
    head = random_head(target, tmp_path / "head")
    return lambda max_seq_len=256: CLI.build_engine(str(target), str(head), max_seq_len=max_seq_len)


def test_warmup_that_ran_nothing_is_not_cached(engine_with_head, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "cache"))
    logs = []
    eng = engine_with_head(max_seq_len=40)          # every warm-up prompt + 64 tokens is too long
    cal = CAL.warm_up(eng, GR.Config(budget=16), log=logs.append)
    assert "ran 0 of 5" in logs[-1] and "nothing is cached" in logs[-1]
    assert cal.methods == {}                                      # pruning off: nothing calibrated it
    assert eng.make("graft", GR.Config(budget=16), cal).thresholds == {0: 0.0, 1: 0.0, 5: 0.0}
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_warmup_cache_key_includes_cache_length(engine_with_head, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "cache"))
    a, b = engine_with_head(256), engine_with_head(200)
    assert CAL.state_path_for(a, "same") != CAL.state_path_for(b, "same")


@pytest.mark.parametrize("change", ["threads", "torch", "attention", "compiled", "exact", "kernels"])
def test_warmup_cache_key_includes_what_changes_the_costs(engine_with_head, monkeypatch, change):
    """A calibration timed at one thread count (torch version, attention, execution, exact mode, the CPU
    kernels' build) is not loaded under another: its costs were measured on a different engine."""
    eng = engine_with_head()
    before = CAL.state_path_for(eng, "same")
    threads = torch.get_num_threads()
    try:
        if change == "threads":
            torch.set_num_threads(threads + 1)
        elif change == "torch":
            monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
        elif change == "attention":
            eng.window = not eng.window
        elif change == "exact":
            eng.exact = not eng.exact
        elif change == "kernels":
            monkeypatch.setattr(cpu_kernels, "ON", not cpu_kernels.ON)
        else:
            monkeypatch.setattr(eng.steps, "compiling", True)
        assert CAL.state_path_for(eng, "same") != before
    finally:
        torch.set_num_threads(threads)


def test_warmup_whose_rounds_were_all_too_short_calibrates_nothing(engine_with_head, tmp_path, monkeypatch):
    """4 tokens a generation: no round is followed by the --depth (8) tokens its score needs, so every
    expected rate would be 0.0; that is nothing calibrated (warned, pruning off, the budget as given),
    never a cached budget 8."""
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "cache"))
    logs = []
    eng = engine_with_head()
    cfg = GR.Config(budget=16)
    cal = CAL.warm_up(eng, cfg, rounds=1, max_new_tokens=4, log=logs.append, auto_budget=True)
    assert "left no round long enough to score" in logs[-1] and "nothing is cached" in logs[-1]
    assert cal.methods == {} and cal.budget is None and CAL.method_config(cal, "graft", cfg, auto_budget=True) == cfg
    assert eng.make("graft", cfg, cal).thresholds == {0: 0.0, 1: 0.0, 5: 0.0}
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_warmup_cache_write_failure_only_warns(engine_with_head, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("GRAFT_CACHE", str(blocker / "cache"))
    eng = engine_with_head()
    CAL.warm_up(eng, GR.Config(budget=16), rounds=1, max_new_tokens=16)
    assert "warning: could not save warm-up state" in capsys.readouterr().err

    def read_only(*a, **k):                          # what torch.save raised on a read-only folder
        raise RuntimeError("File cannot be opened.")
    monkeypatch.setattr("safetensors.torch.save_file", read_only)
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "ro"))
    CAL.warm_up(eng, GR.Config(budget=16), rounds=1, max_new_tokens=16)
    assert "RuntimeError" in capsys.readouterr().err
    assert not list((tmp_path / "ro").iterdir())     # no half-written file left behind


def test_warmup_cache_is_written_atomically(engine_with_head, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "cache"))
    replaced = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((a, b)), real(a, b)))
    eng = engine_with_head()
    CAL.warm_up(eng, GR.Config(budget=16), rounds=1, max_new_tokens=16)
    (src, dst), = replaced
    assert src.endswith(".tmp") and dst.endswith(".safetensors") and os.path.isfile(dst) and not os.path.exists(src)


def test_warmup_cache_that_does_not_fit_counts_as_absent(engine_with_head, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "cache"))
    eng = engine_with_head()
    cfg = GR.Config(budget=16)
    CAL.warm_up(eng, cfg, rounds=1, max_new_tokens=16)
    path, = (tmp_path / "cache").iterdir()
    from safetensors import safe_open
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    sd = load_file(str(path))
    sd["M"][3, 0] = 10 ** 6                                      # a token id beyond the vocabulary
    save_file(sd, str(path), metadata=meta)
    fresh = graft.ContinuationMatrix(eng.model.args.vocab_size)
    assert CAL.load_state(str(path), fresh) is None
    logs = []
    CAL.warm_up(eng, cfg, rounds=1, max_new_tokens=16, log=logs.append)
    assert any("1 of 1 generations ran" in line for line in logs)         # recomputed, not loaded
    assert CAL.load_state(str(path), fresh) is not None        # recomputed and rewritten


# ============================================================================ 7-9. numbers and flags

def flag_error(argv, monkeypatch=None) -> str:
    """The error for these generate.py flags, checking no weight was read before it."""
    if monkeypatch is not None:
        monkeypatch.setattr(CK, "read_safetensors", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(M.GraftError) as e:
        GEN.main(argv)
    return one_line(e)


@pytest.mark.parametrize("flags, fragment", [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "inf"], "--temperature"),
    (["--temperature", "-1"], "--temperature"), (["--top-p", "nan"], "--top-p"), (["--top-p", "0"], "--top-p"),
    (["--top-k", "-2"], "--top-k"),
    (["--budget", "0"], "--budget"), (["--max-seq-len", "0"], "--max-seq-len"),
    (["--keep", "100,200,300", "--budget", "16"], "--keep"), (["--keep", "-1,2,3"], "--keep"),
    (["--keep", "1,2"], "--keep"), (["--checkpoints", "9,10"], "--checkpoints"),
    (["--checkpoints", "5,1"], "--checkpoints"), (["--draft-top-k", "3000"], "--draft-top-k"),
    (["--depth", "0"], "--depth"), (["--seed", "1e20"], "--seed"), (["--seed", str(2 ** 70)], "--seed"),
    (["--seed", "-1"], "--seed"), (["--device", "meta"], "meta"), (["--device", "nonsense"], "nonsense"),
    (["--thresholds", "0.1,nan,0.2"], "--thresholds"), (["--thresholds", "0.1,2,0.2"], "--thresholds"),
    (["--recycle-size", "0"], "--recycle-size"), (["--warmup", "-1"], "--warmup"),
    (["--dtype", "int8"], "--dtype"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--no-such-flag"], "--no-such-flag"), (["--budget", "many"], "--budget"),
])
def test_bad_flag_is_one_line_error_before_loading(ckpt, monkeypatch, flags, fragment):
    assert fragment in flag_error(["--ckpt", str(ckpt), "--prompt", "x", *flags], monkeypatch)


def test_max_seq_len_beyond_context_is_refused_before_weights(ckpt, monkeypatch):
    msg = flag_error(["--ckpt", str(ckpt), "--prompt", "x", "--max-seq-len", "100000000"], monkeypatch)
    assert "context" in msg and "256" in msg


def test_draft_top_k_beyond_draft_vocab_is_refused(tiny_ckpt, tmp_path):
    target = tiny_ckpt("llama31")
    head = random_head(target, tmp_path / "head", draft_vocab=40)
    msg = flag_error(["--ckpt", str(target), "--draft", str(head), "--prompt", "x", "--draft-top-k", "50",
                      "--method", "eagle3", "--warmup", "0"])
    assert "--draft-top-k" in msg and "40" in msg


def test_tiny_temperature_is_greedy(ckpt, capsys):
    base = ["--ckpt", str(ckpt), "--method", "ar", "--prompt", "Once upon", "--max-new-tokens", "12"]
    greedy = GEN.main(base)["tokens"]
    assert GEN.main(base + ["--temperature", "1e-45", "--seed", "3"])["tokens"] == greedy
    assert Sampling(temperature=1e-45).greedy and not Sampling(temperature=0.01).greedy


def test_non_finite_weight_is_refused_at_load(ckpt):
    sd = load_file(str(ckpt / "model.safetensors"))
    sd["model.layers.4.mlp.down_proj.weight"][3, 7] = float("nan")
    save_file(sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(M.GraftError) as e:
        CK.load_model(str(ckpt))
    assert "layers.4.mlp.down_proj.weight" in one_line(e) and "non-finite" in one_line(e)


def test_weight_overflowing_in_half_precision_is_refused(ckpt):
    sd = load_file(str(ckpt / "model.safetensors"))
    sd["model.norm.weight"][0] = 1e6                 # finite in float32, inf in float16
    save_file(sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    CK.load_model(str(ckpt))
    with pytest.raises(M.GraftError) as e:
        CK.load_model(str(ckpt), dtype=torch.float16)
    assert "norm.weight" in one_line(e)


def test_non_finite_logits_stop_generation(ckpt):
    """Finite weights whose activations overflow float32: every logit is NaN, and generation says so
    instead of emitting token 0 forever."""
    sd = load_file(str(ckpt / "model.safetensors"))
    sd["model.layers.0.mlp.down_proj.weight"].fill_(3e38)      # the largest float32: its sums overflow
    save_file(sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(M.GraftError) as e:
        GEN.main(["--ckpt", str(ckpt), "--method", "ar", "--prompt", "Once upon a time", "--max-new-tokens", "4"])
    assert "not finite" in one_line(e)


# ============================================================================ 10. files that disagree

@pytest.mark.parametrize("changes, fragment", [
    ({"num_hidden_layers": -1}, "num_hidden_layers"), ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"head_dim": 15}, "head_dim"), ({"max_position_embeddings": -5}, "max_position_embeddings"),
    ({"eos_token_id": "2"}, "eos_token_id"), ({"eos_token_id": [2, "x"]}, "eos_token_id"),
    ({"eos_token_id": 10 ** 6}, "eos_token_id"), ({"bos_token_id": -1}, "bos_token_id"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}}, "low_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "factor"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"), ({"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"), ({"hidden_act": "gelu"}, "hidden_act"),
    ({"vocab_size": 300.0}, "vocab_size"), ({"rope_parameters": {"rope_theta": -1}}, "rope_theta"),
])
def test_bad_config_field_is_one_line_error(ckpt, changes, fragment):
    edit_json(ckpt / "config.json", **changes)
    with pytest.raises(M.GraftError) as e:
        CK.load_model(str(ckpt))
    assert fragment in one_line(e)


def test_config_that_is_a_list_is_one_line_error(ckpt):
    (ckpt / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(M.GraftError) as e:
        CK.load_model(str(ckpt))
    assert "JSON object" in one_line(e)


def test_corrupt_tokenizer_json_is_one_line_error(ckpt):
    (ckpt / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 5}}')
    with pytest.raises(M.GraftError) as e:
        TOK.load_tokenizer(str(ckpt))
    assert "tokenizer.json" in one_line(e)


def test_tokenizer_ids_beyond_vocab_are_refused(ckpt):
    make_tokenizer(ckpt, vocab_size=400)             # the model's vocab_size is 300
    with pytest.raises(M.GraftError) as e:
        TOK.load_tokenizer(str(ckpt))
    assert "vocab_size" in one_line(e) and "300" in one_line(e)


def test_unknown_weights_are_refused(ckpt):
    sd = load_file(str(ckpt / "model.safetensors"))
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)   # the config says attention_bias false
    save_file(sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(M.GraftError) as e:
        CK.load_model(str(ckpt))
    assert "q_proj.bias" in one_line(e)


def test_bin_holding_a_bare_tensor_is_one_line_error(ckpt):
    (ckpt / "model.safetensors").unlink()
    torch.save(torch.zeros(3), ckpt / "pytorch_model.bin")
    with pytest.raises(M.GraftError) as e:
        CK.load_model(str(ckpt))
    assert "dict of named tensors" in one_line(e)


def test_float_d2t_is_refused(tiny_ckpt, tmp_path):
    target_dir = tiny_ckpt("llama31")
    head = random_head(target_dir, tmp_path / "head")
    sd = load_file(str(head / "model.safetensors"))
    sd["d2t"] = sd["d2t"].float()
    save_file(sd, str(head / "model.safetensors"))
    with pytest.raises(M.GraftError) as e:
        CK.load_head(str(head), CK.load_model(str(target_dir)))
    assert "d2t" in one_line(e)


def test_d2t_and_t2d_that_disagree_are_refused(tiny_ckpt, tmp_path):
    target_dir = tiny_ckpt("llama31")
    head = random_head(target_dir, tmp_path / "head")
    sd = load_file(str(head / "model.safetensors"))
    t2d = sd["t2d"].clone()
    on = t2d.nonzero().flatten()
    t2d[on[0]] = False
    t2d[(~sd["t2d"]).nonzero().flatten()[0]] = True
    sd["t2d"] = t2d
    save_file(sd, str(head / "model.safetensors"))
    with pytest.raises(M.GraftError) as e:
        CK.load_head(str(head), CK.load_model(str(target_dir)))
    assert "d2t and t2d" in one_line(e)


def test_bench_record_without_prompt_is_one_line_error(tiny_ckpt, tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text(json.dumps({"turns": ["fine"]}) + "\n" + json.dumps({"question": "no prompt field"}) + "\n")
    with pytest.raises(M.GraftError) as e:
        bench.main(["--ckpt", str(tiny_ckpt("llama31")), "--methods", "ar", "--datasets", str(f), "--warmup", "0"])
    assert "line 2" in one_line(e)


BAD_VALUES = [-1, 0, 1.5, 1e30, float("nan"), "12", "", True, None, [], {}, [1, 2], 2 ** 40]
TARGET_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                 "max_position_embeddings", "tie_word_embeddings", "attention_bias", "bos_token_id",
                 "eos_token_id", "architectures", "model_type", "hidden_act"]
HEAD_FIELDS = ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size",
               "draft_vocab_size", "target_hidden_size", "architectures", "eagle_config", "attention_bias",
               "norm_before_residual"]


def test_random_bad_config_values_give_only_one_line_errors(tiny_ckpt, tmp_path):
    """Fuzz: every field the loaders read, set to values of every wrong kind. A load either succeeds
    with a model that runs, or stops with one GraftError line; nothing else may escape."""
    target_dir, rng = tiny_ckpt("llama31"), random.Random(0)
    head_dir = random_head(target_dir, tmp_path / "head0")
    target = CK.load_model(str(target_dir))
    cases = [("target", f, v) for f in TARGET_FIELDS for v in BAD_VALUES]
    cases += [("head", f, v) for f in HEAD_FIELDS for v in BAD_VALUES]
    rng.shuffle(cases)
    for i, (kind, field, value) in enumerate(cases):
        src = target_dir if kind == "target" else head_dir
        cfg = json.loads((src / "config.json").read_text())
        cfg[field] = value
        d = tmp_path / f"case{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        for f in src.iterdir():
            if f.name != "config.json":
                os.symlink(f, d / f.name)
        try:
            if kind == "target":
                m = CK.load_model(str(d), max_seq_len=32)
                with torch.no_grad():
                    assert torch.isfinite(m(torch.tensor([[1, 5, 7]]), torch.arange(3))).all()
            else:
                CK.load_head(str(d), target)
        except M.GraftError as e:
            assert str(e) and "\n" not in str(e), (field, value, str(e))
        except Exception as e:       # noqa: BLE001 - the point: nothing but GraftError may escape
            pytest.fail(f"{kind} {field}={value!r}: {type(e).__name__}: {e}")


# ============================================================================ 11. draft-head RoPE

def test_head_reads_rope_theta_from_rope_parameters(tiny_ckpt, tmp_path):
    target_dir = tiny_ckpt("llama31")
    head = random_head(target_dir, tmp_path / "head")
    edit_json(head / "config.json", rope_theta=..., rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    h = CK.load_head(str(head), CK.load_model(str(target_dir)))
    assert h.config.layer.rope_theta == 1e6 and h.config.layer.rope_scaling is None


def test_head_reads_llama3_scaling_from_rope_parameters(tiny_ckpt, tmp_path):
    target_dir = tiny_ckpt("llama31")
    head = random_head(target_dir, tmp_path / "head")
    scaling = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    edit_json(head / "config.json", rope_theta=..., rope_parameters=scaling)
    a = CK.load_head(str(head), CK.load_model(str(target_dir))).config.layer
    assert a.rope_theta == 5e5 and a.rope_scaling["rope_type"] == "llama3"


# ============================================================================ 12. MAT of returned tokens

@pytest.fixture(scope="module")
def demo_engine():
    return CLI.build_engine(str(DEMO), str(ROOT / "checkpoints" / "stdlib-qwen3-eagle3"), max_seq_len=512)


@pytest.mark.parametrize("method", ["eagle3", "graft", "pld"])
def test_counts_are_of_returned_tokens(demo_engine, method):
    """The demo pair accepts about 4 tokens a round, so rounds often run past max_new_tokens or an EOS:
    what is cut must not count in MAT, accepted or retrieved tokens."""
    eng = demo_engine
    ids = eng.tokenizer.encode(DATA.STDLIB_PROMPT)
    ref = E.generate(eng, E.make_method(eng, "ar"), ids, 64, Sampling(), ())
    cut_rounds = 0
    for n in range(9, 40, 3):
        first = ref.tokens[n - 1] not in ref.tokens[:n - 1]
        for eos in ((), (ref.tokens[n - 1],)) if first else ((),):   # cut by max_new_tokens, or an EOS at n
            cfg = GR.Config(budget=16, thresholds={0: 0.3, 1: 0.15, 5: 0.05})     # every stage fires sometimes
            res = E.generate(eng, E.make_method(eng, method, cfg), ids,
                             n if not eos else 64, Sampling(), eos)
            assert res.tokens == ref.tokens[:len(res.tokens)]
            assert res.committed == len(res.tokens) - 1
            assert res.mat == pytest.approx((len(res.tokens) - 1) / res.rounds)
            assert res.accepted <= res.committed and res.committed - res.accepted <= res.rounds
            assert res.from_retrieval <= res.accepted
            cut_rounds += res.committed - res.accepted < res.rounds     # the last round lost its bonus
    assert cut_rounds > 0            # the case the counts used to get wrong did happen
