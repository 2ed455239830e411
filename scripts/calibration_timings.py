"""Record the timings a calibration decides from, on this machine, for the suite to replay.

    python scripts/calibration_timings.py --runs 8 --neighbour 4 --out tests/data/calibration_timings.json

Runs the warm-up of the shipped stdlib pair (--budget auto) `--runs` times in one process, the last
`--neighbour` of them beside a second process that keeps the other core busy with matrix products (a
neighbour on a shared machine), and saves each run's raw samples (calibrate.measure_costs: seconds per
draft forward and per update, each warm-up round; assembly and verify samples per budget) with what
each run chose. tests/test_inputs.py replays them through the calibration: the choice must not
depend on which run's noise it saw.
"""
import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import calibrate as CAL  # noqa: E402
from cli import build_engine  # noqa: E402
from data import STDLIB_CKPT, STDLIB_DRAFT  # noqa: E402
from graft import Config  # noqa: E402


def neighbour(stop):
    torch.set_num_threads(1)
    a = torch.randn(768, 768)
    while not stop.is_set():
        a = (a @ a).tanh()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--neighbour", type=int, default=4, help="how many of the last runs have a busy neighbour")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    eng = build_engine(STDLIB_CKPT, STDLIB_DRAFT)
    runs, seen = [], []
    real = CAL.measure_costs

    def keep(*args, **kw):
        t = real(*args, **kw)
        seen.append(t)
        return t
    CAL.measure_costs = keep
    for i in range(a.runs):
        busy = i >= a.runs - a.neighbour
        stop = mp.Event()
        proc = mp.Process(target=neighbour, args=(stop,)) if busy else None
        if proc:
            proc.start()
            time.sleep(1.0)
        cal = CAL.warm_up(eng, Config(budget=16), use_cache=False, auto_budget=True)
        if proc:
            stop.set()
            proc.join()
        t = seen[-1]
        runs.append({"neighbour": busy, "chose": cal.methods["throughput"],
                     "draft": t["draft"], "update": t["update"],
                     "assemble": {str(b): xs for b, xs in t["assemble"].items()},
                     "verify": {str(n): xs for n, xs in t["verify"].items()}})
        print(f"run {i} (neighbour {busy}): {json.dumps(cal.methods['throughput'])}", file=sys.stderr)
    with open(a.out, "w") as fh:
        json.dump({"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d"),
                   "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                   "runs": runs}, fh)
        fh.write("\n")


if __name__ == "__main__":
    main()
