"""The engine: the target's steps, eager or compiled, the decoding loop, and the methods' table.

gpt-fast's shape: `prefill_chunk` and `decode_one_token` (verify.py) are flat functions, compiled in
one place (Engine.__init__ and Engine.compile); a round of any method is a few static-shaped steps
with one host sync. Every method is a proposer (verify.Proposer): each round it proposes a tree under
the root, the one verifier commits the longest path the target agrees with plus one bonus token, and
it learns. "The engine knows nothing about tokenization" (nanochat): it takes and returns token ids.
  ar       the root alone: plain decoding (`Plain`, decode_one_token)
  eagle3   dense EAGLE-3 tree (budget 60, top_k 10, 8 levels)             (graft.Graft, configured)
  prune    EAGLE-3 stopped at calibrated checkpoints; freed slots left empty (ECHO-style)
  graft    prune, then fill the freed slots from the continuation matrix (this project's point)
  recycle  Token Recycling: an 80-node retrieval tree from the continuation matrix, no draft head
  pld      prompt lookup: copy up to 10 tokens after the last match of the newest 1-3 tokens
  graft-fixed  fixed 40/20 draft/retrieval split, full drafting, no calibration (ablation)
  graft-root   dense 60-node draft plus a 20-node retrieval subtree at the root (ablation)
  graft-tail   dense 60-node draft plus a 20-node retrieval subtree under the best draft leaf (ablation)
Loading a checkpoint is the faces' business (cli.build_engine); calibration is calibrate.py's.
"""
import dataclasses
import statistics
import time
import types
from dataclasses import dataclass, field
from functools import partial

import torch

from draft import Drafter
from graft import Config, ContinuationMatrix, Graft, Recycle
from model import GraftError, attention_mask
from verify import (Clock, Proposer, Sampling, Tree, Verified, chain, choose, commit, decode_one_token, rows_finite,
                    token_hash, verify)


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


# Generic prompts for warm-up (filling the matrix, measuring hit rates, calibrating thresholds).
WARMUP_PROMPTS = [
    "Once upon a time, there was a little",
    "Write a short story about a dog who finds a ball in the park.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Explain in simple words why the sky is blue.",
    "List three tips for staying healthy and explain each one.",
    "import os\nimport sys\n\n\ndef main():\n",
    "The little girl went to the store with her mom. They",
    "Summarize the following: The meeting covered the budget, the schedule and the new hires.",
]


# ----------------------------------------------------------------------------- the target's steps

def prefill_chunk(model, tokens: torch.Tensor, L: torch.Tensor, n: torch.Tensor, cols: torch.Tensor,
                  capture: bool) -> tuple:
    """C prompt tokens (the first n real, the rest padding) at rows L..L+C-1, causal among themselves
    and over the committed rows. Returns logits (C, V) and features (C, 3*dim) or None; L advances by n."""
    C, dev = tokens.numel(), tokens.device
    rows = L + torch.arange(C, device=dev)
    mask = attention_mask(torch.ones(C, C, dtype=torch.bool, device=dev).tril_(), L, cols)
    out = model(tokens[None], rows, rows, mask, capture, keep=torch.arange(C, device=dev) < n)
    L.add_(n)
    return (out[0][0], out[1][0]) if capture else (out[0], None)


# ----------------------------------------------------------------------------- the engine
#
# The CUDA-graph contract (torch.compile mode="reduce-overhead", cudagraph trees), which every step
# below follows on any device and the CPU suite checks (tests/test_gpu_contract.py):
#   1. An output of a compiled step lives until the next generation begins (Engine.mark_step: before
#      every round and every prefill chunk) or until the same step runs again. What must outlive it is
#      written into a static buffer inside the step (the next root: Engine.root, written by verify and
#      decode) or cloned (the prompt's last feature, the warm-up's confidences).
#      Checked by check_lifetimes=True: every output is poisoned (NaN, an out-of-range id) as soon as
#      it expires, and every method must stay lossless.
#   2. Every tensor a step reads that lives across rounds (caches, round state, RoPE tables, column
#      indices, the token hash, templates) is allocated once and declared with Engine.static; on a GPU
#      that marks its address static, so a replay reads it in place instead of copying it in.
#   3. Nothing in a step syncs with the host; a round makes one transfer (verify.commit) plus one per
#      checkpoint reached, and host values reach the device by fills of static buffers, not copies.
#   4. A cache row a query may not see is zero or was written by a real node whose logits were checked:
#      padding rows write zeros, and with full attention begin() zeroes the caches.
#   5. Each step has its own code object, so its graphs live in a dynamo cache of their own (Engine.compile),
#      and the verify step takes the tree size as a dynamic dimension: one compile serves every budget.


def own_code(fn, name: str, codes: dict):
    """fn with a code object of its own for the step `name`. Dynamo keeps compiled graphs per code
    object: every step made with functools.partial(verify, model), or every Graft's bound
    `assemble_stage`, would share one cache, whose entries pile up across steps, stages and engines
    until dynamo stops compiling (it then fails: fail_on_recompile_limit_hit). `codes` (one per engine)
    keeps one code object per (function, step), so two methods' instances of a step share their graphs.
    Partials and bound methods keep their arguments and self."""
    if isinstance(fn, partial):          # (torch.compile wraps every partial in one shared function)
        return own_code(_bound(own_code(fn.func, name, codes), fn.args, fn.keywords), name, codes)
    if isinstance(fn, types.MethodType):
        return types.MethodType(own_code(fn.__func__, name, codes), fn.__self__)
    key = (fn.__code__, name)
    if key not in codes:
        codes[key] = fn.__code__.replace(co_name=f"{fn.__code__.co_name}__{name}")
    code = codes[key]
    f = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    f.__kwdefaults__, f.__qualname__, f.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return f


def _bound(func, args: tuple, kwargs: dict):
    """functools.partial as a plain function (own_code gives it a code object of its own)."""
    def step(*more, **kw):
        return func(*args, *more, **kwargs, **kw)
    return step


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

    def __init__(self, eng: "Engine"):
        self.eng, self.live = eng, {}

    def wrap(self, step, name: str):
        def run(*args, **kwargs):
            self.expire(name)
            out = step(*args, **kwargs)
            keep = {t.untyped_storage().data_ptr() for t in tensors_in((args, kwargs)) + self.eng.statics}
            self.live[name] = [t for t in tensors_in(out) if t.untyped_storage().data_ptr() not in keep]
            return out
        return run

    def expire(self, name: str):
        for t in self.live.pop(name, []):
            poison(t)

    def new_generation(self):
        for name in list(self.live):
            self.expire(name)


class Engine:
    """A target with its tokenizer, optional head and continuation matrix, and how its steps run:
    eager, or compiled (inductor on a CPU, CUDA graphs on a GPU), with attention over a window of the
    cache that grows with the context (`window`, a CPU's fastest) or over the whole cache (static
    shapes, what CUDA graphs need). It owns the device-side round state: the committed length L, the
    next root, the sampling seed, and the clock of the round's phases. check_lifetimes: poison every
    step output when it expires (OutputLifetimes; tests)."""

    def __init__(self, model, tokenizer, drafter: Drafter | None, matrix: ContinuationMatrix,
                 compile: bool = False, window: bool = True, chunk: int = PREFILL_CHUNK, backend="inductor",
                 check_lifetimes: bool = False):
        self.model, self.tokenizer, self.drafter, self.matrix = model, tokenizer, drafter, matrix
        self.thresholds, self.hit_rates = None, None
        p = model.embed_tokens.weight
        self.device, self.dtype = p.device, p.dtype
        self.cuda = self.device.type == "cuda"
        self.compiling, self.window, self.chunk, self.backend = compile, window, chunk, backend
        self.statics = []                                   # what lives across rounds (contract rule 2)
        self.step_names, self._codes = set(), {}            # every step compile() made, and their code objects
        self.lifetimes = OutputLifetimes(self) if check_lifetimes else None
        new = lambda: torch.zeros((), dtype=torch.long, device=self.device)
        self.L, self.L_host = new(), 0                      # committed rows, on the device and its host mirror
        self.root, self.root_id = new(), None               # the next round's root (written by the steps)
        self.seed = new()
        self._n, self._head_n = new(), new()                # real tokens of a prefill chunk (filled, not copied)
        self.sampling = Sampling()
        self.clock = Clock(self.device)
        self.compile_seconds = 0.0
        self.budget = None                                  # what the warm-up chose (--budget auto)
        self.calibration = "throughput"                     # the warm-up's: which calibration the methods use,
        self.calibrations, self.budget_curve = {}, {}       # both of them per method, and rate by budget
        self.cost_spread = None                             # the warm-up's timing spread (graft.robust_costs)
        if compile:        # one graph per (step, shape): a run has a few dozen, each compiled once
            torch._dynamo.config.cache_size_limit = 64
            torch._dynamo.config.accumulated_cache_size_limit = 512
            if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
                torch._dynamo.config.fail_on_recompile_limit_hit = True     # never fall back to eager silently
        self._cols = self._head_cols = None
        self.static(self.L, self.root, self.seed, self._n, self._head_n, *matrix.buffers(),
                    token_hash(model.args.vocab_size, self.device))    # sampling's table: read, never built, in a graph
        self.reserve(1, 1)
        self._decode = self.compile(partial(decode_one_token, model), "decode")
        self._verify = self.compile(partial(verify, model), "verify")
        self._prefill = self.compile(partial(prefill_chunk, model), "prefill")
        self._head_prefill = self.compile(drafter.prefill, "head_prefill") if drafter else None

    # -- compilation
    def compile(self, fn, name: str):
        """fn as it runs on this engine: itself, or compiled (a CPU gets inductor; a GPU gets CUDA
        graphs through torch.compile's reduce-overhead mode), with a code object of its own (own_code).
        One graph per shape: P, stage, sampling; the verify step's tree size is dynamic."""
        fn = own_code(fn, name, self._codes)
        self.step_names.add(name)
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

    def mark_step(self):
        """A new generation of step outputs begins (before every round and every prefill chunk): CUDA
        graph trees may now reuse the memory of the previous generation's outputs."""
        if self.compiling and self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        if self.lifetimes:
            self.lifetimes.new_generation()

    def reserve(self, nodes: int, path: int):
        """Make room in the caches for rounds of `nodes` tree nodes and `path` accepted rows (done when
        a method is set up, before anything is compiled)."""
        need = max(nodes, path, self.chunk)
        m = self.model
        if self._cols is None or m.cache.rows < m.max_seq_len + need:
            m.setup_caches(m.max_seq_len, slack=max(need, 64))
            self._cols = torch.arange(m.cache.rows, device=self.device)
            self.static(*m.cache.tensors(), m.rope, self._cols)
        d = self.drafter
        if d is not None and (self._head_cols is None or d.P < path):
            d.setup(m.max_seq_len, max(path, d.P), self.chunk)
            self._head_cols = torch.arange(d.head.cache.rows, device=self.device)
            self.static(*d.buffers(), d.head.rope, self._head_cols)

    def cols(self, n: int, head: bool = False) -> torch.Tensor:
        """The cache rows a step reads: 0..n-1 (window: a size that varies, compiled once as a
        dynamic dimension), or all of them (static)."""
        full = self._head_cols if head else self._cols
        if not self.window:
            return full
        c = full[:n]
        if self.compiling:
            torch._dynamo.mark_dynamic(c, 0)
        return c

    def variant(self, compile: bool, window: bool | None = None) -> "Engine":
        """Another engine on the same model, head, tokenizer and warm-up (compiled beside eager, for
        a comparison in one process)."""
        d = self.drafter
        drafter = Drafter(d.head, self.model.max_seq_len, d.top_k, d.depth, d.P, self.chunk) if d else None
        window = (not (compile and self.cuda)) if window is None else window
        e = Engine(self.model, self.tokenizer, drafter, self.matrix, compile, window, self.chunk, self.backend,
                   self.lifetimes is not None)
        e.thresholds, e.hit_rates, e.budget = self.thresholds, self.hit_rates, self.budget
        e.calibration, e.calibrations, e.budget_curve = self.calibration, self.calibrations, self.budget_curve
        return e

    # -- the steps every method uses
    def begin(self, sampling: Sampling):
        self.sampling = sampling
        self.seed.fill_(sampling.seed)
        self.L.zero_()
        self.L_host = 0
        self.clock.reset()
        if not self.window:          # full attention reads every row: none may hold a previous run's junk
            for t in self.model.cache.tensors() + (self.drafter.head.cache.tensors() if self.drafter else []):
                t.zero_()

    def prefill(self, tokens: torch.Tensor, n: int, capture: bool) -> tuple:
        self._n.fill_(n)
        out = self._prefill(tokens, self.L, self._n, self.cols(self.L_host + tokens.numel()), capture)
        self.L_host += n
        return out

    def head_prefill(self, feats: torch.Tensor, ids: torch.Tensor, n: int):
        d = self.drafter
        self._head_n.fill_(n)
        self._head_prefill(feats, ids, self._head_n, self.cols(d.Ld_host + ids.numel(), head=True))
        d.Ld_host += n

    def decode(self) -> tuple:
        """decode_one_token after self.root, which then holds the next token."""
        return self._decode(None, self.L, self.cols(self.L_host + 1), self.sampling, self.seed, root=self.root)

    def verify(self, tree, P: int, capture: bool = False) -> Verified:
        """verify() at the committed length; the bonus lands in self.root. The tree size is a dynamic
        dimension of the compiled step (one graph for every budget)."""
        if self.compiling:
            for t in (tree.tokens, tree.parents, tree.valid):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return self._verify(tree, self.L, self.cols(self.L_host + tree.tokens.numel()), self.sampling, self.seed,
                            P, capture, root=self.root)


# torch.compile settings on a CPU (inductor's defaults: graphs go to the FX graph cache, so a second
# run starts fast). Measured against max-autotune with freezing in the README.
CPU_COMPILE = {}


# ----------------------------------------------------------------------------- methods

class Plain(Proposer):
    """ar: the root alone, one token a round through decode_one_token."""
    source = None                       # --show-tree: no candidates

    def __init__(self, eng: Engine):
        self.eng = eng

    def round(self, root: torch.Tensor) -> Verified:
        if root is not self.eng.root:
            self.eng.root.copy_(root)
        self.last_tree = chain(root.view(1))
        nxt, finite = self.eng.decode()
        self.eng.clock.mark("verify")
        got = torch.stack([nxt[0], finite.long()]).tolist()     # the round's one host sync
        if not got[1]:
            raise GraftError("the target's logits are not finite (NaN or inf) in this pass: the model overflows "
                             "in this dtype or its weights are broken")
        return Verified(None, nxt[0], None, None, None, None, finite, accepted=[], bonus_id=got[0], from_retrieval=[])


def lookup(ctx: list, ngram: int, n_tokens: int) -> list:
    """Prompt lookup: up to n_tokens tokens that followed the newest earlier occurrence of the last
    ngram, ngram-1, ..., 1 tokens of ctx (a host list of token ids); [] when none recurs."""
    for n in range(min(ngram, len(ctx) - 1), 0, -1):
        tail = ctx[-n:]
        for s in range(len(ctx) - n - 1, -1, -1):
            if ctx[s:s + n] == tail:
                return ctx[s + n:s + n + n_tokens]
    return []


class PromptLookup(Proposer):
    """Prompt lookup decoding: the tokens that followed the newest earlier occurrence of the last n
    committed tokens (n = 3, 2, 1), as a chain. The search runs on the host, over the context."""
    source = "copied"                   # --show-tree: the nodes are copied from the context

    def __init__(self, eng: Engine, cfg: Config):
        self.eng, self.ngram, self.n_tokens = eng, cfg.pld_ngram, cfg.pld_tokens
        self.N = self.P = cfg.pld_tokens + 1
        eng.reserve(self.N, self.P)
        # the chain is built on the host: it reaches the device as one asynchronous copy from pinned
        # memory into a static buffer (row 0 tokens, row 1 whether the node is real), not a blocking one
        self.host = torch.zeros(2, self.N, dtype=torch.long, pin_memory=eng.cuda)
        self.chain = torch.zeros(2, self.N, dtype=torch.long, device=eng.device)
        self.parents = torch.arange(self.N, device=eng.device) - 1
        eng.static(self.chain, self.parents)

    def start(self, prompt: list):
        self.context = list(prompt)

    def lookup(self) -> list:
        return lookup(self.context, self.ngram, self.n_tokens)

    def round(self, root: torch.Tensor) -> Verified:
        e = self.eng
        self.context.append(e.root_id)
        ids = [e.root_id] + self.lookup()
        self.host.zero_()            # free to write: the last round's commit() waited for its copy
        self.host[0, :len(ids)] = torch.tensor(ids)
        self.host[1, :len(ids)] = 1
        self.chain.copy_(self.host, non_blocking=True)
        tree = self.last_tree = Tree(self.chain[0], self.parents, self.chain[1] > 0)
        e.clock.mark("assemble")
        v = e.verify(tree, self.P)
        e.clock.mark("verify")
        commit(v, tree)
        e.clock.mark("update")
        self.context += v.accepted
        return v


# name -> (proposer, what it changes in the round's Config); no method name is looked at after setup
METHODS = {
    "ar": "plain", "eagle3": dict(prune=False, retrieve=False), "prune": dict(retrieve=False), "graft": {},
    "recycle": "recycle", "pld": "pld", "graft-fixed": dict(prune=False, ablation="fixed"),
    "graft-root": dict(prune=False, ablation="root"), "graft-tail": dict(prune=False, ablation="tail"),
}

NEEDS_HEAD = {m for m, v in METHODS.items() if isinstance(v, dict)}

NEEDS_MATRIX = {m for m, v in METHODS.items() if isinstance(v, dict) and v.get("retrieve", True)} | {"recycle"}

PRUNING = {m for m, v in METHODS.items() if isinstance(v, dict) and v.get("prune", True)}     # calibrated


CALIBRATED = {"eagle3": "eagle3", "prune": "prune", "graft": "graft", "graft-fixed": "graft", "graft-root": "graft",
              "graft-tail": "graft"}       # method -> whose calibration it uses


def method_config(eng: Engine, method: str, cfg: Config, auto_budget: bool, calibration: str | None = None) -> Config:
    """cfg with what the warm-up calibrated for `method` (CALIBRATED): its thresholds unless cfg gives
    some (--thresholds), and with auto_budget its budget. calibration: "throughput" or "youden"
    (default: the warm-up's engine.calibration). Unchanged when nothing was calibrated."""
    per = eng.calibrations.get(calibration or eng.calibration, {})
    got = per.get(CALIBRATED.get(method))
    if not got:
        return cfg
    if cfg.thresholds is None and got["thresholds"]:
        cfg = dataclasses.replace(cfg, thresholds=dict(got["thresholds"]))
    if auto_budget:
        cfg = dataclasses.replace(cfg, budget=got["budget"])
    return cfg


def make_method(eng: Engine, method: str, cfg: Config | None = None, matrix: ContinuationMatrix | None = None) -> Proposer:
    """The proposer of a method, set up on this engine (its steps compiled when the engine compiles).
    matrix: its own continuation matrix (default: the engine's, shared)."""
    cfg = cfg or Config()
    matrix = matrix if matrix is not None else eng.matrix
    eng.static(*matrix.buffers())
    if method not in METHODS:
        raise GraftError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
    if method in NEEDS_HEAD and eng.drafter is None:
        raise GraftError(f"--method {method} needs an EAGLE-3 head: pass --draft DIR_OR_HUB_ID")
    kind = METHODS[method]
    if kind == "plain":
        p = Plain(eng)
    elif kind == "pld":
        p = PromptLookup(eng, cfg)
    elif kind == "recycle":
        p = Recycle(eng, cfg, matrix, eng.hit_rates)
    else:
        if cfg.thresholds is None:           # the warm-up's calibration for this method, else the engine's
            cfg = method_config(eng, method, cfg, auto_budget=False)
        if cfg.thresholds is None and eng.thresholds is not None:
            cfg = dataclasses.replace(cfg, thresholds=dict(eng.thresholds))
        cfg = dataclasses.replace(cfg, **kind, top_k=eng.drafter.top_k, depth=eng.drafter.depth)
        p = Graft(eng, cfg, matrix if method in NEEDS_MATRIX else None, eng.hit_rates)
    p.name = method
    return p


# ----------------------------------------------------------------------------- the loop

@dataclass
class Result:
    tokens: list
    prompt_tokens: int
    seconds: float
    rounds: int = 0
    committed: int = 0                   # tokens returned by decode rounds (bonus included)
    draft_forwards: int = 0
    verified: int = 0                    # real candidate nodes verified (root and padding excluded)
    padded: int = 0                      # candidate slots the passes ran at (the tree's size N - 1, padding included)
    from_retrieval: int = 0              # accepted tokens that were retrieved nodes
    accepted: int = 0                    # accepted candidate tokens (bonus excluded)
    syncs: int = 0                       # host syncs in decode rounds
    stages: dict = field(default_factory=dict)
    times: dict = field(default_factory=dict)   # seconds per phase: prefill, draft, assemble, verify, update

    @property
    def mat(self) -> float:
        return self.committed / max(self.rounds, 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.seconds, 1e-9)

    def stats(self) -> dict:
        r = max(self.rounds, 1)
        return {"mat": round(self.mat, 4), "rounds": self.rounds, "draft_forwards": self.draft_forwards,
                "draft_forwards_per_round": round(self.draft_forwards / r, 4),
                "verified_per_round": round(self.verified / r, 4), "padded_per_round": round(self.padded / r, 4),
                "retrieval_share": round(self.from_retrieval / max(self.accepted, 1), 4),
                "syncs_per_round": round(self.syncs / r, 4),
                "round_ms": {k: round(v / r * 1000, 4) for k, v in self.times.items() if k != "prefill"},
                "prefill_ms": round(self.times.get("prefill", 0.0) * 1000, 3),
                "stages": {str(k): v for k, v in sorted(self.stages.items(), key=lambda kv: str(kv[0]))}}


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def prefill(eng: Engine, method: Proposer, ids: list) -> int:
    """The prompt through the target in chunks of eng.chunk tokens (the last one padded), each chunk's
    logits and features handed to the method (the matrix and the head read them); then the first
    token. Returns it (and leaves it in eng.root, a static buffer, and eng.root_id)."""
    C, dev = eng.chunk, eng.device
    t = torch.tensor(ids, dtype=torch.long, device=dev)       # the prompt's one copy to the device
    finite = torch.ones((), dtype=torch.bool, device=dev)
    for s in range(0, len(ids), C):
        n = min(C, len(ids) - s)
        eng.mark_step()                           # each chunk is a generation of its own (the step replays)
        chunk = torch.cat([t[s:s + n], t.new_zeros(C - n)])
        logits, feats = eng.prefill(chunk, n, method.needs_features)
        finite &= rows_finite(logits[:n])
        method.prompt_chunk(chunk, logits, feats, n)
        last = logits[n - 1:n]
    root = choose(last, eng.L.view(1).clone(), eng.sampling, eng.seed)[0]      # L = len(ids): its position
    eng.root.copy_(root)
    got = torch.stack([root, finite.long()]).tolist()
    if not got[1]:
        raise GraftError("the target's logits are not finite (NaN or inf) on the prompt: the model overflows "
                         "in this dtype or its weights are broken")
    eng.root_id = got[0]
    return got[0]


@torch.no_grad()
def generate(eng: Engine, method: Proposer, prompt_ids: list, max_new_tokens: int, sampling: Sampling,
             eos_ids=(), on_tokens=None, on_round=None) -> Result:
    """Decode up to max_new_tokens after the prompt with one method; stops after an EOS. The returned
    counts are of the tokens returned (a round cut at EOS or max_new_tokens counts what it kept).
    on_tokens(tokens) after each round; on_round(method, verified) too (--show-tree)."""
    N = len(prompt_ids)
    if N == 0:
        raise GraftError("empty prompt")
    if N + max_new_tokens > eng.model.max_seq_len:
        raise GraftError(f"prompt ({N} tokens) + --max-new-tokens ({max_new_tokens}) exceeds --max-seq-len "
                         f"({eng.model.max_seq_len})")
    eng.begin(sampling)
    sync(eng.device)
    t0 = time.perf_counter()
    eng.clock.start()
    method.start(prompt_ids)
    root = prefill(eng, method, prompt_ids)
    eng.clock.mark("prefill")
    res = Result(tokens=[root], prompt_tokens=N, seconds=0.0)
    eos = set(eos_ids)
    if on_tokens:
        on_tokens(res.tokens)
    while len(res.tokens) < max_new_tokens and root not in eos:
        eng.mark_step()                     # the last round's step outputs are dead from here on
        v = method.round(eng.root)
        if on_round:
            on_round(method, v)
        A = len(v.accepted)
        eng.L_host += A + 1
        res.rounds += 1
        res.verified += v.nodes
        res.padded += method.N - 1
        res.draft_forwards += v.draft_forwards
        res.syncs += v.syncs
        res.stages[v.stage] = res.stages.get(v.stage, 0) + 1
        # what this round returns: the accepted tokens and the bonus, cut after an EOS and at
        # max_new_tokens. Every count is of returned tokens (Spec-Bench's MAT), not of verified ones.
        new = v.accepted + [v.bonus_id]
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        new = new[:min(cut, max_new_tokens - len(res.tokens))]
        kept = min(len(new), A)                      # accepted tokens among those returned
        res.committed += len(new)
        res.accepted += kept
        res.from_retrieval += sum(v.from_retrieval[:kept])
        res.tokens += new
        root = eng.root_id = v.bonus_id     # (the device copy is in eng.root: verify wrote it)
        if on_tokens:
            on_tokens(res.tokens)
        if res.tokens[-1] in eos:
            break
    sync(eng.device)
    res.seconds = time.perf_counter() - t0
    res.times = eng.clock.read()
    return res


# ----------------------------------------------------------------------------- costs, compile warm-up, checks


# Measuring costs [ours]. On a shared machine one timing of a pass can be off by half (seen: a 9-node
# verify at 43.1 and 26.9 ms, a 13-node one at 18.9 and 33.5), so the calibration never averages a
# run of one size: time_passes interleaves the sizes (a drift of the machine's speed hits each alike)
# and times each call right after an untimed one of the same size; robust_costs takes each size's
# fastest sample (interference only ever adds time: the fastest is the pass without it) and, as the
# measurement's spread, how far the second fastest lies above it; monotone then fits what physics
# says, a bigger tree never costs less; choose_budget prefers the smaller of budgets within that spread.

def time_passes(run, sizes, repeats: int, timer=time.perf_counter, sync=lambda: None) -> dict:
    """Seconds per call of run(n) for each n in `sizes`, `repeats` samples each. Interleaved: round
    robin over the sizes, every other sweep in reverse order; each timed call comes right after an
    untimed call of the same n (warm caches, no first-call costs). timer: seconds (a clock, injected
    in tests); sync: waits for the device before the clock is read. Returns {n: [seconds, ...]}."""
    samples = {n: [] for n in sizes}
    order = list(sizes)
    for r in range(repeats):
        for n in order if r % 2 == 0 else order[::-1]:
            run(n)                   # untimed
            sync()
            t0 = timer()
            run(n)
            sync()
            samples[n].append(timer() - t0)
    return samples


def robust_costs(samples: dict) -> tuple:
    """({n: fastest of samples[n]}, spread). spread, a fraction: how well those minima are pinned, the
    median over the sizes of (second fastest - fastest) / fastest; 0 with fewer than two samples a
    size. samples: {n: [seconds, ...]} (time_passes); the costs are in the samples' units."""
    low = {n: sorted(xs)[:2] for n, xs in samples.items()}
    costs = {n: xs[0] for n, xs in low.items()}
    gaps = [(xs[1] - xs[0]) / xs[0] for xs in low.values() if len(xs) == 2 and xs[0] > 0]
    if not gaps or len(gaps) < len(low):
        return costs, 0.0
    return costs, statistics.median(gaps)


def monotone(costs: dict) -> dict:
    """The non-decreasing fit of {n: cost} over n (isotonic regression, pool adjacent violators): the
    closest costs in least squares under which a bigger n never costs less. Same keys and units."""
    blocks = []                                        # [sum, count] of pooled neighbours, by n
    for n in sorted(costs):
        blocks.append([costs[n], 1, [n]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c, ns = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
            blocks[-1][2] += ns
    return {n: s / c for s, c, ns in blocks for n in ns}


@torch.no_grad()
def pass_cost(eng, sizes: list, context: int = 256, repeats: int = 20, capture: bool = False,
              timer=time.perf_counter, stats: dict | None = None) -> tuple:
    """Milliseconds per target pass over a tree of N nodes after `context` committed tokens, through
    the step decoding uses (compiled when the engine is): N=1 is decode_one_token, larger N the
    verifier. The price of verifying a budget: on a GPU it barely grows with N; on a CPU it does,
    which is what sets the best budget there. (cost_tree: every size shares one verify graph.)
    Measured robustly (graft.time_passes, robust_costs, monotone): `repeats` samples of each N,
    interleaved, each after an untimed pass; the fastest sample of each N; then the non-decreasing
    fit over N. timer: a clock in seconds (tests inject one). stats: a dict that, when given, receives
    "samples" ({N: [seconds]}) and "spread" (the measurement's relative spread, a fraction). Returns
    (context used, {N: ms}): the context shrinks when the cache leaves no room."""
    dev, m = eng.device, eng.model
    context = max(1, min(context, m.max_seq_len - 1))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.args.vocab_size, (context + max(sizes),), generator=g).to(dev)
    eng.begin(Sampling())
    prefill(eng, Plain(eng), ids[:context].tolist())         # once: every pass below is undone after it
    trees = {n: cost_tree(ids[context:context + n]) for n in sizes}

    def one(n):                                      # one pass over n nodes
        tree, P = trees[n]
        eng.mark_step()
        if n == 1 and not capture:
            eng.root.copy_(tree.tokens[0])
            eng.decode()
        else:
            eng.verify(tree, P, capture)
        eng.L.fill_(context)                     # undo what the pass committed

    samples = time_passes(one, list(sizes), repeats, timer, lambda: sync(dev))
    fastest, spread = robust_costs(samples)
    if stats is not None:
        stats.update(samples=samples, spread=spread)
    fit = monotone(fastest)
    return context, {n: round(fit[n] * 1000, 3) for n in sizes}


# The longest path of the trees pass_cost times: a Graft round's (1 + max(draft depth 8, template depth
# 9)). Fixed, so that every size runs through one verify graph (the tree size is dynamic, P is not).
COST_PATH = 10


def cost_tree(tokens: torch.Tensor) -> tuple:
    """A tree of N = tokens.numel() nodes for timing: a chain of min(N, COST_PATH) nodes from the root,
    the others children of the root. Returns (tree, P). (The cost of a pass does not depend on the
    tree's shape, only on N.)"""
    N, dev = tokens.numel(), tokens.device
    P = min(N, COST_PATH)
    idx = torch.arange(N, device=dev)
    parents = torch.where(idx < P, idx - 1, 0)
    return Tree(tokens, parents, torch.ones(N, dtype=torch.bool, device=dev)), P


def compile_warmup(eng: Engine, methods: list, sampling: Sampling = Sampling(), log=None) -> float:
    """Run every compiled step once before anything is timed: a short generation per method, and for
    a pruning method one per stage (thresholds that force it). Returns the seconds it took, which is
    what compilation costs (a second run reads inductor's FX graph cache). The continuation matrix is
    left as it was: what these generations taught it would otherwise reach a warm-up's records."""
    if not eng.compiling:
        return 0.0
    t0 = time.perf_counter()
    kept = {k: v.clone() for k, v in eng.matrix.state_dict().items()}
    ids = eng.tokenizer.encode(WARMUP_PROMPTS[0])[:max(1, eng.model.max_seq_len - 16)] or [0]
    for m in methods:
        forced = [None]
        if isinstance(m, Graft) and m.thresholds:
            forced += list(m.thresholds)
        saved = dict(getattr(m, "thresholds", {}))
        for stage in forced:
            if stage is not None:      # prune at `stage`: never at the checkpoints before it, always at it
                m.thresholds = {c: (0.0 if c < stage else 2.0) for c in saved}
            elif saved:
                m.thresholds = {c: 0.0 for c in saved}
            generate(eng, m, ids, 8, sampling, ())
        if saved:
            m.thresholds = saved
    eng.matrix.load_state_dict(kept)
    eng.compile_seconds += time.perf_counter() - t0
    if log:
        log(f"compile: {time.perf_counter() - t0:.1f}s")
    return time.perf_counter() - t0


def first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# A bf16 mismatch is a near-tie when the two tokens are the target's best two at that position and
# their scores differ by at most this many units in the last place of the logits' magnitude: a 1-row
# and a 61-row product round differently, and across a model's layers that moves logits by a few ulps.
NEAR_TIE_ULPS = 4


@torch.no_grad()
def classify_mismatch(eng, ids: list, base: list, got: list, sampling: Sampling, eps: float | None = None) -> dict:
    """Why `got` (a method's tokens) differs from `base` (ar's) after the prompt `ids`: at the first
    differing position, the target's own scores (a prefill of the context in the engine's dtype:
    logits, or warped logits plus the position's noise when sampling) are computed; the mismatch is
    a "near-tie" when the two tokens are its top two and their gap is at most NEAR_TIE_ULPS x eps x
    the logits' magnitude (eps: the dtype's machine epsilon by default), else "differs". float32 runs
    never call this: there every mismatch is a real difference. Returns {"kind", "position", "gap",
    "tolerance"} (gap and tolerance in score units)."""
    from verify import position_noise, warp
    pos = first_difference(got, base)
    if pos >= min(len(got), len(base)):           # one is a prefix of the other: a stop that differs
        return {"kind": "differs", "position": pos, "gap": None, "tolerance": None}
    ctx = ids + base[:pos]
    keep = {}

    class Last(Proposer):
        def prompt_chunk(self, chunk, logits, feats, n):
            keep["row"] = logits[n - 1].float().clone()
    eng.begin(sampling)
    prefill(eng, Last(), ctx)
    logits = keep["row"]                                                   # (V,) the scores of position len(ctx)
    if sampling.greedy:
        score, scale = logits.double(), 1.0
    else:
        score = warp(logits[None], sampling)[0].double() + position_noise(
            torch.tensor(sampling.seed, device=logits.device), torch.tensor([len(ctx)], device=logits.device),
            logits.numel())[0]
        scale = 1.0 / sampling.temperature
    top = torch.topk(score, 2)
    a, b = base[pos], got[pos]
    eps = torch.finfo(eng.dtype).eps if eps is None else eps
    tol = NEAR_TIE_ULPS * eps * float(logits.abs().max()) * scale
    gap = abs(float(score[a] - score[b]))
    tie = set(top.indices.tolist()) == {a, b} and gap <= tol
    return {"kind": "near-tie" if tie else "differs", "position": pos, "gap": round(gap, 6), "tolerance": round(tol, 6)}
