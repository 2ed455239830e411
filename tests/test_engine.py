"""The compiled engine: static-shaped steps give the eager engine's tokens, compile once, and stay
within their shapes.

Compiling takes 15-40 s a graph on this CPU with inductor, and seconds with torch.compile's aot_eager
backend (the same dynamo tracing, fullgraph, and functionalised cache writes, without code generation).
So the compiled runs happen in tests/compile_check.py, a subprocess started when the suite starts
(conftest), on the second core; the `test_compiled_*` tests read its results and run last.
"""
import subprocess
import sys

import pytest
import torch

import cli as CLI
import engine as E
import graft as GR
import verify as V
from conftest import ROOT, compile_result
from test_lossless import random_head
from verify import Sampling

GREEDY = Sampling()
SAMPLED = Sampling(temperature=0.8, top_p=0.9, seed=1234)


# ----------------------------------------------------------------------------- compiled against eager

@pytest.mark.parametrize("s", ["greedy", "sampled"])
@pytest.mark.parametrize("method", list(E.METHODS))
def test_compiled_equals_eager_every_method(method, s):
    """A tiny random Llama and head, compiled (aot_eager) and eager: the same tokens, two prompts."""
    assert compile_result("every_method")[method][s]


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
    assert compile_result("warmup") == {"youden": True, "hit_rates": True, "matrix": True}


def test_compiled_with_inductor_equals_eager():
    """The real CPU backend on the tiny model: ar and graft-root (every kind of step), greedy; no
    graph compiled after warm-up."""
    got = compile_result("inductor")
    assert got["same"] == {"ar": True, "graft-root": True} and got["graphs_after_warmup"] == 0


def test_compiled_gpu_check_runs_tiny():
    """scripts/gpu_check.py --tiny: the GPU check's own code end to end, every section in its own
    process, every field of its report."""
    r = compile_result("gpu_check")
    assert r["returncode"] == 0, r["stdout"] + r["stderr"]
    s = r["summary"]
    assert [k for k in s if k != "wall_seconds"] == ["env", "placement", "engine", "full", "peer"]
    assert all(v["ok"] for k, v in s.items() if k != "wall_seconds")
    env, full = s["env"]["result"], s["full"]["result"]
    assert set(env["sdpa_kernel"]) == {"decode", "verify_61", "prefill_128"} and env["cache_rows"] % 16 == 0
    assert s["placement"]["result"]["failed"] == {} and s["placement"]["result"]["missing"] == []
    eng = s["engine"]["result"]
    assert all(eng["same"].values()) and len(eng["same"]) == len(E.METHODS) + 2 + 3
    assert eng["second_pass_new"]["dynamo_graphs"] == 0 and eng["graphs"]["cudagraph_skips"] == 0
    assert full["ar"]["tokens_per_s"] > 0 and set(full["verify_ms"]) >= {"1", "17", "33", "61", "61_over_1"}
    assert set(full["graft_round_ms"]) == {"full", "0", "1", "5"}
    assert all(set(v) >= {"draft", "assemble", "verify", "update", "overhead"} for v in full["graft_round_ms"].values())
    assert all(c["graphs"] >= 0 for c in full["compile"].values())
    assert set(s["peer"]["result"]) == {"eager", "static_compiled"}


@pytest.mark.parametrize("s", ["greedy", "sampled"])
@pytest.mark.parametrize("method", list(E.METHODS))
def test_compiled_outputs_are_never_read_after_they_expire(method, s):
    """Every method compiled (aot_eager), each step output poisoned as soon as a CUDA graph's next
    generation or replay would overwrite it: still the eager engine's tokens (three prompts, one of
    three prefill chunks)."""
    assert compile_result("lifetimes")[method][s]


def test_compiled_verify_serves_every_budget():
    """--budget auto times a verify pass at every budget of AUTO_BUDGETS: the tree size is dynamic, so
    they share the graph of their path length (budget 8's 9-node trees hold paths of 9, the rest 10):
    one graph more after the first, not one per budget."""
    assert compile_result("one_verify_graph") == {"new_graphs": 1}


def test_compiled_steps_read_only_static_state():
    """Every tensor a compiled step reads on every call (the same object each time: RoPE tables, the
    column indices, the token hash, templates, caches) is declared static or is a parameter or buffer;
    on a GPU anything else is copied into the graph on every replay."""
    assert compile_result("statics") == {"window": [], "full": []}


# ----------------------------------------------------------------------------- prefill in chunks

def test_chunked_prefill_gives_the_logits_of_one_pass(tiny_ckpt):
    eng = CLI.build_engine(str(tiny_ckpt("qwen3")), max_seq_len=200, chunk=16)
    ids = torch.randint(3, 300, (53,), generator=torch.Generator().manual_seed(0)).tolist()
    full = eng.model(torch.tensor([ids]), torch.arange(53))[0]              # causal, no cache
    eng.begin(GREEDY)
    chunks = []

    class Keep(V.Proposer):
        needs_features = True

        def prompt_chunk(self, ids, logits, feats, n):
            chunks.append(logits[:n])
    root = E.prefill(eng, Keep(), ids)
    got = torch.cat(chunks)
    assert got.shape == full.shape and torch.allclose(got, full, atol=1e-4, rtol=1e-4)
    assert root == int(full[-1].argmax()) and eng.L_host == int(eng.L) == 53


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

def test_window_and_full_attention_agree(tiny_ckpt, tmp_path):
    target = tiny_ckpt("qwen3")
    head = random_head(target, tmp_path / "head")
    ids = [1, 5, 9, 13, 22, 40, 3]
    out = {}
    for att in ("window", "full"):
        eng = CLI.build_engine(str(target), str(head), max_seq_len=96, attention=att, chunk=8)
        eng.thresholds = {0: 0.2, 1: 0.05, 5: 0.0}
        out[att] = [E.generate(eng, E.make_method(eng, m, GR.Config(budget=12)), ids, 30, SAMPLED, ()).tokens
                    for m in ("ar", "graft")]
    assert out["window"] == out["full"]


def test_padding_never_reaches_the_matrix():
    from graft import ContinuationMatrix
    cm = ContinuationMatrix(20, k=3)
    before = cm.M.clone()
    tokens = torch.tensor([4, 7, 9])
    logits = torch.randn(3, 20)
    cm.update(tokens, logits, torch.tensor([True, False, False]))
    assert torch.equal(cm.M[[7, 9]], before[[7, 9]]) and not cm.written[7] and not cm.written[9]
    assert torch.equal(cm.M[4], logits[0].topk(3).indices.int())


# ----------------------------------------------------------------------------- what a round reports

def test_verified_counts_real_nodes_and_padded_the_pass_size(tiny_ckpt):
    """A tree of 3 real candidates padded to 16 slots: 3 verified a round, 16 the pass ran at."""
    eng = CLI.build_engine(str(tiny_ckpt("qwen3")), max_seq_len=64)

    class Three(E.PromptLookup):            # prompt lookup that always "finds" the same 3 tokens
        def lookup(self):
            return [5, 6, 7]
    res = E.generate(eng, Three(eng, GR.Config(pld_tokens=16)), [1, 9, 13], 6, GREEDY, ())
    st = res.stats()
    assert res.rounds > 0 and st["verified_per_round"] == 3 and st["padded_per_round"] == 16


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
    _, cost = E.pass_cost(eng, [1, 9, 13], repeats=2, timer=lambda: next(now))
    assert cost == {1: 5.0, 9: 25.0, 13: 25.0}
