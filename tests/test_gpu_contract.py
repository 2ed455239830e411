"""The GPU's failure classes, made visible on the CPU (the contract in engine.py, above Steps), at
B = 1 and B > 1.

CUDA graphs (torch.compile mode="reduce-overhead") and SDPA's kernel choice have rules a CPU never
enforces. Each test here enforces one of them on the CPU, for one request and for a batch:
  placement   every step of every method runs on a non-CPU device (meta: data-less), whole rounds with
              refills, under gpu_check.OneDevice (no op with tensors on two devices), so a CPU tensor
              mixed into a step fails here as it would on a GPU, also where meta alone lets it through
              (index_select, gather, scatter_add_, embedding, searchsorted, a 0-dim constant)
  lifetimes   every step output is poisoned when it expires (next generation, or the step's next run):
              every method stays lossless, so nothing reads an output after a replay
  host syncs  device-to-host reads per round are counted and equal the documented number: at B = 1 one
              per round plus one per checkpoint reached (plus one per admitted request)
  host data   no tensor is built from host data for the device, nor moved there with .to(), inside a
              round (a blocking copy on a GPU)
  statics     on a GPU every declared static is marked static for dynamo (Steps' CUDA branch, on the CPU)
  gpu check   scripts/gpu_check.py's plan and limits, a section stopped at its share, its peer section
  masked rows non-finite values in cache rows nobody may see change no token, in both attention modes
  attention   masked grouped-query attention never asks SDPA for enable_gqa (the math kernel on a GPU)
  code        every step has its own code object (its own dynamo cache); caches are 16-row aligned
The compiled checks (aot_eager: the same tracing as a GPU's compile: statics, recompiles as requests
come and go) run in tests/compile_check.py.
"""
import dataclasses
import json
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import cli as CLI
import engine as E
import graft as GR
import model as M
import verify as V
from conftest import NO_BLOCK, ROOT
from engine import Request
from test_lossless import prompts, random_head
from verify import Sampling, Tree

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check as GC  # noqa: E402  (the placement check and OneDevice live there: the GPU machine runs them too)

GREEDY = Sampling()
CHECKPOINTS = (0, 1, 3)
STREAM = prompts(2, 300, seed=11) + [[1] + list(range(40, 80)), [1, 9]]     # (the third: 3 prefill chunks)


def mixed(i: int) -> Sampling:
    """Request i's sampling in a sampled stream: top-p, top-k, both, greedy; its own seed."""
    kinds = [Sampling(0.8, 0.9, 0), Sampling(1.0, 1.0, 20), Sampling(0.7, 0.8, 30), Sampling()]
    return dataclasses.replace(kinds[i % 4], seed=1234 + i)


def requests(kind: str, ids=STREAM) -> list:
    return [Request(x, GREEDY if kind == "greedy" else mixed(i), i) for i, x in enumerate(ids)]


@pytest.fixture(scope="module")
def pair(tiny_ckpt, tmp_path_factory):
    target = tiny_ckpt("llama31")                    # 4 query heads over 2 KV heads: grouped attention
    return str(target), str(random_head(target, tmp_path_factory.mktemp("head")))


def engine(pair, batch=1, **kw):
    return CLI.build_engine(*pair, max_seq_len=256, top_k=4, depth=5, chunk=16, batch=batch, **kw)


@pytest.fixture(scope="module")
def plain(pair):
    return engine(pair)


@pytest.fixture(scope="module")
def taus(plain):
    """Thresholds that make every stage fire sometimes on the random head: quantiles of its confidences."""
    conf = {}

    def keep(rnd, commits):
        for c, x in rnd.record["conf"].items():
            conf.setdefault(c, []).extend(x.tolist())
    m = plain.make("eagle3", GR.Config(budget=10, checkpoints=CHECKPOINTS))
    E.run(plain, m, [Request(x) for x in prompts(4, 300, seed=9)], 16, (), on_round=keep, record=True)
    return {c: sorted(v)[int(q * len(v))] for (c, v), q in zip(sorted(conf.items()), (0.3, 0.4, 0.5))}


def method(eng, name, taus, policy=None):
    return eng.make(name, GR.Config(budget=10, checkpoints=CHECKPOINTS, thresholds=dict(taus), policy=policy))


@pytest.fixture(scope="module")
def reference(plain):
    """Each request's tokens alone with plain decoding and its own sampling (memoised)."""
    memo = {}

    def get(r: Request, n: int) -> list:
        key = (tuple(r.ids), r.sampling, n)
        if key not in memo:
            memo[key] = E.generate(plain, plain.make("ar"), r.ids, n, r.sampling, ()).tokens
        return memo[key]
    return get


# ----------------------------------------------------------------------------- placement

placement_check = GC.placement_check


@pytest.mark.parametrize("batch, window", [(1, True), (1, False), (3, False)])
def test_every_step_runs_on_a_non_cpu_device(batch, window):
    """Every step the engine compiles, of every method, greedy and sampled, one request and a batch
    with a refill, and the verify step at every size --budget auto times: no CPU tensor in any."""
    got = placement_check(batch, window, methods=NO_BLOCK)       # (the block methods': tests/test_dflash.py)
    assert got.pop("missing") == []
    assert {k: v for k, v in got.items() if v != "ok"} == {}
    assert len(got) == 2 * len(NO_BLOCK) + 7


def test_a_template_left_on_the_cpu_is_caught(monkeypatch):
    """The check sees the failure it exists for: retrieval templates that stay on the CPU (the first
    GPU run's crash) fail every method that retrieves, in the step that retrieves, and no other."""
    monkeypatch.setattr(GR.Template, "to", lambda self, device: self)
    got = placement_check(2, False, methods=NO_BLOCK)
    bad = {k for k, v in got.items() if k != "missing" and v != "ok"}
    retrieving = {"graft", "recycle", "graft-fixed", "graft-naive-root", "graft-naive-tail"}
    assert {k.split("/")[0] for k in bad} == retrieving
    assert {k.split("/")[2] for k in bad if k.count("/") == 2} == {"assemble", "recycle_tree"}
    assert "graft/greedy/assemble" in bad


# What a step may do on the CPU, or on meta, but not in a CUDA graph: an operand left on the CPU. Each
# takes the decode step's logits (B, 1, V) and bonus (B,) and mixes in a CPU tensor.
MIXED = {
    "cpu_constant": lambda lg, tok: tok + torch.tensor(0),                    # a 0-dim constant made in the step
    "index_select": lambda lg, tok: lg.index_select(-1, torch.zeros(1, dtype=torch.long)),
    "gather": lambda lg, tok: lg.gather(-1, torch.zeros(*lg.shape[:-1], 1, dtype=torch.long)),
    "scatter_add_": lambda lg, tok: torch.zeros_like(lg).scatter_add_(-1, torch.zeros(*lg.shape[:-1], 1, dtype=torch.long),
                                                                      lg[..., :1]),
    "embedding": lambda lg, tok: F.embedding(tok, torch.zeros(lg.shape[-1], 2)),
    "searchsorted": lambda lg, tok: torch.searchsorted(torch.tensor([0.0, 1.0]), lg),
}


@pytest.mark.parametrize("op", list(MIXED))
def test_an_operand_left_on_the_cpu_is_caught(monkeypatch, op):
    """Each op CUDA refuses with a CPU operand (or, a 0-dim constant, captures only by skipping CUDA
    graphs), put into the decode step: meta's own checks let it through, OneDevice fails ar's runs
    in the decode step, and nothing else."""
    decode = E.decode

    def mixed(*a, **kw):
        v = decode(*a, **kw)
        MIXED[op](v.logits, v.bonus)
        return v
    monkeypatch.setattr(E, "decode", mixed)                 # (Engine binds its steps when built)
    meta_alone = placement_check(1, False, methods=("ar",), strict=False)
    assert "decode" not in meta_alone.pop("missing") and set(meta_alone.values()) == {"ok"}
    got = placement_check(1, False, methods=("ar",))
    bad = {k: v for k, v in got.items() if k != "missing" and v != "ok"}
    assert set(bad) == {"ar/greedy", "ar/greedy/decode", "ar/sampled", "ar/sampled/decode"}, bad
    assert "mixes devices" in bad["ar/greedy/decode"]


def test_gpu_check_plan(capsys):
    """--dry-run runs nothing and prints the plan: every section in order with its graphs and time;
    each section's limit is its expected share of what is left, so the limits add up to the total
    when every section takes all of its own, and a section that finishes early leaves its time to
    the later ones."""
    assert GC.main(["--dry-run", "--time-limit", "420"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in out[1::2]] == list(GC.SECTIONS) == ["env", "placement", "engine", "lossless",
                                                                          "speed", "peer"]
    assert "no GPU has run this" in out[0] and "graphs: ar: prefill, ar: decode" in out[6]
    assert sum(len(g) for s, _, g, *_ in GC.PLAN if s == "engine") == len(GC.ENGINE_GRAPHS) == 9
    names, left, limits = list(GC.SECTIONS), 417.0, []
    for s in names:
        limits.append(GC.limit_for(s, names, left, False))
        left -= limits[-1]
    assert abs(sum(limits) - 417.0) < 1e-6
    assert GC.limit_for("peer", names, 100.0, False) == 100.0               # the last takes all that is left
    assert GC.limit_for("speed", names, 340, False) > GC.limit_for("speed", names, 170, False)


def test_gpu_check_stops_a_section_at_its_limit(tmp_path):
    """A section past its share is killed (its process group: inductor's workers too) and reported,
    the summary is written and printed, and the exit code is 1."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--tiny", "--sections", "placement",
                        "--time-limit", "5", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["complete"] and not s["sections"]["placement"]["ok"]
    why = s["sections"]["placement"]["why"]
    assert why.startswith("timed out after ") and why.endswith("(its share of --time-limit 5)"), why
    assert s["sections"]["placement"]["limit"] <= 2.0
    assert "summary: FAILED" in r.stdout and r.stdout.rstrip().endswith("summary.json)")


def test_gpu_check_peer_refuses_transformers_own_compile(monkeypatch, tmp_path):
    """The peer measures our compiled decode forward, not transformers' compile around it: without
    disable_compile its static-cache generate() would compile the model itself (on a GPU; the CPU
    rehearsal is made eligible the same way), and the section fails before timing anything."""
    monkeypatch.setattr(GC, "PEER_COMPILED", {k: v for k, v in GC.PEER_COMPILED.items() if k != "disable_compile"})
    args = types.SimpleNamespace(tiny=True, tokens=3, chunk=16)
    with pytest.raises(SystemExit, match="transformers compiled the model itself"):
        GC.section_peer(args, lambda r: None)


# ----------------------------------------------------------------------------- output lifetimes

@pytest.fixture(scope="module")
def engines(pair):
    """(attention, B, check_lifetimes) -> engine, built when first asked for."""
    memo = {}

    def get(attention, batch, lifetimes):
        if (attention, batch, lifetimes) not in memo:
            memo[attention, batch, lifetimes] = engine(pair, batch, attention=attention, check_lifetimes=lifetimes)
        return memo[attention, batch, lifetimes]
    return get


@pytest.mark.parametrize("name", NO_BLOCK)
def test_expired_outputs_are_never_read(engines, reference, taus, name):
    """Outputs poisoned as a CUDA graph's next replay would overwrite them: every method, both attention
    modes, one request at a time and three slots with a refill, greedy and sampled requests side by
    side, still emits each request's plain decoding tokens, and drafts exactly what it drafts
    unpoisoned (a poisoned read into the head's input would only show in what gets accepted)."""
    for attention, B in (("window", 1), ("full", 1), ("full", 3)):
        eng, same = engines(attention, B, True), engines(attention, B, False)
        got = E.run(eng, method(eng, name, taus), requests("sampled"), 20, ()).requests
        want = E.run(same, method(same, name, taus), requests("sampled"), 20, ()).requests
        for g, w in zip(got, want):
            assert g.tokens == reference(g, 20), (name, attention, B, g.index)
            assert (g.rounds, g.accepted, g.from_retrieval, g.stages) == (w.rounds, w.accepted, w.from_retrieval, w.stages)
            if B == 1:
                assert g.draft_forwards == w.draft_forwards


def test_the_poison_is_real(pair):
    """What the lifetime check does to an output kept too long: the next run of its step poisons it;
    the state it wrote (the next roots, a static buffer) is left alone."""
    eng = engine(pair, 2, check_lifetimes=True)
    m = eng.make("ar")
    eng.admit(0, Request([1, 5, 7]), m)
    eng.steps.mark()
    step = lambda: eng.steps.decode(eng.root, eng.L, eng.active, eng.cols(1), eng.smp, eng.mode)
    v = step()
    kept, root = v.bonus.clone(), eng.root.clone()
    assert bool(v.finite.all())
    step()                                    # the same step again: the first call's outputs expire
    assert int(v.bonus[0]) == torch.iinfo(torch.long).max and int(kept[0]) != int(v.bonus[0])
    assert not bool(v.finite.any())           # booleans flip
    assert bool(torch.isnan(v.logits).all())
    assert int(eng.root[0]) != torch.iinfo(torch.long).max and int(eng.L[0]) == 5
    v2 = step()
    eng.steps.mark()                          # a new generation: the last call's outputs expire too
    assert int(v2.bonus[0]) == torch.iinfo(torch.long).max
    eng.free(0, m)


@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_marks_a_generation_per_chunk(pair, taus, batch, monkeypatch):
    """Every prefill chunk and every round starts a generation (the prefill step replays per chunk)."""
    eng = engine(pair, batch)
    marks, mark = [], eng.steps.mark
    monkeypatch.setattr(eng.steps, "mark", lambda: marks.append([s.L for s in eng.slots]) or mark())
    reqs = [Request([1] + list(range(10, 50))), Request(list(range(3, 23)))]       # 41 tokens: 3 chunks; 20: 2
    res = E.run(eng, method(eng, "graft", taus), reqs, 12, ())
    assert len(marks) == 3 + 2 + res.rounds
    assert [m[0] for m in marks[:3]] == [0, 16, 32]


# ----------------------------------------------------------------------------- host syncs and host data

class Transfers(TorchDispatchMode):
    """Counts what reaches the host from a tensor (item, float, bool: aten._local_scalar_dense; copies
    out of a non-CPU device; tolist) and tensors built from host data for a device (torch.tensor or
    torch.as_tensor with device=: a blocking copy on a GPU)."""

    def __init__(self):
        super().__init__()
        self.syncs = self.to_device = 0
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        elif func is torch.ops.aten._to_copy.default and args[0].device.type != "cpu" and \
                str(kwargs.get("device", args[0].device)).startswith("cpu"):
            self.syncs += 1
        return func(*args, **kwargs)


@pytest.fixture
def transfers(monkeypatch):
    """tolist() on a CPU tensor reads memory without any aten call, and torch.tensor(..., device=) or
    a CPU tensor's .to(device) on a CPU is no copy at all: all counted at the Python call. A .to()
    with a device is a copy to the device on a GPU (pageable memory: a blocking one) unless it comes
    from pinned memory without blocking, which is not counted."""
    t = Transfers()
    tolist, tensor, as_tensor, to = torch.Tensor.tolist, torch.tensor, torch.as_tensor, torch.Tensor.to

    def counted(self):
        t.syncs += t.active
        return tolist(self)

    def built(make):
        def f(*a, **kw):
            t.to_device += t.active and kw.get("device") is not None
            return make(*a, **kw)
        return f

    def moved(self, *a, **kw):
        device, _, non_blocking, _ = torch._C._nn._parse_to(*a, **kw)
        t.to_device += t.active and device is not None and self.device.type == "cpu" and not (
            non_blocking and self.is_pinned())
        return to(self, *a, **kw)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    monkeypatch.setattr(torch, "tensor", built(tensor))
    monkeypatch.setattr(torch, "as_tensor", built(as_tensor))
    monkeypatch.setattr(torch.Tensor, "to", moved)
    return t


def reached(m, stages: list) -> int:
    """Checkpoint syncs of a round whose live requests ended in `stages`: under the stop policy the
    checkpoints up to the deepest one any request reached (None: all of them), otherwise none."""
    if getattr(m, "policy", None) != "stop":
        return 0
    cps = list(m.checkpoints)
    return max(len(cps) if s is None else cps.index(s) + 1 for s in stages)


@pytest.mark.parametrize("name", NO_BLOCK)
def test_host_syncs_per_round_are_the_documented_ones(pair, taus, transfers, name):
    """B = 1: one host sync a round (commit's transfer) plus one per checkpoint reached, plus the
    prefill's one: counted, not trusted from what the round reports."""
    eng = engine(pair)
    m = method(eng, name, taus)
    ids = prompts(1, 300, seed=12)[0]
    E.generate(eng, m, ids, 8, GREEDY, ())                           # set up and warmed outside the count
    rounds = []
    with transfers:
        res = E.generate(eng, m, ids, 30, GREEDY, (), on_round=lambda rnd, c: rounds.append(rnd))
    want = [1 + reached(m, rnd.stages) for rnd in rounds]
    assert [rnd.syncs for rnd in rounds] == want
    assert transfers.syncs == 1 + sum(want) == 1 + res.syncs
    if name in ("prune", "graft"):                                     # (stop: every stage happened)
        assert len(set(want)) > 1


@pytest.mark.parametrize("name, policy", [("ar", None), ("eagle3", None), ("pld", None), ("recycle", None),
                                          ("graft", "stop"), ("graft", "replace"), ("prune", "stop")])
def test_host_syncs_at_a_batch(pair, taus, transfers, name, policy):
    """B = 3, five requests: one sync per prefill (requests admitted together, their prompts in one
    pass, share one), and per round one (commit's, for every slot at once) plus, under the stop policy,
    one per checkpoint the batch reached."""
    eng = engine(pair, 3)
    m = method(eng, name, taus, policy)
    E.run(eng, m, requests("sampled")[:2], 8, ())
    rounds, prefills = [], count_prefills(eng)
    with transfers:
        E.run(eng, m, requests("sampled") + [Request([1, 4, 4, 4], mixed(4), 4)], 24, (),
              on_round=lambda rnd, c: rounds.append((rnd.syncs, [s for s, x in zip(rnd.stages, c) if x])))
    want = [1 + reached(m, stages) for _, stages in rounds]
    assert [s for s, _ in rounds] == want
    assert transfers.syncs == len(prefills) + sum(want) and sum(prefills) == 5 and max(prefills) > 1, prefills


def count_prefills(eng) -> list:
    """Wrap eng's admissions: the list receives, per prefill, 1 (Engine.admit: one request) or the
    number of requests it prefilled together (Engine.admit_group)."""
    got, one, group = [], eng.admit, eng.admit_group
    eng.admit = lambda b, r, m: got.append(1) or one(b, r, m)
    eng.admit_group = lambda pairs, m: got.append(len(pairs)) or group(pairs, m)
    return got


@pytest.mark.parametrize("name", NO_BLOCK)
def test_no_host_data_enters_a_round(pair, taus, transfers, name):
    """A tensor built from host values for the device inside a round is a blocking copy on a GPU:
    none but each prompt's one copy (pld's chains go through a pinned buffer, asynchronously), at
    B = 3 with a refill."""
    eng = engine(pair, 3)
    m = method(eng, name, taus)
    E.run(eng, m, requests("greedy")[:1], 8, ())
    prefills = count_prefills(eng)
    with transfers:
        res = E.run(eng, m, requests("greedy"), 20, ())
    assert transfers.to_device == len(prefills) and sum(prefills) == len(STREAM) and res.rounds > 5


def test_a_pageable_copy_per_round_is_counted(pair, taus, transfers, monkeypatch):
    """A host tensor moved to the device with .to() once a round (a blocking copy from pageable
    memory on a GPU, a no-op on a CPU) is counted: the check above would fail by one a round."""
    eng = engine(pair, 3)
    m = method(eng, "graft", taus)
    E.run(eng, m, requests("greedy")[:1], 8, ())
    step = E.Engine.step

    def with_a_copy(self, *a, **kw):
        torch.zeros(2, dtype=torch.long).to(self.device)
        return step(self, *a, **kw)
    monkeypatch.setattr(E.Engine, "step", with_a_copy)
    prefills = count_prefills(eng)
    with transfers:
        res = E.run(eng, m, requests("greedy"), 20, ())
    assert transfers.to_device == len(prefills) + res.rounds


# ----------------------------------------------------------------------------- masked rows

@pytest.mark.parametrize("attention", ["window", "full"])
@pytest.mark.parametrize("name", ["ar", "graft", "recycle"])
def test_nonfinite_unwritten_rows_change_no_token(engines, reference, taus, attention, name):
    """Cache rows filled with NaN and inf before a generation (what torch.empty or an earlier run
    that overflowed leaves): the same tokens, one request and three slots with a refill. Full
    attention reads every row under the mask."""
    for B in (1, 3):
        eng = engines(attention, B, False)
        for c in [eng.cache, eng.drafter.cache]:
            for t in c.tensors():
                t.fill_(float("nan"))
                t[..., ::3, :] = float("inf")
            for b in range(B):
                c.mark(b, c.rows)        # (a slot's rows past its requests' writes are zeros the engine keeps)
        res = E.run(eng, method(eng, name, taus), requests("greedy"), 24, ())
        assert [r.tokens for r in res.requests] == [reference(r, 24) for r in res.requests], (name, B)


def rows_past_use_are_zeros(monkeypatch) -> list:
    """Checks, at every clear (Engine.seat), that the slot's rows past what its requests may have written
    (KVCache.used, after the seat's mark) are zeros: the rows a clear leaves alone. Returns the list of
    caches checked, one entry a clear."""
    seen, clear = [], M.KVCache.clear

    def checked(c, b):
        assert all(bool((t[b, :, c.used[b]:] == 0).all()) for t in c.tensors()), (b, c.used[b])
        seen.append(c)
        clear(c, b)
    monkeypatch.setattr(M.KVCache, "clear", checked)
    return seen


@pytest.mark.parametrize("name", NO_BLOCK)
def test_a_request_writes_no_cache_row_past_its_length_and_scratch(engines, taus, monkeypatch, name):
    """A slot's admission zeroes only the rows its requests may have written: below each one's length plus
    its cache's scratch (Engine.caches: trees, head levels, prefill chunks). Every row past that is still
    zero when the next request takes the slot, in both caches, three slots refilled (joins, three prefill
    chunks), greedy and sampled requests side by side; and what each cache clears is a request's rows,
    not the slot's (SmolLM2's whole slot took 12.6 ms an admission)."""
    eng = engines("full", 3, False)
    for c, _ in eng.caches:
        for t in c.tensors():
            t.zero_()
        c.used = [0] * eng.B
    seen = rows_past_use_are_zeros(monkeypatch)
    m = method(eng, name, taus)
    for kind in ("greedy", "sampled"):
        E.run(eng, m, requests(kind), 20, ())
    assert len(seen) == 2 * len(STREAM) * len(eng.caches)
    for c, scratch in eng.caches:
        assert scratch < c.rows // 2 and all(0 < n <= len(max(STREAM, key=len)) + 20 + scratch for n in c.used)
        for b in range(eng.B):
            M.KVCache.clear(c, b)          # (the last requests' rows: zeros past them too)


def test_padding_rows_write_zeros(pair):
    """A padding row's keys and values never reach the cache (zeros there): a prefill chunk's tail,
    a tree's padding nodes, and an empty slot's tree; a prefill writes no other slot's rows."""
    eng = engine(pair, 2, attention="full")
    for t in eng.cache.tensors():
        t.fill_(1.0)
    eng.admit(0, Request([1, 5, 9, 7]), eng.make("ar"))
    k = eng.cache.k[0]                                                 # (B, H_kv, rows, D)
    assert bool((k[0, :, 4:16] == 0).all()) and bool((k[0, :, :4] != 0).any(-1).all())
    assert bool((k[1] == 1).all())
    tree = Tree(torch.tensor([[int(eng.root[0]), 3, 4, 0, 0], [0] * 5]),
                torch.tensor([[-1, 0, 0, -1, -1], [-1] * 5]),
                torch.tensor([[True, True, True, False, False], [False] * 5]))
    eng.steps.verify(tree, eng.L, eng.active, eng.cols(5), eng.smp, eng.mode, 2, False, eng.root)
    assert bool((k[0, :, 7:9] == 0).all())                            # rows 4..8, padding at 7 and 8
    assert bool((k[1, :, :5] == 0).all()) and bool((k[1, :, 5:] == 1).all())
    assert eng.L.tolist()[1] == 0


def test_padding_logits_do_not_stop_verification(pair):
    """A padding node whose logits are not finite (its dummy token overflows) is not the target's
    failure: only real nodes' logits are checked."""
    eng = engine(pair, 2)
    m = eng.model
    saved = m.embed_tokens.weight[0].clone()
    with torch.no_grad():
        m.embed_tokens.weight[0] = float("nan")                      # the padding token
    try:
        eng.admit(0, Request([1, 5, 9, 7]), eng.make("ar"))
        eng.admit(1, Request([1, 6]), eng.make("ar"))
        tree = Tree(torch.stack([eng.root, torch.tensor([3, 5]), torch.tensor([4, 6]), torch.zeros(2, dtype=torch.long),
                                 torch.zeros(2, dtype=torch.long)], 1),
                    torch.tensor([[-1, 0, 0, -1, -1]] * 2), torch.tensor([[True, True, True, False, False]] * 2))
        v = eng.steps.verify(tree, eng.L, eng.active, eng.cols(5), eng.smp, eng.mode, 2, False, eng.root)
        assert bool(v.finite.all()) and bool(torch.isfinite(v.logits[:, :3]).all())
        assert not bool(torch.isfinite(v.logits[:, 3:]).any())
    finally:
        with torch.no_grad():
            m.embed_tokens.weight[0] = saved


# ----------------------------------------------------------------------------- attention and code

def test_masked_grouped_attention_never_expands_kv(pair, taus, monkeypatch):
    """SDPA never sees enable_gqa with a mask (on a GPU: the math kernel, which copies K and V to
    every query head), and the folded form equals the expanded one."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append((kw.get("attn_mask") is not None, bool(kw.get("enable_gqa", False)), a[0].shape[1], a[1].shape[1]))
        return sdpa(*a, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    eng = engine(pair, 2)
    E.run(eng, method(eng, "graft", taus), requests("greedy")[:3], 12, ())
    assert calls and not any(mask and gqa for mask, gqa, _, _ in calls)
    assert all(hq == hkv for mask, _, hq, hkv in calls if mask)          # folded: query heads = KV heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, t, 8, generator=g) for h, t in ((6, 5), (2, 11), (2, 11)))
    mask = torch.rand(5, 11, generator=g) > 0.3
    mask[:, 0] = True
    assert torch.allclose(M.grouped_attention(q, k, v, mask), sdpa(q, k, v, attn_mask=mask, enable_gqa=True), atol=1e-6)


def test_every_step_has_its_own_code_object(pair, taus):
    """Dynamo keeps one cache per code object: each step its own, named after it; the step table is
    the engine's, so every method's instances share it (making a method adds no step)."""
    eng = engine(pair, 2)
    names = set(eng.steps.names)
    assert names == {"prefill", "decode", "verify", "head_prefill", "extend", "level", "assemble", "recycle_tree",
                     "learn", "plain_learn"}
    codes = {n: getattr(eng.steps, n).__code__ for n in names}
    assert len({id(c) for c in codes.values()}) == len(codes)
    assert all(c.co_name.endswith(f"__{n}") for n, c in codes.items())
    assert codes["verify"] is not V.verify.__code__
    for m in NO_BLOCK:
        method(eng, m, taus)
    assert eng.steps.names == names and all(getattr(eng.steps, n).__code__ is codes[n] for n in names)


def test_cache_rows_are_16_aligned(pair):
    for B in (1, 3):
        eng = engine(pair, B)
        assert eng.cache.rows % 16 == 0 and eng.drafter.cache.rows % 16 == 0
        assert eng.cache.k[0].shape[0] == B and eng.drafter.cache.k[0].shape[0] == B
    assert M.cache_rows(4225) == 4240 and M.cache_rows(4224) == 4224


def unmarked(eng) -> list:
    """Declared statics whose address is not marked static for dynamo (torch._dynamo.mark_static_address
    sets _dynamo_static_input_type): on a GPU each would be copied into its CUDA graph on every replay."""
    return [t for t in eng.steps.statics if getattr(t, "_dynamo_static_input_type", None) is None]


@pytest.fixture
def as_if_cuda(monkeypatch):
    """Engines built from here on take their steps' CUDA branch (Steps.cuda) on the CPU: what Steps
    does with the statics on a GPU, without one. Nothing runs a round: CUDA graph marks would need CUDA.
    Pinned host memory (pld's buffer) needs CUDA too: allocated unpinned."""
    init, zeros = E.Steps.__init__, torch.zeros

    def cuda(self, *a, **kw):
        init(self, *a, **kw)
        self.cuda = True
    monkeypatch.setattr(E.Steps, "__init__", cuda)
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **kw: zeros(*a, **kw))
    for k in ("cache_size_limit", "accumulated_cache_size_limit", "fail_on_recompile_limit_hit"):    # (a compiled
        if hasattr(torch._dynamo.config, k):                                    # Steps sets them: restored after)
            monkeypatch.setattr(torch._dynamo.config, k, getattr(torch._dynamo.config, k))


@pytest.mark.parametrize("batch", [1, 2])
def test_every_static_is_marked_on_a_gpu(pair, taus, as_if_cuda, batch):
    """A compiled engine on a GPU marks every static's address (the caches, round state, sampling rows,
    every method's buffers, made after the engine): none is copied per replay."""
    eng = engine(pair, batch, compile=True, backend="aot_eager")
    for name in NO_BLOCK:
        method(eng, name, taus)
    assert len(eng.steps.statics) > 30 and [f"{tuple(t.shape)} {t.dtype}" for t in unmarked(eng)] == []


def test_a_missing_mark_is_caught(pair, taus, as_if_cuda, monkeypatch):
    """mark_static_address removed (on a CPU it is never called, so nothing else would notice): every
    static the engine and the method allocated is reported (the token hash, a table shared by every
    engine in the process, may have been marked by an earlier one)."""
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t, guard=False: None)
    eng = engine(pair, 1, compile=True, backend="aot_eager")
    m = method(eng, "graft", taus)
    got = {id(t) for t in unmarked(eng)}
    assert {id(t) for t in eng.cache.tensors() + [eng.L, eng.root] + m.tensors()} <= got
    assert len(got) >= len(eng.steps.statics) - 1
