"""Graft: the continuation matrix, retrieval templates, hybrid trees, and every method's round.

Follows docs/graft.md sections 2-7; names are the paper's. Every step takes a batch of B
requests (a single request is a batch of one). The pieces:
  ContinuationMatrix   M [V, k]: the target's recent top-k next tokens after each token (section 3);
                       each request reads and writes its own copy (B, V+1, k)
  build_template       a static tree of ranks grown best-first from per-rank hit rates (section 4)
  context_match        the longest earlier match of each request's recent context, and what followed it
                       (the "context" retrieval source beside the matrix: section 4a)
  graft_trees          kept draft nodes + retrieval subtree -> one tree of a fixed size (section 2.4)
  assemble             keep, retrieve, graft: the round's trees, one per request (one graph per method)
  Method               what a decoding method declares (head, matrix, budget, calibration) and its round;
                       METHODS maps every --method name to its class
The pruning thresholds are calibrated in calibrate.py (section 6). Graft prunes by one of two named
policies (POLICIES): "stop" (drafting stops at a checkpoint whose confidence is below its threshold:
the paper's batch-1 Graft) and "replace" (the full tree is drafted and its nodes whose path
confidence is below their checkpoint's threshold are replaced by retrieved ones: the paper's batch
variant, whose shapes do not depend on any request's confidence).
"""
import heapq
import math
from array import array
from dataclasses import dataclass, field, replace

import torch

import cpu_kernels
from draft import level_of, select
from model import use_kernels
from verify import Tree, tree_mask

CHECKPOINTS = (0, 1, 5)          # draft depths at which the confidence test runs

KEEP = (8, 24, 40)               # draft nodes kept when pruned at those checkpoints (budget 60)

MAX_TEMPLATE_DEPTH = 9

# The most plain rounds in a row (engine.Pacer) before a drafting method's drafter reads its pending rows
# (the accepted path, then one row a plain round: room for that many): in a drafting round, or where the
# method can (Method.catch_up), without one. LAZY_RUN where it can (eager): most requests of a batch whose
# trees do not pay then end before their head reads those rows, and so never pay for it.
PLAIN_RUN, LAZY_RUN = 32, 128

# On a CPU with graft's kernels, retrieve, context_match, graft_trees, learn and plain_learn run as one C++
# call each (cpu_kernels: the same result); False keeps the torch versions below (the tests run both).
FUSED = True

# Retrieval sources (--sources), by the id a tree's `retrieved` holds for their nodes (0: not retrieved):
# the continuation matrix, and exact matches of the request's recent context in its prompt and its own
# output so far (docs/graft.md section 4a).
SOURCES = {"matrix": 1, "context": 2}

MATCH = 8                        # the longest context suffix a match looks for (tokens)

# P(a context continuation's next token is right | its match is m tokens long), m = 0..MATCH, before a
# warm-up measures it (calibrate.context_hit_rates); 0 for m = 0: no match, nothing offered
PRIOR_CONTEXT_RATES = (0.0, 0.25, 0.4, 0.5, 0.58, 0.64, 0.68, 0.72, 0.75)

# Graft's pruning policies, each with the calibration it reads (calibrate.py computes both; None: the
# warm-up's choice, --calibration). "replace" reads Youden's J: the throughput calibration prices the
# drafting a pruned round saves, and a replacing round saves none (it always drafts to full depth), so
# on a CPU it can say "prune at checkpoint 0 always" (tau 1.0), which would replace every draft node.
POLICIES = {"stop": None, "replace": "youden"}


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
    (how often M[t, r] was the target's actual next token) size the templates.
    This object is the prior: a request admitted to a slot starts from a copy of it (Method.admit)
    and, when it ends, leaves what it learned here (Method.finish), so one request after another
    learns as a single matrix would; in a batch the request that finishes last wins."""

    def __init__(self, vocab: int, k: int = 8, device="cpu"):
        self.k, self.vocab = k, vocab
        self.fallback = torch.arange(k, dtype=torch.int32, device=device)
        self.M = self.fallback.repeat(vocab + 1, 1)                             # (V+1, k) int32
        self.written = torch.zeros(vocab + 1, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab + 1, dtype=torch.float64, device=device)   # target choices seen
        self.hits = torch.zeros(k + 1, dtype=torch.float64, device=device)      # per rank; [k] = miss

    def copy(self) -> "ContinuationMatrix":
        c = ContinuationMatrix(self.vocab, self.k, self.M.device)
        c.load_state_dict(self.state_dict())
        return c

    def record(self, rank: torch.Tensor, target: torch.Tensor, valid: torch.Tensor):
        """Count the ranks (matrix_ranks) at which the target's actual choices sat, and the choices
        (real nodes only). rank, target, valid: any shape, alike. (The warm-up's statistics: eager.)"""
        self.hits.scatter_add_(0, rank.flatten(), valid.flatten().double())
        self.counts.scatter_add_(0, target.flatten(), valid.flatten().double())

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
        """Copies on the host (on a CPU, .cpu() alone would alias the live tensors: no snapshot)."""
        V, host = self.vocab, lambda t: t.to("cpu", copy=True)
        return {"M": host(self.M[:V]), "written": host(self.written[:V]), "counts": host(self.counts[:V]),
                "hits": host(self.hits), "fallback": host(self.fallback)}

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


def retrieve(M: torch.Tensor, under: torch.Tensor, tpl: "Template") -> torch.Tensor:
    """The template's tokens under each request's node `under` (B,): node j gets M[token(parent j),
    rank j] of that request's matrix M (B, V+1, k). One gather per level (on a CPU with graft's kernels,
    one C++ call: cpu_kernels.retrieve). Returns (B, n) long."""
    if FUSED and use_kernels(M) and not torch.compiler.is_compiling():
        return cpu_kernels.retrieve(M, under, tpl.parents, tpl.ranks)
    B, n = under.shape[0], tpl.size
    buf = torch.empty(B, n + 1, dtype=torch.long, device=M.device)           # [nodes..., the node under]
    buf[:, n] = under                                                        # parent -1 reads it
    bi = torch.arange(B, device=M.device)[:, None]
    for idx, par, rank in tpl.levels:
        buf[:, idx] = M[bi, buf[:, par], rank[None]].long()
    return buf[:, :n]


def update(M: torch.Tensor, written: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor,
           path: torch.Tensor | None = None, A: torch.Tensor | None = None):
    """M[b, tokens[b, i]] = topk(logits[b, i], k) for every real node i of every request b; the
    accepted path (path[b, :A[b]+1]) is written last so it wins when a token occurs at several
    nodes. tokens, valid (B, N); logits (B, N, V); M (B, V+1, k) and written (B, V+1) each request's.
    Deterministic: one write per distinct token; padding and the losers write the spare row V."""
    B, N = tokens.shape
    V, k, dev = M.shape[1] - 1, M.shape[2], tokens.device
    prio = torch.arange(N, device=dev)[None]
    if path is not None:                                                       # accepted rows win
        on_path = torch.zeros(B, N, dtype=torch.long, device=dev).scatter(
            1, path, (torch.arange(path.shape[1], device=dev)[None] <= A[:, None]).long())
        prio = prio + N * on_path
    tok = torch.where(valid, tokens, V)
    order = torch.argsort(tok * (2 * N) + prio, dim=1)                         # by token, prio ascending
    t_sorted = tok.gather(1, order)
    last = torch.cat([t_sorted[:, 1:] != t_sorted[:, :-1], torch.ones_like(t_sorted[:, :1], dtype=torch.bool)], 1)
    rows = torch.where(last, t_sorted, V)
    top = top_ids(logits, k).gather(1, order[:, :, None].expand(-1, -1, k))
    bi = torch.arange(B, device=dev)[:, None]
    M[bi, rows] = top
    written[bi, rows] = True


def top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k best tokens of each row of logits (..., V), best first, int32: on a CPU with graft's kernels
    one pass a row, no sort (cpu_kernels.topk_rows)."""
    fast = use_kernels(logits) and not torch.compiler.is_compiling()
    return (cpu_kernels.topk_rows(logits, k)[1] if fast else logits.topk(k, dim=-1).indices).int()


def matrix_ranks(M: torch.Tensor, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The rank at which each node's row M[b, tokens[b, i]] held the target's actual choice (k: it did
    not). tokens, target (B, N) -> (B, N) long. (The hit rates the templates are built from.)"""
    B, k = tokens.shape[0], M.shape[2]
    rows = M[torch.arange(B, device=M.device)[:, None], tokens]               # (B, N, k)
    match = rows == target[..., None].int()
    return torch.where(match.any(-1), match.int().argmax(-1), k)


# ----------------------------------------------------------------------------- templates

PRIOR_HIT_RATES = (0.72, 0.3, 0.17, 0.12, 0.09, 0.075, 0.065, 0.055)   # decaying; used before warm-up


@dataclass
class Template:
    """A static tree of ranks, nodes in best-first order (so parents come first). With a context chain
    (with_chain) it is the retrieval tree's shape: the matrix's nodes, then the chain's (rank -1, the
    first one's parent -2: the root itself, whatever the matrix's nodes hang under)."""
    parents: torch.Tensor        # (n,) -1 = the node retrieval hangs under (the root, or a draft node)
    ranks: torch.Tensor          # (n,)
    depth: torch.Tensor          # (n,) 1-based
    levels: list                 # per depth: (node idx, parent idx, rank) tensors, for batched gathers
    score: torch.Tensor | None = None   # (n,) log of the product of hit rates on the node's rank path

    @property
    def size(self) -> int:
        return self.parents.numel()

    def widths(self) -> list:
        return torch.bincount(self.depth)[1:].tolist()

    def tensors(self) -> list:
        return [self.parents, self.ranks, self.depth, self.score] + [x for lv in self.levels for x in lv]

    def to(self, device) -> "Template":
        return Template(self.parents.to(device), self.ranks.to(device), self.depth.to(device),
                        [tuple(x.to(device) for x in lv) for lv in self.levels], self.score.to(device))


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
    return _template(parents, ranks, depth, [math.log(x) for x in score])


def _template(parents, ranks, depth, score) -> Template:
    long = lambda x: torch.tensor(x, dtype=torch.long)
    levels = []
    for d in range(1, max(depth, default=0) + 1):        # (host lists: built once, then moved to the device)
        idx = [j for j, x in enumerate(depth) if x == d]
        levels.append((long(idx), long([parents[j] for j in idx]), long([ranks[j] for j in idx])))
    return Template(long(parents), long(ranks), long(depth), levels, torch.tensor(score, dtype=torch.float32))


def with_chain(tpl: Template, T: int) -> Template:
    """The retrieval tree's shape: the template's nodes, then a chain of T context nodes under the root
    (rank -1; the first one's parent -2). Their scores are the request's, each round (context_scores)."""
    n = tpl.size
    return _template(tpl.parents.tolist() + [-2] + list(range(n, n + T - 1)), tpl.ranks.tolist() + [-1] * T,
                     tpl.depth.tolist() + list(range(1, T + 1)), tpl.score.tolist() + [0.0] * T)


# ----------------------------------------------------------------------------- context matches

def context_match(ctx: torch.Tensor, clen: torch.Tensor, G: int, T: int) -> tuple:
    """Each request's longest match of its recent context: the newest earlier position where its last
    m <= G tokens occur again (longest first, then newest), and the T tokens that followed there.
    ctx (B, S) the request's tokens so far (prompt, then output, the root last), the first clen (B,)
    real. Returns (tokens (B, T) long, real (B, T): a known token (before the root's position) after a
    match, m (B,) the match's length, 0: none). Static shapes, no host sync: G x S comparisons (on a CPU
    with graft's kernels, one C++ call that stops each comparison at its first mismatch)."""
    if FUSED and use_kernels(ctx) and not torch.compiler.is_compiling():
        return cpu_kernels.context_match(ctx, clen, G, T)
    (B, S), dev = ctx.shape, ctx.device
    i = torch.arange(G, device=dev)
    at = clen[:, None] - 1 - i[None]                                        # (B, G) the suffix, newest first
    tail = ctx.gather(1, at.clamp(0, S - 1))           # (an empty slot's clen may exceed a narrowed ctx)
    src = torch.arange(S, device=dev)[None] - i[:, None]                    # (G, S) compared with tail[i]
    eq = (ctx[:, src.clamp(min=0)] == tail[:, :, None]) & (src >= 0)[None] & (at >= 0)[:, :, None]   # (B, G, S)
    run = eq.long().cumprod(1).sum(1)                                       # (B, S) match length ending there
    run = torch.where(torch.arange(S, device=dev)[None] < clen[:, None] - 1, run, 0)   # earlier ends only
    best = (run * S + torch.arange(S, device=dev)[None]).argmax(1)          # longest, then newest
    m = run.gather(1, best[:, None])[:, 0]
    pos = best[:, None] + 1 + torch.arange(T, device=dev)[None]             # (B, T)
    return ctx.gather(1, pos.clamp(max=S - 1)), (pos < clen[:, None]) & (m[:, None] > 0), m


def context_scores(real: torch.Tensor, m: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """The chain's log scores, on the template's scale: node t (1-based) after a match of m tokens
    scores t * log q(m), q the warm-up's hit rate of matches that long (log_q (MATCH+1,)); -inf where
    there is no token to offer. real (B, T), m (B,). Returns (B, T) float32."""
    t = torch.arange(1, real.shape[1] + 1, device=real.device, dtype=torch.float32)
    return torch.where(real, t[None] * log_q[m.clamp(max=log_q.numel() - 1)][:, None], float("-inf"))


def context_append(ctx: torch.Tensor, clen: torch.Tensor, new: torch.Tensor, n: torch.Tensor):
    """Append each request's first n (B,) tokens of new (B, P) to its context (ctx (B, S), clen (B,));
    the rest write the spare last column, which no match reads."""
    S, P = ctx.shape[1], new.shape[1]
    j = torch.arange(P, device=ctx.device)[None]
    ctx.scatter_(1, torch.where(j < n[:, None], clen[:, None] + j, S - 1).clamp(max=S - 1), new)
    clen.add_(n)



# ----------------------------------------------------------------------------- hybrid trees

def graft_trees(d_tok, d_par, kept, r_tok, tpl: Template | None, anchor, free, r_score=None) -> tuple:
    """Merge each request's kept draft nodes and its retrieval subtree into one tree of n slots.

    d_tok, d_par, kept (B, n): the selected draft candidates (select: parents first, d_par indexing
    them, -1 = the root) and which of them each request keeps (a prefix-closed set); r_tok (B, R) the
    retrieval tree's tokens (tpl: its shape; None: no retrieval), hung under `anchor` (B,) (-1 = the
    root, or the index of a kept draft node; a parent -2 in tpl is the root itself); r_score (B, R)
    their log scores (default tpl.score; -inf: not offered). The kept nodes come first, compacted in
    order; a retrieved node that repeats a kept sibling's token, or an earlier retrieved sibling's, is
    merged into it (its children attach there, and the node kept takes the better score) and costs no
    slot; a node's score is capped by its parent's, and the free[b] (B,) best unmerged nodes by score
    (ties: tree order, so parents come first) take the next slots in that order: the result is
    prefix-closed. With the template's own scores this is the first free[b] unmerged nodes in template
    order. Slots left over are padding. Returns (tokens, parents, valid, retrieved), each (B, n),
    without the root: parents index the result, -1 = root; retrieved: the node's source (SOURCES, 0:
    drafted). Static shapes throughout."""
    B, n = d_tok.shape
    dev = d_tok.device
    if r_tok is not None and FUSED and use_kernels(d_tok) and not torch.compiler.is_compiling():
        return cpu_kernels.graft_trees(d_tok, d_par, kept, r_tok, tpl.score[None].expand(B, -1) if r_score is None else r_score,
                                       tpl.parents, tpl.depth, tpl.ranks, anchor, free)     # the same, in C++ loops
    kpos = kept.cumsum(1) - 1                                             # a kept node's index in the result
    d_parc = torch.where(d_par >= 0, kpos.gather(1, d_par.clamp(min=0)), -1)
    d_dst = torch.where(kept, kpos, n)                                    # the dropped write a spare slot
    r_vals = (None,) * 4
    if r_tok is not None:
        R = r_tok.shape[1]
        score = (tpl.score[None].expand(B, R) if r_score is None else r_score).clone()
        hid = torch.zeros(B, R, dtype=torch.long, device=dev)            # hybrid id: draft index, or n + j if new
        merged = torch.zeros(B, R, dtype=torch.bool, device=dev)
        eff = torch.full((B, R), float("-inf"), device=dev)              # score capped by the parent's
        up = lambda par: torch.where(par[None] == -1, anchor[:, None],                       # noqa: E731
                                     torch.where(par[None] < -1, -1, hid[:, par.clamp(min=0)]))
        for idx, par, _ in tpl.levels:                                    # level by level: parents are resolved
            ph, tok, off = up(par), r_tok[:, idx], score[:, idx] > float("-inf")        # (B, l)
            same = kept[:, None, :] & (d_par[:, None, :] == ph[:, :, None]) & (d_tok[:, None, :] == tok[:, :, None])
            hit = same.any(-1) & off
            l = idx.numel()                                               # an earlier sibling of this level
            twin = ((ph[:, :, None] == ph[:, None, :]) & (tok[:, :, None] == tok[:, None, :]) & off[:, None, :]
                    & ~hit[:, None, :] & torch.ones(l, l, dtype=torch.bool, device=dev).tril(-1)[None])
            dup = twin.any(-1) & off & ~hit
            first = twin.int().argmax(-1)                                 # (B, l) the earliest such sibling
            merged[:, idx] = hit | dup
            into = torch.where(dup, first, torch.arange(l, device=dev))                # itself, or the sibling kept
            hid[:, idx] = torch.where(hit, same.int().argmax(-1), n + idx[into])
            lifted = score[:, idx].scatter_reduce(1, into, score[:, idx], "amax")
            cap = torch.where(ph >= n, eff.gather(1, (ph - n).clamp(0, R - 1)), float("inf"))
            eff[:, idx] = torch.minimum(lifted, cap)
        new = ~merged & (eff > float("-inf"))
        order = torch.sort(torch.where(new, eff, float("-inf")), dim=1, descending=True, stable=True).indices
        ns = new.gather(1, order)
        take = torch.zeros_like(new).scatter(1, order, ns & (ns.cumsum(1) <= free[:, None]))
        rank = torch.zeros_like(hid).scatter(1, order, ns.cumsum(1) - 1)   # its place among the taken
        slot = kept.sum(1, keepdim=True) + rank
        ph = up(tpl.parents)
        as_draft = torch.where(ph >= 0, kpos.gather(1, ph.clamp(0, n - 1)), -1)
        r_par = torch.where(ph >= n, slot.gather(1, (ph - n).clamp(0, R - 1)), as_draft)
        r_dst = torch.where(take, slot, n)
        src = torch.where(tpl.ranks < 0, SOURCES["context"], SOURCES["matrix"])[None].expand(B, R)
        r_vals = (r_tok, r_par, take, src)
    out = []
    zeros = torch.zeros_like(d_tok)
    for (d_val, fill), r_val in zip(((d_tok, 0), (d_parc, -1), (kept, False), (zeros, 0)), r_vals):
        t = torch.full((B, n + 1), fill, dtype=d_val.dtype, device=dev).scatter(1, d_dst, d_val)
        out.append((t if r_val is None else t.scatter(1, torch.where(r_dst < n, r_dst, n), r_val))[:, :n])
    return tuple(out)


def with_root(root: torch.Tensor, tokens, parents, valid, retrieved, active: torch.Tensor,
              grow: torch.Tensor | None = None) -> Tree:
    """Prepend the roots (B,) to root-less trees (B, n) (parents -1 = the root). An empty slot
    (active (B,) False) gets a tree that is all padding; a slot that drafts nothing this round (grow
    (B,) False: engine.Pacer) keeps its root alone, its candidates padding."""
    col = lambda x: x[:, None]
    keep = col(active) if grow is None else col(active & grow)
    return Tree(torch.cat([col(root), tokens], 1),
                torch.cat([torch.full_like(col(root), -1), torch.where(parents < 0, 0, parents + 1)], 1),
                torch.cat([col(active), valid & keep], 1),
                torch.cat([torch.zeros_like(col(active)), retrieved], 1))


@dataclass
class Config:
    """The shape of a round. `prune` stops drafting at checkpoints; `retrieve` fills the freed slots
    from the continuation matrix. eagle3 = neither, prune = prune only, graft = both. The ablations
    (docs/graft.md section 7), all drafting to full depth: "fixed" splits the budget into a fixed draft and
    retrieval part (40 + 20 at budget 60); "root" and "tail" add retrieved nodes (20 at budget 60) on top
    of the dense tree, under the root or under the best deepest draft node."""
    budget: int = 60                   # candidate nodes under the root
    top_k: int = 10                    # draft children per expansion
    depth: int = 8                     # draft levels at most (forwards a round when not pruned; --budget auto picks it)
    checkpoints: tuple = CHECKPOINTS
    keep: tuple | None = None          # draft nodes kept when pruned at each checkpoint (default scaled 8/24/40)
    thresholds: dict | None = None     # tau per checkpoint (default: calibrated in warm-up)
    prune: bool = True                 # (prune, retrieve, ablation: set by the method, graft.METHODS)
    retrieve: bool = True
    ablation: str | None = None        # "fixed", "root" or "tail"
    policy: str | None = None          # pruning: "stop" or "replace" (POLICIES; default: stop, or replace at B > 1 under CUDA graphs)
    matrix_k: int = 8
    recycle_size: int = 80
    sources: tuple = tuple(SOURCES)    # what retrieval draws from (--sources): the matrix, context matches
    pld_ngram: int = 3
    pld_tokens: int = 5                # prompt lookup's chain (--pld-tokens): on a CPU each node is a row of the pass
    block: int = 16                    # a DFlash block: the root + block - 1 guesses (set from the drafter)
    tail_threshold: float | None = None   # graft-tail's cut (default: calibrated in the warm-up)
    pace: bool | None = None           # cost-aware rounds: plain steps where no tree pays (engine.Pacer; None: engine.PACE)

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




@dataclass
class Calibration:
    """What the warm-up measured (calibrate.warm_up), handed to the methods that read it (make_method):
    per calibration ("throughput", "youden") and calibrated method, {"budget", "thresholds", "rate"}
    and, for "throughput", the draft "depth" --budget auto runs with;
    `chosen`: the calibration a "stop" method reads (--calibration); the matrix's per-rank hit rates;
    the expected tokens/s by budget; the cost timings' relative spread. Empty: nothing calibrated."""
    methods: dict = field(default_factory=dict)
    chosen: str = "throughput"
    hit_rates: tuple = PRIOR_HIT_RATES
    budget_curve: dict = field(default_factory=dict)
    cost_spread: float | None = None
    context_rates: tuple = PRIOR_CONTEXT_RATES    # q(m): a context match's hit rate by its length m
    tail_threshold: float | None = None    # graft-tail's cut (calibrate.calibrate_tail)

    def get(self, method: str | None, kind: str | None = None) -> dict | None:
        """{"budget", "thresholds", "rate"} of `method` under calibration `kind` (default: chosen)."""
        return self.methods.get(kind or self.chosen, {}).get(method)

    @property
    def thresholds(self) -> dict:
        return dict((self.get("graft") or {}).get("thresholds", {}))

    @property
    def budget(self) -> int | None:
        return (self.get("graft") or {}).get("budget")


# ----------------------------------------------------------------------------- methods

@dataclass
class Round:
    """One round of every request, as the engine reads it: the trees, what the verifier returned,
    per request the stage that pruned it (None: drafted to full depth, or no stages), the round's
    draft forwards and host syncs; with record=True what the warm-up reads (`record`)."""
    tree: Tree
    v: object
    stages: list
    forwards: int = 0
    syncs: int = 1
    record: dict | None = None
    plain: bool = False               # a plain round (Method.plain_round): no tree anywhere
    learned: bool = True              # a plain round kept the method's drafter, matrix and context in step
    grow: list | None = None          # per slot, whether it drafted (Engine.step; None: every slot did)


class RowCounts:
    """catch_up's row counts (B,): written on the host into pinned memory, sent into a static device buffer
    (dev) by one asynchronous copy, no host sync."""

    def __init__(self, B: int, device):
        self.host = torch.zeros(B, dtype=torch.long, pin_memory=torch.device(device).type == "cuda")
        self.dev = torch.zeros(B, dtype=torch.long, device=device)

    def send(self, n: list) -> torch.Tensor:
        # (free to write: the last round's commit waited for any earlier copy out of host)
        return self.dev.copy_(self.host.copy_(torch.tensor(n)), non_blocking=True)


class Method:
    """A decoding method: each round it proposes a tree per request under its root, the one verifier
    (verify.verify) checks them all in one target pass, and the method learns from the verification.
    A method declares what it needs on its class; METHODS maps each --method name to its class.
    N: nodes verified per request and round (root included); P: the longest path a round can accept
    (root included)."""
    needs_head = False        # an EAGLE-3 head drafts (and verification captures its features)
    needs_matrix = False      # a continuation matrix per request
    needs_block = False       # a DFlash drafter drafts blocks (and verification captures its features)
    has_budget = False        # the verification budget (--budget) sizes its tree
    calibrated = None         # whose warm-up calibration it reads (calibrate.py); None: none
    source = "draft"          # what proposes the nodes the matrix does not (--show-tree)
    settings: dict = {}       # what it sets in the round's Config
    paced = True              # its rounds may be plain steps where no tree pays (engine.Pacer)
    shadows = False           # its proposals can be scored without a pass (shadow): the pacer needs no probes
    cuts = False              # a proposal may be cut short (its first Slot.length nodes: the pacer's choice)
    pacer = None              # (set by the engine)

    def __init__(self, eng, cfg: Config, cal: Calibration | None = None, matrix: ContinuationMatrix | None = None):
        graphs = eng.compiling and eng.cuda          # (its steps replay CUDA graphs, as Steps and cli read it)
        self.cfg, self.cal = self.configure(cfg, eng.drafter, eng.B, graphs), cal or Calibration()
        self.N, self.P = self.shape(self.cfg)
        self.matrix = None
        if self.needs_matrix or matrix is not None:    # each request's own matrix (B, V+1, k), from the prior
                                                       # (a method that reads none learns one when given it)
            self.matrix = matrix if matrix is not None else eng.matrix
            self.M = self.matrix.M[None].repeat(eng.B, 1, 1)
            self.written = self.matrix.written[None].repeat(eng.B, 1)
        self.uses = tuple(self.cfg.sources) if self.needs_matrix else ()      # the retrieval sources it reads
        self.ctx = None
        if "context" in self.uses:      # each request's tokens so far (B, S), the first clen[b] real
            self.ctx = torch.zeros(eng.B, eng.model.max_seq_len + self.P + 1, dtype=torch.long, device=eng.device)
            self.clen = torch.zeros(eng.B, dtype=torch.long, device=eng.device)
            self.log_q = torch.tensor([math.log(q) if q > 0 else float("-inf") for q in self.cal.context_rates],
                                      device=eng.device)
        self.ctx_cols = None              # the context columns this round's match reads (None: all; see match_cols)

    @classmethod
    def configure(cls, cfg: Config, drafter=None, batch: int = 1, graphs: bool = False) -> Config:
        """cfg as this method runs it: its settings, the head's geometry, Graft's policy at this B and graphs."""
        cfg = replace(cfg, **cls.settings)
        if drafter is not None and cls.needs_head:      # a tree of n nodes needs no wider beam, no deeper level:
            cfg = replace(cfg, top_k=min(drafter.top_k, cfg.budget), depth=min(drafter.depth, cfg.depth, cfg.budget))
        if cfg.prune:
            cfg = replace(cfg, policy=cfg.policy or ("replace" if batch > 1 and graphs else "stop"))
        return cfg

    @classmethod
    def shape(cls, cfg: Config) -> tuple:
        return 1, 1

    def tensors(self) -> list:
        """What lives across rounds (the engine declares it static)."""
        return ([self.M, self.written] if self.matrix is not None else []) + (
            [self.ctx, self.clen, self.log_q] if self.ctx is not None else [])

    # -- a request's life in slot b (host-side calls, around the compiled steps)
    def admit(self, eng, b: int):
        if self.matrix is not None:
            self.M[b].copy_(self.matrix.M)
            self.written[b].copy_(self.matrix.written)
        if self.ctx is not None:
            self.clen[b] = 0

    def prompt_chunk(self, eng, b: int, ids, logits, feats, n: int):
        """After each prefill chunk of slot b's prompt: ids (1, C), logits (1, 1, V) its last real row's ((1, C, V)
        for prompt log-probs: prefill_chunk), feats (1, C, F) or None; the first n real. The context keeps its
        tokens (a copy on the device). The matrix does not learn the prompt (docs/graft.md, section 3)."""
        if self.ctx is not None:
            L = eng.slots[b].L                # after this chunk
            self.ctx[b, L - n:L] = ids[0, :n]
            self.clen[b] = L

    def prefilled(self, eng, b: int):
        """Slot b's prompt is in the cache and its first token in eng.root[b] (the context's last)."""
        if self.ctx is not None:
            context_append(self.ctx[b:b + 1], self.clen[b:b + 1], eng.root[b:b + 1, None], self.clen[b:b + 1] * 0 + 1)

    def finish(self, eng, b: int):
        if self.matrix is not None:           # what the request learned becomes the prior
            self.matrix.M.copy_(self.M[b])
            self.matrix.written.copy_(self.written[b])

    def round(self, eng, record: bool = False, full: bool = False) -> Round:
        """Propose, verify, learn, for every slot (device work; the engine commits). record: return what
        the warm-up reads; full: draft to full depth whatever the confidences (compile warm-up). A slot
        whose eng.grow is False this round (engine.Pacer) keeps its root alone."""
        raise NotImplementedError

    room = PLAIN_RUN          # the plain rounds its pending rows hold

    def can_catch_up(self, eng) -> bool:
        """Whether a long plain run needs no drafting round: no drafter reads pending rows, or its drafter
        can read them outside one (catch_up)."""
        return not self.pending

    def catch_up(self, eng, which: list):
        """Let the drafter of each slot in `which` (B bools) read its pending rows now, outside a drafting
        round (engine.Pacer: a plain run longer than self.room then needs no tree pass). Only where
        can_catch_up."""
        raise NotImplementedError

    def shadow(self, eng) -> tuple:
        """Probes that cost no pass (engine.Pacer, once a round; only where `shadows`): (per slot the proposals
        settled, each (its kind, accepted + 1 had it been drafted), per slot this round's proposal's kind:
        None, no proposal). A kind predicts how far a proposal gets (pld: the n of the matched n-gram)."""
        raise NotImplementedError

    def plain_round(self, eng, learn: bool = True) -> Round:
        """A round without trees, when none pays (engine.Pacer): plain decoding's step for every slot
        (no draft, no head), and what the method keeps in step learns from it (plain_learn), so that its
        next drafting round starts where decoding is; learn=False (Pacer.deep): `ar`'s step alone, and they
        skip this token (their next rounds read the text without it: a draft may be worse, the tokens the same)."""
        tree = Tree(eng.root[:, None].clone(), torch.full_like(eng.root[:, None], -1), eng.active[:, None] > 0)
        v = eng.steps.decode(eng.root, eng.L, eng.active, eng.cols(1), eng.smp, eng.mode, self.pending and learn)
        eng.clock.mark("verify")
        if learn:
            eng.steps.plain_learn(self, tree, v, eng.active)
            eng.clock.mark("update")
        return Round(tree, v, [None] * eng.B, 0, 1, plain=True, learned=learn)

    @property
    def pending(self) -> bool:
        """Whether a drafter reads each round's verified features (an EAGLE-3 head, a DFlash drafter)."""
        return self.needs_head or self.needs_block


class Plain(Method):
    """ar: the root alone, one token a round through the decode step."""
    source = None
    paced = False

    def round(self, eng, record=False, full=False) -> Round:
        tree = Tree(eng.root[:, None].clone(), torch.full_like(eng.root[:, None], -1), eng.active[:, None] > 0)
        v = eng.steps.decode(eng.root, eng.L, eng.active, eng.cols(1), eng.smp, eng.mode)
        eng.clock.mark("verify")
        return Round(tree, v, [None] * eng.B)


def lookup(ctx: list, ngram: int, n_tokens: int) -> tuple:
    """Prompt lookup: (n, the <= n_tokens ids after the newest earlier occurrence of ctx's last n), n the
    longest of ngram, ..., 1 that recurs in ctx (host token ids); (0, []) if none. bytes.rfind over the ids as
    int32, a match on a 4-byte boundary: it runs every round, and a Python loop took 1.3 ms at 4,096 ids."""
    data = array("i", ctx).tobytes()
    for n in range(min(ngram, len(ctx) - 1), 0, -1):
        tail, end = data[-4 * n:], 4 * (len(ctx) - 1)           # (the occurrence ends before the last token)
        while (i := data.rfind(tail, 0, end)) >= 0:
            if i % 4 == 0:
                return n, ctx[i // 4 + n:i // 4 + n + n_tokens]
            end = i + 4 * n - 1                                  # (misaligned: look further back)
    return 0, []


def settle(seen: list, chain: list) -> int | None:
    """What a drafting round of chain commits (its prefix matching seen, the tokens after its root, + 1), once
    seen mismatches or covers it; else None."""
    a = next((i for i, (x, y) in enumerate(zip(seen, chain)) if x != y), len(seen))
    return a + 1 if a < len(seen) or a == len(chain) else None


class PromptLookup(Method):
    """Prompt lookup decoding: the tokens after the newest earlier occurrence of the last n committed tokens
    (n = 3, 2, 1), a chain, searched on the host; one asynchronous copy from pinned memory into a static buffer
    (row 0 tokens, row 1 whether the node is real). The pacer prices each n (shadow): chat chains commit
    1.33 tokens a round at n = 1, 4.3 at n = 3 (scripts/pld_kinds.py); alone, it cuts a chain to the length
    that pays best (Pacer.cut: a 3-node pass costs a Zen 3 ~1.2 tokens, a 6-node one ~2)."""
    source = "copied"
    shadows = cuts = True

    def __init__(self, eng, cfg, cal=None, matrix=None):
        super().__init__(eng, cfg, cal, matrix)
        self.host = torch.zeros(2, eng.B, self.N, dtype=torch.long, pin_memory=eng.cuda)
        self.chains = torch.zeros(2, eng.B, self.N, dtype=torch.long, device=eng.device)
        self.parents = (torch.arange(self.N, device=eng.device) - 1).expand(eng.B, -1).contiguous()
        self.guess = [[] for _ in range(eng.B)]   # per slot, proposals not yet settled: (request, at, chain, n)
        self.now = [None] * eng.B                 # per slot, this round's proposal: (request, at, chain)
        self.drafted = [0] * eng.B                # per slot, the nodes this round drafted (Pacer.seen)

    @classmethod
    def shape(cls, cfg):
        return cfg.pld_tokens + 1, cfg.pld_tokens + 1

    def tensors(self):
        return [self.chains, self.parents]

    def propose(self, r, b: int) -> tuple:
        """(n, chain) of request r in slot b at its newest token, looked up once a round."""
        if self.now[b] is None or self.now[b][0] is not r or self.now[b][1] != len(r.tokens):
            self.now[b] = (r, len(r.tokens), *lookup(r.ids + r.tokens, self.cfg.pld_ngram, self.cfg.pld_tokens))
        return self.now[b][2:]

    def shadow(self, eng) -> tuple:
        """A chain depends on the committed tokens alone, so every round's, drafted or not, is scored against
        the tokens decoded after it (its matching prefix + 1, as a drafting round commits) once it mismatches
        or is all decoded. Returns (per slot the settled (n, tokens), per slot this round's n: None, no chain)."""
        settled, keys = [], []
        for b, r in enumerate(eng.requests()):
            mine = [g for g in self.guess[b] if g[0] is r]                     # (a request that left: dropped)
            got = [settle(r.tokens[at:at + len(c)], c) for _, at, c, _ in mine]
            settled.append([(g[3], a) for g, a in zip(mine, got) if a])
            n, chain = self.propose(r, b) if r is not None else (0, [])
            self.guess[b] = [g for g, a in zip(mine, got) if not a] + ([(r, len(r.tokens), chain, n)] if chain else [])
            keys.append(n if chain else None)
        return settled, keys

    def round(self, eng, record=False, full=False) -> Round:
        self.host.zero_()            # free to write: the last round's commit waited for its copy
        self.drafted = [0] * eng.B
        for b, r in enumerate(eng.requests()):
            if r is not None:             # (a slot that drafts nothing this round: its root alone)
                ids = [r.tokens[-1]] + (self.propose(r, b)[1][:eng.slots[b].length] if eng.drafts[b] else [])
                self.drafted[b] = len(ids) - 1
                self.host[0, b, :len(ids)] = torch.tensor(ids)
                self.host[1, b, :len(ids)] = 1
        self.chains.copy_(self.host, non_blocking=True)
        tree = Tree(self.chains[0], self.parents, self.chains[1] > 0)
        eng.clock.mark("assemble")
        v = eng.steps.verify(tree, eng.L, eng.active, eng.cols(self.N), eng.smp, eng.mode, self.P, False, eng.root)
        eng.clock.mark("verify")
        return Round(tree, v, [None] * eng.B)


class Recycle(Method):
    """Token Recycling: a static retrieval tree from each request's continuation matrix, no draft head."""
    needs_matrix = True
    source = "matrix"

    def __init__(self, eng, cfg, cal=None, matrix=None):
        super().__init__(eng, cfg, cal, matrix)
        self.tpl = build_template(self.cal.hit_rates, self.cfg.recycle_size).to(eng.device)
        self.rtpl = with_chain(self.tpl, MAX_TEMPLATE_DEPTH).to(self.tpl.parents.device) if self.ctx is not None else self.tpl

    @classmethod
    def shape(cls, cfg):
        chain = MAX_TEMPLATE_DEPTH if "context" in cfg.sources else 0
        depth = max(len(build_template(PRIOR_HIT_RATES, cfg.recycle_size).levels), chain)
        return cfg.recycle_size + 1, min(cfg.recycle_size, depth) + 1

    def tensors(self):
        return super().tensors() + self.tpl.tensors() + self.rtpl.tensors()

    def round(self, eng, record=False, full=False) -> Round:
        st = eng.steps
        self.ctx_cols = match_cols(self, eng)
        tree = st.recycle_tree(self, eng.root, eng.active, eng.grow)
        eng.clock.mark("assemble")
        v = st.verify(tree, eng.L, eng.active, eng.cols(self.N), eng.smp, eng.mode, self.P, False, eng.root)
        eng.clock.mark("verify")
        rec = {"rank": matrix_ranks(self.M, tree.tokens, v.target)} if record else None   # before it learns
        st.learn(self, tree, v, eng.active)
        eng.clock.mark("update")
        return Round(tree, v, [None] * eng.B, record=rec)


def recycle_tree(m: Recycle, root: torch.Tensor, active: torch.Tensor, grow: torch.Tensor | None = None) -> Tree:
    """Recycle's step: every request's retrieval tree (its matrix's template, its context chain) under
    its root, the best `recycle_size` nodes of it (graft_trees with no draft node kept)."""
    r_tok, r_score = retrieval(m, root)
    B, n = root.shape[0], m.tpl.size
    none = torch.zeros(B, n, dtype=torch.long, device=root.device)
    return with_root(root, *graft_trees(none, none - 1, none > 0, r_tok, m.rtpl, torch.full_like(root, -1),
                                        torch.full_like(root, n), r_score), active > 0, grow)


def match_cols(m: Method, eng) -> int | None:
    """The context columns a round's match needs (Method.ctx_cols): eager, those of the longest live
    request (its tokens so far, the root last: L + 1), so that a match costs G x its length, not G x the
    longest context the engine allows (~0.7 ms a round at 4,096 on a CPU); compiled, all (a static
    shape). What a match returns for real positions does not depend on it."""
    if m.ctx is None or eng.compiling:
        return None
    return min(m.ctx.shape[1], 2 + max([0] + [s.L for s in eng.slots if s.request is not None]))


def retrieval(m: Method, under: torch.Tensor) -> tuple:
    """Every request's retrieval tree (m.rtpl): the template's tokens from its own matrix under `under`
    (B,), then its context chain after its longest context match; and their log scores (a source the
    method does not use offers nothing: -inf). Returns (tokens, scores), (B, R) each."""
    B, n = under.shape[0], m.tpl.size
    if "matrix" in m.uses:
        r_tok, r_score = retrieve(m.M, under, m.tpl), m.tpl.score[None].expand(B, n)
    else:
        r_tok = torch.zeros(B, n, dtype=torch.long, device=under.device)
        r_score = torch.full((B, n), float("-inf"), device=under.device)
    if m.ctx is None:
        return r_tok, r_score
    ctx = m.ctx if m.ctx_cols is None else m.ctx[:, :m.ctx_cols]
    c_tok, real, mlen = context_match(ctx, m.clen, MATCH, m.rtpl.size - n)
    return torch.cat([r_tok, c_tok], 1), torch.cat([r_score, context_scores(real, mlen, m.log_q)], 1)


class Eagle3Tree(Method):
    """eagle3: the dense EAGLE-3 tree, the best `budget` of a top_k x depth expansion. The methods
    below are configurations of the same round (`settings`): prune (stopped or thinned at the
    checkpoints, freed slots left empty, ECHO-style), graft (the freed slots filled by retrieval:
    this project's point) and the ablations (docs/graft.md section 7)."""
    needs_head = has_budget = True
    calibrated = "eagle3"
    settings = dict(prune=False, retrieve=False, ablation=None)

    def __init__(self, eng, cfg, cal=None, matrix=None):
        super().__init__(eng, cfg, cal, matrix)
        cfg, dev, k = self.cfg, eng.device, self.cfg.top_k
        self.policy = cfg.policy if cfg.prune else None
        if self.policy not in (None, *POLICIES):
            raise ValueError(f"unknown pruning policy {self.policy!r}: {', '.join(POLICIES)}")
        self.stages = cfg.stages()
        self.checkpoints = cfg.checkpoints if cfg.prune else ()
        got = cal.get(self.calibrated, POLICIES.get(self.policy)) if cal is not None and self.policy else None
        thr = cfg.thresholds if cfg.thresholds is not None else (got or {}).get("thresholds", {})
        self.thresholds = {c: float(thr.get(c, 0.0)) for c in self.checkpoints}
        n = self.N - 1
        # stop: per checkpoint the draft nodes it keeps and the candidate slots drafted by then, then
        # the same for a round drafted to full depth; replace: log tau per candidate slot
        stops = [*self.checkpoints, None] if self.policy == "stop" else [None]
        self.keep = torch.tensor([self.stages[s][0] for s in stops], device=dev)
        self.drafted = torch.tensor([k + (s if s is not None else cfg.depth - 1) * k * k for s in stops], device=dev)
        self.taus = torch.tensor([self.thresholds[c] for c in stops[:-1]], dtype=torch.float64, device=dev)
        self.log_tau = self.slot_thresholds().to(dev)
        fills = cfg.retrieve and (cfg.ablation is not None or any(t > 0 for t in self.thresholds.values()))
        if cfg.retrieve and not fills:
            # thresholds that never prune free no slot for retrieval to fill (the warm-up calibrates so where
            # trees are small): then graft is prune, and keeps no matrix or context that nothing would read
            self.matrix = self.M = self.written = self.ctx = self.clen = None
        self.tpl = build_template(self.cal.hit_rates, n).to(dev) if fills else None
        self.rtpl = with_chain(self.tpl, MAX_TEMPLATE_DEPTH).to(self.tpl.parents.device) if self.ctx is not None else self.tpl
        self.anchor = "deepest" if cfg.ablation == "tail" or self.policy == "replace" else "root"
        self.conf = torch.full((eng.B, max(len(self.checkpoints), 1)), float("inf"), device=dev)
        self.record_tpl = None           # the warm-up's: a retrieval under the root to record
        # the head's next input, per request: the accepted path's features and the token after each
        F = len(eng.model.capture_layers) * eng.model.args.dim
        self.room = PLAIN_RUN if eng.compiling else LAZY_RUN       # (compiled, an extend reads every row)
        self.pend_feats = torch.zeros(eng.B, self.P + self.room, F, dtype=eng.dtype, device=dev)
        self.pend_ids = torch.zeros(eng.B, self.P + self.room, dtype=torch.long, device=dev)
        self.pend_n = torch.zeros(eng.B, dtype=torch.long, device=dev)
        self.caught = RowCounts(eng.B, dev)

    @classmethod
    def shape(cls, cfg):
        n = max(K + R for K, R in cfg.stages().values())
        T = MAX_TEMPLATE_DEPTH if cfg.retrieve or cfg.ablation else 0
        deep = cfg.ablation == "tail" or (cfg.prune and cfg.retrieve and cfg.policy == "replace")
        return 1 + n, min(1 + n, 1 + (cfg.depth + T if deep else max(cfg.depth, T)))

    def tensors(self):
        return super().tensors() + [self.keep, self.drafted, self.taus, self.log_tau, self.conf, self.pend_feats,
                                    self.pend_ids, self.pend_n, self.caught.dev] + (
            self.tpl.tensors() + self.rtpl.tensors() if self.tpl is not None else [])

    def slot_thresholds(self) -> torch.Tensor:
        """log tau per candidate slot (C,) for the replace policy: the threshold of the deepest
        checkpoint the slot's level has passed (checkpoint c tests the best path at level c+1);
        -inf = never replaced."""
        k, D = self.cfg.top_k, self.cfg.depth
        out = []
        for lv in level_of(torch.arange(k + (D - 1) * k * k), k).tolist():
            passed = [c for c in sorted(self.thresholds) if c <= lv - 1] if self.policy == "replace" else []
            tau = self.thresholds[passed[-1]] if passed else 0.0
            out.append(math.log(tau) if tau > 0 else float("-inf"))
        return torch.tensor(out, dtype=torch.float32)

    # -- the prompt: the head's committed rows (row t pairs feature t with token t+1: docs/graft.md, EAGLE-3 heads)
    def admit(self, eng, b):
        super().admit(eng, b)
        self._last = None

    def prompt_chunk(self, eng, b, ids, logits, feats, n):
        super().prompt_chunk(eng, b, ids, logits, feats, n)
        if self._last is None:           # the first chunk: rows (f_0, p_1) .. (f_{n-2}, p_{n-1})
            F, I, real = feats, torch.cat([ids[:, 1:], ids[:, :1] * 0], 1), n - 1
        else:                            # later ones start with the previous chunk's last feature
            F, I, real = torch.cat([self._last, feats[:, :-1]], 1), ids, n
        self._last = feats[:, n - 1:n].clone()      # an output of the prefill step, read after its next replay
        eng.head_prefill(b, F, I, real)

    def finish(self, eng, b):
        super().finish(eng, b)
        self.pend_n[b] = 0                    # an empty slot's extend reads nothing

    def prefilled(self, eng, b):
        """The first round's extend reads the prompt's last feature with the first token."""
        super().prefilled(eng, b)
        self.pend_feats[b].zero_()
        self.pend_feats[b, 0] = self._last[0, 0]
        self.pend_ids[b].zero_()
        self.pend_ids[b, 0] = eng.root[b]
        self.pend_n[b] = 1
        self._last = None

    def can_catch_up(self, eng) -> bool:
        return not eng.compiling          # (a compiled extend reads every pending row, a static shape)

    def catch_up(self, eng, which):
        """The head reads each chosen slot's pending rows but the last (an extend whose level-1 draft nobody
        reads), which then becomes its first pending row: the rows its next drafting round's extend would
        have written, the same keys in the same order, so it drafts the same tree."""
        n = [s.pend - 1 if w and s.request is not None else 0 for w, s in zip(which, eng.slots)]
        w = max(n)
        if w <= 0:
            return
        nt = self.caught.send(n)
        eng.steps.extend(self.pend_feats[:, :w], self.pend_ids[:, :w], nt, eng.cols(w, head=True), 1)
        for b, c in enumerate(n):
            if c:
                self.pend_feats[b, 0] = self.pend_feats[b, c]
                self.pend_ids[b, 0] = self.pend_ids[b, c]
                eng.slots[b].Ld += c
                eng.slots[b].pend -= c
        self.pend_n.sub_(nt)

    # -- one round
    def round(self, eng, record=False, full=False) -> Round:
        st = eng.steps
        # 1. draft with checkpoints: the head reads each request's accepted path and drafts level by
        #    level; at checkpoint c (a host sync) a request whose best path's probability is below tau_c
        #    stops (stop policy); drafting ends when every request has stopped
        stages, forwards, syncs, conf = self.draft(eng, record or full, full)
        eng.clock.mark("draft")
        # 2-4. keep the best draft nodes, retrieve from each request's matrix, graft: one tree each
        self.ctx_cols = match_cols(self, eng)
        tree = st.assemble(self, eng.root, eng.active, eng.grow)
        eng.clock.mark("assemble")
        # 5. verify: one target pass over every tree, exact acceptance, KV compaction (the one verifier)
        v = st.verify(tree, eng.L, eng.active, eng.cols(self.N), eng.smp, eng.mode, self.P, True, eng.root)
        eng.clock.mark("verify")
        rec = self.recorded(eng, tree, v, conf) if record else None       # before the matrix learns
        # 6. learn: the matrices learn every verified node's top-k; the head's next input is the path
        st.learn(self, tree, v, eng.active)
        eng.clock.mark("update")
        return Round(tree, v, stages, forwards, 1 + syncs, rec)      # commit's transfer + the checkpoints'

    def draft(self, eng, watch_all: bool, full: bool) -> tuple:
        """Step 1. `extend` reads the accepted paths (the drafter's pending input) and drafts level 1;
        each `level` drafts one more. After the forward that produced level c+1, checkpoint c compares
        every request's best-path probability conf_c with tau_c (one host sync) and stops those below;
        drafting ends when no active request goes on. The confidences go to self.conf for the
        assembly (which applies the same test on the device). Returns (stage per slot: the checkpoint
        that stopped it, or None; draft forwards; host syncs; {c: conf_c (B,)} when watch_all)."""
        st, B = eng.steps, eng.B
        D, k = self.cfg.depth, self.cfg.top_k
        going = [r is not None for r in eng.requests()]
        stages, seen, syncs = [None] * B, {}, 0
        w = eng.pending_rows(self)
        conf = st.extend(self.pend_feats[:, :w], self.pend_ids[:, :w], self.pend_n, eng.cols(w, head=True), k)
        eng.advance_head()
        forwards = 1
        cps = {c: i for i, c in enumerate(self.checkpoints)} if self.policy == "stop" else {}
        if full:                                            # no checkpoint prunes (the compile warm-up)
            self.conf.fill_(float("inf"))
        for c in range(D):                                  # level c+1 exists now
            if c in cps and not full:
                self.conf[:, cps[c]] = conf
            if watch_all and c in self.cfg.checkpoints:
                seen[c] = conf.clone()                      # (read after later levels replay their step)
            if c in cps and not full:
                got = conf.tolist()                         # the checkpoint's host sync
                syncs += 1
                for b in range(B):
                    if going[b] and got[b] < self.thresholds[c]:
                        going[b], stages[b] = False, c
                if not any(going):
                    return stages, forwards, syncs, seen
            if c == D - 1:
                break
            conf = st.level(eng.fills.level[c], eng.cols((D - 1) * k, head=True), k)   # level c+2
            forwards += 1
        return stages, forwards, syncs, seen

    def recorded(self, eng, tree, v, conf) -> dict:
        """What the warm-up reads of a round (calibrate.py), taken before the matrix learns (after, it
        would already hold the target's answer for this very round)."""
        d = eng.drafter
        out = {"conf": conf, "scores": d.scores.clone(), "tokens": d.tokens.clone(), "parents": d.parents.clone()}
        if self.matrix is not None:
            out["rank"] = matrix_ranks(self.M, tree.tokens, v.target)
            if self.record_tpl is not None:
                out["retrieved"] = retrieve(self.M, tree.tokens[:, 0], self.record_tpl)
        return out


def assemble(d, m: Eagle3Tree, root: torch.Tensor, active: torch.Tensor, grow: torch.Tensor | None = None) -> Tree:
    """Steps 2-4 of a round, for every request: keep, retrieve, graft (one graph per method).

    keep: the best n candidates (select); a request keeps, under the stop policy, the best K of its
    stage (the first checkpoint whose confidence, m.conf, is below its threshold, on levels drafted by
    then), under the replace policy every node whose path confidence and its ancestors' pass their
    checkpoint's threshold, otherwise the best K of the round's one stage. retrieve: the template from
    the request's own matrix under the root (or, for the tail ablation and the replace policy, under
    the best node of the deepest kept level). graft: the kept nodes and the retrieved ones, merged,
    one tree of N nodes per request."""
    n, k = m.N - 1, m.cfg.top_k
    scores = d.scores
    if m.policy == "stop":           # stage s per request: the first checkpoint below its threshold
        below = torch.cat([m.conf.double() < m.taus, torch.ones_like(m.conf[:, :1], dtype=torch.bool)], 1)
        s = below[:, :m.taus.numel() + 1].int().argmax(1)                          # (B,)
        K = m.keep[s]
        slot = torch.arange(scores.shape[1], device=scores.device)
        scores = torch.where(slot[None] < m.drafted[s][:, None], scores, float("-inf"))   # levels not drafted
    else:
        K = m.keep[0].expand(root.shape[0])
    d_tok, d_par, sel, rank = select(scores, d.tokens, d.parents, n)
    score = scores.gather(1, sel)
    if m.policy == "replace":        # a node whose path confidence, or an ancestor's, is below tau
        low = score < m.log_tau[sel]
        anc, _ = tree_mask(d_par, torch.ones_like(low), m.cfg.depth)
        kept = ~(anc & low[:, None, :]).any(-1) & (rank < K[:, None])
    else:
        kept = rank < K[:, None]
    r_tok = r_score = anchor = free = None
    if m.tpl is not None:
        if m.anchor == "deepest":    # the best node of the deepest kept level (-1: none kept, the root)
            lv = torch.where(kept, level_of(sel, k), 0)
            key = torch.where(kept & (lv == lv.max(1, keepdim=True).values), score, float("-inf"))
            anchor = torch.where(kept.any(1), key.argmax(1), -1)
        else:
            anchor = torch.full_like(root, -1)
        under = torch.where(anchor >= 0, d_tok.gather(1, anchor.clamp(min=0)[:, None])[:, 0], root)
        r_tok, r_score = retrieval(m, under)
        free = n - kept.sum(1)
    return with_root(root, *graft_trees(d_tok, d_par, kept, r_tok, m.rtpl, anchor, free, r_score), active > 0, grow)


def learn(m: Method, tree: Tree, v, active: torch.Tensor):
    """Step 6: each request's matrix learns every verified node's top-k (update); the head's next
    extend reads each accepted path: the features of the root and the accepted nodes, and the token
    after each (the last one the bonus); a DFlash drafter's next block reads the same features. On a CPU
    with graft's kernels, one C++ call (cpu_kernels.tree_learn: the same writes)."""
    if FUSED and use_kernels(v.logits) and not torch.compiler.is_compiling():
        mx, pend, ctx = m.matrix is not None, m.pending, m.ctx is not None
        return cpu_kernels.tree_learn(v.logits, tree.tokens, tree.valid, v.path, v.A, v.bonus, active,
                                      v.feats if pend else None, m.M if mx else None, m.written if mx else None,
                                      m.ctx, m.clen if ctx else None, m.pend_feats if pend else None,
                                      m.pend_ids if pend and m.needs_head else None, m.pend_n if pend else None)
    if m.matrix is not None:
        update(m.M, m.written, tree.tokens, v.logits, tree.valid, v.path, v.A)
    nxt = torch.cat([tree.tokens.gather(1, v.path[:, 1:]), v.bonus[:, None]], 1)            # (B, P)
    nxt = torch.where(torch.arange(m.P, device=nxt.device)[None] == v.A[:, None], v.bonus[:, None], nxt)
    if m.ctx is not None:                # the context grows by the accepted tokens and the bonus
        context_append(m.ctx, m.clen, nxt, (v.A + 1) * active)
    if m.pending:
        m.pend_feats[:, :m.P].copy_(v.feats)
        m.pend_n.copy_((v.A + 1) * active)
    if m.needs_head:
        m.pend_ids[:, :m.P].copy_(nxt)


def plain_learn(m: Method, tree: Tree, v, active: torch.Tensor):
    """A plain round's step 6 (Method.plain_round): each request's matrix learns its root's top-k, its
    context grows by the new token, and a drafter's pending rows by the root's features and the token
    after it (its next extend reads them all: m.room rounds fit). What update, context_append and
    learn's writes do for one node a request, as one indexed write each: a plain round is most rounds
    where trees do not pay, and one node has no repeated token to order (update's sort). On a CPU with
    graft's kernels, one C++ call (cpu_kernels.plain_learn: the same writes; a dozen small ops cost ~0.2 ms)."""
    if FUSED and use_kernels(v.logits) and not torch.compiler.is_compiling():
        mx, pend = m.matrix is not None, m.pending
        return cpu_kernels.plain_learn(v.logits[:, 0], tree.tokens[:, 0], tree.valid[:, 0], v.bonus, active,
                                       v.feats[:, 0] if pend else None, m.M if mx else None, m.written if mx else None,
                                       m.ctx, m.clen if m.ctx is not None else None, m.pend_feats if pend else None,
                                       m.pend_ids if pend and m.needs_head else None, m.pend_n if pend else None)
    bi = torch.arange(active.shape[0], device=active.device)                            # (B,)
    nxt = v.bonus                                                                        # (B,)
    if m.matrix is not None:             # an empty slot (valid False) writes the spare row V
        V, k = m.M.shape[1] - 1, m.M.shape[2]
        tok = torch.where(tree.valid[:, 0], tree.tokens[:, 0], V)                        # (B,)
        m.M[bi, tok] = top_ids(v.logits[:, 0], k)
        m.written[bi, tok] = True
    if m.ctx is not None:                # (a slot not active writes the spare last column)
        S = m.ctx.shape[1]
        m.ctx[bi, torch.where(active > 0, m.clen, S - 1).clamp(max=S - 1)] = nxt
        m.clen.add_(active)
    if m.pending:
        m.pend_feats[bi, m.pend_n] = v.feats[:, 0]
        if m.needs_head:
            m.pend_ids[bi, m.pend_n] = nxt
        m.pend_n.add_(active)


class Prune(Eagle3Tree):
    calibrated = "prune"
    settings = dict(prune=True, retrieve=False, ablation=None)


class Graft(Eagle3Tree):
    needs_matrix = True
    calibrated = "graft"
    settings = dict(prune=True, retrieve=True, ablation=None)


class GraftFixed(Graft):
    settings = dict(prune=False, retrieve=True, ablation="fixed")


class GraftNaiveRoot(Graft):
    settings = dict(prune=False, retrieve=True, ablation="root")


class GraftNaiveTail(Graft):
    settings = dict(prune=False, retrieve=True, ablation="tail")


class BlockDraft(Method):
    """dflash: a DFlash drafter's block, verified as a chain (docs/graft.md section 11): the root and
    the block's block - 1 guesses, one draft forward a round. The drafter reads the accepted path's
    features (pend_feats, the first pend_n real) before its next block."""
    needs_block = True
    cut = False               # graft-tail: the confident prefix kept, the tail retrieved

    def __init__(self, eng, cfg, cal=None, matrix=None):
        super().__init__(eng, replace(cfg, block=eng.block.block), cal, matrix)
        B, dev, n = eng.B, eng.device, self.N - 1
        F = len(eng.model.capture_layers) * eng.model.args.dim
        self.pend_feats = torch.zeros(B, self.P + self.room, F, dtype=eng.dtype, device=dev)
        self.pend_n = torch.zeros(B, dtype=torch.long, device=dev)
        self.caught = RowCounts(B, dev)
        self.chain = (torch.arange(n, device=dev) - 1).expand(B, n).contiguous()     # parents: a chain
        tau = self.cfg.tail_threshold if self.cfg.tail_threshold is not None else self.cal.tail_threshold
        self.tau = torch.tensor(float(tau or 0.0) if self.cut else 0.0, device=dev)
        self.tpl = build_template(self.cal.hit_rates, n).to(dev) if self.cut else None

    @classmethod
    def shape(cls, cfg):
        return cfg.block, cfg.block

    def tensors(self):
        return super().tensors() + [self.pend_feats, self.pend_n, self.caught.dev, self.chain, self.tau] + (
            self.tpl.tensors() if self.tpl is not None else [])

    def prompt_chunk(self, eng, b, ids, logits, feats, n):
        super().prompt_chunk(eng, b, ids, logits, feats, n)
        eng.block_prefill(b, feats, n)           # the prompt's features are the drafter's context

    def prefilled(self, eng, b):
        self.pend_n[b] = 0                       # the context holds the whole prompt: nothing pending
        eng.slots[b].pend = 0                    # (its host mirror too: Engine.seat counts a head's root row)

    def finish(self, eng, b):
        super().finish(eng, b)
        self.pend_n[b] = 0

    def can_catch_up(self, eng) -> bool:
        return not eng.compiling          # (a compiled draft reads every pending row, a static shape)

    def catch_up(self, eng, which):
        """The drafter writes each chosen slot's pending rows into its context now (BlockDrafter.context):
        the rows its next block would have written first, so it drafts the same block."""
        n = [s.pend if w and s.request is not None else 0 for w, s in zip(which, eng.slots)]
        w = max(n)
        if w <= 0:
            return
        nt = self.caught.send(n)
        eng.steps.block_context(self.pend_feats[:, :w], nt)
        for b, c in enumerate(n):
            eng.slots[b].pend -= c
        self.pend_n.sub_(nt)

    def round(self, eng, record=False, full=False) -> Round:
        st, d = eng.steps, eng.block
        st.block_draft(self.pend_feats[:, :eng.pending_rows(self)], self.pend_n, eng.root, eng.cols(d.block))   # one forward
        eng.clock.mark("draft")
        tree = st.block_tree(self, eng.root, eng.active, eng.grow)
        eng.clock.mark("assemble")
        v = st.verify(tree, eng.L, eng.active, eng.cols(self.N), eng.smp, eng.mode, self.P, True, eng.root)
        eng.clock.mark("verify")
        rec = self.recorded(tree, d) if record else None               # before the matrix learns
        st.learn(self, tree, v, eng.active)
        eng.clock.mark("update")
        return Round(tree, v, [None] * eng.B, 1, 1, rec)

    def recorded(self, tree, d) -> dict:
        """What the cut's calibration reads of a round (calibrate.calibrate_tail): each position's
        confidence and, for every cut K, the retrieval the template would hang under the K-th guess
        (K = 0: the round's root, the tree's first token; not eng.root, which verify has already
        overwritten with the next round's), taken before the matrix learns this round."""
        under = torch.cat([tree.tokens[:, :1], d.tokens[:, :-1]], 1)                   # (B, n)
        got = [retrieve(self.M, under[:, K], self.tpl) for K in range(under.shape[1])] if self.tpl is not None else []
        return {"conf": d.conf.clone(), "retrieved": torch.stack(got, 1) if got else None}


class GraftTail(BlockDraft):
    """graft-tail, the paper's Graft-TAIL: the block's confident prefix (every guess up to the first
    whose drafter probability is below tau) is kept, and the slots of the tail go to a retrieval
    subtree from the continuation matrix under the last kept guess (the root when none is kept):
    one tree of the block's size, verified like any other."""
    needs_matrix = True
    cut = True


def block_tree(d, m: BlockDraft, root: torch.Tensor, active: torch.Tensor, grow: torch.Tensor | None = None) -> Tree:
    """The block methods' step: every request's block as a chain under its root (dflash), or its
    confident prefix and a retrieval subtree under the last kept guess (graft-tail), n = block - 1
    candidates either way. d: the BlockDrafter (tokens, conf (B, n))."""
    tok = d.tokens
    B, n = tok.shape
    if m.tpl is None:
        yes = torch.ones_like(tok, dtype=torch.bool)
        return with_root(root, tok, m.chain, yes, ~yes, active > 0, grow)
    low = d.conf < m.tau                                                               # (B, n)
    K = torch.where(low.any(1), low.int().argmax(1), n)                               # the confident prefix
    kept = torch.arange(n, device=tok.device)[None] < K[:, None]
    anchor = K - 1                                                                     # -1: the root
    under = torch.where(anchor >= 0, tok.gather(1, anchor.clamp(min=0)[:, None])[:, 0], root)
    r_tok = retrieve(m.M, under, m.tpl)
    return with_root(root, *graft_trees(tok, m.chain, kept, r_tok, m.tpl, anchor, n - K), active > 0, grow)


# name -> method; every method runs at every batch size, and nothing looks at a name after setup
METHODS = {"ar": Plain, "eagle3": Eagle3Tree, "prune": Prune, "graft": Graft, "recycle": Recycle, "pld": PromptLookup,
           "dflash": BlockDraft, "graft-tail": GraftTail, "graft-fixed": GraftFixed, "graft-naive-root": GraftNaiveRoot,
           "graft-naive-tail": GraftNaiveTail}
