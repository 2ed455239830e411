"""Graft: the continuation matrix, retrieval templates, threshold calibration and hybrid trees.

Follows ../shared/GRAFT.md sections 2-6; names are the paper's. The pieces:
  ContinuationMatrix   M [V, k]: the target's recent top-k next tokens after each token (section 3)
  build_template       a static tree of ranks grown best-first from per-rank hit rates (section 4)
  youden_threshold     tau_c maximising TPR - FPR on warm-up confidences (section 6)
  graft_trees          kept draft nodes + retrieval subtree -> one tree of exactly `budget` nodes
Everything here works on tensors of static shape: retrieval is one gather per template level.
"""
import heapq
import json
import math
import os
import sys
from dataclasses import dataclass

import torch

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
    token and a lookup is one gather. Per-rank hit rates (how often M[t, r] was the target's actual
    next token) size the templates."""

    def __init__(self, vocab: int, k: int = 8, device="cpu"):
        self.k, self.vocab = k, vocab
        self.fallback = torch.arange(k, dtype=torch.int32, device=device)
        self.M = self.fallback.repeat(vocab, 1)                                 # (V, k) int32
        self.written = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab, dtype=torch.float64, device=device)   # target choices seen
        self.hits = torch.zeros(k + 1, dtype=torch.float64, device=device)      # per rank; [k] = miss

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """(n,) tokens -> (n, k) continuations (the fallback for rows never written)."""
        return self.M[tokens]

    def record(self, tokens: torch.Tensor, target: torch.Tensor):
        """Count, before updating, at which rank the target's actual choice sat in each node's row."""
        match = self.rows(tokens) == target[:, None].int()                     # (n, k)
        rank = torch.where(match.any(-1), match.int().argmax(-1), self.k)
        self.hits += torch.bincount(rank, minlength=self.k + 1).double()
        self.counts += torch.bincount(target, minlength=self.vocab).double()

    def update(self, tokens: torch.Tensor, logits: torch.Tensor, path: torch.Tensor | None = None):
        """M[tokens_i] = topk(logits_i, k) for every verified node i; the accepted path is written last
        so it wins when a token occurs at several nodes. Deterministic: one write per distinct token."""
        n = tokens.numel()
        prio = torch.arange(n, device=tokens.device)
        if path is not None:
            prio[path] += n                                                    # accepted rows win
        # the winner for each token is its highest-priority node
        order = torch.argsort(tokens * (2 * n) + prio)                         # group by token, prio ascending
        t_sorted = tokens[order]
        last = torch.ones_like(t_sorted, dtype=torch.bool)
        last[:-1] = t_sorted[1:] != t_sorted[:-1]
        win = order[last]
        self.M[tokens[win]] = logits[win].topk(self.k, dim=-1).indices.int()
        self.written[tokens[win]] = True

    def refresh_fallback(self):
        """The fallback becomes the k tokens the target chose most often; unwritten rows take it."""
        if self.counts.sum() > 0:
            self.fallback = self.counts.topk(self.k).indices.int()
        self.M[~self.written] = self.fallback

    def hit_rates(self) -> torch.Tensor | None:
        total = self.hits.sum()
        return None if total == 0 else (self.hits[:self.k] / total).float().cpu()

    def state_dict(self) -> dict:
        return {"M": self.M.cpu(), "written": self.written.cpu(), "counts": self.counts.cpu(),
                "hits": self.hits.cpu(), "fallback": self.fallback.cpu()}

    def load_state_dict(self, sd: dict):
        dev = self.M.device
        if tuple(sd["M"].shape) != tuple(self.M.shape):
            raise ValueError(f"matrix shape {tuple(sd['M'].shape)} != {tuple(self.M.shape)}")
        for name in ("M", "written", "counts", "hits", "fallback"):
            setattr(self, name, sd[name].to(dev))
        self.M[~self.written] = self.fallback

    @torch.no_grad()
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
    P, R, D = (torch.tensor(x, dtype=torch.long) for x in (parents, ranks, depth))
    levels = []
    for d in range(1, int(D.max()) + 1 if n else 1):
        idx = (D == d).nonzero().flatten()
        levels.append((idx, P[idx], R[idx]))
    return Template(P, R, D, levels)


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
    """records: (confidences {c: float}, accepted draft length) per dense warm-up round.
    A round is positive at c when the accepted length went past level c+1 (drafting deeper paid off)."""
    taus = {}
    for c in checkpoints:
        rows = [(conf[c], acc > c + 1) for conf, acc in records if c in conf]
        taus[c] = youden_threshold([r[0] for r in rows], [r[1] for r in rows]) if rows else 0.0
    return taus


# ----------------------------------------------------------------------------- hybrid trees

def graft_trees(d_tokens, d_parents, r_tokens, r_tpl: Template, free: int, anchor: int = -1) -> tuple:
    """Merge the kept draft tree (K nodes) and a retrieval subtree into one tree of K + `free` nodes.

    d_parents index the draft nodes (-1 = root); the retrieval subtree hangs under `anchor` (-1 = the
    root, or a draft node). A retrieved node that repeats a sibling's token is merged into it (its
    children attach there) and costs no slot; the slots go to the first `free` unmerged template nodes,
    in template order, so the result is prefix-closed and contains the whole draft tree.
    Returns (tokens, parents, from_retrieval) without the root: parents index the result, -1 = root."""
    dev = d_tokens.device
    K, n = d_tokens.numel(), r_tokens.numel()
    hid = torch.empty(n, dtype=torch.long, device=dev)       # hybrid id: draft index, or K + j if new
    merged = torch.zeros(n, dtype=torch.bool, device=dev)
    for idx, par, _ in r_tpl.levels:                          # level by level: parents are resolved
        ph = torch.where(par < 0, torch.full_like(par, anchor), hid[par.clamp(min=0)])     # (m,)
        same = (d_parents[None, :] == ph[:, None]) & (d_tokens[None, :] == r_tokens[idx][:, None])  # (m, K)
        hit = same.any(-1)
        merged[idx] = hit
        hid[idx] = torch.where(hit, same.int().argmax(-1), K + idx)
    new = ~merged
    take = new & (new.cumsum(0) <= free)                      # the first `free` unmerged nodes
    slot = torch.cumsum(take, 0) - 1 + K                      # their index in the result
    sel = take.nonzero().flatten()
    ph = torch.where(r_tpl.parents[sel] < 0, torch.full_like(sel, anchor), hid[r_tpl.parents[sel].clamp(min=0)])
    # a parent that is new maps through its slot; a merged one is already a draft index
    p_new = torch.where(ph >= K, slot[(ph - K).clamp(min=0, max=n - 1)], ph)
    tokens = torch.cat([d_tokens, r_tokens[sel]])
    parents = torch.cat([d_parents, p_new])
    source = torch.cat([torch.zeros(K, dtype=torch.bool, device=dev), torch.ones(sel.numel(), dtype=torch.bool, device=dev)])
    return tokens, parents, source


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
