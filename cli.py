"""What the faces (generate.py, bench.py, train.py) share: engine flags and their checks, loading an
engine from checkpoint files, streamed text, --show-tree rendering, and the one-line error wrapper."""
import argparse
import dataclasses
import math
import os
import platform
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from calibrate import AUTO_BUDGETS, CALIBRATIONS
from checkpoint import (DTYPES, HEAD_PATTERNS, NotCached, cache_budget, free_memory, load_dflash, load_head, load_model,
                        resolve_checkpoint)
from dflash import share_features
from data import PROMPT_FORMATS, read_prompts
from engine import CPU_BUDGET, DEFAULT_MAX_SEQ_LEN, GPU_BUDGET, PREFILL_CHUNK, Engine, Request, default_budget
from engine import generate as generate_one
from graft import METHODS, POLICIES, SOURCES, Config, ContinuationMatrix, Method
import cpu_kernels
from model import GraftError
import quant
import tp
from tokenizer import load_tokenizer
from verify import MIN_TEMPERATURE, Sampling, position_noise, sampling_mode, warp


# ----------------------------------------------------------------------------- command line

def need(ok, msg: str):
    """A check of input: GraftError(msg), one line, when it fails."""
    if not ok:
        raise GraftError(msg)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one `error:` line (a GraftError), like every other bad input."""

    def error(self, message):
        raise GraftError(message)


# Limits of the draft tree's shape: the beam is top_k wide and each level scores top_k^2 paths (EAGLE
# uses 10, SGLang up to 16); a deeper draft than this never pays for its forwards.
MAX_DRAFT_TOP_K, MAX_DEPTH = 64, 32
# The most nodes a verified tree may hold (--budget, --recycle-size, --pld-tokens): 16x the paper's largest
# budget (60); a pass over more costs far more than the tokens it could accept.
MAX_TREE_NODES = 1024


# Warm-up generations before a run (--warmup): all eight generic prompts (calibrate.WARMUP_PROMPTS). The
# continuation matrix starts empty, so the first generations see little to retrieve: after three, graft's
# calibration (bench, SmolLM2, bf16) found retrieval worth nothing at small budgets and chose budget 3 at
# depth 2 unpruned, 1.17x / 1.38x ar on chat / code; after eight, 1 drafted + 2 retrieved nodes at depth 1,
# 1.28x / 1.72x. The demo runs eight too (after two it chose budget 2 unpruned, which its own estimate
# priced below ar, and the demo printed graft at 0.89x): `python generate.py` from a cold cache, the
# kernels' build included, took 60 s on a 2-core CPU. The result is cached: a machine pays for it once.
WARMUP_RUNS = 8


# Tree shapes of other engines' EAGLE-3 defaults (--preset): (--draft-top-k, --depth, --budget,
# --checkpoints). SGLang's --speculative-eagle-topk / --speculative-num-steps /
# --speculative-num-draft-tokens (which counts the root: our budget is one less) as it picks them when
# unset (5/4/8 for Llama targets, else 3/1/4, a chain); vLLM drafts a chain of num_speculative_tokens
# (3 in its EAGLE-3 examples); the paper's dense tree is top-k 10, 8 levels, 60 nodes.
PRESETS = {"sglang-llama": (4, 5, 7, "0,1"), "sglang": (1, 3, 3, "0,1"), "vllm": (1, 3, 3, "0,1"),
           "paper": (10, 8, 60, "0,1,5")}


def add_engine_flags(p, compare_calibrations: bool = False):
    """The flags generate.py and bench.py share: model, sampling and tree shape. bench.py's
    --calibration may name both calibrations, to compare them in one run."""
    p.add_argument("--draft", default=None, help="EAGLE-3 head: local folder or hub id (default: known mapping)")
    p.add_argument("--dflash", default=None, help="DFlash block drafter: local folder or hub id, z-lab's layout "
                                                  "(default: known mapping; methods dflash, graft-tail)")
    p.add_argument("--tail-threshold", type=float, default=None,
                   help="graft-tail's cut: keep the block's guesses up to the first whose drafter probability is "
                        "below this (default: calibrated in the warm-up)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0,
                   help=f"0 (or below {MIN_TEMPERATURE}) = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="format prompts with the checkpoint's chat template")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-seq-len", type=int, default=None, help=f"KV cache length in tokens (default: the model's context, at most "
                                                                 f"{DEFAULT_MAX_SEQ_LEN}; larger up to the context when given)")
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
    p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="the tree shape of another engine's EAGLE-3 default: sets --draft-top-k, --depth, --budget and "
                        "--checkpoints (" + "; ".join(f"{k}: {v[0]}, {v[1]}, {v[2]}, {v[3]}" for k, v in PRESETS.items()) + ")")
    p.add_argument("--draft-top-k", type=int, default=10, help="draft children per expansion")
    p.add_argument("--depth", type=int, default=8, help="draft levels")
    p.add_argument("--checkpoints", default="0,1,5", help="checkpoint depths")
    p.add_argument("--keep", default=None, help="draft nodes kept per checkpoint, e.g. 8,24,40")
    p.add_argument("--thresholds", default=None, help="override calibrated taus, e.g. 0.4,0.3,0.2")
    p.add_argument("--pace", action=argparse.BooleanOptionalAction, default=None,
                   help="cost-aware rounds (the default): a request whose trees do not pay for their cost, as this "
                        "machine measures it while running, takes plain decoding steps for a while, then drafts again "
                        "to see; --no-pace drafts every round")
    p.add_argument("--policy", choices=tuple(POLICIES), default=None,
                   help="how prune and graft prune: stop (drafting stops at a checkpoint below its threshold; "
                        "reads --calibration) or replace (the full tree, nodes below their checkpoint's threshold "
                        "replaced by retrieval; reads Youden's J); default: stop, but replace for a batch under CUDA graphs")
    p.add_argument("--recycle-size", type=int, default=80, help="nodes of the recycle method's retrieval tree")
    p.add_argument("--pld-tokens", type=int, default=Config.pld_tokens,
                   help="tokens of the pld method's chain (a longer chain costs little on a GPU, a row each on a CPU)")
    p.add_argument("--sources", default=",".join(SOURCES),
                   help="what graft's freed slots and recycle's tree retrieve from, comma-separated: matrix (the "
                        "continuation matrix), context (the continuation of the longest earlier match of the recent "
                        "tokens in the prompt and the output so far); default both, merged by one score")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"warm-up generations (0 = none; default {WARMUP_RUNS})")
    p.add_argument("--warmup-file", default=None, help=f"prompts for warm-up ({PROMPT_FORMATS})")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the warm-up cache")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every step (default: on with CUDA, where it means CUDA graphs; off on a CPU)")
    p.add_argument("--attention", choices=("window", "full"), default=None,
                   help="attend over the rows in use (window: a CPU's fastest) or the whole cache (full: static "
                        "shapes, what CUDA graphs need); default: full when compiling on a GPU, else window")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="prompt tokens per prefill pass")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="exact mode: every method's tokens bit-identical to plain decoding's in every dtype (eager, "
                        "CPU). Default: on for an eager CPU run where graft's CPU kernels build (cpu_kernels.py: there it "
                        "costs nothing); --no-exact runs their linear with torch's attention")
    p.add_argument("--quantization", choices=quant.CHOICES, default="none",
                   help="int8: the target's linears as int8 weights with a float32 scale a row, quantized at load "
                        "(half a bfloat16 token's reads; every method still equals ar on the int8 target; quant.py)")


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
    check_sampling(a.temperature, a.top_p, a.top_k, a.seed, a.max_new_tokens)
    if getattr(a, "preset", None) is not None:
        shape = dict(zip(("draft_top_k", "depth", "budget", "checkpoints"), PRESETS[a.preset]))
        given = [k for k, d in (("draft_top_k", 10), ("depth", 8), ("budget", "auto"), ("checkpoints", "0,1,5"))
                 if getattr(a, k) not in (d, None)]
        need(not given, f"--preset {a.preset} sets the tree's shape: drop --" + ", --".join(g.replace("_", "-") for g in given))
        for k, v in shape.items():
            setattr(a, k, str(v) if k == "budget" else v)
    need(a.max_seq_len is None or a.max_seq_len >= 1, f"--max-seq-len must be >= 1, got {a.max_seq_len}")
    need(1 <= a.draft_top_k <= MAX_DRAFT_TOP_K, f"--draft-top-k must be in [1, {MAX_DRAFT_TOP_K}], got {a.draft_top_k}")
    need(1 <= a.depth <= MAX_DEPTH, f"--depth must be in [1, {MAX_DEPTH}], got {a.depth}")
    need(1 <= a.recycle_size <= MAX_TREE_NODES, f"--recycle-size must be in [1, {MAX_TREE_NODES}], got {a.recycle_size}")
    need(1 <= a.pld_tokens <= MAX_TREE_NODES, f"--pld-tokens must be in [1, {MAX_TREE_NODES}], got {a.pld_tokens}")
    need(a.warmup is None or a.warmup >= 0, f"--warmup must be >= 0, got {a.warmup}")
    need(a.dtype is None or a.dtype in DTYPES, f"unknown --dtype {a.dtype}: use float32, bfloat16 or float16")
    need(a.prefill_chunk >= 1, f"--prefill-chunk must be >= 1, got {a.prefill_chunk}")
    check_device(a.device)
    if a.compile is None:
        a.compile = str(a.device).startswith("cuda") and not a.exact
    if a.exact is None:                   # the default: exact where cpu_kernels.py makes it free
        a.exact = not a.compile and not str(a.device).startswith("cuda") and cpu_kernels.ready()
    need(not a.exact or (not a.compile and not str(a.device).startswith("cuda")),
         "--exact runs eager on the CPU (its kernels' row invariance is measured there; not compiled, not on CUDA yet)")
    a.auto_budget = a.budget in (None, "auto") and not budgets
    if a.budget in (None, "auto"):
        a.budget = default_budget(a.device)       # the fallback, and the reference before the warm-up picks
    elif isinstance(a.budget, str):
        a.budget = numbers("--budget", a.budget)[0] if a.budget.strip().lstrip("-").isdigit() else None
        need(a.budget is not None, "--budget takes a number of nodes or auto")
    budgets = budgets or [a.budget]
    need(all(b >= 1 for b in budgets), f"--budget must be >= 1, got {min(budgets)}")
    most = a.draft_top_k + (a.depth - 1) * a.draft_top_k ** 2        # the candidates a full-depth draft holds
    need(max(budgets) <= min(most, MAX_TREE_NODES),
         f"--budget {max(budgets)} exceeds " + (f"the {most} candidate nodes a draft tree of --draft-top-k "
                                                f"{a.draft_top_k} and --depth {a.depth} holds" if most < MAX_TREE_NODES
                                                else f"{MAX_TREE_NODES} nodes, the largest tree a pass verifies"))
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
        read_prompts(a.warmup_file, "--warmup-file")
    sources(a.sources)


def sources(text) -> tuple:
    """--sources: retrieval source names (graft.SOURCES), comma-separated, each once, at least one."""
    names = [x.strip() for x in str(text).split(",")]
    need(all(names) and set(names) <= set(SOURCES) and len(set(names)) == len(names),
         f"--sources takes one or more of {', '.join(SOURCES)}, comma-separated, each once, got {text!r}")
    return tuple(names)


FLAG_NAMES = ("--temperature", "--top-p", "--top-k", "--seed", "--max-new-tokens")
# Past this the distribution is uniform to float32 anyway, and the value still fits the device's float32
# row (1e39 would not: the step would fail for the whole batch).
MAX_TEMPERATURE = 1e4


def check_sampling(temperature, top_p, top_k, seed, max_new_tokens, names=FLAG_NAMES):
    """A request's sampling and length, checked (GraftError, one line with its name from `names`):
    what check_args checks of the flags, and api.py and serve.py of every request."""
    t, p, k, sd, n = names
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)
    need(num(temperature) and math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE,
         f"{t} must be a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}")
    need(num(top_p) and math.isfinite(top_p) and 0 < top_p <= 1, f"{p} must be in (0, 1], got {top_p!r}")
    need(whole(top_k) and 0 <= top_k < 2 ** 31, f"{k} must be an integer in [0, 2^31) (0 = off), got {top_k!r}")
    need(whole(seed) and 0 <= seed < 2 ** 63, f"{sd} must be an integer in [0, 2^63), got {seed!r}")
    need(whole(max_new_tokens) and max_new_tokens >= 1,
         f"{n} must be an integer >= 1, got {max_new_tokens!r}")


def numbers(flag: str, text: str, kind=int) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GraftError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def config_from_args(a) -> Config:
    cps = tuple(numbers("--checkpoints", a.checkpoints))
    cfg = Config(budget=a.budget, top_k=a.draft_top_k, depth=a.depth, checkpoints=cps, recycle_size=a.recycle_size,
                 pld_tokens=a.pld_tokens, policy=getattr(a, "policy", None),
                 sources=sources(getattr(a, "sources", ",".join(SOURCES))))
    if a.keep:
        cfg.keep = tuple(numbers("--keep", a.keep))
    if a.thresholds:
        cfg.thresholds = dict(zip(cps, numbers("--thresholds", a.thresholds, float)))
    cfg.tail_threshold = getattr(a, "tail_threshold", None)
    cfg.pace = getattr(a, "pace", None)
    return cfg


def core_peak(eng) -> float | None:
    """GMAC/s: the core's multiply-add peak for the engine's dtype, measured now on this thread
    (cpu_kernels.peak: the instruction the linear's inner loop runs); None off a CPU or without the kernels."""
    return cpu_kernels.peak(eng.dtype, 0.2) if eng.device.type == "cpu" and cpu_kernels.ready() else None


def cpu_model() -> str | None:
    """The CPU's model as Linux names it (/proc/cpuinfo: name, family, model), e.g. "AMD EPYC (family 25,
    model 17)"; None elsewhere. A virtual machine's name can be as short as that, which is why the family and
    model are kept: they tell a Zen 4 from a Zen 3."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()[:30]                 # the first processor's block
    except OSError:
        return None
    info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}
    name = info.get("model name")
    return name and f"{name} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"


def machine(device) -> dict:
    """A report's meta.machine: where it ran. kernels: the instructions graft's linears run
    (cpu_kernels.isa(), e.g. "avx512_bf16+amx"): two CPUs of one name can differ there, and it decides
    what a tree costs (docs/cpu.md)."""
    cpu = str(device) == "cpu"
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu": cpu_model(), "kernels": cpu_kernels.isa() if cpu else None, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "tp_ranks": tp.world()[1], "python": platform.python_version(),
            "torch": torch.__version__, "device": str(device),
            "gpu": torch.cuda.get_device_name() if str(device).startswith("cuda") else None}


def room(methods: list, drafter_geometry=None, batch: int = 1, graphs: bool = False) -> tuple:
    """(nodes, path): the largest tree and accepted path of the methods [(name, Config), ...] at this
    B, what Engine allocates for. drafter_geometry: (top_k, depth) of the head, when there is one;
    graphs: the engine replays CUDA graphs (Graft's policy, and so its paths, depend on it)."""
    nodes = path = 1
    for name, cfg in methods:
        cls = METHODS[name]
        c = cls.configure(cfg, None, batch, graphs)
        if drafter_geometry and cls.needs_head:
            c = dataclasses.replace(c, top_k=drafter_geometry[0], depth=drafter_geometry[1])
        N, P = cls.shape(c)
        nodes, path = max(nodes, N), max(path, P)
    return nodes, path


def build_engine(ckpt, draft=None, device="cpu", dtype="float32", max_seq_len=None, top_k=10, depth=8,
                 matrix_k=8, compile: bool = False, attention: str | None = None, chunk: int = PREFILL_CHUNK,
                 backend: str = "inductor", check_lifetimes: bool = False, batch: int = 1,
                 methods: list | None = None, more_batches=(), exact: bool = False, dflash=None,
                 quantization: str = "none") -> Engine:
    """Load a target (and a head) and set up the engine with `batch` request slots, its caches sized
    for the largest tree of `methods` [(name, Config), ...] (default: every method at its default
    budget, and the largest budget the warm-up can choose). attention: "window" or "full" (default:
    full when compiling for a GPU, whose CUDA graphs need static shapes; window otherwise).
    check_lifetimes: poison step outputs as they expire (tests; see OutputLifetimes). exact: model.py's
    exact mode (every method's tokens bit-identical to plain decoding's in any dtype). more_batches: batch
    sizes engines on this model will take later (bench --batch), checked against memory here too, before
    the weights load. dflash: a DFlash drafter's folder or hub id (methods dflash, graft-tail).
    quantization: "none" or "int8" (quant.quantize: the target's linears, after the drafters, which keep
    float weights, have read what they share). Errors: GraftError for a bad dtype, quantization or
    attention, a batch < 1, or caches for `batch` requests larger than the memory there is (checked
    before they are allocated)."""
    if dtype not in DTYPES:
        raise GraftError(f"unknown --dtype {dtype}: use float32, bfloat16 or float16")
    if quantization not in quant.CHOICES:
        raise GraftError(f"--quantization must be one of {', '.join(quant.CHOICES)}, got {quantization!r}")
    if type(batch) is not int or batch < 1:
        raise GraftError(f"--batch must be a positive integer, got {batch!r}")
    if attention is None:
        attention = "full" if compile and str(device).startswith("cuda") else "window"
    if attention not in ("window", "full"):
        raise GraftError(f"--attention must be window or full, got {attention!r}")
    if compile and attention == "window" and str(device).startswith("cuda"):
        raise GraftError("--compile on a GPU uses CUDA graphs, which need --attention full")
    path, head_path = resolve_pair(ckpt, draft)
    tok = load_tokenizer(path)             # first: a missing tokenizer fails before gigabytes load
    device = tp.init(device)               # under torchrun: join the ranks (this rank's GPU)
    args = target_args(path)
    shards = tp.shards(args)               # None in a plain process; a world size that does not fit: refused
    args = shards.args if shards else args                               # this rank's part of the target
    if max_seq_len is None:
        max_seq_len = min(DEFAULT_MAX_SEQ_LEN, args.max_position_embeddings)
    max_seq_len = cache_budget(args, max_seq_len, DTYPES[dtype], device)      # the context first, then memory
    if chunk > max(max_seq_len, PREFILL_CHUNK):
        raise GraftError(f"--prefill-chunk {chunk} is longer than --max-seq-len {max_seq_len}: a prompt never needs "
                         f"a chunk longer than the cache")
    if methods is None:
        methods = [(m, Config(budget=max(AUTO_BUDGETS))) for m in METHODS]
    graphs = compile and torch.device(device).type == "cuda"            # (Engine's steps replay CUDA graphs)
    # the sizes from input against the memory there is, before the weights load (the head's cache is
    # counted once it is loaded, below)
    for b in [batch, *more_batches]:
        nodes, longest = room([(m, c) for m, c in methods if draft or not METHODS[m].needs_head], (top_k, depth), b,
                              graphs)
        check_batch_memory(args, max_seq_len, None, b, max(nodes, longest), chunk, matrix_k, DTYPES[dtype], device)
    model = load_model(path, device=device, dtype=DTYPES[dtype], max_seq_len=max_seq_len, shards=shards)
    head = None
    if draft:
        head = load_head(head_path, model)
        if top_k > head.config.draft_vocab_size:
            raise GraftError(f"--draft-top-k {top_k} exceeds the head's draft vocabulary "
                             f"({head.config.draft_vocab_size} tokens)")
    block = cols = None
    if dflash:
        block = load_dflash(dflash, model)
        cols = share_features(model, block, head)      # the target captures what both drafters read
    quant.quantize(model, quantization)
    nodes, longest = room([(m, c) for m, c in methods if (head is not None or not METHODS[m].needs_head)
                           and (block is not None or not METHODS[m].needs_block)], (top_k, depth), batch, graphs)
    if block is not None:
        nodes, longest = max(nodes, block.config.block_size), max(longest, block.config.block_size)
    check_batch_memory(model.args, max_seq_len, head, batch, max(nodes, longest), chunk, matrix_k, DTYPES[dtype],
                       device)
    matrix = ContinuationMatrix(model.args.vocab_size, matrix_k, device=model.embed_tokens.weight.device)
    eng = Engine(model, tok, head, matrix, batch, nodes, longest, top_k, depth, compile=compile,
                 window=attention == "window", chunk=chunk, backend=backend, check_lifetimes=check_lifetimes,
                 exact=exact, dflash=block, dflash_cols=cols)
    if tp.world()[1] > 1:           # what a rank decides from its own clock must agree (the pacer's round times;
        eng.agree = tp.same         # alone, the identity the engine starts with: tp.same reads the environment)
    return eng


def resolve_pair(ckpt: str, draft: str | None) -> tuple:
    """Local paths of the target and its head (None without one), the head's looked up first, and both
    before any weight is read: what is missing from the hub cache offline is named at once, with the
    commands that fetch it. Errors: GraftError, one line."""
    paths, missing = {}, []
    for name, patterns in ((draft, HEAD_PATTERNS), (ckpt, None)):
        if name:
            try:
                paths[name] = resolve_checkpoint(name, patterns)
            except NotCached:
                missing.append(name)
    if missing:
        raise GraftError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in the local hub cache and "
                         f"the hub is offline or unreachable (HF_HUB_OFFLINE is set or there is no network): where there is "
                         "one, run " + " and ".join(f"`hf download {m}`" for m in missing) + ", or pass local folders "
                         "(--ckpt FOLDER" + (", --draft FOLDER" if draft else "") + ")")
    return paths[ckpt], paths.get(draft) if draft else None


def engine_room(eng: Engine, batch: int, methods: list) -> tuple:
    """(nodes, path): the room (room) of `methods` [(name, Config), ...] at `batch` slots on
    eng's model and head (methods needing a head are left out without one), once check_batch_memory
    says their caches fit. Errors: GraftError when they would not."""
    d = eng.drafter
    nodes, path = room([(m, c) for m, c in methods if d is not None or not METHODS[m].needs_head],
                       (d.top_k, d.depth) if d else None, batch, eng.compiling and eng.cuda)
    check_batch_memory(eng.model.args, eng.model.max_seq_len, d.head if d else None, batch, max(nodes, path),
                       eng.chunk, eng.matrix.k, eng.dtype, eng.device)
    return nodes, path


def batch_engine(eng: Engine, batch: int, methods: list) -> Engine:
    """Another engine with `batch` slots on eng's already loaded model, head, tokenizer and prior
    matrix, its steps run as eng's (compiled or eager, attention, prefill chunk), its caches sized for
    `methods` at this B (engine_room: memory checked first). build_engine without loading again."""
    d = eng.drafter
    nodes, path = engine_room(eng, batch, methods)
    bd, cols = eng.dflash_args()
    if bd is not None:
        nodes, path = max(nodes, bd.config.block_size), max(path, bd.config.block_size)
    out = Engine(eng.model, eng.tokenizer, d.head if d else None, eng.matrix, batch, nodes, path,
                 *((d.top_k, d.depth) if d else (10, 8)), compile=eng.compiling, window=eng.window, chunk=eng.chunk,
                 backend=eng.steps.backend, check_lifetimes=eng.steps.lifetimes is not None, exact=eng.exact,
                 dflash=bd, dflash_cols=cols)
    out.agree = eng.agree
    return out


def check_batch_memory(args, max_seq_len: int, head, batch: int, nodes: int, chunk: int, matrix_k: int, dtype,
                       device):
    """Refuse (GraftError, one line) sizes from input whose buffers would not fit the memory there is,
    before they are allocated: per request the target's and the head's KV caches (--max-seq-len rows,
    plus room for the largest of a tree's `nodes` and a prefill `chunk`) and two continuation matrices
    (a method's and the prior's), and one pass's working set (its logits in float32, a few copies for
    sampling, and its attention mask). args: the target's ModelArgs; head: the loaded head or None."""
    size = torch.empty(0, dtype=dtype).element_size()
    rows = max_seq_len + max(nodes, chunk, 64)
    cache = 2 * args.n_layers * args.n_kv_heads * args.head_dim * rows * size
    if head is not None:
        c = head.config.layer
        cache += 2 * c.n_kv_heads * c.head_dim * rows * size
    per = cache + 2 * (args.vocab_size + 1) * (matrix_k * 4 + 1)
    T = max(nodes, chunk)                                          # the rows of the widest pass
    work = batch * T * (4 * 4 * args.vocab_size + rows + 4 * args.dim * 8)
    free = free_memory(device)
    if free is not None and batch * per + work > free:
        raise GraftError(f"--batch {batch} with --max-seq-len {max_seq_len}, trees of {nodes} nodes (--budget, "
                         f"--recycle-size, --pld-tokens) and --prefill-chunk {chunk} needs "
                         f"{(batch * per + work) / 2**30:.1f} GiB "
                         f"({batch * per / 2**30:.1f} GiB of caches, {work / 2**30:.1f} GiB for one pass), more than "
                         f"the {free / 2**30:.1f} GiB free on {device}: lower one of them")


def target_args(path: str):
    """The target's ModelArgs, read from its config (or GGUF metadata) before its weights."""
    from checkpoint import hf_model_args, is_gguf, read_config
    if is_gguf(path):
        from gguf_checkpoint import gguf_model_args, gguf_read
        reader, meta = gguf_read(path)
        return gguf_model_args(meta, {t.name: t for t in reader.tensors}, path)
    return hf_model_args(read_config(path))


def tok_context(path: str) -> int:
    """The model's context (max_position_embeddings), read before its weights."""
    return target_args(path).max_position_embeddings


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
    n_ret = sum(1 for i in real if retrieved[i])
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
        src = "root" if i == 0 else {1: "matrix", 2: "context"}.get(int(retrieved[i]), source)
        return f"{text:<{width}} {src}"

    def walk(i, indent):
        for j, c in enumerate(kids[i]):
            last = j == len(kids[i]) - 1
            lines.append(line(indent + ("└─" if last else "├─"), c))
            walk(c, indent + ("   " if last else "│  "))

    lines.append(line("", 0))
    walk(0, "")
    return "\n".join(lines)



# ----------------------------------------------------------------------------- is a difference a near-tie?

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
    pos = first_difference(got, base)
    if pos >= min(len(got), len(base)):           # one is a prefix of the other: a stop that differs
        return {"kind": "differs", "position": pos, "gap": None, "tolerance": None}
    ctx = ids + base[:pos]
    keep = {}

    class Last(Method):
        def prompt_chunk(self, eng, b, chunk, logits, feats, n):
            keep["row"] = logits[0, -1].float().clone()         # (the prefill's last real row)
    last = Last(eng, Config())
    eng.admit(0, Request(ctx, sampling), last)
    eng.free(0, last)
    logits = keep["row"]                                                   # (V,) the scores of position len(ctx)
    if sampling.greedy:
        score, scale = logits.double(), 1.0
    else:
        t = lambda x, **kw: torch.tensor([x], device=logits.device, **kw)
        mode = sampling_mode([sampling])
        score = warp(logits[None, None], t(sampling.temperature), t(sampling.top_k), t(sampling.top_p), mode)[0, 0].double()
        score = score + position_noise(t(sampling.seed), t(len(ctx)), logits.numel())[0]
        scale = 1.0 / sampling.temperature
    top = torch.topk(score, 2)
    a, b = base[pos], got[pos]
    eps = torch.finfo(eng.dtype).eps if eps is None else eps
    tol = NEAR_TIE_ULPS * eps * float(logits.abs().max()) * scale
    gap = abs(float(score[a] - score[b]))
    tie = set(top.indices.tolist()) == {a, b} and gap <= tol
    return {"kind": "near-tie" if tie else "differs", "position": pos, "gap": round(gap, 6), "tolerance": round(tol, 6)}


class _Count(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def round_work(eng: Engine, method: Method, ids: list, max_new_tokens: int, sampling: Sampling = Sampling()) -> dict:
    """The host's work per decoding round of one generation of `ids` (the prefill excluded), counted,
    not timed: step calls (on a GPU each is a CUDA graph replay), aten ops dispatched outside the steps
    (eager work: each a kernel launch on a GPU, or a host op), and host syncs (the round's own count).
    Counting slows the round, so it runs apart from timed runs; run it after them (or after a
    generation that compiled the steps). Returns {"rounds", "replays_per_round", "eager_ops_per_round",
    "syncs_per_round"}; per-round figures are means."""
    from torch.utils._python_dispatch import _disable_current_modes
    steps, calls, at = eng.steps, [0], {}
    saved = {name: getattr(steps, name) for name in steps.names}

    def watched(step):
        def run(*a, **kw):
            calls[0] += 1
            with _disable_current_modes():        # a step runs as it always does (a mode would change its guards)
                return step(*a, **kw)
        return run
    ops, syncs = _Count(), []

    def first(_tokens):                           # after the prefill: the rounds start here
        at.setdefault("calls", calls[0])
        at.setdefault("ops", ops.n)
    try:
        for name, step in saved.items():
            setattr(steps, name, watched(step))
        with ops:
            generate_one(eng, method, ids, max_new_tokens, sampling, (), on_tokens=first,
                       on_round=lambda rnd, got: syncs.append(rnd.syncs))
    finally:
        for name, step in saved.items():
            setattr(steps, name, step)
    r = max(len(syncs), 1)
    return {"rounds": len(syncs), "replays_per_round": round((calls[0] - at.get("calls", 0)) / r, 3),
            "eager_ops_per_round": round((ops.n - at.get("ops", 0)) / r, 3), "syncs_per_round": round(sum(syncs) / r, 3)}


def run(main, argv=None):
    """A face's entry point: main(argv), a GraftError as one `error:` line (exit 2), ^C as exit 130.
    Under torchrun only rank 0 prints (tp.quiet)."""
    tp.quiet()
    try:
        out = main(argv)
    except GraftError as e:
        print(f"error: {e}", file=sys.stderr)
        tp.end(2)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    tp.end(0)                              # under torchrun: every rank leaves the group, then exits at once
    return out
