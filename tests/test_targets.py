"""The paper's other targets: Qwen3-MoE, heads that declare their own auxiliary layers, SentencePiece
tokenizers (Vicuna, Llama-2 era) and Vicuna's chat format.

Tiny random Qwen3-MoE checkpoints are written by transformers (the reference); stories260K's
tok512.model is a real SentencePiece model, checked against the sentencepiece library itself.
"""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import checkpoint as CK
import cli as CLI
import engine as E
import graft as GR
import model as M
import tokenizer as TOK
from conftest import NO_BLOCK, SHARED, STORIES, STORIES_TEXT, hf_model, make_tokenizer, needs_shared, TINY_CHAT_TEMPLATE
from verify import Sampling

TOL = 1e-4


def random_head(target_dir, out_dir, seed=0, draft_vocab=200):
    """A random EAGLE-3 head for a checkpoint, saved in the published format."""
    from draft import Eagle3, HeadConfig
    a = CK.load_model(str(target_dir)).args
    torch.manual_seed(seed)
    layer = M.ModelArgs(dim=a.dim, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=a.dim // 4,
                        intermediate_size=2 * a.dim, vocab_size=a.vocab_size)
    h = Eagle3(HeadConfig(layer=layer, target_hidden=a.dim, vocab_size=a.vocab_size, draft_vocab_size=draft_vocab))
    for p in h.parameters():
        torch.nn.init.normal_(p, std=0.2)
    h.d2t.copy_(torch.sort(torch.randperm(a.vocab_size)[:draft_vocab]).values - torch.arange(draft_vocab))
    CK.save_head(h, str(out_dir))
    return out_dir


def make_moe(path: Path, norm_topk: bool = True, step: int = 1, dense=(1,), seed: int = 0) -> Path:
    """A tiny random Qwen3-MoE: 4 layers, 8 experts, 3 per token, layer 1 dense (mlp_only_layers)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk, decoder_sparse_step=step,
                         mlp_only_layers=list(dense), max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                         rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.2 * torch.randn(p.shape, generator=g))
    m.generation_config.eos_token_id = 2
    m.save_pretrained(str(path))
    make_tokenizer(path, 300, TINY_CHAT_TEMPLATE)
    return path


MOE_KINDS = {"norm": dict(norm_topk=True), "no-norm": dict(norm_topk=False), "step2": dict(step=2, dense=())}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = make_moe(tmp_path_factory.mktemp(f"moe-{kind}"), **MOE_KINDS[kind])
        return cache[kind]
    return get


def ids_(n, seed=0):
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(MOE_KINDS))
def test_moe_logits_and_features_match_transformers(moe, kind):
    path = moe(kind)
    ours = CK.load_model(str(path), max_seq_len=64)
    assert ours.args.arch == "qwen3_moe" and ours.args.n_experts == 8
    assert ours.args.sparse_layers == ((True, False, True, True) if kind != "step2" else (False, True, False, True))
    x = ids_(24)
    with torch.no_grad():
        logits, feats = ours(x, torch.arange(24), capture=True)
        ref = hf_model(path)(x, output_hidden_states=True)
    hs, L = ref.hidden_states, 4
    assert (logits - ref.logits).abs().max() < TOL
    want = torch.cat([hs[i] for i in ours.capture_layers], dim=-1)
    assert (feats - want).abs().max() < TOL


def test_moe_incremental_decoding_equals_full_forward(moe):
    """One token at a time (the gathering path: 3 experts of 8) against the full pass (every expert)."""
    m = CK.load_model(str(moe("norm")), max_seq_len=64)
    m.setup_caches(64)
    x = ids_(16, seed=1)
    with torch.no_grad():
        full = m(x, torch.arange(16))[0]
        pos = torch.arange(8)
        got = [m(x[:, :8], pos, pos, torch.ones(8, 8, dtype=torch.bool).tril())[0, -1]]
        for p in range(8, 16):
            r = torch.tensor([p])
            got.append(m(x[:, p:p + 1], r, r, torch.ones(1, p + 1, dtype=torch.bool))[0, 0])
    assert (torch.stack(got) - full[7:]).abs().max() < TOL


def test_moe_batch_decoding_equals_each_sequence_alone(moe):
    """Two sequences decoded side by side (a batch of two, each at its own rows and length: 2 x 3
    experts of 8, the gathering path) against each one's full pass."""
    m = CK.load_model(str(moe("norm")), max_seq_len=64)
    m.setup_caches(64, batch=2)
    xs = [ids_(16, seed=1), ids_(13, seed=2)]
    cols = torch.arange(m.cache.rows)
    with torch.no_grad():
        fulls = [m(x, torch.arange(x.shape[1]))[0] for x in xs]
        for b, n in enumerate((8, 5)):
            pos = torch.arange(n)
            mask = M.attention_mask(torch.ones(n, n, dtype=torch.bool).tril(), torch.tensor([0]), cols)
            m(xs[b][:, :n], pos, pos[None], mask, slots=torch.tensor([b]))
        L = torch.tensor([8, 5])
        for _ in range(8):
            tok = torch.stack([xs[0][0, L[0]], xs[1][0, L[1]]])[:, None]
            got = m(tok, L[:, None], L[:, None], M.attention_mask(torch.ones(1, 1, dtype=torch.bool), L, cols))
            for b in range(2):
                assert (got[b, 0] - fulls[b][L[b]]).abs().max() < TOL, (b, int(L[b]))
            L = L + 1


def test_moe_gather_and_dense_paths_agree():
    a = M.ModelArgs(dim=16, n_experts=6, n_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True)
    block = M.MoE(a)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        x = torch.randn(1, 5, 16, generator=g)          # 5 tokens x 2 experts > 6: the dense path
        dense = block(x)
        one_by_one = torch.cat([block(x[:, i:i + 1]) for i in range(5)], dim=1)   # 2 <= 6: gathered
    assert (dense - one_by_one).abs().max() < 1e-5


@pytest.mark.parametrize("s", [Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)], ids=["greedy", "sampled"])
def test_moe_every_method_lossless(moe, tmp_path, s):
    target = moe("norm")
    head = random_head(target, tmp_path / "head", draft_vocab=200)
    eng = CLI.build_engine(str(target), str(head), max_seq_len=200, top_k=4, depth=4)
    cfg = GR.Config(budget=12, checkpoints=(0, 1, 2), thresholds={0: 0.3, 1: 0.1, 2: 0.01})
    prompts = ([1, 40, 41, 42], [1] + list(range(50, 70)))
    bases = []
    for ids in prompts:
        base = E.generate(eng, E.make_method(eng, "ar"), ids, 24, s, ()).tokens
        bases.append(base)
        for m in NO_BLOCK[1:]:
            assert E.generate(eng, E.make_method(eng, m, cfg), ids, 24, s, ()).tokens == base, m
    # both prompts side by side in a batch of two: each request gets the tokens it gets alone
    eng2 = CLI.build_engine(str(target), str(head), max_seq_len=200, top_k=4, depth=4, batch=2)
    for m in ("ar", "graft", "recycle"):
        got = E.run(eng2, eng2.make(m, cfg), [E.Request(list(ids), s) for ids in prompts], 24)
        assert [r.tokens for r in got.requests] == bases, m


def test_moe_expert_missing_is_one_line_error(moe, tmp_path):
    from safetensors.torch import load_file, save_file
    dst = tmp_path / "m"
    shutil.copytree(moe("norm"), dst)
    sd = load_file(str(dst / "model.safetensors"))
    del sd["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(M.GraftError) as e:
        CK.load_model(str(dst))
    assert "experts.5.up_proj" in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- heads that declare their layers

@pytest.mark.parametrize("where", ["eagle_config", "top"])
def test_head_with_declared_aux_layers(tiny_ckpt, tmp_path, where):
    """A head declaring other layers (SGLang's nested ids count outputs of layers, vLLM's top-level ids
    inputs): the target captures exactly those, features equal transformers' hidden states, lossless."""
    target = tiny_ckpt("llama31")
    head = random_head(target, tmp_path / "head")
    cfg = json.loads((head / "config.json").read_text())
    if where == "eagle_config":
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 3, 7]}    # outputs of 0, 3, 7
    else:
        cfg["eagle_aux_hidden_state_layer_ids"] = [1, 4, 8]                     # inputs of 1, 4, 8
    (head / "config.json").write_text(json.dumps(cfg))
    eng = CLI.build_engine(str(target), str(head), max_seq_len=200)
    assert eng.model.capture_layers == (1, 4, 8)          # 8: the last layer's output (8 layers)
    x = ids_(12, seed=4)
    with torch.no_grad():
        _, feats = eng.model(x, torch.arange(12), capture=True)
        hs = hf_model(target)(x, output_hidden_states=True).hidden_states
    # transformers' last hidden state is after the final norm: compare layer 8's output before it
    assert (feats[..., :128] - torch.cat([hs[1], hs[4]], -1)).abs().max() < TOL
    cfg = GR.Config(budget=12, thresholds={0: 0.1, 1: 0.05, 5: 0.0})
    ids = [1, 40, 41, 42, 43]
    base = E.generate(eng, E.make_method(eng, "ar"), ids, 32, Sampling(), ()).tokens
    for m in ("eagle3", "graft"):
        assert E.generate(eng, E.make_method(eng, m, cfg), ids, 32, Sampling(), ()).tokens == base


def test_head_declaring_layers_the_target_lacks_is_refused(tiny_ckpt, tmp_path):
    target = tiny_ckpt("llama31")
    head = random_head(target, tmp_path / "head")
    cfg = json.loads((head / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 4, 12]}
    (head / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(M.GraftError) as e:
        CK.load_head(str(head), CK.load_model(str(target)))
    assert "not layers of this 8-layer target" in str(e.value)


# ----------------------------------------------------------------------------- SentencePiece and Vicuna

TOK512 = SHARED / "models" / "stories260K" / "tok512.model"
STRINGS = ["Once upon a time", "  leading spaces", "repeated    spaces here", "trailing   ",
           "\tindented\n    code():\n        return 1", "digits 12345 and 3.14", "unicode: café, naïve, 中文, 🙂",
           "", " ", "a\n\nb", "x  \n  y", "   ", "a \n b", " \t x \t ", "Lily's mom said, \"Let's go!\""]


@needs_shared
def test_sentencepiece_model_encodes_like_sentencepiece():
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=str(TOK512))
    tk = TOK.sentencepiece_tokenizer(str(TOK512))
    for s in STRINGS:
        assert tk.encode(s).ids == [sp.bos_id()] + sp.encode(s), repr(s)


@needs_shared
def test_stories_with_tokenizer_model_only_gives_the_documented_text(tmp_path):
    d = tmp_path / "stories"
    shutil.copytree(STORIES, d)
    (d / "tokenizer.json").unlink()
    shutil.copy(TOK512, d / "tokenizer.model")
    eng = CLI.build_engine(str(d))
    r = E.generate(eng, E.make_method(eng, "ar"), eng.tokenizer.encode(""), 120, Sampling(), ())
    assert eng.tokenizer.decode(r.tokens) == STORIES_TEXT


def test_vicuna_without_template_uses_v11_format(tiny_ckpt, tmp_path):
    d = tmp_path / "vicuna-7b-v1.3"
    shutil.copytree(tiny_ckpt("llama2"), d)              # llama2 kind: no chat_template
    tok = TOK.load_tokenizer(str(d))
    assert tok.render([{"role": "user", "content": "Hi"}]) == (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions. USER: Hi ASSISTANT:")


def test_chat_without_template_elsewhere_is_one_line_error(tiny_ckpt):
    with pytest.raises(M.GraftError) as e:
        TOK.load_tokenizer(str(tiny_ckpt("llama2"))).apply_chat("Hi")
    assert "chat_template" in str(e.value) and "\n" not in str(e.value)
