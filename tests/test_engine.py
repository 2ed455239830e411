"""The compiled engine: static-shaped steps give the eager engine's tokens, compile once, and stay
within their shapes.

Compiling takes 15-40 s a graph on this CPU with inductor, and seconds with torch.compile's aot_eager
backend (the same dynamo tracing, fullgraph, and functionalised cache writes, without code generation).
So the compiled runs happen in tests/compile_check.py, a subprocess started when the suite starts
(conftest), on the second core; the `test_compiled_*` tests read its results and run last.
"""
import dataclasses
import subprocess
import sys

import pytest
import torch

import cli as CLI
import calibrate as CAL
import engine as E
import graft as GR
import verify as V
from conftest import NO_BLOCK, ROOT, compile_result
from test_lossless import random_head
from verify import Sampling

GREEDY = Sampling()
SAMPLED = Sampling(temperature=0.8, top_p=0.9, seed=1234)


# ----------------------------------------------------------------------------- compiled against eager

@pytest.mark.parametrize("method", NO_BLOCK)
def test_compiled_equals_eager_every_method(method):
    """A tiny random Llama and head, compiled (aot_eager) and eager: the same tokens, two prompts,
    sampled (greedy, every method: test_compiled_outputs_are_never_read_after_they_expire)."""
    assert compile_result("every_method")[method]["sampled"]


@pytest.mark.parametrize("s", ["greedy", "sampled"])
def test_compiled_equals_eager_demo_pair(s):
    assert compile_result("demo")["graft"][s]


def test_compiled_rounds_never_recompile_after_warmup():
    """After compile_warmup (every stage forced once), rounds at other prompt and context lengths
    compile nothing: the committed length is data, the key length a dynamic dimension."""
    assert compile_result("recompiles")["graphs_after_warmup"] == 0


def test_compiled_warmup_records_what_eager_records():
    """The calibration warm-up on a compiled engine runs past dynamo's recompile limit (its records
    live outside the compiled steps) and gives the eager warm-up's Youden thresholds, hit rates and
    matrix."""
    got = compile_result("warmup")
    assert {k: got[k] for k in ("youden", "hit_rates", "matrix")} == {"youden": True, "hit_rates": True, "matrix": True}


def test_compiled_auto_budget_warmup_compiles_a_constant_number_of_graphs():
    """--budget auto prices 6 budgets here: the warm-up's dense tree and one graft instance make the
    assemble graphs (2, not one per budget), one verify graph per path length serves every size,
    and every other step compiles once or twice (prefill: with and without features), the plain
    rounds a pacer takes included (plain_learn). Compiled, the budgets under 8 are not priced
    (calibrate.auto_budgets: each would add graphs)."""
    got = compile_result("warmup")
    assert got["budgets"] == [8, 12, 16, 24, 32, 48]
    assert got["graphs"]["assemble"] == 2 and got["graphs"]["plain_learn"] == 1, got["graphs"]
    assert sum(got["graphs"].values()) <= 14, got["graphs"]


def test_compiled_with_inductor_equals_eager():
    """The real CPU backend on the tiny model: ar and graft-naive-root (every kind of step), greedy; no
    graph compiled after warm-up."""
    got = compile_result("inductor")
    assert got["same"] == {"ar": True, "graft-naive-root": True} and got["graphs_after_warmup"] == 0


def test_compiled_gpu_check_runs_tiny():
    """scripts/gpu_check.py --tiny --time-limit 420: the GPU check's own code end to end, in one call
    within the limit, every section in its own process and within its share, in the plan's order,
    every field of its report; the engine section compiled exactly the graphs the plan names."""
    import compile_check as CC
    r = compile_result("gpu_check")
    assert r["returncode"] == 0, r["stdout"] + r["stderr"]
    s = r["summary"]
    assert s["complete"] and s["wall_seconds"] <= CC.GPU_CHECK_LIMIT and r["seconds"] <= CC.GPU_CHECK_LIMIT
    sec = s["sections"]
    assert list(sec) == ["env", "placement", "engine", "lossless", "speed", "peer"]
    assert all(v["ok"] and v["seconds"] <= v["limit"] for v in sec.values()), {k: v["why"] for k, v in sec.items()}
    assert r["stdout"].rstrip().splitlines()[-1].startswith("  (every number:")       # the plain summary, last
    env = sec["env"]["result"]
    assert set(env["sdpa_kernel"]) == {"decode", "verify_61", "prefill_128"} and env["cache_rows"] % 16 == 0
    assert all(not v["failed"] and not v["missing"] and v["runs"] > 20 for v in sec["placement"]["result"].values())
    eng = sec["engine"]["result"]
    assert eng["first_pass"]["dynamo_graphs"] == eng["graphs_planned"] == 9 and eng["first_pass"]["cudagraph_skips"] == 0
    assert not any(eng["second_pass_new"].values())
    assert eng["stages"]["graft@stage0"].keys() == {"0"} and eng["stages"]["graft@full"].keys() == {"None"}
    assert sec["lossless"]["result"]["same"] and all(sec["lossless"]["result"]["same"].values())
    speed = sec["speed"]["result"]
    assert speed["decode"]["ms_per_token"] > 0 and speed["verify_61"]["ms"] > 0 and speed["graphs"]["dynamo_graphs"] == 2
    assert speed["ar_generate"]["tokens"] == 16
    assert all(sec["peer"]["result"][k]["ms_per_token"] > 0 for k in ("eager", "static_compiled"))


@pytest.mark.parametrize("s", ["greedy", "sampled"])
@pytest.mark.parametrize("method", NO_BLOCK)
def test_compiled_outputs_are_never_read_after_they_expire(method, s):
    """Every method compiled (aot_eager), each step output poisoned as soon as a CUDA graph's next
    generation or replay would overwrite it: still the eager engine's tokens (three prompts, one of
    three prefill chunks)."""
    assert compile_result("lifetimes")[method][s]


def test_compiled_verify_serves_every_budget():
    """--budget auto times a verify pass at every budget it prices compiled (calibrate.auto_budgets): the tree size is dynamic, so
    they share the graph of their path length (budget 8's 9-node trees hold paths of 9, the rest 10):
    one graph more after the first, not one per budget."""
    assert compile_result("one_verify_graph") == {"new_graphs": 1}


def test_compiled_steps_read_only_static_state():
    """Every tensor a compiled step reads on two calls or more (the same object: RoPE tables, the
    column indices, the token hash, templates, caches) is declared static or is a parameter or buffer;
    on a GPU anything else is copied into the graph on every replay. One request, and two slots."""
    assert compile_result("statics") == {"window": [], "full": [], "window@2": []}


def test_compiled_statics_check_sees_a_buffer_two_instances_share():
    """A method's buffer left out of its tensors() (graft's thresholds on the device), with two graft
    instances whose graphs are shared: the check above reports it; a check wanting the tensor in
    every call of a graph would not (the two instances' buffers alternate)."""
    got = compile_result("statics_shared")
    assert got["flagged"] == [got["taus"]] and got["flagged_if_in_every_call"] == []


def test_statics_rule():
    """The rule itself, on recorded calls: a tensor at one position of one graph in two calls or more
    and not known is reported; a new tensor each call is not; a known one is not."""
    import compile_check as CC
    a, b, new = torch.zeros(3), torch.ones(2), lambda: torch.zeros(4)
    calls = {0: [[a, new()], [b, new()], [a, new()], [b, new()]], 1: [[new()]]}
    assert CC.unstated(calls, set()) == ["(2,) torch.float32", "(3,) torch.float32"]
    assert CC.unstated(calls, set(), every=True) == []
    assert CC.unstated(calls, {id(a), id(b)}) == []


@pytest.mark.parametrize("method", NO_BLOCK + ["graft-stop", "prune-stop"])
def test_compiled_batch_never_recompiles_as_requests_come_and_go(method):
    """B = 2, aot_eager, full attention, every step output poisoned as it expires: after a first
    stream, a second with other prompt lengths, more prompts than slots and other seeds and
    temperatures compiles no new graph, and every request's tokens are its prompt's alone."""
    assert compile_result("batch")[method] == {"new_graphs": 0, "same": True}


# ----------------------------------------------------------------------------- prefill in chunks

class Keep(GR.Method):
    """A method that keeps what the prefill passes give it (each chunk's logits: its last real row's, or
    all its real rows' for a request that asks for its prompt's log-probs)."""
    needs_head = True                   # the prefill step captures features too

    def __init__(self, eng):
        super().__init__(eng, GR.Config())
        self.chunks = []

    def prompt_chunk(self, eng, b, ids, logits, feats, n):
        self.chunks.append(logits[0, :n].clone() if logits.shape[1] > 1 else logits[0].clone())


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("every", [False, True], ids=["last-rows", "prompt-logprobs"])
def test_chunked_prefill_gives_the_logits_of_one_pass(tiny_ckpt, batch, every):
    """A 53-token prompt in chunks of 16 into the last slot, beside a request in slot 0: the logits of
    one causal pass (each chunk's last real row's; every row's when the request asks for its prompt's
    log-probs), its first token in root, its committed length in L (device and host), and the other
    slot's rows, length and root untouched."""
    eng = CLI.build_engine(str(tiny_ckpt("qwen3")), max_seq_len=200, chunk=16, batch=batch)
    ids = torch.randint(3, 300, (53,), generator=torch.Generator().manual_seed(0)).tolist()
    full = eng.model(torch.tensor([ids]), torch.arange(53))[0]              # causal, no cache
    b = batch - 1
    if batch > 1:
        eng.admit(0, E.Request([1, 7, 9, 11]), eng.make("ar"))
        rows, L0, root0 = [t[0].clone() for t in eng.cache.tensors()], int(eng.L[0]), int(eng.root[0])
    m = Keep(eng)
    first = eng.admit(b, E.Request(ids, logprobs=1 if every else None, prompt_logprobs=every), m)
    got, want = torch.cat(m.chunks), full if every else full[[15, 31, 47, 52]]
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert first == int(eng.root[b]) == int(full[-1].argmax()) and eng.slots[b].L == int(eng.L[b]) == 53
    if batch > 1:
        assert all(torch.equal(t[0], r) for t, r in zip(eng.cache.tensors(), rows))
        assert (int(eng.L[0]), int(eng.root[0])) == (L0, root0)


def test_a_group_prefill_gives_each_request_the_log_probs_it_asks_for(tiny_ckpt):
    """Three prompts in one pass (Engine.admit_group): one asks for its prompt's log-probs (every row's
    logits), one for its first token's only, one for none. Each gets what admitting it alone gives, and
    each log-probability is the full causal pass's."""
    eng = CLI.build_engine(str(tiny_ckpt("qwen3")), max_seq_len=64, batch=3)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 14, 5)]
    asks = [dict(logprobs=2, prompt_logprobs=True), dict(logprobs=1), {}]
    group = [E.Request(x, **a) for x, a in zip(ids, asks)]
    eng.admit_group(list(enumerate(group)), eng.make("ar"))
    for b in range(3):
        eng.free(b, eng.make("ar"))
    for x, a, r in zip(ids, asks, group):
        alone = E.Request(x, **a)
        eng.admit(0, alone, eng.make("ar"))
        eng.free(0, eng.make("ar"))
        assert r.tokens == alone.tokens and len(r.prompt_logprob_rows) == (len(x) - 1 if a.get("prompt_logprobs") else 0)
        for got, want in [(r.prompt_logprob_rows, alone.prompt_logprob_rows), (r.logprob_rows, alone.logprob_rows)]:
            assert len(got) == len(want) and all(abs(u[0] - v[0]) < 1e-5 and [t for t, _ in u[1]] == [t for t, _ in v[1]]
                                                 for u, v in zip(got, want))
        with torch.no_grad():
            full = torch.log_softmax(eng.model(torch.tensor([x]), torch.arange(len(x)))[0].float(), -1)   # (T, V)
        chosen = x[1:] + r.tokens[:1]
        rows = r.prompt_logprob_rows + r.logprob_rows
        first = len(x) - len(rows)                    # the rows asked for: the last one, or all after the first
        assert all(abs(row[0] - float(full[first + i, t])) < 1e-4 for i, (row, t) in enumerate(zip(rows, chosen[first:])))
        assert r.tokens[0] == int(full[-1].argmax())


def test_long_prompt_prefills_in_bounded_memory(tmp_path):
    """A 16K-token prompt on a tiny model with a 32K context: chunks keep the attention at (C, L), not
    (L, L). A dense (16K, 16K) mask and bias alone would take 1.3 GB, and the scores 4 GB more."""
    from conftest import make_tiny_model
    ck = make_tiny_model(tmp_path / "long", "llama2", num_hidden_layers=2, max_position_embeddings=32768)
    code = (f"import sys, resource, torch; sys.path.insert(0, {str(ROOT)!r}); torch.set_num_threads(1)\n"
            "import cli as CLI, engine as E, verify as V\n"
            f"eng = CLI.build_engine({str(ck)!r}, max_seq_len=32768)\n"
            "ids = torch.randint(3, 300, (16384,), generator=torch.Generator().manual_seed(0)).tolist()\n"
            "r = E.generate(eng, E.make_method(eng, 'ar'), ids, 4, V.Sampling(), ())\n"
            "print(len(r.tokens), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    n, kib = map(int, out.stdout.split())
    assert n == 4
    assert kib < 1.5 * 2 ** 20, f"peak RSS {kib / 2**20:.2f} GiB"


# ----------------------------------------------------------------------------- attention layouts

@pytest.mark.parametrize("batch", [1, 3])
def test_window_and_full_attention_agree(tiny_ckpt, tmp_path, batch):
    """Attention over the rows in use and over the whole cache give the same tokens: one request, and
    four through three slots (a window then reaches the longest slot's rows)."""
    target = tiny_ckpt("qwen3")
    head = random_head(target, tmp_path / "head")
    ids = [[1, 5, 9, 13, 22, 40, 3], [1] + list(range(50, 80)), [1, 4], [1, 8, 8, 8, 9]]
    cfg = GR.Config(budget=12, thresholds={0: 0.2, 1: 0.05, 5: 0.0})
    out = {}
    for att in ("window", "full"):
        eng = CLI.build_engine(str(target), str(head), max_seq_len=96, attention=att, chunk=8, batch=batch)
        reqs = lambda: [E.Request(x, dataclasses.replace(SAMPLED, seed=i), i) for i, x in enumerate(ids)]
        out[att] = [[r.tokens for r in E.run(eng, eng.make(m, cfg), reqs(), 30).requests] for m in ("ar", "graft")]
    assert out["window"] == out["full"] and out["window"][0] == out["window"][1]


def test_padding_never_reaches_the_matrix():
    """update(): padding nodes write the spare row V, never a token's row; each request writes its own
    matrix (B, V+1, k), and a request's accepted path wins over other nodes with the same token."""
    from graft import update
    V, k = 20, 3
    M = torch.zeros(2, V + 1, k, dtype=torch.int32)
    written = torch.zeros(2, V + 1, dtype=torch.bool)
    tokens = torch.tensor([[4, 7, 9], [4, 4, 9]])
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(0))
    valid = torch.tensor([[True, False, False], [True, True, False]])
    path, A = torch.tensor([[0, 1], [0, 1]]), torch.tensor([0, 1])        # request 1 accepted node 1
    update(M, written, tokens, logits, valid, path, A)
    assert written[0, :V].nonzero().flatten().tolist() == [4] and written[1, :V].nonzero().flatten().tolist() == [4]
    assert not bool(M[:, [7, 9]].any())
    assert torch.equal(M[0, 4], logits[0, 0].topk(k).indices.int())
    assert torch.equal(M[1, 4], logits[1, 1].topk(k).indices.int())          # the accepted one of the two 4s
    update(M[1:], written[1:], tokens[1:, :1], logits[1:, :1], valid[1:, :1])
    assert torch.equal(M[1, 4], logits[1, 0].topk(k).indices.int())


def test_matrix_state_dict_is_a_snapshot():
    """What compile_warmup keeps and restores: on a CPU too, later learning does not reach it."""
    from graft import ContinuationMatrix
    cm = ContinuationMatrix(20, k=3)
    sd = cm.state_dict()
    cm.M[4] = 7
    cm.written[4] = True
    cm.hits += 1
    assert not bool((sd["M"][4] == 7).any()) and not bool(sd["written"][4]) and float(sd["hits"].sum()) == 0
    cm.load_state_dict(sd)
    assert torch.equal(cm.M, ContinuationMatrix(20, k=3).M) and float(cm.hits.sum()) == 0


# ----------------------------------------------------------------------------- what a round reports

@pytest.mark.parametrize("batch", [1, 2])
def test_verified_counts_real_nodes_and_padded_the_pass_size(tiny_ckpt, batch, monkeypatch):
    """A tree of 3 real candidates padded to 16 slots: 3 verified a round, 16 the pass ran at."""
    eng = CLI.build_engine(str(tiny_ckpt("qwen3")), max_seq_len=64, batch=batch,
                           methods=[("pld", GR.Config(pld_tokens=16))])
    monkeypatch.setattr(GR, "lookup", lambda ctx, ngram, n: (3, [5, 6, 7]))   # prompt lookup always "finds" 3 tokens
    res = E.run(eng, eng.make("pld", GR.Config(pld_tokens=16)), [E.Request([1, 9, 13]), E.Request([1, 2])], 6)
    for r in res.requests:
        st = r.stats()
        assert r.rounds > 0 and st["verified_per_round"] == 3 and st["padded_per_round"] == 16



def test_pld_tokens_flag_sizes_the_chain(tiny_ckpt):
    """--pld-tokens 2: the flag reaches the method, whose pass is 3 wide (root + 2) and whose rounds copy
    at most 2 tokens, emitting what ar emits; the default chain is 5 (a row each on a CPU)."""
    import argparse
    p = argparse.ArgumentParser()
    CLI.add_engine_flags(p)
    assert CLI.config_from_args(p.parse_args([])).pld_tokens == 5
    cfg = CLI.config_from_args(p.parse_args(["--pld-tokens", "2", "--no-pace"]))
    eng = CLI.build_engine(str(tiny_ckpt("qwen3")), max_seq_len=96, methods=[("pld", cfg)])
    prompt = [1, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9, 13]           # a pattern that recurs: lookup always finds one
    res = E.run(eng, eng.make("pld", cfg), [E.Request(prompt)], 24)
    ar = E.run(eng, eng.make("ar"), [E.Request(prompt)], 24)
    st = res.requests[0].stats()
    assert eng.make("pld", cfg).N == 3 and st["padded_per_round"] == 2 and 0 < st["verified_per_round"] <= 2
    assert res.requests[0].tokens == ar.requests[0].tokens

def test_a_run_that_raised_leaves_the_engine_usable(tiny_ckpt, monkeypatch):
    """An error in the middle of a run (here: the third verify step raises) leaves requests in their
    slots; the next run frees them and serves its own requests only, each what it is alone."""
    eng = CLI.build_engine(str(tiny_ckpt("qwen3")), max_seq_len=64, batch=2)
    verify, calls = eng.steps.verify, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return verify(*a, **k)
    monkeypatch.setattr(eng.steps, "verify", failing)
    stale = [E.Request([1, 9, 13], GREEDY, 0), E.Request([1, 2], GREEDY, 1)]
    with pytest.raises(RuntimeError, match="boom"):
        E.run(eng, eng.make("pld"), stale, 12)
    assert any(eng.requests())
    seen = []
    reqs = [E.Request([1, 5, 6, 7], SAMPLED, 0), E.Request([1, 3], GREEDY, 1)]
    res = E.run(eng, eng.make("pld"), reqs, 12, on_tokens=lambda r: seen.append(r.index))
    alone = [E.generate(eng, eng.make("ar"), r.ids, 12, r.sampling).tokens for r in reqs]
    assert [r.tokens for r in res.requests] == alone
    assert not any(eng.requests()) and set(seen) == {0, 1} and all(r in reqs for r in res.requests)
    assert [len(r.tokens) for r in stale] != [12, 12]          # the stale requests were not run on


def test_pass_cost_reads_the_given_clock_and_fits_monotone_costs(tiny_ckpt):
    """A clock on which the 13-node pass looks cheaper than the 9-node one: pass_cost takes each N's
    fastest sample and pools the two (a bigger tree never costs less)."""
    eng = CLI.build_engine(str(tiny_ckpt("qwen3")), max_seq_len=64)
    ms = {1: [5, 6], 9: [30, 31], 13: [20, 21]}         # per timed pass, in the order time_passes runs them
    order = [1, 9, 13, 13, 9, 1]
    seen = {n: 0 for n in ms}
    ticks = []
    for n in order:
        ticks += [0.0, ms[n][seen[n]] / 1000]
        seen[n] += 1
    now = iter(ticks)
    _, cost = CAL.pass_cost(eng, [1, 9, 13], repeats=2, timer=lambda: next(now))
    assert cost == {1: 5.0, 9: 25.0, 13: 25.0}
