"""A new user's first start of the server, timed: `python serve.py --port PORT` with nothing else (the
shipped SmolLM2-135M-Instruct and its head, graft, 4 slots), from empty caches (graft's warm-up cache,
GRAFT_CACHE, and the CPU kernels' build, GRAFT_KERNELS_DIR, both fresh temporary folders), until a chat
request is answered; then, with --until-calibrated, until graft is in force (/health).

    OMP_NUM_THREADS=1 python scripts/cold_start.py [--until-calibrated] [--timeout 600] [-- SERVE FLAGS...]

Prints one line per milestone (seconds since the start) and a JSON summary. The request is sent as soon
as the port accepts connections, as a client that does not poll /health would.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call(url: str, body: dict | None = None, timeout: float = 600):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main():
    p = argparse.ArgumentParser(description="Time serve.py's cold start until it answers a chat request.")
    p.add_argument("--until-calibrated", action="store_true", help="then wait until /health says the method is in force")
    p.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")
    p.add_argument("serve", nargs="*", help="more serve.py flags, after --")
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="graft-cold-")
    env = dict(os.environ, GRAFT_CACHE=os.path.join(tmp, "cache"), GRAFT_KERNELS_DIR=os.path.join(tmp, "kernels"))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, os.path.join(ROOT, "serve.py"), "--port", str(port), *a.serve]
    t0 = time.perf_counter()
    log = open(os.path.join(tmp, "serve.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url, out = f"http://127.0.0.1:{port}", {"command": " ".join(cmd[1:]), "caches": tmp}
    say = lambda what: print(f"{time.perf_counter() - t0:7.1f}s  {what}", flush=True)
    try:
        while True:
            if proc.poll() is not None or time.perf_counter() - t0 > a.timeout:
                raise SystemExit(f"serve.py ended or timed out: see {log.name}")
            try:
                model = call(url + "/v1/models", timeout=5)["data"][0]["id"]
                break
            except (OSError, urllib.error.URLError):
                time.sleep(0.2)
        out["port_s"] = round(time.perf_counter() - t0, 1)
        say("the server answers /v1/models")
        r = call(url + "/v1/chat/completions", {"model": model, "max_tokens": 32,
                                                 "messages": [{"role": "user", "content": "Hi! Who are you?"}]})
        out["first_chat_s"] = round(time.perf_counter() - t0, 1)
        h = call(url + "/health")
        out["answered_by"], out["calibration_then"] = h["method"], h["calibration"]
        say(f"a chat request answered by {h['method']} (calibration: {h['calibration']}): "
            f"{r['choices'][0]['message']['content']!r}")
        while a.until_calibrated and h["calibrating"] is not None:
            if proc.poll() is not None or time.perf_counter() - t0 > a.timeout:
                raise SystemExit(f"serve.py ended or timed out: see {log.name}")
            time.sleep(1)
            h = call(url + "/health")
        if a.until_calibrated:
            out["calibrated_s"], out["method"], out["calibration"] = (round(time.perf_counter() - t0, 1), h["method"],
                                                                      h["calibration"])
            say(f"{h['method']} in force (calibration: {h['calibration']})")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
