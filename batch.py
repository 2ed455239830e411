"""Batches: B requests share one target pass per round, each lossless on its own (GRAFT.md, the batch
section: the paper's SGLang runs at batch sizes 1 to 16).

A serving engine captures one CUDA graph per batch size, so a round's shapes may not depend on what
each request's draft looked like: every request keeps a fixed number of verification slots, N. The
batch variant of Graft (`BatchRound`, method "graft") therefore drafts the dense EAGLE-3 tree to full
depth for every request (no per-request early stop), keeps the budget's best N-1 nodes, and replaces
the nodes whose path confidence (exp of the cumulative draft log-probability) falls below the
calibrated threshold of the deepest checkpoint their depth has passed by retrieval from that
request's continuation matrix, hung under the best remaining node (the best node of the deepest kept
level), or under the root when no draft node survives. The other methods run batched for comparison:
eagle3 (the dense tree), recycle (a static retrieval tree per request), pld (host lookup per request,
chains padded to a fixed length) and ar (one token per request).

What is per request, on the device, with a leading batch dimension B:
  the target's KV cache (B, H_kv, rows, D) and committed lengths L (B,), the head's cache and its
  committed rows Ld (B,), the draft tree's buffers, the head's pending input (the accepted path's
  features), one continuation matrix M (B, V+1, k) that starts from the warm-up's matrix (the prior)
  and then learns that request's conversation, and the sampling seed (B,): each request's noise is
  keyed by its own (seed, absolute position, token), so its tokens do not depend on its neighbours.
Slots: B fixed slots. A finished request (EOS, max_new_tokens) frees its slot; the next waiting
prompt is prefilled into it between rounds (in chunks, through the single-request engine's prefill
step, its rows then copied into that batch row), so a stream of prompts keeps the batch full. An
empty slot still runs through the static-shaped steps: its tree is all padding (zeros written, never
accepted, L stays 0), so it influences no other row.
Host syncs: one per round for the whole batch (`commit_each`). Compiled: one graph per (step, B), each
step with a code object of its own (Engine.compile, the CUDA-graph contract in engine.py).
"""
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import torch

from engine import Engine, Proposer, lookup, method_config, prefill
from graft import MAX_TEMPLATE_DEPTH, PRIOR_HIT_RATES, Config, build_template
from model import GraftError, KVCache
from verify import Sampling, position_noise, rows_finite, warp

BATCH_METHODS = ("ar", "eagle3", "graft", "recycle", "pld")


# ----------------------------------------------------------------------------- batched pieces of a round

def batch_mask(tree: torch.Tensor, L: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """model.attention_mask per request: tree (B, N, W), L (B,) -> (B, N, n_keys) bool."""
    B, N, W = tree.shape
    rel = cols[None, None, :] - L[:, None, None]                       # (B, 1, n_keys)
    inside = (rel >= 0) & (rel < W)
    seen = tree.gather(2, rel.clamp(0, W - 1).expand(B, N, -1))
    return (rel < 0) | (inside & seen)


def tree_masks(parents: torch.Tensor, valid: torch.Tensor, max_depth: int) -> tuple:
    """verify.tree_mask per request: parents, valid (B, N) -> ancestor masks (B, N, N), depths (B, N)."""
    B, N = parents.shape
    idx = torch.arange(N, device=parents.device)
    up = torch.where((parents < 0) | ~valid, idx[None], parents.clamp(min=0))
    rel = ((idx[None, :, None] == idx[None, None, :]) | (up[:, :, None] == idx[None, None, :])).float()
    for _ in range(max(max_depth, 1).bit_length()):
        rel = torch.bmm(rel, rel).clamp_(max=1.0)
    mask = rel > 0
    return mask, mask.sum(-1) - 1


def accept_each(tokens, parents, valid, mask, depth, target, P: int) -> tuple:
    """verify.accept per request (B, N): A (B,), bonus (B,), path (B, P)."""
    B, N = tokens.shape
    idx = torch.arange(N, device=tokens.device)
    ok = (idx == 0)[None] | (valid & (tokens == target.gather(1, parents.clamp(min=0))))
    good = ~(mask & ~ok[:, None, :]).any(-1)
    best = torch.argmax(torch.where(good, depth, -1), dim=1)                  # deepest; first on ties
    on_path = mask.gather(1, best[:, None, None].expand(B, 1, N))[:, 0]
    order = torch.sort(torch.where(on_path, depth, N), dim=1, stable=True).indices[:, :P]
    return depth.gather(1, best[:, None])[:, 0], target.gather(1, best[:, None])[:, 0], order


def choose_each(logits: torch.Tensor, positions: torch.Tensor, s: Sampling, seeds: torch.Tensor) -> torch.Tensor:
    """verify.choose per request: logits (B, N, V), positions (B, N), seeds (B,) -> (B, N). Row b's
    noise is position_noise(seeds[b], ...): the same draw the request gets when it runs alone."""
    B, N, V = logits.shape
    if s.greedy:
        return logits.argmax(-1)
    flat = warp(logits.reshape(B * N, V), s).double()
    noise = position_noise(seeds[:, None].expand(B, N).reshape(-1), positions.reshape(-1), V)
    return (flat + noise).argmax(-1).view(B, N)


def verify_each(model, cache: KVCache, tokens, parents, valid, L, active, cols, s: Sampling, seeds, P: int,
                capture: bool, root) -> dict:
    """verify.verify for B trees of N nodes in one target pass: request b's nodes go at its rows
    L[b]..L[b]+N-1 with positions L[b] + depth; acceptance, compaction and the bonus per request; L
    advances by A + 1 where the slot is active (an empty slot's tree is all padding). The bonus tokens
    land in `root` (B,). No host sync."""
    B, N = tokens.shape
    mask, depth = tree_masks(parents, valid, P - 1)
    attend = batch_mask(mask, L, cols) & (valid[:, :, None] | (cols[None, None, :] >= L[:, None, None]))
    ar = torch.arange(N, device=L.device)
    out = model(tokens, L[:, None] + depth, L[:, None] + ar, attend[:, None], capture, cache, keep=valid)
    logits, feats = out if capture else (out, None)
    target = choose_each(logits, L[:, None] + depth + 1, s, seeds)
    A, bonus, path = accept_each(tokens, parents, valid, mask, depth, target, P)
    cache.move_rows_each(L[:, None] + path, L[:, None] + torch.arange(P, device=L.device))
    L.add_((A + 1) * active)
    root.copy_(bonus)
    finite = rows_finite(logits, valid)                                       # (B,) real nodes only
    got = dict(A=A, bonus=bonus, path=path, logits=logits, finite=finite)
    if capture:
        got["feats"] = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))
    return got


def decode_each(model, cache: KVCache, root, L, active, cols, s: Sampling, seeds) -> dict:
    """verify.decode_one_token per request: each root (B,) at its row L[b], the next token into `root`;
    L advances where the slot is active (an empty slot writes zeros at its row 0). Shaped like
    verify_each's result (A = 0, the path is the root) so a round reads both alike."""
    B = root.numel()
    one = torch.ones(B, 1, 1, dtype=torch.bool, device=L.device)
    keep = active[:, None] > 0
    logits = model(root[:, None], L[:, None], L[:, None], batch_mask(one, L, cols)[:, None], False, cache, keep=keep)
    nxt = choose_each(logits, L[:, None] + 1, s, seeds)[:, 0]
    L.add_(active)
    root.copy_(nxt)
    zero = torch.zeros(B, 1, dtype=torch.long, device=L.device)
    return dict(A=zero[:, 0], bonus=nxt, path=zero, finite=rows_finite(logits) | ~keep[:, 0])


def retrieve_each(M: torch.Tensor, under: torch.Tensor, tpl) -> torch.Tensor:
    """ContinuationMatrix.retrieve per request: M (B, V+1, k), under (B,) -> the template's tokens (B, n)."""
    B, n = under.numel(), tpl.size
    buf = torch.empty(B, n + 1, dtype=torch.long, device=M.device)
    buf[:, n] = under
    bi = torch.arange(B, device=M.device)[:, None]
    for idx, par, rank in tpl.levels:
        buf[:, idx] = M[bi, buf[:, par], rank[None]].long()
    return buf[:, :n]


def graft_each(d_tok, d_par, kept, r_tok, tpl, anchor) -> tuple:
    """graft.graft_trees per request, with a number of free slots that differs by request: the kept
    draft nodes (B, n) (compacted, in order), then the retrieval subtree under `anchor` (B,) (a kept
    node's index, or -1 = the root) in the slots the replaced ones left, n in all. A retrieved node that
    repeats a kept sibling's token is merged into it. Returns tokens, parents, valid, retrieved (B, n)."""
    B, n = d_tok.shape
    dev = d_tok.device
    hid = torch.zeros(B, n, dtype=torch.long, device=dev)
    merged = torch.zeros(B, n, dtype=torch.bool, device=dev)
    for idx, par, _ in tpl.levels:
        ph = torch.where(par[None] < 0, anchor[:, None], hid[:, par.clamp(min=0)])
        same = kept[:, None, :] & (d_par[:, None, :] == ph[:, :, None]) & (d_tok[:, None, :] == r_tok[:, idx][:, :, None])
        hit = same.any(-1)
        merged[:, idx] = hit
        hid[:, idx] = torch.where(hit, same.int().argmax(-1), n + idx[None])
    K = kept.sum(1, keepdim=True)
    new = ~merged
    take = new & (new.cumsum(1) <= n - K)
    kpos = kept.cumsum(1) - 1                                             # a kept node's index in the result
    slot = K + take.cumsum(1) - 1
    ph = torch.where(tpl.parents[None] < 0, anchor[:, None], hid[:, tpl.parents.clamp(min=0)])
    as_draft = torch.where(ph >= 0, kpos.gather(1, ph.clamp(0, n - 1)), -1)
    r_par = torch.where(ph >= n, slot.gather(1, (ph - n).clamp(0, n - 1)), as_draft)
    d_parc = torch.where(d_par >= 0, kpos.gather(1, d_par.clamp(min=0)), -1)
    d_dst, r_dst = torch.where(kept, kpos, n), torch.where(take, slot, n)   # dropped ones write a spare slot
    out = []
    for d_val, r_val, fill in ((d_tok, r_tok, 0), (d_parc, r_par, -1), (kept, take, False), (kept & False, take, False)):
        t = torch.full((B, n + 1), fill, dtype=d_val.dtype, device=dev)
        out.append(t.scatter(1, d_dst, d_val).scatter(1, r_dst, r_val)[:, :n])
    return tuple(out)


def select_each(scores, tokens, parents, n: int) -> tuple:
    """draft.select per request: the best n candidates (B, n) as trees, parents first."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
    sel = torch.sort(order, dim=1).values
    par = parents.gather(1, sel)
    pos = torch.searchsorted(sel, par.clamp(min=0))
    return tokens.gather(1, sel), torch.where(par < 0, -1, pos), sel


def with_root_each(root, tokens, parents, valid, retrieved, active) -> tuple:
    """Prepend the roots (B,) to root-less trees (B, n); an empty slot's tree is all padding."""
    one = lambda x: x[:, None]
    return (torch.cat([one(root), tokens], 1), torch.cat([torch.full_like(one(root), -1), torch.where(parents < 0, 0, parents + 1)], 1),
            torch.cat([one(active), valid & one(active)], 1), torch.cat([torch.zeros_like(one(active)), retrieved], 1))


def matrix_update_each(M, written, tokens, logits, valid, path, A, k: int):
    """ContinuationMatrix.update per request: row b of M (B, V+1, k) learns request b's nodes."""
    B, N = tokens.shape
    V = M.shape[1] - 1
    dev = tokens.device
    on_path = torch.zeros(B, N, dtype=torch.long, device=dev).scatter(
        1, path, (torch.arange(path.shape[1], device=dev)[None] <= A[:, None]).long())
    prio = torch.arange(N, device=dev)[None] + N * on_path
    tok = torch.where(valid, tokens, V)
    order = torch.argsort(tok * (2 * N) + prio, dim=1)
    t_sorted = tok.gather(1, order)
    last = torch.cat([t_sorted[:, 1:] != t_sorted[:, :-1], torch.ones_like(t_sorted[:, :1], dtype=torch.bool)], 1)
    rows = torch.where(last, t_sorted, V)
    top = logits.topk(k, dim=-1).indices.int().gather(1, order[:, :, None].expand(-1, -1, k))
    bi = torch.arange(B, device=dev)[:, None]
    M[bi, rows] = top
    written[bi, rows] = True


# ----------------------------------------------------------------------------- the batched head

class BatchDrafter:
    """draft.Drafter with a batch dimension: the head's cache (B, ...) and every round buffer per
    request; `extend` and `level` draft all B trees at once (the dense tree, to full depth)."""

    def __init__(self, d, B: int):
        self.head, self.k, self.D = d.head, d.top_k, d.depth
        k, D, dev = self.k, self.D, d.head.fc.weight.device
        c, H, dt = d.head.config.layer, d.head.config.layer.dim, d.head.fc.weight.dtype
        self.C = d.C
        self.cache = KVCache(1, B, c.n_kv_heads, d.head.cache.rows, c.head_dim, dt, dev)
        z = lambda *s, dtype=torch.long: torch.zeros(*s, dtype=dtype, device=dev)
        self.Ld = z(B)
        self.scores, self.tokens, self.parents = z(B, self.C, dtype=torch.float32), z(B, self.C), z(B, self.C)
        self.beam_s, self.beam_tok, self.beam_h = z(B, k, dtype=torch.float32), z(B, k), z(B, k, H, dtype=dt)
        self.beam_at, self.seen = z(B, k), z(B, k, max((D - 1) * k, 1), dtype=torch.bool)

    def buffers(self) -> list:
        return [self.Ld, self.scores, self.tokens, self.parents, self.beam_s, self.beam_tok, self.beam_h,
                self.beam_at, self.seen] + self.cache.tensors()

    def extend(self, feats, ids, n, cols):
        """Drafter.extend per request: feats (B, P, F), ids (B, P), n (B,) real rows (0: an empty slot)."""
        head, k = self.head, self.k
        B, P = ids.shape
        dev = ids.device
        rows = self.Ld[:, None] + torch.arange(P, device=dev)
        tri = torch.ones(P, P, dtype=torch.bool, device=dev).tril_().expand(B, P, P)
        mask = batch_mask(tri, self.Ld, cols)[:, None]
        keep = torch.arange(P, device=dev)[None] < n[:, None]
        out = head(feats, ids, rows, rows, mask, fused=True, cache=self.cache, keep=keep)       # (B, P, H)
        h_root = out.gather(1, (n - 1).clamp(min=0)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]
        self.Ld.add_(n)
        s, t = head.logprobs(h_root).topk(k, dim=-1)                                           # (B, k)
        tok = head.to_target(t)
        self.scores.fill_(float("-inf"))
        self.scores[:, :k] = s
        self.tokens[:, :k] = tok
        self.parents[:, :k] = -1
        self.beam_s.copy_(s)
        self.beam_tok.copy_(tok)
        self.beam_h.copy_(h_root[:, None].expand(-1, k, -1))
        self.beam_at.copy_(torch.arange(k, device=dev).expand(B, k))
        self.seen.zero_()

    def level(self, i, cols):
        """Drafter.level per request: level i+2 of every tree from its beam."""
        head, k = self.head, self.k
        B, _, W = self.seen.shape
        dev = i.device
        ar, cw = torch.arange(k, device=dev), torch.arange(W, device=dev)
        seen = self.seen | ((cw // k == i)[None, :] & (cw % k == ar[:, None]))[None]
        rows = self.Ld[:, None] + i * k + ar[None]
        mask = batch_mask(seen, self.Ld, cols)[:, None]
        out = head(self.beam_h, self.beam_tok, (self.Ld + i)[:, None].expand(B, k), rows, mask, fused=False,
                   cache=self.cache)                                                           # (B, k, H)
        ps, pt = head.logprobs(out).topk(k, dim=-1)                                            # (B, k, k)
        cu = (self.beam_s[:, :, None] + ps).reshape(B, k * k)
        tok = head.to_target(pt).reshape(B, k * k)
        at = k + i * k * k + torch.arange(k * k, device=dev)
        self.scores.index_copy_(1, at, cu)
        self.tokens.index_copy_(1, at, tok)
        self.parents.index_copy_(1, at, self.beam_at.repeat_interleave(k, dim=1))
        best, sel = cu.topk(k, dim=1)
        self.beam_s.copy_(best)
        self.beam_tok.copy_(tok.gather(1, sel))
        self.beam_h.copy_(out.gather(1, (sel // k)[:, :, None].expand(-1, -1, out.shape[-1])))
        self.beam_at.copy_(at[sel])
        self.seen.copy_(seen.gather(1, (sel // k)[:, :, None].expand(-1, -1, W)))


# ----------------------------------------------------------------------------- requests and results

@dataclass
class Request:
    """One prompt's generation inside a batch (its statistics count the tokens it returned)."""
    index: int
    ids: list
    seed: int
    tokens: list = field(default_factory=list)
    rounds: int = 0
    committed: int = 0
    accepted: int = 0
    from_retrieval: int = 0
    draft_forwards: int = 0
    admitted_s: float = 0.0            # seconds after the run's start: prefill began
    first_s: float = 0.0               # first token
    finished_s: float = 0.0            # last token: the request's latency (every prompt arrives at the start)

    @property
    def mat(self) -> float:
        return self.committed / max(self.rounds, 1)


@dataclass
class BatchResult:
    requests: list                     # Request per prompt, in input order
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
                "rounds": self.rounds, "draft_forwards_per_round": round(self.draft_forwards / max(self.rounds, 1), 4),
                "prefill_s": round(self.prefill_seconds, 4)}


class _SlotPrefill(Proposer):
    """The single engine's prefill, for one slot: seeds that slot's matrix from the prompt's logits
    and fills the head's committed rows (graft.Graft.prompt_chunk's pairing of feature t with token t+1)."""

    def __init__(self, be: "BatchEngine", b: int):
        self.be, self.b, self.last = be, b, None
        self.needs_features = be.needs_head

    def prompt_chunk(self, ids, logits, feats, n: int):
        be, C = self.be, ids.numel()
        if be.uses_matrix:
            matrix_update_each(be.M[self.b:self.b + 1], be.written[self.b:self.b + 1], ids[None], logits[None],
                               (torch.arange(C, device=ids.device) < n)[None],
                               torch.zeros(1, 1, dtype=torch.long, device=ids.device),
                               torch.full((1,), -1, dtype=torch.long, device=ids.device), be.matrix_k)
        if be.needs_head:
            if self.last is None:
                F, I, real = feats, torch.cat([ids[1:], ids[:1] * 0]), n - 1
            else:
                F, I, real = torch.cat([self.last, feats[:-1]]), ids, n
            self.last = feats[n - 1:n].clone()
            be.eng.head_prefill(F, I, real)


# ----------------------------------------------------------------------------- the batched engine

class BatchEngine:
    """B slots running one method (BATCH_METHODS) over the single engine's model, head and warm-up.
    run(prompts, ...) decodes a stream of prompts, B at a time, and returns each in input order.
    anchor (graft): where the retrieval subtree hangs, "best" (the best node of the deepest kept level,
    the default) or "root" (as the single-request graft round hangs it)."""

    def __init__(self, eng: Engine, method: str, B: int, cfg: Config | None = None, anchor: str = "best"):
        if method not in BATCH_METHODS:
            raise GraftError(f"--batch runs the methods {', '.join(BATCH_METHODS)}, not {method!r}")
        if B < 1:
            raise GraftError(f"--batch sizes must be >= 1, got {B}")
        if method in ("eagle3", "graft") and eng.drafter is None:
            raise GraftError(f"--method {method} needs an EAGLE-3 head: pass --draft DIR_OR_HUB_ID")
        cfg = cfg or Config()
        self.eng, self.method, self.B, self.cfg, self.anchor = eng, method, B, cfg, anchor
        self.needs_head = method in ("eagle3", "graft")
        self.uses_matrix = method in ("graft", "recycle")
        m, dev = eng.model, eng.device
        d = eng.drafter
        if method == "ar":
            self.N = self.P = 1
        elif method == "pld":
            self.N = self.P = cfg.pld_tokens + 1
        elif method == "recycle":
            self.tpl = build_template(eng.hit_rates or PRIOR_HIT_RATES, cfg.recycle_size)
            self.N, self.P = cfg.recycle_size + 1, 1 + len(self.tpl.levels)
        else:
            self.N = 1 + min(cfg.budget, d.C)
            self.tpl = build_template(eng.hit_rates or PRIOR_HIT_RATES, self.N - 1, MAX_TEMPLATE_DEPTH)
            T = len(self.tpl.levels) if method == "graft" else 0
            self.P = min(self.N, 1 + d.depth + T)
        eng.reserve(self.N, self.P)
        if self.needs_head and d.P < self.P:
            raise GraftError("the head's path buffer is shorter than the batch round's")   # (reserve grows it)
        a = m.args
        self.cache = KVCache(a.n_layers, B, a.n_kv_heads, m.cache.rows, a.head_dim, eng.dtype, dev)
        z = lambda *s, dtype=torch.long: torch.zeros(*s, dtype=dtype, device=dev)
        self.L, self.root, self.seeds, self.active = z(B), z(B), z(B), z(B)
        self.state = [self.L, self.root, self.seeds, self.active, *self.cache.tensors()]
        self.matrix_k = eng.matrix.k
        if self.uses_matrix:       # one matrix per request; the warm-up's matrix is each one's start
            self.prior_M, self.prior_written = eng.matrix.M.clone(), eng.matrix.written.clone()
            self.M = self.prior_M[None].repeat(B, 1, 1)
            self.written = self.prior_written[None].repeat(B, 1)
            self.state += [self.M, self.written]
        if hasattr(self, "tpl"):
            self.tpl = self.tpl.to(dev)
            self.state += self.tpl.tensors()
        name = lambda s: f"batch{B}_{s}"
        if method == "ar":
            self._decode = eng.compile(partial(decode_each, m, self.cache), name("decode"))
        else:
            self._verify = eng.compile(partial(verify_each, m, self.cache), name("verify"))
        if self.needs_head:
            self.bd = BatchDrafter(d, B)
            F = len(m.capture_layers) * a.dim
            self.pend_feats, self.pend_ids, self.pend_n = z(B, self.P, F, dtype=eng.dtype), z(B, self.P), z(B)
            self.level_index = [torch.full((), i, dtype=torch.long, device=dev) for i in range(d.depth)]
            self.state += self.bd.buffers() + [self.pend_feats, self.pend_ids, self.pend_n, *self.level_index]
            self._extend = eng.compile(self.bd.extend, name("extend"))
            self._level = eng.compile(self.bd.level, name("level"))
            self._learn = eng.compile(self.learn_step, name(f"{method}_learn"))
            thr = cfg.thresholds
            if thr is None:        # Youden's: which calibration, see the note above slot_thresholds
                thr = method_config(eng, "graft", cfg, auto_budget=False, calibration="youden").thresholds
            thr = thr if thr is not None else (eng.thresholds or {})
            self.thresholds = {c: float(thr.get(c, 0.0)) for c in cfg.checkpoints} if method == "graft" else {}
            self.log_tau = self.slot_thresholds(d.top_k, d.depth).to(dev)
            self.state.append(self.log_tau)
        if self.uses_matrix and not self.needs_head:
            self._learn = eng.compile(self.matrix_learn_step, name("recycle_learn"))
        if method in ("eagle3", "graft", "recycle"):
            self._assemble = eng.compile(self.assemble_step, name(f"{method}_assemble"))
        if method == "pld":
            self.host = torch.zeros(2, B, self.N, dtype=torch.long, pin_memory=eng.cuda)
            self.chains = z(2, B, self.N)
            self.chain_parents = (torch.arange(self.N, device=dev) - 1).expand(B, -1).contiguous()
            self.state += [self.chains, self.chain_parents]
        eng.static(*self.state)
        self.L_host, self.Ld_host = [0] * B, [0] * B

    def close(self):
        """Forget this engine's static tensors (the single engine keeps a list of them): a benchmark
        that builds one BatchEngine per (method, B) would otherwise keep every batch's caches alive."""
        mine = {id(t) for t in self.state}
        self.eng.statics[:] = [t for t in self.eng.statics if id(t) not in mine]

    # Which calibration the batch variant reads (calibrate.py computes both): Youden's J, the paper's.
    # The throughput calibration prices the drafting a pruned round saves, and a batch round saves none
    # (it always drafts to full depth), so on a CPU it can say "prune at checkpoint 0 always" (tau 1.0),
    # which here would replace every draft node. --thresholds overrides both.

    def slot_thresholds(self, k: int, D: int) -> torch.Tensor:
        """log tau per candidate slot of the dense tree: the threshold of the deepest checkpoint the
        slot's depth has passed (checkpoint c tests the best path at level c+1); -inf = never replaced."""
        C = k + (D - 1) * k * k
        level = [1 if s < k else (s - k) // (k * k) + 2 for s in range(C)]
        out = []
        for lv in level:
            passed = [c for c in sorted(self.thresholds) if c <= lv - 1]
            tau = self.thresholds[passed[-1]] if passed else 0.0
            out.append(math.log(tau) if tau > 0 else float("-inf"))
        return torch.tensor(out, dtype=torch.float32)

    # -- the steps (each compiled once per B)
    def assemble_step(self, root, active):
        """The round's trees (B, N): eagle3 the best N-1 draft nodes; graft those, with the nodes
        below their checkpoint's threshold replaced by retrieval; recycle the retrieval tree."""
        n = self.N - 1
        if self.method == "recycle":
            toks = retrieve_each(self.M, root, self.tpl)
            yes = torch.ones_like(toks, dtype=torch.bool)
            return with_root_each(root, toks, self.tpl.parents[None].expand_as(toks), yes, yes, active > 0)
        bd = self.bd
        d_tok, d_par, sel = select_each(bd.scores, bd.tokens, bd.parents, n)
        if self.method == "eagle3":
            yes = torch.ones_like(d_tok, dtype=torch.bool)
            return with_root_each(root, d_tok, d_par, yes, ~yes, active > 0)
        score = bd.scores.gather(1, sel)
        low = score < self.log_tau[sel]                                         # path confidence below tau
        anc, _ = tree_masks(d_par, torch.ones_like(low), bd.D)
        kept = ~(anc & low[:, None, :]).any(-1)                                 # it and its ancestors pass
        level = torch.where(sel < bd.k, 1, (sel - bd.k) // (bd.k * bd.k) + 2)
        lk = torch.where(kept, level, 0)
        key = torch.where(kept & (lk == lk.max(1, keepdim=True).values), score, float("-inf"))
        anchor = torch.where(kept.any(1), key.argmax(1), -1)                    # the best remaining node
        if self.anchor == "root":
            anchor = torch.full_like(anchor, -1)
        under = torch.where(anchor >= 0, d_tok.gather(1, anchor.clamp(min=0)[:, None])[:, 0], root)
        r_tok = retrieve_each(self.M, under, self.tpl)
        return with_root_each(root, *graft_each(d_tok, d_par, kept, r_tok, self.tpl, anchor), active > 0)

    def learn_step(self, tokens, valid, got, active):
        """The head's next input is each request's accepted path; graft's matrices learn every node."""
        if self.uses_matrix:
            matrix_update_each(self.M, self.written, tokens, got["logits"], valid, got["path"], got["A"], self.matrix_k)
        A, bonus, path = got["A"], got["bonus"], got["path"]
        nxt = torch.cat([tokens.gather(1, path[:, 1:]), bonus[:, None]], 1)
        self.pend_ids.copy_(torch.where(torch.arange(self.P, device=A.device)[None] == A[:, None], bonus[:, None], nxt))
        self.pend_feats.copy_(got["feats"])
        self.pend_n.copy_((A + 1) * active)

    def matrix_learn_step(self, tokens, valid, got, active):
        matrix_update_each(self.M, self.written, tokens, got["logits"], valid, got["path"], got["A"], self.matrix_k)

    def cols(self, n: int, head: bool = False):
        return self.eng.cols(n, head)

    # -- slots
    def admit(self, b: int, r: Request, sampling: Sampling):
        """Prefill request r into slot b (the single engine's chunked prefill, then its rows copied)."""
        e = self.eng
        e.begin(sampling)
        e.seed.fill_(r.seed)
        if self.uses_matrix:
            self.M[b].copy_(self.prior_M)
            self.written[b].copy_(self.prior_written)
        if self.needs_head:
            e.drafter.reset()
        pre = _SlotPrefill(self, b)
        first = prefill(e, pre, r.ids)
        n = len(r.ids)
        for big, small in zip(self.cache.tensors(), e.model.cache.tensors()):
            big[b, :, :n].copy_(small[0, :, :n])
        if self.needs_head:
            nd = e.drafter.Ld_host
            for big, small in zip(self.bd.cache.tensors(), e.drafter.head.cache.tensors()):
                big[b, :, :nd].copy_(small[0, :, :nd])
            self.bd.Ld[b].fill_(nd)
            self.Ld_host[b] = nd
            self.pend_feats[b].zero_()
            self.pend_feats[b, 0].copy_(pre.last[0])
            self.pend_ids[b].zero_()
            self.pend_ids[b, 0].fill_(first)
            self.pend_n[b].fill_(1)
        self.L[b].fill_(n)
        self.L_host[b] = n
        self.root[b].fill_(first)
        self.seeds[b].fill_(r.seed)
        self.active[b].fill_(1)
        r.tokens = [first]

    def free(self, b: int):
        self.active[b].fill_(0)
        self.L[b].fill_(0)
        self.L_host[b] = 0
        if self.needs_head:
            self.bd.Ld[b].fill_(0)
            self.pend_n[b].fill_(0)
            self.Ld_host[b] = 0

    # -- one round for every slot
    def round(self, sampling: Sampling) -> tuple:
        """Propose B trees, verify them in one pass, learn; the one host transfer. Returns per slot
        (accepted tokens, bonus, retrieved flags of the accepted) and the round's draft forwards."""
        B, P = self.B, self.P
        forwards = 0
        if self.needs_head:
            d = self.bd
            self._extend(self.pend_feats, self.pend_ids, self.pend_n, self.cols(max(self.Ld_host) + P, head=True))
            self.Ld_host = [x + (len_ if a else 0) for x, len_, a in zip(self.Ld_host, self._pend_host, self._active_host)]
            forwards = d.D
            for i in range(d.D - 1):
                self._level(self.level_index[i], self.cols(max(self.Ld_host) + (d.D - 1) * d.k, head=True))
        retrieved = None
        if self.method == "ar":
            tokens = self.root[:, None].clone()           # (the step overwrites root: the path's token is this)
            got = self._decode(self.root, self.L, self.active, self.cols(max(self.L_host) + 1), sampling, self.seeds)
        else:
            if self.method == "pld":
                tokens, parents, valid = self.pld_trees()
            else:
                tokens, parents, valid, retrieved = self._assemble(self.root, self.active)
            got = self._verify(tokens, parents, valid, self.L, self.active, self.cols(max(self.L_host) + self.N),
                               sampling, self.seeds, P, self.needs_head, self.root)
        if self.needs_head or self.uses_matrix:
            self._learn(tokens, valid, got, self.active)
        parts = [got["A"], got["bonus"], got["finite"].long(), tokens.gather(1, got["path"]).flatten()]
        if retrieved is not None:
            parts.append(retrieved.gather(1, got["path"]).long().flatten())
        h = torch.cat(parts).tolist()                                       # the round's one host sync
        A, bonus, finite = h[:B], h[B:2 * B], h[2 * B:3 * B]
        path = [h[3 * B + b * P:3 * B + (b + 1) * P] for b in range(B)]
        ret = [h[3 * B + B * P + b * P:3 * B + B * P + (b + 1) * P] for b in range(B)] if retrieved is not None else None
        out = []
        for b in range(B):
            if not self._active_host[b]:
                out.append(None)
                continue
            if not finite[b]:
                raise GraftError("the target's logits are not finite (NaN or inf) in this pass: the model overflows "
                                 "in this dtype or its weights are broken")
            out.append((path[b][1:1 + A[b]], bonus[b], ret[b][1:1 + A[b]] if ret else [0] * A[b]))
            self.L_host[b] += A[b] + 1
            if self.needs_head:
                self._pend_host[b] = A[b] + 1
        return out, forwards

    def pld_trees(self) -> tuple:
        """Prompt lookup per request on the host (engine.PromptLookup.lookup), chains padded to N."""
        self.host.zero_()
        for b, r in enumerate(self._slots):
            if r is None:
                continue
            ids = [r.ctx[-1]] + lookup(r.ctx, self.cfg.pld_ngram, self.cfg.pld_tokens)
            self.host[0, b, :len(ids)] = torch.tensor(ids)
            self.host[1, b, :len(ids)] = 1
        self.chains.copy_(self.host, non_blocking=True)
        return self.chains[0], self.chain_parents, self.chains[1] > 0

    # -- a stream of prompts
    @torch.no_grad()
    def run(self, prompts: list, max_new_tokens: int, sampling: Sampling, eos_ids=(), seeds=None) -> BatchResult:
        """Decode every prompt (token ids), B at a time: a finished request's slot takes the next
        waiting prompt. seeds: one per prompt (default: sampling.seed for all). Results in input order."""
        e, B = self.eng, self.B
        for ids in prompts:
            if not ids:
                raise GraftError("empty prompt")
            if len(ids) + max_new_tokens > e.model.max_seq_len:
                raise GraftError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({max_new_tokens}) exceeds "
                                 f"--max-seq-len ({e.model.max_seq_len})")
        seeds = list(seeds) if seeds is not None else [sampling.seed] * len(prompts)
        reqs = [Request(i, list(ids), seeds[i]) for i, ids in enumerate(prompts)]
        queue, eos = deque(reqs), set(eos_ids)
        self._slots, self._active_host, self._pend_host = [None] * B, [0] * B, [1] * B
        for b in range(B):
            self.free(b)
        if not e.window:
            for t in self.cache.tensors() + (self.bd.cache.tensors() if self.needs_head else []):
                t.zero_()
        rounds = forwards = 0
        prefill_s = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        while queue or any(self._slots):
            for b in range(B):                       # refill free slots between rounds
                while self._slots[b] is None and queue:
                    r = queue.popleft()
                    r.admitted_s = time.perf_counter() - t0
                    self.admit(b, r, sampling)
                    r.first_s = time.perf_counter() - t0
                    prefill_s += r.first_s - r.admitted_s
                    r.ctx = list(r.ids) + r.tokens
                    self._slots[b], self._active_host[b], self._pend_host[b] = r, 1, 1
                    if r.tokens[-1] in eos or len(r.tokens) >= max_new_tokens:
                        self._finish(b, r, t0)
            if not any(self._slots):
                continue
            e.mark_step()
            got, f = self.round(sampling)
            rounds += 1
            forwards += f
            for b, g in enumerate(got):
                r = self._slots[b]
                if g is None or r is None:
                    continue
                acc, bonus, ret = g
                new = acc + [bonus]
                cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
                new = new[:min(cut, max_new_tokens - len(r.tokens))]
                kept = min(len(new), len(acc))
                r.rounds += 1
                r.committed += len(new)
                r.accepted += kept
                r.from_retrieval += sum(ret[:kept])
                r.draft_forwards += f
                r.tokens += new
                r.ctx += acc + [bonus]
                if r.tokens[-1] in eos or len(r.tokens) >= max_new_tokens:
                    self._finish(b, r, t0)
        return BatchResult(reqs, time.perf_counter() - t0, rounds, forwards, prefill_s, time.process_time() - c0)

    def _finish(self, b: int, r: Request, t0: float):
        r.finished_s = time.perf_counter() - t0
        del r.ctx
        self._slots[b], self._active_host[b] = None, 0
        self.free(b)


@torch.no_grad()
def batch_pass_cost(eng: Engine, sizes: list, nodes: int, context: int = 128, repeats: int = 10,
                    timer=time.perf_counter) -> dict:
    """Milliseconds of one target pass over B trees of `nodes` nodes against B one-token steps (a
    batched ar round), after `context` committed tokens per request, for each B in sizes: where
    batching (and speculation inside a batch) stops paying. Measured as engine.pass_cost is:
    interleaved sizes, each timed call after an untimed one, the fastest sample; timer: a clock in
    seconds (time.process_time on a shared CPU). Returns {B: {1: ms, nodes: ms}}."""
    from engine import cost_tree, robust_costs, sync, time_passes
    m = eng.model
    context = max(1, min(context, m.max_seq_len - nodes - 1))
    g = torch.Generator().manual_seed(0)
    out = {}
    eng.reserve(nodes, min(nodes, 10))
    for B in sizes:
        be, tree_be = BatchEngine(eng, "ar", B), BatchEngine(eng, "pld", B, Config(pld_tokens=max(nodes - 1, 1)))
        trees = {}
        for n in sorted({1, nodes}):
            tree, P = cost_tree(torch.randint(0, m.args.vocab_size, (n,), generator=g).to(eng.device))
            trees[n] = ([t[None].expand(B, -1).contiguous() for t in (tree.tokens, tree.parents, tree.valid)], P)

        be.active.fill_(1)
        tree_be.active.fill_(1)

        def one(n):                # B one-token steps (batched ar's), or B trees through the verifier
            (tokens, parents, valid), P = trees[n]
            eng.mark_step()
            if n == 1:
                be.L.fill_(context)
                be._decode(be.root, be.L, be.active, eng.cols(context + 1), Sampling(), be.seeds)
            else:
                tree_be.L.fill_(context)
                tree_be._verify(tokens, parents, valid, tree_be.L, tree_be.active, eng.cols(context + n), Sampling(),
                                tree_be.seeds, P, False, tree_be.root)

        fastest, _ = robust_costs(time_passes(one, sorted(trees), repeats, timer, sync=lambda: sync(eng.device)))
        out[B] = {n: round(s * 1000, 3) for n, s in fastest.items()}
        be.close()
        tree_be.close()
    return out
