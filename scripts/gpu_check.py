"""The GPU check: what the engine does on a card, section by section, for whoever is lent a GPU.

    python scripts/gpu_check.py --out DIR             # a GPU: widths of Qwen3-8B, within 8 minutes on an H200
    python scripts/gpu_check.py --tiny --out DIR      # the same code on a CPU, tiny shapes (the suite runs it)
    python scripts/gpu_check.py --fake-cuda           # every step on data-less device tensors (the suite runs it)

Each section runs in a process of its own with its own timeout and writes DIR/<section>.json as it
finishes (a section that dies leaves what it wrote); DIR/summary.json lists them, one line per section
is printed, and the exit code is 1 if any failed. It installs nothing and needs neither gguf nor a
model download: random weights shaped like Qwen3-8B (hidden 4096, 32/8 heads, head_dim 128,
intermediate 12288, vocab 151936) and a random EAGLE-3 head shaped like the published ones (one layer,
draft vocabulary 32000). With random weights drafts are never accepted: every number is a cost.

  env        torch, CUDA, cuDNN, the device; which SDPA kernel runs for the decode, verify and prefill
             shapes (folded grouped-query attention, as model.grouped_attention calls it, and what
             enable_gqa=True with a mask would have picked)
  placement  every compiled step of every method once on data-less tensors of a non-CPU device
             (placement_check): a CPU tensor mixed into a step fails it
  engine     2 layers of Qwen3-8B's widths, float32, eager and compiled: every method (ar and graft
             sampled too) and graft at every forced pruning stage, compiled tokens equal eager; then a
             second pass at another prompt length that must record no new CUDA graph and compile
             nothing; no cudagraph skips
  full       the 36-layer shape, bf16, compiled: ms per token and fraction of the card's memory
             bandwidth, the verify pass at 1, 17, 33 and 61 nodes (one graph: the tree size is dynamic),
             a Graft round per stage broken down by phase; graphs compiled and their seconds
  peer       transformers' generate() on the same shape in its own process (cudagraph trees are global
             to a process), eager and with its static cache compiled, warmed at the timed length
"""
import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import calibrate as CAL  # noqa: E402
import cli as CLI  # noqa: E402
import engine as E  # noqa: E402
import graft as GR  # noqa: E402
from draft import Eagle3, HeadConfig  # noqa: E402
from graft import Config, ContinuationMatrix  # noqa: E402
from model import ModelArgs, Transformer, cache_rows  # noqa: E402
from verify import Sampling, Tree, sampling_mode  # noqa: E402

QWEN3_8B = dict(arch="qwen3", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                intermediate_size=12288, norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, qk_norm=True)
TINY = dict(QWEN3_8B, vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128)
HEAD_8B = dict(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate_size=12288, draft_vocab=32000)
HEAD_TINY = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128, draft_vocab=256)
# nominal HBM bandwidth, bytes/s, by the name torch reports (the measured copy bandwidth is reported too)
PEAK = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
        "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "RTX 4090": 1.008e12}
# seconds per section on an H200 (they add up to 8 minutes); --tiny on a CPU gets the same
TIMEOUTS = {"env": 40, "placement": 40, "engine": 160, "full": 170, "peer": 70}
SECTIONS = tuple(TIMEOUTS)
CHECKPOINTS = (0, 1, 5)


# ----------------------------------------------------------------------------- models

def random_target(a: ModelArgs, device, dtype, max_seq_len: int = 1024) -> Transformer:
    with torch.device(device):
        m = Transformer(a).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0, 0.02)
    m.path, m.max_seq_len = "random", max_seq_len
    return m.eval()


def head_args(a: ModelArgs, h: dict) -> HeadConfig:
    layer = ModelArgs(arch="llama", vocab_size=a.vocab_size, dim=h["dim"], n_layers=1, n_heads=h["n_heads"],
                      n_kv_heads=h["n_kv_heads"], head_dim=h["head_dim"], intermediate_size=h["intermediate_size"],
                      norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=a.max_position_embeddings)
    return HeadConfig(layer=layer, target_hidden=a.dim, vocab_size=a.vocab_size, draft_vocab_size=h["draft_vocab"])


def random_head(target: Transformer, h: dict, device, dtype) -> Eagle3:
    a = target.args
    with torch.device(device):
        head = Eagle3(head_args(a, h)).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        head.d2t.copy_(torch.arange(h["draft_vocab"], device=device) * (a.vocab_size // h["draft_vocab"] - 1))
    head.embed_tokens = target.embed_tokens
    head.path = "random"
    return head.eval()


def engine(model, head, compile: bool, backend: str, chunk: int = 128, batch: int = 1) -> E.Engine:
    """An engine with `batch` slots on the random pair, its caches with room for every method at budget
    60 (the largest this check runs) and the 61-node cost trees."""
    matrix = ContinuationMatrix(model.args.vocab_size, 8, device=model.embed_tokens.weight.device)
    window = not (compile and model.embed_tokens.weight.is_cuda)
    nodes, path = CLI.room([(m, Config(budget=60)) for m in E.METHODS], (10, 8), batch)
    return E.Engine(model, None, head, matrix, batch, max(nodes, 61), max(path, CAL.COST_PATH), 10, 8, compile=compile,
                    window=window, chunk=chunk, backend=backend)


def forced(stage, checkpoints=CHECKPOINTS) -> dict:
    """Thresholds that prune exactly at `stage` (None: never): 0 never prunes, 2 always does."""
    return {c: (2.0 if stage is not None and c == stage else 0.0) for c in checkpoints}


# ----------------------------------------------------------------------------- placement

def placement_check(device: str = "meta", tiny: dict = TINY) -> dict:
    """Every compiled step of every method, run once on tensors of `device` (default: meta, which holds
    no data, so it runs anywhere; any op that mixes a CPU tensor with it raises, as CUDA would). Steps
    run one by one, without the round's host syncs (a data-less tensor cannot be read). Returns
    {"<method>/<step>": "ok" or the error's first line, "missing": steps the engine compiled that this
    check did not run}. (FakeTensorMode's CUDA tensors would be the closer stand-in, but on a CPU-only
    build of torch 2.13 indexing and copy_ take a CUDA device guard and fail, and embedding aborts the
    process.)"""
    a = ModelArgs(**dict(tiny, max_position_embeddings=4096))
    with torch.device("meta"):
        model, head = Transformer(a), Eagle3(head_args(a, HEAD_TINY))
    model, head = model.to_empty(device=device), head.to_empty(device=device)
    head.embed_tokens, model.max_seq_len, model.path = model.embed_tokens, 256, "random"
    out, ran, compiled = {}, set(), set()
    C = 16

    def run(name, fn):
        ran.add(name.split("/")[-1])
        try:
            fn()
            out[name] = "ok"
        except Exception as e:      # noqa: BLE001 - reported, the caller fails on it
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    with torch.no_grad():
        for window in (True, False):
            cfg = Config(budget=12, checkpoints=(0, 1, 3), thresholds={0: 0.5, 1: 0.5, 3: 0.5})
            nodes, path = CLI.room([(m, cfg) for m in E.METHODS], (4, 6), 2)
            eng = E.Engine(model, None, head, ContinuationMatrix(a.vocab_size, 8, device=device), 2, max(nodes, 61),
                           max(path, CAL.COST_PATH), 4, 6, chunk=C, window=window)
            st, mode_name = eng.steps, "window" if window else "full"
            for method in E.METHODS:
                p = eng.make(method, cfg)
                for s in (Sampling(), Sampling(temperature=0.8, top_p=0.9, top_k=20, seed=3)):
                    tag = f"{mode_name}/{method}/{'sampled' if s.temperature else 'greedy'}"
                    mode = sampling_mode([s])
                    eng.smp.set(0, s)
                    p.admit(eng, 0)
                    toks = torch.zeros(1, C, dtype=torch.long, device=device)
                    got = {}
                    eng.fills.n.fill_(5)
                    run(f"{tag}/prefill", lambda: got.update(out=st.prefill(
                        toks, eng.L, eng.fills.n, eng.slot_index(0), eng.cols(C, b=0), p.needs_head, eng.smp, mode, eng.root)))
                    if "out" in got:         # the matrix update and the head's prefill, where the method has them
                        run(f"{tag}/prompt_chunk", lambda: p.prompt_chunk(eng, 0, toks, *got["out"][:2], 5))
                        ran.update(x for x, has in (("matrix_update", p.matrix is not None),
                                                    ("head_prefill", p.needs_head)) if has)
                        if p.needs_head:
                            run(f"{tag}/prefilled", lambda: p.prefilled(eng, 0))
                    if isinstance(p, GR.Plain):
                        run(f"{tag}/decode", lambda: st.decode(eng.root, eng.L, eng.active, eng.cols(1), eng.smp, mode))
                        continue
                    tree = {}
                    if isinstance(p, GR.Recycle):
                        run(f"{tag}/recycle_tree", lambda: tree.update(t=st.recycle_tree(p, eng.root, eng.active)))
                    elif isinstance(p, GR.PromptLookup):
                        tree["t"] = Tree(p.chains[0], p.parents, p.chains[1] > 0)
                    else:
                        d = eng.drafter
                        run(f"{tag}/extend", lambda: st.extend(p.pend_feats, p.pend_ids, p.pend_n, eng.cols(p.P, head=True)))
                        for i in range(d.depth - 1):
                            run(f"{tag}/level", lambda: st.level(eng.fills.level[i], eng.cols((d.depth - 1) * d.top_k, head=True)))
                        run(f"{tag}/assemble", lambda: tree.update(t=st.assemble(p, eng.root, eng.active)))
                    if "t" in tree:
                        v = {}
                        run(f"{tag}/verify", lambda: v.update(v=st.verify(tree["t"], eng.L, eng.active, eng.cols(p.N), eng.smp,
                                                                          mode, p.P, p.needs_head, eng.root)))
                        if "v" in v:
                            run(f"{tag}/learn", lambda: st.learn(p, tree["t"], v["v"], eng.active))
            mode = sampling_mode([Sampling()])
            for n in (9, 13, 17, 25, 33, 49, 61):           # every size --budget auto times, and the GPU check's
                tree, P = CAL.cost_tree(torch.zeros(n, dtype=torch.long, device=device), eng.B)
                run(f"{mode_name}/cost/verify_{n}", lambda: st.verify(tree, eng.L, eng.active, eng.cols(n), eng.smp, mode,
                                                                      P, True, eng.root))
            compiled |= set(st.names)
    out["missing"] = sorted(compiled - ran)
    return out


# ----------------------------------------------------------------------------- measuring

def weight_bytes(model) -> int:
    """Bytes a decoding step reads: every weight but the embedding table (one row of it is read)."""
    embed = model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed or model.args.tie_word_embeddings)


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy (reads and writes counted)."""
    x = torch.empty(256 * 2 ** 20 // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    E.sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    E.sync(device)
    return 2 * x.numel() * x.element_size() * 10 / (time.perf_counter() - t0)


def graph_counts() -> dict:
    """Graphs dynamo compiled and CUDA graphs recorded so far in this process."""
    from torch._dynamo.utils import counters
    out = {"dynamo_graphs": counters["stats"]["unique_graphs"], "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}
    if torch.cuda.is_available():
        try:
            from torch._inductor import cudagraph_trees
            mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
            out["cuda_graphs"] = 0 if mgr is None else int(mgr.new_graph_id().id)   # (consumes one id)
        except Exception as e:     # noqa: BLE001 - internal API: report, do not fail on it
            out["cuda_graphs"] = f"unknown ({type(e).__name__})"
    return out


def sdpa_choice(q, k, v, mask, enable_gqa=False) -> str:
    from torch.nn.attention import SDPBackend
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)).name
    except Exception as e:     # noqa: BLE001
        return f"unknown ({type(e).__name__}: {str(e)[:80]})"


# ----------------------------------------------------------------------------- sections

def section_env(args, save):
    cuda = torch.cuda.is_available() and not args.tiny
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    r = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
         "device": torch.cuda.get_device_name() if cuda else "cpu", "python": sys.version.split()[0]}
    a = ModelArgs(**(TINY if args.tiny else QWEN3_8B))
    H, Hkv, D, S = a.n_heads, a.n_kv_heads, a.head_dim, cache_rows(E.DEFAULT_MAX_SEQ_LEN + E.PREFILL_CHUNK)
    G_ = H // Hkv
    k = torch.randn(1, Hkv, S, D, device=dev, dtype=dtype)
    kinds = {}
    for name, T in (("decode", 1), ("verify_61", 61), ("prefill_128", 128)):
        mask = torch.zeros(T, S, device=dev, dtype=dtype)
        kinds[name] = {"folded": sdpa_choice(torch.randn(1, Hkv, G_ * T, D, device=dev, dtype=dtype), k, k, mask.repeat(G_, 1)),
                       "enable_gqa": sdpa_choice(torch.randn(1, H, T, D, device=dev, dtype=dtype), k, k, mask, True)}
    r["sdpa_kernel"] = kinds
    r["cache_rows"] = S
    save(r)


def section_placement(args, save):
    got = placement_check()
    bad = {k: v for k, v in got.items() if k != "missing" and v != "ok"}
    save({"steps": len(got) - 1, "failed": bad, "missing": got["missing"]})
    if bad or got["missing"]:
        raise SystemExit(f"{len(bad)} steps failed, {len(got['missing'])} not run: {list(bad.items())[:3]} {got['missing']}")


def section_engine(args, save):
    """2 layers of Qwen3-8B's widths in float32: compiled tokens equal eager for every method and stage;
    a second pass records and compiles nothing."""
    cuda = torch.cuda.is_available() and not args.tiny
    device, backend = ("cuda", "inductor") if cuda else ("cpu", "aot_eager")
    a = ModelArgs(**dict(TINY if args.tiny else QWEN3_8B, n_layers=2))
    torch.manual_seed(0)
    model = random_target(a, device, torch.float32, max_seq_len=512)
    head = random_head(model, HEAD_TINY if args.tiny else HEAD_8B, device, torch.float32)
    eager, comp = engine(model, head, False, backend, args.chunk), engine(model, head, True, backend, args.chunk)
    prompt = torch.randint(0, a.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy, sampled = Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=7)
    # every method greedy, ar and graft sampled too, graft at each forced stage (prune's stages are
    # graft's without retrieval): every kind of graph, without compiling one per combination
    runs = [(m, None, greedy) for m in E.METHODS] + [(m, None, sampled) for m in ("ar", "graft")] + \
        [("graft", s, greedy) for s in CHECKPOINTS]

    def method(e, m, stage):
        cfg = Config(budget=24, thresholds=forced(stage)) if m in E.PRUNING else Config(budget=24)
        return E.make_method(e, m, cfg)

    made = {(m, s): (method(eager, m, s), method(comp, m, s)) for m, s in dict.fromkeys((m, s) for m, s, _ in runs)}
    r = {"same": {}, "seconds": {}}
    t0 = time.perf_counter()
    for m, s, samp in runs:
        (pe, pc), name = made[(m, s)], f"{m}{'' if s is None else f'@stage{s}'}/{'sampled' if samp.temperature else 'greedy'}"
        t = time.perf_counter()
        r["same"][name] = (E.generate(eager, pe, prompt, 12, samp, ()).tokens ==
                           E.generate(comp, pc, prompt, 12, samp, ()).tokens)
        r["seconds"][name] = round(time.perf_counter() - t, 2)
        save(r)
    r["first_pass_seconds"] = round(time.perf_counter() - t0, 1)
    before = graph_counts()
    for m, s, samp in runs:                       # another prompt length: nothing new may be built
        E.generate(comp, made[(m, s)][1], prompt[:97], 12, samp, ())
    after = graph_counts()
    r["second_pass_new"] = {k: (after[k] - before[k]) if isinstance(after[k], int) and isinstance(before[k], int)
                            else after[k] for k in after}
    r["graphs"] = after
    save(r)
    bad = [k for k, v in r["same"].items() if not v]
    new = {k: v for k, v in r["second_pass_new"].items() if v}
    if bad or new or after["cudagraph_skips"]:
        raise SystemExit(f"compiled differs from eager: {bad}; new in the second pass: {new}; "
                         f"cudagraph skips: {after['cudagraph_skips']}")


def section_full(args, save):
    """The whole shape, bf16 on a GPU (float32 --tiny on a CPU), compiled."""
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype, backend = ("cuda", torch.bfloat16, "inductor") if cuda else ("cpu", torch.float32, "aot_eager")
    a = ModelArgs(**(TINY if args.tiny else QWEN3_8B))
    torch.manual_seed(0)
    model = random_target(a, device, dtype, max_seq_len=1024)
    head = random_head(model, HEAD_TINY if args.tiny else HEAD_8B, device, dtype)
    comp = engine(model, head, True, backend, args.chunk)
    prompt = torch.randint(0, a.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    n = args.tokens
    r = {"shape": "tiny" if args.tiny else "Qwen3-8B", "dtype": str(dtype).replace("torch.", ""), "tokens": n,
         "weight_bytes": weight_bytes(model), "device": torch.cuda.get_device_name() if cuda else "cpu"}
    peak = next((v for k, v in PEAK.items() if k in r["device"]), None)
    r["peak_bytes_per_s"] = {"nominal": peak, "measured_copy": round(copy_bandwidth(device))}
    compile_s = {}

    def timed(what, fn):
        g0, t = graph_counts()["dynamo_graphs"], time.perf_counter()
        out = fn()
        compile_s[what] = {"graphs": graph_counts()["dynamo_graphs"] - g0, "seconds": round(time.perf_counter() - t, 1)}
        return out

    ar = E.make_method(comp, "ar")
    timed("ar (decode, prefill)", lambda: E.generate(comp, ar, prompt, 8, Sampling(), ()))
    res = E.generate(comp, ar, prompt, n, Sampling(), ())
    ms = res.times["verify"] / max(res.rounds, 1) * 1000
    bw = r["weight_bytes"] / (ms / 1000)
    r["ar"] = {"ms_per_token": round(ms, 3), "tokens_per_s": round(1000 / ms, 1),
               "bandwidth_fraction": round(bw / peak, 4) if peak else None,
               "bandwidth_fraction_of_copy": round(bw / r["peak_bytes_per_s"]["measured_copy"], 4)}
    save(dict(r, compile=compile_s))
    ctx, cost = timed("verify (one dynamic graph)", lambda: CAL.pass_cost(comp, [1, 17, 33, 61], context=128, repeats=10))
    r["verify_ms"] = {"context": ctx, **{str(k): v for k, v in cost.items()}, "61_over_1": round(cost[61] / cost[1], 3)}
    save(dict(r, compile=compile_s))
    r["graft_round_ms"] = {}
    for stage in (None, *CHECKPOINTS):
        m = E.make_method(comp, "graft", Config(budget=60, thresholds=forced(stage)))
        timed(f"graft stage {stage}", lambda: E.generate(comp, m, prompt, 6, Sampling(), ()))
        res = E.generate(comp, m, prompt, max(n // 4, 8), Sampling(), ())
        ms = {k: round(v / res.rounds * 1000, 3) for k, v in res.times.items() if k != "prefill"}
        r["graft_round_ms"]["full" if stage is None else str(stage)] = dict(
            ms, total=round(sum(ms.values()), 3), overhead=round(1 - ms["verify"] / sum(ms.values()), 4))
        save(dict(r, compile=compile_s))
    r["compile"], r["graphs"] = compile_s, graph_counts()
    save(r)


def section_peer(args, save):
    """transformers' generate() on the same shape, in this process alone: ms per new token."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    a = ModelArgs(**(TINY if args.tiny else QWEN3_8B))
    cfg = Qwen3Config(vocab_size=a.vocab_size, hidden_size=a.dim, num_hidden_layers=a.n_layers,
                      num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim,
                      intermediate_size=a.intermediate_size, rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta,
                      max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen3ForCausalLM(cfg).to(dtype).eval()
    prompt = torch.randint(0, a.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0)).to(device)
    n, r = args.tokens, {}
    for name, compiled in (("eager", False), ("static_compiled", True)):
        kw = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        if compiled:       # transformers' documented fast path: a static cache and a compiled forward
            kw["cache_implementation"] = "static"
            fwd = torch.compile(hf.forward, fullgraph=True,
                                **(dict(mode="reduce-overhead") if cuda else dict(backend="aot_eager")))

            def step(*x, **y):      # each forward is a new generation of CUDA graph outputs
                if cuda:
                    torch.compiler.cudagraph_mark_step_begin()
                return fwd(*x, **y)
            hf.forward = step
        with torch.no_grad():
            hf.generate(prompt, **kw)                      # warm at the timed length
            E.sync(device)
            t0 = time.perf_counter()
            hf.generate(prompt, **dict(kw, max_new_tokens=1, min_new_tokens=1))
            E.sync(device)
            t1 = time.perf_counter()
            hf.generate(prompt, **kw)
            E.sync(device)
            t2 = time.perf_counter()
        # the 1-token run is the prefill: what remains is n-1 decoding steps
        r[name] = {"ms_per_token": round(((t2 - t1) - (t1 - t0)) / (n - 1) * 1000, 3)}
        save(r)


RUN = {"env": section_env, "placement": section_placement, "engine": section_engine, "full": section_full,
       "peer": section_peer}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check", help="folder for one JSON per section and summary.json")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (what the suite runs)")
    p.add_argument("--fake-cuda", action="store_true", help="only the placement section: every step on data-less "
                   "tensors of a non-CPU device")
    p.add_argument("--sections", default=None, help=f"comma-separated, from {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--tokens", type=int, default=128, help="tokens decoded per timing")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)       # a child process: run one section
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        path = out / f"{args.section}.json"
        RUN[args.section](args, lambda r: path.write_text(json.dumps(r, indent=1) + "\n"))
        return 0
    names = ["placement"] if args.fake_cuda else [s.strip() for s in (args.sections or ",".join(SECTIONS)).split(",")]
    unknown = [s for s in names if s not in RUN]
    if unknown:
        print(f"error: unknown section(s) {unknown}: choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    summary, t_all = {}, time.time()
    for s in names:
        (out / f"{s}.json").unlink(missing_ok=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--section", s, "--out", str(out), "--tokens", str(args.tokens),
               "--chunk", str(args.chunk)] + (["--tiny"] if args.tiny else [])
        t = time.time()
        limit = TIMEOUTS[s] * (4 if args.tiny else 1)      # a shared CPU compiles slower than an H200's host
        try:
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            ok, why = got.returncode == 0, (got.stderr.strip().splitlines() or [""])[-1][:300]
        except subprocess.TimeoutExpired:
            ok, why = False, f"timed out after {limit} s"
        f = out / f"{s}.json"
        summary[s] = {"ok": ok, "seconds": round(time.time() - t, 1), "why": None if ok else why,
                      "result": json.loads(f.read_text()) if f.is_file() else None}
        print(f"{s:<10} {'ok    ' if ok else 'FAILED'} {summary[s]['seconds']:>6.1f}s  {'' if ok else why}", flush=True)
    summary["wall_seconds"] = round(time.time() - t_all, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(v["ok"] for k, v in summary.items() if k != "wall_seconds") else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except Exception:      # noqa: BLE001 - a child's traceback, for the parent's one line
        traceback.print_exc()
        sys.exit(1)
