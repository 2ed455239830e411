"""An OpenAI-compatible HTTP server over the one engine, with continuous batching.

    python serve.py --ckpt CKPT [--draft HEAD] [--method M] [--batch B] [--host H] --port PORT

Endpoints (the shapes of vLLM's server): GET /v1/models; POST /v1/completions and /v1/chat/completions
(the chat template applied), streamed (server-sent events) or not, with temperature, top_p, top_k,
max_tokens, seed, stop (a string or a list), n (choice i samples with seed + i), echo (completions),
logprobs (completions: logprobs k; chat: logprobs, top_logprobs) and stream_options.include_usage;
POST /tokenize and /detokenize; GET /health (slots, the queue, the method in force and its
calibration) and GET /metrics (Prometheus text, prometheus_client). Requests join the free slots of
the running batch between rounds (the prompts that arrive together prefilled in one target pass) and
leave when done; a client that hangs up frees its slot, or its place in the queue, at once; past
--max-queued-requests waiting requests a new one gets a 429. A bad request gets a 4xx JSON error in
OpenAI's shape and the server goes on. A field a request leaves out takes the server's flag
(--temperature, --top-p, --top-k, --seed, --max-new-tokens: greedy, 128 tokens by default), so an
answer is exactly what `python generate.py` gives with the same values. Fields graft does not
implement (penalties, logit_bias, tools, best_of > n, suffix, ...) are refused, never ignored.

One thread owns the engine (api.LLM: load, every step, and a method's calibration between requests
while plain decoding serves: api.Calibrating); the HTTP side (FastAPI on uvicorn, the stack vLLM and
SGLang serve with) talks to it through an inbox and a queue of events per request.
"""
import asyncio
import functools
import json
import socket
import sys
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

import api
from cli import ArgumentParser, add_engine_flags, check_args, check_sampling, run
from engine import METHODS
from graft import SOURCES
from model import GraftError
import tp

SERVER_NAMES = ("temperature", "top_p", "top_k", "seed", "max_tokens")
MAX_STOPS = 16
MAX_N = 128                 # choices a request may ask for (OpenAI's limit)
disable_created_metrics()   # one series a counter: no *_created timestamps beside each


# ----------------------------------------------------------------------------- the engine's thread

class Job:
    """One HTTP request's way to the engine: what to submit (n choices, choice i with seed + i), and a
    queue of events back to the event loop: ("ok",), ("error", status, message), ("prompt", i, the
    prompt's log-probs or None: echo), ("text", i, piece, log-probs of the tokens it settled),
    ("end", i, Completion), ("gone",) (the client hung up)."""

    def __init__(self, loop, kw: dict, n: int = 1, echo: bool = False, t0: float | None = None):
        self.loop, self.kw, self.n, self.echo, self.events = loop, kw, n, echo, asyncio.Queue()
        self.seqs, self.cancelled, self.t0 = [], False, time.perf_counter() if t0 is None else t0   # its arrival
        self.begun, self.over = set(), set()       # choices prefilled, ended (the engine's thread's)

    def put(self, *event):
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Meter:
    """The server's Prometheus metrics (prometheus_client, a registry of its own), named as vLLM's with
    graft: for vllm:. Counted after every step from the engine's own requests: prompt tokens prefilled,
    tokens generated (a stop string's cut included: the engine made them), and per method the rounds
    (one target pass each), the candidate tokens verified and the accepted ones by where they came
    from (the head: draft; the continuation matrix; a context match), the bonus token aside; times in
    seconds from the request's arrival."""

    def __init__(self, worker):
        r = self.registry = CollectorRegistry()
        Gauge("graft:num_requests_running", "Requests in a slot.", registry=r).set_function(worker.running)
        Gauge("graft:num_requests_waiting", "Requests waiting for a slot.", registry=r).set_function(worker.queued)
        self.prompt = Counter("graft:prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation = Counter("graft:generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter("graft:request_success", "Choices ended, by finish reason.", ["finished_reason"],
                               registry=r)
        self.drafts = Counter("graft:spec_decode_num_drafts", "Rounds (target passes), by method.", ["method"], registry=r)
        self.drafted = Counter("graft:spec_decode_num_draft_tokens", "Candidate tokens verified (the root and "
                               "padding aside), by method.", ["method"], registry=r)
        self.accepted = Counter("graft:spec_decode_num_accepted_tokens", "Candidate tokens accepted (the bonus aside), "
                                "by method and source (draft, matrix, context).", ["method", "source"], registry=r)
        times = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
        self.ttft = Histogram("graft:time_to_first_token_seconds", "From arrival to the first token.",
                              buckets=times, registry=r)
        self.tpot = Histogram("graft:time_per_output_token_seconds", "A choice's seconds per token after its first.",
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5), registry=r)
        self.e2e = Histogram("graft:e2e_request_latency_seconds", "From arrival to the last token.", buckets=times,
                             registry=r)
        self.seen = {}                   # per live Sequence: (counts at the last step, time of its first token)

    def observe(self, job: Job, seq, method: str):
        r, now = seq.request, time.perf_counter()
        counts = (len(r.tokens), r.rounds, r.verified, r.accepted - r.from_retrieval,
                  *(r.from_source.get(s, 0) for s in SOURCES))
        old, first = self.seen.get(seq, ((0,) * len(counts), None))
        if r.tokens and first is None:                   # prefilled: its first token
            first = now
            self.prompt.inc(len(r.ids))
            self.ttft.observe(now - job.t0)
        d = [a - b for a, b in zip(counts, old)]
        self.generation.inc(d[0])
        self.drafts.labels(method).inc(d[1])
        self.drafted.labels(method).inc(d[2])
        for source, x in zip(("draft", *SOURCES), d[3:]):
            self.accepted.labels(method, source).inc(x)
        self.seen[seq] = (counts, first)
        if seq.done:
            del self.seen[seq]
            self.success.labels(seq.reason).inc()
            self.e2e.observe(now - job.t0)
            if first is not None and len(r.tokens) > 1:
                self.tpot.observe((now - first) / (len(r.tokens) - 1))


class Worker:
    """The thread that loads the model and then steps it: waiting jobs are submitted between steps,
    each live one gets its new text after every step, cancelled ones are dropped; with nothing to run,
    the method's background calibration takes a turn (api.LLM.idle_step). limit: the most requests
    that may wait for a slot (--max-queued-requests; None: no limit)."""

    def __init__(self, load, limit: int | None = None):
        self.load, self.llm, self.error, self.limit = load, None, None, limit
        self.inbox, self.jobs, self.cond = [], [], threading.Condition()
        self.held = []                       # jobs with a choice not yet in a slot, as of the last step
        self.ended = {}                      # choices ended, by finish_reason ("stop", "length", "cancelled", "error")
        self.meter = Meter(self)
        self.ready = threading.Event()
        threading.Thread(target=self.main, daemon=True, name="graft-engine").start()

    def queued(self) -> int:
        """Requests waiting for a slot (those just arrived included; a client gone is not counted)."""
        with self.cond:
            return sum(not j.cancelled for j in self.inbox + self.held)

    def running(self) -> int:
        return sum(r is not None for r in self.llm.engine.requests()) if self.llm else 0

    def send(self, job: Job) -> bool:
        """Queue a job; False when `limit` requests already wait (the caller answers 429)."""
        with self.cond:
            if self.limit is not None and sum(not j.cancelled for j in self.inbox + self.held) >= self.limit:
                return False
            self.inbox.append(job)
            self.cond.notify()
        return True

    def cancel(self, job: Job):
        job.cancelled = True
        for seq in job.seqs:
            seq.cancel()
        with self.cond:
            self.cond.notify()

    def submit(self, job: Job):
        """Job's n choices into the engine's queue (GraftError: none stays)."""
        try:
            for i in range(job.n):
                job.seqs.append(self.llm.submit(**dict(job.kw, seed=job.kw["seed"] + i)))
        except GraftError:
            for seq in job.seqs:
                seq.cancel()
            raise

    def main(self):
        try:
            self.llm = self.load()
        except BaseException as e:          # reported by the main thread, in one line
            self.error = e
            return
        finally:
            self.ready.set()
        llm = self.llm
        while True:
            with self.cond:                  # (a switch of method waits for the running requests to end)
                while not (self.inbox and not llm.switching) and not llm.busy() and llm.background is None:
                    self.cond.wait()
                todo, self.inbox = ([], self.inbox) if llm.switching else (self.inbox, [])
                for job in todo:             # 1. new requests join the batch
                    if job.cancelled:
                        continue
                    try:
                        self.submit(job)
                    except GraftError as e:
                        job.put("error", 400, str(e))
                        continue
                    job.put("ok")
                    self.jobs.append(job)
                self.hold()
            for job in self.jobs:            # 2. the cancelled leave it
                if job.cancelled:
                    for seq in job.seqs:
                        seq.cancel()
            method = llm.method
            try:                             # 3. one round for every slot, or background work
                if llm.busy():
                    llm.step()
                else:
                    llm.idle_step()
            except Exception as e:           # the batch's pass failed: its requests end with the reason
                llm.abort()
                self.ended["error"] = self.ended.get("error", 0) + sum(len(j.seqs) for j in self.jobs)
                for job in self.jobs:
                    job.put("error", 500, f"the engine failed on this batch: {str(e).splitlines()[0][:300]}")
                    for seq in job.seqs:
                        self.meter.seen.pop(seq, None)
                self.jobs = []
                continue
            for job in self.jobs:            # 4. what each request got
                for i, seq in enumerate(job.seqs):
                    self.report(job, i, seq, method)
            self.jobs = [j for j in self.jobs if not all(seq.done for seq in j.seqs)]
            with self.cond:
                self.hold()

    def report(self, job: Job, i: int, seq, method: str):
        """After a step: choice i's prompt part (echo, once prefilled), new text and log-probs, its end."""
        if i in job.over:
            return
        if job.echo and seq.request.tokens and i not in job.begun:
            job.begun.add(i)
            job.put("prompt", i, seq.completion().prompt_logprobs)
        self.meter.observe(job, seq, method)
        piece, lps = seq.pull(), seq.pull_logprobs()
        if piece or lps:
            job.put("text", i, piece, lps)
        if seq.done:
            job.over.add(i)
            job.put("end", i, seq.completion())
            self.ended[seq.reason] = self.ended.get(seq.reason, 0) + 1

    def hold(self):
        self.held = [j for j in self.jobs if any(not s.request.tokens and not s.done for s in j.seqs)]


# ----------------------------------------------------------------------------- requests

class Body(BaseModel):
    """What both endpoints take. Types are strict: "1" is not a number."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: StrictStr
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    n: StrictInt = 1
    user: StrictStr | None = None
    logprobs: StrictBool | StrictInt | None = None
    top_logprobs: StrictInt | None = None
    # what graft does not do: accepted at their neutral values only
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: StrictStr | dict | None = None


class CompletionBody(Body):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: StrictStr
    content: StrictStr | list[dict] | None = None
    name: StrictStr | None = None


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages (the template applied)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = None
    add_special_tokens: StrictBool | None = None          # default: True for a prompt, False for messages
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: StrictStr | None = None
    tokens: list[StrictInt]


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        self.status, self.message, self.param, self.code = status, message, param, code


def error(status: int, message: str, param=None, code=None) -> JSONResponse:
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "internal_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def logprobs_of(b: Body, chat: bool) -> int | None:
    """How many of the most likely tokens a request wants beside each token's log-probability (None:
    no log-probs): completions' logprobs k; chat's logprobs true with top_logprobs k (0 when left out)."""
    most = api.MAX_LOGPROBS
    if chat:
        if not isinstance(b.logprobs, (bool, type(None))):
            raise BadRequest(400, "logprobs is true or false for chat (top_logprobs: k gives the k most likely)",
                             "logprobs")
        if b.top_logprobs is not None and not (b.logprobs and 0 <= b.top_logprobs <= most):
            raise BadRequest(400, f"top_logprobs must be an integer in [0, {most}], with logprobs: true",
                             "top_logprobs")
        return (b.top_logprobs or 0) if b.logprobs else None
    if isinstance(b.logprobs, bool) or not (b.logprobs is None or 0 <= b.logprobs <= most):
        raise BadRequest(400, f"logprobs must be an integer in [0, {most}] for completions (the most likely "
                              f"tokens given beside each token's)", "logprobs")
    if b.top_logprobs is not None:
        raise BadRequest(400, "top_logprobs is chat's: completions take logprobs: k", "top_logprobs")
    return b.logprobs


def request_kw(b: Body, server, prompt, chat: bool) -> dict:
    """api.LLM.submit's keywords for a request body; BadRequest for what graft does not do."""
    a = server.args
    unsupported = [(bool(b.presence_penalty) or bool(b.frequency_penalty), "presence_penalty",
                    "presence and frequency penalties are not supported (they change the distribution)"),
                   (bool(b.logit_bias), "logit_bias", "logit_bias is not supported"),
                   (b.response_format not in (None, {"type": "text"}), "response_format",
                    "response_format other than text is not supported"),
                   (bool(b.tools) or b.tool_choice not in (None, "none"), "tools", "tools are not supported"),
                   (getattr(b, "suffix", None) is not None, "suffix", "suffix is not supported"),
                   (getattr(b, "best_of", None) not in (None, b.n), "best_of",
                    "best_of other than n is not supported (it would rank choices)")]
    for bad, param, msg in unsupported:
        if bad:
            raise BadRequest(400, msg, param)
    if not 1 <= b.n <= MAX_N:
        raise BadRequest(400, f"n must be an integer in [1, {MAX_N}], got {b.n}", "n")
    if b.stream_options is not None and (not b.stream or set(b.stream_options) - {"include_usage"}):
        raise BadRequest(400, "stream_options takes only include_usage, and only with stream: true", "stream_options")
    stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
    if len(stop) > MAX_STOPS or not all(stop):
        raise BadRequest(400, f"stop takes at most {MAX_STOPS} non-empty strings", "stop")
    if b.max_tokens is not None and b.max_completion_tokens is not None:
        raise BadRequest(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
    kw = dict(max_new_tokens=b.max_tokens if b.max_tokens is not None else b.max_completion_tokens,
              temperature=b.temperature, top_p=b.top_p, top_k=b.top_k, seed=b.seed)
    flags = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    kw = {k: flags[k] if v is None else v for k, v in kw.items()}
    try:
        check_sampling(kw["temperature"], kw["top_p"], kw["top_k"], kw["seed"], kw["max_new_tokens"], SERVER_NAMES)
    except GraftError as e:
        raise BadRequest(400, str(e), str(e).split()[0]) from None
    if kw["seed"] + b.n - 1 >= 2 ** 63:
        raise BadRequest(400, f"seed {kw['seed']}: choice i samples with seed + i, and n = {b.n} takes it past "
                              f"2^63 - 1", "seed")
    names = SERVER_NAMES if b.max_tokens is not None or b.max_completion_tokens is not None else \
        SERVER_NAMES[:4] + ("max_tokens (not given: the server's --max-new-tokens)",)
    k = logprobs_of(b, chat)
    return dict(kw, prompt=prompt, stop=stop, names=names, logprobs=k,
                prompt_logprobs=k is not None and bool(getattr(b, "echo", False)))


def completion_prompt(b: CompletionBody):
    p = b.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise BadRequest(400, "one prompt per request (a list of several is a batch: send them as requests)",
                             "prompt")
        p = p[0]
    if isinstance(p, list) and not p:
        raise BadRequest(400, "empty prompt", "prompt")
    return p


def chat_prompt(messages: list) -> list:
    out = []
    for m in messages:
        if m.role not in ("system", "user", "assistant", "developer", "tool"):
            raise BadRequest(400, f"unknown message role {m.role!r}", "messages")
        content = m.content or ""
        if isinstance(content, list):               # content parts: text only
            if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str)
                       for x in content):
                raise BadRequest(400, "message content parts must be {\"type\": \"text\", \"text\": ...}: "
                                      "graft serves text models", "messages")
            content = "".join(x["text"] for x in content)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        out.append(msg if m.name is None else {**msg, "name": m.name})     # a template may print the name
    return out


# ----------------------------------------------------------------------------- log-probs in OpenAI's shapes

class Texts:
    """Token texts for log-probs: a token alone (special tokens spelled out; a token that is part of a
    character shows as U+FFFD, as in vLLM), and the character offset of each token in a text (the
    length of the text before it, an incomplete character left out)."""

    def __init__(self, tok):
        self.tok = tok
        self.piece = functools.lru_cache(maxsize=65536)(lambda i: tok.tk.decode([i], skip_special_tokens=False))

    def offsets(self, ids: list, a: int, b: int, base: int = 0, end: int | None = None) -> list:
        """Offsets of tokens a..b-1 of `ids` (plus base, at most end)."""
        out = [base + len(self.tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(a, b)]
        return out if end is None else [min(x, end) for x in out]

    def completion(self, entries: list, offsets: list) -> dict:
        """Legacy completions' logprobs: tokens, token_logprobs, top_logprobs (a dict of the k most likely
        and the chosen, as vLLM gives), text_offset. An entry of None (echo's first token) has none."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": offsets}
        for e in entries:
            if len(e) == 1:
                out["tokens"].append(self.piece(e[0]))
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            t, lp, top = e
            out["tokens"].append(self.piece(t))
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({**{self.piece(i): x for i, x in top}, self.piece(t): lp})
        return out

    def chat(self, entries: list) -> dict:
        """Chat's logprobs: content, per token its text, log-probability, UTF-8 bytes and top_logprobs."""
        one = lambda i, x: {"token": self.piece(i), "logprob": x, "bytes": list(self.piece(i).encode("utf-8"))}
        return {"content": [{**one(t, lp), "top_logprobs": [one(i, x) for i, x in top]} for t, lp, top in entries],
                "refusal": None}


# ----------------------------------------------------------------------------- the app

def make_app(server) -> FastAPI:
    app = FastAPI(title="graft", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        e = exc.errors()[0] if exc.errors() else {}
        if e.get("type") == "json_invalid":
            return error(400, f"malformed JSON: {e.get('ctx', {}).get('error', 'invalid')}")
        where = ".".join(str(x) for x in e.get("loc", ())[1:]) or None
        return error(400, f"{where or 'body'}: {e.get('msg', 'invalid')}", where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):        # unknown route, wrong method: OpenAI's shape too
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(BadRequest)
    async def bad(_, exc: BadRequest):
        return error(exc.status, exc.message, exc.param, exc.code)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                             "owned_by": "graft", "max_model_len": server.worker.llm.max_seq_len}]}

    @app.get("/health")
    async def health():
        """Liveness, and what the engine holds: busy slots, waiting requests, choices ended by reason, the
        method in force and its calibration (api.LLM.calibrated; "running": plain decoding serves while
        `calibrating` calibrates between requests)."""
        w, llm = server.worker, server.worker.llm
        bg = llm.background
        return {"slots": llm.engine.B, "busy": w.running(), "waiting": w.queued(), "ended": dict(w.ended),
                "method": llm.method, "calibration": llm.calibrated, "calibrating": bg.method if bg else None}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.worker.meter.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        check_model(server, body.model)
        llm = server.worker.llm
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest(400, "give a prompt or messages, one of them", "prompt")
        try:
            if body.messages is not None:
                text = llm.tokenizer.render(chat_prompt(body.messages), body.add_generation_prompt,
                                            enable_thinking=False)
                ids = await asyncio.to_thread(llm.tokenizer.encode, text, bool(body.add_special_tokens))
            else:
                ids = await asyncio.to_thread(llm.tokenizer.encode, body.prompt, body.add_special_tokens is not False)
        except GraftError as e:
            raise BadRequest(400, str(e), "messages" if body.messages is not None else "prompt") from None
        strs = [llm.tokenizer.tk.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": llm.max_seq_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        check_model(server, body.model)
        V = server.worker.llm.engine.model.args.vocab_size
        if not all(0 <= t < V for t in body.tokens):
            raise BadRequest(400, f"a token id is outside the vocabulary [0, {V})", "tokens")
        return {"prompt": await asyncio.to_thread(server.worker.llm.tokenizer.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        return await answer(server, http, body, completion_prompt(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HTTPRequest):
        return await answer(server, http, body, chat_prompt(body.messages), chat=True)

    return app


def check_model(server, name):
    if name is not None and name != server.name:
        raise BadRequest(404, f"the model `{name}` does not exist: this server serves `{server.name}`",
                         "model", "model_not_found")


async def watch(http: HTTPRequest, worker: Worker, job: Job):
    """A client that hangs up cancels its request at once: its slot, or its place in the queue, is
    freed at the next step. (The body is read: the next message is the disconnect.)"""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    worker.cancel(job)
    job.events.put_nowait(("gone",))


async def answer(server, http: HTTPRequest, body: Body, prompt, chat: bool):
    """Queue the request with the engine, then answer it whole or as server-sent events."""
    t0 = time.perf_counter()
    check_model(server, body.model)
    kw, echo = request_kw(body, server, prompt, chat), bool(getattr(body, "echo", False))
    llm = server.worker.llm
    try:                                     # tokenized here, beside the engine's thread, never in it
        kw["prompt"] = await asyncio.to_thread(llm.encode, prompt)
    except GraftError as e:
        raise BadRequest(400, str(e), "messages" if chat else "prompt") from None
    shown = (prompt if isinstance(prompt, str) else llm.tokenizer.decode(kw["prompt"])) if echo else ""
    job = Job(asyncio.get_running_loop(), kw, body.n, echo, t0)
    if not server.worker.send(job):
        return error(429, f"{server.worker.limit} requests are waiting for a slot (--max-queued-requests): "
                          f"retry later", None, "rate_limit_exceeded")
    watcher = asyncio.create_task(watch(http, server.worker, job))
    try:
        first = await job.events.get()       # accepted, or refused (too long, bad token ids...)
    except asyncio.CancelledError:
        server.worker.cancel(job)
        watcher.cancel()
        raise
    if first[0] != "ok":
        watcher.cancel()
        if first[0] == "gone":
            return error(499, "client closed the request")
        return error(first[1], first[2], "max_tokens" if "exceeds the context" in first[2] else None)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    head = {"id": rid, "created": int(time.time()), "model": server.name}
    reply = Reply(server, job, chat, kw["logprobs"] is not None, shown)
    if body.stream:
        usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(events(server, job, head, reply, usage, watcher), media_type="text/event-stream")
    try:
        ends = {}
        while len(ends) < job.n:
            ev = await job.events.get()
            if ev[0] == "gone":
                return error(499, "client closed the request")
            if ev[0] == "error":
                return error(ev[1], ev[2])
            if ev[0] == "end":
                ends[ev[1]] = ev[2]
    finally:
        watcher.cancel()
    choices = [await asyncio.to_thread(reply.choice, i, ends[i]) for i in range(job.n)]
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": usage_of(list(ends.values()))}


class Reply:
    """One request's choices in OpenAI's shapes, whole (choice) or piece by piece (the streamed events:
    a choice's log-probs follow its pieces, their offsets counted over every token so far)."""

    def __init__(self, server, job: Job, chat: bool, logprobs: bool, shown: str):
        self.texts, self.job, self.chat, self.logprobs, self.shown = server.texts, job, chat, logprobs, shown
        self.ids = [[] for _ in range(job.n)]           # the tokens streamed so far, per choice
        self.sent = [0] * job.n                         # their text's length so far

    def prompt_part(self, entries) -> list:
        """Echo's prompt tokens as log-prob entries: the first has none."""
        ids = self.job.kw["prompt"]
        return [(ids[0],)] + list(entries)

    def choice(self, i: int, c) -> dict:
        """Choice i, whole, from its Completion."""
        if self.chat:
            return {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                    "logprobs": self.texts.chat(c.logprobs) if self.logprobs else None}
        lps = None
        if self.logprobs:
            gen = self.texts.offsets(c.tokens, 0, len(c.tokens), len(self.shown), len(self.shown) + len(c.text))
            if self.shown:
                ids = self.job.kw["prompt"]
                lps = self.texts.completion(self.prompt_part(c.prompt_logprobs) + c.logprobs,
                                            self.texts.offsets(ids, 0, len(ids), 0, len(self.shown)) + gen)
            else:
                lps = self.texts.completion(c.logprobs, gen)
        return {"index": i, "text": self.shown + c.text, "finish_reason": c.finish_reason, "logprobs": lps}

    def piece(self, i: int, text: str, entries: list, prompt: bool = False) -> dict:
        """A streamed piece of choice i: text and the log-probs of the tokens it settled (prompt: echo's)."""
        if self.chat:
            lps = self.texts.chat(entries) if self.logprobs else None
            return {"index": i, "delta": {"content": text}, "finish_reason": None, "logprobs": lps}
        lps = None
        if self.logprobs and prompt:
            ids = self.job.kw["prompt"]
            lps = self.texts.completion(self.prompt_part(entries), self.texts.offsets(ids, 0, len(ids), 0, len(text)))
        elif self.logprobs:
            ids, a = self.ids[i], len(self.ids[i])
            ids += [e[0] for e in entries]
            lps = self.texts.completion(entries, self.texts.offsets(ids, a, len(ids), len(self.shown)))
        return {"index": i, "text": text, "finish_reason": None, "logprobs": lps}


def usage_of(cs: list) -> dict:
    """Real tokens: the prompt once (every choice prefilled it), the tokens each choice returned."""
    done = sum(len(c.tokens) for c in cs)
    return {"prompt_tokens": cs[0].prompt_tokens, "completion_tokens": done, "total_tokens": cs[0].prompt_tokens + done}


async def events(server, job: Job, head: dict, reply: Reply, usage: bool, watcher):
    """The server-sent events of one streamed request: per choice a first chunk (chat: the role; echo:
    the prompt), its pieces, a last one with its finish_reason; then usage if asked. A client that goes
    away cancels it."""
    chat = reply.chat
    kind = "chat.completion.chunk" if chat else "text_completion"
    data = lambda **x: "data: " + json.dumps({**head, "object": kind, **x}) + "\n\n"
    try:
        if chat:
            for i in range(job.n):
                yield data(choices=[{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}])
        ends = {}
        while len(ends) < job.n:
            ev = await job.events.get()
            if ev[0] == "gone":
                break
            if ev[0] == "prompt":
                yield data(choices=[reply.piece(ev[1], reply.shown, ev[2] or [], prompt=True)])
            elif ev[0] == "text":
                yield data(choices=[reply.piece(ev[1], ev[2], ev[3])])
            elif ev[0] == "error":
                yield "data: " + json.dumps({"error": {"message": ev[2], "type": "internal_error", "param": None,
                                                       "code": None}}) + "\n\n"
                break
            else:
                ends[ev[1]] = ev[2]
                end = {"index": ev[1], "finish_reason": ev[2].finish_reason, "logprobs": None}
                yield data(choices=[{**end, "delta": {}} if chat else {**end, "text": ""}])
        if usage and len(ends) == job.n:
            yield data(choices=[], usage=usage_of(list(ends.values())))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        server.worker.cancel(job)           # (a no-op once it ended)


# ----------------------------------------------------------------------------- the command line

def parse_args(argv=None):
    p = ArgumentParser(description="An OpenAI-compatible server over graft (continuous batching).")
    p.add_argument("--ckpt", default=None,
                   help="target: a local HF folder, a .gguf file or a hub id (default: the shipped SmolLM2-135M-Instruct)")
    p.add_argument("--method", default=None, choices=METHODS,
                   help="default: graft when a head is known or given, else ar")
    p.add_argument("--batch", type=int, default=4, help="request slots: requests run together in one target pass")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --ckpt as given)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="past this many requests waiting for a slot, a new one gets a 429 (SGLang's flag; default: no limit)")
    add_engine_flags(p)
    return p.parse_args(argv)


class Server:
    def __init__(self, a, worker):
        self.args, self.worker, self.created = a, worker, int(time.time())
        self.name = a.served_model_name or a.ckpt or "SmolLM2-135M-Instruct"
        self.texts = Texts(worker.llm.tokenizer)


def main(argv=None):
    a = parse_args(argv)
    check_args(a)
    if not 0 < a.port < 65536:
        raise GraftError(f"--port must be in [1, 65535], got {a.port}")
    if a.batch < 1:
        raise GraftError(f"--batch must be >= 1, got {a.batch}")
    if a.max_queued_requests is not None and a.max_queued_requests < 1:
        raise GraftError(f"--max-queued-requests must be >= 1, got {a.max_queued_requests}")
    if tp.world()[1] > 1:      # every rank would need every request, in the same order: not built yet
        raise GraftError("serve.py does not run under torchrun (tensor parallelism) yet: run generate.py or bench.py there")
    err = lambda s: print(s, file=sys.stderr, flush=True)
    sock = listen(a.host, a.port)            # first: a busy port or a bad host fails before minutes of loading
    # a method's warm-up not cached yet runs between requests while plain decoding serves (api.Calibrating)
    worker = Worker(lambda: api.open_llm(a.ckpt, a, a.method, a.batch, err, background=True), a.max_queued_requests)
    worker.ready.wait()
    if worker.error is not None:
        sock.close()
        raise worker.error
    llm = worker.llm
    server = Server(a, worker)
    later = f"; {llm.background.method} once it has calibrated between requests" if llm.background else ""
    err(f"serving {server.name} ({llm.method}{later}, {llm.engine.B} slots, {str(llm.engine.dtype)[6:]}, "
        f"{llm.max_seq_len} tokens of context) on http://{a.host}:{a.port}/v1")
    uvicorn.Server(uvicorn.Config(make_app(server), log_level="warning")).run(sockets=[sock])


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening (connections wait in its backlog until uvicorn serves).
    Errors: GraftError, one line, for a host that is not this machine's or a port in use."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(2048)
    except OSError as e:
        raise GraftError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


if __name__ == "__main__":
    run(main)
