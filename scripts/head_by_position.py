"""How well an EAGLE-3 head agrees with its target at each position of a long real text.

    python scripts/head_by_position.py --ckpt TARGET [--draft HEAD] [--length 4096] [--texts 4] [--json-out F]

Teacher-forced, one target pass (prefill in chunks) and one head pass per text: at row t the head reads
the target's features of token t with token t+1 (docs/graft.md, EAGLE-3 heads) and predicts the token after
t+1; it agrees when its top-1 (mapped to the target's vocabulary) is the target's own top-1 there. That
is the depth-0 acceptance a round starts with (a draft path is accepted token by token from its first
node), measured by position, so a head trained on short windows shows where it stops working.
The texts are long real ones the benchmarks never use: standard-library sources from the training
split (data.stdlib_files: neither is_heldout nor is_long_context_file, the files lcc and repobench use) and, for chat models,
pydoc_data.topics documentation.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cli as CLI  # noqa: E402
import data as DATA  # noqa: E402
import engine as E  # noqa: E402
from model import GraftError, attention_mask  # noqa: E402
from verify import Sampling  # noqa: E402

EDGES = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@torch.no_grad()
def agreement(eng, ids: list) -> torch.Tensor:
    """(T-2,) bool: at row t (t = 0..T-3) the head's top-1 after (feature t, token t+1) equals the
    target's top-1 after token t+1. ids: a token list of T >= 3 tokens that fits the engine's caches."""
    if eng.drafter is None:
        raise GraftError("the head's agreement needs a head: pass --draft")
    got = []

    class Keep(E.Method):
        needs_head = True        # the prefill captures the target's features

        def prompt_chunk(self, eng, b, chunk, logits, feats, n):
            got.append((logits[0, :n].argmax(-1), feats[0, :n].clone()))

    keep = Keep(eng, E.Config())
    # slot 0: the target's pass, chunk by chunk (every row's logits: as for a request's prompt log-probs)
    eng.admit(0, E.Request(list(ids), logprobs=1, prompt_logprobs=True), keep)
    eng.free(0, keep)
    tgt = torch.cat([g[0] for g in got])                                  # (T,) the target's choice after each token
    feats = torch.cat([g[1] for g in got])                                # (T, 3*dim)
    d, dev = eng.drafter, eng.device
    head, T, C = d.head, len(ids), eng.chunk
    tok = torch.tensor(ids, device=dev)
    cols = torch.arange(d.cache.rows, device=dev)
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    preds = []
    for s in range(0, T - 1, C):                                        # rows (f_t, token t+1), t = 0..T-2
        c = min(C, T - 1 - s)                                           # into slot 0 of the head's cache
        L = torch.full((1,), s, device=dev)
        rows = L[:, None] + torch.arange(c, device=dev)
        mask = attention_mask(torch.ones(c, c, dtype=torch.bool, device=dev).tril_(), L, cols[:s + c])
        out = head(feats[s:s + c][None], tok[s + 1:s + 1 + c][None], rows, rows, mask, fused=True, cache=d.cache,
                   slots=slot)[0]
        preds.append(head.to_target(head.logprobs(out).argmax(-1)))
    pred = torch.cat(preds)                                               # (T-1,) after token t+1
    return pred[:T - 2] == tgt[1:T - 1]


def by_position(hits: list, edges=EDGES) -> list:
    """Agreement per position bucket over several texts: [{"from", "to", "rows", "agreement"}] for the
    buckets [edges[i], edges[i+1]) that hold rows. hits: (n,) bool tensors, row t at position t+1."""
    out = []
    for lo, hi in zip(edges, edges[1:]):
        xs = [h[max(lo - 1, 0):max(hi - 1, 0)] for h in hits]
        n = sum(x.numel() for x in xs)
        if n:
            out.append({"from": lo, "to": hi, "rows": n,
                        "agreement": round(sum(int(x.sum()) for x in xs) / n, 4)})
    return out


@torch.no_grad()
def on_continuations(eng, texts: list, contexts: list, new_tokens: int = 64) -> list:
    """The agreement on what the head meets when it drafts: each text cut to each context length (a
    token prefix), the target's own greedy continuation of new_tokens after it, and the agreement over
    the continuation's rows only. [{"context", "rows", "agreement"}] per context length."""
    out = []
    for L in contexts:
        hits = []
        for text in texts:
            ids = eng.tokenizer.encode(text)[:L]
            if len(ids) < L:
                continue
            res = E.generate(eng, E.make_method(eng, "ar"), ids, new_tokens, Sampling(), ())
            hits.append(agreement(eng, ids + res.tokens)[L - 1:])     # rows whose prediction is generated
        n = sum(h.numel() for h in hits)
        if n:
            out.append({"context": L, "rows": n, "agreement": round(sum(int(h.sum()) for h in hits) / n, 4)})
    return out


def long_texts(n: int, chat: bool) -> list:
    """n long real texts the benchmarks do not use: stdlib sources of the training split, the longest
    first (deterministic), and for chat models pydoc_data's topics as well."""
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    files = [f for f in DATA.stdlib_files(root) if not DATA.is_heldout(f, root) and not DATA.is_long_context_file(f, root)]
    files.sort(key=lambda f: (-os.path.getsize(f), f))
    texts = [open(f, encoding="utf-8", errors="replace").read() for f in files[:n]]
    if chat:
        from pydoc_data.topics import topics
        doc = "\n\n".join(topics[k] for k in sorted(topics))
        texts = texts[:(n + 1) // 2] + [doc[i * 400000:(i + 1) * 400000] for i in range(n // 2)]
    return texts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--draft", default=None, help="the head (default: the known one for --ckpt)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--length", type=int, default=4096, help="tokens per text")
    p.add_argument("--texts", type=int, default=4)
    p.add_argument("--chat", action="store_true", help="a chat model: half the texts are documentation")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--contexts", default="", help="also: the agreement on the target's own continuation after "
                                               "prefixes of these lengths, e.g. 256,1024,4096")
    p.add_argument("--new-tokens", type=int, default=64, help="continuation length for --contexts")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    draft = a.draft or DATA.known_head(a.ckpt)
    if not draft:
        raise GraftError("pass --draft: no known head for this target")
    contexts = CLI.numbers("--contexts", a.contexts) if a.contexts else []
    eng = CLI.build_engine(a.ckpt, draft, "cpu", a.dtype, max_seq_len=max([a.length] + contexts) + a.new_tokens + 16)
    hits = []
    texts = long_texts(a.texts, a.chat)
    for text in texts:
        ids = eng.tokenizer.encode(text)[:a.length]
        if len(ids) < a.length:
            print(f"a text has only {len(ids)} tokens (< --length {a.length}): left out", file=sys.stderr)
            continue
        hits.append(agreement(eng, ids))
    rows = by_position(hits)
    for r in rows:
        print(f"positions {r['from']:>6}-{r['to']:<6} rows {r['rows']:>6}  agreement {r['agreement']:.3f}")
    cont = on_continuations(eng, texts, contexts, a.new_tokens) if contexts else []
    for r in cont:
        print(f"after a {r['context']:>6}-token prefix: rows {r['rows']:>5}  agreement {r['agreement']:.3f} "
              f"(the target's own greedy continuation)")
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump({"ckpt": a.ckpt, "draft": draft, "length": a.length, "texts": len(hits), "buckets": rows,
                       "continuations": cont}, fh, indent=1)
    return rows, cont


if __name__ == "__main__":
    CLI.run(main)
