"""Tensor parallelism (tp.py): the target sharded over ranks of torch.distributed, gloo on loopback.

Every launch is `torchrun --standalone` (a free port of its own) running tests/tp_worker.py, which
decodes with every method on every rank and reports rank 0's tokens, whether every rank decided the
same ones, and every rank's peak memory; the same worker function in this process is the one-process
reference. float32, greedy and seeded sampling at B = 3, greedy at B = 1 (sampled at B = 1: the compiled
and SmolLM2 tests), and graft's host work a round (step calls, eager ops, host syncs: cli.round_work)
the same as one process's:
  tiny Llama-3.1 with one KV head (repeated on both ranks), tiny Qwen3 (2 KV heads: one a rank) and
  tiny Qwen3-MoE (experts and the dense layer sharded, router replicated), each with a random head
  compiled: the tiny Qwen3 with torch.compile's aot_eager backend (dynamo traces the functional
  all-reduces into every step's graph, fullgraph; inductor's codegen of them is checked by hand:
  README "Several devices")
  SmolLM2-135M-Instruct (GGUF, dequantized per shard) with its head at 3 ranks (3 KV heads)
and the faces: a world size the heads cannot be split into is one `error:` line; generate.py under
torchrun prints once, the tokens of a plain run.
"""
import json
import os
import subprocess
from pathlib import Path
import sys

import pytest
import torch

from conftest import ROOT, SHARED
from test_targets import make_moe, random_head

sys.path.insert(0, str(ROOT / "tests"))
import tp  # noqa: E402
import tp_worker  # noqa: E402
from model import GraftError, ModelArgs  # noqa: E402

SMOLLM2 = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def torchrun(n: int, *argv, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           *map(str, argv)], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)


def sharded(n: int, spec: dict, tmp_path) -> dict:
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    p = torchrun(n, ROOT / "tests" / "tp_worker.py", tmp_path / "spec.json", tmp_path / "out.json")
    written = (tmp_path / "out.json").exists()      # rank 0 writes it once every rank has done its work
    assert p.returncode == 0, f"(out.json {'written' if written else 'not written'}) " + p.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())


def same_tokens(one: dict, many: dict):
    keys = [k for k in one if "|" in k]
    assert keys and set(keys) == {k for k in many if "|" in k}
    assert many["ranks_agree"], "the ranks decided different tokens"
    assert {k: many[k] for k in keys} == {k: one[k] for k in keys}


@pytest.fixture(scope="module")
def targets(tiny_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    out = [tiny_ckpt("llama31", num_hidden_layers=3, num_key_value_heads=1), tiny_ckpt("qwen3", num_hidden_layers=3),
           make_moe(d / "moe", step=1, dense=(1,))]
    return [[str(t), str(random_head(t, d / f"head{i}"))] for i, t in enumerate(out)]


def test_every_method_sharded_equals_one_process(targets, tmp_path):
    spec = {"models": targets, "new": 6, "batch": 3, "samplings_alone": ["greedy"], "round_work": ["graft"]}
    many = sharded(2, spec, tmp_path)
    one = tp_worker.tokens_of(spec)
    same_tokens(one, many)
    assert len(many["peak_rss_mib"]) == 2
    # each rank holds its half of the sharded weights and all of the replicated ones
    assert one["weights_mib"][0] / 2 < many["weights_mib"][0] < one["weights_mib"][0]


def test_paced_ranks_plan_the_same_rounds(targets, tmp_path):
    """The pacer decides from a clock, and each rank has its own: the ranks take rank 0's round times
    (tp.same), so that they draft or step plainly together (else their all-reduces would not pair up)."""
    spec = {"models": targets[:1], "methods": ["graft"], "samplings": ["greedy"], "samplings_alone": ["none"],
            "new": 40, "batch": 2, "pace": True}
    many = sharded(2, spec, tmp_path)
    assert many["ranks_agree"], "the ranks decided different tokens or rounds"
    key = f"{Path(targets[0][0]).name}|graft"
    assert many[f"{key}|2|greedy"] == tp_worker.tokens_of(dict(spec, pace=False))[f"{key}|2|greedy"]
    assert sum(many[f"{key}|plain rounds"]) > 0          # (tiny models: trees do not pay, plain steps are taken)


def test_compiled_sharded_equals_one_process(targets, tmp_path):
    spec = {"models": targets[1:2], "methods": ["graft"], "samplings": ["sampled"], "new": 6, "batch": 1,
            "compile": True, "backend": "aot_eager"}
    same_tokens(tp_worker.tokens_of(dict(spec, compile=False)), sharded(2, spec, tmp_path))


@pytest.mark.skipif(not SMOLLM2.is_file(), reason=f"{SMOLLM2} is missing")
def test_smollm2_with_its_head_at_three_ranks(tmp_path):
    from data import DEMO_DRAFT
    spec = {"models": [[str(SMOLLM2), DEMO_DRAFT]], "methods": ["graft"], "new": 5, "batch": 1}
    many = sharded(3, spec, tmp_path)
    one = tp_worker.tokens_of(spec)
    same_tokens(one, many)
    print(f"SmolLM2-135M-Instruct float32: peak RSS one process {one['peak_rss_mib'][0]:.0f} MiB, "
          f"3 ranks {[round(m) for m in many['peak_rss_mib']]} MiB; weights {one['weights_mib'][0]:.0f} MiB against "
          f"{[round(m) for m in many['weights_mib']]} MiB a rank")


def test_world_size_the_heads_cannot_split_is_one_line(targets):
    with pytest.raises(GraftError, match="cannot split this model over 3 ranks.*world sizes that fit: 1, 2, 4"):
        tp.Shards(ModelArgs(n_heads=4, n_kv_heads=2, intermediate_size=128), 0, 3)
    p = torchrun(3, "generate.py", "--ckpt", targets[1][0], "--method", "ar", "--prompt", "a", "--max-new-tokens", "2")
    ours = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode != 0 and len(ours) == 1, p.stderr[-2000:]
    assert "cannot split this model over 3 ranks" in ours[0] and "world sizes that fit: 1, 2, 4" in ours[0]
    assert "Traceback" not in p.stderr.split("error:")[0]          # (torchrun's own report of the exit follows)


def test_generate_under_torchrun_prints_once_what_one_process_prints(targets):
    argv = ["generate.py", "--ckpt", targets[0][0], "--draft", targets[0][1], "--method", "graft", "--prompt",
            "Once upon a time", "--max-new-tokens", "8", "--warmup", "0", "--json", "--temperature", "0.8",
            "--seed", "3"]
    many = torchrun(2, *argv)
    assert many.returncode == 0, many.stderr[-3000:]
    import generate
    one = generate.main(argv[1:])                      # the same command in one process (this one)
    lines = [json.loads(ln) for ln in many.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1 and many.stderr.count("[graft, eager]") == 1
    assert lines[0]["tokens"] == one["tokens"] and len(one["peak_rss_mib"]) == 1
    assert len(lines[0]["peak_rss_mib"]) == 2 and "peak memory per rank" in many.stderr
