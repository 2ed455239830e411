"""The GPU check: what the engine does on a card, in one call within a total time limit.

    python scripts/gpu_check.py --out DIR                     # a GPU: Qwen3-8B's widths, within --time-limit (420 s)
    python scripts/gpu_check.py --dry-run [--time-limit S]    # the plan: sections, graphs, expected and allowed time
    python scripts/gpu_check.py --tiny --out DIR              # the same code on a CPU, tiny shapes (the suite runs it)
    python scripts/gpu_check.py --fake-cuda                   # placement only (the suite calls its check directly)

It installs nothing and needs neither gguf nor a download: it runs on the lent machine's own torch
(2.11) and transformers (5.17). Random weights shaped like Qwen3-8B (hidden 4096, 32/8 heads, head_dim
128, intermediate 12288, vocab 151936) and a random EAGLE-3 head shaped like the published ones (one
layer, draft vocabulary 32000): drafts are never accepted, so every timing is a cost.

Sections run in order of what they prove, each in a process of its own (cudagraph trees are global
to a process; a section that dies or times out leaves what it wrote). Each gets a share of the time
left: its expected seconds over the expected seconds of every section still to run, times what is
left of --time-limit (a section that finishes early leaves its time to the later ones). Each writes
DIR/<section>.json as it goes, DIR/summary.json is rewritten after every section, one line is printed
per section as it ends and a plain summary last; the exit code is 1 if any section failed or did not
run.

  env        torch, CUDA, the device; the SDPA kernel for the decode, verify and prefill shapes
  placement  every step of every method in whole rounds on data-less tensors of a non-CPU device, under
             a dispatch mode that refuses any op whose tensors sit on two devices (OneDevice)
  engine     4 layers at Qwen3-8B's widths, float32, compiled: ar, and graft at one budget forced to
             stop at checkpoint 0 and to draft to full depth (one method instance: the stage is data).
             After the first pass (before anything else can time out): no cudagraph skip and no
             unexpected re-recording. A second pass at another prompt length: no new dynamo graph and
             no new CUDA graph recording
  lossless   the same model and runs, compiled and eager (on a GPU the compiled graphs come from
             inductor's cache, filled by `engine`): every run's tokens equal eager plain decoding's
  speed      the 36-layer shape, bf16, compiled: one decode graph and one 61-node verify graph (the
             prefill runs eager: it is not timed); ms per token, tokens/s of a whole ar generation, the
             fraction of the card's memory bandwidth, verify(61) over decode
  peer       transformers' generate() on the speed shape: eager, and with its static cache and our
             own compiled decode forward (disable_compile=True: transformers compiles nothing itself;
             its prefill runs eager), warmed at the timed length
"""
import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import calibrate as CAL  # noqa: E402
import cli as CLI  # noqa: E402
import engine as E  # noqa: E402
from dflash import DFlash, DFlashConfig, share_features  # noqa: E402
from draft import Eagle3, HeadConfig  # noqa: E402
from graft import Config, ContinuationMatrix  # noqa: E402
from model import ModelArgs, Transformer, cache_rows  # noqa: E402
from verify import Sampling  # noqa: E402

QWEN3_8B = dict(arch="qwen3", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                intermediate_size=12288, norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, qk_norm=True)
TINY = dict(QWEN3_8B, vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128)
HEAD_8B = dict(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate_size=12288, draft_vocab=32000)
HEAD_TINY = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128, draft_vocab=256)
# nominal HBM bandwidth, bytes/s, by the name torch reports (the measured copy bandwidth is reported too)
PEAK = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
        "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "RTX 4090": 1.008e12}
CHECKPOINTS = (0, 1, 5)
ENGINE_LAYERS, BUDGET, STAGES = 4, 24, (0, None)     # the engine and lossless sections' model and runs
# the graphs the engine section compiles (dynamo graphs; on a GPU each is also one CUDA graph per path)
ENGINE_GRAPHS = ("ar: prefill", "ar: decode", "graft: prefill with features", "graft: head_prefill",
                 "graft: extend", "graft: level", "graft: assemble", "graft: verify", "graft: learn")
# The plan, in order: (section, what it proves, graphs it compiles, expected seconds on an H200 from a
# cold cache, expected seconds of --tiny on a quiet 2-core CPU, measured). The H200 numbers are
# estimates (no GPU has run this): about 12 s a graph of a few layers, 45 s one of 36 layers, plus
# start-up. Only their ratios matter to the limits; a loaded CPU stretches them all alike, but not
# every CPU alike: the --tiny numbers are the slowest kind's (an AVX2 Zen 3), where placement, all
# Python dispatch on meta tensors, took 79 s (14 when first measured on a Xeon), while engine took about the same.
PLAN = (
    ("env", "torch, CUDA, the device, SDPA's kernel per shape", (), 15, 5),
    ("placement", "no step mixes devices (meta tensors, OneDevice)", (), 25, 80),
    ("engine", "CUDA graphs: no skip, no re-recording after the first pass; nothing new in a second",
     ENGINE_GRAPHS, 140, 33),
    ("lossless", "compiled and eager tokens equal plain decoding's (4 layers, float32)",
     ("the engine section's 9 again, from inductor's cache on a GPU",), 70, 29),
    ("speed", "ms per token and verify(61) over decode at the 36-layer shape, bf16",
     ("decode (36 layers)", "verify 61 nodes (36 layers)"), 110, 11),
    ("peer", "transformers' generate() at the same shape: eager and static cache compiled",
     ("transformers decode forward (36 layers)",), 60, 12),
)
SECTIONS = tuple(s for s, *_ in PLAN)
RESERVE = 3          # seconds kept for the summary after the last section


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


def engine(model, head, compile: bool, backend: str, chunk: int = 128) -> E.Engine:
    """One slot on the random pair, attention over the whole cache (what CUDA graphs need: the CPU
    rehearsal takes the same path), room for ar and graft at BUDGET and the 61-node cost trees."""
    matrix = ContinuationMatrix(model.args.vocab_size, 8, device=model.embed_tokens.weight.device)
    nodes, path = CLI.room([(m, Config(budget=BUDGET)) for m in ("ar", "graft")], (10, 8), 1)
    return E.Engine(model, None, head, matrix, 1, max(nodes, 61), max(path, CAL.COST_PATH), 10, 8, compile=compile,
                    window=False, chunk=chunk, backend=backend)


def force(m, stage):
    """Make the graft instance m stop at checkpoint `stage` (None: draft to full depth) by data alone:
    its thresholds (host) and their device copy (m.taus) are rewritten in place, so one instance, and
    one set of graphs, serves every stage. 2.0 is above any confidence, 0.0 below."""
    taus = {c: (2.0 if c == stage else 0.0) for c in m.checkpoints}
    m.thresholds.update(taus)
    m.taus.copy_(torch.tensor([taus[c] for c in m.checkpoints], dtype=m.taus.dtype))


def setting(tiny: bool):
    """(device, backend, cuda?) of the compiled sections: CUDA graphs on a GPU; --tiny, or no GPU, the
    CPU with aot_eager (dynamo's tracing and functionalisation, no code generation)."""
    cuda = torch.cuda.is_available() and not tiny
    return ("cuda", "inductor", True) if cuda else ("cpu", "aot_eager", False)


# ----------------------------------------------------------------------------- placement

class OneDevice(TorchDispatchMode):
    """Refuses any op whose tensor arguments sit on two devices, as CUDA would, or as a CUDA graph
    would not capture: the meta device alone lets index_select, gather, scatter_add_, embedding and
    searchsorted take a CPU operand, and takes a CPU 0-dim tensor anywhere (so does CUDA outside a
    graph; inside a compiled step it is a cudagraph skip). Copies between devices (copy_, _to_copy)
    are transfers, counted elsewhere (tests/test_gpu_contract.py), and pass. Raises RuntimeError
    naming the op and the devices."""

    TRANSFERS = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default, torch.ops.aten.copy.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.TRANSFERS:
            devices = {t.device for t in E.tensors_in((list(args), kwargs))}
            if len(devices) > 1:
                raise RuntimeError(f"{func} mixes devices {sorted(map(str, devices))}")
        return func(*args, **kwargs)


class EveryOtherRound(E.Pacer):
    """A pacer that makes every other round plain (Method.plain_round), whatever the costs, and at B > 1
    lets only some slots draft in the others: every kind of round runs."""

    def plan(self, eng, method) -> list:
        self.n = getattr(self, "n", 0) + 1
        return [s.request is not None and self.n % 2 == 0 and (b + self.n) % 3 != 0 for b, s in enumerate(eng.slots)]


def placement_check(batch: int, window: bool, device: str = "meta", methods=E.METHODS, strict: bool = True,
                    tiny: dict = TINY) -> dict:
    """Every compiled step of every method (of `methods`), in whole rounds (batch + 2 requests through
    `batch` slots: refills, at a batch one joining the others' round), on tensors of `device` (meta holds no data, so it runs anywhere), under
    OneDevice (strict=False: meta's own checks alone, to show what they miss), greedy and sampled,
    and the verify step at every size --budget auto times. The host's reads of
    data-less tensors (the prefill's, commit's, the checkpoints') read ones. Returns {"<method>/
    <sampling>": "ok" or the error's first line, "<method>/<sampling>/<step>": the error of the step
    that raised, "cost/verify_<n>": ..., "missing": steps the engine compiled that never ran}.
    (FakeTensorMode's CUDA tensors would be the closer stand-in, but on a CPU-only build of torch
    indexing and copy_ take a CUDA device guard and fail, and embedding aborts the process.)"""
    a = ModelArgs(**dict(tiny, max_position_embeddings=4096))
    with torch.device("meta"):
        model, head = Transformer(a), Eagle3(head_args(a, HEAD_TINY))
        block = DFlash(DFlashConfig(ModelArgs(**dict(tiny, n_layers=1, qk_norm=True)), 1, 4, 3, (0,)))
    model, head, block = model.to_empty(device=device), head.to_empty(device=device), block.to_empty(device=device)
    head.embed_tokens, model.max_seq_len, model.path, block._target = model.embed_tokens, 256, "random", (model,)
    cols = share_features(model, block, head) if set(methods) & E.NEEDS_BLOCK else None   # a DFlash drafter too
    nodes, path = CLI.room([(m, Config(budget=60)) for m in E.METHODS], (4, 4), batch)
    eng = E.Engine(model, None, head, ContinuationMatrix(a.vocab_size, 8, device=device), batch, nodes, path, 4, 4,
                   chunk=16, window=window, **(dict(dflash=block, dflash_cols=cols) if set(methods) & E.NEEDS_BLOCK else {}))
    out, ran, tag = {}, set(), [None]
    for name in sorted(eng.steps.names):             # each step, watched: which ran, which raised
        def watched(*args, _step=getattr(eng.steps, name), _name=name, **kw):
            ran.add(_name)
            try:
                with OneDevice() if strict else contextlib.nullcontext():
                    return _step(*args, **kw)
            except Exception as e:
                out.setdefault(f"{tag[0]}/{_name}", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                raise
        setattr(eng.steps, name, watched)
    tolist = torch.Tensor.tolist
    ones = lambda self: [1] * self.numel() if self.is_meta else tolist(self)
    cfg = Config(budget=12, checkpoints=(0, 1, 3), thresholds={0: 0.5, 1: 0.5, 3: 0.5})
    with mock.patch.object(torch.Tensor, "tolist", ones), torch.no_grad():
        for name in methods:
            for s in (Sampling(), Sampling(temperature=0.8, top_p=0.9, top_k=20, seed=3)):
                tag[0] = f"{name}/{'sampled' if s.temperature else 'greedy'}"
                m = eng.make(name, cfg)
                if m.paced:                                     # plain rounds, and rounds where some slots draft
                    m.pacer = EveryOtherRound()
                # (request 1 ends first; at a batch, the last one, short, joins the others' round: Engine.join)
                reqs = [E.Request([1] + list(range(2, 2 + (7 * i if i <= batch else 3))), s, i,
                                  max_new_tokens=3 if i == 1 else 6) for i in range(batch + 2)]
                try:
                    E.run(eng, m, reqs, 6)
                    out[tag[0]] = "ok"
                except Exception as e:      # noqa: BLE001 - reported, the caller fails on it
                    out[tag[0]] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    for b, r in enumerate(eng.requests()):
                        if r is not None:
                            eng.free(b, m)
        for n in (9, 13, 17, 25, 33, 49, 61):          # every size --budget auto times, and the speed section's
            tag[0] = f"cost/verify_{n}"
            tree, P = CAL.cost_tree(torch.zeros(n, dtype=torch.long, device=device), batch)
            try:
                eng.steps.verify(tree, eng.L, eng.active, eng.cols(n), eng.smp, eng.mode, P, True, eng.root)
                out[tag[0]] = "ok"
            except Exception as e:          # noqa: BLE001
                out[tag[0]] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    out["missing"] = sorted(eng.steps.names - ran)
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


def graph_state() -> dict:
    """What this process compiled and recorded so far: dynamo graphs; cudagraph skips (a graph that
    silently runs without CUDA graphs); inputs recorded as non-static (copied in on every replay);
    and, on CUDA, the CUDA graphs recorded (nodes of the cudagraph tree) and the unexpected
    re-recordings (cudagraph_trees' own count, the one its re-record limit reads). Raises
    RuntimeError when the tree cannot be read on CUDA: a check that cannot look must not pass."""
    from torch._dynamo.utils import counters
    out = {"dynamo_graphs": int(counters["stats"]["unique_graphs"]),
           "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
           "non_static_inputs": int(counters["inductor"]["cudagraph_recorded_non_static_inputs"]),
           "cuda_graphs": 0, "rerecords": 0}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            from torch._inductor import cudagraph_trees
            mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
            if mgr is not None:
                nodes = [n for roots in mgr.roots.values() for n in roots]
                while nodes:
                    n = nodes.pop()
                    out["cuda_graphs"] += 1
                    nodes.extend(c for cs in n.children.values() for c in cs)
                out["rerecords"] = sum(sum(d.values()) for d in mgr.num_rerecord.values())
        except (ImportError, AttributeError, TypeError) as e:
            raise RuntimeError(f"cannot read the cudagraph tree on torch {torch.__version__}: {e!r}") from e
    return out


def sdpa_choice(q, k, v, mask, enable_gqa=False) -> str:
    from torch.nn.attention import SDPBackend
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)).name
    except Exception as e:     # noqa: BLE001 - reported as what it is
        return f"unknown ({type(e).__name__}: {str(e)[:80]})"


# ----------------------------------------------------------------------------- sections

def section_env(args, save):
    cuda = torch.cuda.is_available() and not args.tiny
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    r = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
         "device": torch.cuda.get_device_name() if cuda else "cpu", "python": sys.version.split()[0]}
    try:
        import transformers
        r["transformers"] = transformers.__version__
    except ImportError:
        r["transformers"] = None            # the peer section will say so
    a = ModelArgs(**(TINY if args.tiny else QWEN3_8B))
    H, Hkv, D, S = a.n_heads, a.n_kv_heads, a.head_dim, cache_rows(E.DEFAULT_MAX_SEQ_LEN + E.PREFILL_CHUNK)
    G_ = H // Hkv
    k = torch.randn(1, Hkv, S, D, device=dev, dtype=dtype)
    kinds = {}
    for name, T in (("decode", 1), ("verify_61", 61), ("prefill_128", 128)):
        mask = torch.zeros(T, S, device=dev, dtype=dtype)
        kinds[name] = {"folded": sdpa_choice(torch.randn(1, Hkv, G_ * T, D, device=dev, dtype=dtype), k, k, mask.repeat(G_, 1)),
                       "enable_gqa": sdpa_choice(torch.randn(1, H, T, D, device=dev, dtype=dtype), k, k, mask, True)}
    r["sdpa_kernel"], r["cache_rows"] = kinds, S
    save(r)


def section_placement(args, save):
    r = {}
    for batch, window in ((1, True), (2, False)):
        got = placement_check(batch, window)
        r[f"B{batch}/{'window' if window else 'full'}"] = {
            "runs": len(got) - 1, "failed": {k: v for k, v in got.items() if k != "missing" and v != "ok"},
            "missing": got["missing"]}
        save(r)
    bad = {k: v for k, v in r.items() if v["failed"] or v["missing"]}
    if bad:
        raise SystemExit(f"placement: {json.dumps(bad)[:400]}")


def engine_pair(args, *compiled: bool) -> tuple:
    """The engine and lossless sections' setup: ENGINE_LAYERS layers of the shape in float32 (exact
    comparisons), and one engine per entry of `compiled` on it (one slot, full attention), each with
    its ar and one graft instance; returns ([(engine, {run name: (method, stage)})], prompt ids)."""
    device, backend, _ = setting(args.tiny)
    a = ModelArgs(**dict(TINY if args.tiny else QWEN3_8B, n_layers=ENGINE_LAYERS))
    torch.manual_seed(0)
    model = random_target(a, device, torch.float32, max_seq_len=512)
    head = random_head(model, HEAD_TINY if args.tiny else HEAD_8B, device, torch.float32)
    out = []
    for c in compiled:
        eng = engine(model, head, c, backend, args.chunk)
        ar, graft = eng.make("ar"), eng.make("graft", Config(budget=BUDGET, thresholds=dict.fromkeys(CHECKPOINTS, 0.5),
                                                                 pace=False))     # (plain rounds: placement's)
        # (thresholds that can prune: graft keeps its retrieval; force() sets each run's in place)
        out.append((eng, {"ar": (ar, None), **{f"graft@{'full' if s is None else f'stage{s}'}": (graft, s) for s in STAGES}}))
    return out, torch.randint(0, a.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()


def generate(eng, runs, name, prompt, n):
    m, stage = runs[name]
    if m.name == "graft":
        force(m, stage)
    return E.generate(eng, m, prompt, n, Sampling(), ())


def section_engine(args, save):
    """Compiled ar and graft (two stages): after the first pass no cudagraph skip and no unexpected
    re-recording (saved and asserted before anything else runs); a second pass at another prompt
    length compiles and records nothing."""
    [(eng, runs)], prompt = engine_pair(args, True)
    r = {"graphs_planned": len(ENGINE_GRAPHS), "stages": {}, "seconds": {}}
    t0 = time.perf_counter()
    for name in runs:
        t = time.perf_counter()
        res = generate(eng, runs, name, prompt, 12)
        r["seconds"][name] = round(time.perf_counter() - t, 2)
        r["stages"][name] = {str(k): v for k, v in res.stages.items()}
    r["first_pass_seconds"], r["first_pass"] = round(time.perf_counter() - t0, 1), graph_state()
    save(r)
    first = r["first_pass"]
    if first["cudagraph_skips"] or first["rerecords"]:
        raise SystemExit(f"after the first pass: {first['cudagraph_skips']} cudagraph skips, "
                         f"{first['rerecords']} unexpected re-recordings")
    for name in runs:                              # another prompt length (one prefill chunk, not two)
        generate(eng, runs, name, prompt[:97], 12)
    after = graph_state()
    r["second_pass_new"] = {k: after[k] - first[k] for k in after}
    save(r)
    want = {"graft@stage0": {"0": 1}, "graft@full": {"None": 1}}
    wrong = {k: v for k, v in r["stages"].items() if k in want and set(v) != set(want[k])}
    new = {k: v for k, v in r["second_pass_new"].items() if v and k != "non_static_inputs"}
    if wrong or new or first["dynamo_graphs"] != len(ENGINE_GRAPHS):
        raise SystemExit(f"stages not forced: {wrong}; new in the second pass: {new}; dynamo graphs after the "
                         f"first pass {first['dynamo_graphs']}, planned {len(ENGINE_GRAPHS)}")


def section_lossless(args, save):
    """The engine section's runs, compiled and eager: every run's tokens equal eager ar's."""
    [(comp, runs), (eager, eruns)], prompt = engine_pair(args, True, False)
    want = generate(eager, eruns, "ar", prompt, 24).tokens
    r = {"tokens": len(want), "same": {}}
    for name in runs:
        r["same"][f"{name}/eager"] = generate(eager, eruns, name, prompt, 24).tokens == want
        r["same"][f"{name}/compiled"] = generate(comp, runs, name, prompt, 24).tokens == want
        save(r)
    r["graphs"] = graph_state()
    save(r)
    bad = [k for k, v in r["same"].items() if not v]
    if bad:
        raise SystemExit(f"tokens differ from eager plain decoding: {bad}")


def section_speed(args, save):
    """The whole shape, bf16 on a GPU (float32 --tiny), compiled: the decode and a 61-node verify."""
    device, backend, cuda = setting(args.tiny)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = ModelArgs(**(TINY if args.tiny else QWEN3_8B))
    torch.manual_seed(0)
    model = random_target(a, device, dtype, max_seq_len=1024)
    comp = engine(model, None, True, backend, args.chunk)
    # the prefill is not timed: eager, so that only the two timed graphs compile at this size
    comp.steps.prefill = lambda *x: E.prefill_chunk(model, comp.cache, *x)
    prompt = torch.randint(0, a.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    r = {"shape": "tiny" if args.tiny else "Qwen3-8B", "dtype": str(dtype).replace("torch.", ""),
         "weight_bytes": weight_bytes(model), "device": torch.cuda.get_device_name() if cuda else "cpu"}
    peak = next((v for k, v in PEAK.items() if k in r["device"]), None)
    r["peak_bytes_per_s"] = {"nominal": peak, "measured_copy": round(copy_bandwidth(device))}
    t = time.perf_counter()
    ctx, cost = CAL.pass_cost(comp, [1, 61], context=128, repeats=10)
    r["compile_and_time_seconds"] = round(time.perf_counter() - t, 1)
    bw = r["weight_bytes"] / (cost[1] / 1000)
    r["decode"] = {"context": ctx, "ms_per_token": cost[1], "bandwidth_fraction": round(bw / peak, 4) if peak else None,
                   "bandwidth_fraction_of_copy": round(bw / r["peak_bytes_per_s"]["measured_copy"], 4)}
    r["verify_61"] = {"ms": cost[61], "over_decode": round(cost[61] / cost[1], 3)}
    save(r)
    ar = comp.make("ar")
    E.generate(comp, ar, prompt, 8, Sampling(), ())            # (first-call costs)
    res = E.generate(comp, ar, prompt, args.tokens, Sampling(), ())
    r["ar_generate"] = {"tokens": len(res.tokens), "tokens_per_s": round(len(res.tokens) / max(res.seconds - res.times.get(
        "prefill", 0.0), 1e-9), 1), "syncs_per_round": res.syncs / max(res.rounds, 1)}
    r["graphs"] = graph_state()
    r["max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if cuda else None
    save(r)
    if r["graphs"]["dynamo_graphs"] != 2 or r["graphs"]["cudagraph_skips"]:
        raise SystemExit(f"planned 2 graphs and no cudagraph skip: {r['graphs']}")


# transformers' generate() options for the compiled peer: disable_compile=True, or on CUDA with a
# static cache transformers compiles the forward itself, around ours (whose cudagraph_mark_step_begin
# is then a dynamo skip inside its compile): it would measure its compile, not our graph
PEER_COMPILED = dict(cache_implementation="static", disable_compile=True)


def section_peer(args, save):
    """transformers' generate() on the speed shape, in this process alone: ms per new token, eager and
    with its static cache and our compiled decode forward. On the CPU the same path: a CompileConfig
    that lets transformers compile on any device, so that without disable_compile it would compile
    there too; transformers' get_compiled_call is watched, and a call fails the section."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    device, backend, cuda = setting(args.tiny)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = ModelArgs(**(TINY if args.tiny else QWEN3_8B))
    cfg = Qwen3Config(vocab_size=a.vocab_size, hidden_size=a.dim, num_hidden_layers=a.n_layers,
                      num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim,
                      intermediate_size=a.intermediate_size, rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta,
                      max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen3ForCausalLM(cfg).to(dtype).eval()

    def refused(*_a, **_k):
        raise SystemExit("transformers compiled the model itself (get_compiled_call): pass disable_compile=True")
    hf.get_compiled_call = refused
    prompt = torch.randint(0, a.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0)).to(device)
    n, r = args.tokens, {"transformers": __import__("transformers").__version__}
    for name, compiled in (("eager", False), ("static_compiled", True)):
        kw = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        if compiled:
            kw.update(PEER_COMPILED)
            if not cuda:            # transformers compiles only on accelerators unless told otherwise
                from transformers import CompileConfig
                kw["compile_config"] = CompileConfig(fullgraph=True, backend="aot_eager")
                kw["compile_config"]._compile_all_devices = True
            eager_forward = hf.forward
            fwd = torch.compile(eager_forward, fullgraph=True, dynamic=False,
                                **(dict(mode="reduce-overhead") if cuda else dict(backend=backend)))

            def step(*x, **y):      # the decode compiled; the prefill (128 tokens) eager, untimed in the difference
                ids = y.get("input_ids", x[0] if x else None)
                if ids is None or ids.shape[-1] != 1:
                    return eager_forward(*x, **y)
                if cuda:            # each forward is a new generation of CUDA graph outputs
                    torch.compiler.cudagraph_mark_step_begin()
                return fwd(*x, **y)
            hf.forward = step
        def timed(**more) -> float:       # the fastest of two (a shared machine only ever adds time)
            out = []
            for _ in range(2):
                E.sync(device)
                t = time.perf_counter()
                hf.generate(prompt, **dict(kw, **more))
                E.sync(device)
                out.append(time.perf_counter() - t)
            return min(out)
        with torch.no_grad():
            hf.generate(prompt, **kw)                      # warm at the timed length
            one, all_ = timed(max_new_tokens=1, min_new_tokens=1), timed()
        # the 1-token run is the prefill: what remains is n-1 decoding steps
        r[name] = {"ms_per_token": round((all_ - one) / (n - 1) * 1000, 3)}
        save(r)
    r["graphs"] = graph_state()
    save(r)
    if r["graphs"]["cudagraph_skips"]:
        raise SystemExit(f"the peer's decode ran without CUDA graphs: {r['graphs']}")


RUN = {"env": section_env, "placement": section_placement, "engine": section_engine, "lossless": section_lossless,
       "speed": section_speed, "peer": section_peer}


# ----------------------------------------------------------------------------- the plan and the run

def expected(names, tiny: bool) -> dict:
    return {s: (cpu if tiny else gpu) for s, _, _, gpu, cpu in PLAN if s in names}


def limit_for(name: str, names: list, left: float, tiny: bool) -> float:
    """Section `name`'s seconds: its expected share of what is left, over the sections from it on."""
    exp = expected(names, tiny)
    rest = names[names.index(name):]
    return max(1.0, left * exp[name] / sum(exp[s] for s in rest))


def plan_lines(names: list, total: float, tiny: bool) -> list:
    exp = expected(names, tiny)
    lines = [f"plan ({'--tiny: this CPU, measured' if tiny else 'a GPU: estimated, no GPU has run this'}), "
             f"--time-limit {total:.0f}s, expected {sum(exp.values())}s:"]
    left = total - RESERVE
    for s in names:
        _, proves, graphs, *_ = next(p for p in PLAN if p[0] == s)
        lim = limit_for(s, names, left, tiny)
        lines.append(f"  {s:<10} expected {exp[s]:>4}s, limit {lim:>4.0f}s if the ones before take theirs: {proves}")
        lines.append(f"             graphs: {', '.join(graphs) if graphs else 'none'}")
        left -= exp[s]
    return lines


def one_line(s: str, v: dict) -> str:
    """A section's result in a few words (the summary printed last)."""
    r = v.get("result") or {}
    try:
        if s == "env":
            what = f"torch {r['torch']}, {r['device']}, decode kernel {r['sdpa_kernel']['decode']['folded']}"
        elif s == "placement":
            what = ", ".join(f"{k}: {x['runs']} runs, {len(x['failed'])} failed" for k, x in r.items())
        elif s == "engine":
            f = r["first_pass"]
            what = (f"{f['dynamo_graphs']} graphs ({r['graphs_planned']} planned), {f['cuda_graphs']} CUDA graphs, "
                    f"{f['cudagraph_skips']} skips, {f['rerecords']} re-records; second pass new: "
                    f"{ {k: x for k, x in r.get('second_pass_new', {}).items() if x} or 'none'}")
        elif s == "lossless":
            what = f"{sum(r['same'].values())} of {len(r['same'])} runs equal plain decoding ({r['tokens']} tokens)"
        elif s == "speed":
            what = (f"{r['shape']} {r['dtype']}: {r['decode']['ms_per_token']} ms/token "
                    f"(bandwidth {r['decode']['bandwidth_fraction']}), verify(61)/decode {r['verify_61']['over_decode']}")
        elif s == "peer":
            what = ", ".join(f"{k} {x['ms_per_token']} ms/token" for k, x in r.items() if isinstance(x, dict) and "ms_per_token" in x)
        else:
            what = ""
    except (KeyError, TypeError):
        what = "partial: " + ", ".join(r) if r else "nothing written"
    return what


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check", help="folder for one JSON per section and summary.json")
    p.add_argument("--time-limit", type=float, default=420.0, help="seconds for the whole check (default 420)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and run nothing")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (what the suite runs)")
    p.add_argument("--fake-cuda", action="store_true", help="only the placement section")
    p.add_argument("--sections", default=None, help=f"comma-separated, from {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per timing (speed, peer)")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)       # a child process: run one section
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.section:
        path = out / f"{args.section}.json"
        RUN[args.section](args, lambda r: path.write_text(json.dumps(r, indent=1) + "\n"))
        return 0
    names = ["placement"] if args.fake_cuda else [s.strip() for s in (args.sections or ",".join(SECTIONS)).split(",")]
    unknown = [s for s in names if s not in RUN]
    if unknown or args.time_limit <= RESERVE or args.tokens < 2:
        print(f"error: unknown section(s) {unknown} (choose from {', '.join(SECTIONS)}), or --time-limit at most "
              f"{RESERVE}, or --tokens below 2", file=sys.stderr)
        return 2
    names = [s for s in SECTIONS if s in names]          # always in the plan's order
    if args.dry_run:
        print("\n".join(plan_lines(names, args.time_limit, args.tiny)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    summary, t_all = {"time_limit": args.time_limit, "complete": False, "sections": {}}, time.time()
    for s in names:
        (out / f"{s}.json").unlink(missing_ok=True)
    for s in names:
        left = args.time_limit - RESERVE - (time.time() - t_all)
        limit = limit_for(s, names, left, args.tiny)
        cmd = [sys.executable, os.path.abspath(__file__), "--section", s, "--out", str(out), "--tokens", str(args.tokens),
               "--chunk", str(args.chunk)] + (["--tiny"] if args.tiny else [])
        t = time.time()
        # a session of its own: on a timeout the whole group goes (inductor's compile workers too)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=limit)
            ok, why = proc.returncode == 0, (err.strip().splitlines() or [""])[-1][:300]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            ok, why = False, f"timed out after {limit:.0f} s (its share of --time-limit {args.time_limit:.0f})"
        f = out / f"{s}.json"
        summary["sections"][s] = {"ok": ok, "seconds": round(time.time() - t, 1), "limit": round(limit, 1),
                                  "why": None if ok else why, "result": json.loads(f.read_text()) if f.is_file() else None}
        summary["wall_seconds"] = round(time.time() - t_all, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"{s:<10} {'ok    ' if ok else 'FAILED'} {summary['sections'][s]['seconds']:>6.1f}s of {limit:>4.0f}s  "
              f"{'' if ok else why}", flush=True)
    summary["complete"] = True
    summary["wall_seconds"] = round(time.time() - t_all, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    good = all(v["ok"] for v in summary["sections"].values())
    print(f"\nsummary: {'every section passed' if good else 'FAILED'} in {summary['wall_seconds']}s "
          f"(--time-limit {args.time_limit:.0f}s){'' if good else '; ' + ', '.join(k for k, v in summary['sections'].items() if not v['ok'])}")
    for s, v in summary["sections"].items():
        print(f"  {s:<10} {'ok' if v['ok'] else 'FAILED':<6} {one_line(s, v)}")
    print(f"  (every number: {out}/summary.json)")
    return 0 if good else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except Exception:      # noqa: BLE001 - a child's traceback, for the parent's one line
        traceback.print_exc()
        sys.exit(1)
