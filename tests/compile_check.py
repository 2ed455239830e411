"""The compiled engine's checks, run as one subprocess beside the suite (compiling takes minutes; the
suite itself runs on one thread, this on the other core). Results go to argv[1] as JSON; test_engine.py
reads them (those tests run last).

  every_method  a tiny random Llama (2 layers) + random head, compiled with torch.compile's aot_eager
                backend (dynamo tracing with fullgraph, functionalised cache writes, no codegen): every
                method, sampled, two prompts, tokens equal to the eager engine's (greedy: lifetimes)
  recompiles    after compile_warmup, graphs compiled by rounds at other prompt/context lengths
  warmup        the calibration warm-up with --budget auto on the compiled engine (aot_eager): it runs
                (more rounds than dynamo's recompile limit), records what the eager engine's records
                (Youden's thresholds, hit rates, the matrix), and the graphs each step then holds
  demo          the demo pair, aot_eager, graft, greedy and sampled
  gpu_check     scripts/gpu_check.py --tiny --time-limit 420: the GPU check's code end to end on the CPU,
                every section, in one call within the limit
  lifetimes     every method compiled (aot_eager) with every step output poisoned as it expires: lossless
  one_verify_graph  the verify passes --budget auto times share one graph per path length
  statics       every tensor a compiled step reads on two calls or more is declared static
  statics_shared  the same with a method's buffer left undeclared, two instances sharing their graphs
  inductor      the tiny model compiled with inductor (the real CPU backend): ar, and graft-naive-root (every
                kind of step in one stage: prefill, decode, verify, the head's extend and level,
                retrieval and grafting, the matrix update), greedy
  batch         B = 2 (aot_eager, full attention, every step output poisoned as it expires): after a
                first stream, a second one with other prompt lengths, more prompts than slots, other
                seeds and temperatures (one sampling mode) compiles no new graph, and every request's
                tokens equal the eager engine's at B = 1; every method, graft under both policies
"""
import dataclasses
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

import calibrate as CAL  # noqa: E402
import cli as CLI  # noqa: E402
import data as DATA  # noqa: E402
import engine as E  # noqa: E402
import graft as GR  # noqa: E402
import verify as V  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

NO_BLOCK = [m for m in E.METHODS if m not in E.NEEDS_BLOCK]   # (engines here have no DFlash drafter)

GREEDY, SAMPLED = V.Sampling(), V.Sampling(temperature=0.8, top_p=0.9, seed=1234)
THRESHOLDS = {0: 0.3, 1: 0.1, 2: 0.02}                # every stage fires on the tiny head
CFG = GR.Config(budget=8, checkpoints=(0, 1, 2), thresholds=THRESHOLDS)
GPU_CHECK_LIMIT = 420                                  # seconds: scripts/gpu_check.py --tiny --time-limit
PROMPTS = [[1, 40, 41, 42, 50], [1, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71]]


def same(eager, comp, method, s, prompts, cfg=CFG, n=24) -> bool:
    return all(E.generate(eager, E.make_method(eager, method, cfg), ids, n, s, ()).tokens ==
               E.generate(comp, E.make_method(comp, method, cfg), ids, n, s, ()).tokens for ids in prompts)


def tiny_files(tmp: Path) -> Path:
    from conftest import make_tiny_model
    from test_lossless import random_head
    target = tmp / "t"
    if not target.exists():
        make_tiny_model(target, "llama31", num_hidden_layers=2)
        random_head(target, tmp / "h", draft_vocab=100)
    return target


def tiny_pair(backend: str, tmp: Path):
    target = tiny_files(tmp)
    kw = dict(max_seq_len=128, top_k=4, depth=4, chunk=16)
    return (CLI.build_engine(str(target), str(tmp / "h"), **kw),
            CLI.build_engine(str(target), str(tmp / "h"), compile=True, backend=backend, **kw))


PROMPTS_LONG = PROMPTS + [[1] + list(range(40, 80))]          # (the last: 3 prefill chunks of 16)


def tiny_engine(tmp: Path, **kw):
    """An engine on the tiny pair (tiny_pair builds it first)."""
    return CLI.build_engine(str(tiny_files(tmp)), str(tmp / "h"), max_seq_len=128, top_k=4, depth=4, chunk=16, **kw)


def run(section, fn, result):
    t0 = time.time()
    try:
        result[section] = fn()
    except Exception:       # noqa: BLE001 - reported to the test, which fails with it
        result[section] = {"error": traceback.format_exc()[-3000:]}
    result.setdefault("_seconds", {})[section] = round(time.time() - t0, 1)      # (what each section costs)


def recording():
    """({graph: [[tensor arguments of each call]]}, a dynamo backend that records them and runs the graph)."""
    calls = {}

    def backend(gm, example_inputs):
        key = len(calls)
        calls[key] = []

        def run(*args):
            calls[key].append([a for a in args if torch.is_tensor(a)])
            return gm(*args)
        return run
    return calls, backend


def known(eng) -> set:
    """ids of what a step may read in place on a GPU: declared statics, parameters and buffers."""
    out = {id(t) for t in eng.steps.statics}
    return out | {id(t) for mod in (eng.model, eng.drafter.head) for t in list(mod.parameters()) + list(mod.buffers())}


def unstated(calls: dict, known: set, every: bool = False) -> list:
    """The tensors (shape and dtype) that reached one graph, at one argument position, in two or more
    of its calls as the same object, and are not `known`: state living across calls that nobody
    declared static. (every=True: only those that were there in every call, the older rule, which a
    graph shared by two method instances hides: their buffers alternate.) `calls` holds every
    argument alive, so no id is reused."""
    bad = set()
    for seen in calls.values():
        if len(seen) < 2:
            continue
        for i in range(max(map(len, seen))):
            at = [c[i] for c in seen if i < len(c)]
            counts = {}
            for t in at:
                counts[id(t)] = counts.get(id(t), 0) + 1
            for t in at:
                if id(t) not in known and (counts[id(t)] == len(seen) if every else counts[id(t)] >= 2):
                    bad.add(f"{tuple(t.shape)} {t.dtype}")
    return sorted(bad)


def main(out: str, only=()):
    result, tmp = {}, Path(tempfile.mkdtemp())
    save = lambda: Path(out).write_text(json.dumps(result))

    def every_method():
        # sampled only: greedy is checked for every method by `lifetimes` (full attention, outputs poisoned)
        # and, with this window attention, by `inductor` (ar, graft-naive-root) and `recompiles`
        eager, comp = tiny_pair("aot_eager", tmp)
        return {m: {"sampled": same(eager, comp, m, SAMPLED, PROMPTS)} for m in NO_BLOCK}

    def recompiles():
        _, comp = tiny_pair("aot_eager", tmp)
        methods = [E.make_method(comp, m, CFG) for m in ("ar", "graft", "recycle", "pld")]
        E.compile_warmup(comp, methods)
        before = counters["stats"]["unique_graphs"]
        for ids in PROMPTS + [[1] + list(range(60, 100))]:    # three prompt lengths, two chunk counts
            for m in methods:
                E.generate(comp, m, ids, 30, GREEDY, ())
        return {"graphs_after_warmup": counters["stats"]["unique_graphs"] - before}

    def warmup():
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        eager, comp = tiny_pair("aot_eager", tmp)
        got = []
        for e in (eager, comp):
            cal = CAL.warm_up(e, GR.Config(budget=8, checkpoints=(0, 1, 2)), rounds=3, max_new_tokens=40, use_cache=False,
                              auto_budget=True)
            got.append((cal.get("graft", "youden")["thresholds"], cal.hit_rates, e.matrix.M.clone(), cal.budget_curve))
        graphs = {n: len(_debug_get_cache_entry_list(getattr(comp.steps, n)._torchdynamo_orig_callable))
                  for n in sorted(comp.steps.names)}        # each step's graphs: its code object's cache entries
        return {"youden": got[0][0] == got[1][0], "hit_rates": got[0][1] == got[1][1],
                "matrix": bool(torch.equal(got[0][2], got[1][2])), "graphs": graphs,
                "budgets": sorted(int(b) for b in got[1][3]["graft"])}

    def demo():
        ckpt, head = str(HERE.parent / "checkpoints" / "stdlib-qwen3"), str(HERE.parent / "checkpoints" / "stdlib-qwen3-eagle3")
        eager = CLI.build_engine(ckpt, head, max_seq_len=512)
        comp = CLI.build_engine(ckpt, head, max_seq_len=512, compile=True, backend="aot_eager")
        ids = [eager.tokenizer.encode(DATA.STDLIB_PROMPT)]
        cfg = GR.Config(budget=16, thresholds={0: 0.3, 1: 0.15, 5: 0.01})
        return {m: {"greedy": same(eager, comp, m, GREEDY, ids, cfg, 40), "sampled": same(eager, comp, m, SAMPLED, ids, cfg, 40)}
                for m in ("graft",)}

    def inductor():
        eager, comp = tiny_pair("inductor", tmp)
        methods = {m: E.make_method(comp, m, CFG) for m in ("ar", "graft-naive-root")}
        t0 = time.time()
        E.compile_warmup(comp, list(methods.values()))
        secs = time.time() - t0
        before = counters["stats"]["unique_graphs"]
        got = {m: all(E.generate(comp, p, ids, 24, GREEDY, ()).tokens ==
                      E.generate(eager, E.make_method(eager, m, CFG), ids, 24, GREEDY, ()).tokens for ids in PROMPTS)
               for m, p in methods.items()}
        return {"same": got, "graphs_after_warmup": counters["stats"]["unique_graphs"] - before,
                "compile_seconds": round(secs, 1)}

    def gpu_check():
        """The rehearsal the issue asks for, as it would run on a GPU: one call within 420 s."""
        import subprocess
        out = tmp / "gpu_check"
        t0 = time.time()
        got = subprocess.run([sys.executable, str(HERE.parent / "scripts" / "gpu_check.py"), "--tiny", "--time-limit",
                              str(GPU_CHECK_LIMIT), "--tokens", "16", "--out", str(out)],
                             capture_output=True, text=True, timeout=GPU_CHECK_LIMIT + 60)
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else None
        return {"returncode": got.returncode, "stdout": got.stdout[-3000:], "stderr": got.stderr[-3000:],
                "summary": summary, "seconds": round(time.time() - t0, 1)}

    def lifetimes():
        """Every method compiled (aot_eager) with each step output poisoned as it expires."""
        eager, _ = tiny_pair("aot_eager", tmp)
        comp = tiny_engine(tmp, compile=True, backend="aot_eager", check_lifetimes=True, attention="full")
        return {m: {"greedy": same(eager, comp, m, GREEDY, PROMPTS_LONG), "sampled": same(eager, comp, m, SAMPLED, PROMPTS_LONG)}
                for m in NO_BLOCK}

    def one_verify_graph():
        """--budget auto times a verify pass per budget: one graph serves them all (the size is dynamic)."""
        _, comp = tiny_pair("aot_eager", tmp)
        CAL.pass_cost(comp, [9], context=40, repeats=1, capture=True)          # compiles prefill and verify
        before = counters["stats"]["unique_graphs"]
        CAL.pass_cost(comp, [b + 1 for b in CAL.auto_budgets(comp)], context=40, repeats=1, capture=True)
        return {"new_graphs": counters["stats"]["unique_graphs"] - before}

    def statics():
        """Every tensor a compiled step reads on more than one call (the same object) is declared static
        (or is a parameter or buffer): on a GPU anything else is copied in on every replay."""
        out = {}
        for attention, B in (("window", 1), ("full", 1), ("window", 2)):
            calls, backend = recording()
            eng = tiny_engine(tmp, compile=True, backend=backend, attention=attention, batch=B)
            for m in NO_BLOCK:
                p = E.make_method(eng, m, CFG)
                if B == 1:
                    for ids in PROMPTS_LONG:
                        E.generate(eng, p, ids, 12, GREEDY, ())
                else:                        # a stream through the slots, refilled
                    E.run(eng, p, [E.Request(ids, GREEDY, i) for i, ids in enumerate(PROMPTS_LONG)], 12)
            out[attention if B == 1 else f"{attention}@{B}"] = unstated(calls, known(eng))
        return out

    def statics_shared():
        """The blind spot of a check that wants a tensor in *every* call of a graph: two graft instances
        (other thresholds) share their graphs, so a buffer left out of Method.tensors() (here m.taus)
        alternates between two objects. What the rule of `statics` and the all-calls rule report."""
        calls, backend = recording()
        eng = tiny_engine(tmp, compile=True, backend=backend, attention="full")
        tensors = GR.Eagle3Tree.tensors
        GR.Eagle3Tree.tensors = lambda self: [t for t in tensors(self) if t is not self.taus]
        try:
            ms = [E.make_method(eng, "graft", dataclasses.replace(CFG, thresholds={0: t, 1: 0.1, 2: 0.02}))
                  for t in (0.3, 0.31)]
            for ids in PROMPTS_LONG:
                for m in ms:
                    E.generate(eng, m, ids, 12, GREEDY, ())
        finally:
            GR.Eagle3Tree.tensors = tensors
        taus = f"{tuple(ms[0].taus.shape)} {ms[0].taus.dtype}"
        return {"taus": taus, "flagged": unstated(calls, known(eng)),
                "flagged_if_in_every_call": unstated(calls, known(eng), every=True)}

    def batch():
        """B = 2 (aot_eager, full attention, every step output poisoned as it expires): after a first
        stream, a second with other prompt lengths, more prompts than slots, other seeds and
        temperatures (one sampling mode: sampled, top-p) compiles nothing new, and each request's tokens
        are the eager engine's for its prompt alone."""
        eager = tiny_engine(tmp)
        comp = tiny_engine(tmp, compile=True, backend="aot_eager", check_lifetimes=True, attention="full", batch=2)
        first = [[1, 40, 41, 42, 50], [1] + list(range(7, 30)), [1, 9, 9]]
        later = [[1] + list(range(60, 100)), [1, 5], PROMPTS[1], [1, 3, 4], [1] + list(range(20, 37))]
        smp = lambda i, seed: V.Sampling(temperature=0.5 + 0.1 * (i % 4), top_p=0.8 + 0.05 * (i % 3), seed=seed + i)
        out = {}
        for name, policy in [(m, None) for m in NO_BLOCK] + [("graft", "stop"), ("prune", "stop")]:
            m = comp.make(name, dataclasses.replace(CFG, policy=policy))
            E.run(comp, m, [E.Request(x, smp(i, 100), i) for i, x in enumerate(first)], 12)
            before = counters["stats"]["unique_graphs"]
            got = E.run(comp, m, [E.Request(x, smp(i, 7), i) for i, x in enumerate(later)], 16).requests
            new = counters["stats"]["unique_graphs"] - before
            want = [E.generate(eager, eager.make("ar"), r.ids, 16, r.sampling, ()).tokens for r in got]
            out[name + (f"-{policy}" if policy else "")] = {"new_graphs": new, "same": [r.tokens for r in got] == want}
        return out

    for section, fn in (("batch", batch), ("lifetimes", lifetimes), ("one_verify_graph", one_verify_graph), ("statics", statics),
                        ("statics_shared", statics_shared),
                        ("every_method", every_method), ("recompiles", recompiles), ("warmup", warmup),
                        ("demo", demo),
                        ("gpu_check", gpu_check), ("inductor", inductor)):
        if only and section not in only:
            continue
        run(section, fn, result)
        save()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else ())     # [sections]: for debugging
