"""Graft: the continuation matrix, retrieval templates, hybrid trees, and the round.

Follows ../shared/GRAFT.md sections 2-6; names are the paper's. The pieces:
  ContinuationMatrix   M [V, k]: the target's recent top-k next tokens after each token (section 3)
  build_template       a static tree of ranks grown best-first from per-rank hit rates (section 4)
  graft_trees          kept draft nodes + retrieval subtree -> one tree of a fixed size (section 2.4)
  graft_round          one decoding round, start to end: draft with checkpoints, keep, retrieve,
                       graft, verify, update
  Graft                the proposer that runs it; eagle3, prune and the ablations are configurations
  Recycle              Token Recycling: a static retrieval tree, no draft head (a baseline)
The thresholds the round prunes with are calibrated in calibrate.py (section 6). Every tensor step has a static shape, so each can be compiled (one graph per pruning stage).
"""
import heapq
from dataclasses import dataclass
from functools import partial

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
        self.recorder = None             # warm-up: called once a round, after verification (calibrate.Recorder)
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

    One call per step; each tensor step is static-shaped and compiled when the engine compiles.
    Host syncs: one per checkpoint reached (the pruning decision) and one at the end (commit)."""
    e = g.eng
    # 1. draft with checkpoints: the head reads the accepted path and drafts level by level; at each
    #    checkpoint c a best-path probability below tau_c stops it (the round is pruned at stage c)
    stage, conf, forwards = draft_with_checkpoints(g)
    e.clock.mark("draft")
    # 2-4. keep the K best draft nodes, retrieve R nodes from the continuation matrix under the root,
    #    graft them into one hybrid tree of N nodes (Graft.assemble_stage, one graph per stage)
    tree = g.last_tree = g.assemble[stage](root)
    e.clock.mark("assemble")
    # 5. verify: one target pass over the tree, exact acceptance, KV compaction (the one verifier)
    v = e.verify(tree, g.P, capture=True)
    e.clock.mark("verify")
    if g.recorder is not None:          # warm-up only: what the calibration reads, before the matrix learns
        g.recorder(g, conf, tree, v)
    # 6. update: the matrix learns every verified node's top-k, the head's next input is the accepted
    #    path; then the round's one transfer to the host
    g.learn(tree, v)
    commit(v, tree)
    e.clock.mark("update")
    g.pend_n_host = len(v.accepted) + 1
    v.stage, v.draft_forwards, v.syncs = stage, forwards, 1 + len([c for c in conf if c in g.thresholds])
    return v


def draft_with_checkpoints(g: Graft) -> tuple:
    """Step 1 of the round. The head's `extend` reads the accepted path (pend_*) and drafts level 1
    (the root's top_k children); each `level` drafts one more. After the forward that produced level
    c+1, checkpoint c compares the best path's probability conf_c with tau_c (a host sync); below it,
    drafting stops. Returns (stage: the checkpoint that pruned, or None; {c: conf_c (0-d)} for the
    checkpoints reached, plus every configured one while a recorder listens; draft forwards)."""
    e, d, cfg = g.eng, g.d, g.cfg
    k, D = d.top_k, cfg.depth
    watch = set(g.thresholds) | (set(cfg.checkpoints) if g.recorder is not None else set())
    conf = g.extend(g.pend_feats, g.pend_ids, g.pend_n, e.cols(d.Ld_host + g.P, head=True))
    d.Ld_host += g.pend_n_host
    seen, forwards = {}, 1
    for c in range(D):                                   # level c+1 exists now
        if c in watch:
            seen[c] = conf.clone()                       # (read after later levels replay their step)
            if c in g.thresholds and float(conf) < g.thresholds[c]:
                return c, seen, forwards
        if c == D - 1:
            break
        conf = g.level(g.level_index[c], e.cols(d.Ld_host + (D - 1) * k, head=True))        # draft level c+2
        forwards += 1
    return None, seen, forwards


# ----------------------------------------------------------------------------- Token Recycling


class Recycle(Proposer):
    """Token Recycling: a static retrieval tree from the continuation matrix, no draft head."""
    source = "matrix"                   # --show-tree: every node retrieved

    def __init__(self, eng, cfg: Config, matrix: ContinuationMatrix, hit_rates=None):
        self.eng, self.matrix = eng, matrix
        tpl = build_template(hit_rates or PRIOR_HIT_RATES, cfg.recycle_size)       # on the host, then moved
        self.N, self.P = cfg.recycle_size + 1, 1 + len(tpl.levels)
        self.tpl = tpl.to(eng.device)
        eng.reserve(self.N, self.P)
        self.propose, self.learn = eng.compile(self.propose_step, "recycle_propose"), eng.compile(self.learn_step, "recycle_learn")
        self.seed_matrix = eng.compile(matrix.update, "matrix_update")
        eng.static(*self.tpl.tensors())
        self.recorder = None             # warm-up: called once a round, after verification (calibrate.Recorder)

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
        if self.recorder is not None:       # warm-up only: before the matrix learns
            self.recorder(self, {}, tree, v)
        self.learn(tree, v)
        commit(v, tree)
        e.clock.mark("update")
        return v
