"""The command line and the decoding loop for every method.

    python generate.py --ckpt Qwen/Qwen3-8B --method graft --chat --prompt "Write a haiku"

Every method proposes a tree each round (tokens, parents; the root is the last committed token) and
the same verifier (verify.py) commits the longest path the target agrees with plus one bonus token:
  ar       the root alone: plain decoding
  eagle3   dense EAGLE-3 tree (budget 60, top_k 10, 8 levels)
  prune    EAGLE-3 stopped at calibrated checkpoints; freed slots left empty (ECHO-style)
  graft    prune, then fill the freed slots from the continuation matrix (this project's point)
  recycle  Token Recycling: an 80-node retrieval tree from the continuation matrix, no draft head
  pld      prompt lookup: copy up to 10 tokens after the last match of the newest 1-3 tokens
  graft-fixed  fixed 40/20 draft/retrieval split, full drafting, no calibration (ablation)
  graft-root   dense 60-node draft plus a 20-node retrieval subtree at the root (ablation)
  graft-tail   dense 60-node draft plus a 20-node retrieval subtree under the best draft leaf (ablation)
"""
import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from model import DTYPES, GraftError, Tokenizer, load_model, load_tokenizer, resolve_checkpoint
from verify import Sampling, choose, verify
from draft import Drafter, load_head
from graft import (CHECKPOINTS, KEEP, PRIOR_HIT_RATES, ContinuationMatrix, build_template, cache_dir,
                   calibrate, graft_trees, load_state, save_state, scaled_keep)

METHODS = ("ar", "eagle3", "prune", "graft", "recycle", "pld", "graft-fixed", "graft-root", "graft-tail")
NEEDS_HEAD = {"eagle3", "prune", "graft", "graft-fixed", "graft-root", "graft-tail"}
NEEDS_MATRIX = {"graft", "recycle", "graft-fixed", "graft-root", "graft-tail"}

# Published EAGLE-3 heads for well-known targets (eagle3.md section 3).
KNOWN_HEADS = {
    "meta-llama/Llama-3.1-8B-Instruct": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
    "lmsys/vicuna-13b-v1.3": "yuhuili/EAGLE3-Vicuna1.3-13B",
    "Qwen/Qwen3-8B": "AngelSlim/Qwen3-8B_eagle3",
}

# The shipped demo pair (checkpoints/): a small Qwen3 pretrained on the stdlib and its EAGLE-3 head.
HERE = os.path.dirname(os.path.abspath(__file__))
DEMO_CKPT = os.path.join(HERE, "checkpoints", "stdlib-qwen3")
DEMO_DRAFT = os.path.join(HERE, "checkpoints", "stdlib-qwen3-eagle3")
DEMO_PROMPT = ('def parse_header(line):\n    """Split a header line into its name and value.\n\n'
               '    Leading and trailing whitespace is removed from both.\n    """\n')

# The verification budget. On a GPU a 61-node tree costs about what one token does (the paper's 60);
# on a CPU verification cost grows with the nodes, and the budget sweep in the README found this best.
GPU_BUDGET, CPU_BUDGET = 60, 16


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


# ----------------------------------------------------------------------------- methods

@dataclass
class Proposal:
    tokens: torch.Tensor               # (N,) root first
    parents: torch.Tensor              # (N,) -1 for the root
    retrieved: torch.Tensor | None = None   # (N,) bool: node came from retrieval (stats only)
    draft_forwards: int = 0
    stage: int | None = None           # checkpoint that pruned, None if not pruned / no draft


def with_root(root: torch.Tensor, tokens, parents, retrieved=None) -> Proposal:
    """Prepend the root to a root-less tree whose parents index it with -1 for the root."""
    dev = root.device
    t = torch.cat([root.view(1), tokens])
    p = torch.cat([torch.tensor([-1], device=dev), torch.where(parents < 0, 0, parents + 1)])
    r = None if retrieved is None else torch.cat([torch.zeros(1, dtype=torch.bool, device=dev), retrieved])
    return Proposal(t, p, r)


@dataclass
class Config:
    method: str = "ar"
    budget: int = 60                   # candidate nodes under the root
    top_k: int = 10                    # draft children per expansion
    depth: int = 8                     # draft levels (draft forwards per round when not pruned)
    checkpoints: tuple = CHECKPOINTS
    keep: tuple | None = None          # draft nodes kept when pruned at each checkpoint (default scaled 8/24/40)
    thresholds: dict | None = None     # tau per checkpoint (default: calibrated in warm-up)
    matrix_k: int = 8
    recycle_size: int = 80
    ablation_size: int = 20            # retrieval nodes added by graft-root / graft-tail; split of graft-fixed
    pld_ngram: int = 3
    pld_tokens: int = 10

    def keep_sizes(self) -> tuple:
        """Draft nodes kept when pruned at each checkpoint: --keep, else the paper's 8/24/40 scaled to
        the budget, else (other checkpoint counts) evenly from 8/60 to 40/60 of the budget."""
        if self.keep:
            return tuple(self.keep)
        if len(self.checkpoints) == len(KEEP):
            return scaled_keep(self.budget)
        n = len(self.checkpoints)
        fr = [KEEP[0] / 60 + (KEEP[-1] - KEEP[0]) / 60 * i / max(n - 1, 1) for i in range(n)]
        return tuple(max(1, min(self.budget - 1, round(f * self.budget))) for f in fr)


class Method:
    """One object per (target, method); it persists across prompts (the matrix stays hot)."""

    def __init__(self, cfg: Config, model, drafter: Drafter | None = None, matrix: ContinuationMatrix | None = None):
        self.cfg, self.model, self.drafter, self.matrix = cfg, model, drafter, matrix
        self.name = cfg.method
        self.needs_features = drafter is not None and cfg.method in NEEDS_HEAD
        self.calib = None                      # a list to collect (confidences, accepted) when warming up
        self._conf = None                      # this round's checkpoint confidences (warm-up only)
        self._templates = {}
        self.hit_rates = PRIOR_HIT_RATES
        self.context: list = []                # committed tokens (prompt lookup reads them)
        self.root: int | None = None           # this round's root
        self.pending = None                    # (features, next tokens) the draft head has yet to read

    # -- bookkeeping shared by all methods
    def begin(self, ids: torch.Tensor, logits: torch.Tensor, feats):
        """After the prefill: ids (N,) prompt, logits (N, V), feats (N, 3H) or None."""
        self.context = ids.tolist()
        if self.drafter is not None and self.needs_features:
            self.drafter.reset()
            self.pending = (feats, ids[1:])
        if self.matrix is not None:
            self.matrix.update(ids, logits)    # seed from the prompt's own prefill logits

    def observe(self, prop: Proposal, v):
        self.context += [self.root] + v.accepted
        if self.needs_features:
            self.pending = (v.feats, prop.tokens[v.path[1:]])
        if self.matrix is not None:
            if self.calib is not None:          # hit rates are measured during warm-up only
                self.matrix.record(prop.tokens, v.target)
            self.matrix.update(prop.tokens, v.logits, v.path)
        if self.calib is not None and self._conf is not None:
            self.calib.append(({c: float(x) for c, x in self._conf.items()}, len(v.accepted)))

    def template(self, n: int, device):
        key = (n, tuple(round(float(a), 4) for a in self.hit_rates))
        if key not in self._templates:
            self._templates[key] = build_template(self.hit_rates, n).to(device)
        return self._templates[key]

    # -- the proposals
    def propose(self, root: int) -> Proposal:
        self.root = root
        dev = self.model.embed_tokens.weight.device
        r = torch.tensor(root, device=dev)
        m, cfg = self.name, self.cfg
        if m == "ar":
            return Proposal(r.view(1), torch.tensor([-1], device=dev))
        if m == "pld":
            return self.prompt_lookup(r)
        if m == "recycle":
            tpl = self.template(cfg.recycle_size, dev)
            toks = self.matrix.retrieve(r, tpl)
            return with_root(r, toks, tpl.parents, torch.ones_like(toks, dtype=torch.bool))
        # draft-based methods
        feats, nxt = self.pending
        h = self.drafter.extend(feats, torch.cat([nxt, r.view(1)]))
        pruning = m in ("prune", "graft")
        record = cfg.checkpoints if self.calib is not None else ()
        tree = self.drafter.draft(h, cfg.depth, checkpoints=self.thresholds_dict() if pruning else None,
                                  record=record)
        self._conf = tree.confidence if self.calib is not None else None
        budget, keep = cfg.budget, cfg.keep_sizes()
        if tree.stopped_at is not None:
            K = keep[cfg.checkpoints.index(tree.stopped_at)]
        elif m == "graft-fixed":
            K = max(budget - cfg.ablation_size, 1)
        else:
            K = budget
        d_tok, d_par = tree.select(K)
        if m in ("eagle3", "prune") or (m == "graft" and K >= budget):
            p = with_root(r, d_tok, d_par)
        else:
            extra = cfg.ablation_size if m in ("graft-root", "graft-tail") else budget - d_tok.numel()
            anchor = tree.deepest_selected(K) if m == "graft-tail" else -1   # tail: under the best deep node
            tpl = self.template(extra + d_tok.numel(), dev)   # room for merges with draft siblings
            toks = self.matrix.retrieve(r if anchor < 0 else d_tok[anchor], tpl)
            t, par, src = graft_trees(d_tok, d_par, toks, tpl, extra, anchor)
            p = with_root(r, t, par, src)
        p.draft_forwards, p.stage = tree.levels, tree.stopped_at
        return p

    def thresholds_dict(self) -> dict:
        th = self.cfg.thresholds or {}
        return {c: float(th.get(c, 0.0)) for c in self.cfg.checkpoints}

    def prompt_lookup(self, r: torch.Tensor) -> Proposal:
        """n-gram prompt lookup: the newest earlier occurrence of the last n tokens (n = 3, 2, 1)."""
        ctx = self.context + [int(r)]
        cont = []
        for n in range(min(self.cfg.pld_ngram, len(ctx) - 1), 0, -1):
            tail = ctx[-n:]
            for s in range(len(ctx) - n - 1, -1, -1):
                if ctx[s:s + n] == tail:
                    cont = ctx[s + n:s + n + self.cfg.pld_tokens]
                    break
            if cont:
                break
        dev = r.device
        toks = torch.tensor(cont, dtype=torch.long, device=dev)
        return with_root(r, toks, torch.arange(len(cont), device=dev) - 1)


# ----------------------------------------------------------------------------- the loop

@dataclass
class Result:
    tokens: list
    prompt_tokens: int
    seconds: float
    rounds: int = 0
    committed: int = 0                   # tokens committed by decode rounds (bonus included)
    draft_forwards: int = 0
    verified: int = 0                    # candidate nodes verified (root excluded)
    from_retrieval: int = 0              # accepted tokens that were retrieved nodes
    accepted: int = 0                    # accepted candidate tokens (bonus excluded)
    stages: dict = field(default_factory=dict)

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
                "verified_per_round": round(self.verified / r, 4),
                "retrieval_share": round(self.from_retrieval / max(self.accepted, 1), 4),
                "stages": {str(k): v for k, v in sorted(self.stages.items(), key=lambda kv: str(kv[0]))}}


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def generate(model, method: Method, prompt_ids: list, max_new_tokens: int, sampling: Sampling,
             eos_ids=(), on_tokens=None) -> Result:
    dev = model.embed_tokens.weight.device
    N = len(prompt_ids)
    if N == 0:
        raise GraftError("empty prompt")
    if N + max_new_tokens > model.max_seq_len:
        raise GraftError(f"prompt ({N} tokens) + --max-new-tokens ({max_new_tokens}) exceeds --max-seq-len "
                         f"({model.max_seq_len})")
    sync(dev)
    t0 = time.perf_counter()
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
    pos = torch.arange(N, device=dev)
    mask = torch.ones(N, N, dtype=torch.bool, device=dev).tril_()
    out = model(ids[None], pos, pos, mask, capture=method.needs_features)
    logits, feats = (out[0][0], out[1][0]) if method.needs_features else (out[0], None)
    root = int(choose(logits[-1:], torch.tensor([N], device=dev), sampling)[0])
    method.begin(ids, logits, feats)
    res = Result(tokens=[root], prompt_tokens=N, seconds=0.0)
    eos = set(eos_ids)
    L = N                                            # committed rows in the KV cache
    if on_tokens:
        on_tokens(res.tokens)
    while len(res.tokens) < max_new_tokens and root not in eos:
        prop = method.propose(root)
        room = model.max_seq_len - L                 # never write past the cache: trim the tree
        if prop.tokens.numel() > room:
            prop.tokens, prop.parents = prop.tokens[:room], prop.parents[:room]
        v = verify(model, prop.tokens, prop.parents, L, sampling, capture=method.needs_features)
        method.observe(prop, v)
        A = len(v.accepted)
        L += A + 1
        res.rounds += 1
        res.committed += A + 1
        res.accepted += A
        res.verified += prop.tokens.numel() - 1
        res.draft_forwards += prop.draft_forwards
        if prop.retrieved is not None and A:
            res.from_retrieval += prop.retrieved[v.path[1:]].sum()     # stays on the device until the end
        res.stages[prop.stage] = res.stages.get(prop.stage, 0) + 1
        new = v.accepted + [v.bonus]
        for i, t in enumerate(new):
            if t in eos:
                new = new[:i + 1]
                break
        res.tokens += new
        root = v.bonus
        if on_tokens:
            on_tokens(res.tokens[:max_new_tokens])
        if res.tokens[-1] in eos:
            break
    res.tokens = res.tokens[:max_new_tokens]
    res.from_retrieval = int(res.from_retrieval)
    sync(dev)
    res.seconds = time.perf_counter() - t0
    return res


# ----------------------------------------------------------------------------- set-up and warm-up

@dataclass
class Engine:
    """A target with its tokenizer, optional head, and the methods built on them."""
    model: object
    tokenizer: Tokenizer
    drafter: Drafter | None
    matrix: ContinuationMatrix | None
    thresholds: dict | None = None
    hit_rates: tuple | None = None


def state_path_for(engine: Engine, *settings) -> str:
    """Warm-up state is cached per (target, head), their weight files' size and date (a retrained
    model in the same folder is a different model) and the settings that shaped it. A target may be a
    single .gguf file."""
    def stamp(path):
        if os.path.isfile(path):
            return [path, os.stat(path).st_size, os.stat(path).st_mtime_ns]
        files = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin")))
        return [path] + [(f, os.stat(os.path.join(path, f)).st_size, os.stat(os.path.join(path, f)).st_mtime_ns)
                         for f in files]
    head = stamp(os.path.abspath(engine.drafter.head.path)) if engine.drafter else "-"
    key = json.dumps([stamp(os.path.abspath(engine.model.path)), head, *settings], default=str)
    return os.path.join(cache_dir(), "warmup-" + hashlib.sha1(key.encode()).hexdigest()[:16] + ".pt")


def build_engine(ckpt, draft=None, device="cpu", dtype="float32", max_seq_len=None, top_k=10, depth=8,
                 matrix_k=8) -> Engine:
    if dtype not in DTYPES:
        raise GraftError(f"unknown --dtype {dtype}: use float32, bfloat16 or float16")
    path = resolve_checkpoint(ckpt)
    tok = load_tokenizer(path)             # first: a missing tokenizer fails before gigabytes load
    model = load_model(path, device=device, dtype=DTYPES[dtype], max_seq_len=max_seq_len)
    drafter = None
    if draft:
        head = load_head(draft, model)
        drafter = Drafter(head, model.max_seq_len, top_k=top_k, depth=depth)
    matrix = ContinuationMatrix(model.args.vocab_size, matrix_k, device=model.embed_tokens.weight.device)
    return Engine(model, tok, drafter, matrix)


def make_method(engine: Engine, cfg: Config) -> Method:
    if cfg.method not in METHODS:
        raise GraftError(f"unknown method {cfg.method!r}: choose from {', '.join(METHODS)}")
    if cfg.method in NEEDS_HEAD and engine.drafter is None:
        raise GraftError(f"--method {cfg.method} needs an EAGLE-3 head: pass --draft DIR_OR_HUB_ID")
    if cfg.thresholds is None and engine.thresholds is not None:
        cfg.thresholds = dict(engine.thresholds)
    m = Method(cfg, engine.model, engine.drafter if cfg.method in NEEDS_HEAD else None,
               engine.matrix if cfg.method in NEEDS_MATRIX else None)
    if engine.hit_rates is not None:
        m.hit_rates = engine.hit_rates
    return m


def warm_up(engine: Engine, cfg: Config, prompts=None, rounds: int = 5, max_new_tokens: int = 64,
            use_cache: bool = True, chat: bool = False, log=None):
    """Fill the continuation matrix, measure per-rank hit rates and calibrate the thresholds by running
    a few generations with the dense tree (GRAFT.md sections 3, 4, 6). Cached per (target, head)."""
    prompts = list(prompts or WARMUP_PROMPTS)[:rounds]
    d = engine.drafter
    path = state_path_for(engine, prompts, max_new_tokens, chat, cfg.checkpoints, cfg.budget, engine.matrix.k,
                          (d.top_k, d.depth) if d else None)
    if use_cache:
        got = load_state(path, engine.matrix)
        if got is not None:
            engine.thresholds = got["thresholds"]
            engine.hit_rates = tuple(got["meta"].get("hit_rates") or PRIOR_HIT_RATES)
            return
    wcfg = Config(**{**cfg.__dict__, "method": "eagle3" if engine.drafter else "recycle", "thresholds": None})
    m = Method(wcfg, engine.model, engine.drafter, engine.matrix)
    m.calib = []
    for p in prompts:
        ids = engine.tokenizer.apply_chat(p) if chat else engine.tokenizer.encode(p)
        if 0 < len(ids) <= engine.model.max_seq_len - max_new_tokens:   # a prompt too long is skipped
            generate(engine.model, m, ids, max_new_tokens, Sampling(), engine.tokenizer.eos_ids)
    engine.matrix.refresh_fallback()
    engine.thresholds = calibrate(m.calib, cfg.checkpoints) if engine.drafter else {}
    rates = engine.matrix.hit_rates()
    engine.hit_rates = tuple(rates.tolist()) if rates is not None else PRIOR_HIT_RATES
    if log:
        log(f"warm-up: {len(prompts)} generations, thresholds "
            f"{ {c: round(t, 3) for c, t in engine.thresholds.items()} }, hit rates "
            f"{[round(a, 3) for a in engine.hit_rates]}")
    if use_cache:
        save_state(path, engine.matrix, engine.thresholds, {"hit_rates": list(engine.hit_rates)})


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Lossless speculative decoding with Graft (and its baselines).")
    p.add_argument("--ckpt", default=None,
                   help="target: a local HF folder, a .gguf file or a hub id (default: the shipped demo model)")
    p.add_argument("--draft", default=None, help="EAGLE-3 head: local folder or hub id (default: known mapping)")
    p.add_argument("--method", default=None, choices=METHODS,
                   help="default: graft when a head is known or given, else ar")
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--chat", action="store_true", help="format the prompt with the checkpoint's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--budget", type=int, default=None,
                   help=f"verification budget: candidate nodes per round (default {GPU_BUDGET} on a GPU, "
                        f"{CPU_BUDGET} on a CPU)")
    p.add_argument("--draft-top-k", type=int, default=10, help="draft children per expansion")
    p.add_argument("--depth", type=int, default=8, help="draft levels")
    p.add_argument("--checkpoints", default="0,1,5", help="checkpoint depths")
    p.add_argument("--keep", default=None, help="draft nodes kept per checkpoint, e.g. 8,24,40")
    p.add_argument("--thresholds", default=None, help="override calibrated taus, e.g. 0.4,0.3,0.2")
    p.add_argument("--recycle-size", type=int, default=80, help="nodes of the recycle method's retrieval tree")
    p.add_argument("--warmup", type=int, default=5, help="warm-up generations (0 = none)")
    p.add_argument("--warmup-file", default=None, help="prompts for warm-up (one per line or jsonl)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the warm-up cache")
    p.add_argument("--compare", action="store_true", help="also run ar and print the speedup")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    return p.parse_args(argv)


def read_prompts(path: str) -> list:
    """One prompt per line, or jsonl with `turns` (first turn) or `prompt`."""
    if not os.path.isfile(path):
        raise GraftError(f"prompt file not found: {path}")
    out = []
    with open(path) as fh:
        lines = [l for l in fh.read().splitlines() if l.strip()]
    for l in lines:
        if l.lstrip().startswith("{"):
            try:
                rec = json.loads(l)
            except json.JSONDecodeError as e:
                raise GraftError(f"bad json line in {path}: {e}") from None
            out.append(rec["turns"][0] if rec.get("turns") else rec.get("prompt", ""))
        else:
            out.append(l.replace("\\n", "\n"))
    return out


def numbers(flag: str, text: str, kind=int) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GraftError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def config_from_args(a, method: str) -> Config:
    cps = tuple(numbers("--checkpoints", a.checkpoints))
    cfg = Config(method=method, budget=a.budget, top_k=a.draft_top_k, depth=a.depth, checkpoints=cps,
                 recycle_size=a.recycle_size)
    if a.recycle_size < 1:
        raise GraftError("--recycle-size must be at least 1")
    if a.keep:
        cfg.keep = tuple(numbers("--keep", a.keep))
        if len(cfg.keep) != len(cps):
            raise GraftError("--keep needs one size per checkpoint")
    if a.thresholds:
        th = numbers("--thresholds", a.thresholds, float)
        if len(th) != len(cps):
            raise GraftError("--thresholds needs one value per checkpoint")
        cfg.thresholds = dict(zip(cps, th))
    if cfg.budget < 1:
        raise GraftError("--budget must be at least 1")
    return cfg


def main(argv=None):
    a = parse_args(argv)
    err = sys.stderr
    if a.ckpt is None:  # the demo: the shipped pair, Graft on a code prompt, compared with plain decoding
        if not os.path.isdir(DEMO_CKPT):
            raise GraftError(f"no --ckpt given and the demo model is missing from {DEMO_CKPT}")
        a.ckpt, a.draft = DEMO_CKPT, a.draft or DEMO_DRAFT
        a.compare = True
        if a.prompt is None and a.prompt_file is None:
            a.prompt = DEMO_PROMPT
        print(f"demo: {os.path.relpath(DEMO_CKPT)} + its EAGLE-3 head, prompt:\n{a.prompt}", file=err)
    draft = a.draft or KNOWN_HEADS.get(a.ckpt)
    method = a.method or ("graft" if draft else "ar")
    dtype = a.dtype or ("bfloat16" if str(a.device).startswith("cuda") else "float32")
    if a.temperature < 0 or not 0 < a.top_p <= 1 or a.top_k < 0:
        raise GraftError("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    if a.max_new_tokens < 1 or a.draft_top_k < 1 or a.depth < 1:
        raise GraftError("need --max-new-tokens, --draft-top-k and --depth >= 1")
    eng = build_engine(a.ckpt, draft if method in NEEDS_HEAD else None, a.device, dtype, a.max_seq_len,
                       a.draft_top_k, a.depth)
    if a.prompt is None and a.prompt_file:
        got = read_prompts(a.prompt_file)
        if not got:
            raise GraftError(f"no prompt in {a.prompt_file}")
        a.prompt = got[0]
    text = a.prompt or ""
    ids = eng.tokenizer.apply_chat(text) if a.chat else eng.tokenizer.encode(text)
    if len(ids) + a.max_new_tokens > eng.model.max_seq_len:
        raise GraftError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({a.max_new_tokens}) exceeds "
                         f"--max-seq-len ({eng.model.max_seq_len})")
    a.budget = a.budget or default_budget(a.device)
    cfg = config_from_args(a, method)
    if method in NEEDS_MATRIX | {"prune"} and a.warmup > 0:
        wp = read_prompts(a.warmup_file) if a.warmup_file else None
        warm_up(eng, cfg, wp, rounds=a.warmup, use_cache=not a.no_cache, chat=a.chat,
                log=lambda s: print(s, file=err))
    s = Sampling(a.temperature, a.top_p, a.top_k, a.seed)
    m = make_method(eng, cfg)
    shown = [""]

    def stream(tokens):
        t = eng.tokenizer.decode(tokens)
        if t.startswith(shown[0]):
            sys.stdout.write(t[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = t

    res = generate(eng.model, m, ids, a.max_new_tokens, s, eng.tokenizer.eos_ids, on_tokens=stream)
    text_out = eng.tokenizer.decode(res.tokens)
    if text_out.startswith(shown[0]):
        sys.stdout.write(text_out[len(shown[0]):])
    sys.stdout.write("\n")
    st = res.stats()
    line = (f"[{method}] {len(res.tokens)} tokens in {res.seconds:.2f}s = {res.tokens_per_s:.1f} tokens/s")
    if method != "ar":
        line += (f", MAT {st['mat']:.2f}, {st['draft_forwards_per_round']:.2f} draft forwards/round, "
                 f"{st['verified_per_round']:.1f} verified/round, retrieval share {st['retrieval_share']:.2f}")
    print(line, file=err)
    out = {"method": method, "prompt_tokens": res.prompt_tokens, "tokens": res.tokens, "text": text_out,
           "seconds": round(res.seconds, 4), "tokens_per_s": round(res.tokens_per_s, 2), **st}
    if a.compare and method != "ar":
        base = generate(eng.model, make_method(eng, Config(method="ar")), ids, a.max_new_tokens, s,
                        eng.tokenizer.eos_ids)
        same = base.tokens == res.tokens
        print(f"[ar] {len(base.tokens)} tokens in {base.seconds:.2f}s = {base.tokens_per_s:.1f} tokens/s; "
              f"{method} speedup {res.tokens_per_s / base.tokens_per_s:.2f}x, identical output: {same}", file=err)
        out.update(ar_tokens_per_s=round(base.tokens_per_s, 2),
                   speedup=round(res.tokens_per_s / base.tokens_per_s, 3), lossless=same)
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
