"""serve.py through a real client (the `openai` package) on a loopback port: chat and completions,
streamed and not, every answer what plain decoding gives alone; bad requests answered with OpenAI's
error shape while the server goes on; a bounded load of concurrent streams, some leaving midway.

The server runs graft with the stdlib pair (its target copied with a chat template added, so chat
runs too) in float32, with 4 slots, in a process of its own; the references run `ar` in this one.
"""
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
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
    cmd = [sys.executable, str(ROOT / "serve.py"), "--ckpt", str(chat_ckpt), "--draft", str(HEAD), "--method", "graft",
           "--batch", "4", "--warmup", "1", "--port", str(port), "--served-model-name", NAME, "--dtype", "float32"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600                  # a loaded 2-core machine: the warm-up can take minutes
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve.py exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if http("GET", url + "/health", timeout=5)[0] == 200:
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"serve.py did not start: {log.read_text()[-2000:]}")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


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
    ({"model": NAME, "prompt": "x", "n": 2}, 400, "n > 1"),
    ({"model": NAME, "prompt": "x", "logprobs": 3}, 400, "logprobs"),
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


def test_bad_requests_get_openai_errors(server):
    for body, status, words in BAD:
        path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        code, got = http("POST", server + path, raw)
        assert code == status, (body, got)
        err = got["error"]
        assert words in err["message"] and err["type"] == "invalid_request_error", (body, err)
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
