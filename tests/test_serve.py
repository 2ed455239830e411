"""serve.py through a real client (the `openai` package) on a loopback port: chat and completions,
streamed and not, every answer what plain decoding gives alone, with its log-probs, n choices, echo;
/tokenize, /detokenize, /metrics, /health; bad requests answered with OpenAI's error shape (raw HTTP)
while the server goes on; a bounded load of concurrent streams, some leaving midway; a queue limit.

The server runs graft with the stdlib pair (its target copied with a chat template added, so chat
runs too) in float32, with 4 slots, in a process of its own; it serves plain decoding while graft
calibrates, and the tests start once graft is in force. The references run `ar` in this one.
"""
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import urllib.error
import urllib.request

import openai
import pytest

from conftest import ROOT, TINY_CHAT_TEMPLATE

STDLIB = ROOT / "checkpoints" / "stdlib-qwen3"
HEAD = ROOT / "checkpoints" / "stdlib-qwen3-eagle3"
NAME = "stdlib"
PROMPTS = ['def parse(line):\n    """Split a line."""\n', "import os\n\n\ndef main():\n", "class Stack:\n    def push(self, x):\n",
           "for i in range(10):\n", "    return self._data[", "with open(path) as f:\n", "try:\n    import json\n",
           "def __repr__(self):\n        return "]


def http(method: str, url: str, raw: bytes | None = None, timeout: float = 120) -> tuple:
    """(status, JSON body) of one plain HTTP request (urllib: no client library in between)."""
    req = urllib.request.Request(url, data=raw, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    """The stdlib target with a chat template (a copy: the shipped folder stays as it is)."""
    d = tmp_path_factory.mktemp("serve") / "stdlib-chat"
    shutil.copytree(STDLIB, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TINY_CHAT_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def server(chat_ckpt, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", GRAFT_CACHE=str(tmp_path_factory.mktemp("cache")))
    # --no-pace: every round drafts, so that these tests see speculation's work (the metrics count it); paced,
    # on this tiny model no tree pays and, once probes are seen to lose, a request can run without one
    cmd = [sys.executable, str(ROOT / "serve.py"), "--ckpt", str(chat_ckpt), "--draft", str(HEAD), "--method", "graft",
           "--batch", "4", "--warmup", "1", "--port", str(port), "--served-model-name", NAME, "--dtype", "float32",
           "--no-pace"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = start(proc, port, log, lambda h: h["method"] == "graft")   # graft in force: calibrated between requests
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def start(proc, port: int, log, ready=lambda h: True) -> str:
    """The server's URL once /health answers and says ready(health) (a loaded 2-core machine: the
    warm-up can take minutes)."""
    url, states = f"http://127.0.0.1:{port}", []
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve.py exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            code, h = http("GET", url + "/health", timeout=5)
            states.append((h["method"], h["calibration"]))
            if code == 200 and ready(h):
                return url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    pytest.fail(f"serve.py did not start (health: {states[-3:]}): {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def plain(chat_ckpt):
    """Plain decoding (ar) in this process, one request at a time: what every answer must equal."""
    import api
    return api.load(str(chat_ckpt), method="ar", dtype="float32")


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def alone(plain, prompt, chat: bool, **kw):
    """The same request run alone with ar: (text, finish_reason)."""
    c = plain.generate(prompt if not chat else [dict(m) for m in prompt], **kw)
    return c.text, c.finish_reason


def test_answers_equal_plain_decoding(server, plain, chat_ckpt):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [NAME]
    # a completion, greedy: also against generate.py itself
    r = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    import generate
    out = generate.main(["--ckpt", str(chat_ckpt), "--method", "ar", "--prompt", PROMPTS[0], "--max-new-tokens", "24",
                         "--warmup", "0", "--json", "--dtype", "float32"])
    assert r.choices[0].text == out["text"] == alone(plain, PROMPTS[0], False, max_new_tokens=24)[0]
    assert r.usage.completion_tokens == len(out["tokens"]) and r.choices[0].finish_reason == "length"
    # streamed, sampled: the pieces joined are the whole answer, the answer is ar's with the same seed
    pieces, reason = [], None
    for ch in c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0.8, seed=7, stream=True):
        pieces.append(ch.choices[0].text)
        reason = ch.choices[0].finish_reason or reason
    assert ("".join(pieces), reason) == alone(plain, PROMPTS[1], False, max_new_tokens=20, temperature=0.8, seed=7)
    # chat, the template applied, streamed and not
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack class."}]
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, temperature=0.6, top_p=0.9, seed=3)
    want = alone(plain, msgs, True, max_new_tokens=16, temperature=0.6, top_p=0.9, seed=3)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == want
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=16, temperature=0.6, top_p=0.9, seed=3, stream=True))
    assert text == want[0]
    # a stop string ends the text before it, streamed or not
    full = alone(plain, PROMPTS[0], False, max_new_tokens=24)[0]
    assert "\n" in full
    r = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=["\n"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[:full.index("\n")], "stop")
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=["\n"], stream=True))
    assert text == full[:full.index("\n")]
    want = plain.generate(PROMPTS[0], max_new_tokens=24, stop=["\n"])
    assert r.usage.completion_tokens == len(want.tokens)          # the tokens up to the stop, as ar's
    # usage in a stream's last chunk
    last = list(c.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=5, temperature=0, stream=True,
                                     stream_options={"include_usage": True}))[-1]
    assert last.usage.completion_tokens == 5


BAD = [  # (body or raw bytes, status, words the message holds)
    (b"{not json", 400, "malformed JSON"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ({"model": NAME, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": 10 ** 9}, 400, "exceeds the context"),
    ({"model": NAME, "prompt": "x", "temperature": float("nan")}, 400, "temperature"),
    ({"model": NAME, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": NAME, "prompt": "x", "temperature": 1e300}, 400, "temperature"),      # (once a 500 for the batch)
    ({"model": NAME, "prompt": "x", "top_k": 2 ** 63}, 400, "top_k"),
    ({"model": NAME, "prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": NAME, "prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"model": NAME, "prompt": "x", "seed": 2 ** 64}, 400, "seed"),
    ({"model": NAME, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "n": 0}, 400, "n must be an integer in [1, 128]"),
    ({"model": NAME, "prompt": "x", "n": 129}, 400, "n must be"),
    ({"model": NAME, "prompt": "x", "n": 2, "seed": 2 ** 63 - 1}, 400, "seed + i"),
    ({"model": NAME, "prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
    ({"model": NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs must be an integer in [0, 20]"),
    ({"model": NAME, "prompt": "x", "logprobs": True}, 400, "logprobs must be an integer"),
    ({"model": NAME, "prompt": "x", "top_logprobs": 2}, 400, "top_logprobs is chat's"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "logprobs": 2}, 400, "true or false"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "with logprobs: true"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs must be"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
    ({"model": NAME, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": NAME, "prompt": "x", "frequency_penalty": 0.5}, 400, "penalties"),
    ({"model": NAME, "prompt": "x", "best_model": 1}, 400, "best_model"),
    ({"model": NAME, "prompt": ""}, 400, "empty prompt"),
    ({"model": NAME, "prompt": [10 ** 6]}, 400, "vocabulary"),
    ({"model": NAME, "prompt": ["a", "b"]}, 400, "one prompt"),
    ({"model": NAME, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": NAME, "messages": []}, 400, "messages"),
    ({"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
]


BAD_TOKENIZE = [  # (path, body, status, words)
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "one of them"),
    ("/tokenize", {}, 400, "one of them"),
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/detokenize", {"tokens": [10 ** 6]}, 400, "vocabulary"),
    ("/detokenize", {"tokens": [-1]}, 400, "vocabulary"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "does not exist"),
]


def test_bad_requests_get_openai_errors(server):
    for body, status, words in BAD:
        path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        code, got = http("POST", server + path, raw)
        assert code == status, (body, got)
        err = got["error"]
        assert words in err["message"] and err["type"] == "invalid_request_error", (body, err)
    for path, body, status, words in BAD_TOKENIZE:
        code, got = http("POST", server + path, json.dumps(body).encode())
        assert code == status and words in got["error"]["message"], (path, body, got)
    for method, path, status in (("GET", "/v1/completions", 405), ("POST", "/v1/nothing", 404)):
        code, got = http(method, server + path, b"{}" if method == "POST" else None)
        assert code == status and got["error"]["message"], got
    with pytest.raises(openai.NotFoundError):          # what the client makes of them
        client(server).completions.create(model="nope", prompt="x")
    assert client(server).completions.create(model=NAME, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_bounded_load_with_disconnects_and_bad_requests(server, plain):
    """32 concurrent clients: 24 stream good requests (completions and chat, greedy and sampled), 4 leave
    after their first piece of a long answer, 4 send bad requests. Every good answer is complete and ar's;
    the leavers' slots are freed (their answers would take minutes); the server still answers."""
    goods = []
    for i in range(24):
        p = PROMPTS[i % len(PROMPTS)]
        kw = dict(max_tokens=12 + i % 5, temperature=0 if i % 2 else 0.7, seed=i)
        goods.append((i % 3 == 0, p, kw))
    ac = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=600)

    async def good(chat, p, kw):
        t0, text, reason = time.perf_counter(), "", None
        if chat:
            stream = await ac.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}],
                                                      stream=True, **kw)
            async for ch in stream:
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    reason = ch.choices[0].finish_reason or reason
        else:
            async for ch in await ac.completions.create(model=NAME, prompt=p, stream=True, **kw):
                text += ch.choices[0].text
                reason = ch.choices[0].finish_reason or reason
        return text, reason, time.perf_counter() - t0

    async def leaver(p):
        stream = await ac.completions.create(model=NAME, prompt=p, max_tokens=1500, temperature=0, stream=True)
        async for _ in stream:
            break
        await stream.close()

    async def bad(body):
        return (await asyncio.to_thread(http, "POST", server + "/v1/completions", json.dumps(body).encode()))[0]

    async def everyone():
        jobs = [good(*g) for g in goods] + [leaver(PROMPTS[i]) for i in range(4)]
        jobs += [bad({"model": NAME, "prompt": "x", "max_tokens": 0}), bad({"model": "x", "prompt": "x"}),
                 bad({"model": NAME, "prompt": "x", "temperature": -2}), bad({"model": NAME})]
        t0 = time.perf_counter()
        got = await asyncio.gather(*jobs)
        return got, time.perf_counter() - t0

    got, secs = asyncio.run(everyone())
    answers, statuses = got[:24], got[-4:]
    assert statuses == [400, 404, 400, 400]
    for (chat, p, kw), (text, reason, _) in zip(goods, answers):
        prompt = [{"role": "user", "content": p}] if chat else p
        assert (text, reason) == alone(plain, prompt, chat, max_new_tokens=kw["max_tokens"],
                                       temperature=kw["temperature"], seed=kw["seed"]), (chat, p, kw)
    deadline = time.time() + 120
    while time.time() < deadline:                      # the leavers' slots come back
        h = http("GET", server + "/health")[1]
        if h["busy"] == 0 and h["waiting"] == 0:
            break
        time.sleep(0.2)
    assert h["busy"] == 0 and h["waiting"] == 0 and h["ended"].get("cancelled", 0) >= 4, h
    lat = sorted(a[2] for a in answers)
    print(f"\n{len(answers)} good streams in {secs:.1f}s = {len(answers) / secs:.2f} requests/s, latency p50 "
          f"{lat[len(lat) // 2]:.2f}s p90 {lat[int(0.9 * len(lat)) - 1]:.2f}s")
    assert client(server).completions.create(model=NAME, prompt="x", max_tokens=3).usage.completion_tokens == 3


def test_a_client_gone_frees_its_slot_unstreamed_too(server):
    """A plain (not streamed) request whose client leaves ends "cancelled", not after its 2000 tokens."""
    from http.client import HTTPConnection
    before = http("GET", server + "/health")[1]["ended"].get("cancelled", 0)
    host, port = server.split("//")[1].split(":")
    conn = HTTPConnection(host, int(port), timeout=2)
    conn.request("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": PROMPTS[0], "max_tokens": 2000,
                                                        "temperature": 0}), {"content-type": "application/json"})
    with pytest.raises(OSError):                       # the answer would take far longer than 2 s
        conn.getresponse()
    conn.close()
    deadline = time.time() + 120
    while time.time() < deadline:
        h = http("GET", server + "/health")[1]
        if h["busy"] == 0 and h["ended"].get("cancelled", 0) > before:
            break
        time.sleep(0.2)
    assert h["busy"] == 0 and h["ended"].get("cancelled", 0) == before + 1, h


def test_a_busy_port_is_refused_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--ckpt", str(STDLIB), "--port", str(port)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: cannot listen on 127.0.0.1:") and \
        len(r.stderr.strip().splitlines()) == 1, r.stderr


def piece(plain, i: int) -> str:
    """A token's text alone, as the server spells it in log-probs."""
    return plain.tokenizer.tk.decode([i], skip_special_tokens=False)


def test_logprobs_n_and_echo_equal_plain_decoding(server, plain):
    """Completions' logprobs k and chat's logprobs/top_logprobs are plain decoding's (graft verifies;
    float32: to 1e-5); n choices, choice i sampled with seed + i; echo puts the prompt and its log-probs
    first; streamed pieces join into the whole answer, log-probs included; usage counts real tokens."""
    c, tok = client(server), plain.tokenizer
    kw = dict(max_tokens=12, temperature=0.8, seed=5)
    r = c.completions.create(model=NAME, prompt=PROMPTS[0], n=3, logprobs=2, **kw)
    wants = [plain.generate(PROMPTS[0], max_new_tokens=12, temperature=0.8, seed=5 + i, logprobs=2) for i in range(3)]
    assert [ch.index for ch in r.choices] == [0, 1, 2] and len({ch.text for ch in r.choices}) > 1
    for ch, want in zip(r.choices, wants):
        assert (ch.text, ch.finish_reason) == (want.text, want.finish_reason)
        lp = ch.logprobs
        assert lp.tokens == [piece(plain, t) for t in want.tokens]
        assert all(abs(a - b[1]) < 1e-5 for a, b in zip(lp.token_logprobs, want.logprobs))
        for top, (t, x, best) in zip(lp.top_logprobs, want.logprobs):     # the 2 most likely and the chosen
            assert all(abs(top[piece(plain, i)] - y) < 1e-5 for i, y in best + [(t, x)]) and len(top) <= 3
        assert lp.text_offset == [len(tok.decode(want.tokens[:j])) for j in range(len(want.tokens))]
    assert r.usage.completion_tokens == sum(len(w.tokens) for w in wants)
    assert r.usage.prompt_tokens == len(tok.encode(PROMPTS[0]))
    texts, lps = ["", ""], [[], []]                 # streamed: per index, the same text and log-probs
    for ch in c.completions.create(model=NAME, prompt=PROMPTS[0], n=2, logprobs=2, stream=True, **kw):
        for x in ch.choices:
            texts[x.index] += x.text
            lps[x.index] += x.logprobs.token_logprobs if x.logprobs else []
    assert texts == [ch.text for ch in r.choices[:2]] and lps == [ch.logprobs.token_logprobs for ch in r.choices[:2]]
    # echo: the prompt, then the answer; the prompt's tokens have log-probs after the first
    e = c.completions.create(model=NAME, prompt=PROMPTS[1], echo=True, logprobs=1, max_tokens=6, temperature=0)
    want = plain.generate(PROMPTS[1], max_new_tokens=6, logprobs=1, prompt_logprobs=True)
    ids = tok.encode(PROMPTS[1])
    assert e.choices[0].text == PROMPTS[1] + want.text
    lp = e.choices[0].logprobs
    assert lp.tokens == [piece(plain, t) for t in ids + want.tokens] and lp.token_logprobs[0] is None
    assert all(abs(a - b[1]) < 1e-5 for a, b in zip(lp.token_logprobs[1:], want.prompt_logprobs + want.logprobs))
    assert e.usage.prompt_tokens == len(ids) and e.usage.completion_tokens == len(want.tokens)
    streamed = c.completions.create(model=NAME, prompt=PROMPTS[1], echo=True, max_tokens=6, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == PROMPTS[1] + want.text
    # chat: logprobs true with the top 2; a stop given as a string
    msgs = [{"role": "user", "content": "A stack class."}]
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, logprobs=True, top_logprobs=2, stop="\n")
    want = plain.generate([dict(m) for m in msgs], max_new_tokens=10, logprobs=2, stop=["\n"])
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want.text and [x.token for x in content] == [piece(plain, t) for t in want.tokens]
    assert all(abs(x.logprob - w[1]) < 1e-5 and [y.token for y in x.top_logprobs] == [piece(plain, i) for i, _ in w[2]]
               and x.bytes == list(x.token.encode()) for x, w in zip(content, want.logprobs))
    got = []
    for ch in c.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, logprobs=True, top_logprobs=2,
                                        stop="\n", stream=True):
        got += [x.logprob for x in ch.choices[0].logprobs.content] if ch.choices and ch.choices[0].logprobs else []
    assert got == [x.logprob for x in content]
    assert c.chat.completions.create(model=NAME, messages=msgs, max_tokens=4).choices[0].logprobs is None


def test_tokenize_and_detokenize(server, plain):
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize."""
    tok = plain.tokenizer
    code, r = http("POST", server + "/tokenize", json.dumps({"model": NAME, "prompt": PROMPTS[0]}).encode())
    assert code == 200 and r == {"count": len(tok.encode(PROMPTS[0])), "max_model_len": plain.max_seq_len,
                                 "tokens": tok.encode(PROMPTS[0]), "token_strs": None}
    assert r["count"] == client(server).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=1).usage.prompt_tokens
    r = http("POST", server + "/tokenize", json.dumps({"prompt": PROMPTS[2], "return_token_strs": True,
                                                       "add_special_tokens": False}).encode())[1]
    assert r["tokens"] == tok.encode(PROMPTS[2], add_special_tokens=False)
    assert r["token_strs"] == [tok.tk.id_to_token(i) for i in r["tokens"]]
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack class."}]
    r = http("POST", server + "/tokenize", json.dumps({"messages": msgs}).encode())[1]
    assert r["tokens"] == plain.encode(msgs)
    bare = http("POST", server + "/tokenize", json.dumps({"messages": msgs, "add_generation_prompt": False}).encode())[1]
    assert bare["tokens"] == r["tokens"][:bare["count"]] and bare["count"] < r["count"]
    code, r = http("POST", server + "/detokenize", json.dumps({"model": NAME, "tokens": tok.encode(PROMPTS[3])}).encode())
    assert code == 200 and r == {"prompt": tok.decode(tok.encode(PROMPTS[3]))} and PROMPTS[3] in r["prompt"]


def metrics(url) -> dict:
    """/metrics parsed by prometheus_client: {(name, labels as a sorted tuple): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def test_metrics_and_health_count_real_work(server, plain):
    """/metrics (Prometheus text) counts what the engine did for two requests: prompt tokens prefilled,
    tokens generated, rounds, the candidates verified and the accepted ones by source, the latencies;
    /health says graft is in force, calibrated in the background while plain decoding served."""
    h = http("GET", server + "/health")[1]
    assert (h["method"], h["calibration"], h["calibrating"], h["busy"], h["waiting"]) == ("graft", "measured", None, 0, 0)
    before = metrics(server)
    c = client(server)
    a = c.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=30, temperature=0)
    b = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPTS[5]}], max_tokens=20)
    after = metrics(server)
    d = lambda name, **labels: after.get((name, tuple(sorted(labels.items()))), 0) - before.get(
        (name, tuple(sorted(labels.items()))), 0)
    assert d("graft:prompt_tokens_total") == a.usage.prompt_tokens + b.usage.prompt_tokens
    assert d("graft:generation_tokens_total") == a.usage.completion_tokens + b.usage.completion_tokens == 50
    assert d("graft:request_success_total", finished_reason="length") == 2
    assert d("graft:time_to_first_token_seconds_count") == 2 and d("graft:e2e_request_latency_seconds_count") == 2
    assert d("graft:time_per_output_token_seconds_count") == 2 and d("graft:time_to_first_token_seconds_sum") > 0
    rounds, drafted = d("graft:spec_decode_num_drafts_total", method="graft"), d(
        "graft:spec_decode_num_draft_tokens_total", method="graft")
    accepted = sum(d("graft:spec_decode_num_accepted_tokens_total", method="graft", source=s)
                   for s in ("draft", "matrix", "context"))
    # after its first token a request returns, each round, its accepted tokens and the bonus (cut at max_tokens)
    assert 0 < accepted <= drafted and accepted <= 50 - 2 <= accepted + rounds and rounds < 48
    assert after[("graft:num_requests_running", ())] == 0 and after[("graft:num_requests_waiting", ())] == 0


def test_a_queue_limit_refuses_with_429_and_a_client_gone_leaves_the_queue(chat_ckpt, plain, tmp_path):
    """--max-queued-requests 1 with one slot: one request runs, one waits, the next gets a 429 in
    OpenAI's shape (the client's RateLimitError); a waiting client that hangs up leaves the queue at
    once; every admitted request completes with plain decoding's answer; the server goes on."""
    r = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--ckpt", str(STDLIB), "--port", "1",
                        "--max-queued-requests", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "error: --max-queued-requests must be >= 1, got 0", r.stderr
    port, log = free_port(), tmp_path / "serve.log"
    cmd = [sys.executable, str(ROOT / "serve.py"), "--ckpt", str(chat_ckpt), "--method", "ar", "--batch", "1",
           "--max-queued-requests", "1", "--port", str(port), "--served-model-name", NAME, "--dtype", "float32"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        url = start(proc, port, log)
        c = client(url)
        waiting = lambda: http("GET", url + "/health")[1]["waiting"]

        def until(cond, seconds=60):
            deadline = time.time() + seconds
            while not cond() and time.time() < deadline:
                time.sleep(0.05)
            return cond()

        running = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=1500, temperature=0, stream=True)
        next(iter(running))                            # it holds the one slot
        from http.client import HTTPConnection
        gone = HTTPConnection("127.0.0.1", port, timeout=60)
        gone.request("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": "x", "max_tokens": 4}),
                     {"content-type": "application/json"})
        assert until(lambda: waiting() == 1)
        body = json.dumps({"model": NAME, "prompt": PROMPTS[1], "max_tokens": 4}).encode()
        code, got = http("POST", url + "/v1/completions", body)
        assert code == 429 and got["error"]["type"] == "rate_limit_error" and "--max-queued-requests" in \
            got["error"]["message"], got
        with pytest.raises(openai.RateLimitError):
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert metrics(url)[("graft:num_requests_waiting", ())] == 1
        t0 = time.time()
        gone.close()                                   # its place in the queue is free at once
        assert until(lambda: waiting() == 0, 10) and time.time() - t0 < 5
        kept = {}
        thread = threading.Thread(target=lambda: kept.update(r=c.completions.create(
            model=NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0)))
        thread.start()
        assert until(lambda: waiting() == 1)
        running.close()                                # the running one's client leaves: the waiting one runs
        thread.join(60)
        assert kept["r"].choices[0].text == alone(plain, PROMPTS[1], False, max_new_tokens=8)[0]
        assert c.completions.create(model=NAME, prompt="x", max_tokens=2).usage.completion_tokens == 2
        assert http("GET", url + "/health")[1]["ended"].get("cancelled", 0) >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
