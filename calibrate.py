"""Calibration: the warm-up, Youden's and the throughput thresholds, the budget choice, the cache.

docs/graft.md section 6 calibrates a threshold tau_c per checkpoint on warm-up rounds (Youden's J); the
throughput calibration [ours] picks the thresholds, and with --budget auto the budget, that maximise
the expected tokens per second on this machine, from the same rounds and the engine's measured step
costs, measured here robustly (pass_cost: interleaved sizes, the fastest sample, a monotone fit).
The warm-up runs the dense tree; each round returns what the calibration reads (`run(...,
record=True)`), and the result, a graft.Calibration the methods are given, is cached per (target,
head, settings, machine) in safetensors, never pickle.
"""
import statistics
import time
import dataclasses
import hashlib
import json
import math
import os
import sys
from functools import lru_cache

import torch
from tqdm import tqdm

import cpu_kernels
from draft import select
from engine import CALIBRATED, CPU_COMPILE, Engine, Request, compile_warmup, run, sync
from graft import (CHECKPOINTS, MATCH, MAX_TEMPLATE_DEPTH, METHODS, PRIOR_CONTEXT_RATES, PRIOR_HIT_RATES, Calibration,
                   Config, ContinuationMatrix,
                   Template, build_template, context_scores, graft_trees, match_cols, with_chain, with_root)
from verify import Sampling, Tree, sampling_mode


# ----------------------------------------------------------------------------- calibration

def youden_threshold(conf, positive) -> float:
    """tau maximising TPR - FPR for the rule "positive iff conf >= tau" (prune when conf < tau).

    The cut is placed midway between the two confidences it separates. With no negatives it never
    prunes (0.0); with no positives it always prunes (above 1)."""
    conf = torch.as_tensor(conf, dtype=torch.float64).flatten()
    pos = torch.as_tensor(positive, dtype=torch.bool).flatten()
    P, N = int(pos.sum()), int((~pos).sum())
    if N == 0:
        return 0.0
    if P == 0:
        return 1.0 + 1e-6
    order = torch.argsort(conf, descending=True)
    c, p = conf[order], pos[order]
    tpr = p.double().cumsum(0) / P          # predicted positive = the first i+1 (conf >= c[i])
    fpr = (~p).double().cumsum(0) / N
    last = torch.ones_like(p)               # a cut can only sit after the last of equal confidences
    last[:-1] = c[1:] != c[:-1]
    j = torch.where(last, tpr - fpr, torch.tensor(-2.0, dtype=torch.float64))
    i = int(torch.argmax(j))
    if float(j[i]) <= 0:
        return 0.0                          # the confidence says nothing: never prune
    below = float(c[i + 1]) if i + 1 < c.numel() else 0.0
    return (float(c[i]) + below) / 2


def calibrate(records: list, checkpoints=CHECKPOINTS) -> dict:
    """Youden's J per checkpoint (--calibration youden). records: (confidences {c: float}, accepted
    draft length) per dense warm-up round. A round is positive at c when the accepted length went past
    level c+1 (drafting deeper paid off)."""
    taus = {}
    for c in checkpoints:
        rows = [(conf[c], acc > c + 1) for conf, acc in records if c in conf]
        taus[c] = youden_threshold([r[0] for r in rows], [r[1] for r in rows]) if rows else 0.0
    return taus


# Throughput calibration [ours]. Youden's J counts a wrong prune (a round that would have accepted
# several more tokens) the same as a right one (a round that saves a few draft forwards). What matters
# is tokens per second. From dense warm-up rounds we know, per round r, each checkpoint's confidence
# conf_c(r) and, for every stage s a round can end in, the tokens A_s(r) its tree would have accepted
# (the kept draft nodes grafted with their retrieved nodes, matched against what the target then
# generated). The engine's own steps give each stage's round time T_s (draft forwards, assembly, the
# verify pass, the update). Thresholds tau send round r to stage s_r = the first checkpoint c with
# conf_c(r) < tau_c (none: drafted to full depth), and
#
#       rate(tau) = sum_r (A_{s_r}(r) + 1) / sum_r T_{s_r}           tokens per second
#
# is what the thresholds maximise (a search over the cuts between observed confidences).

def stage_of(conf: dict, taus: dict, checkpoints) -> int | None:
    """The stage a round ends in: the first checkpoint whose confidence is below its threshold."""
    return next((c for c in checkpoints if conf[c] < taus[c]), None)


def throughput(rounds: list, taus: dict, cost: dict, checkpoints) -> float:
    """rate(tau) above. rounds: (conf {c: conf_c}, accepted {stage: A_s}) per warm-up round;
    cost {stage: seconds per round} (stage None = drafted to full depth). Tokens per second."""
    stages = [stage_of(conf, taus, checkpoints) for conf, _ in rounds]
    tokens = sum(acc[s] + 1 for (_, acc), s in zip(rounds, stages))
    return tokens / max(sum(cost[s] for s in stages), 1e-12)


def throughput_thresholds(rounds: list, cost: dict, checkpoints=CHECKPOINTS, grid: int = 16, tol: float = 0.0) -> tuple:
    """Thresholds maximising rate(tau) (see above). Each tau_c ranges over 0 (never prune), the
    midpoints between its observed confidences, and above 1 (always prune). Every combination of up to
    `grid` cuts per checkpoint (evenly spaced among them) is scored at once, since checkpoints interact
    (a round pruned early never reaches a later one); coordinate ascent over all cuts then refines the
    best. Deterministic: the first best in grid order wins, and a change must strictly improve the
    rate. With a tie tolerance `tol` (a fraction; tie_tolerance): rates that close are what the
    timings cannot tell apart, so the search stays on a grid of TIE_GRID cuts a checkpoint (neighbouring
    cuts far enough apart that noise does not hop between them; no refinement), and when never pruning
    comes within tol of the best it is the choice. Returns ({c: tau_c}, tokens/s)."""
    checkpoints = tuple(checkpoints)
    m = len(checkpoints)
    conf = torch.tensor([[c[k] for k in checkpoints] for c, _ in rounds], dtype=torch.float64).reshape(len(rounds), m)
    tok = torch.tensor([[a[s] + 1 for s in (*checkpoints, None)] for _, a in rounds], dtype=torch.float64).reshape(len(rounds), m + 1)
    secs = torch.tensor([cost[s] for s in (*checkpoints, None)], dtype=torch.float64)
    cands = []
    for k in range(m):
        seen = torch.unique(conf[:, k])                                         # sorted
        cands.append(torch.cat([torch.zeros(1, dtype=torch.float64), (seen[1:] + seen[:-1]) / 2,
                                torch.full((1,), 1.0 + 1e-6, dtype=torch.float64)]))
    grid = TIE_GRID if tol > 0 else grid
    while grid > 2 and grid ** m * max(len(rounds), 1) > 2e7:       # keep the grid's tensor small
        grid -= 1
    coarse = [v if v.numel() <= grid else v[torch.round(torch.arange(grid) * (v.numel() - 1) / (grid - 1)).long()]
              for v in cands]
    rates = _rates(conf, tok, secs, coarse)                          # (g_0, ..., g_{m-1})
    best = float(rates.max())
    idx = [int(i) for i in torch.unravel_index(torch.argmax(rates), rates.shape)] if m else []
    taus = [float(coarse[k][i]) for k, i in enumerate(idx)]
    improved = tol == 0
    while improved:
        improved = False
        for k in range(m):                      # all of checkpoint k's cuts, the others held
            grids = [torch.tensor([t], dtype=torch.float64) for t in taus]
            grids[k] = cands[k]
            r = _rates(conf, tok, secs, grids).reshape(-1)
            i = int(torch.argmax(r))
            if float(r[i]) > best * (1 + 1e-12):
                best, taus[k], improved = float(r[i]), float(cands[k][i]), True
    never = float(_rates(conf, tok, secs, [torch.zeros(1, dtype=torch.float64)] * m).reshape(-1)[0]) if m else best
    if never >= best * (1 - tol):
        return dict.fromkeys(checkpoints, 0.0), never
    return dict(zip(checkpoints, taus)), best


def _rates(conf, tok, secs, grids) -> torch.Tensor:
    """rate(tau) for every combination of grids[k] (1-D tensors of tau_k): shape (len g_0, ...).
    conf (R, m), tok (R, m + 1) accepted + 1 per stage (the last: full depth), secs (m + 1,)."""
    R, m = tok.shape[0], len(grids)
    if R == 0:                                        # no rounds: no tokens
        return torch.zeros([g.numel() for g in grids], dtype=torch.float64)
    t, c = tok[:, m], secs[m].expand(R)               # (R,): rounds that pass every checkpoint
    for k in reversed(range(m)):                      # an earlier checkpoint decides first
        below = (conf[:, k] < grids[k][:, None]).view(-1, *[1] * (t.dim() - 1), R)   # (g_k, 1.., R)
        t = torch.where(below, tok[:, k], t.unsqueeze(0))
        c = torch.where(below, secs[k], c.unsqueeze(0))
    return t.sum(-1) / c.sum(-1).clamp_min(1e-12)


# Near-equal choices: expected rates within one spread (robust_costs) of the best, and never closer than
# MIN_TIE, are ties (each budget's verify cost is off by about one spread, either way). The rule trades
# two things, both measured on eight recorded cold runs of one warm-up on this 2-core machine, half beside
# a busy neighbour (tests/data/calibration_timings.json, scripts/calibration_timings.py), each replayed 6
# times with its samples resampled (tests/test_inputs.py): how many choices the replays make (identical
# inputs should choose alike), and what a choice costs, its rate under the run's own timings against that
# run's best. Ties to the smaller within 3 spreads or 10% (the rule until now): 13 choices, 4.5% of the
# rate given up on average (up to 24%); within one spread or 4%: 12 choices, 1.4%; no tie rule: 19
# choices, 0.4%; floors of 1%, 2%, 3%: 21, 14, 16 choices. The old rule's bias to small trees cost more on
# a real pair: SmolLM2-135M with its head, bfloat16, one thread, 8 prompts of 128 tokens, interleaved in
# one process: HumanEval graft 1.71x ar at its budget 3 against 1.84x at this rule's 4 (eagle3 1.30x
# against 1.43x), MT-bench graft 1.33x against 1.40x (eagle3 1.29x against 1.26x): the warm-up's chat
# prompts accept less than code does, and a larger tree converts the difference.
TIE_SPREADS = 1
MIN_TIE = 0.04
TIE_GRID = 8


def tie_tolerance(spread: float, floor: float = MIN_TIE) -> float:
    """Rates closer than this fraction of the best are ties: the smaller budget, and never pruning,
    win them (choose_budget, throughput_thresholds), the same way on every run."""
    return max(TIE_SPREADS * spread, floor)


def choose_budget(options: dict, checkpoints=CHECKPOINTS, spread: float = 0.0, floor: float = 0.0) -> tuple:
    """--budget auto: options {shape: (rounds, cost)} as throughput_thresholds reads them, one per
    candidate shape (a budget, or a (budget, draft depth) pair: its keep sizes, its verify pass, its
    draft forwards). Returns (shape, taus, rate, {shape: rate}): the smallest shape whose expected rate
    (tokens/s) is within tie_tolerance(spread, floor) of the best one's (spread: the cost measurement's
    relative spread, a fraction, from robust_costs; 0 and no floor: exact ties only), and the whole
    curve, for the log and the report. Shapes that close are what the timing's noise tells apart, so
    they go to the smaller one (the smaller budget, then the shallower draft), the same way every time."""
    fits, curve, tol = {}, {}, tie_tolerance(spread, floor)
    for b in sorted(options):
        fits[b] = throughput_thresholds(*options[b], checkpoints, tol=tol)
        curve[b] = fits[b][1]
    top = max(curve.values())
    b = next(b for b in sorted(curve) if curve[b] >= top * (1 - max(tol, 1e-12)))
    return (b, *fits[b], curve)


def accepted_by(tree: Tree, truth: list) -> int:
    """The tokens a tree accepts under greedy decoding when the target's continuation after the root
    is `truth` (host ints): the deepest root path spelling a prefix of it. Greedy choices are a
    function of the path, so this is what verifying the tree would have accepted. (On the host: the
    calibration asks it thousands of times about trees of a few dozen nodes.)"""
    tokens, parents, valid = (x.reshape(-1).tolist() for x in (tree.tokens, tree.parents, tree.valid))   # one tree
    depth = [0] * len(tokens)           # a node's depth when its whole root path matches truth, else -1
    for i in range(1, len(tokens)):     # parents first: a node's parent was decided before it
        d = depth[parents[i]] if 0 <= parents[i] < i else -1
        depth[i] = d + 1 if valid[i] and d >= 0 and d < len(truth) and tokens[i] == truth[d] else -1
    return max(depth)


def stage_tree(rec: dict, stage, K: int, R: int, rates, k: int, log_q: torch.Tensor | None = None) -> Tree:
    """The tree a warm-up round would have verified had it ended in `stage` (None: full depth) with K
    draft nodes kept and R retrieved: its candidates (rec["scores"/"tokens"/"parents"], slots past the
    stage's levels left out), grafted with the first K + R nodes of its retrieval (rec["retrieved"],
    best-first, so a smaller template is a prefix of a larger one) and, with log_q (the context hit
    rates' logs, graft.context_scores), the context chain graft's round would offer beside them
    (rec["context"]: match_context's tokens and match length), the R best by score taking the slots."""
    scores = rec["scores"].clone()[None]
    if stage is not None:
        scores[:, k + stage * k * k:] = float("-inf")                # levels not drafted by then
    d_tok, d_par, _, rank = select(scores, rec["tokens"][None], rec["parents"][None], K + R)
    kept = rank < K
    root, yes = torch.tensor([rec["root"]]), torch.ones(1, dtype=torch.bool)
    if not R:
        return with_root(root, *graft_trees(d_tok, d_par, kept, None, None, None, None), yes)
    tpl = _template(tuple(rates), K + R)
    r_tok, r_score = rec["retrieved"][None, :K + R], None
    if log_q is not None and rec.get("context") is not None:         # the chain after the template's nodes
        chain, m = rec["context"]
        T = MAX_TEMPLATE_DEPTH
        real = (torch.arange(T) < len(chain))[None]                                # (1, T)
        r_tok = torch.cat([r_tok, torch.tensor(chain + [0] * (T - len(chain)), dtype=torch.long)[None]], 1)
        r_score = torch.cat([tpl.score[None], context_scores(real, torch.tensor([m]), log_q)], 1)
        tpl = _chained(tuple(rates), K + R)
    return with_root(root, *graft_trees(d_tok, d_par, kept, r_tok, tpl, torch.tensor([-1]), torch.tensor([R]), r_score),
                     yes)


@lru_cache(maxsize=256)
def _template(rates: tuple, n: int) -> Template:
    return build_template(rates, n)


@lru_cache(maxsize=256)
def _chained(rates: tuple, n: int) -> Template:
    return with_chain(_template(rates, n), MAX_TEMPLATE_DEPTH)


# ----------------------------------------------------------------------------- the warm-up


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


CALIBRATIONS = ("throughput", "youden")

# What --budget auto chooses from (verification budgets: candidate nodes per round).
# On a CPU the cheap ones win (a pass over a few nodes costs about a token, a large one grows with the
# nodes; a tree of n nodes also needs a beam of only n and n levels: graft.Method.configure). Budget 1,
# the head's best guess alone (a 2-row pass), pays where a 3-row pass costs ~1.2 tokens and a guess is
# right about half the time (SmolLM2 on code on an AVX2 core: eagle3 1.08-1.13x ar there, 0.96-1.02x at 2).
AUTO_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 60)
# On a GPU a pass over 9 nodes costs what a pass over 3 does, so the budgets under 8 cannot win there;
# compiled, each would add graphs of its own (a verify graph per path length: COST_PATH serves the
# rest; a draft level per beam width). So the eager CPU engine alone prices them.
SMALL_BUDGETS = (1, 2, 3, 4, 6)


def auto_budgets(engine: Engine) -> tuple:
    """The budgets --budget auto prices on this engine: AUTO_BUDGETS eager on a CPU, without
    SMALL_BUDGETS compiled or on a GPU."""
    if engine.device.type == "cpu" and not engine.compiling:
        return AUTO_BUDGETS
    return tuple(b for b in AUTO_BUDGETS if b not in SMALL_BUDGETS)


def needs_warmup(method: str, auto_budget: bool) -> bool:
    """Whether a method needs the warm-up: for the continuation matrix (graft, recycle, the
    ablations), its thresholds (prune, graft), or, under --budget auto, its budget (every method that
    has one: those with a head)."""
    cls = METHODS[method]
    return cls.needs_matrix or bool(cls.settings.get("prune")) or (auto_budget and cls.calibrated is not None)


def warmup_method(cfg: Config, drafter_geometry, auto_budget: bool) -> tuple:
    """(name, Config) of the method the warm-up runs, for the engine's room (cli.room): the dense
    tree at the largest budget it may choose, or recycle without a head."""
    if drafter_geometry is None:
        return "recycle", cfg
    k, D = drafter_geometry
    budgets = [b for b in AUTO_BUDGETS if b <= k + (D - 1) * k * k] if auto_budget else [cfg.budget]
    return "eagle3", dataclasses.replace(cfg, budget=max(budgets))


def warmup_path(engine: Engine, cfg: Config, prompts, rounds: int, max_new_tokens: int, chat: bool,
                auto_budget: bool) -> str:
    """The cache file of this warm-up (state_path_for over every setting that shapes it)."""
    d = engine.drafter
    budgets = tuple(b for b in auto_budgets(engine) if b <= d.C) if auto_budget and d else None
    return state_path_for(engine, list(prompts or WARMUP_PROMPTS)[:rounds], rounds, max_new_tokens, chat,
                          tuple(cfg.checkpoints) if d else (), budgets or cfg.budget, engine.matrix.k,
                          (d.top_k, d.depth) if d else None, engine.B)


def warm_up(engine: Engine, cfg: Config, prompts=None, rounds: int = 5, max_new_tokens: int = 64,
            use_cache: bool = True, chat: bool = False, log=None, calibration: str = "throughput",
            auto_budget: bool = False, pause=None) -> Calibration:
    """The warm-up (calibrate_now), at most one at a time per cache file: runs of one command started
    together take turns on a lock beside it, so the later ones read what the first measured and every
    run chooses the same budget and thresholds (measuring again would see the machine's noise: see
    TIE_SPREADS). With use_cache=False it always measures. pause: called between warm-up rounds and
    between timed samples, never inside one (a server calibrating between its own rounds: api.Calibrating)."""
    path = warmup_path(engine, cfg, prompts, rounds, max_new_tokens, chat, auto_budget) if use_cache else None
    lock = None
    if path is not None:
        try:
            import fcntl
            os.makedirs(os.path.dirname(path), exist_ok=True)
            lock = open(path + ".lock", "a")
            fcntl.flock(lock, fcntl.LOCK_EX)          # released when the file closes
        except (ImportError, OSError):                # no POSIX locks, or a read-only cache folder: go unlocked
            lock = None
    try:
        return calibrate_now(engine, cfg, prompts, rounds, max_new_tokens, path, chat, log, calibration, auto_budget,
                             pause)
    finally:
        if lock is not None:     # removed while held: a run waiting on it then reads the cache; a later one
            try:                 # locks a new file, and reads the cache too
                os.remove(path + ".lock")
            except OSError:
                pass
            lock.close()


def calibrate_now(engine: Engine, cfg: Config, prompts=None, rounds: int = 5, max_new_tokens: int = 64,
                  path: str | None = None, chat: bool = False, log=None, calibration: str = "throughput",
                  auto_budget: bool = False, pause=None) -> Calibration:
    """Fill the continuation matrix (engine.matrix, the prior every request starts from), measure
    per-rank hit rates and calibrate the thresholds by running a few generations with the dense tree
    (docs/graft.md sections 3, 4, 6), on the engine's B slots. Returns the Calibration the methods read.

    Both calibrations are computed, for each calibrated method (eagle3, prune, graft; the ablations use
    graft's): "throughput" picks the thresholds (and, with auto_budget, the budget from AUTO_BUDGETS)
    that maximise the expected tokens/s on this machine (throughput_thresholds); "youden" maximises
    Youden's J per checkpoint at cfg.budget. `calibration` is the one a "stop" method reads by default
    (Calibration.chosen); "replace" reads Youden's (graft.POLICIES). Cached per (target, head) and all
    that changes the measured costs or the warm-up (state_path_for) in `path` (warmup_path; None: not
    read, not written). A prompt too long for the cache
    is skipped, never truncated; a warm-up in which no generation ran, or none left a round long
    enough to score (usable_records), calibrates nothing (the thresholds never prune, with a warning)
    and is not cached."""
    show, log = log is not None, log or (lambda s: None)       # a caller that logs sees progress bars too
    prompts = list(prompts or WARMUP_PROMPTS)[:rounds]
    d = engine.drafter
    checkpoints = tuple(cfg.checkpoints) if d else ()
    budgets = tuple(b for b in auto_budgets(engine) if b <= d.C) if auto_budget and d else None

    def use(calibrations: dict, curve: dict, rates, spread, q) -> Calibration:
        cal = Calibration(calibrations, calibration, tuple(rates or PRIOR_HIT_RATES), curve, spread,
                          tuple(q or PRIOR_CONTEXT_RATES))
        log(f"warm-up: {calibration} calibration: graft budget {cal.budget or cfg.budget}, thresholds "
            f"{ {c: round(t, 3) for c, t in cal.thresholds.items()} }, hit rates {[round(a, 3) for a in cal.hit_rates]}, "
            f"context hit rates by match length {[round(a, 2) for a in cal.context_rates[1:]]}")
        return cal

    if path is not None:
        got = load_state(path, engine.matrix, checkpoints)
        cal = read_calibrations(got["meta"], checkpoints if d else None) if got is not None else None
        if cal is not None:        # (a cache whose calibrations do not fit these settings counts as absent)
            spread = got["meta"].get("cost_spread")
            log(f"warm-up: loaded from {path}")
            return use(*cal, got["meta"].get("hit_rates"),
                       float(spread) if isinstance(spread, (int, float)) and math.isfinite(spread) else None,
                       got["meta"].get("context_hit_rates"))
    name, wcfg = warmup_method(cfg, (d.top_k, d.depth) if d else None, auto_budget)
    m = engine.make(name, wcfg, matrix=engine.matrix)      # the dense tree, learning the prior matrix
    if d:
        m.record_tpl = build_template(PRIOR_HIT_RATES, 2 * wcfg.budget).to(engine.device)
        engine.steps.static(*m.record_tpl.tensors())
    if engine.compiling:
        compile_warmup(engine, [m])
    records, reqs = [], []
    phases = {"draft": [], "update": []}     # per round: seconds a draft forward, seconds the update
    seen = {}

    def record(rnd, got):          # every round, before the next: what the calibration replays
        now = engine.clock.read()
        phases["draft"].append((now.get("draft", 0.0) - seen.get("draft", 0.0)) / max(rnd.forwards, 1))
        phases["update"].append(now.get("update", 0.0) - seen.get("update", 0.0))
        seen.update(now)
        rec = rnd.record
        for b, g in enumerate(got):
            if g is None:
                continue
            bar.update(len(g[0]) + 1)
            r = engine.slots[b].request
            engine.matrix.record(rec["rank"][b], rnd.v.target[b], rnd.tree.valid[b])
            if d:
                records.append({"conf": {c: float(x[b]) for c, x in rec["conf"].items()}, "accepted": len(g[0]),
                                "scores": rec["scores"][b].cpu(), "tokens": rec["tokens"][b].cpu(),
                                "parents": rec["parents"][b].cpu(), "root": int(rnd.tree.tokens[b, 0]),
                                "L": engine.slots[b].L - len(g[0]) - 1, "request": r,
                                "retrieved": rec["retrieved"][b].cpu()})
        if pause:
            pause()
            engine.clock.start()         # the time paused is no phase's

    for p in prompts:
        ids = engine.tokenizer.apply_chat(p) if chat else engine.tokenizer.encode(p)
        if 0 < len(ids) <= engine.model.max_seq_len - max_new_tokens:   # a prompt too long is skipped
            reqs.append(Request(ids))
    engine.clock.timer = cost_timer(engine)         # the costs the calibration reads (measure_costs)
    engine.clock.reset()
    # the bar counts tokens of at most max_new_tokens a generation (one that stops early ends short of it)
    bar = tqdm(total=len(reqs) * max_new_tokens, desc="warm-up", unit="tok", file=sys.stderr, dynamic_ncols=True,
               disable=not show)
    if reqs:
        run(engine, m, reqs, max_new_tokens, engine.tokenizer.eos_ids, on_round=record, record=True)
    bar.close()
    engine.clock.timer = time.perf_counter
    for r in records:              # what the target generated after each round's root: its truth
        full = r["request"].ids + r["request"].tokens
        r["truth"] = full[r["L"] + 1:r["L"] + 1 + d.depth + MAX_TEMPLATE_DEPTH]
        # the context chain graft's retrieval would have offered under this root (graft.context_match)
        r["context"] = match_context(full[:r["L"] + 1], MATCH, MAX_TEMPLATE_DEPTH) if "context" in cfg.sources else None
    engine.matrix.refresh_fallback()
    rates = engine.matrix.hit_rates()
    rates = tuple(rates.tolist()) if rates is not None else PRIOR_HIT_RATES
    q = context_hit_rates(reqs)
    ran = len(reqs)
    calibrated = ran > 0 and (not d or all(any(c in r["conf"] for r in records) for c in checkpoints))
    short = calibrated and d is not None and not usable_records(records, d.depth)
    if not calibrated or short:
        why = (f"ran {ran} of {len(prompts)} generations but left no round long enough to score (each needs "
               f"more than --depth {d.depth} tokens generated after it: every expected rate would be 0)" if short else
               f"ran {ran} of {len(prompts)} generations (prompts longer than --max-seq-len "
               f"{engine.model.max_seq_len} minus {max_new_tokens} are skipped)")
        log(f"warning: warm-up {why}: nothing calibrated, so pruning is off (pass --thresholds to set it), "
            f"the budget stays {cfg.budget}, and nothing is cached")
        return Calibration(hit_rates=rates, context_rates=q)
    calibrations, curve, spread = {}, {}, None
    if d:
        youden = calibrate([(r["conf"], r["accepted"]) for r in records], checkpoints)
        timings = measure_costs(engine, cfg, budgets or (cfg.budget,), rates, phases, pause)
        options, spread = calibration_options(engine, cfg, records, timings,
                                              candidate_shapes(budgets or (cfg.budget,), cfg, d, auto_budget), show, pause, q)
        log(f"warm-up: verify timings' spread {spread:.2%}: rates within {tie_tolerance(spread):.1%} of the best "
            f"are ties, which go to the smaller budget, the shallower draft and to never pruning")
        calibrations = {"throughput": {}, "youden": {}}
        for method, opts in options.items():
            (b, depth), taus, rate, by_shape = choose_budget(opts, checkpoints if method != "eagle3" else (), spread, MIN_TIE)
            taus = {c: (t if c < depth else 0.0) for c, t in taus.items()}     # a checkpoint never reached
            curve[method] = {x: max(r for (y, _), r in by_shape.items() if y == x) for x, _ in by_shape}
            calibrations["throughput"][method] = {"budget": b, "depth": depth, "rate": round(rate, 3),
                                                  "thresholds": taus if method != "eagle3" else {}}
            calibrations["youden"][method] = {"budget": cfg.budget, "rate": None,
                                              "thresholds": youden if method != "eagle3" else {}}
            log(f"warm-up: {method}: expected tokens/s by budget (its best draft depth): " +
                ", ".join(f"{x}: {r:.1f}" for x, r in curve[method].items()) +
                f" -> budget {b}, depth {depth}, thresholds { {c: round(t, 3) for c, t in taus.items()} }")
        log(f"warm-up: Youden's J thresholds { {c: round(t, 3) for c, t in youden.items()} } "
            f"(--calibration youden, budget {cfg.budget})")
    log(f"warm-up: {ran} of {len(prompts)} generations ran")
    cal = use(calibrations, curve, rates, spread, q)
    if path is not None:
        save_state(path, engine.matrix, cal.thresholds if d else {},
                   {"hit_rates": list(rates), "context_hit_rates": list(q), "generations": ran, "cost_spread": spread,
                    "calibrations": {n: {m: {**c, "thresholds": {str(k): float(t) for k, t in c["thresholds"].items()}}
                                         for m, c in per.items()} for n, per in calibrations.items()},
                    "budget_curve": {m: {str(b): r for b, r in c.items()} for m, c in curve.items()}})
    return cal


def tail_accepted(conf: list, A: int, retrieved: list, parents: list, truth: list, tau: float) -> int:
    """What a graft-tail round would have accepted at cut tau (greedy): conf (n,) the block's
    confidences, A what the whole block (dflash's chain) accepted, retrieved[K] (n,) the template's
    tokens under guess K-1 (K = 0: the root), parents (n,) the template's (-1: under that guess),
    truth the target's continuation after the root (at least n tokens). On the host."""
    n = len(conf)
    K = next((i for i, c in enumerate(conf) if c < tau), n)
    if K == n or K > A:              # nothing cut, or the chain broke inside the kept prefix
        return A
    depth, best = [0] * (n - K), 0   # the retrieval subtree's first n - K nodes, matched against truth[K:]
    for i in range(n - K):
        d = 0 if parents[i] < 0 else depth[parents[i]]
        ok = (parents[i] < 0 or d > 0) and K + d < len(truth) and retrieved[K][i] == truth[K + d]
        depth[i] = d + 1 if ok else 0
        best = max(best, depth[i])
    return K + best


def calibrate_tail(engine: Engine, cal: Calibration | None, prompts=None, rounds: int = 5, max_new_tokens: int = 64,
                   chat: bool = False, log=None, use_cache: bool = True) -> float:
    """graft-tail's cut tau (docs/graft.md section 11): a few dflash generations on the warm-up prompts
    (a copy of the warmed-up matrix, so the prior is left as it was) record every round's block
    confidences and, for every possible cut, the retrieval the matrix offered then; tau is the cut that
    maximises the tokens those rounds would have accepted (the same verify size at every tau, so the
    same tokens per second; ties go to the smaller tau, 0 being dflash's chain). Sets
    cal.tail_threshold and returns tau. Cached (tail_path: the drafter's bytes, the matrix it started
    from, every setting), like the warm-up; use_cache=False computes it afresh."""
    log = log or (lambda s: None)
    cal = cal if cal is not None else Calibration()
    path = tail_path(engine, prompts, rounds, max_new_tokens, chat) if use_cache else None
    tau = read_tail(path) if path else None
    if tau is not None:
        cal.tail_threshold = tau
        log(f"warm-up: graft-tail: cut tau {tau:.3f} (cached: {path})")
        return tau
    m = engine.make("graft-tail", Config(tail_threshold=0.0), cal, engine.matrix.copy())
    if engine.compiling:
        compile_warmup(engine, [m])
    recs = []

    def record(rnd, got):
        for b, g in enumerate(got):
            if g is not None:
                A = len(g[0])
                recs.append((rnd.record["conf"][b].tolist(), A, rnd.record["retrieved"][b].tolist(),
                             engine.slots[b].request, engine.slots[b].L - A - 1))

    reqs = []
    for p in list(prompts or WARMUP_PROMPTS)[:rounds]:
        ids = engine.tokenizer.apply_chat(p) if chat else engine.tokenizer.encode(p)
        if 0 < len(ids) <= engine.model.max_seq_len - max_new_tokens:
            reqs.append(Request(ids))
    if reqs:
        run(engine, m, reqs, max_new_tokens, engine.tokenizer.eos_ids, on_round=record, record=True)
    n, parents = m.N - 1, m.tpl.parents.tolist()
    rows = []
    for conf, A, ret, r, L in recs:
        full = r.ids + r.tokens
        truth = full[L + 1:L + 1 + n]
        if len(truth) == n:          # the last rounds of a generation see too little of what followed
            rows.append((conf, A, ret, truth))
    cuts = sorted({round(c, 6) for row in rows for c in row[0]})
    taus = [0.0] + [(a + b) / 2 for a, b in zip(cuts, cuts[1:])] + [1.0 + 1e-6]
    if len(taus) > 65:               # at most 64 cuts: quantiles of the observed confidences
        taus = [0.0] + [taus[round(i * (len(taus) - 1) / 63)] for i in range(1, 64)] + [1.0 + 1e-6]
    best, best_tau, base = -1, 0.0, sum(row[1] for row in rows)
    for tau in taus:
        got = sum(tail_accepted(conf, A, ret, parents, truth, tau) for conf, A, ret, truth in rows)
        if got > best:
            best, best_tau = got, tau
    cal.tail_threshold = best_tau
    if rows:
        log(f"warm-up: graft-tail: cut tau {best_tau:.3f}: {len(rows)} rounds would have committed MAT "
            f"{(best + len(rows)) / len(rows):.2f} (dflash's chain: {(base + len(rows)) / len(rows):.2f})")
        if path:
            write_tail(path, best_tau, len(rows))
    else:       # (not cached: a later run with other prompts may find rounds to score)
        log("warning: the graft-tail calibration left no round to score: tau 0 (graft-tail runs as dflash)")
    return best_tau


def tail_path(engine: Engine, prompts, rounds: int, max_new_tokens: int, chat: bool) -> str:
    """The cache file of graft-tail's cut: state_path_for's key (target, head, dtype, kernels, ...) with
    the DFlash drafter's bytes, a digest of the matrix the calibration starts from (the warm-up's, so
    a warm-up on other prompts gives another file) and the calibration's own settings."""
    d = hashlib.sha1()
    for v in engine.matrix.state_dict().values():
        d.update(v.detach().cpu().contiguous().numpy().tobytes())
    drafter = os.path.abspath(engine.block.model.path) if engine.block is not None else "-"
    key = state_path_for(engine, "graft-tail", TAIL_FORMAT, [drafter, content_stamp(drafter) if drafter != "-" else "-"],
                         d.hexdigest(), list(prompts or WARMUP_PROMPTS)[:rounds], rounds, max_new_tokens, chat)
    return os.path.join(os.path.dirname(key), "tail-" + os.path.basename(key).split("-", 1)[1].split(".")[0] + ".json")


TAIL_FORMAT = 2        # bump when what calibrate_tail computes changes (2: the record's root fixed)


def read_tail(path: str) -> float | None:
    """The cached cut, or None when the file is absent, unreadable or not a cut in [0, 1 + 1e-6]."""
    try:
        with open(path) as fh:
            tau = json.load(fh)["tau"]
        return float(tau) if isinstance(tau, (int, float)) and 0 <= tau <= 1 + 1e-6 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_tail(path: str, tau: float, rounds: int):
    """Cache the cut (JSON, written atomically); a cache that cannot be written only warns."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as fh:
            json.dump({"tau": tau, "rounds": rounds}, fh)
        os.replace(tmp, path)
    except OSError as e:
        print(f"warning: could not save graft-tail's cut to {path}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)


def read_calibrations(meta: dict, checkpoints) -> tuple | None:
    """(calibrations, budget_curve) from a cache file's JSON, or None when they are malformed or do not
    fit (checkpoints None: a warm-up without a head, which calibrates nothing)."""
    try:
        cal = {n: {m: {"budget": int(c["budget"]), "rate": None if c.get("rate") is None else float(c["rate"]),
                       "thresholds": {int(k): float(t) for k, t in c["thresholds"].items()},
                       **({"depth": int(c["depth"])} if "depth" in c else {})}
                   for m, c in per.items()} for n, per in meta.get("calibrations", {}).items()}
        curve = {m: {int(b): float(r) for b, r in c.items()} for m, c in meta.get("budget_curve", {}).items()}
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
    if checkpoints is None:
        return (cal, curve) if not cal else None
    ok = set(cal) == set(CALIBRATIONS) and all(
        set(per) == {c.calibrated for c in METHODS.values() if c.calibrated} and all(
            c["budget"] >= 1 and c.get("depth", 1) >= 1 and set(c["thresholds"]) == (set() if m == "eagle3" else set(checkpoints))
            and all(math.isfinite(t) and 0 <= t <= 1 + 1e-6 for t in c["thresholds"].values())
            for m, c in per.items()) for per in cal.values())
    return (cal, curve) if ok else None


def match_context(ctx: list, G: int, T: int) -> tuple:
    """graft.context_match for one request on the host (the warm-up's measurement, and the
    tests' reference): (continuation tokens, at most T; the match's length m)."""
    n, best, m = len(ctx), -1, 0
    for j in range(n - 2, -1, -1):                     # newest first: a longer match later replaces it
        r = 0
        while r < G and j - r >= 0 and ctx[j - r] == ctx[n - 1 - r]:
            r += 1
        if r > m:
            best, m = j, r
    return (ctx[best + 1:min(best + 1 + T, n)] if m else []), m


# Pseudo-counts of the prior (PRIOR_CONTEXT_RATES) in each measured context hit rate: a warm-up of a
# few generations sees few matches of some lengths, and a rate from two trials would say 0 or 1.
CONTEXT_PRIOR_WEIGHT = 4.0


def context_hit_rates(requests: list, prior=PRIOR_CONTEXT_RATES, weight: float = CONTEXT_PRIOR_WEIGHT) -> tuple:
    """q(m), m = 0..MATCH: how often the next token of a context continuation (graft.context_match)
    was the target's, after the previous ones were, by the length m of the match, over every position
    of the warm-up's generated text (on the host: once, after the warm-up), smoothed towards the prior
    with `weight` pseudo-counts. q(0) = 0: no match offers nothing. The graft retrieval tree scores a
    context node t tokens down a match of m by q(m)^t, beside the matrix's products of hit rates."""
    hits, trials = [0] * (MATCH + 1), [0] * (MATCH + 1)
    for r in requests:
        full = r.ids + r.tokens
        for p in range(len(r.ids), len(full) - 1):              # the root at p, the truth after it
            chain, m = match_context(full[:p + 1], MATCH, MAX_TEMPLATE_DEPTH)
            for t, tok in enumerate(chain):
                if p + 1 + t >= len(full):
                    break
                trials[m] += 1
                if tok != full[p + 1 + t]:
                    break
                hits[m] += 1
    return (0.0,) + tuple((hits[m] + weight * prior[m]) / (trials[m] + weight) for m in range(1, MATCH + 1))


def usable_records(records: list, depth: int) -> list:
    """The warm-up rounds the calibration can score: those followed by more than `depth` generated
    tokens (the last rounds of a generation see too little of what the target went on to say)."""
    return [r for r in records if len(r["truth"]) > depth]


@torch.no_grad()
def measure_costs(eng: Engine, cfg: Config, budgets, rates, phases: dict, pause=None) -> dict:
    """The samples the calibration's costs come from, in seconds: {"draft": per warm-up round, the
    seconds a draft forward took; "update": per round, the update's seconds (both from the warm-up's
    own clock, `phases`); "assemble": {widest budget: samples} (assembly_samples; its cost barely
    depends on the budget: a top-k over every drafted candidate, then a template fill, on a GPU one
    graph replay; timed once, at the widest budget, an upper bound, so the warm-up builds one graft
    instance and compiles one assemble graph, not one per budget: 0.6-1.3 ms at every budget on the
    demo pair, eager, no trend); "verify": {N: samples}, a
    target pass over B trees of N nodes (pass_cost: interleaved, each after an untimed pass)}. Plain
    lists of floats: what a test replays (a real run's timings, saved) to show the choice holds.
    pause: called between samples (time_passes)."""
    stats = {}
    pass_cost(eng, sorted({b + 1 for b in budgets}), repeats=8, capture=True, timer=cost_timer(eng), stats=stats,
              pause=pause)
    d = eng.drafter
    widths = sorted({min(d.top_k, b) for b in budgets}) if d is not None else []
    return {"draft": list(phases["draft"]), "update": list(phases["update"]),
            "assemble": {max(budgets): assembly_samples(eng, dataclasses.replace(cfg, budget=max(budgets)), rates,
                                                        pause=pause)},
            "verify": {n: list(xs) for n, xs in stats["samples"].items()},
            "level": {k: list(xs) for k, xs in level_samples(eng, widths, pause=pause).items()}}


def level_samples(eng: Engine, widths: list, repeats: int = 5, pause=None) -> dict:
    """Seconds of one draft level (Drafter.level: a head forward over B x k beam nodes and its top k)
    at each beam width k: a budget of n nodes drafts with a beam of min(top_k, n) (graft.Method.configure),
    and a narrow level costs less than the warm-up's full-width one. {k: samples}, interleaved, each
    after an untimed call, on the drafter's state the warm-up left (its scratch rows only are written).
    pause: called between samples (time_passes)."""
    if not widths:
        return {}
    d, cols = eng.drafter, eng.cols((eng.drafter.depth - 1) * eng.drafter.top_k, head=True)

    def one(k):
        eng.steps.mark()
        eng.steps.level(eng.fills.level[0], cols, k)
    return time_passes(one, widths, repeats, cost_timer(eng), lambda: sync(eng.device), pause=pause)


def robust_round_costs(timings: dict) -> tuple:
    """(t_fwd, t_upd, t_asm, {N: t_ver}, spread), seconds, from measure_costs' samples: the
    fastest sample of each (interference on a shared machine only ever adds time, so the fastest is
    the cost without it; robust_costs), the verify costs made non-decreasing in N (monotone), and the
    relative spread of the verify samples (how well those minima are pinned: the tie tolerance)."""
    low = lambda xs: min(xs) if xs else 0.0
    ver, spread = robust_costs(timings["verify"])
    return (low(timings["draft"]), low(timings["update"]), low(timings["assemble"][max(timings["assemble"])]),
            monotone(ver), spread)


def candidate_shapes(budgets, cfg: Config, drafter, auto_budget: bool) -> list:
    """The (budget, draft depth) pairs the calibration prices: at each budget the depth its tree
    reaches (min(--depth, budget), graft.Method.configure), and under --budget auto every shallower
    one too (a head forward saved per level against the tokens the deeper levels would have added:
    on the CPU at budget 3, depth 2 ran 1.16x ar where depth 3 ran 1.08x, mt_bench, interleaved)."""
    top = lambda b: min(drafter.depth, cfg.depth, b)
    return [(b, D) for b in budgets for D in (range(1, top(b) + 1) if auto_budget else (top(b),))]


@torch.no_grad()
def calibration_options(eng: Engine, cfg: Config, records: list, timings: dict, shapes: list, show: bool = False,
                        pause=None, context_rates=None) -> tuple:
    """({method: {(budget, depth): (rounds, cost)}}, spread): the options as choose_budget reads them,
    for eagle3, prune and graft, and the relative spread of the verify timings (a fraction, its
    tolerance). rounds: each usable warm-up round's confidences and, per stage, the tokens its tree
    would have accepted (stage_tree, matched against what the target generated); cost: seconds per
    round per stage, from this engine's own steps, robust statistics of `timings` (measure_costs, or a
    replay of a saved run): the draft forwards, the assembly, the verify pass at B + 1 nodes, the update.
    context_rates: q(m) (context_hit_rates): graft's trees then hold the context chain too. A draft of
    depth D drafts levels 1..D; a checkpoint at or past D is never reached, so a round "stopped" there
    is the round drafted to depth D."""
    d = eng.drafter
    k = d.top_k
    costs, spread = stage_costs(eng, cfg, timings, shapes)
    usable = usable_records(records, d.depth)
    memo = {}
    log_q = None if context_rates is None else torch.tensor([math.log(x) if x > 0 else float("-inf")
                                                              for x in context_rates])

    def acc(i, s, K, R):          # a tree that two options share is matched once
        if (i, s, K, R) not in memo:
            r = usable[i]
            memo[(i, s, K, R)] = accepted_by(stage_tree(r, s, K, R, PRIOR_HIT_RATES, k, log_q), r["truth"])
        return memo[(i, s, K, R)]

    out = {"eagle3": {}, "prune": {}, "graft": {}}
    for b, D in tqdm(shapes, desc="calibration", unit="shape", file=sys.stderr, dynamic_ncols=True, disable=not show):
        if pause:
            pause()
        for method in out:
            stages = METHODS[method].configure(dataclasses.replace(cfg, budget=b, depth=D, keep=None, policy="stop"),
                                               d).stages()
            full = stages[None]
            at = {s: (s, *KR) if s is not None and s < D else (D - 1, *full) for s, KR in stages.items()}
            rounds = [(r["conf"], {s: acc(i, *at[s]) for s in stages}) for i, r in enumerate(usable)]
            out[method][(b, D)] = (rounds, costs[method][(b, D)])
    return out, spread


def stage_costs(eng: Engine, cfg: Config, timings: dict, shapes: list) -> tuple:
    """({method: {(budget, depth): {stage: seconds a round}}}, spread) for eagle3, prune and graft: per
    stage a round ends in, its draft forwards (a checkpoint at or past the depth is never reached: the
    full draft's), the assembly, the verify pass over budget + 1 nodes and the update, robust
    statistics of `timings` (robust_round_costs)."""
    d = eng.drafter
    t_fwd, t_upd, t_asm, t_ver, spread = robust_round_costs(timings)
    # a draft forward at a budget's beam width: measured (level_samples), else the warm-up's full-width one
    t_lvl = {k: min(xs) for k, xs in timings.get("level", {}).items() if xs}
    out = {}
    for method in ("eagle3", "prune", "graft"):
        for b, D in shapes:
            c = METHODS[method].configure(dataclasses.replace(cfg, budget=b, depth=D, keep=None, policy="stop"), d)
            fwd = t_lvl.get(c.top_k, t_fwd)
            out.setdefault(method, {})[(b, D)] = {
                s: (c.depth if s is None or s >= c.depth else s + 1) * fwd + t_asm + t_ver[b + 1] + t_upd
                for s in c.stages()}
    return out, spread


def assembly_samples(eng: Engine, cfg: Config, rates, repeats: int = 5, pause=None) -> list:
    """Seconds of one keep-retrieve-graft step (graft.assemble, one graph for every stage) on the
    drafter's current candidates: `repeats` samples, each after an untimed call."""
    # made without eng.make's room check: nothing is verified, and the room (warmup_method's dense
    # tree, cli.room) need not hold graft's deeper retrieval paths
    g = METHODS["graft"](eng, dataclasses.replace(cfg, policy="stop"), Calibration(hit_rates=rates), eng.matrix.copy())
    eng.steps.static(*g.tensors())
    g.ctx_cols = match_cols(g, eng)                  # what a round's match reads (as Eagle3Tree.round sets it)

    def one(_):
        eng.steps.mark()
        eng.steps.assemble(g, eng.root, eng.active)
    return time_passes(one, [0], repeats, cost_timer(eng), lambda: sync(eng.device), pause)[0]


# ----------------------------------------------------------------------------- measured costs

# Measuring costs [ours]. On a shared machine one timing of a pass can be off by half (seen: a 9-node
# verify at 43.1 and 26.9 ms, a 13-node one at 18.9 and 33.5), so the calibration never averages a
# run of one size: time_passes interleaves the sizes (a drift of the machine's speed hits each alike)
# and times each call right after an untimed one of the same size; robust_costs takes each size's
# fastest sample (interference only ever adds time: the fastest is the pass without it) and, as the
# measurement's spread, how far the second fastest lies above it; monotone then fits what physics
# says, a bigger tree never costs less; choose_budget prefers the smaller of budgets within that spread.
# On a CPU every cost is CPU time (cost_timer): a neighbour that takes the core away for a while
# slows every wall-clock sample of that while, so the fastest sample does not undo it.

def cost_timer(eng: Engine):
    """The clock costs are measured with: on a CPU this process's CPU time, which a neighbour taking
    the core away does not inflate (it inflates every wall-clock sample of a shared machine, and
    unevenly across components measured minutes apart); on a GPU the wall clock after a sync."""
    return time.perf_counter if eng.cuda else time.process_time


def time_passes(run, sizes, repeats: int, timer=time.perf_counter, sync=lambda: None, pause=None) -> dict:
    """Seconds per call of run(n) for each n in `sizes`, `repeats` samples each. Interleaved: round
    robin over the sizes, every other sweep in reverse order; each timed call comes right after an
    untimed call of the same n (warm caches, no first-call costs). timer: seconds (a clock, injected
    in tests); sync: waits for the device before the clock is read; pause: called before each untimed
    call (never between it and its timed one). Returns {n: [seconds, ...]}."""
    samples = {n: [] for n in sizes}
    order = list(sizes)
    for r in range(repeats):
        for n in order if r % 2 == 0 else order[::-1]:
            if pause:
                pause()
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
def pass_cost(eng: Engine, sizes: list, context: int = 256, repeats: int = 20, capture: bool = False,
              timer=time.perf_counter, stats: dict | None = None, pause=None) -> tuple:
    """Milliseconds per target pass over B trees of N nodes (B: the engine's slots, each after
    `context` committed tokens), through the steps decoding uses (compiled when the engine is): N=1 is
    the decode step, larger N the verifier. The price of verifying a budget: on a GPU it barely grows
    with N; on a CPU it does, which is what sets the best budget there. (cost_tree: every size shares
    one verify graph.) Measured robustly (time_passes, robust_costs, monotone): `repeats` samples of
    each N, interleaved, each after an untimed pass; the fastest sample of each N; then the
    non-decreasing fit over N. timer: a clock in seconds (tests inject one). stats: a dict that, when
    given, receives "samples" ({N: [seconds]}) and "spread" (the measurement's relative spread, a
    fraction). pause: time_passes'. Returns (context used, {N: ms}): the context shrinks when the cache
    leaves no room."""
    dev, m = eng.device, eng.model
    context = max(1, min(context, m.max_seq_len - max(sizes) - 1))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.args.vocab_size, (context + max(sizes),), generator=g).tolist()
    ar = eng.make("ar")
    for b in range(eng.B):               # every slot holds the context: each pass below is undone after it
        eng.admit(b, Request(ids[:context]), ar)
    trees = {n: cost_tree(torch.tensor(ids[context:context + n], device=dev), eng.B) for n in sizes}
    smp, mode = eng.smp, sampling_mode([Sampling()])

    def one(n):                                      # one pass over n nodes per request
        tree, P = trees[n]
        eng.steps.mark()
        if n == 1 and not capture:
            eng.steps.decode(eng.root, eng.L, eng.active, eng.cols(1), smp, mode)
        else:
            eng.steps.verify(tree, eng.L, eng.active, eng.cols(n), smp, mode, P, capture, eng.root)
        eng.L.fill_(context)                     # undo what the pass committed

    samples = time_passes(one, list(sizes), repeats, timer, lambda: sync(dev), pause)
    for b in range(eng.B):
        eng.free(b, ar)
    fastest, spread = robust_costs(samples)
    if stats is not None:
        stats.update(samples=samples, spread=spread)
    fit = monotone(fastest)
    return context, {n: round(fit[n] * 1000, 3) for n in sizes}


# The longest path of the trees pass_cost times: a Graft round's (1 + max(draft depth 8, template depth
# 9)). Fixed, so that every size runs through one verify graph (the tree size is dynamic, P is not).
COST_PATH = 10


def cost_tree(tokens: torch.Tensor, batch: int = 1) -> tuple:
    """A tree of N = tokens.numel() nodes for timing, the same for each of `batch` requests: a chain of
    min(N, COST_PATH) nodes from the root, the others children of the root. Returns (tree, P). (The
    cost of a pass does not depend on the tree's shape, only on N.)"""
    N, dev = tokens.numel(), tokens.device
    P = min(N, COST_PATH)
    idx = torch.arange(N, device=dev)
    parents = torch.where(idx < P, idx - 1, 0)
    rows = lambda x: x[None].expand(batch, -1).contiguous()
    return Tree(rows(tokens), rows(parents), torch.ones(batch, N, dtype=torch.bool, device=dev)), P


def method_config(cal: Calibration | None, name: str, cfg: Config, auto_budget: bool,
                  calibration: str | None = None) -> Config:
    """cfg with what the warm-up calibrated for method `name`: with auto_budget its budget; with
    `calibration` ("throughput" or "youden") that calibration's thresholds, unless cfg gives some
    (--thresholds); without, the method reads the one its pruning policy names (graft.POLICIES).
    Unchanged when nothing was calibrated."""
    got = cal.get(CALIBRATED.get(name), calibration) if cal is not None else None
    if not got:
        return cfg
    if calibration and cfg.thresholds is None and got["thresholds"]:
        cfg = dataclasses.replace(cfg, thresholds=dict(got["thresholds"]))
    if auto_budget:
        cfg = dataclasses.replace(cfg, budget=got["budget"], depth=min(cfg.depth, got.get("depth", cfg.depth)))
    return cfg


# ----------------------------------------------------------------------------- set-up and warm-up

def content_stamp(path: str) -> str:
    """What a model is, read from its bytes (not its path, size or file times: a folder whose weights
    were replaced by another model's of the same size, times kept by `cp -p`, is another model): a
    hash of its config files whole and, of each weight file (.safetensors, .gguf, .bin), its size and
    STAMP_BLOCKS blocks of 64 KiB spread evenly from its first byte to its last (the header, and
    weights from every part of the file). A few MiB read, whatever the model's size."""
    h = hashlib.sha256()
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in sorted(os.listdir(path))
                                                if f.endswith((".safetensors", ".gguf", ".bin", ".json"))]
    for f in files:
        size = os.path.getsize(f)
        h.update(f"{os.path.basename(f)}:{size};".encode())
        with open(f, "rb") as fh:
            if f.endswith(".json"):
                h.update(fh.read())
                continue
            for i in range(STAMP_BLOCKS):
                fh.seek(max(0, size - 65536) * i // (STAMP_BLOCKS - 1))
                h.update(fh.read(65536))
    return h.hexdigest()


STAMP_BLOCKS = 32


def state_path_for(engine: Engine, *settings) -> str:
    """Warm-up state is cached per (target, head) as their bytes say (content_stamp: a retrained or
    replaced model in the same folder is a different model), the cache length, everything that changes
    what the calibration measured (dtype, device and which one, torch's version and thread count, eager
    or compiled and how, attention over a window or the whole cache, which CPU kernels (cpu_kernels.py's
    build, named by a hash of their source), exact mode and the target's quantization), and every setting that
    shaped the warm-up."""
    stamp = lambda path: [path, content_stamp(path)]
    m = engine.model
    head = stamp(os.path.abspath(engine.drafter.head.path)) if engine.drafter else "-"
    dev = str(engine.device) + (f" {torch.cuda.get_device_name(engine.device)}" if engine.cuda else "")
    execution = (("compiled", engine.steps.backend, "cuda graphs" if engine.cuda else CPU_COMPILE) if engine.compiling
                 else "eager")
    kern = f"graft kernels {cpu_kernels.build_dir().name}" if cpu_kernels.ON and engine.device.type == "cpu" else "torch kernels"
    timing = [dev, str(engine.dtype), torch.__version__, torch.get_num_threads(), execution,
              "window" if engine.window else "full", kern, "exact" if engine.exact else "not exact",
              getattr(m, "quantization", "none")]
    key = json.dumps([WARMUP_FORMAT, stamp(os.path.abspath(m.path)), head, m.max_seq_len, timing, *settings],
                     default=str, sort_keys=True)
    return os.path.join(cache_dir(), "warmup-" + hashlib.sha1(key.encode()).hexdigest()[:16] + ".safetensors")


WARMUP_FORMAT = 9        # bump when what the warm-up computes changes: old cache files are then ignored


# ----------------------------------------------------------------------------- the cache


# ----------------------------------------------------------------------------- warm-up cache

def cache_dir() -> str:
    return os.environ.get("GRAFT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "graft"))


def save_state(path: str, matrix: ContinuationMatrix, thresholds: dict, meta: dict) -> bool:
    """Cache the warm-up result: the matrix's tensors in safetensors, thresholds and `meta` as JSON in
    its metadata (no pickle). Written atomically (a temporary file, then os.replace), so a concurrent
    reader never sees half a file. A cache that cannot be written (read-only folder, full disk) only
    costs the next run its warm-up: a warning, never an error. Returns whether it was saved."""
    from safetensors.torch import save_file
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file({k: v.contiguous() for k, v in matrix.state_dict().items()}, tmp,
                  metadata={"graft": json.dumps({"thresholds": {str(c): float(t) for c, t in thresholds.items()},
                                                 **meta})})
        os.replace(tmp, path)
        return True
    except Exception as e:      # OSError, or the RuntimeError safetensors/torch raise on a read-only folder
        print(f"warning: could not save warm-up state to {path}: {type(e).__name__}: {str(e)[:160]}",
              file=sys.stderr)
        if os.path.exists(tmp):
            try:
                os.remove(tmp)
            except OSError:
                pass
        return False


def load_state(path: str, matrix: ContinuationMatrix, checkpoints=CHECKPOINTS) -> dict | None:
    """Restore a saved matrix; returns {"thresholds", "meta"}, or None when the file is absent,
    unreadable, or does not fit this model (a shape, a token id outside the vocabulary, a threshold
    that is not a probability, a checkpoint it does not calibrate): such a cache counts as absent."""
    from safetensors import safe_open
    if not os.path.isfile(path):
        return None
    try:
        with safe_open(path, framework="pt") as fh:
            sd = {k: fh.get_tensor(k) for k in fh.keys()}
            meta = json.loads(fh.metadata()["graft"])
        th = {int(c): float(t) for c, t in meta.pop("thresholds").items()}
        V, k = matrix.vocab, matrix.k
        fits = (set(sd) == {"M", "written", "counts", "hits", "fallback"}
                and tuple(sd["M"].shape) == (V, k) and tuple(sd["fallback"].shape) == (k,)
                and tuple(sd["written"].shape) == (V,) and tuple(sd["counts"].shape) == (V,)
                and tuple(sd["hits"].shape) == (k + 1,)
                and sd["M"].dtype == sd["fallback"].dtype == torch.int32 and sd["written"].dtype == torch.bool
                and all(int(sd[n].min()) >= 0 and int(sd[n].max()) < V for n in ("M", "fallback"))
                and all(bool(torch.isfinite(sd[n]).all()) and float(sd[n].min()) >= 0 for n in ("counts", "hits"))
                and set(th) == set(checkpoints) and all(math.isfinite(t) and 0 <= t <= 1 + 1e-6 for t in th.values())
                and all(math.isfinite(x) and 0 <= x <= 1 for x in meta.get("hit_rates") or [])
                and len(meta.get("context_hit_rates") or []) == MATCH + 1
                and all(math.isfinite(x) and 0 <= x <= 1 for x in meta["context_hit_rates"]))
        if not fits:
            return None
        matrix.load_state_dict(sd)
        return {"thresholds": th, "meta": meta}
    except Exception:           # unreadable or malformed: recompute rather than trust it
        return None
