"""DFlash block drafting (dflash.py) and the block methods (graft.py: dflash, graft-tail).

  layout      a random drafter written as z-lab publishes one (config.json fields, tensor names) loads;
              a drafter that does not fit the target, or is not a DFlash drafter, is refused in one line
  lossless    dflash and graft-tail emit plain decoding's tokens: float32, 20 prompts, greedy and
              seeded sampling side by side, B = 1 and B = 3 (a refill), every step output poisoned as
              it expires (the CUDA-graph contract's rule 1)
  contract    the block steps run on a non-CPU device (placement), make one host sync a round and no
              host data, and every static they read is marked static on a GPU
  calibration graft-tail's cut: what a round would have accepted at a cut, from its records
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import calibrate as CAL
import cli as CLI
import engine as E
import graft as GR
from checkpoint import load_dflash, load_model
from conftest import ROOT
from data import STDLIB_CKPT, STDLIB_DFLASH, known_dflash, stdlib_snippets
from model import GraftError
from test_gpu_contract import (as_if_cuda, count_prefills, placement_check, rows_past_use_are_zeros,  # noqa: F401
                               transfers, unmarked)  # (fixtures)
from test_pacing import Forced
from verify import Sampling

BLOCK_METHODS = ["dflash", "graft-tail"]
TAU = 0.5                        # a cut that fires: the tail is retrieved in many rounds, kept whole in others
N_NEW = 10


def published_config(target, layers: int = 2, block: int = 16, mask: int = 4095) -> dict:
    """config.json as z-lab publishes a DFlash drafter (the fields of Qwen3-8B-DFlash-b16's, sized for
    `target`: a Qwen3 config with architectures, auto_map, block_size, dflash_config, num_target_layers)."""
    a = target.args
    return {"architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": block, "bos_token_id": None,
            "dflash_config": {"mask_token_id": mask, "target_layer_ids": [1, 5]}, "dtype": "bfloat16",
            "eos_token_id": 0, "head_dim": a.head_dim, "hidden_act": "silu", "hidden_size": a.dim,
            "initializer_range": 0.02, "intermediate_size": a.intermediate_size,
            "layer_types": ["full_attention"] * layers, "max_position_embeddings": a.max_position_embeddings,
            "max_window_layers": layers, "model_type": "qwen3", "num_attention_heads": a.n_heads,
            "num_hidden_layers": layers, "num_key_value_heads": a.n_kv_heads, "num_target_layers": a.n_layers,
            "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": a.rope_theta, "sliding_window": None,
            "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
            "vocab_size": a.vocab_size}


def published_tensors(target, layers: int = 2, seed: int = 0) -> dict:
    """Random weights under the published names (no embedding, no lm_head), bfloat16 as published."""
    a, g = target.args, torch.Generator().manual_seed(seed)
    H, q, kv, I = a.dim, a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.intermediate_size
    shapes = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                       p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                       p + "self_attn.q_norm.weight": (a.head_dim,), p + "self_attn.k_norm.weight": (a.head_dim,),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
    return {k: (torch.ones(s) + 0.1 * torch.randn(s, generator=g) if len(s) == 1 else
                torch.randn(s, generator=g) * s[1] ** -0.5).to(torch.bfloat16) for k, s in shapes.items()}


@pytest.fixture(scope="module")
def target():
    return load_model(STDLIB_CKPT, max_seq_len=256)


@pytest.fixture(scope="module")
def random_dflash(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash")
    (out / "config.json").write_text(json.dumps(published_config(target), indent=2))
    save_file(published_tensors(target), str(out / "model.safetensors"))
    return out


def test_a_drafter_in_the_published_layout_loads(target, random_dflash):
    d = load_dflash(str(random_dflash), target)
    c = d.config
    assert (c.n_layers, c.block_size, c.mask_token_id, c.target_layer_ids) == (2, 16, 4095, (1, 5))
    want = {k: v.float() for k, v in load_file(str(random_dflash / "model.safetensors")).items()}
    got = d.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert d.fc.weight.dtype == torch.float32 and d.target is target
    # block_size inside dflash_config (the newer checkpoints) reads the same
    cfg = published_config(target, block=8)
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    (random_dflash.parent / "b8").mkdir(exist_ok=True)
    (random_dflash.parent / "b8" / "config.json").write_text(json.dumps(cfg))
    shutil.copy(random_dflash / "model.safetensors", random_dflash.parent / "b8")
    assert load_dflash(str(random_dflash.parent / "b8"), target).config.block_size == 8


def _drop(sd, k):
    del sd[k]


MISFITS = {     # what each change of a published drafter is refused with
    "hidden_size": (lambda c, sd: c.update(hidden_size=128), "its hidden_size is 128, the target's is 192"),
    "target": (lambda c, sd: c.update(num_target_layers=36), "its num_target_layers is 36, the target's is 8"),
    "vocab": (lambda c, sd: c.update(vocab_size=151936), "its vocab_size is 151936"),
    "arch": (lambda c, sd: c.update(architectures=["Qwen3ForCausalLM"]), "not a DFlash drafter"),
    "layer_ids": (lambda c, sd: c["dflash_config"].update(target_layer_ids=[1, 7]), "are not layers 0..6"),
    "mask": (lambda c, sd: c["dflash_config"].pop("mask_token_id"), "missing field 'mask_token_id'"),
    "missing": (lambda c, sd: _drop(sd, "layers.1.mlp.up_proj.weight"), "lacks weight layers.1.mlp.up_proj.weight"),
    "shape": (lambda c, sd: sd.update({"fc.weight": sd["fc.weight"][:, :192].contiguous()}), "fc.weight has shape (192, 192)"),
    "extra": (lambda c, sd: sd.update({"lm_head.weight": torch.zeros(4096, 192)}), "does not know: lm_head.weight"),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_drafter_that_does_not_fit_is_refused_in_one_line(target, random_dflash, tmp_path, case):
    cfg = json.loads((random_dflash / "config.json").read_text())
    sd = load_file(str(random_dflash / "model.safetensors"))
    change, says = MISFITS[case]
    change(cfg, sd)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(GraftError) as e:
        load_dflash(str(tmp_path), target)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- lossless

def sampling(i: int) -> Sampling:
    """Even requests greedy, odd ones sampled at temperature 0.8 with their own seed (top-p and top-k
    go through the same verifier: tests/test_lossless.py; here they would sort every node's logits)."""
    return Sampling() if i % 2 == 0 else Sampling(0.8, seed=100 + i)


@pytest.fixture(scope="module")
def stream():
    return stdlib_snippets(heldout=True, n=20, lines=3, seed=3)


def test_block_methods_are_lossless(stream, monkeypatch):
    """20 prompts, greedy and sampled requests side by side, B = 1 and B = 3 with refills, every step
    output poisoned as it expires: each request gets plain decoding's tokens alone. The shipped drafter
    (the stdlib target finds it), so that blocks are accepted, cut and retrieved. Paced too, at B = 3:
    plain rounds, and refills that join them (Engine.join). Every admission finds the slot's rows past
    what its requests may have written zeros (Engine.seat clears only theirs), the block's cache too."""
    assert known_dflash(STDLIB_CKPT) == STDLIB_DFLASH
    engs = {B: CLI.build_engine(STDLIB_CKPT, dflash=STDLIB_DFLASH, max_seq_len=256, batch=B,
                                attention="window" if B == 1 else "full", check_lifetimes=True) for B in (1, 3)}
    clears = rows_past_use_are_zeros(monkeypatch)
    ids = [engs[1].tokenizer.encode(t) for t in stream]
    reqs = lambda: [E.Request(x, sampling(i), i) for i, x in enumerate(ids)]
    assert len(ids) == 20
    want = [r.tokens for r in E.run(engs[3], engs[3].make("ar"), reqs(), N_NEW).requests]   # (ar: any B alike)
    kept = retrieved = 0
    for B, e in engs.items():
        for name in BLOCK_METHODS:
            m = e.make(name, GR.Config(tail_threshold=TAU))
            res = E.run(e, m, reqs(), N_NEW)
            assert [r.tokens for r in res.requests] == want, (name, B)
            assert res.stats()["draft_forwards_per_round"] == 1.0 and m.N == 16
            if name == "graft-tail":
                retrieved += sum(r.from_retrieval for r in res.requests)
                kept += sum(r.accepted - r.from_retrieval for r in res.requests)
            else:
                assert sum(r.from_retrieval for r in res.requests) == 0
    assert retrieved > 0 and kept > 0          # the cut fired: both the prefix and the retrieval were accepted
    joined, real = [], E.Engine.join
    monkeypatch.setattr(E.Engine, "join", lambda eng, m, pairs: joined.append(pairs) or real(eng, m, pairs))
    for name in BLOCK_METHODS:
        res = E.run(engs[3], engs[3].make(name, GR.Config(tail_threshold=TAU, pace=True)), reqs(), N_NEW)
        assert [r.tokens for r in res.requests] == want, (name, "paced")
    assert joined and {id(c) for c in clears} >= {id(c) for c, _ in engs[3].caches} and len(engs[3].caches) == 2


@pytest.mark.parametrize("run", [GR.PLAIN_RUN - 1, 2 * GR.PLAIN_RUN + 5])
def test_a_block_after_a_plain_run_is_the_block_it_would_have_drafted(stream, run):
    """Through a run of plain steps the drafter's context falls behind; it writes the rows it missed
    (BlockDraft.catch_up) each time its pending rows are full and just before it drafts again, outside the
    drafting round. A context row is the drafter's projection of the target's features at one position,
    a function of that row alone, so the block it then drafts is, guesses and confidences bit for bit,
    the block it drafts reading those rows in the round (where they fit its pending rows), and its guesses
    are those of a request whose prompt already held the tokens."""
    eng = CLI.build_engine(STDLIB_CKPT, dflash=STDLIB_DFLASH, max_seq_len=256, batch=1)
    ids = eng.tokenizer.encode(stream[0])
    want = E.generate(eng, eng.make("ar"), ids, run + 8).tokens
    first, caught = {}, []
    for tag, prompt, pacer in (("caught up", ids, Forced(lambda n, b: n > run)), ("in the round", ids, Forced(lambda n, b: n > run)),
                               ("prefilled", ids + want[:run], None)):
        if tag == "in the round" and run >= GR.PLAIN_RUN:
            continue                                 # (more than its pending rows hold: it must catch up)
        m = eng.make("dflash", GR.Config(pace=True))
        m.pacer, catch_up, got = pacer, m.catch_up, []
        m.catch_up = lambda e, which: (caught.append(e.slots[0].pend), catch_up(e, which))
        if tag == "in the round":
            m.can_catch_up = lambda e: False
        res = E.run(eng, m, [E.Request(prompt)], run + 8 if pacer else 8, on_round=lambda rnd, c: got.append(
            (rnd.tree.tokens[0].tolist(), eng.block.conf[0].clone())) if not rnd.plain else None)
        first[tag] = got[0]
        assert res.requests[0].tokens == want[len(prompt) - len(ids):][:len(res.requests[0].tokens)]
    assert first["caught up"][0] == first["prefilled"][0] and len(first["prefilled"][0]) == 16
    if run < GR.PLAIN_RUN:
        assert first["caught up"][0] == first["in the round"][0]
        assert torch.equal(first["caught up"][1], first["in the round"][1])
    full = run // GR.PLAIN_RUN
    assert caught == [GR.PLAIN_RUN] * full + [run - full * GR.PLAIN_RUN]   # each time full, then as it drafts


# ----------------------------------------------------------------------------- the CUDA-graph contract

def test_block_steps_run_on_a_non_cpu_device():
    """placement (tests/test_gpu_contract.py) for the block steps: a refill, greedy and sampled."""
    got = placement_check(2, False, methods=BLOCK_METHODS)
    assert set(got.pop("missing")) <= {"decode", "head_prefill", "extend", "level", "assemble", "recycle_tree"}
    assert {k: v for k, v in got.items() if v != "ok"} == {}


def test_one_host_sync_a_round_and_no_host_data(random_dflash, stream, transfers):
    eng = CLI.build_engine(STDLIB_CKPT, dflash=str(random_dflash), max_seq_len=256, batch=2)
    ids = [eng.tokenizer.encode(t) for t in stream[:3]]
    for name in BLOCK_METHODS:
        m = eng.make(name, GR.Config(tail_threshold=TAU))
        E.run(eng, m, [E.Request(ids[0])], 2)
        prefills = count_prefills(eng)             # one sync and one copy a prefill (prompts together: one)
        with transfers:
            res = E.run(eng, m, [E.Request(x, sampling(i), i) for i, x in enumerate(ids)], 8)
        assert transfers.syncs == res.rounds + len(prefills) and transfers.to_device == len(prefills), name
        assert sum(prefills) == len(ids) and max(prefills) == 2, prefills
        transfers.syncs = transfers.to_device = 0
        del eng.admit, eng.admit_group              # (the class's again)


def test_every_block_static_is_marked_on_a_gpu(random_dflash, as_if_cuda):
    eng = CLI.build_engine(STDLIB_CKPT, dflash=str(random_dflash), max_seq_len=256, batch=2, compile=True,
                           backend="aot_eager")
    for name in BLOCK_METHODS:
        eng.make(name, GR.Config(tail_threshold=TAU))
    assert {"block_prefill", "block_draft", "block_tree"} <= eng.steps.names
    assert any(t is eng.block.cache.k[0] for t in eng.steps.statics) and unmarked(eng) == []


# ----------------------------------------------------------------------------- the cut's calibration

def test_what_a_cut_would_have_accepted():
    """tail_accepted: no cut is the chain's count; a cut inside the accepted prefix keeps it and
    matches the retrieval under the last kept guess against what the target said next; a cut past
    where the chain broke changes nothing."""
    conf, truth = [0.9, 0.8, 0.2, 0.9], [5, 6, 7, 8]
    parents = [-1, 0, 1, -1]                          # a chain of 3 and a sibling of its first node
    ret = [[5, 6, 9, 1], [6, 7, 8, 2], [1, 8, 3, 7], [9, 9, 9, 9]]   # ret[K]: under guess K-1 (K=0: the root)
    assert CAL.tail_accepted(conf, 3, ret, parents, truth, 0.0) == 3
    assert CAL.tail_accepted(conf, 3, ret, parents, truth, 0.5) == 2 + 0      # K=2: [1, 8, 3 | 7] under 6: no 7 first
    assert CAL.tail_accepted(conf, 1, ret, parents, truth, 0.5) == 1          # broke before the cut
    assert CAL.tail_accepted(conf, 3, ret, parents, truth, 0.85) == 1 + 3     # K=1: 6, 7, 8 retrieved
    assert CAL.tail_accepted(conf, 0, ret, parents, truth, 0.95) == 2         # K=0: 5, 6 under the root


def test_the_recorded_retrieval_is_what_the_round_verified(stream):
    """The calibration's record of a round (graft.BlockDraft.recorded): at a cut above every confidence
    the whole tree is the retrieval under the root, so what tail_accepted scores from the record must
    be what the round accepted, round by round (the record once read the next round's root)."""
    eng = CLI.build_engine(STDLIB_CKPT, dflash=STDLIB_DFLASH, max_seq_len=256)
    m = eng.make("graft-tail", GR.Config(tail_threshold=1.5))
    recs = []
    on_round = lambda rnd, got: recs.append((rnd.record["conf"][0].tolist(), rnd.record["retrieved"][0].tolist(),
                                             len(got[0][0]), eng.slots[0].request, eng.slots[0].L - len(got[0][0]) - 1))
    E.run(eng, m, [E.Request(eng.tokenizer.encode(t)) for t in stream[:3]], 24, on_round=on_round, record=True)
    parents, n, scored = m.tpl.parents.tolist(), m.N - 1, 0
    for conf, ret, A, r, L in recs:
        truth = (r.ids + r.tokens)[L + 1:L + 1 + n]
        if len(truth) == n:
            assert CAL.tail_accepted(conf, 0, ret, parents, truth, 1.5) == A
            scored += 1
    assert scored > 10 and any(A > 0 for *_, A, _, _ in recs)


def test_the_cut_is_cached_per_drafter_and_matrix(stream, tmp_path, monkeypatch):
    """calibrate_tail writes its cut to the cache and a second call reads it back without running a
    block; a matrix warmed otherwise gets its own file; an unreadable file counts as absent."""
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path))
    eng = CLI.build_engine(STDLIB_CKPT, dflash=STDLIB_DFLASH, max_seq_len=256)
    logs, run = [], lambda: CAL.calibrate_tail(eng, None, stream[:2], rounds=2, max_new_tokens=40, log=logs.append)
    tau = run()
    path, = tmp_path.glob("tail-*.json")
    assert "cached" not in logs[-1] and json.loads(path.read_text())["tau"] == tau
    calls, real = [], CAL.run
    monkeypatch.setattr(CAL, "run", lambda *a, **k: calls.append(a))
    assert run() == tau and "cached" in logs[-1] and calls == []
    monkeypatch.setattr(CAL, "run", real)
    path.write_text("{not json")
    assert run() == tau and "cached" not in logs[-1]                  # recomputed, and written again
    eng.matrix.M[5, 0] += 1                                            # another warm-up's matrix
    run()
    assert len(list(tmp_path.glob("tail-*.json"))) == 2


def test_the_cached_block_is_the_training_block(target, random_dflash):
    """The engine's block (the context written chunk by chunk into the drafter's cache, then the
    accepted path's rows, then the block at its positions) gives the logits training computes for a
    block at the same anchor over the whole context at once (train.dflash_loss's layout: context
    rows first, blocks after them at their own positions): inference reads what the drafter learned."""
    from dflash import BlockDrafter, share_features
    d = load_dflash(str(random_dflash), target)
    cols = share_features(target, d)
    toks = torch.tensor([[(7 * i + 3) % 4000 + 1 for i in range(40)]])
    _, feats = target(toks, torch.arange(40), capture=True)                       # (1, 40, F)
    a, S = 25, d.config.block_size
    bd = BlockDrafter(d, 1, 128, cols)
    bd.prefill(feats[:, :16], torch.tensor(16), torch.tensor([0]))               # a prompt chunk
    bd.prefill(feats[:, 16:20], torch.tensor(4), torch.tensor([0]))              # a shorter one
    path = torch.cat([feats[:, 20:a], feats[:, :3] * float("nan")], 1)           # 5 accepted rows, padding
    bd.draft(path, torch.tensor([5]), toks[:, a], torch.arange(128))
    ids = torch.cat([toks[:, a:a + 1], torch.full((1, S - 1), d.config.mask_token_id)], 1)
    pos = a + torch.arange(S)[None]
    mask = torch.cat([(torch.arange(40) < a).expand(1, S, 40), torch.ones(1, S, S, dtype=torch.bool)], 2)
    cache = E.KVCache(d.config.n_layers, 1, d.config.layer.n_kv_heads, 40 + S, d.config.layer.head_dim,
                      torch.float32, "cpu")
    h = d(bd.features(feats), torch.arange(40)[None], torch.ones(1, 40, dtype=torch.bool), ids,
          40 + torch.arange(S)[None], pos, mask, cache)
    best, tok = d.logprobs(h[:, 1:]).max(-1)
    assert torch.equal(tok, bd.tokens) and torch.allclose(best.exp(), bd.conf, atol=1e-5)
