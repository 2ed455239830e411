"""train.py eagle3 on tiny random targets: --init fine-tunes a given head from its own weights, --texts
cuts real texts into exact windows (labels stay the target's), and bad paths are one-line errors
before the target runs. Each run is a few steps of a 64-wide head (a second or two on one thread)."""
import json

import pytest
import torch
from safetensors.torch import load_file

import checkpoint as CK
import model as M
import train
from draft import Eagle3, HeadConfig
from tokenizer import load_tokenizer


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


def argv(target, out, *more, steps=2):
    return ["eagle3", "--ckpt", str(target), "--out", str(out), "--device", "cpu", "--new-tokens", "8",
            "--steps", str(steps), "--batch", "2", "--seq-len", "16", "--ttt", "2", "--draft-vocab", "100",
            "--log-every", "1", "--gen-batch", "4", "--threads", "1", *map(str, more)]


@pytest.fixture
def base_head(tiny_ckpt, tmp_path):
    """(target, a head trained 2 steps on it by self-distillation, with a reduced draft vocabulary)."""
    target = tiny_ckpt("llama31")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\nThe ball was red\nShe saw a tree\n")
    out = tmp_path / "base"
    train.main(argv(target, out, "--prompts", prompts))
    return target, out


def code_dir(tmp_path, n_files=3, lines=40):
    """A folder of .py files (and files --texts must skip: a .txt and a __pycache__ .py)."""
    d = tmp_path / "code"
    (d / "pkg" / "__pycache__").mkdir(parents=True)
    for i in range(n_files):
        (d / ("pkg" if i % 2 else "") / f"m{i}.py").write_text(
            "".join(f"def f{i}_{k}(x):\n    return x * {k} + {i}\n" for k in range(lines)))
    (d / "notes.txt").write_text("not code " * 200)
    (d / "pkg" / "__pycache__" / "junk.py").write_text("x = 1\n" * 200)
    return d


def test_init_trains_from_the_given_heads_weights(base_head, tmp_path, monkeypatch):
    """The first training step sees exactly the init head's weights; the run keeps its draft vocabulary
    (d2t, t2d) and changes its weights; --save-dtype float16 writes float16."""
    target, base = base_head
    seen = []
    real = train.ttt_loss

    def spy(head, *a, **k):
        if not seen:
            seen.append({n: v.detach().clone() for n, v in train.head_state(head).items()})
        return real(head, *a, **k)

    monkeypatch.setattr(train, "ttt_loss", spy)
    out = tmp_path / "tuned"
    code = code_dir(tmp_path)
    train.main(argv(target, out, "--texts", code, "--init", base, "--draft-vocab", "50", "--save-dtype", "float16"))
    init = load_file(str(base / "model.safetensors"))
    assert set(seen[0]) == set(init) - {"t2d"}
    for k, v in seen[0].items():
        assert torch.equal(v, init[k].to(v.dtype)), k
    tuned = load_file(str(out / "model.safetensors"))
    assert torch.equal(tuned["d2t"], init["d2t"]) and torch.equal(tuned["t2d"], init["t2d"])   # not --draft-vocab 50
    assert tuned["fc.weight"].dtype == torch.float16 and tuned["lm_head.weight"].shape == init["lm_head.weight"].shape
    assert not torch.equal(tuned["fc.weight"].float(), init["fc.weight"].half().float())
    tgt = CK.load_model(str(target))
    CK.load_head(str(out), tgt)                     # loads as a head of its target


def test_init_step_one_loss_is_the_init_heads_loss(base_head, tmp_path):
    """The loss logged at step 1 (computed before the first update) is the init head's own loss on that
    batch, recomputed here from the cached data with the run's seed."""
    import random
    target, base = base_head
    out = tmp_path / "tuned"
    train.main(argv(target, out, "--texts", code_dir(tmp_path), "--init", base, steps=1))
    first = json.loads((out / "train_log.jsonl").read_text().splitlines()[0])
    tgt = CK.load_model(str(target), max_seq_len=1)
    head = CK.load_head(str(base), tgt, dtype=torch.float32)
    seqs = train.load_sequences(str(out / "train_data.safetensors"))
    views = train.load_views(str(out / "train_views.safetensors"), seqs)
    used = head.to_target(torch.arange(head.config.draft_vocab_size))
    to_draft = torch.full((tgt.args.vocab_size,), -1, dtype=torch.long)
    to_draft[used] = torch.arange(used.numel())
    batch = next(train.batches(seqs, views, to_draft, 16, 2, random.Random(0)))
    with torch.no_grad():
        loss, _ = train.ttt_loss(head, *batch, 2)
    assert first["step"] == 1 and first["loss"] == pytest.approx(loss.item(), abs=1e-3)


def test_texts_windows_are_exact_and_the_labels_the_targets(tiny_ckpt, tmp_path):
    """--texts FOLDER: its .py files (sorted, all depths, __pycache__ and other suffixes left out), each
    tokenized and cut into non-overlapping windows of --seq-len + 1 tokens, tails dropped; the views
    hold the target's own distribution on those tokens, not the text's next token."""
    target = tiny_ckpt("llama31")
    code = code_dir(tmp_path)
    files = train.text_files([str(code)])
    assert files == sorted(str(p) for p in [code / "m0.py", code / "m2.py", code / "pkg" / "m1.py"])
    tok = load_tokenizer(str(target), CK.load_model(str(target), max_seq_len=1).args)
    want = []
    for f in files:
        ids = tok.encode(open(f).read())
        assert len(ids) % 17                                     # every file has a tail to drop
        want += [ids[a:a + 17] for a in range(0, len(ids) - 16, 17)]
    out = tmp_path / "head"
    train.main(argv(target, out, "--texts", code))
    seqs = train.load_sequences(str(out / "train_data.safetensors"))
    assert seqs == want and all(len(s) == 17 for s in seqs)
    views = train.load_views(str(out / "train_views.safetensors"), seqs)
    tgt = CK.load_model(str(target), max_seq_len=1)
    with torch.no_grad():
        logits = tgt(torch.tensor([seqs[3]]), torch.arange(17))
    assert torch.equal(views[3][1][:, 0].long(), logits[0].argmax(-1))
    # --max-windows: evenly spaced, deterministic
    assert train.text_windows(tok, files, 16, 4) == [want[k * len(want) // 4] for k in range(4)]


def test_other_texts_do_not_reuse_the_data_cache(tiny_ckpt, tmp_path, capsys):
    """The data and views caches are keyed by what they were made from: another --texts, --seq-len or
    --prompts in the same --out makes them again; the same one reuses them."""
    target = tiny_ckpt("llama31")
    code = code_dir(tmp_path)
    out = tmp_path / "head"
    train.main(argv(target, out, "--texts", code / "m0.py", "--restart"))
    first = train.load_sequences(str(out / "train_data.safetensors"))
    capsys.readouterr()
    train.main(argv(target, out, "--texts", code / "m0.py", "--restart"))
    assert "sequences from" in capsys.readouterr().err
    train.main(argv(target, out, "--texts", code / "m2.py", "--restart"))
    assert "made from other inputs" in capsys.readouterr().err
    second = train.load_sequences(str(out / "train_data.safetensors"))
    assert second != first and len(second) == len(first)        # same lengths: views must be keyed too
    views = train.load_views(str(out / "train_views.safetensors"), second)
    tgt = CK.load_model(str(target), max_seq_len=1)
    with torch.no_grad():
        logits = tgt(torch.tensor([second[0]]), torch.arange(17))
    assert torch.equal(views[0][1][:, 0].long(), logits[0].argmax(-1))
    train.main(argv(target, out, "--texts", code / "m2.py", "--seq-len", "8", "--restart"))
    assert "made from other inputs" in capsys.readouterr().err
    assert all(len(s) == 9 for s in train.load_sequences(str(out / "train_data.safetensors")))


def test_prompts_and_texts_mix(tiny_ckpt, tmp_path, capsys):
    """--prompts and --texts together: each kind made and cached under its own name, both in the
    batches; a second run reuses both caches; --bf16 trains under autocast (float32 weights saved)."""
    target = tiny_ckpt("llama31")
    code, p = code_dir(tmp_path), tmp_path / "p.txt"
    p.write_text("Once upon a time\nThe ball was red\n")
    out = tmp_path / "head"
    seen = []
    real = train.batches
    train.batches = lambda seqs, *a, **k: (seen.append(len(seqs)), real(seqs, *a, **k))[1]
    try:
        train.main(argv(target, out, "--prompts", p, "--texts", code, "--bf16"))
    finally:
        train.batches = real
    chat = train.load_sequences(str(out / "train_data.safetensors"))
    texts = train.load_sequences(str(out / "train_data_texts.safetensors"))
    assert len(chat) == 2 and texts == train.text_windows(
        load_tokenizer(str(target), CK.load_model(str(target), max_seq_len=1).args), train.text_files([str(code)]), 16)
    assert seen == [len(chat) + len(texts)] and (out / "train_views_texts.safetensors").is_file()
    assert all(v.dtype == torch.float32 for v in load_file(str(out / "model.safetensors")).values() if v.is_floating_point())
    capsys.readouterr()
    train.main(argv(target, out, "--prompts", p, "--texts", code, "--restart"))
    err = capsys.readouterr().err
    assert err.count("sequences from") == 2 and "views" not in err.replace("train_views", "")


def misfit_head(target, out):
    """A head for `target` whose MLP is wider than one of the target's layers (load_head takes it, a
    fine-tune of this target's head shape cannot)."""
    tgt = CK.load_model(str(target), max_seq_len=1)
    head = train.new_head(tgt, 50)
    c = head.config
    c.layer.intermediate_size *= 2
    wide = Eagle3(HeadConfig(layer=c.layer, target_hidden=c.target_hidden, vocab_size=c.vocab_size,
                             draft_vocab_size=50))
    wide.embed_tokens = tgt.embed_tokens
    CK.save_head(wide, str(out))


def test_bad_paths_and_heads_are_one_line_errors_before_any_work(base_head, tiny_ckpt, tmp_path, monkeypatch):
    target, base = base_head
    code = code_dir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "short.py").write_text("x = 1\n")
    misfit_head(target, tmp_path / "wide")
    other = tiny_ckpt("llama31", hidden_size=32)
    qwen3 = tiny_ckpt("qwen3")              # same widths, other head_dim
    p = tmp_path / "p.txt"
    p.write_text("Once upon a time\n")

    def no_views(*a, **k):
        raise AssertionError("the target ran before the error")

    monkeypatch.setattr(train, "target_views", no_views)
    cases = {
        "--texts": (["--texts", tmp_path / "missing"], "neither a file nor a folder"),
        "no .py": (["--texts", tmp_path / "empty"], "without .py files"),
        "no window": (["--texts", tmp_path / "short.py"], "no file holds 17 tokens"),
        "neither": ([], "pass --prompts"),
        "--init": (["--texts", code, "--init", tmp_path / "nohead"], "head folder not found"),
        "misfit": (["--texts", code, "--init", tmp_path / "wide"], "does not fit this target"),
        "other target": (["--texts", code, "--init", base], "does not fit"),
        "qwen3 target": (["--texts", code, "--init", base], "does not fit this target"),
    }
    for name, (more, needle) in cases.items():
        tgt = {"other target": other, "qwen3 target": qwen3}.get(name, target)
        with pytest.raises(M.GraftError) as e:
            train.main(argv(tgt, tmp_path / f"out-{name}", *more))
        assert needle in one_line(e), name


def test_code_prompts_are_a_def_and_its_docstring_from_the_training_split():
    """code-prompts: deterministic, each a public function's signature and docstring and nothing of
    its body, taken from the stdlib's training split (never a file the stdlib, lcc or repobench sets read)."""
    import sysconfig
    import data
    got = data.code_prompts(60)
    assert got == data.code_prompts(60) and len(got) == 60 == len(set(got))
    for p in got:
        body = p.rstrip("\n").split("\n")
        assert p.startswith("def ") and body[-1].strip().endswith(('"""', "'''")), p
    root = sysconfig.get_paths()["stdlib"]
    train_split = set(data.stdlib_training_files(root))
    assert train_split and all(not data.is_heldout(f, root) and not data.is_long_context_file(f, root) for f in train_split)
