"""The engine: B request slots over one target (and head), its compiled steps, and the decoding loop.

A single request is a batch of one (nano-vllm, SGLang): every step carries a leading batch dimension,
and `generate` is `run` with one prompt. gpt-fast's shape: the steps are flat functions (verify.verify,
verify.decode, prefill_chunk, the drafter's extend and level, graft.assemble and graft.learn), bound
and compiled in one visible place (Engine.__init__); a round of any method is a few static-shaped
steps with one host sync (graft.Method.round). "The engine knows nothing about tokenization"
(nanochat): it takes and returns token ids. The methods, what each needs, and the round are graft.py's;
loading a checkpoint is the faces' business (cli.build_engine); calibration is calibrate.py's.

What a slot holds: the request (its prompt, sampling and counts) and, on the host, the mirrors of its
device state (`Slot`: committed rows L, head rows Ld, pending path length), kept in step by the
engine alone (Engine.seat, Engine.admit, Engine.step). On the device, with a leading B: the KV caches, L, the next
roots, which slots are active, and each request's sampling parameters (SlotSampling). An empty slot
still runs through the static-shaped steps: its tree is all padding (zeros written, never accepted, L
stays 0), so it influences no other row.
"""
import dataclasses
import math
import statistics
import time
import types
from collections import deque
from dataclasses import dataclass, field

import torch

from dflash import BlockDrafter
from draft import Drafter
from graft import (METHODS, PLAIN_RUN, SOURCES, Calibration, Config, ContinuationMatrix, Method, Round, assemble,
                   block_tree, learn, plain_learn, recycle_tree)
from model import GraftError, KVCache, attention_mask, cache_rows, rope_table, set_exact
from verify import (NOT_FINITE, Clock, Sampling, SlotSampling, Tree, Verified, choose, commit, decode, logprobs,
                    path_logprobs, rows_finite, sampling_mode, token_hash, unpack_logprobs, verify)


# The verification budget. On a GPU a 61-node tree costs about what one token does (the paper's 60);
# on a CPU verification cost grows with the nodes, and the budget sweep in the README found this best.
GPU_BUDGET, CPU_BUDGET = 60, 16

# The KV cache length when --max-seq-len is not given: the model's context, capped. A GPU step reads
# the whole cache (static shapes), so a 128K-context model would pay for 128K rows every token.
DEFAULT_MAX_SEQ_LEN = 4096

# Prefill chunk: a prompt of any length runs as chunks of this many tokens (the last one padded), so
# a few graphs serve every length and memory grows with the context, not with its square.
PREFILL_CHUNK = 128


def default_budget(device) -> int:
    return GPU_BUDGET if str(device).startswith("cuda") else CPU_BUDGET


# ----------------------------------------------------------------------------- the target's prefill step

def prefill_chunk(model, cache, tokens: torch.Tensor, L: torch.Tensor, n: torch.Tensor, slot: torch.Tensor,
                  cols: torch.Tensor, capture: bool, smp: SlotSampling, mode: tuple, root: torch.Tensor,
                  every: bool = False) -> tuple:
    """C prompt tokens (1, C) of the request in slot `slot` (1,) (the first n real, the rest padding) at
    its rows L[slot]..L[slot]+C-1, causal among themselves and over its committed rows; its L advances by
    n, root[slot] receives the target's choice after the last real token (the first generated token, once
    the last chunk has run). Returns the last real row's logits (1, 1, V) (every: all rows', (1, C, V), for
    the prompt's log-probs; nothing else reads them, and the lm_head is a fifth of SmolLM2's prefill),
    features (1, C, 3*dim) or None, and whether those logits were finite (1,) (a non-finite row earlier
    reaches the last through attention). Several requests' chunks at once (Engine.admit_group): tokens
    (B', C), slot and n (B'), and every result has B' rows."""
    C, dev = tokens.shape[1], tokens.device
    Ls = L.index_select(0, slot)                                                   # (1,)
    rows = Ls[:, None] + torch.arange(C, device=dev)                               # (1, C)
    mask = attention_mask(torch.ones(C, C, dtype=torch.bool, device=dev).tril_(), Ls, cols)
    keep = torch.arange(C, device=dev)[None] < n.view(-1, 1)
    out = model(tokens, rows, rows, mask, capture, cache, keep=keep, slots=slot, last=None if every else n - 1)
    logits, feats = out if capture else (out, None)
    last = logits.gather(1, (n - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])) if every else logits  # (B', 1, V)
    root.index_copy_(0, slot, choose(last, (Ls + n)[:, None], smp.rows(slot), mode)[:, 0])
    L.index_add_(0, slot, n.view(-1))
    return logits, feats, rows_finite(logits, keep if every else None)


# ----------------------------------------------------------------------------- the engine
#
# The CUDA-graph contract (torch.compile mode="reduce-overhead", cudagraph trees), which every step
# below follows on any device and the CPU suite checks (tests/test_gpu_contract.py):
#   1. An output of a compiled step lives until the next generation begins (Steps.mark: before every
#      round and every prefill chunk) or until the same step runs again. What must outlive it is
#      written into a static buffer inside the step (the next roots: Engine.root, written by verify,
#      decode and prefill) or cloned (the prompt's last feature, the warm-up's confidences).
#      Checked by check_lifetimes=True: every output is poisoned (NaN, an out-of-range id) as soon as
#      it expires, and every method must stay lossless.
#   2. Every tensor a step reads that lives across rounds (caches, round state, RoPE tables, column
#      indices, the token hash, templates, a method's buffers) is allocated once and declared with
#      Steps.static; on a GPU
#      that marks its address static, so a replay reads it in place instead of copying it in.
#   3. Nothing in a step syncs with the host; a round makes one transfer (verify.commit) plus one per
#      checkpoint reached, and host values reach the device by fills of static buffers, not copies.
#   4. A cache row a query may not see is zero or was written by a real node whose logits were checked:
#      padding rows and empty slots write zeros, caches start zeroed, admission zeroes a slot's written rows.
#   5. Each step has its own code object, so its graphs live in a dynamo cache of their own (Steps.compile),
#      and the verify step takes the tree size as a dynamic dimension: one compile serves every budget.
#      Requests coming and going change data only (lengths, seeds, which slots are active): no recompile.


def own_code(fn, name: str, codes: dict, bound: tuple = ()):
    """fn, its first arguments `bound`, with a code object of its own for the step `name`. Dynamo keeps
    compiled graphs per code object: steps made of one function (bound to two engines' models, or a
    closure over any arguments) would share one cache, whose entries pile up across steps and engines
    until dynamo stops compiling (it then fails: fail_on_recompile_limit_hit). `codes` (one per engine)
    keeps one code object per (function, step), so two methods' calls of a step share their graphs."""
    if bound:                            # (torch.compile wraps every partial in one shared function)
        inner = own_code(fn, name, codes)
        fn = lambda *more, **kw: inner(*bound, *more, **kw)        # noqa: E731
    key = (fn.__code__, name)
    if key not in codes:
        codes[key] = fn.__code__.replace(co_name=f"{fn.__code__.co_name}__{name}")
    f = types.FunctionType(codes[key], fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    f.__kwdefaults__, f.__qualname__, f.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return f


def tensors_in(x) -> list:
    """Every tensor in a step's output or arguments: tuples, lists, dicts and dataclasses (Tree, Verified)."""
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in tensors_in(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensors_in(v)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [t for f in dataclasses.fields(x) for t in tensors_in(getattr(x, f.name))]
    return []


def poison(t: torch.Tensor):
    """Overwrite an expired output as a CUDA graph's next replay would: floats NaN, integers an id no
    vocabulary or index has, booleans flipped."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.fill_(torch.iinfo(t.dtype).max)


class OutputLifetimes:
    """Test mode of contract rule 1 on any device: each step's outputs are poisoned when the next
    generation begins and when the step runs again. Outputs that share storage with an argument or a
    static buffer are state, not outputs, and are left alone."""

    def __init__(self, steps: "Steps"):
        self.steps, self.live = steps, {}

    def wrap(self, step, name: str):
        def run(*args, **kwargs):
            self.expire(name)
            out = step(*args, **kwargs)
            keep = {t.untyped_storage().data_ptr() for t in tensors_in((args, kwargs)) + self.steps.statics}
            self.live[name] = [t for t in tensors_in(out) if t.untyped_storage().data_ptr() not in keep]
            return out
        return run

    def expire(self, name: str):
        for t in self.live.pop(name, []):
            poison(t)

    def new_generation(self):
        for name in list(self.live):
            self.expire(name)




class Steps:
    """The compiled steps, a table of their own: how they run (eager, or compiled: inductor on a CPU,
    CUDA graphs through torch.compile's reduce-overhead mode on a GPU), the tensors they read across
    rounds (statics, contract rule 2), and the generation marks (rule 1). Engine.__init__ fills it.
    check_lifetimes: poison every step output when it expires (OutputLifetimes; tests)."""

    def __init__(self, device, compiling: bool, backend: str = "inductor", check_lifetimes: bool = False):
        self.cuda = torch.device(device).type == "cuda"
        self.compiling, self.backend = compiling, backend
        self.statics, self.names, self._codes = [], set(), {}
        self.lifetimes = OutputLifetimes(self) if check_lifetimes else None
        self.compile_seconds = 0.0
        self.before = None                     # called by mark(): the engine puts its model in its mode
        if compiling:      # one graph per (step, shape): a run has a few dozen, each compiled once
            torch._dynamo.config.cache_size_limit = 64
            torch._dynamo.config.accumulated_cache_size_limit = 512
            if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
                torch._dynamo.config.fail_on_recompile_limit_hit = True     # never fall back to eager silently

    def compile(self, fn, name: str, *bound):
        """fn (with its first arguments `bound`) as it runs: itself, or compiled, with a code object of
        its own (own_code). One graph per static shape and setting (sampling mode, method); the tree
        size of verify and the window of every step are dynamic."""
        fn = own_code(fn, name, self._codes, bound)
        self.names.add(name)
        if not self.compiling:
            step = fn
        elif self.backend != "inductor":       # tests: "aot_eager" traces and functionalises, no codegen
            step = torch.compile(fn, fullgraph=True, backend=self.backend)
        elif self.cuda:
            step = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
        else:
            step = torch.compile(fn, fullgraph=True, **CPU_COMPILE)
        return self.lifetimes.wrap(step, name) if self.lifetimes else step

    def static(self, *tensors):
        """Tensors that live across rounds at a fixed address (caches, state buffers, tables): CUDA
        graphs read and write them in place instead of copying them in on every replay."""
        for t in tensors:
            if not any(t is s for s in self.statics):
                self.statics.append(t)
                if self.compiling and self.cuda:
                    torch._dynamo.mark_static_address(t)

    def mark(self):
        """A new generation of step outputs begins (before every round and every prefill chunk): CUDA
        graph trees may now reuse the memory of the previous generation's outputs."""
        if self.before:
            self.before()
        if self.compiling and self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        if self.lifetimes:
            self.lifetimes.new_generation()


# torch.compile settings on a CPU (inductor's defaults: graphs go to the FX graph cache, so a second
# run starts fast). Measured against max-autotune with freezing in the README.
CPU_COMPILE = {}


# ----------------------------------------------------------------------------- requests and slots

@dataclass
class Request:
    """One prompt's generation. Its counts are of the tokens it returned (a round cut at EOS or
    max_new_tokens counts what it kept: Spec-Bench's MAT)."""
    ids: list
    sampling: Sampling = Sampling()
    index: int = 0
    tokens: list = field(default_factory=list)
    rounds: int = 0
    committed: int = 0                   # tokens returned by decode rounds (bonus included)
    accepted: int = 0                    # accepted candidate tokens (bonus excluded)
    from_retrieval: int = 0              # accepted tokens that were retrieved nodes
    from_source: dict = field(default_factory=dict)   # those, per retrieval source (graft.SOURCES)
    draft_forwards: int = 0
    verified: int = 0                    # real candidate nodes verified (root and padding excluded)
    padded: int = 0                      # candidate slots the passes ran at (N - 1, padding included)
    syncs: int = 0                       # host syncs in its decode rounds
    plain: int = 0                       # rounds in which it drafted nothing: plain steps (Pacer)
    stages: dict = field(default_factory=dict)
    admitted_s: float = 0.0              # seconds after the run's start: prefill began
    first_s: float = 0.0                 # first token
    finished_s: float = 0.0              # last token: its latency (every prompt arrives at the start)
    seconds: float = 0.0                 # generate(): the whole generation, prefill included
    times: dict = field(default_factory=dict)   # generate(): seconds per phase (prefill, draft, assemble, verify, update)
    max_new_tokens: int | None = None    # its own limit (a server's request); None: the run's
    cancelled: bool = False              # set from outside (a client gone, a stop string): freed next step
    done: bool = False                   # it ended (EOS, its limit, cancelled): no slot holds it
    logprobs: int | None = None          # asked for: each token's log-probability and the top `logprobs` (None: off)
    prompt_logprobs: bool = False        # the prompt's tokens' too (a server's echo)
    logprob_rows: list = field(default_factory=list)    # per token of `tokens`: (log-prob, [(id, log-prob), ...])
    prompt_logprob_rows: list = field(default_factory=list)   # per prompt token after the first, the same

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    @property
    def mat(self) -> float:
        return self.committed / max(self.rounds, 1)

    @property
    def mat_drafting(self) -> float:
        """Tokens a round that drafted committed (its plain rounds left out: what the drafting achieves)."""
        return (self.committed - self.plain) / max(self.rounds - self.plain, 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.seconds, 1e-9)

    def stats(self) -> dict:
        r = max(self.rounds, 1)
        return {"mat": round(self.mat, 4), "mat_drafting": round(self.mat_drafting, 4), "rounds": self.rounds,
                "draft_forwards": self.draft_forwards,
                "draft_forwards_per_round": round(self.draft_forwards / r, 4),
                "verified_per_round": round(self.verified / r, 4), "padded_per_round": round(self.padded / r, 4),
                "retrieval_share": round(self.from_retrieval / max(self.accepted, 1), 4),
                "retrieval_shares": {s: round(self.from_source.get(s, 0) / max(self.accepted, 1), 4) for s in SOURCES},
                "syncs_per_round": round(self.syncs / r, 4), "plain_share": round(self.plain / r, 4),
                "round_ms": {k: round(v / r * 1000, 4) for k, v in self.times.items() if k != "prefill"},
                "prefill_ms": round(self.times.get("prefill", 0.0) * 1000, 3),
                "stages": {str(k): v for k, v in sorted(self.stages.items(), key=lambda kv: str(kv[0]))}}


Result = Request          # what generate() returns: the one request, timed


@dataclass
class Slot:
    """A slot's request and the host's mirrors of its device state, kept in step by the engine alone,
    and its pacing (Pacer): the tokens its drafting rounds commit (an average), the plain rounds left."""
    request: Request | None = None
    L: int = 0               # committed rows of the target's cache (Engine.L[b])
    Ld: int = 0              # committed rows of the head's cache (Drafter.Ld[b])
    pend: int = 0            # rows the head's next extend reads (the method's pend_n[b])
    mat: float | None = None  # tokens a drafting round of this request commits (an exponential average)
    plain: int = 0           # plain rounds left before it drafts again
    backoff: int = 0         # the next plain run's length (Pacer.MIN_RUN, doubling to Pacer.cap while none pays)
    idle: bool = False       # its last round was a plain step: its next drafting round catches up the head
    length: int | None = None  # the nodes of its proposal it drafts (Pacer.cut; None: all)


@dataclass
class Run:
    """What run() returns: every request in input order, and the run's totals."""
    requests: list
    seconds: float
    rounds: int                        # batched rounds (one target pass each)
    draft_forwards: int                # head forwards over the batch, all rounds
    prefill_seconds: float = 0.0
    cpu_seconds: float = 0.0           # this process's CPU time over the run (time.process_time): on one
                                       # thread, what the wall time would be on a core of its own

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    def stats(self) -> dict:
        lat = sorted(r.finished_s for r in self.requests)
        p90 = lat[min(len(lat) - 1, math.ceil(0.9 * len(lat)) - 1)] if lat else 0.0
        rr = sum(r.rounds for r in self.requests)
        return {"requests": len(self.requests), "tokens": self.tokens, "seconds": round(self.seconds, 4),
                "tokens_per_s": round(self.tokens / max(self.seconds, 1e-9), 3),
                "tokens_per_cpu_s": round(self.tokens / max(self.cpu_seconds, 1e-9), 3),
                "latency_median_s": round(statistics.median(lat), 4) if lat else 0.0, "latency_p90_s": round(p90, 4),
                "mat": round(sum(r.committed for r in self.requests) / max(rr, 1), 4),
                "mat_drafting": round(sum(r.committed - r.plain for r in self.requests) /
                                      max(rr - sum(r.plain for r in self.requests), 1), 4),
                "plain_share": round(sum(r.plain for r in self.requests) / max(rr, 1), 4),
                "rounds": self.rounds, "draft_forwards_per_round": round(self.draft_forwards / max(self.rounds, 1), 4),
                "prefill_s": round(self.prefill_seconds, 4)}


# ----------------------------------------------------------------------------- the engine

class Engine:
    """B request slots over a target with its tokenizer, optional head and continuation matrix (the
    prior every request starts from), and how the steps run: eager or compiled, with attention over a
    window of the cache that grows with the context (`window`, a CPU's fastest) or over the whole
    cache (static shapes, what CUDA graphs need). Caches are allocated once, here, for trees of up to
    `nodes` nodes and paths of `path` rows (cli.room). check_lifetimes: poison every step output when
    it expires (tests). dflash: a DFlash drafter (dflash.DFlash) for the block methods, dflash_cols its
    features' columns in what the target captures (dflash.share_features)."""

    def __init__(self, model, tokenizer, head, matrix: ContinuationMatrix, batch: int = 1, nodes: int = 1,
                 path: int = 1, top_k: int = 10, depth: int = 8, compile: bool = False, window: bool = True,
                 chunk: int = PREFILL_CHUNK, backend: str = "inductor", check_lifetimes: bool = False,
                 exact: bool = False, dflash=None, dflash_cols=None):
        if batch < 1:
            raise GraftError(f"--batch must be >= 1, got {batch}")
        p = model.embed_tokens.weight
        self.model, self.tokenizer, self.matrix, self.B = model, tokenizer, matrix, batch
        self.window, self.chunk, self.room = window, chunk, (nodes, path)
        self.steps = Steps(p.device, compile, backend, check_lifetimes)
        self.agree = lambda x: x        # rank 0's x on every rank when sharded (cli: tp.same): the pacer's clock
        # exact: every step in model.py's exact mode (a node's logits are plain decoding's, bit for bit, in
        # every dtype); set before every step, since engines in one process may share the model
        self.exact = exact
        self.steps.before = lambda: model.exact == exact or set_exact(model, exact)
        a, S = model.args, model.max_seq_len
        rows = cache_rows(S + max(nodes, path, chunk, 64))        # committed rows, then a round's scratch
        if model.rope is None or model.rope.shape[0] < rows:
            model.rope = rope_table(a, rows).to(p.device)
        self.cache = KVCache(a.n_layers, batch, a.n_kv_heads, rows, a.head_dim, p.dtype, p.device)
        self.drafter = Drafter(head, batch, S, top_k, depth, path, chunk) if head is not None else None
        # a DFlash block drafter (dflash_cols: its features' columns in what the target captures)
        self.block = BlockDrafter(dflash, batch, rows, dflash_cols) if dflash is not None else None
        self.slots = [Slot() for _ in range(batch)]
        self.caches = [(c, c.rows - S) for c in [self.cache] + [x.cache for x in (self.drafter, self.block) if x]]
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=p.device)
        self.L, self.root, self.active = z(batch), z(batch), z(batch)   # committed rows, next roots, live slots
        # which slots draft this round (Pacer.plan; the others keep their roots alone), filled by the host
        self.grow = torch.ones(batch, dtype=torch.bool, device=p.device)
        self.grow_host = torch.ones(batch, dtype=torch.bool)
        self.drafts = [True] * batch            # the same, as the host reads it
        self.smp, self.mode = SlotSampling(batch, p.device), sampling_mode([])
        self.clock = Clock(p.device)
        # what the host fills (never copies) before a step: prefill's real length and slot, the level
        # index of each draft level, and the rows a step may read (cols)
        self.fills = types.SimpleNamespace(n=z(()), slot=z(1), level=[torch.full((), i, dtype=torch.long, device=p.device)
                                                                       for i in range(depth)],
                                           cols=torch.arange(rows, device=p.device),
                                           head_cols=torch.arange(self.drafter.cache.rows, device=p.device) if head else None)
        self.steps.static(*self.cache.tensors(), self.cache.bi, self.cache.hi, model.rope, self.L, self.root, self.active, self.grow,
                          *self.smp.tensors(),
                          self.fills.n, self.fills.slot, *self.fills.level, self.fills.cols,
                          token_hash(a.vocab_size, p.device),  # sampling's table: read, never built, in a graph
                          *([self.fills.head_cols, *self.drafter.buffers()] if head is not None else []),
                          *(self.block.buffers() if dflash is not None else []))
        # The steps of a round, bound and compiled here and nowhere else (gpt-fast's one visible block):
        # the target's three passes, the head's three, and the methods' own.
        s, d = self.steps, self.drafter
        s.prefill = s.compile(prefill_chunk, "prefill", model, self.cache)      # a prompt chunk into one slot
        s.decode = s.compile(decode, "decode", model, self.cache)               # ar: one token per request
        s.verify = s.compile(verify, "verify", model, self.cache)               # every tree, one pass
        if d is not None:
            s.head_prefill = s.compile(Drafter.prefill, "head_prefill", d)      # the head's rows of a prompt
            s.extend = s.compile(Drafter.extend, "extend", d)                   # accepted paths + level 1
            s.level = s.compile(Drafter.level, "level", d)                      # one more level
            s.assemble = s.compile(assemble, "assemble", d)                    # keep, retrieve, graft
        if self.block is not None:
            s.block_prefill = s.compile(BlockDrafter.prefill, "block_prefill", self.block)   # a prompt's context
            s.block_draft = s.compile(BlockDrafter.draft, "block_draft", self.block)         # a block per request
            s.block_context = s.compile(BlockDrafter.context, "block_context", self.block)   # a plain run's rows
            s.block_tree = s.compile(block_tree, "block_tree", self.block)                   # chain, or cut + retrieval
        s.recycle_tree = s.compile(recycle_tree, "recycle_tree")                # Token Recycling's tree
        s.learn = s.compile(learn, "learn")                                     # matrices, the head's next input
        s.plain_learn = s.compile(plain_learn, "plain_learn")                   # the same after a plain round

    @property
    def device(self):
        return self.L.device

    @property
    def dtype(self):
        return self.model.embed_tokens.weight.dtype

    @property
    def cuda(self) -> bool:
        return self.steps.cuda

    @property
    def compiling(self) -> bool:
        return self.steps.compiling

    def requests(self) -> list:
        return [s.request for s in self.slots]

    def cols(self, n: int, head: bool = False, b: int | None = None) -> torch.Tensor:
        """The cache rows a step reads: 0..(the committed rows of slot b, default the longest slot's,
        + n)-1 (window: a size that varies, compiled once as a dynamic dimension), or all of them
        (static). head: the head's cache."""
        full = self.fills.head_cols if head else self.fills.cols
        if not self.window:
            return full
        c = full[:max(s.Ld if head else s.L for s in (self.slots if b is None else [self.slots[b]])) + n]
        if self.compiling:
            torch._dynamo.mark_dynamic(c, 0)
        return c

    def slot_index(self, b: int) -> torch.Tensor:
        self.fills.slot.fill_(b)
        return self.fills.slot

    def variant(self, compile: bool, window: bool | None = None, exact: bool | None = None) -> "Engine":
        """Another engine on the same model, head, tokenizer and matrix (compiled beside eager, exact
        beside not, for a comparison in one process)."""
        d = self.drafter
        window = (not (compile and self.cuda)) if window is None else window
        out = Engine(self.model, self.tokenizer, d.head if d else None, self.matrix, self.B, *self.room,
                     *((d.top_k, d.depth) if d else (10, 8)), compile, window, self.chunk, self.steps.backend,
                     self.steps.lifetimes is not None, self.exact if exact is None else exact, *self.dflash_args())
        out.agree = self.agree
        return out

    def dflash_args(self) -> tuple:
        """(the DFlash drafter, its feature columns) for another engine on this one's model."""
        b = self.block
        return (b.model, b.cols.tolist()) if b is not None else (None, None)

    def make(self, name: str, cfg: Config | None = None, cal: Calibration | None = None,
             matrix: ContinuationMatrix | None = None) -> Method:
        """The method `name` (graft.METHODS) on this engine, with what the warm-up calibrated (cal) and
        its own continuation matrix (default: the engine's, shared). Errors: GraftError for an unknown
        name, a method that needs a head the engine lacks, or a tree larger than the caches' room."""
        if name not in METHODS:
            raise GraftError(f"unknown method {name!r}: choose from {', '.join(METHODS)}")
        cls = METHODS[name]
        if cls.needs_head and self.drafter is None:
            raise GraftError(f"--method {name} needs an EAGLE-3 head: pass --draft DIR_OR_HUB_ID")
        if cls.needs_block and self.block is None:
            raise GraftError(f"--method {name} needs a DFlash drafter: pass --dflash DIR_OR_HUB_ID")
        m = cls(self, cfg or Config(), cal, matrix)
        if m.N > self.room[0] or m.P > self.room[1]:
            raise GraftError(f"--method {name}: its tree ({m.N} nodes, paths of {m.P}) does not fit the room this "
                             f"engine was built with ({self.room[0]}, {self.room[1]}): build it with cli.room()")
        m.name = name
        pace = m.cfg.pace if m.cfg.pace is not None else PACE
        m.pacer = Pacer() if cls.paced and pace else None
        self.steps.static(*m.tensors())
        return m

    # -- a request's life in a slot
    def admit(self, b: int, r: Request, method: Method) -> int:
        """Prefill request r into slot b, chunk by chunk (the last one padded); each chunk's logits (its
        last row's, prefill_chunk) and features go to the method (its head reads them). Returns the first
        token (one host sync), which is also in self.root[b]."""
        self.enter(b, r, method)
        slot, C = self.slots[b], self.chunk
        t = torch.tensor(r.ids, dtype=torch.long, device=self.device)       # the prompt's one copy to the device
        finite = torch.ones(1, dtype=torch.bool, device=self.device)
        mode, every = sampling_mode([r.sampling]), r.logprobs is not None and r.prompt_logprobs   # every row's logits?
        lps = []                                  # log-probs asked for, taken before the next chunk's pass
        for s in range(0, len(r.ids), C):
            n = min(C, len(r.ids) - s)
            self.steps.mark()                      # each chunk is a generation of its own (the step replays)
            # compiled, every chunk has C rows (one graph); eager, a short one is padded to 16 rows, not C
            pad = C if self.steps.compiling else min(C, cache_rows(n))
            chunk = torch.cat([t[s:s + n], t.new_zeros(pad - n)])[None]
            self.fills.n.fill_(n)
            logits, feats, ok = self.steps.prefill(chunk, self.L, self.fills.n, self.slot_index(b), self.cols(pad, b=b),
                                                   method.needs_head or method.needs_block, self.smp, mode, self.root, every)
            finite &= ok
            slot.L += n
            if r.logprobs is not None and (every or s + n == len(r.ids)):
                lo = 0 if every else n - 1            # row i chose token s + i + 1 (the last: root)
                lps.append(logprobs(logits[0, lo:n] if every else logits[0],
                                    torch.cat([t, self.root[b].view(1)])[s + lo + 1:s + n + 1], r.logprobs))
            method.prompt_chunk(self, b, chunk, logits, feats, n)
        method.prefilled(self, b)
        return self.first_tokens([(b, r)], self.root[b].view(1), finite, [lps])[0]

    def admit_group(self, pairs: list, method: Method) -> list:
        """Prefill requests (b, r) whose prompts each fit one chunk in one target pass: their rows side by
        side (B', C), each written at its own slot (prefill_chunk); then each one's chunk goes to the
        method, as in admit. Eager engines only (a compiled step would need a graph per B'). Returns the
        first tokens (one host sync)."""
        for b, r in pairs:
            self.enter(b, r, method)
        k, n = len(pairs), [len(r.ids) for _, r in pairs]
        pad = cache_rows(max(n))
        h = torch.tensor([t for _, r in pairs for t in r.ids + [0] * (pad - len(r.ids))] + n + [b for b, _ in pairs],
                         device=self.device)         # the prompts' one copy to the device, lengths and slots with them
        ids, slots = h[:k * pad].view(k, pad), h[k * pad + k:]
        self.steps.mark()
        every = any(r.logprobs is not None and r.prompt_logprobs for _, r in pairs)    # else the last rows' logits
        logits, feats, ok = self.steps.prefill(ids, self.L, h[k * pad:k * pad + k], slots,
                                               self.fills.cols[:pad] if self.window else self.fills.cols,
                                               method.needs_head or method.needs_block, self.smp,
                                               sampling_mode([r.sampling for _, r in pairs]), self.root, every)
        lps = []
        for i, (b, r) in enumerate(pairs):
            self.slots[b].L += n[i]
            lo = 0 if r.prompt_logprobs else n[i] - 1
            lps.append([] if r.logprobs is None else [logprobs(logits[i, lo:n[i]] if every else logits[i],
                                                                torch.cat([ids[i, 1:n[i]], self.root[b].view(1)])[lo:], r.logprobs)])
            method.prompt_chunk(self, b, ids[i:i + 1], logits[i:i + 1], None if feats is None else feats[i:i + 1], n[i])
            method.prefilled(self, b)
        return self.first_tokens(pairs, self.root.index_select(0, slots), ok, lps)

    def join(self, method: Method, pairs: list) -> tuple | None:
        """An admission round [ours]: new requests (b, r), prompts of one chunk, prefilled in the pass that takes
        the running requests' plain steps (prefill_chunk: a running request's chunk is its root alone, at row
        L[b], with decode's mask, position and sampling key), so a slot freed while others run costs no pass of
        its own (a prefill of one request reads every weight, as a round of B does). The running requests learn
        as in a plain round (Method.plain_round), the new chunks go to the method as in admit_group. Eager only.
        Returns (the Round, per slot what step returns; None for a new request: its first token is in r.tokens),
        or None, nothing done, where a running request's drafter must read its full pending rows in a tree."""
        new = {b for b, _ in pairs}
        late = [method.pending and s.request is not None and b not in new and s.pend >= method.room
                for b, s in enumerate(self.slots)]
        if any(late) and not method.can_catch_up(self):
            return None
        self.steps.mark()
        if any(late):
            method.catch_up(self, late)
        for b, r in pairs:
            self.enter(b, r, method)
        live = [b for b, s in enumerate(self.slots) if s.request is not None]
        prompt = [self.slots[b].request.ids if b in new else [0] for b in live]   # a running request's: its root, below
        run, n = [i for i, b in enumerate(live) if b not in new], [len(x) for x in prompt]
        k, pad, R = len(live), cache_rows(max(n)), len(run)
        h = torch.tensor([t for x in prompt for t in x + [0] * (pad - len(x))] + n + live + run + [live[i] for i in run],
                         device=self.device)                                   # one copy to the device
        ids, lens, slots, ri, rs = (h[:k * pad].view(k, pad), *h[k * pad:].split([k, k, R, R]))
        ids[ri, 0] = self.root[rs]
        running = torch.zeros_like(self.active).index_fill_(0, rs, 1)           # (B,)
        tree = Tree(self.root[:, None].clone(), torch.full_like(self.root[:, None], -1), running[:, None] > 0)
        logits, feats, ok = self.steps.prefill(ids, self.L, lens, slots, self.cols(pad), method.pending, self.smp,
                                               self.mode, self.root)
        row = lambda x: x.new_zeros(self.B, 1, x.shape[-1]).index_copy_(0, rs, x[ri, :1]) if x is not None else None
        zero, nxt = torch.zeros(self.B, 1, dtype=torch.long, device=self.device), self.root.clone()  # as decode's
        v = Verified(zero[:, 0], nxt, zero, row(logits), nxt[:, None], row(feats),
                     ok.new_ones(self.B).index_copy_(0, rs, ok[ri]))
        if method.paced:                          # (ar's plain round learns nothing)
            self.steps.plain_learn(method, tree, v, running)
        for i, b in enumerate(live):              # the new requests' chunks, as admit_group's
            if b in new:
                self.slots[b].L += n[i]
                method.prompt_chunk(self, b, ids[i:i + 1], logits[i:i + 1], feats if feats is None else feats[i:i + 1], n[i])
                method.prefilled(self, b)
        self.clock.mark("prefill")
        out = self.settle(commit(v, tree), True, new)
        take = [i for i, b in enumerate(live) if b in new]
        self.first_tokens([(live[i], self.slots[live[i]].request) for i in take],
                          self.root.index_select(0, slots[take]), ok[take], [[] for _ in take])
        if method.pacer is not None:              # a plain round, not a sample of a plain step's cost
            method.pacer.seen(self, method, [False] * self.B, out, 0.0, True, caught=True)
        return Round(tree, v, [None] * self.B, 0, 2, plain=True), out

    def first_tokens(self, pairs: list, roots: torch.Tensor, finite: torch.Tensor, lps: list) -> list:
        """After a prefill of requests (b, r): their first tokens (roots, (k,)) and, for those that ask,
        the log-probs taken (lps, per request a list of logprobs() rows), in one transfer; finite (k,)."""
        got = torch.cat([roots.double(), finite.double()] + [x.flatten() for xs in lps for x in xs]).tolist()
        if not all(got[len(pairs):2 * len(pairs)]):
            raise GraftError("the target's logits are not finite (NaN or inf) on the prompt: the model overflows "
                             "in this dtype or its weights are broken")
        at = 2 * len(pairs)
        for i, ((b, r), xs) in enumerate(zip(pairs, lps)):
            n = sum(x.numel() for x in xs)
            rows = unpack_logprobs(got[at:at + n], r.logprobs, r.logprobs) if xs else []
            r.tokens, r.prompt_logprob_rows, r.logprob_rows, at = [int(got[i])], rows[:-1], rows[-1:], at + n
        return [r.tokens[0] for _, r in pairs]

    def head_prefill(self, b: int, feats, ids, n: int):
        """The head's committed rows for a chunk of slot b's prompt (Drafter.prefill)."""
        self.fills.n.fill_(n)
        self.steps.head_prefill(feats, ids, self.fills.n, self.slot_index(b), self.cols(ids.shape[1], True, b))
        self.slots[b].Ld += n

    def block_prefill(self, b: int, feats, n: int):
        """The DFlash drafter's context rows for a chunk of slot b's prompt (BlockDrafter.prefill)."""
        self.fills.n.fill_(n)
        self.steps.block_prefill(feats, self.fills.n, self.slot_index(b))

    def advance_head(self):
        """After an extend: every slot's head rows grew by the path it read."""
        for s in self.slots:
            if s.request is not None:
                s.Ld += s.pend

    def enter(self, b: int, r: Request, method: Method):
        """Slot b takes request r for `method`: seated (its rows zeroed), its sampling set, the method told."""
        self.seat(b, r)
        self.smp.set(b, r.sampling)
        method.admit(self, b)

    def seat(self, b: int, r: Request | None):
        """Slot b takes request r (None: it empties): its lengths start at 0, host and device alike, and
        the batch's sampling mode follows its requests."""
        # rows past L meet the mask's zero weights (0 * NaN = NaN): zeros, whatever the slot held. A request writes
        # below its length plus each cache's scratch (self.caches: c.rows - max_seq_len, a round's trees, levels or
        # prefill chunk): only those rows are zeroed (SmolLM2's whole slot: 12.6 ms), the prompt's marked first
        for c, scratch in self.caches:
            c.mark(b, self.slots[b].L + scratch)
            if r is not None:
                c.clear(b), c.mark(b, len(r.ids) + scratch)     # (before its prefill, which may fail)
        self.slots[b] = Slot(r, pend=int(r is not None))
        self.L[b], self.active[b] = 0, int(r is not None)
        if self.drafter is not None:
            self.drafter.Ld[b] = 0
        if self.block is not None:
            self.block.Ld[b] = 0
        self.mode = sampling_mode([q.sampling for q in self.requests() if q is not None])

    def free(self, b: int, method: Method):
        method.finish(self, b)
        self.seat(b, None)

    # -- one round for every slot
    def step(self, method: Method, record: bool = False, full: bool = False) -> tuple:
        """One round: the method proposes, the verifier checks every tree in one pass, the method
        learns (graft.Method.round); then the round's one host transfer (verify.commit). Which slots
        draft is the method's pacer's call (Pacer.plan): none, and the round is a plain step
        (Method.plain_round). Returns (the Round, per slot (accepted tokens, bonus, the accepted's
        sources (graft.SOURCES, 0: none), real nodes) or None for an empty slot)."""
        self.steps.mark()                     # the last round's step outputs are dead from here on
        t0 = time.perf_counter()
        grow = method.pacer.plan(self, method) if method.pacer is not None and not (record or full) else None
        plain = grow is not None and not any(grow)
        # a long plain run: a drafter whose pending rows are full reads them now (a drafting round reads every
        # slot's, drafting or not)
        late = [plain and method.pending and s.request is not None and s.pend >= method.room for s in self.slots]
        caught = any(late) and method.can_catch_up(self)
        if caught:
            method.catch_up(self, late)
        # a round drafting after plain steps (a probe): every head reads the rows it missed first, outside the
        # round's time, so the round is a sample of a tree's cost (else probes never refresh cost(k), and a
        # window left dear by a noisy spell kept eagle3 plain in 97% of its rounds)
        behind = [grow is not None and s.request is not None and s.idle and s.pend > 1 for s in self.slots]
        clean = not plain and method.pending and any(behind) and method.can_catch_up(self)
        ahead = 0.0                           # (a probe's catch-up: part of what the probe costs, not of a tree)
        if clean:
            method.catch_up(self, behind)
            ahead, t0 = time.perf_counter() - t0, time.perf_counter()
        if plain:
            rnd = method.plain_round(self, learn=not method.pacer.deep(self))
        else:
            self.drafts[:] = grow if grow is not None else [True] * self.B
            self.grow.copy_(self.grow_host.copy_(torch.tensor(self.drafts)))
            rnd = method.round(self, record, full)
        rnd.grow = grow
        want = [b for b, s in enumerate(self.slots) if s.request is not None and s.request.logprobs is not None]
        k = max((self.slots[b].request.logprobs for b in want), default=0)       # (no work unless asked)
        got, vals = commit(rnd.v, rnd.tree, path_logprobs(rnd.v, want, k)) if want else (commit(rnd.v, rnd.tree), [])
        out = self.settle(got, rnd.plain, learned=rnd.learned)
        P, w = rnd.v.path.shape[1], 1 + 2 * k
        for i, b in enumerate(want):          # the emitted tokens' rows: the path's first A + 1
            r = self.slots[b].request
            r.logprob_rows += unpack_logprobs(vals[i * P * w:(i * P + len(out[b][0]) + 1) * w], k, r.logprobs)
        self.clock.mark("update")
        if grow is not None:          # (sharded: rank 0's clock, so that every rank plans the same rounds)
            took, ahead = self.agree((time.perf_counter() - t0, ahead))
            method.pacer.seen(self, method, grow, out, took, rnd.plain, caught, clean, ahead)
        return rnd, out

    def settle(self, got: list, plain: bool, skip=(), learned: bool = True) -> list:
        """After a round's commit (got: verify.commit's per slot): per slot (accepted tokens, bonus, sources,
        nodes), None for an empty slot and for those in skip (requests that joined it); the host's lengths
        follow (a plain round's pending row where it learned). Errors: GraftError where logits were not finite."""
        out = []
        for b, (acc, bonus, ret, nodes, finite) in enumerate(got):
            s = self.slots[b]
            if s.request is None or b in skip:
                out.append(None)
                continue
            if not finite:
                raise GraftError(NOT_FINITE)
            s.L += len(acc) + 1
            s.pend = s.pend + learned if plain else len(acc) + 1
            out.append((acc, bonus, ret, nodes))
        return out

    def pending_rows(self, method: Method) -> int:
        """The rows of a method's pending buffers its drafter's next step reads: eager, as many as any
        slot has (a narrower step: padding rows cost compute); compiled, all (a static shape)."""
        if self.compiling:
            return method.pend_feats.shape[1]
        return max([1] + [s.pend for s in self.slots if s.request is not None])


# ----------------------------------------------------------------------------- cost-aware rounds

# Whether a method's rounds are paced (Pacer) unless its Config says (--pace, --no-pace): on.
PACE = True


class Pacer:
    """Cost-aware rounds [ours]: each round, which requests draft a tree and which take a plain step.

    A tree pays when the tokens a round commits outweigh what the round costs more than a plain step:
    mat * t_plain > t_tree, mat the tokens this request's drafting rounds commit (an exponential average,
    AVERAGE the newest round's weight: ~20 rounds, as a shorter memory let two short rounds send a request
    whose trees paid into plain runs; a probe, after a plain run left it stale, weighs PROBE) and t_tree,
    t_plain this method's rounds on this engine as it runs (cost(k): k slots drafting, the median of the
    last WINDOW of each count: robust to interference; a lower quartile priced a count's smallest trees,
    and pld at B = 4 drafted where it lost). Where it does not pay (by MARGIN), the request takes plain
    steps (no draft, no head: plain decoding's cost), MIN_RUN of them, then drafts once (a probe), the
    plain run doubling while it does not pay, up to MAX_RUN where the drafter can read its pending rows
    outside a drafting round (Method.catch_up, once its pending rows are full: Method.room), else up to PLAIN_RUN
    (the cap); where no tree could pay committing even its longest path (P tokens: the stdlib pair's eagle3, 60
    nodes in 12 steps' time for <= 9 tokens), LONGEST at once; a new request starts where the last one left off
    (its mat and the rest of its run, at most 8 or floor() once any request's tree has paid here: a method that
    never pays probes less than once a request). Early in a long run a plain round is `ar`'s step (deep).
    At B > 1 a tree pass costs every request, so the batch is paced as one (plan): its drafters are the
    requests of highest mat, as many as pay, its probes one request's tree beside the others' roots
    (Engine.grow; a CPU skips a padding row's arithmetic; every request's, where that costs less a request), a
    drafting round halving its run (once its first requests have all left, the rest as a new request's alone).
    A method that scores every proposal (Method.shadow: pld's chains) needs no plain runs nor probes: each
    round reads the mat of its proposal's kind (self.kinds). Costs are measured, never assumed: PLAIN_SAMPLES plain
    steps first measure t_plain, each after a plain step (the stdlib pair's two after trees: 3.3, 2.9 ms, a plain run's
    2.0, its weights out of cache: trees looked paying), and again after STALE rounds; then trees, two of each count.
    Probing is exploration, and it is priced too: where probes lose on average (a probe's round and its
    drafter's catch-up, less the plain steps its tokens would have taken: a gain where it paid; the mean of
    the last WINDOW probes), the plain run after a probe that does not pay is at least long enough that
    probes cost EXPLORE of its time (up to LONGEST where the drafter catches up, else the cap): on a target
    whose step costs about what its head's draft does (the 4.3M stdlib pair: a probe lost ~1.8 plain steps),
    probes every 4-8 steps cost ~8% of ar's speed (EXPLORE 1%: 0-3% faster there, graft at B = 4 on SmolLM2 2-4%
    slower); on SmolLM2 probes gain on average (a median with every gain counted 0: graft 14% plain, not 3%)."""
    WINDOW, MARGIN, MIN_RUN, AVERAGE, PROBE, PLAIN_SAMPLES, MAX_RUN, EXPLORE = 16, 0.03, 4, 0.1, 0.5, 3, 128, 0.03
    QUANTILE, STALE, LONGEST, RECENT = 0.5, 128, 1024, 16

    def __init__(self):
        self.times = {}               # slots that drafted (0: a plain step) -> deque of seconds
        self.batch, self.cohort = Slot(), []      # at B > 1, the batch's plain run (plain, backoff), its first requests
        self.prior = None             # (mat, backoff, plain) of the request seen last: where a new one starts
        self.cap = PLAIN_RUN          # the longest plain run: MAX_RUN where the method catches up (plan)
        self.turn = 0                 # at B > 1, the slot whose tree the batch's next probe drafts (in turn)
        self.probed = False           # at B > 1, the last drafting round was a probe (plan)
        self.kinds = {}               # a shadowing method's MAT by its proposals' kind (Method.shadow)
        self.cuts = {}                # ... by kind, per length 1, 2, .. its proposals cut there would (Method.cuts)
        self.rows = {}                # nodes one slot drafted -> deque of seconds of those rounds (Method.cuts)
        self.paid, self.stale = False, 0   # a tree paid here, alone (seen); rounds since a plain step
        self.lost = deque(maxlen=self.WINDOW)   # seconds each recent probe lost against plain steps (< 0: gained)

    def cost(self, k: int) -> float | None:
        """Seconds of a round in which k slots draft (0: a plain step): the median (QUANTILE) of its window
        once two are known; else the line through the nearest counts measured below and above k (above
        the largest: through it and the plain step; a tree pass grows with its rows). None before that."""
        known = {j: self.typical(x) for j, x in self.times.items() if len(x) >= 2}
        if k in known or 0 not in known or len(known) < 2:
            return known.get(k)
        lo, hi = max(j for j in known if j < k), min((j for j in known if j > k), default=None)
        lo, hi = (0, lo) if hi is None else (lo, hi)
        return known[lo] + (known[hi] - known[lo]) * (k - lo) / (hi - lo)

    def pays(self, mat: float | None, k: int = 1) -> bool:
        """mat * cost(0) >= cost(k) * (1 + MARGIN): k drafters committing mat tokens beat a plain step (unknowns: yes)."""
        tp, tt = self.cost(0), self.cost(k)
        return mat is None or not (tp and tt) or mat * tp >= tt * (1 + self.MARGIN)

    def plan(self, eng, method) -> list:
        """Per slot, whether it drafts this round (an empty slot: False). At B > 1 (self.batch: its plain run)
        the drafters are the requests of highest MAT, as many as make the batch's tokens a second highest
        (a non-drafter's: 1; k drafters cost cost(k)), none where no count pays; after a plain run, one
        request's tree (in turn) probes. A head whose pending rows are full (Method.room) drafts in any case,
        unless the method can catch up without a tree (Method.catch_up, which the engine then runs)."""
        live = [s.request is not None for s in eng.slots]
        catch = method is not None and method.can_catch_up(eng)
        self.cap = self.MAX_RUN if catch else PLAIN_RUN
        if self.times.get(0) and self.stale > self.STALE:   # a plain step's cost grows with the context: one
            self.times[0].clear()            # kept from a long prompt made trees look paying on short ones after it
        if len(self.times.get(0, ())) < self.PLAIN_SAMPLES:   # measure a plain step's cost (what ar's is) first:
            return [False] * eng.B      # it costs nothing over ar (drafting first, recycle's 81-node trees at B = 4: 13x)
        for s in [s for x, s in zip(live, eng.slots) if x and s.mat is None and self.prior]:   # a new request
            s.mat, s.backoff, s.plain = self.prior                            # starts where the last one left off
        shadow = method.shadow(eng) if getattr(method, "shadows", False) else None
        n, b, tp = sum(live), self.batch, self.cost(0) if eng.B > 1 or shadow else None     # (a plain run: no sorts)
        if shadow is not None:       # the method scores every proposal, drafted or not: no plain runs, no probes;
            settled, kinds = shadow              # each round decides from the MAT of its proposal's kind
            cap = method.N - 1 if getattr(method, "cuts", False) else 0
            for kind, a in [x for got in settled for x in got]:
                self.kinds[kind] = self.average(self.kinds.get(kind), a)
                c = self.cuts.setdefault(kind, [None] * cap)    # (cut after l nodes: min(a, l + 1) tokens)
                c[:] = [self.average(m, min(a, l + 2)) for l, m in enumerate(c)]
            for s, kind in zip(eng.slots, kinds):
                s.mat, s.length = 1.0 if kind is None else self.kinds.get(kind), None   # (no proposal: commits 1)
            live = [x and kind is not None for x, kind in zip(live, kinds)]     # (none: nothing to draft)
            if n == 1 and tp and self.cost(1):
                return [x and self.cut(s, self.cuts.get(kind)) for x, s, kind in zip(live, eng.slots, kinds)]
        want = [x and s.plain == 0 for x, s in zip(live, eng.slots)]
        full = [x and s.pend >= getattr(method, 'room', PLAIN_RUN) and not catch for x, s in zip(live, eng.slots)]
        if n > 1 and tp and any(want) and self.cost(sum(want)):
            if b.plain and not any(s.request is r for s in eng.slots for r in self.cohort):   # its first requests left:
                b.plain, self.cohort = min(b.plain, max(2 * self.MIN_RUN, self.floor())), [s.request for s in eng.slots if s.request]
            if b.plain:                                    # the batch's plain run (the rest as a new request's alone)
                b.plain -= 1
                return full
            order = sorted((i for i in range(eng.B) if want[i]), key=lambda i: -(eng.slots[i].mat or 1.0))
            if b.backoff and not self.probed:              # the run is over: a probe, one request's tree,
                self.probed, every, one = True, self.cost(len(order)), self.cost(1)
                if every and one and (every - tp) / len(order) < one - tp:   # or every one's where that costs
                    return [f or i in order for i, f in enumerate(full)]     # less a request (a head drafts all
                pick = min(order, key=lambda i: (i - self.turn) % eng.B)     # at once: graft's four trees at
                self.turn = (pick + 1) % eng.B                               # B = 4 36 ms, one 38, a step 25)
                return [f or i == pick for i, f in enumerate(full)]
            gain = [sum((eng.slots[i].mat or 1.0) - 1 for i in order[:k]) for k in range(len(order) + 1)]
            k = max(range(len(order) + 1), key=lambda k: (n + gain[k]) / (self.cost(k) * (1 + self.MARGIN * (k > 0))))
            self.probed, b.backoff = False, b.backoff if k == 0 else b.backoff // 2   # (a lucky probe: not back to MIN_RUN)
            if k == 0:                                     # no count pays: a plain run (twice the last after a probe)
                b.plain, self.cohort = self.back_off(b) - 1 if shadow is None else 0, [s.request for s in eng.slots if s.request]
                return full
            want = [i in order[:k] for i in range(eng.B)]
        return [w or f for w, f in zip(want, full)]

    def typical(self, seconds) -> float:          # a round's cost from its samples: their QUANTILE (median)
        return sorted(seconds)[int(len(seconds) * self.QUANTILE)]

    def average(self, m: float | None, a: float, w: float = AVERAGE) -> float:   # m, a newest of weight w
        return a if m is None else (1 - w) * m + w * a

    def cut(self, s: Slot, c: list | None) -> bool:
        """Alone, whether slot s drafts its proposal and its first s.length nodes (None: all), for a method that
        cuts them (c: the tokens its kind's proposals commit cut after 1, 2, .. nodes; None or empty: all, if
        pays): the length of most tokens a second (c[l - 1] over the median round that drafted l nodes, self.rows)
        where that beats a plain step by MARGIN; first each length not timed twice (costs are measured)."""
        if not c:
            return self.pays(s.mat)
        t = {l: self.typical(x) for l, x in self.rows.items() if len(x) >= 2 and 1 <= l <= len(c)}
        new = [l for l in range(1, len(c) + 1) if l not in t]
        for l in range(len(c) - 1, 0, -1) if not new else ():     # fewer nodes cost no more (a length
            t[l] = min(t[l], t[l + 1])                            # never chosen again keeps a noisy high time)
        best = new[0] if new else max(t, key=lambda l: c[l - 1] / t[l])
        drafts = bool(new) or c[best - 1] * self.cost(0) >= t[best] * (1 + self.MARGIN)
        s.length = best if drafts and best < len(c) else None
        return drafts

    def back_off(self, s: Slot, hopeless: bool = False) -> int:
        """s takes plain steps: MIN_RUN of them, twice the last run while none pays (up to self.cap), and
        at least floor(); the longest run (LONGEST where the drafter catches up, else self.cap) where
        no tree can pay (hopeless: one committing its longest path would not)."""
        top = self.LONGEST if self.cap == self.MAX_RUN else self.cap
        run = max(min(self.cap, 2 * s.backoff if s.backoff else self.MIN_RUN), min(self.floor(), top))
        s.backoff = s.plain = top if hopeless else run
        return s.plain

    def deep(self, eng) -> bool:
        """Whether this plain round leaves the drafter, matrix and context behind (Method.plain_round, learn=False:
        the stdlib pair's rounds kept them in step for 2-3% of a step): more than RECENT rounds are left in the run
        (at B > 1 the batch's; its last RECENT give the drafter the newest text). Eager only (compiled: one graph)."""
        live = [s for s in eng.slots if s.request is not None]
        left = self.batch.plain + 1 if len(live) > 1 else live[0].plain if live else 0    # (plan counted this
        return left > self.RECENT and not eng.compiling                                   # round off the batch's)

    def floor(self) -> int:
        """The shortest plain run after a probe that did not pay: probes then cost at most EXPLORE of the
        run's time (the mean probe's loss over EXPLORE plain steps); 0 where probes gain on average or
        before one is measured."""
        tp, lost = self.cost(0), statistics.fmean(self.lost) if self.lost else 0.0
        return math.ceil(lost / (self.EXPLORE * tp)) if tp and lost > 0 else 0

    def explain(self, s: Slot, drafted: bool) -> str:
        """One line on a round of slot s just seen: what it did and the inputs of what it does next."""
        tp, tt = self.cost(0), self.cost(1)
        costs = (f"plain step {tp * 1000:.1f} ms, drafting round {tt * 1000:.1f} ms" if tp and tt else
                 "costs not measured yet (plain step: " + (f"{tp * 1000:.1f} ms" if tp else "?") + ", drafting round: " +
                 (f"{tt * 1000:.1f} ms" if tt else "?") + ")")
        if self.kinds:               # a shadowing method: each round reads the MAT of its proposal's kind
            pay = [k for k, m in sorted(self.kinds.items()) if self.pays(m)]
            return (f"{'drafted' if drafted else 'plain step'}; MAT by kind of proposal " + ", ".join(
                f"{k}: {m:.2f}" for k, m in sorted(self.kinds.items())) + f"; {costs}; a round drafts where its "
                f"proposal's kind pays ({', '.join(map(str, pay)) or 'none yet'}), else it takes a plain step" +
                (f"; its first {s.length} node(s) by rounds' cost (" + ", ".join(
                    f"{l}: {self.typical(x) * 1000:.1f} ms" for l, x in sorted(self.rows.items())) + ")"
                 if drafted and s.length else ""))
        mat = f"drafting MAT {s.mat:.2f}" if s.mat is not None else "no drafting round yet"
        pays = self.pays(s.mat)
        nxt = (f"plain for {s.plain} more round(s), then a probe" if s.plain else
               ("drafts next" if pays else "plain next") + (
                   f" (it {'pays' if pays else 'does not pay'}: {s.mat:.2f} x {tp * 1000:.1f} ms "
                   f"{'>=' if pays else '<'} {tt * 1000:.1f} ms x {1 + self.MARGIN:.2f})"
                   if s.mat is not None and tp and tt else ""))
        return f"{'drafted' if drafted else 'plain step'}; {mat}; {costs}; {nxt}"

    def seen(self, eng, method, grow: list, out: list, seconds: float, plain: bool, caught: bool = False,
             clean: bool = False, ahead: float = 0.0):
        """After a round: its cost, and per request what its drafting committed (a request whose trees do
        not pay goes plain for a while). No cost sample: a round whose resuming head read the plain steps'
        features it missed (unless before the timer: clean, Engine.step), or whose drafter caught up (caught).
        ahead: the seconds a probe's drafters spent catching up before the timer (clean)."""
        k, probe, n = 0 if plain else sum(grow), [s.idle for s in eng.slots], sum(o is not None for o in out)
        shadows, pending = getattr(method, "shadows", False), getattr(method, "pending", True)   # (None: a test's)
        if not plain and n and not shadows and any(g and p for g, p in zip(grow, probe)) and (tp := self.cost(0)):
            # a probe: its time against the plain steps that would have committed its tokens (n a step)
            made = sum(len(o[0]) + 1 for o in out if o is not None)
            self.lost.append(seconds + ahead - made / n * tp)
        resumed = any(g and s.idle for s, g in zip(eng.slots, grow))      # (a plain step: sampled after a plain one)
        if not caught and (not self.stale if plain else clean or not pending or not resumed):
            self.times.setdefault(k, deque(maxlen=self.WINDOW)).append(seconds)
            if k == 1 and getattr(method, "cuts", False):       # (alone: its nodes' cost, for cut)
                self.rows.setdefault(max(method.drafted), deque(maxlen=self.WINDOW)).append(seconds)
        self.stale = 0 if plain and not caught else self.stale + 1
        for s, g in zip(eng.slots, grow):
            s.idle = plain or not g
        for s, g, o, fresh in zip(eng.slots, grow, out, probe):
            if o is None:
                continue
            if plain or not g or shadows:          # (a shadowing method scored its drafted proposals too: plan)
                s.plain = max(s.plain - 1, 0)
                if n == 1 and self.prior is not None:     # (its run goes on into the next request; once paid, <= run)
                    self.prior = self.prior[:2] + (min(self.prior[2], s.plain),) if self.paid else (s.mat, s.backoff, s.plain)
                continue
            a, w = len(o[0]) + 1, self.PROBE if fresh else self.AVERAGE      # (a plain run left it stale)
            s.mat = self.average(s.mat, a, w)
            # alone, a request goes plain where its trees do not pay; in a batch, plan picks the drafters
            if n == 1 and not self.pays(s.mat, k):
                most = getattr(method, "P", None)      # the most tokens one of its rounds commits
                self.back_off(s, most is not None and not self.pays(most, k))
            else:
                s.backoff = 0
                self.paid = self.paid or (n == 1 and self.cost(0) is not None and self.cost(k) is not None)
            # a new request starts where this one is: once a tree has paid here, with the rest of a run <= 2 MIN_RUN or
            # the floor (the next text may differ); else inside this one's run (a probe a request cost DFlash ~4% of ar)
            run = min(s.backoff, max(2 * self.MIN_RUN, self.floor()))
            self.prior = (s.mat, run, run) if self.paid else (s.mat, s.backoff, s.plain)


class PlainSteps(Pacer):
    """A pacer whose every round is a plain step (compile_warmup: those rounds' graphs)."""
    plan = lambda self, eng, method: [False] * eng.B        # noqa: E731
    seen = lambda self, *args: None                         # noqa: E731


# What the faces ask of a method name, read off the classes (graft.METHODS): nothing to keep in step.
NEEDS_HEAD = {n for n, c in METHODS.items() if c.needs_head}
NEEDS_BLOCK = {n for n, c in METHODS.items() if c.needs_block}
NEEDS_MATRIX = {n for n, c in METHODS.items() if c.needs_matrix}
PRUNING = {n for n, c in METHODS.items() if c.settings.get("prune")}
CALIBRATED = {n: c.calibrated for n, c in METHODS.items() if c.calibrated}


def make_method(eng: Engine, name: str, cfg: Config | None = None, cal: Calibration | None = None,
                matrix: ContinuationMatrix | None = None) -> Method:
    """eng.make(...): the method `name` set up on this engine."""
    return eng.make(name, cfg, cal, matrix)


# ----------------------------------------------------------------------------- the loop

class Scheduler:
    """The loop (nano-vllm's scheduler and step): requests waiting for a slot, and one iteration that
    refills free slots, runs one round for every slot and hands each request what it returned. run()
    steps it until nothing is left; a server adds requests as they arrive and steps while any is busy.
    A request stops after an EOS, at its max_new_tokens (the run's when None) or once `cancelled`
    (a client gone, a stop string met): its slot takes the next waiting request between rounds.
    on_tokens(request) after each of its rounds (streaming); on_round(round, commits) after every round."""

    def __init__(self, eng: Engine, method: Method, max_new_tokens: int, eos_ids=(), on_tokens=None, on_round=None,
                 record: bool = False, full: bool = False):
        self.eng, self.method, self.max_new, self.eos = eng, method, max_new_tokens, set(eos_ids)
        self.on_tokens, self.on_round, self.record, self.full = on_tokens, on_round, record, full
        self.waiting, self.rounds, self.forwards, self.prefill_s = deque(), 0, 0, 0.0
        self.plain = True                    # the last round was a plain one (joins)
        for b, r in enumerate(eng.requests()):        # a run that raised left its requests in their slots
            if r is not None:
                eng.free(b, method)
        self.t0 = time.perf_counter()
        eng.clock.start()

    def add(self, r: Request):
        """Queue r. Errors: GraftError for an empty prompt or one that does not fit the cache."""
        if not r.ids:
            raise GraftError("empty prompt")
        if len(r.ids) + self.limit(r) > self.eng.model.max_seq_len:
            raise GraftError(f"prompt ({len(r.ids)} tokens) + --max-new-tokens ({self.limit(r)}) exceeds "
                             f"--max-seq-len ({self.eng.model.max_seq_len})")
        self.waiting.append(r)

    def limit(self, r: Request) -> int:
        return self.max_new if r.max_new_tokens is None else r.max_new_tokens

    def busy(self) -> bool:
        return bool(self.waiting) or any(self.eng.requests())

    def done(self, b: int, r: Request):
        if r.cancelled or r.tokens[-1] in self.eos or len(r.tokens) >= self.limit(r):
            r.finished_s, r.done = time.perf_counter() - self.t0, True
            self.eng.free(b, self.method)

    def joins(self, pairs: list) -> bool:
        """Whether new requests (slot, request) join the next round (Engine.join) rather than take a pass
        of their own: an eager engine where others run, prompts of one chunk, no log-probs asked, and a
        round that would be plain: ar's, or a paced method's after a plain one (where trees pay, a forced
        plain step would give up more than the pass saves; an unpaced method drafts every round)."""
        eng, m, rs = self.eng, self.method, [r for r in self.eng.requests() if r is not None]
        return bool(rs) and (not m.paced or m.pacer is not None and self.plain) and not (
            eng.compiling or self.record or self.full) and (
            all(len(r.ids) <= eng.chunk for _, r in pairs) and all(r.logprobs is None for r in rs + [r for _, r in pairs]))

    def join(self, pairs: list) -> tuple | None:
        """Engine.join: the round, with the new requests' prefill in its pass (its seconds count as
        prefill); None where it cannot (then nothing ran)."""
        t = time.perf_counter() - self.t0
        got = self.eng.join(self.method, pairs)
        if got is not None:
            self.prefill_s += time.perf_counter() - self.t0 - t
            for b, r in pairs:
                r.admitted_s, r.first_s = t, time.perf_counter() - self.t0
        return got

    def admit(self, pairs: list):
        """Prefill new requests (slot, request): the prompts that fit one chunk together in one target
        pass (Engine.admit_group, on an eager engine), the others one by one; each may end at once."""
        eng = self.eng
        group = [p for p in pairs if len(p[1].ids) <= eng.chunk] if len(pairs) > 1 and not eng.compiling else []
        grouped = {id(r) for _, r in group} if len(group) > 1 else set()
        for batch in ([group] if grouped else []) + [[p] for p in pairs if id(p[1]) not in grouped]:
            t = time.perf_counter() - self.t0
            eng.admit_group(batch, self.method) if len(batch) > 1 else eng.admit(*batch[0], self.method)
            for b, r in batch:
                r.admitted_s, r.first_s = t, time.perf_counter() - self.t0
            self.prefill_s += time.perf_counter() - self.t0 - t
            eng.clock.mark("prefill")
            for b, r in batch:
                if self.on_tokens:
                    self.on_tokens(r)
                self.done(b, r)

    @torch.no_grad()
    def step(self):
        eng, method = self.eng, self.method
        for b in range(eng.B):                       # 1. free the cancelled, refill free slots between rounds
            if (r := eng.slots[b].request) is not None and r.cancelled:
                self.done(b, r)
        while True:
            free, pairs = [b for b in range(eng.B) if eng.slots[b].request is None], []
            while free and self.waiting:
                r = self.waiting.popleft()
                if r.cancelled:
                    r.done = True
                    continue
                pairs.append((free.pop(0), r))
            if not pairs:
                break
            if self.joins(pairs) and (joined := self.join(pairs)) is not None:
                break                                # (their prefill rode on this round's pass)
            self.admit(pairs)
        if not any(eng.requests()):
            return
        # 2. one round for every slot
        rnd, got = joined if pairs else eng.step(method, self.record, self.full)
        self.rounds, self.plain = self.rounds + 1, rnd.plain
        self.forwards += rnd.forwards
        if self.on_round:
            self.on_round(rnd, got)
        for b, g in enumerate(got):                  # 3. what each request returns
            r = eng.slots[b].request
            if g is None:
                continue
            acc, bonus, ret, nodes = g
            new = acc + [bonus]                      # cut after an EOS and at max_new_tokens
            cut = next((i + 1 for i, t in enumerate(new) if t in self.eos), len(new))
            new = new[:min(cut, self.limit(r) - len(r.tokens))]
            kept = min(len(new), len(acc))           # accepted tokens among those returned
            r.rounds += 1
            r.committed += len(new)
            r.accepted += kept
            r.from_retrieval += sum(1 for x in ret[:kept] if x)
            for name, i in SOURCES.items():
                r.from_source[name] = r.from_source.get(name, 0) + ret[:kept].count(i)
            r.draft_forwards += rnd.forwards
            r.verified += nodes
            r.padded += method.N - 1
            r.syncs += rnd.syncs
            r.plain += rnd.plain or (rnd.grow is not None and not rnd.grow[b])
            r.stages[rnd.stages[b]] = r.stages.get(rnd.stages[b], 0) + 1
            r.tokens += new
            del r.logprob_rows[len(r.tokens):]      # (rows past the cut)
            if self.on_tokens:
                self.on_tokens(r)
            self.done(b, r)
        for b, r in pairs:                           # requests that joined the round: their first token
            if self.on_tokens:
                self.on_tokens(r)
            self.done(b, r)


@torch.no_grad()
def run(eng: Engine, method: Method, requests: list, max_new_tokens: int, eos_ids=(), on_tokens=None,
        on_round=None, record: bool = False, full: bool = False) -> Run:
    """Decode every request (Request: token ids and sampling), B at a time (Scheduler): a finished
    request's slot takes the next waiting one, prefilled between rounds. record: the warm-up's records;
    full: draft to full depth (compile warm-up). Results in input order. Errors: GraftError for an empty
    prompt or one that does not fit the cache, before anything runs."""
    s = Scheduler(eng, method, max_new_tokens, eos_ids, on_tokens, on_round, record, full)
    for r in requests:
        s.add(r)
    c0 = time.process_time()
    while s.busy():
        s.step()
    sync(eng.device)
    return Run(list(requests), time.perf_counter() - s.t0, s.rounds, s.forwards, s.prefill_s, time.process_time() - c0)


def generate(eng: Engine, method: Method, prompt_ids: list, max_new_tokens: int, sampling: Sampling = Sampling(),
             eos_ids=(), on_tokens=None, on_round=None) -> Request:
    """One prompt (token ids), alone: run() with a batch of one. on_tokens(tokens) after each round
    (streaming); on_round(round, commits) too (--show-tree). Returns the Request with its tokens, counts,
    seconds and the seconds per phase."""
    r = Request(list(prompt_ids), sampling)
    eng.clock.reset()
    sync(eng.device)
    res = run(eng, method, [r], max_new_tokens, eos_ids, on_tokens and (lambda q: on_tokens(q.tokens)), on_round)
    r.seconds, r.times = res.seconds, eng.clock.read()
    return r


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- costs, compile warm-up, checks


def compile_warmup(eng: Engine, methods: list, sampling: Sampling = Sampling(), log=None) -> float:
    """Run every compiled step once before anything is timed: a short generation per method in every
    slot, drafted to full depth (`full`: every draft level's graph). Returns the seconds it took, which
    is what compilation costs (a second run reads inductor's FX graph cache). The continuation
    matrices are left as they were: what these generations taught them would otherwise reach a
    warm-up's records."""
    if not eng.compiling:
        return 0.0
    t0 = time.perf_counter()
    ids = list(range(1, min(17, eng.model.max_seq_len - 15, eng.model.args.vocab_size))) or [0]    # any ids do
    for m in methods:
        kept = m.matrix.state_dict() if m.matrix is not None else None
        run(eng, m, [Request(ids, sampling) for _ in range(eng.B)], 8, (), full=True)
        if m.pacer is not None:          # and the plain rounds a pacer takes (decode with features, plain_learn)
            pacer, m.pacer = m.pacer, PlainSteps()
            run(eng, m, [Request(ids, sampling) for _ in range(eng.B)], 3, ())
            m.pacer = pacer
        if kept is not None:
            m.matrix.load_state_dict(kept)
    eng.steps.compile_seconds += time.perf_counter() - t0
    if log:
        log(f"compile: {time.perf_counter() - t0:.1f}s")
    return time.perf_counter() - t0
