"""Does tokenizers' DecodeStream give the text a whole decode gives? (Why api.Sequence decodes whole.)

    python scripts/decode_stream_check.py [--sequences 30] [--length 60]

For each tokenizer graft ships or tests with (the stdlib target's byte-level BPE, stories260K's
SentencePiece with byte fallback, SmolLM2's GGUF vocabulary, where present) it streams token ids one
at a time through DecodeStream and counts the sequences whose joined pieces equal tokenizer.decode,
differ, or make DecodeStream raise: real texts with multi-byte characters, then random ids (which a
sampled generation can produce: a byte-fallback token alone is half a character)."""
import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenizers.decoders import DecodeStream  # noqa: E402

import data  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

TEXTS = ["héllo wörld — ünïcödé 日本語のテキスト 🎉🎉 emoji\n  spaces\ttab", "def f(x):\n    return x  # ∑",
         " leading space", "a\u2028b\u00a0c", "Once upon a time  there was"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=30)
    p.add_argument("--length", type=int, default=60)
    a = p.parse_args()
    random.seed(0)
    places = [data.STDLIB_CKPT, os.path.join(os.path.dirname(data.HERE), "shared", "models", "stories260K-hf"),
              data.demo_model()]
    for path in [q for q in places if q and os.path.exists(q)]:
        tok = load_tokenizer(path)
        V = tok.tk.get_vocab_size()
        cases = [("text", tok.encode(t)) for t in TEXTS]
        cases += [("random", [random.randrange(V) for _ in range(a.length)]) for _ in range(a.sequences)]
        got = {}
        for kind, ids in cases:
            ds, out = DecodeStream(skip_special_tokens=True), ""
            try:
                for i in ids:
                    out += ds.step(tok.tk, i) or ""
                verdict = "same" if out == tok.decode(ids) else "different"
            except Exception:
                verdict = "raised"
            got[(kind, verdict)] = got.get((kind, verdict), 0) + 1
        print(os.path.basename(path.rstrip("/")), {f"{k}/{v}": n for (k, v), n in sorted(got.items())})


if __name__ == "__main__":
    main()
