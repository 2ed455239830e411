"""Load a running serve.py with concurrent streaming clients; print requests/s and latency percentiles.

    python serve.py --ckpt checkpoints/stdlib-qwen3 --draft checkpoints/stdlib-qwen3-eagle3 --port 8000 &
    python scripts/serve_load.py --url http://127.0.0.1:8000 --clients 32 --requests 96 --max-tokens 32

`--clients` streams run at once until `--requests` good requests are done (completions and chat
alternating unless --no-chat, greedy and sampled alternating, prompts from the stdlib snippets); `--leavers` more clients
leave after their first piece of a long answer and `--bad` send a request the server must refuse.
Latency is a request's whole time, TTFT its first piece's; tokens/s counts the completion tokens the
server reports. Needs the `openai` package (a test dependency)."""
import argparse
import asyncio
import json
import statistics
import time
import urllib.request

import openai

PROMPTS = ["def parse(line):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def push(self, x):\n",
           "for i in range(10):\n", "with open(path) as f:\n", "try:\n    import json\n"]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))] if xs else 0.0


async def main_async(a):
    c = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key="none", max_retries=0, timeout=3600)
    model = (await c.models.list()).data[0].id
    todo, lat, ttft, tokens = list(range(a.requests)), [], [], 0

    async def one(i):
        nonlocal tokens
        p, kw = PROMPTS[i % len(PROMPTS)], dict(max_tokens=a.max_tokens, temperature=0.0 if i % 2 else 0.7, seed=i,
                                                stream=True, stream_options={"include_usage": True})
        t0, first = time.perf_counter(), None
        if i % 2 and not a.no_chat:
            stream = await c.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], **kw)
        else:
            stream = await c.completions.create(model=model, prompt=p, **kw)
        async for ch in stream:
            if first is None and ch.choices:
                first = time.perf_counter() - t0
            if ch.usage:
                tokens += ch.usage.completion_tokens
        lat.append(time.perf_counter() - t0)
        ttft.append(first or 0.0)

    async def worker():
        while todo:
            await one(todo.pop())

    async def leaver(i):
        s = await c.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=2000, stream=True)
        async for _ in s:
            break
        await s.close()

    def bad(i):
        body = [{"model": model, "prompt": "x", "max_tokens": -1}, {"model": "nope", "prompt": "x"}][i % 2]
        req = urllib.request.Request(a.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=600)
            return 200
        except urllib.error.HTTPError as e:
            return e.code

    t0 = time.perf_counter()
    extra = [leaver(i) for i in range(a.leavers)] + [asyncio.to_thread(bad, i) for i in range(a.bad)]
    got = await asyncio.gather(*[worker() for _ in range(a.clients)], *extra)
    secs = time.perf_counter() - t0
    out = {"requests": a.requests, "clients": a.clients, "seconds": round(secs, 2),
           "requests_per_s": round(a.requests / secs, 3), "tokens_per_s": round(tokens / secs, 2),
           "latency_s": {q: round(pct(lat, v), 3) for q, v in (("p50", .5), ("p90", .9), ("p99", .99))},
           "ttft_s": {q: round(pct(ttft, v), 3) for q, v in (("p50", .5), ("p90", .9), ("p99", .99))},
           "mean_latency_s": round(statistics.mean(lat), 3), "bad_statuses": sorted(set(got[len(got) - a.bad:]))
           if a.bad else []}
    with urllib.request.urlopen(a.url + "/health", timeout=60) as r:
        out["health"] = json.loads(r.read())
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--leavers", type=int, default=4)
    p.add_argument("--bad", type=int, default=4)
    p.add_argument("--no-chat", action="store_true", help="completions only (a model without a chat template)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
