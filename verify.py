"""Tree verification: one target pass over a token tree, then exact (lossless) acceptance.

A tree has a static shape, root first and parents before children (`Tree`), one row per request:
    tokens  (B, N) long   tokens[:, 0] is the root r (the last committed token, its KV not yet cached)
    parents (B, N) long   parents[:, 0] = -1; parents[:, i] < i
    valid   (B, N) bool   False marks padding: a short tree (prune, pld, a merged graft tree) is padded
                        to the method's N with dummy nodes that attend to nothing and are never accepted
Where a node came from (draft head, continuation matrix, prompt lookup) is not the verifier's business.

Acceptance picks the longest root path whose every token equals the target's own choice at its
parent: the argmax (greedy) or a draw with noise keyed by (seed, absolute position) (sampling). The
target's choice at the last accepted node is the bonus token, the next round's root. Plain decoding is
the same thing with an empty tree (`decode`), so every method emits exactly the target's own tokens.
Every function takes a batch: B requests, each with its own tree, committed length and sampling
(a single request is a batch of one). Everything here is static-shaped and free of host syncs;
`commit` is the one transfer of a round (the accepted lengths and tokens).
"""
import time
from dataclasses import dataclass

import torch

import cpu_kernels
from model import attention_mask, use_kernels

# On a CPU with graft's kernels, tree_mask and accept run as one C++ call each (cpu_kernels: the same result);
# False keeps the torch versions (GPUs and compiled steps run them; the tests run both).
FUSED = True


# ----------------------------------------------------------------------------- sampling

# Below this temperature, sampling is greedy decoding: dividing the logits by it would overflow
# float32 (1e-45 gives inf - inf = NaN), and the draw it approximates is the argmax anyway (vLLM's
# _SAMPLING_EPS is the same value).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Sampling:
    """One request's sampling parameters (a host value; the engine keeps one row per request on the device)."""
    temperature: float = 0.0     # < MIN_TEMPERATURE = greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 = off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def sampling_mode(samplings) -> tuple:
    """What a batch's token choice must compute, from its requests' Sampling: (any sampled, any
    top-k, any top-p). A compiled step is specialised on it (at most a few graphs); the values
    themselves are data (SlotSampling), so a new request compiles nothing."""
    drawn = [s for s in samplings if not s.greedy]
    return (bool(drawn), any(0 < s.top_k for s in drawn), any(s.top_p < 1.0 for s in drawn))


class SlotSampling:
    """Every request's sampling parameters on the device, (B,) each, filled when a request is admitted."""

    def __init__(self, batch: int, device):
        self.temperature = torch.ones(batch, device=device)       # greedy rows hold 1 (never divides)
        self.top_p = torch.ones(batch, device=device)
        self.top_k = torch.zeros(batch, dtype=torch.long, device=device)
        self.seed = torch.zeros(batch, dtype=torch.long, device=device)
        self.greedy = torch.ones(batch, dtype=torch.bool, device=device)

    def set(self, b: int, s: Sampling):
        self.temperature[b] = 1.0 if s.greedy else s.temperature
        self.top_p[b], self.top_k[b], self.seed[b], self.greedy[b] = s.top_p, s.top_k, s.seed, s.greedy

    def tensors(self) -> list:
        return [self.temperature, self.top_p, self.top_k, self.seed, self.greedy]

    def rows(self, slots: torch.Tensor) -> "SlotSampling":
        """The parameters of the requests `slots` (B',) alone (a prefill's one request)."""
        out = SlotSampling.__new__(SlotSampling)
        for name, t in zip(("temperature", "top_p", "top_k", "seed", "greedy"), self.tensors()):
            setattr(out, name, t.index_select(0, slots))
        return out


_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply) in int64 arithmetic; constants < 2^31 so nothing overflows."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


_TOKEN_HASH = {}


def token_hash(vocab: int, device) -> torch.Tensor:
    """Per-token-id hash (V,): depends on nothing else, so it is computed once per (V, device)
    (call it once before compiling: a compiled step only reads it)."""
    key = (vocab, str(torch.device(device)))
    if key not in _TOKEN_HASH:
        ids = torch.arange(vocab, device=device, dtype=torch.int64)
        _TOKEN_HASH[key] = _hash32(ids * 0x165667B1 + 0x3C6EF372)
    return _TOKEN_HASH[key]


def position_noise(seed: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise (..., V) that depends only on (seed, absolute position, token id).

    A counter-based generator: the draw for position p is the same whether p is decoded alone or as
    one node of a tree, in a batch or not, on any device. That is what makes speculative sampling
    reproduce plain sampling token for token (docs/graft.md section 5). seed: int64, broadcastable to
    positions ((B, 1) against (B, N)); data, so a new seed compiles nothing. Every seed in [0, 2^63)
    keys its own stream: the high 32 bits, when not zero, rehash each position's key."""
    base = _hash32(seed * 0x2545F491 + 0x1234567)
    h_pos = _hash32(base ^ (positions.long() * 0x27D4EB2D & _M32))                 # (..., N)
    hi = seed >> 32
    h_pos = torch.where(hi == 0, h_pos, _hash32(h_pos ^ _hash32(hi * 0x2F1E9B7 + 0x5A5A5A5)))
    h = _hash32(h_pos[..., None] ^ token_hash(vocab, positions.device))            # (..., N, V)
    u = ((h >> 8).double() + 0.5) / float(1 << 24)                                 # (0, 1), 24 bits
    return -torch.log(-torch.log(u))


def warp(logits: torch.Tensor, temperature, top_k, top_p, mode: tuple) -> torch.Tensor:
    """Temperature, then top-k, then top-p (HF order), per request; removed tokens get -inf.
    logits (B, N, V); temperature, top_p (B,) float, top_k (B,) long (0 = off); mode: sampling_mode.
    Returns float32 (B, N, V)."""
    B, N, V = logits.shape
    x = logits.float() / temperature[:, None, None]
    if mode[1]:
        k = torch.where(top_k > 0, top_k.clamp(max=V), V)                      # (B,)
        kth = torch.sort(x, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None, None].expand(B, N, 1))
        x = x.masked_fill(x < kth, float("-inf"))
    if mode[2]:
        sorted_x, idx = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= (1 - top_p)[:, None, None]
        drop_sorted[..., -1] = False  # always keep the most likely token
        x = x.masked_fill(drop_sorted.scatter(-1, idx, drop_sorted), float("-inf"))
    return x


def choose(logits: torch.Tensor, positions: torch.Tensor, smp: SlotSampling, mode: tuple,
           real: torch.Tensor | None = None) -> torch.Tensor:
    """The target's token after each row: argmax, or a Gumbel-max draw keyed by (the request's seed,
    the position it fills). logits (B, N, V); positions (B, N) absolute positions *of the tokens being
    chosen*; real (B, N) bool: the rows whose choice is read (None: all; an eager CPU draws no other:
    a padding row's is 0). Returns (B, N) long."""
    kernels = use_kernels(logits) and not torch.compiler.is_compiling()
    if kernels:
        best = cpu_kernels.topk_rows(logits, 1)[1][..., 0]      # one pass a row (the first max, as argmax)
    else:     # a CPU's argmax over bfloat16/float16 is ~5x slower than widening first (exact: the same first max)
        best = (logits.float() if logits.device.type == "cpu" else logits).argmax(-1)
    if not mode[0]:
        return best
    if kernels:                          # the same draw, without (B, N, V) temporaries
        cut = mode[1] or mode[2]             # (temperature alone: the kernel divides, no warped copy)
        drawn = cpu_kernels.gumbel_argmax(warp(logits, smp.temperature, smp.top_k, smp.top_p, mode) if cut else logits,
                                          smp.seed, positions.long(), token_hash(logits.shape[-1], logits.device),
                                          None if cut else smp.temperature, real)
    else:
        x = warp(logits, smp.temperature, smp.top_k, smp.top_p, mode)              # (B, N, V) float32
        drawn = (x.double() + position_noise(smp.seed[:, None], positions, logits.shape[-1])).argmax(-1)
    return torch.where(smp.greedy[:, None], best, drawn)


# ----------------------------------------------------------------------------- trees

@dataclass
class Tree:
    """A proposal per request: N nodes each, root first (see the module docstring), (B, N) each.
    `retrieved` gives each node's retrieval source (graft.SOURCES: 1 the continuation matrix, 2 a context
    match; 0 or False: not retrieved), statistics only: the verifier never reads it."""
    tokens: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor
    retrieved: torch.Tensor | None = None


def tree_mask(parents: torch.Tensor, valid: torch.Tensor, max_depth: int) -> tuple:
    """Ancestor masks (B, N, N) bool (row i sees i and its ancestors) and depths (B, N) (root 0).
    parents, valid (B, N).

    Start from "self or parent" and square the relation: after j squarings it reaches ancestors up to
    2^j generations away. The number of squarings depends on max_depth (the deepest node a tree may
    have), never on N itself, so N can be a dynamic dimension of a compiled step (one graph for every
    tree size). A padding node (valid False) is its own root: it sees only itself and has depth 0.
    On a CPU with graft's kernels, one C++ call that walks each node's parents (cpu_kernels.tree_mask)."""
    if FUSED and use_kernels(parents) and not torch.compiler.is_compiling():
        return cpu_kernels.tree_mask(parents, valid, max_depth)
    N = parents.shape[1]
    idx = torch.arange(N, device=parents.device)
    up = torch.where((parents < 0) | ~valid, idx, parents.clamp(min=0))          # a root is its own parent
    rel = ((idx[:, None] == idx[None, :]) | (up[:, :, None] == idx[None, None, :])).float()   # (B, N, N)
    for _ in range(max(max_depth, 1).bit_length()):
        rel = torch.bmm(rel, rel).clamp_(max=1.0)
    mask = rel > 0
    return mask, mask.sum(-1) - 1


def accept(tokens, parents, valid, mask, depth, target, P: int) -> tuple:
    """Every request's longest accepted path. tokens, parents, valid, depth, target (B, N) (target:
    the target's choice after each node), mask (B, N, N); P: the longest path a tree can hold (its
    depth + 1), a static size.

    A node is acceptable when it is real, its token is what the target chose at its parent, and the
    same holds for all its ancestors. Returns (A (B,): accepted tokens, bonus (B,): the target's
    choice after the last one, path (B, P): the root and the accepted nodes first, in order, then
    other nodes as filler). Indexing stays on the device (no host sync). On a CPU with graft's kernels,
    one C++ call (cpu_kernels.accept)."""
    if FUSED and use_kernels(tokens) and not torch.compiler.is_compiling():
        return cpu_kernels.accept(tokens, parents, valid, mask, depth, target, P)
    B, N = tokens.shape
    idx = torch.arange(N, device=tokens.device)
    ok = (idx == 0)[None] | (valid & (tokens == target.gather(1, parents.clamp(min=0))))
    good = ~(mask & ~ok[:, None, :]).any(-1)                                   # every node on the way is ok
    best = torch.argmax(torch.where(good, depth, -1), dim=1)                   # deepest; first on ties
    on_path = mask.gather(1, best[:, None, None].expand(B, 1, N))[:, 0]        # ancestors of best (and best)
    order = torch.sort(torch.where(on_path, depth, N), dim=1, stable=True).indices[:, :P]
    return depth.gather(1, best[:, None])[:, 0], target.gather(1, best[:, None])[:, 0], order


# ----------------------------------------------------------------------------- verification

@dataclass
class Verified:
    """What one verification returns for every request, on the device (commit() brings the little
    the host needs)."""
    A: torch.Tensor             # (B,) accepted tokens (root excluded)
    bonus: torch.Tensor         # (B,) the target's token after the last accepted node: the next root
    path: torch.Tensor          # (B, P) node indices: the root and the A accepted nodes first
    logits: torch.Tensor        # (B, N, V) logits at every node (the continuation matrix reads them)
    target: torch.Tensor        # (B, N) the target's choice at every node
    feats: torch.Tensor | None  # (B, P, 3*dim) EAGLE-3 features of the path nodes
    finite: torch.Tensor        # (B,) every logit of the request's real nodes was finite


def rows_finite(logits: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) bool: every logit of every real row of a request (valid (B, N) True; default all) is
    finite. logits (B, N, V).
    Checked through each row's sum: a NaN or an inf anywhere makes its row's sum non-finite, and one
    reduction costs ~1/80 of isfinite over every element (measured on a CPU: 0.9 against 73 ms for a 128
    x 49152 prefill chunk). A finite row could only overflow the sum with logits near 1e34. The sum
    accumulates in float32 in any dtype; its result stays in the logits' dtype where that has float32's
    range (bfloat16: a float32 copy of 4 x 64 x 49152 prefill logits cost 25 ms on a CPU, the sum 1 ms)."""
    ok = torch.isfinite(logits.sum(-1) if logits.dtype in (torch.bfloat16, torch.float32) else
                        logits.sum(-1, dtype=torch.float32))                       # (B, N)
    return (ok if valid is None else ok | ~valid).all(-1)


def verify(model, cache, tree: Tree, L: torch.Tensor, active: torch.Tensor, cols: torch.Tensor, smp: SlotSampling,
           mode: tuple, P: int, capture: bool, root: torch.Tensor) -> Verified:
    """Verify every request's tree in one target pass and commit its accepted path in the cache.

    Request b's nodes are written at its rows L[b]..L[b]+N-1 with positions L[b] + depth; a node
    attends to the committed prefix and its own ancestors (attention_mask; cols: the rows attention
    reads). Afterwards the path's rows are moved to L[b]..L[b]+P-1 (compaction), so rows 0..L[b]+A[b]
    hold exactly what decoding the accepted tokens one by one would have left. L (B,) advances by
    A + 1 where the slot is active (B,) (an empty slot's tree is all padding). No node is deeper than
    P - 1. root (B,): receives the bonus tokens (the next round's roots) inside the step, so that they
    outlive the step's outputs (a CUDA graph's outputs are overwritten by its next replay). One
    target pass, no host sync. (Called under no_grad: the decoding loop is.)"""
    N = tree.tokens.shape[1]
    mask, depth = tree_mask(tree.parents, tree.valid, P - 1)
    attend = attention_mask(mask, L, cols) & (tree.valid[:, :, None] | (cols[None, None, :] >= L[:, None, None]))
    ar = torch.arange(N, device=L.device)
    out = model(tree.tokens, L[:, None] + depth, L[:, None] + ar, attend, capture, cache, keep=tree.valid)
    logits, feats = out if capture else (out, None)
    target = choose(logits, L[:, None] + depth + 1, smp, mode, tree.valid)             # (B, N)
    A, bonus, path = accept(tree.tokens, tree.parents, tree.valid, mask, depth, target, P)
    cache.move_rows(L[:, None] + path, L[:, None] + torch.arange(P, device=L.device))
    L.add_((A + 1) * active)
    root.copy_(bonus)
    finite = rows_finite(logits, tree.valid)                              # real nodes only: padding is junk
    path_feats = None if feats is None else feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))
    return Verified(A, bonus, path, logits, target, path_feats, finite)


def decode(model, cache, root: torch.Tensor, L: torch.Tensor, active: torch.Tensor, cols: torch.Tensor,
           smp: SlotSampling, mode: tuple, capture: bool = False) -> Verified:
    """Plain decoding's step for every request: its root at row L[b], then the target's next token,
    written into root (B,). L advances where the slot is active (an empty slot stays at row 0).
    Shaped like verify's result (A = 0, the path is the root), so a round reads both alike; capture:
    the root's EAGLE-3 features too (a drafting method's plain round: its drafter catches up later)."""
    B = root.shape[0]
    keep = active[:, None] > 0                                                # (B, 1)
    one = torch.ones(1, 1, dtype=torch.bool, device=L.device)
    # no padding rows here: an empty slot writes its junk token at its own row 0, which no other request
    # reads and its next prefill overwrites, so the rows need no zeroing (it saves a select per layer)
    out = model(root[:, None], L[:, None], L[:, None], attention_mask(one, L, cols), capture, cache)
    logits, feats = out if capture else (out, None)
    nxt = choose(logits, L[:, None] + 1, smp, mode)                           # (B, 1)
    L.add_(active)
    root.copy_(nxt[:, 0])
    zero = torch.zeros(B, 1, dtype=torch.long, device=L.device)
    return Verified(zero[:, 0], nxt[:, 0], zero, logits, nxt, feats, rows_finite(logits) | ~keep[:, 0])


NOT_FINITE = ("the target's logits are not finite (NaN or inf) in this pass: the model overflows in this dtype "
              "or its weights are broken")


def commit(v: Verified, tree: Tree, more: torch.Tensor | None = None):
    """The one host sync of a round: for every request, the accepted length, the bonus, whether its
    logits were finite, the real candidates its tree held, and the path's tokens and sources, in one
    transfer. Returns per request (accepted tokens, bonus, retrieval sources of the accepted (0: none),
    real candidate nodes verified, whether its real nodes' logits were finite: the engine refuses to
    go on when an active request's were not, since a NaN would make the argmax pick token 0 again and
    again). more: float64 values (path_logprobs) brought in the same transfer; then (that list, them
    as a list of floats)."""
    B, P = v.path.shape
    parts = [v.A, v.bonus, v.finite.long(), tree.valid.sum(1) - 1, tree.tokens.gather(1, v.path).flatten()]
    if tree.retrieved is not None:
        parts.append(tree.retrieved.gather(1, v.path).long().flatten())
    h = torch.cat(parts)
    if more is not None:        # one transfer still: the integers ride as float64, exact below 2^53
        n, h = h.numel(), torch.cat([h.double(), more.flatten()]).tolist()
        h, more = [int(x) for x in h[:n]], h[n:]
    else:
        h = h.tolist()
    out = []
    for b in range(B):
        A, bonus, finite, nodes = h[b], h[B + b], h[2 * B + b], h[3 * B + b]
        path = h[4 * B + b * P:4 * B + (b + 1) * P]
        ret = h[4 * B + B * P + b * P + 1:4 * B + B * P + b * P + 1 + A] if tree.retrieved is not None else [0] * A
        out.append((path[1:1 + A], bonus, ret, nodes, bool(finite)))
    return out if more is None else (out, more)


# ----------------------------------------------------------------------------- log-probabilities

def logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """What a request that asks for log-probabilities gets at R rows: logits (R, V), chosen (R,) the
    token emitted after each row. The target's distribution is the log-softmax of its raw logits in
    float32 (before temperature, top-k and top-p: what vLLM reports by default), so every method reports
    plain decoding's numbers. Returns (R, 1 + 2k) float64: the chosen token's log-probability, the k
    largest (descending), then their ids (exact in float64)."""
    lp = logits.float().log_softmax(-1)
    top = lp.topk(k, -1)
    return torch.cat([lp.gather(1, chosen[:, None]).double(), top.values.double(), top.indices.double()], 1)


def path_logprobs(v: Verified, slots: list, k: int) -> torch.Tensor:
    """logprobs() at every path row of the requests `slots` (a list of S slot indices): row j of a
    path chose the j-th token the round emitted (the accepted, then the bonus). Returns (S * P, 1 + 2k)."""
    idx = torch.tensor(slots, device=v.path.device)[:, None]
    path = v.path[idx[:, 0]]                                                      # (S, P)
    return logprobs(v.logits[idx, path].flatten(0, 1), v.target[idx, path].flatten(), k)


def unpack_logprobs(vals: list, k: int, keep: int) -> list:
    """Host rows of logprobs() (flat, 1 + 2k floats each) as [(log-probability, [(id, log-probability)
    of the `keep` <= k most likely, descending])]."""
    w = 1 + 2 * k
    return [(vals[i], [(int(t), x) for t, x in zip(vals[i + 1 + k:i + 1 + k + keep], vals[i + 1:i + 1 + keep])])
            for i in range(0, len(vals), w)]


class Clock:
    """Time per phase of a round, without host syncs: on a CPU each mark reads `timer` (the wall clock;
    the calibration sets time.process_time); on a GPU it records a CUDA event, and the events are read
    once, when the generation is over."""

    def __init__(self, device):
        self.cuda, self.timer = torch.device(device).type == "cuda", time.perf_counter
        self.reset()

    def reset(self):
        """Forget every phase; timing restarts at the next start() (no event is recorded here, so an
        engine on fake CUDA tensors can be built on a machine without CUDA)."""
        self.totals, self.events = {}, []
        self.last = self.timer()

    def start(self):
        if self.cuda:
            self.events.append((None, self._event()))
        else:
            self.last = self.timer()

    def mark(self, phase: str):
        """The time since the previous mark goes to `phase`."""
        if self.cuda:
            self.events.append((phase, self._event()))
        else:
            now = self.timer()
            self.totals[phase] = self.totals.get(phase, 0.0) + now - self.last
            self.last = now

    def read(self) -> dict:
        """Seconds per phase."""
        if self.cuda:
            torch.cuda.synchronize()
            for (_, a), (phase, b) in zip(self.events, self.events[1:]):
                if phase is not None:
                    self.totals[phase] = self.totals.get(phase, 0.0) + a.elapsed_time(b) / 1000
            self.events = self.events[-1:]
        return dict(self.totals)

    @staticmethod
    def _event():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
