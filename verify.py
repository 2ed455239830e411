"""Tree verification: one target pass over a token tree, then exact (lossless) acceptance.

A tree has a static shape, root first and parents before children (`Tree`):
    tokens  (N,) long   tokens[0] is the root r (the last committed token, its KV not yet cached)
    parents (N,) long   parents[0] = -1; parents[i] < i
    valid   (N,) bool   False marks padding: a short tree (prune, pld, a merged graft tree) is padded
                        to the method's N with dummy nodes that attend to nothing and are never accepted
Where a node came from (draft head, continuation matrix, prompt lookup) is not the verifier's business.

Acceptance picks the longest root path whose every token equals the target's own choice at its
parent: the argmax (greedy) or a draw with noise keyed by (seed, absolute position) (sampling). The
target's choice at the last accepted node is the bonus token, the next round's root. Plain decoding is
the same thing with an empty tree (`decode_one_token`), so every method emits exactly the target's
own tokens. Everything here is static-shaped and free of host syncs; `commit` is the one transfer of a
round (the accepted length and tokens).
"""
import time
from dataclasses import dataclass

import torch

from model import GraftError, attention_mask


# ----------------------------------------------------------------------------- sampling

# Below this temperature, sampling is greedy decoding: dividing the logits by it would overflow
# float32 (1e-45 gives inf - inf = NaN), and the draw it approximates is the argmax anyway (vLLM's
# _SAMPLING_EPS is the same value).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0     # < MIN_TEMPERATURE = greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 = off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def warp(self) -> tuple:
        """What shapes the distribution (not the seed): a compiled step is specialised on it."""
        return (self.temperature, self.top_p, self.top_k)


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
    """Gumbel noise (N, V) that depends only on (seed, absolute position, token id).

    A counter-based generator: the draw for position p is the same whether p is decoded alone or as
    one node of a tree, on any device. That is what makes speculative sampling reproduce plain sampling
    token for token (GRAFT.md section 5). seed: a 0-d int64 tensor (data, so a new seed compiles nothing)."""
    base = _hash32(seed * 0x2545F491 + 0x1234567)
    h_pos = _hash32(base ^ (positions.long() * 0x27D4EB2D & _M32))                 # (N,)
    h = _hash32(h_pos[:, None] ^ token_hash(vocab, positions.device)[None, :])     # (N, V)
    u = ((h >> 8).double() + 0.5) / float(1 << 24)                                 # (0, 1), 24 bits
    return -torch.log(-torch.log(u))


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p (HF order); removed tokens get -inf. (N, V) float32."""
    x = logits.float() / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - s.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        x = x.masked_fill(drop_sorted.scatter(-1, idx, drop_sorted), float("-inf"))
    return x


def choose(logits: torch.Tensor, positions: torch.Tensor, s: Sampling, seed: torch.Tensor | None = None):
    """The target's token after each row: argmax, or a Gumbel-max draw keyed by the position it fills.

    logits (N, V); positions (N,) absolute positions *of the tokens being chosen*; seed a 0-d int64
    tensor (default: s.seed). Returns (N,) long."""
    if s.greedy:
        return logits.argmax(-1)
    if seed is None:
        seed = torch.tensor(s.seed, dtype=torch.int64, device=logits.device)
    x = warp(logits, s).double() + position_noise(seed, positions, logits.shape[-1])
    return x.argmax(-1)


# ----------------------------------------------------------------------------- trees

@dataclass
class Tree:
    """A proposal: N nodes, root first (see the module docstring). `retrieved` (N,) bool marks nodes
    from the continuation matrix (statistics only; the verifier never reads it)."""
    tokens: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor
    retrieved: torch.Tensor | None = None


def chain(tokens: torch.Tensor, n: int | None = None) -> Tree:
    """A root followed by a chain of tokens (each node the child of the one before), padded to n."""
    k = tokens.numel()
    n = n or k
    dev = tokens.device
    idx = torch.arange(n, device=dev)
    toks = torch.zeros(n, dtype=torch.long, device=dev)
    toks[:k] = tokens
    return Tree(toks, idx - 1, idx < k)


def tree_mask(parents: torch.Tensor, valid: torch.Tensor | None = None, max_depth: int | None = None) -> tuple:
    """Ancestor mask (N, N) bool (row i sees i and its ancestors) and depth (N,) (root 0).

    Start from "self or parent" and square the relation: after j squarings it reaches ancestors up to
    2^j generations away. The number of squarings depends on max_depth (the deepest node a tree may
    have; default N - 1), never on N itself, so N can be a dynamic dimension of a compiled step (one
    graph for every tree size). A padding node (valid False) is its own root: it sees only itself
    and has depth 0."""
    N = parents.numel()
    max_depth = N - 1 if max_depth is None else max_depth
    idx = torch.arange(N, device=parents.device)
    alone = parents < 0 if valid is None else (parents < 0) | ~valid
    up = torch.where(alone, idx, parents.clamp(min=0))                # a root is its own parent
    rel = torch.zeros(N, N, device=parents.device)
    rel[idx, idx] = 1.0
    rel[idx, up] = 1.0
    for _ in range(max(max_depth, 1).bit_length()):
        rel = (rel @ rel).clamp_(max=1.0)
    mask = rel > 0
    return mask, mask.sum(-1) - 1


def accept(tokens, parents, valid, mask, depth, target, P: int) -> tuple:
    """Longest accepted path. target (N,): the target's choice after each node; P: the longest path
    the tree can hold (its depth + 1), a static size.

    A node is acceptable when it is real, its token is what the target chose at its parent, and the
    same holds for all its ancestors. Returns (A (0-d): accepted tokens, bonus (0-d): the target's
    choice after the last one, path (P,): the root and the accepted nodes first, in order, then other
    nodes as filler). Indexing stays on the device (a 0-d index would be a host sync)."""
    N = tokens.numel()
    idx = torch.arange(N, device=tokens.device)
    ok = (idx == 0) | (valid & (tokens == target.gather(0, parents.clamp(min=0))))
    good = ~(mask & ~ok[None, :]).any(-1)                # every node on the way is ok
    best = torch.argmax(torch.where(good, depth, -1)).view(1)   # deepest; first one on ties
    on_path = mask.index_select(0, best)[0]              # ancestors of best (and best)
    order = torch.sort(torch.where(on_path, depth, N), stable=True).indices
    return depth.gather(0, best)[0], target.gather(0, best)[0], order[:P]


# ----------------------------------------------------------------------------- verification

@dataclass
class Verified:
    """What one verification returns, on the device (commit() brings the little the host needs)."""
    A: torch.Tensor             # () accepted tokens (root excluded)
    bonus: torch.Tensor         # () the target's token after the last accepted node: the next root
    path: torch.Tensor          # (P,) node indices: the root and the A accepted nodes first
    logits: torch.Tensor        # (N, V) logits at every node (the continuation matrix reads them)
    target: torch.Tensor        # (N,) the target's choice at every node
    feats: torch.Tensor | None  # (P, 3*dim) EAGLE-3 features of the path nodes
    finite: torch.Tensor        # () every logit was finite
    accepted: list | None = None    # after commit(): the accepted tokens, the bonus as an int,
    bonus_id: int | None = None     # and which accepted tokens came from retrieval (0/1 each)
    from_retrieval: list | None = None
    nodes: int = 0                  # after commit(): real candidate nodes verified (root and padding excluded)
    stage: int | None = None        # the checkpoint that pruned the round, if any
    draft_forwards: int = 0
    syncs: int = 1                  # host syncs the round made (commit's, and one per checkpoint reached)


def rows_finite(logits: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """() bool, or (B,) for a batch: every logit of every real row (valid (N,) or (B, N) True; default
    all) is finite. logits (N, V) or (B, N, V).
    Checked through each row's float32 sum: a NaN or an inf anywhere makes its row's sum non-finite,
    and one reduction costs ~1/80 of isfinite over every element (measured on a CPU: 0.9 against 73 ms
    for a 128 x 49152 prefill chunk). A finite row could only overflow the sum with logits near 1e34."""
    ok = torch.isfinite(logits.sum(-1, dtype=torch.float32))                     # (..., N)
    return (ok if valid is None else ok | ~valid).all(-1)


def verify(model, tree: Tree, L: torch.Tensor, cols: torch.Tensor, sampling: Sampling, seed: torch.Tensor,
           P: int, capture: bool = False, cache=None, root: torch.Tensor | None = None) -> Verified:
    """Verify a tree whose root goes at cache row L (rows 0..L-1 are committed) and commit its
    accepted path in the cache; L (0-d, on the device) advances by A + 1.

    Nodes are written at rows L..L+N-1 with positions L + depth; a node attends to the committed
    prefix and its own ancestors (attention_mask; cols: the rows attention reads). Afterwards the
    path's rows are moved to L..L+P-1 (compaction), so rows 0..L+A hold exactly what decoding the
    accepted tokens one by one would have left. No node is deeper than P - 1 (P: the longest path the
    tree can hold). root: a 0-d buffer that receives the bonus token (the next round's root) inside
    the step, so that it outlives the step's outputs (a CUDA graph's outputs are overwritten by its
    next replay). One target pass, no host sync. (Called under no_grad: the decoding loop is; the
    steps are not decorated, so that each compiles as itself.)"""
    cache = cache if cache is not None else model.cache
    N = tree.tokens.numel()
    mask, depth = tree_mask(tree.parents, tree.valid, P - 1)
    attend = attention_mask(mask, L, cols) & (tree.valid[:, None] | (cols[None, :] >= L))   # padding: nothing
    out = model(tree.tokens[None], L + depth, L + torch.arange(N, device=L.device), attend, capture, cache,
                keep=tree.valid)
    logits, feats = (out[0][0], out[1][0]) if capture else (out[0], None)
    target = choose(logits, L + depth + 1, sampling, seed)                               # (N,)
    A, bonus, path = accept(tree.tokens, tree.parents, tree.valid, mask, depth, target, P)
    cache.move_rows(L + path, L + torch.arange(P, device=L.device))
    L.add_(A + 1)
    if root is not None:
        root.copy_(bonus)
    finite = rows_finite(logits, tree.valid)                              # real nodes only: padding is junk
    return Verified(A, bonus, path, logits, target, None if feats is None else feats.index_select(0, path), finite)


def decode_one_token(model, token: torch.Tensor, L: torch.Tensor, cols: torch.Tensor, sampling: Sampling,
                     seed: torch.Tensor, cache=None, root: torch.Tensor | None = None) -> tuple:
    """Plain decoding's step: the root (1,) at row L, then the target's next token (1,) and whether
    its logits were finite (()). L advances by one. root: a 0-d buffer that receives the next token
    inside the step (see verify); with token None the step reads its token from there too."""
    token = root.view(1) if token is None else token
    one = torch.ones(1, 1, dtype=torch.bool, device=token.device)
    logits = model(token[None], L.view(1), L.view(1), attention_mask(one, L, cols), False, cache)[0]
    nxt = choose(logits, (L + 1).view(1), sampling, seed)
    L.add_(1)
    if root is not None:
        root.copy_(nxt[0])
    return nxt, rows_finite(logits)


def commit(v: Verified, tree: Tree) -> Verified:
    """The one host sync of a round: the accepted length, the bonus, whether the logits were finite,
    the real candidates the tree held (v.nodes), and the path's tokens and sources, in one transfer.
    Errors: GraftError when the pass was not finite (a NaN would make the argmax pick token 0, again
    and again)."""
    parts = [v.A.view(1), v.bonus.view(1), v.finite.view(1).long(), tree.valid.sum().view(1) - 1,
             tree.tokens.index_select(0, v.path)]
    if tree.retrieved is not None:
        parts.append(tree.retrieved.index_select(0, v.path).long())
    got = torch.cat(parts).tolist()
    if not got[2]:
        raise GraftError("the target's logits are not finite (NaN or inf) in this pass: the model overflows "
                         "in this dtype or its weights are broken")
    A, P, H = got[0], v.path.numel(), 5          # H: the 4 values above and the root, then the accepted
    v.accepted, v.bonus_id, v.nodes = got[H:H + A], got[1], got[3]
    v.from_retrieval = got[H + P:H + P + A] if tree.retrieved is not None else [0] * A
    return v


# ----------------------------------------------------------------------------- methods

class Proposer:
    """A decoding method: each round it proposes a tree under the root, the verifier checks it, and it
    learns from the verification. N: nodes verified per round (root included); P: the longest path a
    round can accept (root included); needs_features: verification captures EAGLE-3 features."""
    N = 1
    P = 1
    needs_features = False

    def start(self, prompt: list):
        """A new generation: the prompt's token ids."""

    def prompt_chunk(self, ids: torch.Tensor, logits: torch.Tensor, feats, n: int):
        """After each prefill chunk: ids (C,), logits (C, V), feats (C, 3*dim) or None; the first n real."""

    def round(self, root: torch.Tensor) -> Verified:
        """One round under the root (0-d, on the device): propose, verify, learn, commit()."""
        raise NotImplementedError


class Clock:
    """Time per phase of a round, without host syncs: on a CPU each mark reads the wall clock; on a GPU
    it records a CUDA event, and the events are read once, when the generation is over."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.reset()

    def reset(self):
        """Forget every phase; timing restarts at the next start() (no event is recorded here, so an
        engine on fake CUDA tensors can be built on a machine without CUDA)."""
        self.totals, self.events = {}, []
        self.last = time.perf_counter()

    def start(self):
        if self.cuda:
            self.events.append((None, self._event()))
        else:
            self.last = time.perf_counter()

    def mark(self, phase: str):
        """The time since the previous mark goes to `phase`."""
        if self.cuda:
            self.events.append((phase, self._event()))
        else:
            now = time.perf_counter()
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
