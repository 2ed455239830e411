"""The compiled engine's checks, run as one subprocess beside the suite (compiling takes minutes; the
suite itself runs on one thread, this on the other core). Results go to argv[1] as JSON; test_engine.py
reads them (those tests run last).

  every_method  a tiny random Llama (2 layers) + random head, compiled with torch.compile's aot_eager
                backend (dynamo tracing with fullgraph, functionalised cache writes, no codegen): every
                method, greedy and sampled, two prompts, tokens equal to the eager engine's
  recompiles    after compile_warmup, graphs compiled by rounds at other prompt/context lengths
  warmup        the calibration warm-up on the compiled engine (aot_eager): it runs (more rounds than
                dynamo's recompile limit), and records what the eager engine's records (Youden's
                thresholds, hit rates, the matrix)
  demo          the demo pair, aot_eager, graft, greedy and sampled
  gpu_check     scripts/gpu_check.py --tiny: the GPU check's code end to end on the CPU
  inductor      the tiny model compiled with inductor (the real CPU backend): ar, and graft-root (every
                kind of step in one stage: prefill, decode, verify, the head's extend and level,
                retrieval and grafting, the matrix update), greedy
"""
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

torch.set_num_threads(1)
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import generate as G  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

GREEDY, SAMPLED = G.Sampling(), G.Sampling(temperature=0.8, top_p=0.9, seed=1234)
CFG = G.Config(budget=8, checkpoints=(0, 1, 2))
PROMPTS = [[1, 40, 41, 42, 50], [1, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71]]


def same(eager, comp, method, s, prompts, cfg=CFG, n=24) -> bool:
    return all(G.generate(eager, G.make_method(eager, method, cfg), ids, n, s, ()).tokens ==
               G.generate(comp, G.make_method(comp, method, cfg), ids, n, s, ()).tokens for ids in prompts)


def tiny_pair(backend: str, tmp: Path):
    from conftest import make_tiny_model
    from test_lossless import random_head
    target = tmp / "t"
    if not target.exists():
        make_tiny_model(target, "llama31", num_hidden_layers=2)
        random_head(target, tmp / "h", draft_vocab=100)
    kw = dict(max_seq_len=128, top_k=4, depth=4, chunk=16)
    pair = (G.build_engine(str(target), str(tmp / "h"), **kw),
            G.build_engine(str(target), str(tmp / "h"), compile=True, backend=backend, **kw))
    for e in pair:
        e.thresholds = {0: 0.3, 1: 0.1, 2: 0.02}       # every stage fires on this head
    return pair


def run(section, fn, result):
    try:
        result[section] = fn()
    except Exception:       # noqa: BLE001 - reported to the test, which fails with it
        result[section] = {"error": traceback.format_exc()[-3000:]}


def main(out: str):
    result, tmp = {}, Path(tempfile.mkdtemp())
    save = lambda: Path(out).write_text(json.dumps(result))

    def every_method():
        eager, comp = tiny_pair("aot_eager", tmp)
        return {m: {"greedy": same(eager, comp, m, GREEDY, PROMPTS), "sampled": same(eager, comp, m, SAMPLED, PROMPTS)}
                for m in G.METHODS}

    def recompiles():
        _, comp = tiny_pair("aot_eager", tmp)
        methods = [G.make_method(comp, m, CFG) for m in ("ar", "graft", "recycle", "pld")]
        G.compile_warmup(comp, methods)
        before = counters["stats"]["unique_graphs"]
        for ids in PROMPTS + [[1] + list(range(60, 100))]:    # three prompt lengths, two chunk counts
            for m in methods:
                G.generate(comp, m, ids, 30, GREEDY, ())
        return {"graphs_after_warmup": counters["stats"]["unique_graphs"] - before}

    def warmup():
        eager, comp = tiny_pair("aot_eager", tmp)
        got = []
        for e in (eager, comp):
            G.warm_up(e, CFG, rounds=3, max_new_tokens=40, use_cache=False)
            got.append((e.calibrations["youden"]["graft"]["thresholds"], e.hit_rates, e.matrix.M.clone()))
        return {"youden": got[0][0] == got[1][0], "hit_rates": got[0][1] == got[1][1],
                "matrix": bool(torch.equal(got[0][2], got[1][2]))}

    def demo():
        ckpt, head = str(HERE.parent / "checkpoints" / "stdlib-qwen3"), str(HERE.parent / "checkpoints" / "stdlib-qwen3-eagle3")
        eager = G.build_engine(ckpt, head, max_seq_len=512)
        comp = G.build_engine(ckpt, head, max_seq_len=512, compile=True, backend="aot_eager")
        for e in (eager, comp):
            e.thresholds = {0: 0.3, 1: 0.15, 5: 0.05}
        ids = [eager.tokenizer.encode(G.STDLIB_PROMPT)]
        cfg = G.Config(budget=16)
        return {m: {"greedy": same(eager, comp, m, GREEDY, ids, cfg, 40), "sampled": same(eager, comp, m, SAMPLED, ids, cfg, 40)}
                for m in ("graft",)}

    def inductor():
        eager, comp = tiny_pair("inductor", tmp)
        methods = {m: G.make_method(comp, m, CFG) for m in ("ar", "graft-root")}
        t0 = time.time()
        G.compile_warmup(comp, list(methods.values()))
        secs = time.time() - t0
        before = counters["stats"]["unique_graphs"]
        got = {m: all(G.generate(comp, p, ids, 24, GREEDY, ()).tokens ==
                      G.generate(eager, G.make_method(eager, m, CFG), ids, 24, GREEDY, ()).tokens for ids in PROMPTS)
               for m, p in methods.items()}
        return {"same": got, "graphs_after_warmup": counters["stats"]["unique_graphs"] - before,
                "compile_seconds": round(secs, 1)}

    def gpu_check():
        import subprocess
        report = tmp / "gpu_check.json"
        got = subprocess.run([sys.executable, str(HERE.parent / "scripts" / "gpu_check.py"), "--tiny", "--tokens", "16",
                              "--out", str(report)], capture_output=True, text=True, timeout=1200)
        if got.returncode:
            return {"error": got.stderr[-3000:]}
        return json.loads(report.read_text())

    for section, fn in (("every_method", every_method), ("recompiles", recompiles), ("warmup", warmup), ("demo", demo),
                        ("gpu_check", gpu_check), ("inductor", inductor)):
        run(section, fn, result)
        save()


if __name__ == "__main__":
    main(sys.argv[1])
