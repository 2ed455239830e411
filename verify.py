"""Tree verification: one target pass over a token tree, then exact (lossless) acceptance.

A tree is two tensors, root first and parents before children:
    tokens  (N,) long   tokens[0] is the root r (the last committed token, its KV not yet cached)
    parents (N,) long   parents[0] = -1; parents[i] < i
Where a node came from (draft head, continuation matrix, prompt lookup) is not the verifier's business.

Acceptance picks the longest root path whose every token equals the target's own choice at its
parent: the argmax (greedy) or a draw with noise keyed by (seed, absolute position) (sampling). The
target's choice at the last accepted node is the bonus token, the next round's root. Plain decoding is
the same thing with an empty tree, so every method emits exactly the target's own tokens.
"""
from dataclasses import dataclass

import torch

from model import GraftError


# ----------------------------------------------------------------------------- sampling

# Below this temperature, sampling is greedy decoding: dividing the logits by it would overflow
# float32 (1e-45 gives inf - inf = NaN), and the draw it approximates is the argmax anyway (vLLM's
# _SAMPLING_EPS is the same value).
MIN_TEMPERATURE = 1e-5


@dataclass
class Sampling:
    temperature: float = 0.0     # < MIN_TEMPERATURE = greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 = off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply) in int64 arithmetic; constants < 2^31 so nothing overflows."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


_TOKEN_HASH = {}


def _token_hash(vocab: int, device) -> torch.Tensor:
    """Per-token-id hash (V,): depends on nothing else, so it is computed once per (V, device)."""
    key = (vocab, str(device))
    if key not in _TOKEN_HASH:
        ids = torch.arange(vocab, device=device, dtype=torch.int64)
        _TOKEN_HASH[key] = _hash32(ids * 0x165667B1 + 0x3C6EF372)
    return _TOKEN_HASH[key]


def position_noise(seed: int, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise (N, V) that depends only on (seed, absolute position, token id).

    A counter-based generator: the draw for position p is the same whether p is decoded alone or as
    one node of a tree, on any device. That is what makes speculative sampling reproduce plain sampling
    token for token (GRAFT.md section 5)."""
    dev = positions.device
    base = _hash32(torch.tensor(seed, dtype=torch.int64, device=dev) * 0x2545F491 + 0x1234567)
    h_pos = _hash32(base ^ (positions.long() * 0x27D4EB2D & _M32))                 # (N,)
    h = _hash32(h_pos[:, None] ^ _token_hash(vocab, dev)[None, :])                 # (N, V)
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


def choose(logits: torch.Tensor, positions: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The target's token after each row: argmax, or a Gumbel-max draw keyed by the position it fills.

    logits (N, V); positions (N,) absolute positions *of the tokens being chosen*. Returns (N,) long."""
    if s.greedy:
        return logits.argmax(-1)
    x = warp(logits, s).double() + position_noise(s.seed, positions, logits.shape[-1])
    return x.argmax(-1)


# ----------------------------------------------------------------------------- tree geometry

def tree_mask(parents: torch.Tensor) -> tuple:
    """Ancestor mask (N, N) bool (row i sees i and its ancestors) and depth (N,) (root 0).

    Start from "self or parent" and square the relation: after j squarings it reaches ancestors up to
    2^j generations away, so ceil(log2 N) small matmuls, a number fixed by N alone (no host sync)."""
    N = parents.numel()
    idx = torch.arange(N, device=parents.device)
    up = torch.where(parents < 0, idx, parents)          # the root is its own parent
    rel = torch.zeros(N, N, device=parents.device)
    rel[idx, idx] = 1.0
    rel[idx, up] = 1.0
    for _ in range(max(N - 1, 1).bit_length()):
        rel = (rel @ rel).clamp_(max=1.0)
    mask = rel > 0
    return mask, mask.sum(-1) - 1


def accept(tokens: torch.Tensor, parents: torch.Tensor, mask: torch.Tensor, depth: torch.Tensor,
           target: torch.Tensor) -> tuple:
    """Longest accepted path. target (N,): the target's choice after each node.

    A node is acceptable when its token is what the target chose at its parent, and so are all its
    ancestors'. Returns (order (N,), bonus token (), A as a 0-d tensor): order[:A+1] is the accepted
    path, root first (the rest of `order` is the other nodes)."""
    ok = torch.ones_like(tokens, dtype=torch.bool)
    ok[1:] = tokens[1:] == target[parents[1:]]
    good = ~(mask & ~ok[None, :]).any(-1)                # every node on the way is ok
    best = torch.argmax(torch.where(good, depth, -1))    # deepest; first one on ties
    on_path = mask[best]                                 # ancestors of best (and best)
    order = torch.argsort(torch.where(on_path, depth, depth.numel() + 1))
    A = depth[best]
    return order, target[best], A


# ----------------------------------------------------------------------------- verification

@dataclass
class Verified:
    path: torch.Tensor          # (A+1,) node indices of the root and the accepted nodes
    accepted: list              # the A accepted tokens (python ints), root excluded
    bonus: int                  # the target's token after the last accepted node: the next root
    logits: torch.Tensor        # (N, V) logits at every node (the continuation matrix reads them)
    target: torch.Tensor        # (N,) the target's choice at every node
    feats: torch.Tensor | None  # (A+1, 3*dim) EAGLE-3 features of the root and accepted nodes


@torch.no_grad()
def verify(model, tokens: torch.Tensor, parents: torch.Tensor, L: int, s: Sampling,
           capture: bool = False) -> Verified:
    """Verify a tree whose root goes at cache row L (rows 0..L-1 are committed), commit the accepted path.

    Nodes are written at rows L..L+N-1 with positions L + depth; row i attends to the committed prefix
    and its own ancestors. Afterwards the accepted rows are compacted to L..L+A, so the cache is
    exactly what decoding the accepted tokens one by one would have left."""
    N = tokens.numel()
    dev = tokens.device
    mask, depth = tree_mask(parents)
    full = torch.cat([torch.ones(N, L, dtype=torch.bool, device=dev), mask], dim=1)   # (N, L+N)
    rows = torch.arange(L, L + N, device=dev)
    out = model(tokens[None], L + depth, rows, full, capture=capture)
    logits, feats = (out[0][0], out[1][0]) if capture else (out[0], None)
    target = choose(logits, L + depth + 1, s)                                        # (N,)
    order, bonus, A = accept(tokens, parents, mask, depth, target)
    # the one host sync of the round: the accepted length, the bonus, whether every logit was finite
    # (a NaN would make the argmax silently pick token 0), and the accepted tokens, in one transfer
    finite = torch.isfinite(logits).all().long()
    got = torch.cat([A.view(1), bonus.view(1), finite.view(1), tokens[order]]).tolist()
    if not got[2]:
        raise GraftError("the target's logits are not finite (NaN or inf) in this pass: the model overflows "
                         "in this dtype or its weights are broken")
    A, bonus = got[0], got[1]
    path = order[:A + 1]
    if A > 0:
        model.move_cache_rows(L + path, L)
    return Verified(path=path, accepted=got[4:4 + A], bonus=bonus, logits=logits,
                    target=target, feats=None if feats is None else feats[path])
