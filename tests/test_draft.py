"""draft.py: the EAGLE-3 head loader (every published naming and config format), its refusals, and
tree drafting with checkpoints.

A tiny random target (model.Transformer from a ModelArgs, hidden 32, vocab 64) and a tiny random head
(hidden 32, draft vocabulary 40 with a non-trivial d2t) are built in this file; checkpoints are written
to tmp_path in each variant by hand. CPU, float32.
"""
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import checkpoint as CK  # noqa: E402
import draft as D  # noqa: E402
import model as M  # noqa: E402
from model import GraftError  # noqa: E402

torch.set_num_threads(1)

V, HT = 64, 32              # target vocab and hidden size
VD = 40                     # draft vocab
K = 4                       # draft top_k in the drafting tests


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def randomize(module: torch.nn.Module, seed: int, std: float = 0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def tiny_target(seed: int = 0) -> M.Transformer:
    a = M.ModelArgs(arch="llama", vocab_size=V, dim=HT, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                    intermediate_size=64, norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128)
    m = M.Transformer(a)
    randomize(m, seed, std=0.3)
    m.eval()
    m.setup_caches(64)
    return m


def layer_args(H=32, nh=4, nkv=2, hd=8, I=48, theta=1e6, vocab=V) -> M.ModelArgs:
    return M.ModelArgs(arch="llama", vocab_size=vocab, dim=H, n_layers=1, n_heads=nh, n_kv_heads=nkv,
                       head_dim=hd, intermediate_size=I, norm_eps=1e-6, rope_theta=theta,
                       max_position_embeddings=2048)


def make_head(target, Vd=VD, Ht=HT, seed=1, **layer_kw) -> D.Eagle3:
    """A random head; d2t maps the draft ids onto a random sorted subset of the target vocabulary."""
    c = D.HeadConfig(layer=layer_args(**layer_kw), target_hidden=Ht, vocab_size=V, draft_vocab_size=Vd)
    head = D.Eagle3(c)
    randomize(head, seed)
    g = torch.Generator().manual_seed(seed + 100)
    used = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
    head.d2t.copy_(used - torch.arange(Vd))
    head.embed_tokens = target.embed_tokens
    return head.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def head(target):
    h = make_head(target)
    assert h.d2t.max() > 0 and VD < V                       # a non-trivial draft vocabulary
    return h


@pytest.fixture(scope="module")
def official(tmp_path_factory, head):
    """save_head's output (official names in model.safetensors) and its tensors, as the reference."""
    d = tmp_path_factory.mktemp("official")
    CK.save_head(head, str(d))
    return d, load_file(str(d / "model.safetensors")), json.loads((d / "config.json").read_text())


HEAD_KEYS = ["fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
             "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
             "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
             "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
             "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
             "lm_head.weight", "d2t"]


def write(folder: Path, sd: dict, cfg: dict, fmt: str = "safetensors") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.contiguous() for k, v in sd.items()}
    if fmt == "safetensors":
        save_file(sd, str(folder / "model.safetensors"))
    else:
        torch.save(sd, str(folder / "pytorch_model.bin"))
    return str(folder)


def assert_same_head(loaded: D.Eagle3, ref: dict, target, keys=HEAD_KEYS):
    sd = loaded.state_dict()
    for k in keys:
        assert k in sd, k
        assert sd[k].dtype == ref[k].dtype, k
        assert torch.equal(sd[k], ref[k]), k
    assert loaded.d2t.dtype == torch.long


def rename(sd: dict, fn) -> dict:
    return {fn(k): v for k, v in sd.items()}


# ----------------------------------------------------------------------------- naming / format variants

def test_load_official_safetensors(official, target, head):
    d, ref, _ = official
    loaded = CK.load_head(str(d), target)
    assert_same_head(loaded, ref, target)
    assert loaded.embed_tokens is target.embed_tokens
    assert loaded.config.draft_vocab_size == VD and loaded.config.vocab_size == V
    assert loaded.config.target_hidden == HT
    la, ha = loaded.config.layer, head.config.layer
    assert (la.dim, la.n_heads, la.n_kv_heads, la.head_dim, la.intermediate_size, la.rope_theta, la.norm_eps) == \
        (ha.dim, ha.n_heads, ha.n_kv_heads, ha.head_dim, ha.intermediate_size, ha.rope_theta, ha.norm_eps)


def test_load_pytorch_model_bin(official, target, tmp_path):
    d, ref, cfg = official
    path = write(tmp_path / "bin", dict(ref), cfg, fmt="bin")
    assert_same_head(CK.load_head(path, target), ref, target)


def test_load_layers0_names(official, target, tmp_path):
    # speculators-style: the decoder layer is layers.0.*
    d, ref, cfg = official
    sd = rename(ref, lambda k: "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k)
    assert any(k.startswith("layers.0.") for k in sd)
    assert_same_head(CK.load_head(write(tmp_path / "l0", sd, cfg), target), ref, target)


def test_load_vllm_names(official, target, tmp_path):
    # vLLM-style: model.layers.0.*, model.fc, model.norm, model.draft_id_to_target_id; lm_head unprefixed
    d, ref, cfg = official

    def vllm(k):
        if k == "lm_head.weight":
            return k
        k = "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k
        k = "draft_id_to_target_id" if k == "d2t" else k
        return "model." + k

    sd = rename(ref, vllm)
    assert "model.fc.weight" in sd and "lm_head.weight" in sd and "model.draft_id_to_target_id" in sd
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)     # dropped by the loader
    assert_same_head(CK.load_head(write(tmp_path / "vllm", sd, cfg), target), ref, target)


def test_load_model_prefixed_midlayer_names(official, target, tmp_path):
    d, ref, cfg = official
    sd = rename(ref, lambda k: k if k == "lm_head.weight" else "model." + k)
    assert_same_head(CK.load_head(write(tmp_path / "mp", sd, cfg), target), ref, target)


def test_load_without_d2t_when_full_vocab(target, tmp_path):
    full = make_head(target, Vd=V, seed=3)
    d = tmp_path / "full"
    CK.save_head(full, str(d))
    sd = load_file(str(d / "model.safetensors"))
    del sd["d2t"], sd["t2d"]
    cfg = json.loads((d / "config.json").read_text())
    cfg["draft_vocab_size"] = V
    loaded = CK.load_head(write(tmp_path / "nod2t", sd, cfg), target)
    assert_same_head(loaded, {**sd, "d2t": torch.zeros(V, dtype=torch.long)}, target)
    assert torch.equal(loaded.to_target(torch.arange(V)), torch.arange(V))


def test_load_full_vocab_ignores_d2t_present(target, tmp_path):
    # draft_vocab_size == vocab_size: ids are used directly even when a (meaningless) d2t is stored
    full = make_head(target, Vd=V, seed=3)
    d = tmp_path / "full"
    CK.save_head(full, str(d))
    sd = load_file(str(d / "model.safetensors"))
    sd["d2t"] = torch.zeros(V, dtype=torch.long)
    loaded = CK.load_head(write(tmp_path / "withd2t", sd, json.loads((d / "config.json").read_text())), target)
    assert torch.equal(loaded.to_target(torch.arange(V)), torch.arange(V))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"])
def test_load_architecture_names(official, target, tmp_path, arch):
    d, ref, cfg = official
    cfg = dict(cfg, architectures=[arch])
    assert_same_head(CK.load_head(write(tmp_path / arch, dict(ref), cfg), target), ref, target)


def test_load_speculators_config(official, target, head, tmp_path):
    d, ref, cfg = official
    a = head.config.layer
    layer = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.dim,
             "intermediate_size": a.intermediate_size, "num_attention_heads": a.n_heads,
             "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "num_hidden_layers": 1,
             "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta, "max_position_embeddings": 4096,
             "vocab_size": V, "hidden_act": "silu"}
    spec = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": VD, "target_hidden_size": HT,
            "norm_before_residual": False, "speculators_config": {"algorithm": "eagle3"}}
    sd = rename(ref, lambda k: "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k)
    loaded = CK.load_head(write(tmp_path / "spec", sd, spec), target)
    assert_same_head(loaded, ref, target)
    la = loaded.config.layer
    assert (la.dim, la.n_heads, la.n_kv_heads, la.head_dim, la.intermediate_size, la.rope_theta, la.norm_eps,
            la.max_position_embeddings) == (a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size,
                                            a.rope_theta, a.norm_eps, 4096)
    assert loaded.config.draft_vocab_size == VD and loaded.config.vocab_size == V


def test_load_config_defaults(target, tmp_path):
    # the official Vicuna/Llama-3.1 configs lack num_key_value_heads / rope_theta / head_dim
    mha = make_head(target, seed=4, nh=4, nkv=4, hd=8, theta=10000.0)
    d = tmp_path / "mha"
    CK.save_head(mha, str(d))
    cfg = json.loads((d / "config.json").read_text())
    for k in ("num_key_value_heads", "rope_theta", "head_dim"):
        cfg.pop(k)
    (d / "config.json").write_text(json.dumps(cfg))
    loaded = CK.load_head(str(d), target)
    la = loaded.config.layer
    assert la.n_kv_heads == 4 and la.head_dim == 32 // 4 and la.rope_theta == 10000.0
    assert loaded.config.target_hidden == HT
    assert_same_head(loaded, load_file(str(d / "model.safetensors")), target)


def test_load_config_rope_theta_read(official, target):
    # the saved config carries rope_theta 1e6 (a Qwen3-style head): it must not fall back to 1e4
    d, _, cfg = official
    assert cfg["rope_theta"] == 1e6
    assert CK.load_head(str(d), target).config.layer.rope_theta == 1e6


def test_load_own_embedding(official, target, tmp_path):
    d, ref, cfg = official
    emb = torch.randn(V, 32, generator=torch.Generator().manual_seed(9))
    loaded = CK.load_head(write(tmp_path / "emb", dict(ref, **{"embed_tokens.weight": emb}), cfg), target)
    assert loaded.embed_tokens is not target.embed_tokens
    assert torch.equal(loaded.embed_tokens.weight, emb)
    assert not torch.equal(loaded.embed_tokens.weight, target.embed_tokens.weight)


def test_load_own_embedding_allows_other_hidden_size(target, tmp_path):
    # H (24) != Ht (32) is fine when the head brings its own embedding (fc reads 3*32 features)
    h24 = make_head(target, seed=5, H=24, nh=4, nkv=2, hd=6, I=40)
    d = tmp_path / "h24"
    CK.save_head(h24, str(d))
    sd = load_file(str(d / "model.safetensors"))
    sd["embed_tokens.weight"] = torch.randn(V, 24)
    save_file(sd, str(d / "model.safetensors"))
    loaded = CK.load_head(str(d), target)
    assert loaded.config.layer.dim == 24 and loaded.fc.weight.shape == (24, 3 * HT)
    out = loaded(torch.randn(1, 3, 3 * HT), torch.tensor([[4, 5, 6]]), torch.arange(3))
    assert out.shape == (1, 3, 24)


def test_load_without_lm_head_uses_targets(official, target, tmp_path):
    # no draft vocabulary at all: the head predicts with the target's own lm_head
    d, ref, cfg = official
    sd = {k: v for k, v in ref.items() if k not in ("lm_head.weight", "d2t", "t2d")}
    cfg = dict(cfg)
    cfg.pop("draft_vocab_size")
    loaded = CK.load_head(write(tmp_path / "nolm", sd, cfg), target)
    assert torch.equal(loaded.lm_head.weight, target.lm_head.weight)
    assert loaded.config.draft_vocab_size == V


# ----------------------------------------------------------------------------- refusals

def refusal(path, target) -> str:
    with pytest.raises(GraftError) as e:
        CK.load_head(str(path), target)
    msg = str(e.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


def test_refuse_fc_width(target, tmp_path):
    narrow = make_head(target, Ht=16, seed=6)            # fc reads 3*16 = 48 features, the target has 32
    CK.save_head(narrow, str(tmp_path / "fc"))
    msg = refusal(tmp_path / "fc", target)
    assert "48" in msg and "32" in msg, msg


def test_refuse_vocab_size(official, target, tmp_path):
    d, ref, cfg = official
    msg = refusal(write(tmp_path / "voc", dict(ref), dict(cfg, vocab_size=100)), target)
    assert "vocab" in msg and "100" in msg and "64" in msg, msg


def test_refuse_missing_folder(target, tmp_path):
    missing = tmp_path / "does-not-exist"
    msg = refusal(missing, target)
    assert str(missing) in msg, msg


def test_refuse_folder_without_weights(official, target, tmp_path):
    _, _, cfg = official
    (tmp_path / "cfg-only").mkdir()
    (tmp_path / "cfg-only" / "config.json").write_text(json.dumps(cfg))
    msg = refusal(tmp_path / "cfg-only", target)
    assert "model.safetensors" in msg and "pytorch_model.bin" in msg and "cfg-only" in msg, msg


def test_refuse_folder_without_config(official, target, tmp_path):
    _, ref, _ = official
    (tmp_path / "nocfg").mkdir()
    save_file(dict(ref), str(tmp_path / "nocfg" / "model.safetensors"))
    msg = refusal(tmp_path / "nocfg", target)
    assert "config.json" in msg, msg


def test_refuse_unsupported_architecture(official, target, tmp_path):
    d, ref, cfg = official
    msg = refusal(write(tmp_path / "arch", dict(ref), dict(cfg, architectures=["MistralForCausalLM"])), target)
    assert "MistralForCausalLM" in msg, msg


def test_refuse_other_hidden_size_without_embedding(target, tmp_path):
    h24 = make_head(target, seed=5, H=24, nh=4, nkv=2, hd=6, I=40)
    CK.save_head(h24, str(tmp_path / "h24"))
    msg = refusal(tmp_path / "h24", target)
    assert "24" in msg and "32" in msg, msg


def test_refuse_d2t_outside_target_vocab(official, target, tmp_path):
    d, ref, cfg = official
    bad = ref["d2t"].clone()
    bad[-1] = V                                           # draft id 39 -> 39 + 64: not a target id
    msg = refusal(write(tmp_path / "d2t", dict(ref, d2t=bad), cfg), target)
    assert "d2t" in msg, msg


# ----------------------------------------------------------------------------- the head's forward

def test_forward_fused_applies_fc(head):
    g = torch.Generator().manual_seed(0)
    x3 = torch.randn(1, 5, 3 * HT, generator=g)
    ids, pos = torch.tensor([[3, 9, 27, 1, 60]]), torch.arange(5)
    out = head(x3, ids, pos, fused=True)
    assert out.shape == (1, 5, 32)
    assert torch.allclose(out, head(head.fc(x3), ids, pos, fused=False), atol=1e-6)


def test_forward_unfused_skips_fc(head):
    ids, pos = torch.tensor([[3, 9, 27]]), torch.arange(3)
    out = head(torch.randn(1, 3, 32), ids, pos, fused=False)
    assert out.shape == (1, 3, 32)
    with pytest.raises(RuntimeError):
        head(torch.randn(1, 3, 3 * HT), ids, pos, fused=False)     # no fc: 96-wide input does not fit


# ----------------------------------------------------------------------------- drafting

PROMPT = [1, 5, 9, 13, 22, 40, 3, 17, 8]
PROMPT2 = [1, 30, 31, 2, 60, 7]                 # another request: another length, other tokens
CHUNK, PATH = 16, 4


def cols(dr):
    return torch.arange(dr.head.cache.rows)


def target_pass(target, prompt):
    """The target's prefill of a prompt: (its features (n, 3*Ht), the token after each: the prompt
    shifted by one, then the root, the target's argmax after the prompt)."""
    n = len(prompt)
    ids = torch.tensor(prompt)
    pos = torch.arange(n)
    target.setup_caches(64)
    logits, feats = target(ids[None], pos, pos, torch.ones(n, n, dtype=torch.bool).tril(), capture=True)
    root = int(logits[0, -1].argmax())
    return feats[0], torch.cat([ids[1:], torch.tensor([root])])


def prefill_slot(dr, b, feats, nxt, lo, hi):
    """The head's committed rows (f_t, p_t+1) for t in lo..hi-1 of request b, as one padded chunk."""
    F = torch.zeros(1, CHUNK, 3 * HT)
    F[0, :hi - lo] = feats[lo:hi]
    I = torch.zeros(1, CHUNK, dtype=torch.long)
    I[0, :hi - lo] = nxt[lo:hi]
    dr.prefill(F, I, torch.tensor(hi - lo), torch.tensor([b]), cols(dr))


def pending(rows):
    """extend's input, one row per request: [(feats (n, 3*Ht), ids (n,)), ...] padded to PATH."""
    B = len(rows)
    F = torch.zeros(B, PATH, 3 * HT)
    I = torch.zeros(B, PATH, dtype=torch.long)
    for b, (f, i) in enumerate(rows):
        F[b, :len(i)] = f
        I[b, :len(i)] = i
    return F, I, torch.tensor([len(i) for _, i in rows])


def drafter_for(target, head, prompts, depth=8):
    """A fresh Drafter of len(prompts) requests, each having read its prompt (prefill: rows (f_t, p_t+1))
    and extended with the prompt's last feature and the root, which drafts level 1. Returns
    (drafter, conf_0 (B,), [(feats, next ids) per request])."""
    dr = D.Drafter(head, len(prompts), max_seq_len=64, top_k=K, depth=depth, max_path=PATH, chunk=CHUNK)
    got = [target_pass(target, p) for p in prompts]
    for b, (feats, nxt) in enumerate(got):
        prefill_slot(dr, b, feats, nxt, 0, len(nxt) - 1)
    conf = dr.extend(*pending([(f[-1:], n[-1:]) for f, n in got]), cols(dr))
    return dr, conf, got


def drafter_and_root(target, head, depth=8):
    """drafter_for one request (PROMPT). Returns (drafter, conf_0 (1,), feats, next ids)."""
    dr, conf, [(feats, nxt)] = drafter_for(target, head, [PROMPT], depth)
    return dr, conf, feats, nxt


def draft(dr, levels):
    """Draft up to `levels` levels; returns the confidences conf_1 .. conf_{levels-1} of request 0."""
    return [float(dr.level(torch.tensor(i), cols(dr))[0]) for i in range(levels - 1)]


def level_slices(levels, k=K):
    out = [slice(0, k)]
    for l in range(2, levels + 1):
        out.append(slice(k + (l - 2) * k * k, k + (l - 1) * k * k))
    return out


def test_extend_reads_the_path_and_drafts_level_1(target, head):
    dr, conf, _, _ = drafter_and_root(target, head)
    assert dr.Ld.tolist() == [len(PROMPT)]                    # n - 1 prompt rows, then the root's
    assert conf.shape == (1,)
    h = dr.beam_h[0, :1]
    s, t = head.logprobs(h).topk(K, dim=-1)
    assert torch.allclose(dr.scores[0, :K], s[0]) and torch.equal(dr.tokens[0, :K], head.to_target(t[0]))
    assert (dr.parents[0, :K] == -1).all() and torch.isinf(dr.scores[0, K:]).all()
    assert math.isclose(float(conf[0]), math.exp(float(s[0, 0])), rel_tol=1e-6)


def test_prefill_in_chunks_equals_one_chunk(target, head):
    dr, _, feats, nxt = drafter_and_root(target, head)
    n = len(PROMPT)
    dr2 = D.Drafter(head, 1, max_seq_len=64, top_k=K, depth=8, max_path=PATH, chunk=CHUNK)
    for lo, hi in ((0, 4), (4, n - 1)):
        prefill_slot(dr2, 0, feats, nxt, lo, hi)
    dr2.extend(*pending([(feats[-1:], nxt[-1:])]), cols(dr2))
    assert torch.equal(dr2.Ld, dr.Ld)
    assert torch.allclose(dr2.scores[:, :K], dr.scores[:, :K], atol=1e-5)


def test_draft_full_tree_shape(target, head):
    dr, _, _, _ = drafter_and_root(target, head)
    draft(dr, 8)
    C = K + 7 * K * K
    assert dr.scores.shape == dr.tokens.shape == dr.parents.shape == (1, C)
    scores, tokens, parents = dr.scores[0], dr.tokens[0], dr.parents[0]
    assert torch.isfinite(scores).all()
    assert int(tokens.min()) >= 0 and int(tokens.max()) < V
    # every token is a target id reachable from the draft vocabulary
    reach = set((torch.arange(VD) + head.d2t).tolist())
    assert set(tokens.tolist()) <= reach
    # parents: -1 for level 1, else a slot of the previous level
    sl = level_slices(8)
    assert (parents[sl[0]] == -1).all()
    for prev, cur in zip(sl, sl[1:]):
        p = parents[cur]
        assert (p >= prev.start).all() and (p < prev.stop).all()
    # a child's score never exceeds its parent's (log-probs <= 0)
    ch = parents >= 0
    assert (scores[ch] <= scores[parents[ch]] + 1e-6).all()


def test_draft_scores_match_sequential_decoding(target, head):
    # a level-3 candidate's score = sum of the head's log-probs along its path, decoded one row at a time
    dr, _, _, _ = drafter_and_root(target, head)
    draft(dr, 3)
    scores, tokens, parents = dr.scores[0].clone(), dr.tokens[0].clone(), dr.parents[0].clone()
    inv = {int(t): d for d, t in enumerate((torch.arange(VD) + head.d2t).tolist())}
    n = len(PROMPT)
    lvl3 = level_slices(3)[2]
    checked = 0
    for c in range(lvl3.start, lvl3.stop, 5):
        p2 = int(parents[c])
        p1 = int(parents[p2])
        toks = [int(tokens[p1]), int(tokens[p2]), int(tokens[c])]
        ref, _, _, _ = drafter_and_root(target, head)            # fresh draft cache
        hid, score = ref.beam_h[0, :1], 0.0
        for i, t in enumerate(toks):
            lp = head.logprobs(hid)[0]
            score += float(lp[inv[t]])
            if i == len(toks) - 1:
                break
            row = torch.tensor([n + i])
            hid = head(hid[None], torch.tensor([[t]]), row, row, torch.ones(1, n + i + 1, dtype=torch.bool),
                       fused=False)[0]
        assert math.isclose(score, float(scores[c]), abs_tol=1e-4), (c, score, float(scores[c]))
        checked += 1
    assert checked >= 3


def test_confidence_is_best_path_probability(target, head):
    dr, conf0, _, _ = drafter_and_root(target, head)
    confs = [float(conf0[0])] + draft(dr, 8)
    for c, sl in enumerate(level_slices(8)):
        assert math.isclose(confs[c], math.exp(float(dr.scores[0, sl].max())), rel_tol=1e-6), c


def test_drafting_a_batch_equals_each_request_alone(target, head):
    """Two requests of different lengths drafted side by side (one extend, then each level for both)
    leave, row by row, the candidates (scores, tokens, parents), the committed head rows and the
    confidences that drafting each alone leaves."""
    prompts = [PROMPT, PROMPT2]
    dr, conf0, _ = drafter_for(target, head, prompts)
    confs = [conf0.clone()] + [dr.level(torch.tensor(i), cols(dr)).clone() for i in range(7)]
    assert dr.Ld.tolist() == [len(PROMPT), len(PROMPT2)] and conf0.shape == (2,)
    assert not torch.equal(dr.tokens[0], dr.tokens[1])                      # two different trees
    for b, p in enumerate(prompts):
        one, c1, _ = drafter_for(target, head, [p])
        alone = [c1] + [one.level(torch.tensor(i), cols(one)).clone() for i in range(7)]
        assert torch.equal(one.tokens[0], dr.tokens[b]) and torch.equal(one.parents[0], dr.parents[b]), b
        assert torch.allclose(one.scores[0], dr.scores[b], atol=1e-5), b
        assert torch.allclose(torch.stack([c[0] for c in alone]), torch.stack([c[b] for c in confs]), rtol=1e-5), b
        assert one.Ld.tolist() == [len(p)]


def test_extend_of_an_empty_slot_reads_nothing(target, head):
    """A slot with n = 0 (no request) beside a real one: the real request drafts what it drafts alone,
    and the empty slot's committed rows do not move."""
    dr = D.Drafter(head, 2, max_seq_len=64, top_k=K, depth=8, max_path=PATH, chunk=CHUNK)
    feats, nxt = target_pass(target, PROMPT)
    prefill_slot(dr, 1, feats, nxt, 0, len(nxt) - 1)
    F, I, n = pending([(feats[:0], nxt[:0]), (feats[-1:], nxt[-1:])])
    dr.extend(F, I, n, cols(dr))
    for i in range(3):
        dr.level(torch.tensor(i), cols(dr))
    one, _, _ = drafter_for(target, head, [PROMPT])
    for i in range(3):
        one.level(torch.tensor(i), cols(one))
    assert dr.Ld.tolist() == [0, len(PROMPT)]
    assert torch.equal(dr.tokens[1], one.tokens[0]) and torch.allclose(dr.scores[1], one.scores[0], atol=1e-5)


def test_select_is_prefix_closed_best_n(target, head):
    dr, _, _, _ = drafter_and_root(target, head)
    draft(dr, 8)
    for n in (1, 5, 20, 60, K + 7 * K * K):
        toks, pars, slots, rank = D.select(dr.scores, dr.tokens, dr.parents, n)
        assert toks.shape == pars.shape == slots.shape == rank.shape == (1, n)
        toks, pars, slots, rank = toks[0], pars[0], slots[0], rank[0]
        assert ((pars == -1) | ((pars >= 0) & (pars < torch.arange(n)))).all(), pars.tolist()
        # the chosen slots are the n best scores, in slot (parents-first) order
        order = torch.sort(dr.scores[0], descending=True, stable=True).indices[:n]
        best = torch.sort(order).values
        assert torch.equal(slots, best) and torch.equal(toks, dr.tokens[0, best])
        # parents map back to the same slots
        assert torch.equal(torch.where(pars < 0, -1, best[pars.clamp(min=0)]), dr.parents[0, best])
        # rank: the place in the score order; the best K of the selection are prefix-closed for every K
        assert sorted(rank.tolist()) == list(range(n)) and torch.equal(slots[rank.argsort()], order)
        for Kk in range(1, n + 1):
            kept = rank < Kk
            assert (~kept | (pars < 0) | kept[pars.clamp(min=0)]).all(), (n, Kk)


def test_select_batch_rows_equal_each_alone(target, head):
    dr, _, _ = drafter_for(target, head, [PROMPT, PROMPT2])
    draft(dr, 4)
    dr.scores[1, K + K * K:] = float("-inf")                # request 1 as if stopped after level 2
    for n in (3, 12, 40):
        got = D.select(dr.scores, dr.tokens, dr.parents, n)
        for b in range(2):
            alone = D.select(dr.scores[b:b + 1], dr.tokens[b:b + 1], dr.parents[b:b + 1], n)
            for x, y in zip(got, alone):
                assert torch.equal(x[b], y[0]), (n, b)


def test_select_after_an_early_stop_takes_only_drafted_slots(target, head):
    dr, _, _, _ = drafter_and_root(target, head)
    draft(dr, 2)                                   # levels 1-2 drafted, the rest score -inf
    toks, pars, slots, _ = D.select(dr.scores, dr.tokens, dr.parents, K + K * K)
    assert int(slots.max()) < K + K * K and torch.isfinite(dr.scores[0, slots[0]]).all()


def test_select_ties_keep_parent_first():
    # node 2 (child of node 0) ties its parent's score: the parent must be selected first
    s, t, p = T2([-0.5, -1.0, -0.5, -2.0], torch.float32), T2([10, 11, 12, 13]), T2([-1, -1, 0, 1])
    toks, pars, _, rank = D.select(s, t, p, 2)
    assert toks.tolist() == [[10, 12]] and pars.tolist() == [[-1, 0]] and rank.tolist() == [[0, 1]]
    toks, pars, _, _ = D.select(s, t, p, 1)
    assert toks.tolist() == [[10]] and pars.tolist() == [[-1]]


def T2(x, dtype=torch.long):
    """One request's row as a batch of one."""
    return torch.tensor([x], dtype=dtype)


def test_level_of_slots():
    # k = 2: slots of level 1 = 0, 1; level 2 = 2..5; level 3 = 6..9 (graft.assemble's "deepest" anchor
    # is the best kept node of the deepest level it reads from here)
    assert D.level_of(torch.arange(10), 2).tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    sl = level_slices(8)
    lv = D.level_of(torch.arange(K + 7 * K * K).view(2, -1), K).flatten()        # any shape
    for l, s in enumerate(sl, start=1):
        assert (lv[s] == l).all(), l


# ----------------------------------------------------------------------------- reduced vocabulary without d2t

# BUG: (draft.py load_head, the line `if "d2t" not in sd or c.draft_vocab_size == c.vocab_size:`):
# a head with a reduced draft vocabulary (draft_vocab_size < vocab_size) whose checkpoint lacks d2t gets
# an all-zero d2t, i.e. draft id i is silently taken to be target id i. Every drafted token is then wrong
# (output stays lossless, acceptance collapses) and nothing tells the user. The loader should rebuild d2t
# from t2d when that is present (used = t2d.nonzero(); d2t = used - arange(Vd)) and refuse with a
# GraftError when neither is there.
def test_reduced_vocab_without_d2t_rebuilds_from_t2d(official, target, head, tmp_path):
    d, ref, cfg = official
    sd = {k: v for k, v in ref.items() if k != "d2t"}
    assert "t2d" in sd and int(sd["t2d"].sum()) == VD
    try:
        loaded = CK.load_head(write(tmp_path / "t2d-only", sd, cfg), target)
    except GraftError as e:                       # refusing is acceptable too, as long as it is explicit
        assert "d2t" in str(e)
        return
    assert torch.equal(loaded.d2t, head.d2t), "d2t silently replaced by zeros"


def test_reduced_vocab_without_d2t_or_t2d_is_refused(official, target, tmp_path):
    d, ref, cfg = official
    sd = {k: v for k, v in ref.items() if k not in ("d2t", "t2d")}
    with pytest.raises(GraftError):
        CK.load_head(write(tmp_path / "no-map", sd, cfg), target)


# BUG: (draft.py load_head, the d2t range check
#   `if int((head.d2t + torch.arange(c.draft_vocab_size, device=device)).max()) >= ta.vocab_size:`):
# only the upper end is checked. A d2t that maps a draft id to a negative target id loads fine and
# crashes later inside the target's embedding lookup with a traceback (or, on GPU, an indexing assert).
# Suggested fix: refuse when `(d2t + arange).min() < 0` as well, with the same one-line GraftError.
def test_refuse_d2t_negative_target_id(official, target, tmp_path):
    d, ref, cfg = official
    bad = ref["d2t"].clone()
    bad[0] = -1                                           # draft id 0 -> target id -1
    with pytest.raises(GraftError):
        CK.load_head(write(tmp_path / "d2t-neg", dict(ref, d2t=bad), cfg), target)


# BUG: (draft.py normalize_names / load_head): tensors the head does not know are dropped silently.
# Published heads come in variants a loader may meet, e.g. SpecForge's `fc_norm` (three
# RMSNorm(Ht) weights `fc_norm.{0,1,2}.weight` applied to the low/mid/high chunks before fc). Such a
# head loads without complaint and drafts from un-normalised features, i.e. garbage. The loader should
# either implement the variant or refuse unknown weight names (anything but fc / midlayer.* / norm /
# lm_head / d2t / t2d / embed_tokens after normalisation) with a one-line GraftError.
def test_fc_norm_head_is_honoured_or_refused(official, target, head, tmp_path):
    d, ref, cfg = official
    sd = dict(ref)
    for i in range(3):
        sd[f"fc_norm.{i}.weight"] = torch.full((HT,), 2.0)
    path = write(tmp_path / "fcnorm", sd, dict(cfg, fc_norm=True))
    try:
        loaded = CK.load_head(path, target)
    except GraftError:
        return
    x3 = 5.0 * torch.randn(1, 4, 3 * HT, generator=torch.Generator().manual_seed(0))
    ids, pos = torch.tensor([[3, 9, 27, 1]]), torch.arange(4)
    assert not torch.allclose(loaded(x3, ids, pos), head(x3, ids, pos), atol=1e-4), \
        "fc_norm.* weights were silently ignored"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_not_wanted_only_write_their_keys(target, dtype):
    """want (the rows whose output is read: an extend's new root; none of a prefill's or a catch-up's): the
    CPU's fused layer skips the other rows' q, attention, o_proj and MLP. The wanted rows' outputs and
    every cache row are the same bits as computing every row; the rows not wanted output zeros."""
    h = make_head(target, seed=7).to(dtype)
    g = torch.Generator().manual_seed(3)
    B, T, S = 2, 6, 24
    x3 = torch.randn(B, T, 3 * HT, generator=g).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    L = torch.tensor([5, 9])
    rows = L[:, None] + torch.arange(T)
    mask = M.attention_mask(torch.ones(T, T, dtype=torch.bool).tril(), L, torch.arange(S))
    keep = torch.arange(T)[None] < torch.tensor([[6], [4]])            # slot 1: two padding rows
    want = torch.arange(T)[None] == torch.tensor([[5], [3]])           # each slot's last real row
    outs, caches = [], []
    for w in (None, want, torch.zeros_like(want)):
        cache = h.setup_caches(S, B)
        for t in cache.tensors():                                       # rows committed before
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
        outs.append(h(x3, ids, rows, rows, mask, fused=True, cache=cache, keep=keep, want=w))
        caches.append(cache)
    assert torch.equal(outs[1][want], outs[0][want]) and (outs[1][~want] == 0).all() and (outs[2] == 0).all()
    assert outs[0][want].abs().sum() > 0
    for c in caches[1:]:
        assert all(torch.equal(a, b) for a, b in zip(c.tensors(), caches[0].tensors()))
