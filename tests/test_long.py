"""Long context (issue 20): the lcc, repobench and longdoc prompt builders, the edit similarity, and
bench.py --context (refusal past the context, the new columns, the speedup-against-context plot).

The builders are tested with a character-level fake tokenizer (one id per character, so a prompt's
text is exactly readable back); bench runs the tiny stdlib pair (data.STDLIB_CKPT) at 64/128 tokens.
"""
import json
import os
import sysconfig

import pytest

import bench
import data

ROOT = sysconfig.get_paths()["stdlib"]
BOS = 1


class CharTok:
    """One id per character (ord + 10), BOS = 1 in front with add_special_tokens; with `template`, a
    chat template of the shape <user>...</user><assistant>, whose special tokens are single ids."""
    SPECIAL = {"<user>": 2, "</user>": 3, "<assistant>": 4}

    def __init__(self, template: bool = False):
        self.chat_template = "fake" if template else None

    def encode(self, text, add_special_tokens=True):
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in self.SPECIAL if text.startswith(t, i)), None)
            ids.append(self.SPECIAL[tag] if tag else ord(text[i]) + 10)
            i += len(tag) if tag else 1
        return ([BOS] if add_special_tokens else []) + ids

    def decode(self, ids):
        back = {v: k for k, v in self.SPECIAL.items()}
        return "".join(back.get(i, "") if i < 10 else chr(i - 10) for i in ids)

    def render(self, messages, add_generation_prompt=True, **kw):
        turns = "".join(f"<user>{m['content']}</user>" for m in messages)
        return turns + ("<assistant>" if add_generation_prompt else "")


def source(p):
    """The file and the 0-based line index a code prompt stops before."""
    rel, line = p.source.rsplit(":", 1)
    return os.path.join(ROOT, rel), int(line) - 1


@pytest.mark.parametrize("name", data.LONG)
def test_builders_are_deterministic_and_exact(name):
    tok = CharTok(template=name == "longdoc")
    a = data.long_prompts(name, 300, 3, tok)
    b = data.long_prompts(name, 300, 3, tok)
    assert len(a) == 3 and [p.ids for p in a] == [p.ids for p in b] and [p.source for p in a] == [p.source for p in b]
    assert all(len(p.ids) == 300 for p in a)
    assert len({tuple(p.ids) for p in a}) == 3          # three different sources


def test_lcc_is_the_files_text_up_to_a_line_boundary():
    tok = CharTok()
    for p in data.long_prompts("lcc", 500, 3, tok):
        path, cut = source(p)
        lines = data._lines(path)
        assert p.ids[0] == BOS and tok.decode(p.ids[1:]) == "".join(lines[:cut])[-499:]
        assert tok.decode(p.ids).endswith("\n")
        want = [l.strip() for l in lines[cut:] if l.strip()][:data.REFERENCE_LINES]
        assert p.reference.split("\n") == want and len(want) == data.REFERENCE_LINES
        assert data.is_long_context_file(path, ROOT) and not data.is_heldout(path, ROOT)


def test_longest_gives_the_same_sources_at_every_context():
    """With the run's largest context as `longest`, a shorter context gets the same files and cuts
    (the same references): only the left context differs."""
    tok = CharTok()
    short = data.long_prompts("lcc", 200, 3, tok, longest=2000)
    long = data.long_prompts("lcc", 2000, 3, tok, longest=2000)
    assert [p.source for p in short] == [p.source for p in long]
    assert [p.reference for p in short] == [p.reference for p in long]
    assert all(l.ids[-199:] == s.ids[-199:] for s, l in zip(short, long))


def test_a_file_too_short_is_skipped_for_another():
    """At 30000 characters, the prompts come from the files (long_files order) with at least that much
    text before their cut, and no other."""
    fits = []
    for f in data.long_files()[:20]:
        rel, lines = os.path.relpath(f, ROOT), data._lines(f)
        cut = data.code_cut(lines, rel)
        if cut is not None and len("".join(lines[:cut])) >= 29999:
            fits.append(f"{rel}:{cut + 1}")
    assert 0 < len(fits) < 20
    assert [p.source for p in data.long_prompts("lcc", 30000, len(fits), CharTok())] == fits


def test_repobench_puts_the_imported_sources_before_the_file():
    tok = CharTok()
    p = data.long_prompts("repobench", 4000, 1, tok)[0]
    path, cut = source(p)
    text, title = tok.decode(p.ids[1:]), f"# file: {os.path.relpath(path, ROOT)}\n"
    own = title + "".join(data._lines(path)[:cut])[-(3999 // 2 - len(title)):]     # at most half the context
    assert len(p.ids) == 4000 and text.endswith(own) and own.endswith("\n")
    cross = text[:-len(own)]
    dep = data.imported_files(path, ROOT)[-1]            # the last import comes right before, left-truncated
    last = f"# file: {os.path.relpath(dep, ROOT)}\n" + "".join(data._lines(dep))
    last += "" if last.endswith("\n") else "\n"
    assert len(cross) == 3999 - len(own) and (cross.endswith(last) or last.endswith(cross))


def test_imports_resolve_by_path_in_order(tmp_path):
    (tmp_path / "pkg").mkdir()
    for f in ["pkg/__init__.py", "pkg/a.py", "pkg/b.py", "c.py", "d.py"]:
        (tmp_path / f).write_text("x = 1\n")
    (tmp_path / "pkg" / "b.py").write_text("import d\nfrom . import a\nimport sys\nfrom c import x\nimport d\n")
    got = data.imported_files(str(tmp_path / "pkg" / "b.py"), str(tmp_path))
    rel = [os.path.relpath(f, tmp_path) for f in got]
    assert rel == ["d.py", "pkg/__init__.py", "pkg/a.py", "c.py"]     # sys is built in: no source
    assert data.module_file("pkg", str(tmp_path)).endswith("pkg/__init__.py")
    assert data.module_file("nope", str(tmp_path)) is None


@pytest.mark.parametrize("template", [True, False], ids=["chat", "plain"])
def test_longdoc_frames_the_document_exactly(template):
    tok = CharTok(template)
    for p in data.long_prompts("longdoc", 400, 3, tok):
        text = tok.decode(p.ids)
        assert len(p.ids) == 400 and p.reference == ""
        if template:
            assert p.ids[0] == 2 and text.endswith(f"\n\n{data.SUMMARISE}</user><assistant>")
        else:
            assert p.ids[0] == BOS and text.endswith(f"\n\n{data.SUMMARISE}\n")
        title = p.source.split(" (")[0]
        body = dict(data.long_documents())[title].strip()
        assert (body + "\n\n" + data.SUMMARISE)[-300:] in text     # the document's end, then the instruction


def test_a_context_too_small_for_the_frame_is_an_error():
    with pytest.raises(data.GraftError, match="too small"):
        data.long_prompts("longdoc", 20, 1, CharTok(template=True))
    with pytest.raises(data.GraftError, match="unknown long-context"):
        data.long_prompts("lcc2", 100, 1, CharTok())
    with pytest.raises(data.GraftError, match="token ids"):      # texts would lose the exact length
        data.load_dataset("lcc", 1, None)


@pytest.mark.parametrize("a,b,want", [("abc", "abc", 100.0), ("abcd", "abce", 75.0), ("", "", 100.0), ("", "ab", 0.0),
                                      ("this is a test", "this is a test!", 100 * 28 / 29),
                                      ("  x = 1\n\n    y = 2\nz = 3\n", "x = 1\ny = 2", 100.0),
                                      ("x = 1", "x = 1\ny = 2", 100 * 10 / 16)])
def test_edit_similarity(a, b, want):
    """2 * LCS / total characters, over the first as many non-blank stripped lines as the reference
    has (fuzz.ratio("this is a test", "this is a test!") is 97: 96.55 rounded)."""
    assert data.edit_similarity(a, b) == pytest.approx(want)


# ----------------------------------------------------------------------------- bench.py --context

def run(tmp_path, *extra):
    out = tmp_path / "long.json"
    report = bench.main(["--ckpt", data.STDLIB_CKPT, "--draft", data.STDLIB_DRAFT, "--methods", "ar,eagle3,graft",
                         "--datasets", "lcc,longdoc", "--context", "64,128", "--limit", "2", "--max-new-tokens", "12",
                         "--warmup", "0", "--budget", "8", "--no-cache", "--json-out", str(out), *extra])
    return report, json.loads(out.read_text())


def test_bench_context_rows_and_columns(tmp_path, capsys):
    png = tmp_path / "ctx.png"
    _, saved = run(tmp_path, "--plot", str(png))
    rows = saved["rows"]
    assert [(r["dataset"], r["context"], r["method"]) for r in rows] == [
        (d, c, m) for d in ("lcc", "longdoc") for c in (64, 128) for m in ("ar", "eagle3", "graft")]
    for r in rows:
        assert r["prompts"] == 2 and r["skipped"] == 0 and r["lossless"] is True
        assert r["decode_tokens_per_s"] > 0 and r["ttft_ms"] > 0
        assert (r["edit_similarity"] is None) == (r["dataset"] == "longdoc")
    assert all(r["decode_speedup"] == 1.0 for r in rows if r["method"] == "ar")
    assert 0 <= rows[0]["edit_similarity"] <= 100
    meta = saved["meta"]
    assert meta["contexts"] == [64, 128] and set(meta["datasets"]) == {"lcc@64", "lcc@128", "longdoc@64", "longdoc@128"}
    lcc = meta["datasets"]["lcc@64"]["sources"]
    assert len(lcc) == 2 and meta["datasets"]["lcc@128"]["sources"] == lcc     # the same sources at both lengths
    assert set(meta["graft_over_eagle3"]) == {"lcc@64 eager", "lcc@128 eager", "longdoc@64 eager", "longdoc@128 eager"}
    assert all(v["decode"] > 0 and v["end_to_end"] > 0 for v in meta["graft_over_eagle3"].values())
    by = meta["pass_ms_by_context"]               # the pass costs after each context length
    assert set(by) == {"64", "128"} and all(set(v) == set(meta["pass_ms"]["eager"]) for v in by.values())
    out = capsys.readouterr().out
    assert out.startswith("| dataset | context | method |") and "decode tok/s" in out and "TTFT ms" in out
    assert "graft / eagle3, lcc@64 eager: decode-only" in out
    assert "target pass (ms) after 128 tokens: N=1:" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = [json.loads(l) for l in (tmp_path / "long.jsonl").read_text().splitlines()]
    assert len(runs) == 24 and {r["context"] for r in runs} == {64, 128}


def test_prompts_past_the_cache_are_refused_and_counted(tmp_path, capsys):
    """--max-seq-len 100: the 128-token prompts (+12 new) do not fit: each is refused, never truncated;
    their rows stay, with 0 prompts and 2 skipped."""
    _, saved = run(tmp_path, "--max-seq-len", "100", "--datasets", "lcc", "--methods", "ar")
    assert [(r["context"], r["prompts"], r["skipped"]) for r in saved["rows"]] == [(64, 2, 0), (128, 0, 2)]
    err = capsys.readouterr().err
    assert "--max-seq-len is 100 tokens" in err and "lcc@128: refused 2 of 2 prompts" in err


@pytest.mark.parametrize("args,says", [
    (["--datasets", "lcc", "--context", "0"], "--context takes distinct"),
    (["--datasets", "lcc", "--context", "256,256"], "--context takes distinct"),
    (["--datasets", "lcc", "--context", "1k"], "--context: expected comma-separated numbers"),
    (["--datasets", "lcc,stdlib", "--context", "256"], "not of stdlib"),
])
def test_bad_context_is_one_error_line_before_any_model_loads(monkeypatch, capsys, args, says):
    monkeypatch.setattr(bench.CLI, "build_engine", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as e:
        bench.cli(["--ckpt", data.STDLIB_CKPT, "--methods", "ar", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0]


def test_the_cache_fits_the_largest_context(capsys):
    """Without --max-seq-len the cache holds the largest context + --max-new-tokens (at least the usual
    default, at most the model's own context, which is then said)."""
    log = []
    assert bench.long_seq_len(data.STDLIB_CKPT, None, 1024, 128, log.append) == 2048     # the default cap
    assert bench.long_seq_len(data.STDLIB_CKPT, None, 1900, 148, log.append) == 2048 and log == []
    assert bench.long_seq_len(data.STDLIB_CKPT, None, 4096, 128, log.append) == 2048
    assert log == ["the model's context is 2048 tokens: a 4096-token prompt + --max-new-tokens 128 does not fit, "
                   "so the prompts longer than 1920 tokens will be refused"]
