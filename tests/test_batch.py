"""Batches: one engine with B request slots, each request lossless on its own.

A single request is a batch of one: the engine that serves B = 1 serves B = 5, through the same steps.
On the demo pair (checkpoints/stdlib-qwen3 and its EAGLE-3 head: small, and it accepts many tokens a
round, so acceptance, compaction and refills all happen often) every method, prune and graft under
both pruning policies, at B = 1, 2, 3 and 5: every request's tokens equal the same prompt run alone
with `ar` and its seed (greedy, and sampled with per-request temperature/top-p/top-k), over prompts of
different lengths (one of two prefill chunks), more prompts than slots, and requests that end at an
EOS and at the token limit. A request's tokens, rounds and accepted tokens do not depend on its
neighbours; the host's mirrors of every slot follow the device; caches are allocated once; the faces
(generate.py --prompts --batch, bench.py --batch) keep their meaning. The compiled steps' "no
recompile as requests come and go" check runs in tests/compile_check.py (test_engine.py reads it).
"""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import engine as E
import graft as GR
from cli import build_engine
from conftest import NO_BLOCK
from data import STDLIB_CKPT, STDLIB_DRAFT, STDLIB_PROMPT
from engine import METHODS, Request, generate, make_method
from graft import Config, build_template, graft_trees
from model import GraftError
from verify import Sampling, tree_mask

GREEDY = Sampling()
CFG = Config(budget=10, recycle_size=24, thresholds={0: 0.3, 1: 0.15, 5: 0.01})   # every stage fires on this pair
TEXTS = [STDLIB_PROMPT, "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
         "def add(a, b):\n    return", "for i in range(10):\n    print(i)\n" * 3, "x",
         STDLIB_PROMPT * 4]                  # 160 tokens: two prefill chunks into its slot
N_NEW = 16
BATCHES = (1, 2, 3, 5)

has_stdlib = pytest.mark.skipif(not (Path(STDLIB_CKPT) / "model.safetensors").is_file(), reason="no demo pair")


def sampling(kind: str, i: int) -> Sampling:
    """Request i's sampling: greedy, or (sampled) top-p, top-k, both or greedy in turn, seed 1234 + i
    (a sampled batch holds greedy requests too)."""
    if kind == "greedy":
        return GREEDY
    kinds = [Sampling(0.8, 0.9, 0), Sampling(1.0, 1.0, 20), Sampling(0.7, 0.8, 30), Sampling()]
    return dataclasses.replace(kinds[i % 4], seed=1234 + i)


@pytest.fixture(scope="module")
def engines():
    return {B: build_engine(STDLIB_CKPT, STDLIB_DRAFT, max_seq_len=256, batch=B) for B in BATCHES}


@pytest.fixture(scope="module")
def prompts(engines):
    return [engines[1].tokenizer.encode(t) for t in TEXTS]


def requests(prompts, kind: str) -> list:
    return [Request(ids, sampling(kind, i), i) for i, ids in enumerate(prompts)]


def alone(eng, r: Request, n: int = N_NEW, eos=()) -> list:
    return generate(eng, make_method(eng, "ar"), r.ids, n, r.sampling, eos).tokens


@pytest.fixture(scope="module")
def baselines(engines, prompts):
    """ar alone, per sampling: EOS is a token the first prompt's greedy output reaches early, so that
    request (and any other that meets it) stops before the token limit."""
    eng = engines[1]
    eos = [alone(eng, Request(prompts[0]))[6]]
    out = {kind: [alone(eng, r, N_NEW, eos) for r in requests(prompts, kind)] for kind in ("sampled",)}
    return eos, out


CASES = [(m, None) for m in NO_BLOCK] + [(m, p) for m in ("prune", "graft") for p in GR.POLICIES]


@has_stdlib
@pytest.mark.parametrize("method, policy", CASES, ids=[m + (f"-{p}" if p else "") for m, p in CASES])
def test_every_request_equals_ar_alone(engines, prompts, baselines, method, policy):
    """Greedy and sampled requests side by side (the sampled stream holds both), at every B."""
    eos, base = baselines
    kind = "sampled"
    assert any(len(b) < N_NEW for b in base[kind]) and any(len(b) == N_NEW for b in base[kind])
    for B in BATCHES:
        eng = engines[B]
        res = E.run(eng, eng.make(method, dataclasses.replace(CFG, policy=policy)), requests(prompts, kind), N_NEW, eos)
        assert [r.tokens for r in res.requests] == base[kind], (method, policy, B)
        assert [r.index for r in res.requests] == list(range(len(prompts)))
        assert len({r.rounds for r in res.requests}) > 1 or method == "ar"      # they end at different rounds
        assert res.rounds >= max(r.rounds for r in res.requests)
        if method in ("eagle3", "graft"):
            assert res.stats()["mat"] > 1.5                      # long paths accepted: compaction in every slot


@has_stdlib
def test_one_new_token_ends_every_request_at_its_prefill(engines, prompts):
    """--max-new-tokens 1: every request ends at its prefill (the slot is refilled at once), no round."""
    eng = engines[2]
    res = E.run(eng, eng.make("graft", CFG), [Request(x) for x in prompts], 1)
    assert [r.tokens for r in res.requests] == [alone(engines[1], Request(x), 1) for x in prompts]
    assert res.rounds == 0 and all(r.rounds == 0 for r in res.requests)


@has_stdlib
@pytest.mark.parametrize("method", ["ar", "graft", "pld", "recycle"])
def test_a_request_that_joins_a_round_is_the_request_alone(engines, prompts, baselines, method, monkeypatch):
    """A slot freed while others run: its next request is prefilled in the round's pass (Engine.join),
    beside the others' plain steps. Requests of different limits (1: it ends at its first token) so that
    slots free apart: rounds are joined, and every request's tokens (greedy and sampled) are its tokens
    alone; an unpaced method (--no-pace) never joins (its rounds all draft)."""
    joined = []
    real = E.Engine.join
    monkeypatch.setattr(E.Engine, "join", lambda eng, m, pairs: joined.append(len(pairs)) or real(eng, m, pairs))
    eos, base = baselines
    eng, one = engines[3], engines[1]
    for kind in ("greedy", "sampled"):
        reqs = requests(prompts[:6], kind)
        for i, r in enumerate(reqs):
            r.max_new_tokens = [N_NEW, 5, 1, 9, N_NEW, 3][i]
        want = [alone(one, r, r.max_new_tokens) for r in reqs]
        res = E.run(eng, eng.make(method, dataclasses.replace(CFG, pace=True)), reqs, N_NEW)
        assert [r.tokens for r in res.requests] == want, (method, kind)
        assert joined and all(r.first_s > 0 for r in res.requests)
    joined.clear()
    E.run(eng, eng.make(method, dataclasses.replace(CFG, pace=False)), requests(prompts[:6], "greedy"), 4)
    assert not joined or method == "ar"


@has_stdlib
@pytest.mark.parametrize("method, policy", [("eagle3", None), ("graft", "replace"), ("graft", "stop"),
                                            ("prune", "stop"), ("recycle", None), ("pld", None)])
def test_a_request_does_not_depend_on_its_neighbours(engines, prompts, method, policy):
    """Request 0 beside different neighbours, at B = 3: the same tokens, the same rounds, the same
    accepted and retrieved tokens (its tree, its matrix, its head rows and its seed are its own)."""
    eng, seen = engines[3], []
    for others in ([1, 2], [3, 4], [5, 5], [2, 1, 6, 4]):
        m = eng.make(method, dataclasses.replace(CFG, policy=policy), matrix=eng.matrix.copy())
        reqs = [Request(prompts[0], sampling("sampled", 0), 0)] + [Request(prompts[i], sampling("sampled", i), i)
                                                                  for i in others]
        r = E.run(eng, m, reqs, N_NEW).requests[0]
        seen.append((r.tokens, r.rounds, r.accepted, r.from_retrieval))
    assert all(x == seen[0] for x in seen), method


@has_stdlib
def test_replace_policy_replaces_low_confidence_nodes(engines, prompts):
    """The trees keep N nodes and drafting never stops early; with thresholds that never fire, graft's
    replace policy is eagle3 exactly; with high ones it replaces draft nodes by retrieved ones."""
    eng = engines[2]
    never = Config(budget=10, thresholds={0: 0.0, 1: 0.0, 5: 0.0}, policy="replace")
    reqs = lambda: [Request(x) for x in prompts[:4]]
    a = E.run(eng, eng.make("graft", never), reqs(), N_NEW)
    b = E.run(eng, eng.make("eagle3", never), reqs(), N_NEW)
    assert [r.rounds for r in a.requests] == [r.rounds for r in b.requests]
    assert [r.accepted for r in a.requests] == [r.accepted for r in b.requests]
    assert sum(r.from_retrieval for r in a.requests) == 0
    high = Config(budget=10, thresholds={0: 0.9, 1: 0.9, 5: 0.9}, policy="replace")
    c = E.run(eng, eng.make("graft", high), reqs(), N_NEW)
    assert sum(r.from_retrieval for r in c.requests) > 0
    assert c.stats()["draft_forwards_per_round"] == eng.drafter.depth      # no per-request early stop
    assert all(set(r.stages) == {None} for r in c.requests)


@has_stdlib
def test_stop_policy_at_a_batch_stops_when_every_request_has(engines, prompts):
    """The stop policy at B = 3: a round drafts until its last request stops, each request's tree is
    cut at its own checkpoint, and every stage occurs."""
    eng = engines[3]
    rounds = []
    res = E.run(eng, eng.make("graft", dataclasses.replace(CFG, policy="stop")), [Request(x) for x in prompts], N_NEW,
                on_round=lambda rnd, c: rounds.append((rnd.forwards, [s for s, x in zip(rnd.stages, c) if x])))
    order = {0: 1, 1: 2, 5: 6, None: eng.drafter.depth}          # draft forwards to reach each stage
    for forwards, stages in rounds:
        assert forwards == max(order[s] for s in stages), (forwards, stages)
    assert {s for r in res.requests for s in r.stages} == {0, 1, 5, None}


@has_stdlib
@pytest.mark.parametrize("method", ["eagle3", "graft", "recycle", "pld"])
def test_host_mirrors_follow_the_device(engines, prompts, method):
    """After every round, each slot's host copies (committed rows, head rows) equal the device's."""
    eng, bad = engines[3], []

    def check(rnd, commits):          # (before the round's tokens reach the request: its last one is the root)
        for b, (s, c) in enumerate(zip(eng.slots, commits)):
            if c is not None:
                dev = (int(eng.L[b]), int(eng.drafter.Ld[b]) if METHODS[method].needs_head else s.Ld)
                if (s.L, s.Ld) != dev or s.L != len(s.request.ids) + len(s.request.tokens) + len(c[0]):
                    bad.append((b, s.L, s.Ld, dev))
    E.run(eng, eng.make(method, CFG), [Request(x) for x in prompts], N_NEW, on_round=check)
    assert bad == []


@has_stdlib
def test_caches_are_allocated_once(engines, prompts):
    """Making every method and running it never reallocates a cache (they are sized for the largest
    tree any configured method needs when the engine is built)."""
    eng = engines[2]
    ptrs = lambda: [t.data_ptr() for t in eng.cache.tensors() + eng.drafter.cache.tensors()]
    before = ptrs()
    for m in NO_BLOCK:
        E.run(eng, eng.make(m, Config(budget=60)), [Request(x) for x in prompts[:3]], 4)
    assert ptrs() == before


def test_graft_trees_keeps_prefix_closed_trees():
    """Grafting, per request: the kept nodes first, retrieved ones in the freed slots (free[b] of them),
    merged duplicates, every parent before its child."""
    d_tok = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    d_par = torch.tensor([[-1, -1, 0, 2], [-1, -1, 0, 2]])
    kept = torch.tensor([[True, True, True, True], [True, False, True, False]])
    tpl = build_template((0.7, 0.3), 4)                         # rank 0 chain of 3 under the anchor, rank 1 beside
    r_tok = torch.tensor([[9, 1, 2, 3], [7, 9, 4, 4]])          # request 1: 7 under node 0 merges
    tok, par, val, ret = graft_trees(d_tok, d_par, kept, r_tok, tpl, torch.tensor([-1, 0]), torch.tensor([0, 2]))
    assert tok[0].tolist() == [5, 6, 7, 8] and val[0].all() and not ret[0].any()
    assert tok[1].tolist() == [5, 7, 9, 4] and par[1].tolist() == [-1, 0, 1, 2]
    assert val[1].all() and ret[1].tolist() == [False, False, True, True]
    assert all(par[b, i] < i for b in range(2) for i in range(4))
    mask, depth = tree_mask(par, val, 4)
    for b in range(2):                                          # a batch of two is two batches of one
        m1, d1 = tree_mask(par[b:b + 1], val[b:b + 1], 4)
        assert torch.equal(mask[b:b + 1], m1) and torch.equal(depth[b:b + 1], d1)


@has_stdlib
def test_bad_batch_arguments(engines):
    with pytest.raises(GraftError, match="--batch must be"):
        build_engine(STDLIB_CKPT, STDLIB_DRAFT, batch=0)
    with pytest.raises(GraftError, match="needs .* GiB of caches"):      # refused before any cache exists
        build_engine(STDLIB_CKPT, STDLIB_DRAFT, max_seq_len=2048, batch=10 ** 7)
    with pytest.raises(GraftError, match="unknown method"):
        engines[2].make("graft2")
    small = build_engine(STDLIB_CKPT, STDLIB_DRAFT, max_seq_len=64, batch=2, methods=[("eagle3", Config(budget=8))])
    with pytest.raises(GraftError, match="does not fit"):
        small.make("graft", Config(budget=60))
    with pytest.raises(GraftError, match="needs an EAGLE-3 head"):
        build_engine(STDLIB_CKPT, max_seq_len=64, batch=2).make("graft")


@has_stdlib
@pytest.mark.parametrize("method", ["graft", "pld"])
def test_full_attention_and_output_lifetimes(prompts, baselines, method):
    """Attention over the whole cache (static shapes: what CUDA graphs need), with every step output
    poisoned as it expires (the CUDA-graph contract's rule 1): still every request's ar tokens."""
    e = build_engine(STDLIB_CKPT, STDLIB_DRAFT, max_seq_len=256, attention="full", check_lifetimes=True, batch=2)
    eos, base = baselines
    res = E.run(e, e.make(method, CFG), requests(prompts, "sampled"), N_NEW, eos)
    assert [r.tokens for r in res.requests] == base["sampled"]


# ----------------------------------------------------------------------------- the faces

@has_stdlib
def test_generate_batch_prints_results_in_input_order(engines, prompts, tmp_path, capsys):
    import generate as GEN
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": t}) for t in TEXTS[:4]) + "\n")
    out = GEN.main(["--ckpt", STDLIB_CKPT, "--draft", STDLIB_DRAFT, "--prompts", str(f), "--batch", "3", "--method",
                    "graft", "--max-new-tokens", "12", "--warmup", "0", "--compare", "--json", "--budget", "8"])
    assert out["lossless"] is True and out["requests"] == 4 and out["batch"] == 3
    eng = engines[1]
    for r, ids in zip(out["results"], prompts[:4]):
        assert r["tokens"] == generate(eng, make_method(eng, "ar"), ids, 12, GREEDY, eng.tokenizer.eos_ids).tokens
    assert "[graft, batch 3, eager]" in capsys.readouterr().err


@has_stdlib
def test_generate_batch_gives_each_request_its_own_seed(engines, tmp_path, capsys):
    """Four copies of one prompt at temperature 1: request i samples with --seed + i, so four outputs,
    each what the prompt draws alone with that seed; --batch above the prompts runs as many slots."""
    import generate as GEN
    f = tmp_path / "p.txt"
    f.write_text("\n".join(["class Stack:"] * 4) + "\n")
    out = GEN.main(["--ckpt", STDLIB_CKPT, "--draft", STDLIB_DRAFT, "--prompts", str(f), "--batch", "8", "--method",
                    "prune", "--max-new-tokens", "12", "--warmup", "0", "--json", "--budget", "8",
                    "--temperature", "1", "--seed", "5"])
    assert out["batch"] == 4
    eng = engines[1]
    ids = eng.tokenizer.encode("class Stack:")
    want = [generate(eng, make_method(eng, "ar"), ids, 12, Sampling(temperature=1.0, seed=5 + i),
                     eng.tokenizer.eos_ids).tokens for i in range(4)]
    assert [r["tokens"] for r in out["results"]] == want and len({tuple(w) for w in want}) == 4


@pytest.mark.parametrize("argv, msg", [
    (["--batch", "2"], "go together"), (["--prompts", "x.txt"], "go together"),
    (["--prompts", "x.txt", "--batch", "0"], "--batch must be >= 1"),
    (["--prompts", "x.txt", "--batch", "2", "--prompt", "hi"], "not both"),
    (["--prompts", "x.txt", "--batch", "2", "--show-tree"], "--show-tree"),
    (["--prompts", "/nonexistent/p.txt", "--batch", "2"], "p.txt")])
def test_generate_batch_bad_flags_before_loading(argv, msg, monkeypatch):
    import api
    import generate as GEN
    monkeypatch.setattr(api, "build_engine", lambda *a, **k: pytest.fail("loaded a model"))   # generate builds through api
    with pytest.raises(GraftError, match=msg):
        GEN.main(argv)


@pytest.mark.parametrize("argv, msg", [
    (["--batch", "0"], "batch sizes >= 1"), (["--batch", "a,b"], "comma-separated"),
    (["--batch", "2", "--budgets", "8,16"], "one budget")])
def test_bench_batch_bad_flags_before_loading(argv, msg, monkeypatch):
    import bench
    monkeypatch.setattr(bench.CLI, "build_engine", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(GraftError, match=msg):
        bench.main(["--ckpt", STDLIB_CKPT, "--draft", STDLIB_DRAFT, "--datasets", "stdlib"] + argv)


@has_stdlib
def test_bench_batch_reports_every_method_and_size(tmp_path, capsys):
    """bench.py --batch: every method (prune too: every method runs at every B), lossless, at each size."""
    import bench
    f = tmp_path / "p.txt"
    f.write_text("\n".join(t.replace("\n", " ") for t in TEXTS[:3]) + "\n")
    rep = bench.main(["--ckpt", STDLIB_CKPT, "--draft", STDLIB_DRAFT, "--datasets", str(f), "--batch", "1,2",
                      "--methods", "eagle3,prune,graft,pld", "--max-new-tokens", "10", "--warmup", "0", "--budget", "8",
                      "--json-out", str(tmp_path / "r.json")])
    rows = rep["rows"]
    assert {(r["method"], r["batch"]) for r in rows} == {(m, b) for m in ("ar", "eagle3", "prune", "graft", "pld")
                                                         for b in (1, 2)}
    assert all(r["lossless"] for r in rows) and not rep["meta"]["mismatches"]
    assert all(r["requests"] == 3 * bench.BATCH_STREAMS for r in rows)     # each stream run, interleaved, totalled
    for r in rows:
        assert {"tokens_per_s", "latency_median_s", "latency_p90_s", "mat", "draft_forwards_per_round"} <= set(r)
    assert set(rep["meta"]["graft_over_eagle3"]) == {f"p.txt batch {b}" for b in (1, 2)}
    out = capsys.readouterr().out
    assert "| p.txt | 2 | graft |" in out and "graft over eagle3" in out and json.loads((tmp_path / "r.json").read_text())


@has_stdlib
def test_bench_batch_calibrates_at_each_batch_size(tmp_path, monkeypatch):
    """bench.py --batch with a warm-up: each B > 1 warms up on its own engine (the budget that pays
    depends on B, as a server with B slots calibrates), into a matrix of its own (not the B = 1
    engine's); every row lossless, each B's budget reported and its trees no larger."""
    import bench
    import calibrate as CAL
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "cache"))
    seen, real = [], CAL.warm_up

    def warm_up(engine, *args, **kwargs):
        seen.append((engine.B, engine.matrix))
        return real(engine, *args, **kwargs)
    monkeypatch.setattr(CAL, "warm_up", warm_up)
    f = tmp_path / "p.txt"
    f.write_text("\n".join(t.replace("\n", " ") for t in TEXTS[:3]) + "\n")
    rep = bench.main(["--ckpt", STDLIB_CKPT, "--draft", STDLIB_DRAFT, "--datasets", str(f), "--batch", "1,2",
                      "--methods", "graft", "--max-new-tokens", "10", "--warmup", "1", "--json-out", str(tmp_path / "r.json")])
    assert [b for b, _ in seen] == [1, 2] and seen[0][1] is not seen[1][1]
    assert set(rep["meta"]["budgets"]) == {"1", "2"} and all(n >= 1 for n in rep["meta"]["budgets"].values())
    assert all(r["lossless"] for r in rep["rows"]) and not rep["meta"]["mismatches"]
    graft2 = [r for r in rep["rows"] if r["method"] == "graft" and r["batch"] == 2]
    assert graft2 and graft2[0]["nodes"] <= 1 + rep["meta"]["budgets"]["2"]
