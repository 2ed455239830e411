"""Every method's tokens on some checkpoints, in one process or on every rank under torchrun (test_tp.py).

    python tests/tp_worker.py SPEC.json OUT.json                       # one process
    torchrun --nproc-per-node 2 tests/tp_worker.py SPEC.json OUT.json  # sharded: rank 0 writes OUT.json

SPEC: {"models": [[ckpt, head or null], ...], "methods": [...] or null (all), "new": tokens,
"batch": B > 1 also runs B requests at once, "compile": bool, "backend": torch.compile's (default
inductor), "samplings": some of SAMPLINGS or null (all), "samplings_alone": those of them
also run at B = 1 (default all), "round_work": methods whose host work a round
(cli.round_work: step calls, eager ops, host syncs) to count, "pace": rounds paced (engine.Pacer;
default off, as in the suite)}. OUT: {"model|method|B|greedy or
sampled": [tokens of each request], ...}, plus "ranks_agree" (every rank's tokens the same),
"peak_rss_mib" (every rank's) and "weights_mib" (every rank's parameters).
"""
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)

import engine  # noqa: E402
import tp  # noqa: E402
from cli import batch_engine, build_engine, round_work  # noqa: E402
from engine import Request, generate, run  # noqa: E402
from graft import METHODS, Config  # noqa: E402
from verify import Sampling  # noqa: E402

PROMPTS = [[1, 40, 77, 12, 9, 200, 31], [1, 5, 250, 250, 7], [1, 99, 14, 3, 180, 66, 71, 8, 120]]
SAMPLINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=0.9, top_p=0.95, seed=7)}


def tokens_of(spec: dict) -> dict:
    engine.PACE = bool(spec.get("pace"))      # as the suite's one-process reference (conftest: unpaced)
    out, weights = {}, 0
    for ckpt, head in spec["models"]:
        methods = [m for m in spec.get("methods") or METHODS if (head or not METHODS[m].needs_head) and not METHODS[m].needs_block]
        cfg = Config(budget=12)
        todo = [(m, cfg) for m in methods]
        eng = build_engine(ckpt, head, "cpu", "float32", max_seq_len=96, top_k=4, depth=4, batch=spec["batch"],
                           methods=todo, compile=spec.get("compile", False), backend=spec.get("backend", "inductor"))
        one = eng if spec["batch"] == 1 else batch_engine(eng, 1, todo)
        weights = max(weights, sum(p.numel() * p.element_size() for p in eng.model.parameters()))
        for m in methods:
            for kind, s in [(k, SAMPLINGS[k]) for k in spec.get("samplings") or SAMPLINGS]:
                if kind in (spec.get("samplings_alone") or SAMPLINGS):
                    r = generate(one, one.make(m, cfg), PROMPTS[0], spec["new"], s)
                    out[f"{Path(ckpt).name}|{m}|1|{kind}"] = [r.tokens]
                if spec["batch"] > 1:
                    reqs = [Request(ids, dataclasses.replace(s, seed=s.seed + i), i) for i, ids in enumerate(PROMPTS)]
                    res = run(eng, eng.make(m, cfg), reqs, spec["new"])
                    out[f"{Path(ckpt).name}|{m}|{spec['batch']}|{kind}"] = [q.tokens for q in res.requests]
                    if spec.get("pace"):          # which rounds were plain steps: every rank's the same
                        out[f"{Path(ckpt).name}|{m}|plain rounds"] = [q.plain for q in res.requests]
        for m in spec.get("round_work", []):      # the host's work a round: the all-reduces add no sync
            out[f"{Path(ckpt).name}|{m}|round_work"] = round_work(one, one.make(m, cfg), PROMPTS[0], spec["new"])
    out["ranks_agree"] = all(o == out for o in tp.every(dict(out)))
    out["peak_rss_mib"] = tp.every(tp.peak_rss_mib())
    out["weights_mib"] = tp.every(weights / 2 ** 20)
    return out


if __name__ == "__main__":
    got = tokens_of(json.loads(Path(sys.argv[1]).read_text()))
    if tp.world()[0] == 0:
        Path(sys.argv[2]).write_text(json.dumps(got))
    tp.end()                              # leave the group, then exit without the interpreter's teardown
