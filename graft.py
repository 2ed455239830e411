"""Graft: the continuation matrix, retrieval templates, calibration, hybrid trees, and the round.

Follows ../shared/GRAFT.md sections 2-6; names are the paper's. The pieces:
  ContinuationMatrix   M [V, k]: the target's recent top-k next tokens after each token (section 3)
  build_template       a static tree of ranks grown best-first from per-rank hit rates (section 4)
  youden_threshold     tau_c maximising TPR - FPR on warm-up confidences (section 6)
  graft_trees          kept draft nodes + retrieval subtree -> one tree of a fixed size (section 2.4)
  graft_round          one decoding round, start to end: draft with checkpoints, keep, retrieve,
                       graft, verify, update
  Graft                the proposer that runs it; eagle3, prune and the ablations are configurations
Every tensor step has a static shape, so each can be compiled (one graph per pruning stage).
"""
import heapq
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache, partial

import torch

from draft import deepest, select
from verify import Proposer, Tree, Verified, commit

CHECKPOINTS = (0, 1, 5)          # draft depths at which the confidence test runs
KEEP = (8, 24, 40)               # draft nodes kept when pruned at those checkpoints (budget 60)
MAX_TEMPLATE_DEPTH = 9


def scaled_keep(budget: int, keep=KEEP, base: int = 60) -> tuple:
    """Keep sizes in proportion to the budget (the paper's 8/24/40 are for 60)."""
    return tuple(max(1, min(budget - 1, round(k * budget / base))) for k in keep)


# ----------------------------------------------------------------------------- continuation matrix

class ContinuationMatrix:
    """M[t] lists the k tokens the target most recently ranked highest after token t, best first.

    Rows are overwritten whole from verification logits (free: they are computed anyway). Rows never
    written hold the fallback, the unigram top-k of the target's choices, so every lookup is a real
    token and a lookup is one gather. One extra row (index V) takes the writes of nodes that must not
    land anywhere (padding, duplicates that lost): updates keep a static shape. Per-rank hit rates
    (how often M[t, r] was the target's actual next token) size the templates."""

    def __init__(self, vocab: int, k: int = 8, device="cpu"):
        self.k, self.vocab = k, vocab
        self.fallback = torch.arange(k, dtype=torch.int32, device=device)
        self.M = self.fallback.repeat(vocab + 1, 1)                             # (V+1, k) int32
        self.written = torch.zeros(vocab + 1, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab + 1, dtype=torch.float64, device=device)   # target choices seen
        self.hits = torch.zeros(k + 1, dtype=torch.float64, device=device)      # per rank; [k] = miss

    def buffers(self) -> list:
        return [self.M, self.written, self.counts, self.hits]

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """(n,) tokens -> (n, k) continuations (the fallback for rows never written)."""
        return self.M[tokens]

    def record(self, tokens: torch.Tensor, target: torch.Tensor, valid: torch.Tensor):
        """Count, before updating, at which rank the target's actual choice sat in each real node's row."""
        match = self.rows(tokens) == target[:, None].int()                     # (n, k)
        rank = torch.where(match.any(-1), match.int().argmax(-1), self.k)
        self.hits.scatter_add_(0, rank, valid.double())
        self.counts.scatter_add_(0, target, valid.double())

    def update(self, tokens: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor,
               path: torch.Tensor | None = None, A: torch.Tensor | None = None):
        """M[tokens_i] = topk(logits_i, k) for every real node i; the accepted path (path[:A+1]) is
        written last so it wins when a token occurs at several nodes. Deterministic: one write per
        distinct token; padding and the losers write the spare row V."""
        n, dev = tokens.numel(), tokens.device
        prio = torch.arange(n, device=dev)
        if path is not None:                                                   # accepted rows win
            on_path = torch.zeros(n, dtype=torch.long, device=dev).scatter(
                0, path, (torch.arange(path.numel(), device=dev) <= A).long())
            prio = prio + n * on_path
        tok = torch.where(valid, tokens, self.vocab)
        order = torch.argsort(tok * (2 * n) + prio)                            # by token, prio ascending
        t_sorted = tok[order]
        last = torch.ones_like(t_sorted, dtype=torch.bool)
        last[:-1] = t_sorted[1:] != t_sorted[:-1]
        rows = torch.where(last, t_sorted, self.vocab)
        self.M[rows] = logits[order].topk(self.k, dim=-1).indices.int()
        self.written[rows] = True

    def refresh_fallback(self):
        """The fallback becomes the k tokens the target chose most often; unwritten rows take it."""
        counts = self.counts[:self.vocab]
        if counts.sum() > 0:
            self.fallback = counts.topk(self.k).indices.int()
        self.M[~self.written] = self.fallback

    def hit_rates(self) -> torch.Tensor | None:
        total = self.hits.sum()
        return None if total == 0 else (self.hits[:self.k] / total).float().cpu()

    def state_dict(self) -> dict:
        V = self.vocab
        return {"M": self.M[:V].cpu(), "written": self.written[:V].cpu(), "counts": self.counts[:V].cpu(),
                "hits": self.hits.cpu(), "fallback": self.fallback.cpu()}

    def load_state_dict(self, sd: dict):
        dev, V = self.M.device, self.vocab
        if tuple(sd["M"].shape) != (V, self.k):
            raise ValueError(f"matrix shape {tuple(sd['M'].shape)} != {(V, self.k)}")
        self.M[:V] = sd["M"].to(dev)
        self.written[:V] = sd["written"].to(dev)
        self.counts[:V] = sd["counts"].to(dev)
        self.hits.copy_(sd["hits"].to(dev))
        self.fallback = sd["fallback"].to(dev)
        self.M[~self.written] = self.fallback

    def retrieve(self, root: torch.Tensor, tpl: "Template") -> torch.Tensor:
        """The template's tokens under `root` (0-d): node j gets M[token(parent j), rank j]. (n,)"""
        n = tpl.size
        buf = torch.empty(n + 1, dtype=torch.int32, device=self.M.device)      # [nodes..., root]
        buf[n] = root                                                          # parent -1 reads the root
        for idx, par, rank in tpl.levels:                                      # one gather per level
            buf[idx] = self.M[buf[par], rank]
        return buf[:n].long()


# ----------------------------------------------------------------------------- templates

PRIOR_HIT_RATES = (0.72, 0.3, 0.17, 0.12, 0.09, 0.075, 0.065, 0.055)   # decaying; used before warm-up


@dataclass
class Template:
    """A static tree of ranks, nodes in best-first order (so parents come first)."""
    parents: torch.Tensor        # (n,) -1 = the root
    ranks: torch.Tensor          # (n,)
    depth: torch.Tensor          # (n,) 1-based
    levels: list                 # per depth: (node idx, parent idx, rank) tensors, for batched gathers

    @property
    def size(self) -> int:
        return self.parents.numel()

    def widths(self) -> list:
        return torch.bincount(self.depth)[1:].tolist()

    def tensors(self) -> list:
        return [self.parents, self.ranks, self.depth] + [x for lv in self.levels for x in lv]

    def to(self, device) -> "Template":
        return Template(self.parents.to(device), self.ranks.to(device), self.depth.to(device),
                        [tuple(x.to(device) for x in lv) for lv in self.levels])


def build_template(hit_rates, n: int, max_depth: int = MAX_TEMPLATE_DEPTH) -> Template:
    """The n rank-paths with the largest product of hit rates, grown best-first (prefix-closed: a path
    is only offered once its parent is in). Asymmetric by construction: rank 0 chains run deep, lower
    ranks spread width near the root."""
    a = [max(float(x), 1e-9) for x in hit_rates]
    heap = [(-a[r], r, -1, r, 1) for r in range(len(a))]       # (-score, tiebreak, parent, rank, depth)
    heapq.heapify(heap)
    parents, ranks, depth, score = [], [], [], []
    counter = len(a)
    while heap and len(parents) < n:
        neg, _, par, rank, d = heapq.heappop(heap)
        j = len(parents)
        parents.append(par), ranks.append(rank), depth.append(d), score.append(-neg)
        if d < max_depth:
            for r in range(len(a)):
                heapq.heappush(heap, (neg * a[r], counter, j, r, d + 1))
                counter += 1
    long = lambda x: torch.tensor(x, dtype=torch.long)
    levels = []
    for d in range(1, max(depth, default=0) + 1):        # (host lists: built once, then moved to the device)
        idx = [j for j, x in enumerate(depth) if x == d]
        levels.append((long(idx), long([parents[j] for j in idx]), long([ranks[j] for j in idx])))
    return Template(long(parents), long(ranks), long(depth), levels)


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


def throughput_thresholds(rounds: list, cost: dict, checkpoints=CHECKPOINTS, grid: int = 16) -> tuple:
    """Thresholds maximising rate(tau) (see above). Each tau_c ranges over 0 (never prune), the
    midpoints between its observed confidences, and above 1 (always prune). Every combination of up to
    `grid` cuts per checkpoint (evenly spaced among them) is scored at once, since checkpoints interact
    (a round pruned early never reaches a later one); coordinate ascent over all cuts then refines the
    best. Deterministic: the first best in grid order wins, and a change must strictly improve the
    rate. Returns ({c: tau_c}, tokens/s)."""
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
    while grid > 2 and grid ** m * max(len(rounds), 1) > 2e7:       # keep the grid's tensor small
        grid -= 1
    coarse = [v if v.numel() <= grid else v[torch.round(torch.arange(grid) * (v.numel() - 1) / (grid - 1)).long()]
              for v in cands]
    rates = _rates(conf, tok, secs, coarse)                          # (g_0, ..., g_{m-1})
    best = float(rates.max())
    idx = [int(i) for i in torch.unravel_index(torch.argmax(rates), rates.shape)] if m else []
    taus = [float(coarse[k][i]) for k, i in enumerate(idx)]
    improved = True
    while improved:
        improved = False
        for k in range(m):                      # all of checkpoint k's cuts, the others held
            grids = [torch.tensor([t], dtype=torch.float64) for t in taus]
            grids[k] = cands[k]
            r = _rates(conf, tok, secs, grids).reshape(-1)
            i = int(torch.argmax(r))
            if float(r[i]) > best * (1 + 1e-12):
                best, taus[k], improved = float(r[i]), float(cands[k][i]), True
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


# Near-equal budgets: expected rates within this many spreads (robust_costs) of the best. Each
# budget's verify cost is off by about one spread, either way, so the difference of two is off by up
# to about twice that; three leaves room (simulated: far fewer flips than two, at a cost of three
# spreads of throughput at most, about 1% on a quiet machine).
TIE_SPREADS = 3


def choose_budget(options: dict, checkpoints=CHECKPOINTS, spread: float = 0.0) -> tuple:
    """--budget auto: options {budget: (rounds, cost)} as throughput_thresholds reads them, one per
    candidate budget (its keep sizes, its verify pass). Returns (budget, taus, rate, {budget: rate}):
    the smallest budget whose expected rate (tokens/s) is within TIE_SPREADS * spread of the best
    one's (spread: the cost measurement's relative spread, a fraction, from robust_costs; 0: exact
    ties only), and the whole curve, for the log and the report. Budgets that close are what the
    timing's noise tells apart, so they go to the smaller one, the same way every time."""
    fits, curve = {}, {}
    for b in sorted(options):
        fits[b] = throughput_thresholds(*options[b], checkpoints)
        curve[b] = fits[b][1]
    top = max(curve.values())
    b = next(b for b in sorted(curve) if curve[b] >= top * (1 - max(TIE_SPREADS * spread, 1e-12)))
    return (b, *fits[b], curve)


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


# ----------------------------------------------------------------------------- hybrid trees

def graft_trees(d_tokens, d_parents, r_tokens, tpl: Template, free: int, anchor=-1) -> tuple:
    """Merge the kept draft tree (K nodes) and a retrieval subtree into one tree of K + `free` slots.

    d_parents index the draft nodes (-1 = root); the retrieval subtree hangs under `anchor` (-1 = the
    root, or the index of a draft node, an int or a 0-d tensor). A retrieved node that repeats a
    sibling's token is merged into it (its children attach there) and costs no slot; the slots go to
    the first `free` unmerged template nodes, in template order, so the result is prefix-closed and
    contains the whole draft tree. Slots left over (too many merges) are padding.
    Returns (tokens, parents, valid, retrieved), each (K + free,), without the root: parents index the
    result, -1 = root. Static shapes: no nonzero, no data-dependent sizes."""
    dev = d_tokens.device
    K, n = d_tokens.numel(), r_tokens.numel()
    if not torch.is_tensor(anchor):                           # (a host int: a fill, never a copy to the device)
        anchor = torch.full((), anchor, dtype=torch.long, device=dev)
    hid = torch.empty(n, dtype=torch.long, device=dev)       # hybrid id: draft index, or K + j if new
    merged = torch.zeros(n, dtype=torch.bool, device=dev)
    for idx, par, _ in tpl.levels:                            # level by level: parents are resolved
        ph = torch.where(par < 0, anchor, hid[par.clamp(min=0)])                             # (m,)
        same = (d_parents[None, :] == ph[:, None]) & (d_tokens[None, :] == r_tokens[idx][:, None])  # (m, K)
        hit = same.any(-1)
        merged[idx] = hit
        hid[idx] = torch.where(hit, same.int().argmax(-1), K + idx)
    new = ~merged
    take = new & (new.cumsum(0) <= free)                      # the first `free` unmerged nodes
    slot = torch.cumsum(take, 0) - 1 + K                      # their index in the result
    ph = torch.where(tpl.parents < 0, anchor, hid[tpl.parents.clamp(min=0)])
    # a parent that is new maps through its slot; a merged one is already a draft index
    p_new = torch.where(ph >= K, slot[(ph - K).clamp(min=0, max=n - 1)], ph)
    dst = torch.where(take, slot, K + free)                   # the untaken write a spare slot, dropped
    tokens = torch.cat([d_tokens, torch.zeros(free + 1, dtype=torch.long, device=dev)])
    parents = torch.cat([d_parents, torch.full((free + 1,), -1, dtype=torch.long, device=dev)])
    valid = torch.cat([torch.ones(K, dtype=torch.bool, device=dev), torch.zeros(free + 1, dtype=torch.bool, device=dev)])
    tokens[dst], parents[dst], valid[dst] = r_tokens, p_new, take
    retrieved = torch.arange(K + free, device=dev) >= K
    return tokens[:-1], parents[:-1], valid[:-1], retrieved & valid[:-1]


def with_root(root: torch.Tensor, tokens, parents, valid, retrieved, N: int) -> Tree:
    """Prepend the root to a root-less tree (parents -1 = the root) and pad it to N nodes."""
    dev = root.device
    pad = N - 1 - tokens.numel()
    z = lambda dtype, v=0: torch.full((pad,), v, dtype=dtype, device=dev)
    one = lambda x: x.view(1)
    return Tree(torch.cat([one(root), tokens, z(torch.long)]),
                torch.cat([torch.full((1,), -1, dtype=torch.long, device=dev), torch.where(parents < 0, 0, parents + 1),
                           z(torch.long, -1)]),
                torch.cat([torch.ones(1, dtype=torch.bool, device=dev), valid, z(torch.bool)]),
                torch.cat([torch.zeros(1, dtype=torch.bool, device=dev), retrieved, z(torch.bool)]))


def accepted_by(tree: Tree, truth: list) -> int:
    """The tokens a tree accepts under greedy decoding when the target's continuation after the root
    is `truth` (host ints): the deepest root path spelling a prefix of it. Greedy choices are a
    function of the path, so this is what verifying the tree would have accepted. (On the host: the
    calibration asks it thousands of times about trees of a few dozen nodes.)"""
    tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    depth = [0] * len(tokens)           # a node's depth when its whole root path matches truth, else -1
    for i in range(1, len(tokens)):     # parents first: a node's parent was decided before it
        d = depth[parents[i]] if 0 <= parents[i] < i else -1
        depth[i] = d + 1 if valid[i] and d >= 0 and d < len(truth) and tokens[i] == truth[d] else -1
    return max(depth)


def stage_tree(rec: dict, stage, K: int, R: int, rates, k: int) -> Tree:
    """The tree a warm-up round would have verified had it ended in `stage` (None: full depth) with K
    draft nodes kept and R retrieved: its candidates (rec["scores"/"tokens"/"parents"], slots past the
    stage's levels left out), grafted with the first K + R nodes of its retrieval (rec["retrieved"],
    best-first, so a smaller template is a prefix of a larger one)."""
    scores = rec["scores"].clone()
    if stage is not None:
        scores[k + stage * k * k:] = float("-inf")                   # levels not drafted by then
    d_tok, d_par, _ = select(scores, rec["tokens"], rec["parents"], K)
    root = torch.tensor(rec["root"])
    if not R:
        yes = torch.ones_like(d_tok, dtype=torch.bool)
        return with_root(root, d_tok, d_par, yes, ~yes, 1 + K)
    tpl = _template(tuple(rates), K + R)
    return with_root(root, *graft_trees(d_tok, d_par, rec["retrieved"][:K + R], tpl, R), 1 + K + R)


@lru_cache(maxsize=256)
def _template(rates: tuple, n: int) -> Template:
    return build_template(rates, n)


# ----------------------------------------------------------------------------- the round

@dataclass
class Config:
    """The shape of a round. `prune` stops drafting at checkpoints; `retrieve` fills the freed slots
    from the continuation matrix. eagle3 = neither, prune = prune only, graft = both. The ablations
    (GRAFT.md section 7), all drafting to full depth: "fixed" splits the budget into a fixed draft and
    retrieval part (40 + 20 at budget 60); "root" and "tail" add retrieved nodes (20 at budget 60) on top
    of the dense tree, under the root or under the best deepest draft node."""
    budget: int = 60                   # candidate nodes under the root
    top_k: int = 10                    # draft children per expansion
    depth: int = 8                     # draft levels (draft forwards per round when not pruned)
    checkpoints: tuple = CHECKPOINTS
    keep: tuple | None = None          # draft nodes kept when pruned at each checkpoint (default scaled 8/24/40)
    thresholds: dict | None = None     # tau per checkpoint (default: calibrated in warm-up)
    prune: bool = True
    retrieve: bool = True
    ablation: str | None = None        # "fixed", "root" or "tail"
    matrix_k: int = 8
    recycle_size: int = 80
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

    def stages(self) -> dict:
        """stage -> (draft nodes kept K, retrieved slots R): one per checkpoint when pruning (the
        candidates drafted by then bound K), and None for a round drafted to full depth."""
        k, B = self.top_k, self.budget
        a = max(1, min(B - 1, round(B / 3))) if self.ablation else 0           # 20 at budget 60
        out = {None: (B - a, a) if self.ablation == "fixed" else (B, a)}
        if self.prune:
            for c, keep in zip(self.checkpoints, self.keep_sizes()):
                K = min(keep, k + c * k * k)
                out[c] = (K, B - K if self.retrieve else 0)
        return out


class Graft(Proposer):
    """EAGLE-3 drafting with checkpoints, grafted with retrieval (and, as configurations of the same
    round, eagle3, prune and the ablations). Holds the compiled steps of its round: the head's
    `extend` and `level`, one `assemble` per pruning stage, and `learn`."""
    needs_features = True

    def __init__(self, eng, cfg: Config, matrix: ContinuationMatrix | None = None, hit_rates=None):
        self.eng, self.cfg, self.d, self.matrix = eng, cfg, eng.drafter, matrix
        self.thresholds = {c: float((cfg.thresholds or {}).get(c, 0.0)) for c in cfg.checkpoints} if cfg.prune else {}
        self.stages = cfg.stages()
        rates = hit_rates or PRIOR_HIT_RATES
        self.templates = {s: build_template(rates, K + R).to(eng.device) for s, (K, R) in self.stages.items() if R}
        self.N = 1 + max(cfg.budget, *(K + R for K, R in self.stages.values()))
        T = MAX_TEMPLATE_DEPTH if self.templates else 0
        self.tail = cfg.ablation == "tail"
        self.P = min(self.N, 1 + (cfg.depth + T if self.tail else max(cfg.depth, T)))
        eng.reserve(self.N, self.P)
        dev, Ht = eng.device, eng.model.args.dim
        self.pend_feats = torch.zeros(self.P, len(eng.model.capture_layers) * Ht, dtype=eng.dtype, device=dev)
        self.pend_ids = torch.zeros(self.P, dtype=torch.long, device=dev)
        self.pend_n = torch.ones((), dtype=torch.long, device=dev)
        self.level_index = [torch.full((), i, dtype=torch.long, device=dev) for i in range(cfg.depth)]
        self.extend, self.level = eng.compile(self.d.extend, "extend"), eng.compile(self.d.level, "level")
        self.assemble = {s: eng.compile(partial(self.assemble_stage, s), f"assemble_{s}") for s in self.stages}
        self.learn = eng.compile(self.learn_step, "learn")
        self.seed_matrix = eng.compile(matrix.update, "matrix_update") if matrix is not None else None
        self.records = None              # warm-up: a list to collect each round's candidates and confidences
        self.calib_template = None       # warm-up: the largest retrieval template a calibrated stage may use
        eng.static(self.pend_feats, self.pend_ids, self.pend_n, *self.level_index,
                   *(t for tpl in self.templates.values() for t in tpl.tensors()))

    # -- the prompt: the head's committed rows, and the matrix seeded from the prefill logits
    def start(self, prompt: list):
        self.d.reset()
        self._last = None
        self.pend_n_host = 1

    def prompt_chunk(self, ids, logits, feats, n: int):
        C, dev = ids.numel(), ids.device
        if self.seed_matrix is not None:
            self.seed_matrix(ids, logits, torch.arange(C, device=dev) < n)
        # row t of the head pairs feature t with token t+1 (eagle3.md section 4.1)
        if self._last is None:           # the first chunk: rows (f_0, p_1) .. (f_{n-2}, p_{n-1})
            F, I, real = feats, torch.cat([ids[1:], ids[:1] * 0]), n - 1
        else:                            # later ones start with the previous chunk's last feature
            F, I, real = torch.cat([self._last, feats[:-1]]), ids, n
        self._last = feats[n - 1:n].clone()      # an output of the prefill step, read after its next replay
        self.eng.head_prefill(F, I, real)

    # -- one round
    def round(self, root: torch.Tensor) -> Verified:
        if self._last is not None:       # the first round reads the prompt's last feature with the root
            self.pend_feats.zero_()
            self.pend_feats[0] = self._last[0]
            self.pend_ids[0] = root
            self.pend_n.fill_(1)
            self._last = None
        return graft_round(self, root)

    def assemble_stage(self, stage, root: torch.Tensor) -> Tree:
        """Keep, retrieve, graft: the K best draft nodes, R slots of retrieval hung under the root (or
        the best deepest draft node), merged into one tree of N nodes. One graph per stage."""
        d, (K, R) = self.d, self.stages[stage]
        d_tok, d_par, slots = select(d.scores, d.tokens, d.parents, K)                     # keep
        if not R:
            return with_root(root, d_tok, d_par, torch.ones_like(d_tok, dtype=torch.bool),
                             torch.zeros_like(d_tok, dtype=torch.bool), self.N)
        tpl = self.templates[stage]
        anchor = deepest(slots, d.scores, d.top_k) if self.tail else -1
        under = d_tok.index_select(0, anchor.view(1))[0] if self.tail else root
        r_tok = self.matrix.retrieve(under, tpl)                                             # retrieve
        return with_root(root, *graft_trees(d_tok, d_par, r_tok, tpl, R, anchor), self.N)   # graft

    def learn_step(self, tree: Tree, v: Verified):
        """The matrix learns from every verified node; the head's next extend reads the accepted path."""
        if self.matrix is not None:
            self.matrix.update(tree.tokens, v.logits, tree.valid, v.path, v.A)
        nxt = torch.cat([tree.tokens.index_select(0, v.path[1:]), v.bonus.view(1)])       # token after each
        self.pend_ids.copy_(torch.where(torch.arange(self.P, device=nxt.device) == v.A, v.bonus, nxt))
        self.pend_feats.copy_(v.feats)
        self.pend_n.copy_(v.A + 1)


def graft_round(g: Graft, root: torch.Tensor) -> Verified:
    """One Graft round, start to end (GRAFT.md section 2). root: the last committed token (0-d).

    Host syncs: one per checkpoint reached (the pruning decision) and one at the end (the accepted
    length and tokens). Every tensor step is static-shaped and may be compiled; `e.cols(n)` is the
    cache rows attention reads (see model.attention_mask)."""
    e, d, cfg = g.eng, g.d, g.cfg
    k, D = d.top_k, cfg.depth
    Ld = d.Ld_host
    # 1. draft with checkpoints. The head first reads the accepted path (extend), which also drafts
    #    level 1 (the root's top_k children); each further forward drafts one more level. After the
    #    forward that produced level c+1, checkpoint c compares the best path's probability conf_c
    #    with its calibrated tau_c; below it, drafting stops: the tree is pruned at stage c.
    conf = g.extend(g.pend_feats, g.pend_ids, g.pend_n, e.cols(Ld + g.P, head=True))
    d.Ld_host = Ld = Ld + g.pend_n_host
    stage, forwards, syncs, seen = None, 1, 1, {}
    for c in range(D):                                  # level c+1 exists now
        if c in g.thresholds or (g.records is not None and c in cfg.checkpoints):
            seen[c] = conf.clone()                       # read after later levels replay their step
            if c in g.thresholds:
                syncs += 1
                if float(conf) < g.thresholds[c]:        # a host sync: the decision
                    stage = c
                    break
        if c == D - 1:
            break
        conf = g.level(g.level_index[c], e.cols(Ld + (D - 1) * k, head=True))        # draft level c+2
        forwards += 1
    e.clock.mark("draft")
    # (warm-up: what retrieval would give before this round's logits reach the matrix; after the
    #  update it would already hold the target's answer for this very round)
    retrieved = g.matrix.retrieve(root, g.calib_template).cpu() if g.records is not None else None
    # 2-4. keep the K best draft nodes, retrieve R nodes from the continuation matrix under the root,
    #    graft them into one hybrid tree of N nodes (padding where merges freed more than the template
    #    held, or where pruning left slots empty and nothing retrieves)
    tree = g.last_tree = g.assemble[stage](root)
    e.clock.mark("assemble")
    # 5. verify: one target pass over the tree, exact acceptance, KV compaction
    v = e.verify(tree, g.P, capture=True)
    e.clock.mark("verify")
    # 6. update: the continuation matrix from every verified node's logits, the head's next input
    #    from the accepted path; then the round's one transfer to the host
    if g.records is not None:     # warm-up: the matrix's rank of each true token, before it learns (eager:
        g.matrix.record(tree.tokens, v.target, tree.valid)   # a list in a compiled step recompiles per round)
    g.learn(tree, v)
    commit(v, tree)
    e.clock.mark("update")
    g.pend_n_host = len(v.accepted) + 1
    v.stage, v.draft_forwards, v.syncs = stage, forwards, syncs
    if g.records is not None:                           # warm-up: what the calibration reads
        g.records.append({"conf": {c: float(x) for c, x in seen.items()}, "accepted": len(v.accepted),
                          "scores": d.scores.cpu().clone(), "tokens": d.tokens.cpu().clone(),
                          "parents": d.parents.cpu().clone(), "root": e.root_id, "L": e.L_host,
                          "retrieved": retrieved})
    return v


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
                and all(math.isfinite(x) and 0 <= x <= 1 for x in meta.get("hit_rates") or []))
        if not fits:
            return None
        matrix.load_state_dict(sd)
        return {"thresholds": th, "meta": meta}
    except Exception:           # unreadable or malformed: recompute rather than trust it
        return None
