"""Batches (batch.py): B requests in one target pass per round, each lossless on its own.

Every request's tokens equal the same prompt run alone with `ar` (float32, greedy and sampled), for
every batched method at B = 1, 2, 3 and 5: prompts of different lengths, more prompts than slots
(a finished request's slot takes the next one), requests that end at different rounds (an EOS, the
token limit), each with its own seed. A request's tokens do not depend on its neighbours, and the
compiled steps (aot_eager) do not recompile as requests come and go at a fixed B.
The demo pair (checkpoints/stdlib-qwen3 and its EAGLE-3 head) is small enough to keep this fast and
accepts many tokens a round, so acceptance, compaction and refills all happen often.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batch import BATCH_METHODS, BatchEngine, graft_each, tree_masks
from cli import build_engine
from conftest import ROOT
from data import STDLIB_CKPT, STDLIB_DRAFT, STDLIB_PROMPT
from engine import generate, make_method
from graft import Config, build_template
from model import GraftError
from verify import Sampling, tree_mask

GREEDY = Sampling()
SAMPLED = Sampling(temperature=0.8, top_p=0.9, seed=1234)
CFG = Config(budget=10, recycle_size=24)
TEXTS = [STDLIB_PROMPT, "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
         "def add(a, b):\n    return", "for i in range(10):\n    print(i)\n" * 3, "x",
         STDLIB_PROMPT * 4]                  # 160 tokens: two prefill chunks into its slot
N_NEW = 16

has_stdlib = pytest.mark.skipif(not (Path(STDLIB_CKPT) / "model.safetensors").is_file(), reason="no demo pair")


@pytest.fixture(scope="module")
def eng():
    e = build_engine(STDLIB_CKPT, STDLIB_DRAFT, max_seq_len=256)
    e.thresholds = {0: 0.3, 1: 0.2, 5: 0.05}        # the batch variant replaces nodes in most rounds
    return e


@pytest.fixture(scope="module")
def prompts(eng):
    return [eng.tokenizer.encode(t) for t in TEXTS]


def alone(eng, ids, s, eos, seed):
    s1 = Sampling(s.temperature, s.top_p, s.top_k, seed)
    return generate(eng, make_method(eng, "ar", CFG), ids, N_NEW, s1, eos).tokens


@pytest.fixture(scope="module")
def baselines(eng, prompts):
    """ar alone, per sampling: EOS is a token the first prompt's greedy output reaches early, so that
    request (and any other that meets it) stops before the token limit."""
    eos = [generate(eng, make_method(eng, "ar", CFG), prompts[0], N_NEW, GREEDY, ()).tokens[6]]
    out = {}
    for name, s in (("greedy", GREEDY), ("sampled", SAMPLED)):
        out[name] = [alone(eng, ids, s, eos, s.seed + i) for i, ids in enumerate(prompts)]
    return eos, out


@has_stdlib
@pytest.mark.parametrize("s", ["greedy", "sampled"])
@pytest.mark.parametrize("method", BATCH_METHODS)
def test_every_request_equals_ar_alone(eng, prompts, baselines, method, s):
    eos, base = baselines
    samp = GREEDY if s == "greedy" else SAMPLED
    assert any(len(b) < N_NEW for b in base[s])       # a request ends early, at an EOS
    for B in (1, 2, 3, 5):
        be = BatchEngine(eng, method, B, CFG)
        res = be.run(prompts, N_NEW, samp, eos, seeds=[samp.seed + i for i in range(len(prompts))])
        got = [r.tokens for r in res.requests]
        assert got == base[s], (method, B)
        assert [r.index for r in res.requests] == list(range(len(prompts)))
        assert len({r.rounds for r in res.requests}) > 1 or method == "ar"      # they end at different rounds
        assert res.rounds >= max(r.rounds for r in res.requests)


@has_stdlib
def test_one_new_token_and_a_full_stream(eng, prompts):
    """--max-new-tokens 1: every request ends at its prefill (the slot is refilled at once)."""
    res = BatchEngine(eng, "graft", 2, CFG).run(prompts, 1, GREEDY)
    assert [r.tokens for r in res.requests] == [generate(eng, make_method(eng, "ar"), x, 1, GREEDY, ()).tokens
                                               for x in prompts]
    assert res.rounds == 0


@has_stdlib
@pytest.mark.parametrize("method", ["eagle3", "graft"])
def test_a_request_does_not_depend_on_its_neighbours(eng, prompts, method):
    """Request 0 beside different neighbours, at B = 3: the same tokens, the same rounds, the same
    accepted tokens (its tree, matrix and head state are its own)."""
    be = BatchEngine(eng, method, 3, CFG)
    seen = []
    for others in ([1, 2], [3, 4], [5, 5], [2, 1]):
        res = be.run([prompts[0]] + [prompts[i] for i in others], N_NEW, SAMPLED)
        r = res.requests[0]
        seen.append((r.tokens, r.rounds, r.accepted))
    assert all(x == seen[0] for x in seen)


@has_stdlib
def test_graft_batch_variant_replaces_low_confidence_nodes(eng, prompts):
    """The trees keep N nodes; with thresholds that never fire the batch graft is eagle3 exactly; with
    thresholds it replaces some draft nodes by retrieved ones."""
    never = Config(budget=10, thresholds={0: 0.0, 1: 0.0, 5: 0.0})
    a = BatchEngine(eng, "graft", 2, never).run(prompts[:3], N_NEW, GREEDY)
    b = BatchEngine(eng, "eagle3", 2, never).run(prompts[:3], N_NEW, GREEDY)
    assert [r.rounds for r in a.requests] == [r.rounds for r in b.requests]
    assert sum(r.from_retrieval for r in a.requests) == 0
    be = BatchEngine(eng, "graft", 2, Config(budget=10, thresholds={0: 0.9, 1: 0.9, 5: 0.9}))
    c = be.run(prompts[:3], N_NEW, GREEDY)
    assert sum(r.from_retrieval for r in c.requests) > 0
    assert c.stats()["draft_forwards_per_round"] == eng.drafter.depth      # no per-request early stop


def test_graft_each_keeps_prefix_closed_trees():
    """Batched grafting: the kept nodes first, retrieved ones in the freed slots, merged duplicates,
    every parent before its child; per request a different number of free slots."""
    d_tok = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    d_par = torch.tensor([[-1, -1, 0, 2], [-1, -1, 0, 2]])
    kept = torch.tensor([[True, True, True, True], [True, False, True, False]])
    tpl = build_template((0.7, 0.3), 4)
    r_tok = torch.tensor([[9, 1, 2, 3], [7, 9, 4, 4]])          # request 1: 7 under node 0 merges
    anchor = torch.tensor([-1, 0])
    tok, par, val, ret = graft_each(d_tok, d_par, kept, r_tok, tpl, anchor)
    assert tok[0].tolist() == [5, 6, 7, 8] and val[0].all() and not ret[0].any()
    assert val[1].sum() == 4 and ret[1].tolist()[:2] == [False, False]
    for b in range(2):
        for i in range(4):
            assert par[b, i] < i
    mask, depth = tree_masks(par, val, 4)
    m1, d1 = tree_mask(par[1], val[1], 4)
    assert torch.equal(mask[1], m1) and torch.equal(depth[1], d1)


def test_bad_batch_arguments(eng):
    with pytest.raises(GraftError, match="--batch runs"):
        BatchEngine(eng, "prune", 2)
    with pytest.raises(GraftError, match=">= 1"):
        BatchEngine(eng, "ar", 0)


@has_stdlib
@pytest.mark.parametrize("method", ["graft", "pld"])
def test_full_attention_and_output_lifetimes(prompts, baselines, method):
    """Attention over the whole cache (static shapes: what CUDA graphs need), with every step output
    poisoned as it expires (the CUDA-graph contract's rule 1): still every request's ar tokens."""
    e = build_engine(STDLIB_CKPT, STDLIB_DRAFT, max_seq_len=256, attention="full", check_lifetimes=True)
    e.thresholds = {0: 0.3, 1: 0.2, 5: 0.05}
    eos, base = baselines
    res = BatchEngine(e, method, 2, CFG).run(prompts, N_NEW, SAMPLED, eos,
                                             seeds=[SAMPLED.seed + i for i in range(len(prompts))])
    assert [r.tokens for r in res.requests] == base["sampled"]


@has_stdlib
def test_generate_batch_prints_results_in_input_order(eng, prompts, tmp_path, capsys):
    import generate as GEN
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": t}) for t in TEXTS[:4]) + "\n")
    out = GEN.main(["--ckpt", STDLIB_CKPT, "--draft", STDLIB_DRAFT, "--prompts", str(f), "--batch", "3", "--method",
                    "graft", "--max-new-tokens", "12", "--warmup", "0", "--compare", "--json", "--budget", "8"])
    assert out["lossless"] is True and out["requests"] == 4
    for r, ids in zip(out["results"], prompts[:4]):
        assert r["tokens"] == generate(eng, make_method(eng, "ar"), ids, 12, GREEDY, eng.tokenizer.eos_ids).tokens
    assert "[graft, batch 3, eager]" in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [
    (["--batch", "2"], "go together"), (["--prompts", "x.txt"], "go together"),
    (["--prompts", "x.txt", "--batch", "0"], "--batch must be >= 1"),
    (["--prompts", "x.txt", "--batch", "2", "--method", "prune"], "--batch runs the methods"),
    (["--prompts", "x.txt", "--batch", "2", "--prompt", "hi"], "not both"),
    (["--prompts", "/nonexistent/p.txt", "--batch", "2"], "p.txt")])
def test_generate_batch_bad_flags_before_loading(argv, msg, monkeypatch):
    import generate as GEN
    monkeypatch.setattr(GEN, "build_engine", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(GraftError, match=msg):
        GEN.main(argv)


@pytest.mark.parametrize("argv, msg", [
    (["--batch", "0"], "batch sizes >= 1"), (["--batch", "a,b"], "comma-separated"),
    (["--batch", "2", "--methods", "ar,prune"], "--batch runs the methods"),
    (["--batch", "2", "--budgets", "8,16"], "one budget")])
def test_bench_batch_bad_flags_before_loading(argv, msg, monkeypatch):
    import bench
    monkeypatch.setattr(bench.CLI, "build_engine", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(GraftError, match=msg):
        bench.main(["--ckpt", STDLIB_CKPT, "--draft", STDLIB_DRAFT, "--datasets", "stdlib"] + argv)


@has_stdlib
def test_bench_batch_reports_every_method_and_size(tmp_path, capsys):
    import bench
    f = tmp_path / "p.txt"
    f.write_text("\n".join(t.replace("\n", " ") for t in TEXTS[:3]) + "\n")
    rep = bench.main(["--ckpt", STDLIB_CKPT, "--draft", STDLIB_DRAFT, "--datasets", str(f), "--batch", "1,2",
                      "--methods", "eagle3,graft,pld", "--max-new-tokens", "10", "--warmup", "0", "--budget", "8",
                      "--json-out", str(tmp_path / "r.json")])
    rows = rep["rows"]
    assert {(r["method"], r["batch"]) for r in rows} == {(m, b) for m in ("ar", "eagle3", "graft", "pld") for b in (1, 2)}
    assert all(r["lossless"] for r in rows) and not rep["meta"]["mismatches"]
    for r in rows:
        assert {"tokens_per_s", "latency_median_s", "latency_p90_s", "mat", "draft_forwards_per_round"} <= set(r)
    assert set(rep["meta"]["graft_over_eagle3"]) == {f"p.txt batch {b}" for b in (1, 2)}
    assert set(rep["meta"]["pass_ms"]) == {"1", "2"}
    out = capsys.readouterr().out
    assert "| p.txt | 2 | graft |" in out and "graft over eagle3" in out and json.loads((tmp_path / "r.json").read_text())


COMPILE_CHECK = """
import json, sys, torch
sys.path.insert(0, {root!r}); torch.set_num_threads(1)
from torch._dynamo.utils import counters
from batch import BatchEngine
from cli import build_engine
from data import STDLIB_CKPT, STDLIB_DRAFT
from graft import Config
from verify import Sampling
cfg = Config(budget=8, recycle_size=16, thresholds={{0: 0.3, 1: 0.2, 5: 0.05}})
eager = build_engine(STDLIB_CKPT, STDLIB_DRAFT, max_seq_len=192)
comp = build_engine(STDLIB_CKPT, STDLIB_DRAFT, max_seq_len=192, compile=True, backend="aot_eager")
enc = eager.tokenizer.encode
first = [enc("def f(x):\\n"), enc("import os\\n"), enc("class A:\\n    pass\\n")]
later = [enc("x = 1\\n" * 12), enc("y"), enc("def g(a, b):\\n    return a"), enc("for i in range(3):\\n"), enc("z = 2")]
out = {{}}
for m in ("ar", "graft", "recycle", "pld"):
    be, ref = BatchEngine(comp, m, 2, cfg), BatchEngine(eager, m, 2, cfg)
    be.run(first, 12, Sampling(), ())
    before = counters["stats"]["unique_graphs"]
    got = be.run(later, 16, Sampling(), ())
    out[m] = dict(new_graphs=counters["stats"]["unique_graphs"] - before,
                  same=[r.tokens for r in got.requests] == [r.tokens for r in ref.run(later, 16, Sampling(), ()).requests])
print(json.dumps(out))
"""


@has_stdlib
def test_compiled_steps_do_not_recompile_as_requests_come_and_go():
    """aot_eager (dynamo tracing, fullgraph): after a first stream at B = 2, a second stream with other
    prompt lengths, more prompts than slots and refills compiles no new graph, and gives the eager
    batch's tokens."""
    out = subprocess.run([sys.executable, "-c", COMPILE_CHECK.format(root=str(ROOT))], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for m, r in got.items():
        assert r == {"new_graphs": 0, "same": True}, (m, r)
