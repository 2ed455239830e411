"""bench.py end to end on a tiny random target and head (in-process), and its dataset names.

The tiny model makes every number meaningless except the bookkeeping: the ar row is the baseline
(speedup 1, MAT 1), every method reproduces ar exactly, and the JSON report has its keys.
"""
import json

import pytest

import bench
import cpu_kernels
import data
from conftest import SHARED, needs_shared
from test_lossless import random_head

KEYS = {"dataset", "method", "budget", "prompts", "skipped", "mat", "tokens_per_s", "speedup",
        "draft_forwards_per_round", "verified_per_round", "padded_per_round", "retrieval_share", "stages", "lossless"}


@pytest.fixture(scope="module")
def tiny(tiny_ckpt, tmp_path_factory):
    target = tiny_ckpt("llama31")
    d = tmp_path_factory.mktemp("bench")
    head = random_head(target, d / "head")
    prompts = d / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"turns": ["Once upon a time, there was a little"]}, {"prompt": "The ball was in the tree"},
        {"turns": ["One day, she saw a big red ball.", "second turn, ignored"]}]) + "\n")
    return target, head, prompts, d


def run_bench(tiny, *extra, prompts=None):
    target, head, default, d = tiny
    out = d / f"report{len(extra)}.json"
    report = bench.main(["--ckpt", str(target), "--draft", str(head), "--methods", "ar,eagle3,graft,recycle,pld",
                         "--datasets", str(prompts or default), "--max-new-tokens", "16", "--warmup", "2",
                         "--no-cache", "--json-out", str(out), *extra])
    return report, json.loads(out.read_text())


def test_report_rows_lossless_and_baseline(tiny, capsys):
    report, saved = run_bench(tiny)
    assert saved == json.loads(json.dumps(report))
    rows = saved["rows"]
    assert [r["method"] for r in rows] == ["ar", "eagle3", "graft", "recycle", "pld"]
    for r in rows:
        assert KEYS <= set(r), r
        assert r["prompts"] == 3 and r["skipped"] == 0 and r["lossless"] is True
    ar = rows[0]
    assert ar["speedup"] == 1.0 and ar["mat"] == 1.0 and ar["verified_per_round"] == 0
    assert rows[1]["draft_forwards_per_round"] > 0 and rows[1]["verified_per_round"] > 0
    assert saved["meta"]["mismatches"] == [] and saved["meta"]["machine"]["cpu_count"]
    assert saved["meta"]["machine"]["kernels"] == cpu_kernels.isa()        # which path the linears ran on
    work = {k.split("@")[0]: v for k, v in saved["meta"]["round_work"].items()}   # the host's work per round
    assert set(work) == {f"eager {m}" for m in ("ar", "eagle3", "graft", "recycle", "pld")}
    assert work["eager ar"]["replays_per_round"] == 1 and work["eager ar"]["syncs_per_round"] == 1
    assert work["eager pld"]["replays_per_round"] == 1 and work["eager recycle"]["replays_per_round"] == 3
    # extend and depth - 1 levels, assemble, verify, learn; the warm-up picked the depth (at most the budget)
    depth = saved["meta"]["calibrations"]["throughput"]["eagle3"]["depth"]
    assert depth <= min(8, rows[1]["budget"]) and work["eager eagle3"]["replays_per_round"] == depth + 3
    assert work["eager graft"]["syncs_per_round"] >= 1 and all(w["eager_ops_per_round"] > 0 for w in work.values())
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("| dataset | method |")
    assert not any(l.startswith("{") for l in out)       # with --json-out the report goes to the file alone


def test_budget_sweep_and_skipping(tiny):
    # a prompt longer than the context (256) is skipped and counted, never truncated
    long = tiny[3] / "long.jsonl"
    long.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Her mom said", "play " * 400, "The sun"]))
    _, saved = run_bench(tiny, "--budgets", "8,20", "--methods", "ar,eagle3", prompts=long)
    rows = saved["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == [("ar", None), ("eagle3", 8), ("eagle3", 20)]
    assert all(r["lossless"] and r["prompts"] == 2 and r["skipped"] == 1 for r in rows)
    assert [r["verified_per_round"] for r in rows] == [0, 8, 20]     # the dense tree fills the budget
    assert [r["padded_per_round"] for r in rows] == [0, 8, 20]
    # the cost of a target pass is measured at 1 node and at each budget's tree size (root included)
    assert sorted(saved["meta"]["pass_ms"]["eager"], key=int) == ["1", "9", "21"]
    assert all(ms > 0 for ms in saved["meta"]["pass_ms"]["eager"].values())


@needs_shared
@pytest.mark.parametrize("name,n", [("mt_bench", 80), ("humaneval", 164), ("spec_bench:coding", 10),
                                    ("spec_bench", 480), ("sharegpt", 50)])
def test_dataset_names(name, n):
    bench.check_dataset(name)
    prompts = bench.load_dataset(name, None, None)
    assert len(prompts) == n and all(isinstance(p, str) and p for p in prompts)
    assert len(bench.load_dataset(name, 7, None)) == 7


@needs_shared
def test_humaneval_is_raw_code():
    assert bench.load_dataset("humaneval", 1, None)[0].startswith("from typing import List")


def test_stdlib_snippets_are_deterministic(tmp_path, monkeypatch):
    a, b = data.stdlib_prompts(5), data.stdlib_prompts(5)
    assert a == b and len(a) == 5 and all(len(s.splitlines()) <= 40 for s in a)
    files = []
    for i in range(3):          # an explicit held-out list wins: the first 40 lines of each file
        files.append(tmp_path / f"m{i}.py")
        files[-1].write_text("".join(f"x{i}_{j} = {j}\n" for j in range(50)))
    monkeypatch.setattr(data, "STDLIB_FILES", [str(f) for f in files])
    got = data.stdlib_prompts(2)
    assert len(got) == 2 and got[0].startswith("x0_0 = 0\n") and got[0].endswith("x0_39 = 39\n")


@pytest.mark.parametrize("name", ["nope", "spec_bench:poetry", "mt_bench:coding"])
def test_unknown_dataset_is_one_error_line(tiny, name, capsys):
    target = tiny[0]
    with pytest.raises(SystemExit) as e:
        bench.cli(["--ckpt", str(target), "--methods", "ar", "--datasets", name])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and name.split(":")[-1] in err[0]


def test_shared_override(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAFT_SHARED", str(tmp_path))
    with pytest.raises(bench.GraftError, match="not found"):
        bench.check_dataset("mt_bench")
    (tmp_path / "data" / "mt_bench").mkdir(parents=True)
    (tmp_path / "data" / "mt_bench" / "question.jsonl").write_text('{"turns": ["hi", "again"]}\n')
    assert bench.load_dataset("mt_bench", None, None) == ["hi"]
    assert SHARED.name == "shared"


def test_mismatch_is_reported_and_exits_1(tiny, monkeypatch, capsys):
    real = bench.E.generate

    def broken(model, method, *args, **kw):      # pld "loses" its 4th token
        res = real(model, method, *args, **kw)
        if method.name == "pld" and len(res.tokens) > 3:
            res.tokens[3] = (res.tokens[3] + 1) % 300
        return res

    monkeypatch.setattr(bench.E, "generate", broken)
    target, head, prompts, d = tiny
    with pytest.raises(SystemExit) as e:
        bench.cli(["--ckpt", str(target), "--methods", "pld", "--datasets", str(prompts), "--max-new-tokens", "8",
                   "--json-out", str(d / "broken.json")])
    assert e.value.code == 1
    assert "MISMATCH" in capsys.readouterr().err
    saved = json.loads((d / "broken.json").read_text())
    assert [r["lossless"] for r in saved["rows"]] == [True, False]
    assert {(m["prompt"], m["position"]) for m in saved["meta"]["mismatches"]} == {(0, 3), (1, 3), (2, 3)}


def test_methods_run_in_the_reverse_order_every_other_prompt(tiny, monkeypatch):
    """A prompt's runs in the order ar, eagle3, ..., the next prompt's in reverse: what one run leaves the next
    (and a drift of the machine's load) falls on every method alike; each is still checked against ar's."""
    real, order = bench.E.generate, []

    def logged(model, method, ids, *args, **kw):
        order.append((tuple(ids), method.name))
        return real(model, method, ids, *args, **kw)

    monkeypatch.setattr(bench.E, "generate", logged)
    _, saved = run_bench(tiny, "--warmup", "0")
    prompts = list(dict.fromkeys(p for p, _ in order))[-3:]      # (the first-call run before the clock: left out)
    per = [[m for p, m in order if p == q][-5:] for q in prompts]
    assert per[0] == ["ar", "eagle3", "graft", "recycle", "pld"] and per[1] == per[0][::-1] and per[2] == per[0]
    assert all(r["lossless"] is True for r in saved["rows"])


def test_recycle_size_sets_the_retrieval_tree(tiny):
    _, saved = run_bench(tiny, "--methods", "ar,recycle", "--recycle-size", "5")
    assert [(r["method"], r["verified_per_round"], r["lossless"]) for r in saved["rows"]] == \
        [("ar", 0, True), ("recycle", 5, True)]


def test_eager_and_compiled_in_one_run(tiny, monkeypatch):
    """--executions eager,compiled: every method both ways, interleaved, each against its own ar; both
    lossless against the one ar. (Compiled with aot_eager here: tracing, no codegen.)"""
    import functools
    monkeypatch.setattr(bench.CLI, "build_engine", functools.partial(bench.CLI.build_engine, backend="aot_eager"))
    _, saved = run_bench(tiny, "--methods", "ar,graft", "--executions", "eager,compiled", "--budget", "4",
                         "--depth", "2", "--checkpoints", "0,1", "--max-new-tokens", "8")
    rows = saved["rows"]
    assert [(r["execution"], r["method"]) for r in rows] == [("eager", "ar"), ("eager", "graft"),
                                                            ("compiled", "ar"), ("compiled", "graft")]
    assert all(r["lossless"] for r in rows) and [r["speedup"] for r in rows][::2] == [1.0, 1.0]
    assert set(saved["meta"]["compiled_over_eager"]) == {"prompts.jsonl ar", "prompts.jsonl graft@4"}
    assert set(saved["meta"]["pass_ms"]) == {"eager", "compiled"}
    graft = rows[1]
    assert set(graft["round_ms"]) == {"draft", "assemble", "verify", "update"} and 0 < graft["overhead"] < 1


def test_plot_draws_speedup_against_mat(tiny, tmp_path):
    png = tmp_path / "fig1.png"
    run_bench(tiny, "--methods", "ar,eagle3,graft", "--budgets", "4,8", "--plot", str(png), "--max-new-tokens", "8")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("flag,name", [("--plot", "x.png"), ("--json-out", "x.json")])
def test_output_into_a_missing_folder_fails_before_anything_runs(tiny, monkeypatch, capsys, flag, name):
    monkeypatch.setattr(bench.CLI, "build_engine", lambda *a, **k: pytest.fail("the benchmark ran"))
    target, head, prompts, d = tiny
    with pytest.raises(SystemExit) as e:
        bench.cli(["--ckpt", str(target), "--draft", str(head), "--datasets", str(prompts),
                   flag, str(d / "no-such-folder" / name)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {flag} {d / 'no-such-folder' / name}: the folder {d / 'no-such-folder'} does not exist"]


@pytest.mark.parametrize("flags", [["--json-out", "{stem}.json"], ["--json-out", "{stem}.jsonl"]])
def test_an_output_never_writes_over_an_input(tiny, monkeypatch, capsys, flags):
    """`--datasets chat.jsonl --json-out chat.json` once wrote its runs (chat.jsonl) over the prompts: now
    a clash of any output with an input file is one line, before anything runs, and the prompts are kept."""
    monkeypatch.setattr(bench.CLI, "build_engine", lambda *a, **k: pytest.fail("the benchmark ran"))
    target, head, prompts, d = tiny
    before = prompts.read_bytes()
    flag, out = flags[0], flags[1].format(stem=prompts.with_suffix(""))
    with pytest.raises(SystemExit) as e:
        bench.cli(["--ckpt", str(target), "--draft", str(head), "--datasets", str(prompts), flag, out])
    assert e.value.code == 2 and prompts.read_bytes() == before
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"which is an input ({prompts})" in err[0], err


def test_budget_sweep_runs_a_method_without_a_budget_once(tiny):
    """pld ignores the budget: one run and one row (one point on the plot), not one per budget."""
    _, saved = run_bench(tiny, "--methods", "ar,eagle3,pld", "--budgets", "4,8", "--max-new-tokens", "8")
    assert [(r["method"], r["budget"]) for r in saved["rows"]] == [("ar", None), ("eagle3", 4), ("eagle3", 8),
                                                                   ("pld", None)]


def test_budget_auto_reaches_eagle3(tiny):
    """--methods ar,eagle3 --budget auto: the warm-up runs for eagle3 alone and it runs at its budget."""
    _, saved = run_bench(tiny, "--methods", "ar,eagle3", "--max-new-tokens", "8", "--warmup", "1")
    eagle3 = saved["meta"]["calibrations"]["throughput"]["eagle3"]["budget"]
    assert [(r["method"], r["budget"]) for r in saved["rows"]] == [("ar", None), ("eagle3", eagle3)]


def test_plot_without_matplotlib_is_one_line_error(tiny, monkeypatch, capsys):
    import builtins
    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__",
                        lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name)) if name.startswith("matplotlib")
                        else real(name, *a, **k))
    target, head, prompts, d = tiny
    with pytest.raises(SystemExit) as e:
        bench.cli(["--ckpt", str(target), "--draft", str(head), "--methods", "ar", "--datasets", str(prompts),
                   "--max-new-tokens", "4", "--warmup", "0", "--plot", str(d / "x.png")])
    assert e.value.code == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error")]
    assert err == ["error: --plot needs matplotlib: pip install matplotlib"]


def test_both_calibrations_and_auto_budget(tiny):
    """--calibration throughput,youden --budget auto: each pruning method runs twice (the second labelled
    [youden]), each head method at the budget its calibration picked; the report carries both
    calibrations and the expected tokens/s per budget; everything stays lossless."""
    _, saved = run_bench(tiny, "--methods", "ar,eagle3,prune,graft", "--calibration", "throughput,youden",
                         "--budget", "auto", "--depth", "3", "--checkpoints", "0,1", "--max-new-tokens", "8")
    rows, meta = saved["rows"], saved["meta"]
    assert [r["method"] for r in rows] == ["ar", "eagle3", "prune", "prune[youden]", "graft", "graft[youden]"]
    assert all(r["lossless"] for r in rows) and meta["budgets"] == "auto"
    assert set(meta["calibrations"]) == {"throughput", "youden"}
    thr = meta["calibrations"]["throughput"]
    for r in rows[1:]:
        name = r["method"].split("[")[0]
        want = meta["calibrations"]["youden" if "[" in r["method"] else "throughput"][name]["budget"]
        assert r["budget"] == want
    curve = meta["expected_tokens_per_s_by_budget"]
    assert set(curve) == {"eagle3", "prune", "graft"}
    tie = 1 - bench.CAL.tie_tolerance(meta["cost_spread"])
    for m in curve:           # the chosen budget: the smallest within the timing's spread of the curve's best
        best = max(curve[m].values())
        chosen = min((int(b) for b, r in curve[m].items() if r >= best * tie))
        assert chosen == thr[m]["budget"]
        # the curve gives each budget's best depth; the choice is the shallowest depth within the tie
        assert best * tie * (1 - 1e-2) <= thr[m]["expected_tokens_per_s"] <= curve[m][str(chosen)] * (1 + 1e-2)
        assert 1 <= thr[m]["depth"] <= min(3, chosen)


def test_one_calibration_name_only(tiny, capsys):
    target, head, prompts, d = tiny
    with pytest.raises(SystemExit) as e:
        bench.cli(["--ckpt", str(target), "--draft", str(head), "--datasets", str(prompts),
                   "--calibration", "youden,youden"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--calibration" in err[0]


@pytest.mark.parametrize("s", [bench.Sampling(), bench.Sampling(temperature=0.8, top_p=0.9, seed=5)],
                         ids=["greedy", "sampled"])
def test_a_bf16_mismatch_is_classified_by_the_targets_own_gap(tiny, s):
    """A token that differs from ar's is a near-tie only when the two are the target's best two at
    that position within the rounding tolerance; anything else differs (float32 never asks)."""
    target, _, _, _ = tiny
    eng = bench.CLI.build_engine(str(target), max_seq_len=128)
    ids = [1, 17, 23, 42]
    base = bench.E.generate(eng, bench.E.make_method(eng, "ar"), ids, 10, s, ()).tokens
    keep = {}

    class Last(bench.E.Method):                  # the target's scores after the prompt's last token
        def prompt_chunk(self, eng, b, chunk, logits, feats, n):
            keep["row"] = logits[0, -1].float().clone()
    last = Last(eng, bench.E.Config())
    eng.admit(0, bench.E.Request(ids + base[:4], s), last)
    eng.free(0, last)
    scores = keep["row"] if s.greedy else None
    if scores is None:                           # the sampled choice ranks warped logits plus the noise
        from verify import position_noise, sampling_mode, warp
        t = lambda x: bench.torch.tensor([x])
        scores = warp(keep["row"][None, None], t(s.temperature), t(s.top_k), t(s.top_p),
                      sampling_mode([s]))[0, 0].double() + position_noise(t(s.seed), t(len(ids) + 4),
                                                                          keep["row"].numel())[0]
    first, second, third = scores.topk(3).indices.tolist()
    assert first == base[4]
    runner_up = base[:4] + [second] + base[5:]
    assert bench.CLI.classify_mismatch(eng, ids, base, runner_up, s, eps=1.0)["kind"] == "near-tie"
    assert bench.CLI.classify_mismatch(eng, ids, base, runner_up, s, eps=0.0)["kind"] == "differs"
    far = base[:4] + [third] + base[5:]
    got = bench.CLI.classify_mismatch(eng, ids, base, far, s, eps=1.0)
    assert got["kind"] == "differs" and got["position"] == 4


def break_pld(monkeypatch):
    """pld's outputs get a wrong fourth token."""
    real = bench.E.generate

    def broken(model, method, *args, **kw):
        res = real(model, method, *args, **kw)
        if method.name == "pld" and len(res.tokens) > 3:
            res.tokens[3] = (res.tokens[3] + 1) % 300
        return res
    monkeypatch.setattr(bench.E, "generate", broken)


def test_near_ties_are_reported_apart_and_exit_0(tiny, monkeypatch, capsys):
    """In bf16 outside exact mode (--no-exact), a difference the classification calls a near-tie is
    reported as such (row lossless: "near-tie"), and the run does not fail on it; a real difference
    still does. (In exact mode every difference is real: test_exact_mode_has_no_near_ties.)"""
    break_pld(monkeypatch)
    monkeypatch.setattr(bench.CLI, "classify_mismatch", lambda *a, **k: {"kind": "near-tie", "position": 3, "gap": 0.01,
                                                                       "tolerance": 0.1})
    target, head, prompts, d = tiny
    bench.cli(["--ckpt", str(target), "--methods", "pld", "--datasets", str(prompts), "--max-new-tokens", "8",
               "--dtype", "bfloat16", "--no-exact", "--json-out", str(d / "tie.json")])
    assert "NEAR-TIE" in capsys.readouterr().err
    saved = json.loads((d / "tie.json").read_text())
    assert [r["lossless"] for r in saved["rows"]] == [True, "near-tie"]
    assert {m["kind"] for m in saved["meta"]["mismatches"]} == {"near-tie"}


def test_exact_mode_has_no_near_ties(tiny, monkeypatch):
    """In exact mode (the CPU default) the same difference is real: the run fails, whatever the
    near-tie classification would say (it is not asked)."""
    break_pld(monkeypatch)
    monkeypatch.setattr(bench.CLI, "classify_mismatch", lambda *a, **k: pytest.fail("asked for a near-tie"))
    target, head, prompts, d = tiny
    with pytest.raises(SystemExit) as e:
        bench.cli(["--ckpt", str(target), "--methods", "pld", "--datasets", str(prompts), "--max-new-tokens", "8",
                   "--dtype", "bfloat16", "--limit", "1", "--json-out", str(d / "exact.json")])
    assert e.value.code == 1 and cpu_kernels.ON


def test_help_names_every_method_and_dataset(capsys):
    """bench.py --help says what each method is and which datasets exist (issue: what a newcomer meets first)."""
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(f"  {m} " in out for m in bench.E.METHODS)
    assert all(d in out for d in list(bench.DATA.FILES) + list(bench.DATA.GENERATED))
