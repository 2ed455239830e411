"""The layout (README, "Reading the code"): imports go one way, and the algorithm stays small.

    cpu_kernels                                                    a CPU's linear and attention (cpu_kernels.cpp), under model
    model <- draft, dflash, verify <- graft <- engine <- calibrate   the algorithm, in reading order
    checkpoint, gguf_checkpoint, tokenizer                        loaders: the model (and the head) only
    quant                                                         int8 weights: replaces the model's linears at load
    tp                                                            tensor parallelism: shards the model (loaders
                                                                  take its Shards as an argument, never import it)
    data, cli                                                     serve the faces
    api                                                           graft from Python (and for the faces)
    generate, bench, train, serve                                 the faces: never one another
"""
import ast

from conftest import ROOT

CORE = ["model", "draft", "dflash", "verify", "graft", "engine", "calibrate"]
LOADERS = ["checkpoint", "gguf_checkpoint", "tokenizer"]
SERVING = ["data", "cli"]
API = ["api"]
FACES = ["generate", "bench", "train", "serve"]
# what each may import from the project (tp: tensor parallelism, which shards the model; cli, api and the
# faces use it)
ALLOWED = {
    "cpu_kernels": set(), "model": {"cpu_kernels"}, "draft": {"model", "cpu_kernels"}, "dflash": {"model"}, "verify": {"model", "cpu_kernels"},
    "graft": {"model", "draft", "verify", "cpu_kernels"},
    "engine": {"model", "draft", "dflash", "verify", "graft"},
    "calibrate": {"model", "draft", "dflash", "verify", "graft", "engine", "cpu_kernels"},   # cpu_kernels: in the cache key
    **{m: {"model", "draft", "dflash"} | set(LOADERS) - {m} for m in LOADERS},
    "tp": {"model"}, "quant": {"model", "cpu_kernels"},
    "data": set(CORE) | set(LOADERS) | {"cpu_kernels"}, "cli": set(CORE) | set(LOADERS) | {"data", "tp", "cpu_kernels", "quant"},
    "api": set(CORE) | set(LOADERS) | set(SERVING) | {"tp", "quant"},
    **{f: set(CORE) | set(LOADERS) | set(SERVING) | set(API) | {"tp", "quant"} for f in FACES},
}
OURS = set(ALLOWED)


def imports(name: str) -> set:
    """Every project module a file imports, at any depth (imports inside functions count)."""
    tree = ast.parse((ROOT / f"{name}.py").read_text())
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module.split(".")[0])
    return out & OURS


def test_every_project_file_has_a_place():
    files = {p.stem for p in ROOT.glob("*.py")}
    assert files == OURS, f"files without a place in the layout: {sorted(files - OURS)}; missing: {sorted(OURS - files)}"


def test_imports_go_one_way():
    wrong = {m: sorted(imports(m) - ALLOWED[m]) for m in OURS}
    assert {m: w for m, w in wrong.items() if w} == {}


def test_the_model_file_is_the_model():
    assert imports("model") == {"cpu_kernels"}        # how a CPU computes a linear, not what the model is
    # 450 + 80 for exact mode (the padded Linear, exact_attention), which lives beside what it replaces,
    # + 25 for Block's fused route (when one cpu_kernels.block call computes the layer, and its arguments),
    # + 15 for every layer in one cpu_kernels.layers call and KV compaction in one cpu_kernels.move_rows,
    # + 5 for an int8 layer's scales beside its weights on the fused route (quant.py),
    # + 4 for reading that route's weights from the modules' dicts (nn.Module.__getattr__: ~1.5 ms a step),
    # + 5 for the real rows' logits only (a tree's padding rows cost the lm_head ~0.4 ms each on SmolLM2),
    # + 11 for the fused route's test in two halves: the step's (fused_step, once) and each layer's (fusable)
    # + 5 for the rows of a slot that may hold values (KVCache.mark): admission zeroes them, not the whole slot
    assert len((ROOT / "model.py").read_text().splitlines()) <= 600


def test_the_algorithm_fits_in_3327_lines():
    """Every top-level module but the faces, the loaders, data, cli, api, calibrate, tp (how one target
    spreads over devices, not how it decodes) and kernels (how a CPU computes a linear and attention, not
    what graft computes) is the algorithm, batched code included (there is one engine: a single request is
    a batch of one). 2000 lines until the loop became a Scheduler a server steps as requests arrive and
    leave (continuous batching, +50), exact mode came (model.py's padded Linear and exact_attention, the
    engine's mode: +120), retrieval drew from several sources (graft.py: the context match on the device,
    each request's context, the merge of both sources by one score, the shares by source: +85; the host's
    reference match and the warm-up's rates live in calibrate.py), model.py routed CPU linears and exact
    attention to cpu_kernels.py (+10), and block drafting came (+255: dflash.py, the DFlash drafter and its
    batched steps, ~150; the block methods dflash and graft-tail in graft.py and the engine's block steps,
    ~100), and model.Block learned when one cpu_kernels.block call computes a layer (+20). Then the CPU
    speedup: cost-aware rounds (+115: engine.Pacer, the plain round and what it keeps in step, the slots
    that draft beside those that do not), the routes to the CPU's fused steps (+55: an EAGLE-3 head's layer,
    every target layer in one call, graft_trees and the top-k in C++, the reference versions kept beside
    them), and a budget's own beam width and depth (+15); and a server's needs (+100: the target's
    log-probs at the accepted path's rows, brought in the round's one transfer; new prompts prefilled
    together in one pass), and the pacer's plain rounds compiled at warm-up and timed on rank 0's clock
    when sharded, and the batch paced as a whole (a tree pass must pay for every request: +30); and int8
    weights (model.py: the fused route's scales, +5); and the CPU pacing's second pass (+75: a head reading
    its pending rows outside a drafting round, so plain runs outgrow them; the context match over the live
    columns; a plain round's learn as one write each; graft without a matrix where its thresholds never
    prune; the fused route's weights read from the modules' dicts); and a tree's padding rows left out of
    the lm_head (+5), and the pacer's cost by how many slots draft, a batch's best drafters, its probes
    of one tree and a probe's weight (+25); and the fused route's test in its two halves again, the step's
    once and each layer's (+6); and the pacer's third pass (+67: pld's chains scored in plain rounds against
    the tokens decoded after them, so it needs no probes (Method.shadow); a probe's head catch-up outside
    the timed round, its row counts copied without a host sync; prompt lookup as a byte search; the cost's
    median); and the batch's fourth (+12: a plain round's writes in one C++ call, the head's rows that only
    write their keys, a pending room of 128 plain rounds when eager); and the pacer's fifth (+41: a DFlash
    drafter reading a plain run's rows outside a drafting round, its context step and catch-up, the row
    counts' buffers shared with the head's; a new request taking up the plain run of a method that never paid);
    and admission rounds (+85: a request whose slot frees while others run is prefilled in the pass that takes
    their plain steps after a plain round, Engine.join, and the scheduler's choice of it); and probing priced
    as exploration (+20: Pacer.floor, each probe's net loss, its catch-up timed apart) and a sampled draw in
    one C++ call (+8: the kernel's route); and a batch's
    probe of every tree where one costs more a request, a sampled draw that divides by the temperature in
    its kernel and skips a tree's padding rows (+5); and a batch's plain run cut short once the requests it
    began with have all left (+1); and admission zeroing only the rows a slot's requests may have written,
    not the whole slot (+9: KVCache.mark, Engine.caches; SmolLM2's slot took 12.6 ms an admission); and a long
    plain run's early rounds as `ar`'s step, its longest run where no tree can pay (+16: Pacer.deep,
    plain_round's learn; the stdlib pair's plain rounds cost 2-3% more than `ar`'s); and a drafting round's
    small steps on the kernels' route, one C++ call each (+22: tree_mask, accept, retrieve, context_match,
    learn; their ~60 small torch ops cost a Zen 3 ~1.4 ms a round, the calls ~0.2); and pld's chain cut,
    alone, to the length of most tokens a second (+34: Pacer.cut, each length's rounds timed, Slot.length;
    the pacer's median and average as one helper each)."""
    algorithm = ({p.stem for p in ROOT.glob("*.py")} - set(FACES) - set(LOADERS) - set(SERVING) - set(API)
                 - {"calibrate", "tp", "cpu_kernels", "quant"})
    assert algorithm == {"model", "draft", "dflash", "verify", "graft", "engine"}
    lines = sum(sum(1 for ln in (ROOT / f"{m}.py").read_text().splitlines() if ln.strip()) for m in algorithm)
    assert lines <= 3327, lines


def test_no_batched_twins():
    """One kernel per step for every B: no function is a batched twin of another (nothing is named *_each),
    and no method name is tested for inside the engine (methods declare what they need)."""
    for m in ["model", "draft", "dflash", "verify", "graft", "engine"]:
        tree = ast.parse((ROOT / f"{m}.py").read_text())
        names = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not [n for n in names if n.endswith("_each")], m
    src = (ROOT / "engine.py").read_text()
    for name in ("eagle3", "prune", "recycle", "pld", "graft-"):
        assert f'== "{name}' not in src and f"== '{name}" not in src, name


def test_no_module_shadows_an_installed_one():
    """A module of ours named like one an installed distribution provides (or the standard library's)
    hides it from everything run from the repository root: graft's old `kernels.py` hid Hugging Face's
    `kernels`, which transformers 5 imports, and a fresh install failed its tests. Every importable
    name here (the top-level modules and packages, and the tests folder's helpers) is checked against
    what this environment has installed."""
    import importlib.metadata
    import sys
    installed = importlib.metadata.packages_distributions()
    ours = {p.stem for p in ROOT.glob("*.py")} | {p.parent.name for p in ROOT.glob("*/__init__.py")} | {
        p.stem for p in (ROOT / "tests").glob("*.py")}
    clash = {m: installed.get(m, ["the standard library"]) for m in sorted(ours)
             if m in installed or m in sys.stdlib_module_names}
    assert clash == {}, f"rename these modules: each hides an installed one of the same name: {clash}"
