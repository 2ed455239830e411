"""model.py against transformers: logits, EAGLE-3 features, KV cache, RoPE variants, loading, errors.

Tiny random checkpoints (conftest.make_tiny_model) cover Llama-2 (MHA, tied), Llama-3.1 (GQA, llama3
RoPE scaling, untied) and Qwen3 (head_dim != hidden/heads, q/k norm); the pretrained stories260K-hf in
../shared checks real decoding against its documented golden text. CPU, float32 unless stated.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoint as CK
import model as M
import tokenizer as TOK
from conftest import (BOS, EOS, KINDS, STORIES, STORIES_IDS64, STORIES_PROMPT_IDS, STORIES_TEXT,
                      TINY_CAPTURE_LAYERS, hf_greedy, hf_model, needs_shared, reference_greedy)

TOL = 1e-4
ALL_KINDS = list(KINDS)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def random_ids(n: int, seed: int = 1, vocab: int = 300) -> torch.Tensor:
    """(1, n) ids: BOS then random non-special tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor([[BOS]]), torch.randint(3, vocab, (1, n - 1), generator=g)], dim=1)


def maxdiff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def loaded(tiny_ckpt):
    """loaded(kind, **overrides) -> our float32 Transformer for that tiny checkpoint (cached per module)."""
    cache = {}

    def get(kind, **overrides):
        key = (kind, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            model = CK.load_model(str(tiny_ckpt(kind, **overrides)))
            model.setup_caches(model.max_seq_len)      # its own KV cache, one request (the engine makes its own)
            cache[key] = model
        return cache[key]

    return get


def full_forward(model, ids, capture=False):
    """Our forward over the whole sequence without touching the KV cache (causal, positions 0..T-1)."""
    return model(ids, torch.arange(ids.shape[1]), capture=capture)


def hf_capture(hf, ids):
    """HF logits and the EAGLE-3 features: hidden_states[2], [L//2], [L-3] concatenated."""
    out = hf(ids, output_hidden_states=True)
    L = hf.config.num_hidden_layers
    hs = out.hidden_states
    assert len(hs) == L + 1
    return out.logits, torch.cat([hs[2], hs[L // 2], hs[L - 3]], dim=-1)


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("kind", ALL_KINDS)
def test_config_fields_parsed(tiny_ckpt, kind):
    a = CK.hf_model_args(json.loads((tiny_ckpt(kind) / "config.json").read_text()))
    want = KINDS[kind]
    assert a.arch == ("qwen3" if kind == "qwen3" else "llama")
    assert (a.vocab_size, a.dim, a.n_layers, a.n_heads, a.intermediate_size) == (300, 64, 8, 4, 128)
    assert a.n_kv_heads == want["num_key_value_heads"]
    assert a.head_dim == want.get("head_dim", 16)
    assert a.rope_theta == want["rope_theta"]       # transformers 5 stores it inside rope_parameters
    assert a.norm_eps == want["rms_norm_eps"]
    assert a.tie_word_embeddings is want["tie_word_embeddings"]
    assert a.qk_norm is (kind == "qwen3")
    assert a.bos_token_id == BOS and a.eos_token_ids == [EOS]
    assert a.capture_layers == TINY_CAPTURE_LAYERS
    if kind == "llama31":
        assert a.rope_scaling["rope_type"] == "llama3" and a.rope_scaling["factor"] == 8.0
    else:
        assert a.rope_scaling is None


@pytest.mark.parametrize("L, layers", [(32, (2, 16, 29)), (40, (2, 20, 37)), (36, (2, 18, 33)), (8, (2, 4, 5))])
def test_capture_layers_follow_eagle3(L, layers):
    assert M.ModelArgs(n_layers=L).capture_layers == layers


def test_tied_head_shares_embedding_untied_does_not(loaded):
    tied, untied = loaded("llama2"), loaded("llama31")
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert untied.lm_head.weight.data_ptr() != untied.embed_tokens.weight.data_ptr()
    assert not torch.equal(untied.lm_head.weight, untied.embed_tokens.weight)


# ----------------------------------------------------------------------------- parity with transformers

@pytest.mark.parametrize("kind", ALL_KINDS)
def test_logits_match_transformers(tiny_ckpt, loaded, kind):
    ids = random_ids(48)
    ours = full_forward(loaded(kind), ids)
    ref = hf_model(tiny_ckpt(kind))(ids).logits
    assert ours.shape == ref.shape == (1, 48, 300)
    assert maxdiff(ours, ref) < TOL
    assert ref.std() > 0.3                                # the random weights give non-flat logits


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_capture_features_match_hidden_states(tiny_ckpt, loaded, kind):
    ids = random_ids(40, seed=2)
    logits, feats = full_forward(loaded(kind), ids, capture=True)
    ref_logits, ref_feats = hf_capture(hf_model(tiny_ckpt(kind)), ids)
    assert feats.shape == (1, 40, 3 * 64)
    # hidden states grow through the layers (|h| up to ~30 here), and float32's rounding of another sum
    # order with them: 1.3e-4 apart on an AVX2 Zen 3 (8-lane sums), within 1e-4 on AVX-512 (16-lane)
    assert maxdiff(feats, ref_feats) < max(TOL, 1e-5 * ref_feats.abs().max().item())
    assert maxdiff(logits, ref_logits) < TOL


def test_capture_features_are_distinct_layers(loaded):
    """low | mid | high come from three different layers (L=8: inputs of layers 2, 4, 5)."""
    _, feats = full_forward(loaded("llama31"), random_ids(16), capture=True)
    low, mid, high = feats.split(64, dim=-1)
    assert maxdiff(low, mid) > 1e-2 and maxdiff(mid, high) > 1e-2


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_rope_inv_freq_matches_transformers(tiny_ckpt, loaded, kind):
    rot = hf_model(tiny_ckpt(kind)).model.rotary_emb
    a = loaded(kind).args
    inv, scale = M.rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling, a.max_position_embeddings)
    torch.testing.assert_close(inv, rot.inv_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(rot.attention_scaling, rel=1e-6)


def test_llama3_scaling_changes_some_frequencies(loaded):
    """At this size the llama3 scaling keeps the fastest band, ramps one, and slows the rest by 8."""
    a = loaded("llama31").args
    plain, _ = M.rope_inv_freq(a.head_dim, a.rope_theta, None, a.max_position_embeddings)
    scaled, _ = M.rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling, a.max_position_embeddings)
    ratio = plain / scaled
    assert ratio[0] == pytest.approx(1.0)
    assert 1.0 < ratio[1] < 8.0
    torch.testing.assert_close(ratio[2:], torch.full_like(ratio[2:], 8.0))


ROPE_VARIANTS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 2.0},
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_scaling_variant_matches_transformers(tiny_ckpt, loaded, variant):
    """Yarn and linear scaling on the Llama-3.1-style model, over positions past the original 64."""
    scaling = ROPE_VARIANTS[variant]
    path = tiny_ckpt("llama31", rope_scaling=scaling)
    ours = loaded("llama31", rope_scaling=scaling)
    assert ours.args.rope_scaling["rope_type"] == variant
    hf = hf_model(path)
    inv, scale = M.rope_inv_freq(ours.args.head_dim, ours.args.rope_theta, ours.args.rope_scaling,
                                 ours.args.max_position_embeddings)
    torch.testing.assert_close(inv, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-6)
    if variant == "yarn":
        assert scale > 1.0                                # yarn's attention factor is really applied
    ids = random_ids(100, seed=3)
    assert maxdiff(full_forward(ours, ids), hf(ids).logits) < TOL


# ----------------------------------------------------------------------------- KV cache

def prefill(model, ids):
    T = ids.shape[1]
    pos = torch.arange(T)
    return model(ids, pos, rows=pos, mask=torch.ones(T, T, dtype=torch.bool).tril(), capture=True)


def step(model, tok: int, p: int, row: int | None = None, capture=True):
    """One token at position p, written at cache row `row` (default p), attending to rows 0..row."""
    row = p if row is None else row
    return model(torch.tensor([[tok]]), torch.tensor([p]), rows=torch.tensor([row]),
                 mask=torch.ones(1, row + 1, dtype=torch.bool), capture=capture)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_incremental_decoding_matches_full_forward(loaded, kind):
    model = loaded(kind)
    ids = random_ids(32, seed=4)
    full_logits, full_feats = full_forward(model, ids, capture=True)
    T0 = 12
    logits, feats = prefill(model, ids[:, :T0])
    assert maxdiff(logits, full_logits[:, :T0]) < TOL
    assert maxdiff(feats, full_feats[:, :T0]) < TOL
    for p in range(T0, 32):
        logits, feats = step(model, int(ids[0, p]), p)
        assert logits.shape == (1, 1, 300) and feats.shape == (1, 1, 192)
        assert maxdiff(logits[0, 0], full_logits[0, p]) < TOL, f"position {p}"
        assert maxdiff(feats[0, 0], full_feats[0, p]) < TOL, f"position {p}"


def test_cache_and_rope_table_shapes(loaded, tiny_ckpt):
    """setup_caches(max_position_embeddings) holds that many rows per layer, in the model's dtype,
    (B, H_kv, S, D), for B requests."""
    model = loaded("qwen3")
    cache = model.cache
    assert len(cache.k) == len(cache.v) == 8
    assert cache.k[0].shape == cache.v[3].shape == (1, 2, 256, 32)
    assert cache.k[0].dtype == torch.float32
    assert model.rope.shape == (256, 2, 32)          # cos and sin, full head width
    fresh = CK.load_model(str(tiny_ckpt("qwen3")))
    assert fresh.cache is None and fresh.max_seq_len == 256      # loading allocates no cache
    fresh.setup_caches(256, batch=3, slack=8)
    assert fresh.cache.k[0].shape == (3, 2, M.cache_rows(264), 32) and fresh.rope.shape[0] == M.cache_rows(264)


def test_sibling_tokens_at_one_position_match_sequential(loaded):
    """Tree verification: two siblings share position T but sit at cache rows T and T+1; each sees
    only the prefix and itself, and gets the logits of decoding it alone."""
    model = loaded("llama31")
    ids = random_ids(20, seed=5)
    T = ids.shape[1]
    a, b = 17, 211
    prefill(model, ids)
    mask = torch.zeros(2, T + 2, dtype=torch.bool)
    mask[:, :T] = True
    mask[0, T] = mask[1, T + 1] = True
    logits, feats = model(torch.tensor([[a, b]]), torch.tensor([T, T]), rows=torch.tensor([T, T + 1]),
                          mask=mask, capture=True)
    for i, tok in enumerate((a, b)):
        ref_logits, ref_feats = full_forward(model, torch.cat([ids, torch.tensor([[tok]])], dim=1), capture=True)
        assert maxdiff(logits[0, i], ref_logits[0, -1]) < TOL
        assert maxdiff(feats[0, i], ref_feats[0, -1]) < TOL


def test_cache_move_rows_then_continue(loaded):
    """Accepting the sibling at row T+1: compacting it to row T lets decoding continue as if it had
    been the only token there."""
    model = loaded("qwen3")
    ids = random_ids(20, seed=6)
    T = ids.shape[1]
    a, b, c = 17, 211, 99
    prefill(model, ids)
    mask = torch.zeros(2, T + 2, dtype=torch.bool)
    mask[:, :T] = True
    mask[0, T] = mask[1, T + 1] = True
    model(torch.tensor([[a, b]]), torch.tensor([T, T]), rows=torch.tensor([T, T + 1]), mask=mask)
    model.cache.move_rows(torch.tensor([[T + 1]]), torch.tensor([[T]]))      # (B, n): request 0's rows
    logits = step(model, c, T + 1, capture=False)
    ref = full_forward(model, torch.cat([ids, torch.tensor([[b, c]])], dim=1))
    assert maxdiff(logits[0, 0], ref[0, -1]) < TOL


@pytest.mark.parametrize("kind", ["llama2", "qwen3"])
def test_batch_of_requests_each_at_its_own_rows(tiny_ckpt, kind):
    """Two requests of different lengths in one batched cache: each prompt prefilled into its own slot
    (slots=), then tree steps for both at once, rows (B, T), positions (B, T) and masks (B, T, n_keys)
    of their own, then a compaction with each request's own rows (move_rows (B, n)) and one more step:
    every request's logits and features are those of its sequence alone."""
    model = CK.load_model(str(tiny_ckpt(kind)), max_seq_len=64)
    model.setup_caches(64, batch=2)
    cache = model.cache
    n_keys = cache.rows
    prompts = [random_ids(11, seed=20), random_ids(6, seed=21)]
    L = torch.tensor([11, 6])
    for b, ids in enumerate(prompts):
        T = ids.shape[1]
        mask = M.attention_mask(torch.ones(T, T, dtype=torch.bool).tril(), torch.tensor([0]), torch.arange(n_keys))
        logits = model(ids, torch.arange(T), torch.arange(T)[None], mask, slots=torch.tensor([b]))
        assert maxdiff(logits, full_forward(model, ids)) < TOL
    # two siblings per request at its position L[b], rows L[b], L[b] + 1
    sib = torch.tensor([[17, 211], [45, 99]])
    tree = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)
    rows = L[:, None] + torch.arange(2)
    logits, feats = model(sib, L[:, None].expand(2, 2), rows, M.attention_mask(tree, L, torch.arange(n_keys)),
                          capture=True)
    for b, ids in enumerate(prompts):
        for i in range(2):
            ref_logits, ref_feats = full_forward(model, torch.cat([ids, sib[b:b + 1, i:i + 1]], 1), capture=True)
            assert maxdiff(logits[b, i], ref_logits[0, -1]) < TOL, (b, i)
            assert maxdiff(feats[b, i], ref_feats[0, -1]) < TOL, (b, i)
    # request 0 accepts its first sibling (already in place), request 1 its second (row L+1 -> L)
    cache.move_rows((L + torch.tensor([0, 1]))[:, None], L[:, None])
    nxt = torch.tensor([[5], [6]])
    L1 = L + 1
    logits = model(nxt, L1[:, None], L1[:, None], M.attention_mask(torch.ones(1, 1, dtype=torch.bool), L1,
                                                                   torch.arange(n_keys)))
    for b, (ids, acc) in enumerate(zip(prompts, (17, 99))):
        ref = full_forward(model, torch.cat([ids, torch.tensor([[acc, int(nxt[b])]])], 1))
        assert maxdiff(logits[b, 0], ref[0, -1]) < TOL, b


# ----------------------------------------------------------------------------- greedy generation

@pytest.mark.parametrize("kind", ALL_KINDS)
def test_greedy_matches_transformers_generate(tiny_ckpt, loaded, kind):
    model = loaded(kind)
    tok = TOK.load_tokenizer(str(tiny_ckpt(kind)))
    prompts = [[BOS], tok.encode("Once upon a time"), random_ids(30, seed=7)[0].tolist()]
    outs = []
    for ids in prompts:
        ours = reference_greedy(model, ids, 24)
        ref = hf_greedy(tiny_ckpt(kind), ids, 24)
        assert len(ref) == 24
        assert ours == ref, f"prompt {ids[:8]}..."
        outs.append(ours)
    assert min(len(set(o)) for o in outs) >= 8           # the tiny model does not just repeat one token


# ----------------------------------------------------------------------------- checkpoints

def shard_checkpoint(src, dst, n_shards=3):
    """Copy a single-file checkpoint into dst as n_shards files plus model.safetensors.index.json."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    sd = load_file(str(src / "model.safetensors"))
    names = sorted(sd)
    weight_map = {}
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = names[i::n_shards]
        save_file({k: sd[k].contiguous() for k in part}, str(dst / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
             "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dst


@pytest.mark.parametrize("kind", ["llama2", "qwen3"])
def test_sharded_checkpoint_loads_identically(tiny_ckpt, loaded, tmp_path, kind):
    sharded = shard_checkpoint(tiny_ckpt(kind), tmp_path / "sharded")
    assert CK.weight_files(str(sharded)) == [str(sharded / f"model-0000{i}-of-00003.safetensors") for i in (1, 2, 3)]
    model = CK.load_model(str(sharded))
    ids = random_ids(24, seed=8)
    assert torch.equal(full_forward(model, ids), full_forward(loaded(kind), ids))


def test_bfloat16_load(tiny_ckpt):
    model = CK.load_model(str(tiny_ckpt("llama31")), dtype=torch.bfloat16, max_seq_len=64)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    model.setup_caches(model.max_seq_len)
    assert model.cache.k[0].dtype == torch.bfloat16
    assert model.cache.k[0].shape[2] == 64
    ids = random_ids(16, seed=9)
    logits, feats = prefill(model, ids)
    assert logits.dtype == feats.dtype == torch.bfloat16
    assert torch.isfinite(logits).all() and torch.isfinite(feats).all()
    logits, _ = step(model, 5, 16)
    assert torch.isfinite(logits).all()


def test_max_seq_len_sizes_cache_and_rope(tiny_ckpt):
    model = CK.load_model(str(tiny_ckpt("llama2")), max_seq_len=40)
    assert model.max_seq_len == 40 and model.cache is None
    model.setup_caches(model.max_seq_len)
    # rows rounded up to a multiple of 16 (model.cache_rows: the efficient kernel's mask alignment)
    assert model.rope.shape[0] == M.cache_rows(40) == 48
    assert model.cache.v[-1].shape == (1, 4, 48, 16)


def test_engine_allocates_caches_for_its_batch(tiny_ckpt):
    """The engine sizes its own KV cache from the model's max_seq_len: B requests, the committed rows
    and a round's scratch after them, rounded up; the RoPE table covers every row."""
    import engine as E
    from graft import ContinuationMatrix
    model = CK.load_model(str(tiny_ckpt("llama2")), max_seq_len=40)
    eng = E.Engine(model, None, None, ContinuationMatrix(300, 4), batch=3, nodes=20, path=8, chunk=32)
    rows = M.cache_rows(40 + 64)                      # scratch: the largest of nodes, path, chunk and 64
    assert eng.cache.k[0].shape == eng.cache.v[-1].shape == (3, 4, rows, 16) and len(eng.cache.k) == 8
    assert model.rope.shape[0] >= rows and model.cache is None


# ----------------------------------------------------------------------------- tokenizer (tiny)

def test_tiny_tokenizer_roundtrip_and_special_ids(tiny_ckpt):
    tok = TOK.load_tokenizer(str(tiny_ckpt("llama31")))
    ids = tok.encode("Once upon a time")
    assert ids[0] == BOS and len(ids) > 2
    assert tok.decode(ids) == "Once upon a time"
    assert tok.encode("") == [BOS]
    assert tok.bos_id == BOS and tok.eos_ids == [EOS]
    assert tok.tk.get_vocab_size() == 300


# ----------------------------------------------------------------------------- pretrained stories260K

@pytest.fixture(scope="module")
def stories():
    model = CK.load_model(str(STORIES))
    model.setup_caches(model.max_seq_len)
    return model, TOK.load_tokenizer(str(STORIES))


@needs_shared
def test_stories_tokenizer_encode(stories):
    _, tok = stories
    assert tok.encode("Once upon a time") == STORIES_PROMPT_IDS
    assert tok.encode("") == [1]
    assert tok.bos_id == 1 and tok.eos_ids == [2]


@needs_shared
def test_stories_greedy_from_bos_gives_documented_text(stories):
    model, tok = stories
    out = reference_greedy(model, tok.encode(""), 120)
    assert len(out) == 120
    assert out[:64] == STORIES_IDS64
    assert tok.decode(out) == STORIES_TEXT


@needs_shared
def test_stories_matches_transformers(stories):
    model, _ = stories
    ids = torch.tensor([[1] + STORIES_IDS64])
    ref_logits, ref_feats = hf_capture(hf_model(STORIES), ids)
    logits, feats = full_forward(model, ids, capture=True)
    assert model.args.capture_layers == (2, 2, 2)       # L=5: 2, 5//2, 5-3 all name layer 2
    assert feats.shape == ref_feats.shape == (1, 65, 3 * 64)
    assert maxdiff(logits, ref_logits) < TOL
    assert maxdiff(feats, ref_feats) < TOL


# ----------------------------------------------------------------------------- loader errors

@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("llama2"), dst)
    return dst


def load_error(path) -> str:
    with pytest.raises(M.GraftError) as e:
        CK.load_model(str(path))
    msg = str(e.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


def test_error_missing_folder(tmp_path):
    assert "not found" in load_error(tmp_path / "nope")


def test_error_no_config(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    assert "no config.json" in load_error(ckpt_copy)


def test_error_config_not_json(ckpt_copy):
    (ckpt_copy / "config.json").write_text('{"hidden_size": 64,\n  oops\n')
    assert "malformed config.json" in load_error(ckpt_copy)


def test_error_config_missing_field(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    msg = load_error(ckpt_copy)
    assert "malformed config.json" in msg and "hidden_size" in msg


def test_error_unsupported_architecture(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    msg = load_error(ckpt_copy)
    assert "unsupported architecture" in msg and "GPT2LMHeadModel" in msg


def test_error_unsupported_rope_type(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0}
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    assert "longrope" in load_error(ckpt_copy)


def test_error_no_weights(ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    assert "no model.safetensors" in load_error(ckpt_copy)


def test_error_missing_shard(tiny_ckpt, tmp_path):
    sharded = shard_checkpoint(tiny_ckpt("llama2"), tmp_path / "sharded")
    (sharded / "model-00002-of-00003.safetensors").unlink()
    msg = load_error(sharded)
    assert "missing shard" in msg and "model-00002-of-00003.safetensors" in msg


def test_error_weight_wrong_shape(ckpt_copy):
    f = ckpt_copy / "model.safetensors"
    sd = load_file(str(f))
    name = "model.layers.3.self_attn.k_proj.weight"
    sd[name] = torch.zeros(32, 64)
    save_file(sd, str(f), metadata={"format": "pt"})
    msg = load_error(ckpt_copy)
    assert "layers.3.self_attn.k_proj.weight" in msg and "(32, 64)" in msg and "(64, 64)" in msg


def test_error_weight_missing(ckpt_copy):
    f = ckpt_copy / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.5.mlp.up_proj.weight"]
    save_file(sd, str(f), metadata={"format": "pt"})
    assert "layers.5.mlp.up_proj.weight" in load_error(ckpt_copy)


def test_error_corrupt_safetensors(ckpt_copy):
    (ckpt_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    assert "cannot read" in load_error(ckpt_copy)


def test_error_hub_id_when_offline(monkeypatch, tmp_path):
    """A name that looks like a hub id, with the hub offline and an empty cache: one line, no traceback."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    msg = load_error("nobody-graft-test/no-such-model")
    assert "nobody-graft-test/no-such-model" in msg and "offline" in msg


def test_pytorch_bin_shards_load_like_safetensors(tiny_ckpt, tmp_path):
    """Older checkpoints (Vicuna) ship pytorch_model-*.bin shards: read with weights_only=True."""
    import json as _json
    import shutil
    from safetensors.torch import load_file
    src = tiny_ckpt("llama2")
    dst = tmp_path / "bin"
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(sd)
    half = len(names) // 2
    torch.save({k: sd[k] for k in names[:half]}, dst / "pytorch_model-00001-of-00002.bin")
    torch.save({k: sd[k] for k in names[half:]}, dst / "pytorch_model-00002-of-00002.bin")
    wm = {k: "pytorch_model-00001-of-00002.bin" if i < half else "pytorch_model-00002-of-00002.bin"
          for i, k in enumerate(names)}
    (dst / "pytorch_model.bin.index.json").write_text(_json.dumps({"weight_map": wm}))
    a, b = CK.load_model(str(src)), CK.load_model(str(dst))
    x = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        assert torch.equal(a(x, torch.arange(5)), b(x, torch.arange(5)))
