"""An OpenAI-compatible HTTP server over the one engine, with continuous batching.

    python serve.py --ckpt CKPT [--draft HEAD] [--method M] [--batch B] [--host H] --port PORT

Endpoints: GET /v1/models, POST /v1/completions and /v1/chat/completions (the chat template applied),
streamed (server-sent events) or not, with temperature, top_p, top_k, max_tokens, seed, stop (and
stream_options.include_usage). Requests join the free slots of the running batch between rounds and
leave when done; a client that disconnects frees its slot. A bad request gets a 4xx JSON error in
OpenAI's shape and the server goes on. A field a request leaves out takes the server's flag
(--temperature, --top-p, --top-k, --seed, --max-new-tokens: greedy, 128 tokens by default), so an
answer is exactly what `python generate.py` gives with the same values. Fields graft does not
implement (logprobs, n > 1, penalties, logit_bias, tools, ...) are refused, never ignored.

One thread owns the engine (api.LLM: load, warm-up, every step); the HTTP side (FastAPI on uvicorn,
the stack vLLM and SGLang serve with) talks to it through an inbox and a queue per request.
"""
import asyncio
import json
import socket
import sys
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

import api
from cli import ArgumentParser, add_engine_flags, check_args, check_sampling, run
from engine import METHODS
from model import GraftError
import tp

SERVER_NAMES = ("temperature", "top_p", "top_k", "seed", "max_tokens")
MAX_STOPS = 16


# ----------------------------------------------------------------------------- the engine's thread

class Job:
    """One HTTP request's way to the engine: what to submit, and a queue of events back to the
    event loop: ("ok",), ("text", piece), ("end", Completion), ("error", status, message)."""

    def __init__(self, loop, kw: dict):
        self.loop, self.kw, self.events = loop, kw, asyncio.Queue()
        self.seq, self.cancelled = None, False

    def put(self, *event):
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Worker:
    """The thread that loads the model and then steps it: waiting jobs are submitted between steps,
    each live one gets its new text after every step, cancelled ones are dropped."""

    def __init__(self, load):
        self.load, self.llm, self.error = load, None, None
        self.inbox, self.jobs, self.cond = [], [], threading.Condition()
        self.ended = {}                      # requests ended, by finish_reason ("stop", "length", "cancelled", "error")
        self.ready = threading.Event()
        threading.Thread(target=self.main, daemon=True, name="graft-engine").start()

    def send(self, job: Job):
        with self.cond:
            self.inbox.append(job)
            self.cond.notify()

    def cancel(self, job: Job):
        job.cancelled = True
        if job.seq is not None:
            job.seq.cancel()
        with self.cond:
            self.cond.notify()

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
            with self.cond:
                while not self.inbox and not llm.busy():
                    self.cond.wait()
                todo, self.inbox = self.inbox, []
            for job in todo:                 # 1. new requests join the batch
                if job.cancelled:
                    continue
                try:
                    job.seq = llm.submit(**job.kw)
                except GraftError as e:
                    job.put("error", 400, str(e))
                    continue
                job.put("ok")
                self.jobs.append(job)
            for job in self.jobs:            # 2. the cancelled leave it
                if job.cancelled:
                    job.seq.cancel()
            try:                             # 3. one round for every slot
                if llm.busy():
                    llm.step()
            except Exception as e:           # the batch's pass failed: its requests end with the reason
                llm.abort()
                self.ended["error"] = self.ended.get("error", 0) + len(self.jobs)
                for job in self.jobs:
                    job.put("error", 500, f"the engine failed on this batch: {str(e).splitlines()[0][:300]}")
                self.jobs = []
                continue
            for job in self.jobs:            # 4. what each request got
                piece = job.seq.pull()
                if piece:
                    job.put("text", piece)
                if job.seq.done:
                    job.put("end", job.seq.completion())
                    self.ended[job.seq.reason] = self.ended.get(job.seq.reason, 0) + 1
            self.jobs = [j for j in self.jobs if not j.seq.done]


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
    # what graft does not do: accepted at their neutral values only
    logprobs: StrictBool | StrictInt | None = None
    top_logprobs: StrictInt | None = None
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


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        self.status, self.message, self.param, self.code = status, message, param, code


def error(status: int, message: str, param=None, code=None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def request_kw(b: Body, server, prompt) -> dict:
    """api.LLM.submit's keywords for a request body; BadRequest for what graft does not do."""
    a = server.args
    unsupported = [(b.n != 1, "n", "n > 1 is not supported: send n requests"),
                   (bool(b.logprobs) or b.top_logprobs is not None, "logprobs", "logprobs are not supported"),
                   (bool(b.presence_penalty) or bool(b.frequency_penalty), "presence_penalty",
                    "presence and frequency penalties are not supported (they change the distribution)"),
                   (bool(b.logit_bias), "logit_bias", "logit_bias is not supported"),
                   (b.response_format not in (None, {"type": "text"}), "response_format",
                    "response_format other than text is not supported"),
                   (bool(b.tools) or b.tool_choice not in (None, "none"), "tools", "tools are not supported"),
                   (bool(getattr(b, "echo", False)), "echo", "echo is not supported"),
                   (getattr(b, "suffix", None) is not None, "suffix", "suffix is not supported"),
                   (getattr(b, "best_of", None) not in (None, 1), "best_of", "best_of > 1 is not supported")]
    for bad, param, msg in unsupported:
        if bad:
            raise BadRequest(400, msg, param)
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
    names = SERVER_NAMES if b.max_tokens is not None or b.max_completion_tokens is not None else \
        SERVER_NAMES[:4] + ("max_tokens (not given: the server's --max-new-tokens)",)
    return dict(kw, prompt=prompt, stop=stop, names=names)


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


def chat_prompt(b: ChatBody) -> list:
    out = []
    for m in b.messages:
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
                                             "owned_by": "graft"}]}

    @app.get("/health")
    async def health():
        """Liveness, and what the engine holds: busy slots, waiting requests, ended ones by reason."""
        w = server.worker
        return {"slots": w.llm.engine.B, "busy": sum(r is not None for r in w.llm.engine.requests()),
                "waiting": len(w.llm.scheduler.waiting) + len(w.inbox), "ended": dict(w.ended)}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        return await answer(server, http, body, completion_prompt(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HTTPRequest):
        return await answer(server, http, body, chat_prompt(body), chat=True)

    return app


async def answer(server, http: HTTPRequest, body: Body, prompt, chat: bool):
    """Queue the request with the engine, then answer it whole or as server-sent events."""
    if body.model != server.name:
        raise BadRequest(404, f"the model `{body.model}` does not exist: this server serves `{server.name}`",
                         "model", "model_not_found")
    kw = request_kw(body, server, prompt)
    try:                                     # tokenized here, beside the engine's thread, never in it
        kw["prompt"] = await asyncio.to_thread(server.worker.llm.encode, prompt)
    except GraftError as e:
        raise BadRequest(400, str(e), "messages" if chat else "prompt") from None
    job = Job(asyncio.get_running_loop(), kw)
    server.worker.send(job)
    try:
        first = await job.events.get()       # accepted, or refused (too long, bad token ids...)
    except asyncio.CancelledError:
        server.worker.cancel(job)
        raise
    if first[0] == "error":
        return error(first[1], first[2], "max_tokens" if "exceeds the context" in first[2] else None)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    head = {"id": rid, "created": int(time.time()), "model": server.name}
    if body.stream:
        usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(events(server, job, head, chat, usage), media_type="text/event-stream")
    text, checked = [], time.perf_counter()
    while True:                              # a client gone while it waits frees the slot
        try:
            ev = await asyncio.wait_for(job.events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            ev = None
        if time.perf_counter() - checked >= 0.5:     # at most twice a second, events or not
            checked = time.perf_counter()
            if await http.is_disconnected():
                server.worker.cancel(job)
                return error(499, "client closed the request")
        if ev is None:
            continue
        if ev[0] == "text":
            text.append(ev[1])
        elif ev[0] == "error":
            return error(ev[1], ev[2])
        else:
            c = ev[1]
            break
    choice = ({"index": 0, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
              if chat else {"index": 0, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None})
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
            "usage": usage_of(c)}


def usage_of(c) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.tokens),
            "total_tokens": c.prompt_tokens + len(c.tokens)}


async def events(server, job: Job, head: dict, chat: bool, usage: bool):
    """The server-sent events of one streamed request; a client that goes away cancels it."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece=None, reason=None, role=False, **more):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": piece} if piece is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
        return "data: " + json.dumps({**head, "object": kind, "choices": [choice], **more}) + "\n\n"

    try:
        if chat:
            yield chunk(role=True)
        while True:
            ev = await job.events.get()
            if ev[0] == "text":
                yield chunk(ev[1])
            elif ev[0] == "error":
                yield "data: " + json.dumps({"error": {"message": ev[2], "type": "internal_error", "param": None,
                                                       "code": None}}) + "\n\n"
                break
            else:
                c = ev[1]
                yield chunk(reason=c.finish_reason)
                if usage:
                    yield "data: " + json.dumps({**head, "object": kind, "choices": [], "usage": usage_of(c)}) + "\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
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
    add_engine_flags(p)
    return p.parse_args(argv)


class Server:
    def __init__(self, a, worker):
        self.args, self.worker, self.created = a, worker, int(time.time())
        self.name = a.served_model_name or a.ckpt or "SmolLM2-135M-Instruct"


def main(argv=None):
    a = parse_args(argv)
    check_args(a)
    if not 0 < a.port < 65536:
        raise GraftError(f"--port must be in [1, 65535], got {a.port}")
    if a.batch < 1:
        raise GraftError(f"--batch must be >= 1, got {a.batch}")
    if tp.world()[1] > 1:      # every rank would need every request, in the same order: not built yet
        raise GraftError("serve.py does not run under torchrun (tensor parallelism) yet: run generate.py or bench.py there")
    err = lambda s: print(s, file=sys.stderr, flush=True)
    sock = listen(a.host, a.port)            # first: a busy port or a bad host fails before minutes of loading
    worker = Worker(lambda: api.open_llm(a.ckpt, a, a.method, a.batch, err))
    worker.ready.wait()
    if worker.error is not None:
        sock.close()
        raise worker.error
    llm = worker.llm
    server = Server(a, worker)
    err(f"serving {server.name} ({llm.method}, {llm.engine.B} slots, {str(llm.engine.dtype)[6:]}, "
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
