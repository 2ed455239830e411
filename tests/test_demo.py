"""The shipped demo pair (checkpoints/) and the `train.py target` pipeline that made it."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from generate import DEMO_CKPT, DEMO_DRAFT, Config, build_engine, generate, make_method, warm_up
from verify import Sampling

has_demo = pytest.mark.skipif(not (Path(DEMO_CKPT) / "model.safetensors").is_file()
                              or not (Path(DEMO_DRAFT) / "model.safetensors").is_file(),
                              reason="demo checkpoints not present")


def test_train_target_writes_a_folder_transformers_loads(tmp_path):
    """A few steps on a two-file corpus: tokenizer, config and weights in standard HF form."""
    from model import load_model, load_tokenizer
    from train import main
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):  # the held-out split takes whole files by hash: give it enough of them
        (corpus / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i}\n\n\nprint(f{i}(2))\n" * 20)
    out = tmp_path / "target"
    main(["target", "--out", str(out), "--corpus", str(corpus), "--vocab", "300", "--dim", "32",
          "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "24", "--intermediate", "64",
          "--context", "128", "--seq-len", "32", "--batch", "2", "--steps", "3", "--minutes", "0",
          "--no-compile", "--no-bf16"])
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).is_file(), f
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]
    ours = load_model(str(out))
    tok = load_tokenizer(str(out), ours.args)
    ids = tok.encode("def f1(x):\n    return")
    assert tok.decode(ids) == "def f1(x):\n    return"
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        want = ref(x).logits
        got = ours(x, torch.arange(len(ids)))
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


@has_demo
def test_demo_pair_loads_and_graft_equals_ar():
    eng = build_engine(DEMO_CKPT, DEMO_DRAFT, max_seq_len=1024)
    assert eng.model.args.arch == "qwen3" and eng.model.args.qk_norm
    warm_up(eng, Config(), rounds=2, max_new_tokens=32, use_cache=False)
    for p in ["def read_config(path):\n", "class Stack:\n    def __init__(self):\n"]:
        ids = eng.tokenizer.encode(p)
        base = generate(eng, make_method(eng, "ar"), ids, 48, Sampling(), eng.tokenizer.eos_ids)
        for m in ("eagle3", "graft"):
            r = generate(eng, make_method(eng, m), ids, 48, Sampling(), eng.tokenizer.eos_ids)
            assert r.tokens == base.tokens, m


@has_demo
def test_demo_pair_matches_transformers():
    from transformers import AutoModelForCausalLM
    from model import load_model
    ours = load_model(DEMO_CKPT, max_seq_len=256)
    ref = AutoModelForCausalLM.from_pretrained(DEMO_CKPT, torch_dtype=torch.float32).eval()
    x = torch.randint(0, ours.args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(x, torch.arange(40)), ref(x).logits, atol=1e-3)


@has_demo
def test_default_command_runs_under_a_minute(tmp_path):
    env = dict(os.environ, GRAFT_CACHE=str(tmp_path))
    t0 = time.time()
    p = subprocess.run([sys.executable, "generate.py", "--max-new-tokens", "24", "--json"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert time.time() - t0 < 60
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert rec["method"] == "graft" and rec["lossless"] is True and rec["speedup"] > 0
    assert "speedup" in p.stderr
