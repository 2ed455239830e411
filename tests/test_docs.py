"""The documentation stays what issue 45 made it: a README read in five minutes, pages in docs/ a reader
finds by title, every flag documented where a reader looks for it, RESULTS.md written from the JSON
reports by scripts/results.py (never by hand), and links that lead somewhere. Light: nothing is run
but the parsers' construction and the results script's reading of results/*.json.
"""
import argparse
import importlib
import importlib.util
import re
from unittest import mock

import pytest

from conftest import ROOT

PAGES = sorted((ROOT / "docs").glob("*.md"))
TEXTS = ["README.md", "RESULTS.md"] + [f"docs/{p.name}" for p in PAGES]
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def words(name: str) -> int:
    return len((ROOT / name).read_text().split())                   # as `wc -w` counts


def test_word_budgets():
    """README <= 2,000 words, RESULTS.md <= 5,000, everything together <= 20,000 (issue 45)."""
    assert words("README.md") <= 2000, words("README.md")
    assert words("RESULTS.md") <= 5000, words("RESULTS.md")
    assert sum(words(t) for t in TEXTS) <= 20000, {t: words(t) for t in TEXTS}


def test_quick_start_in_the_first_60_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert "## Quick start" in lines[:15], lines[:15]
    fences = [i for i, ln in enumerate(lines, 1) if ln.startswith("```")]
    assert len(fences) >= 2 and fences[1] <= 60, fences[:2]


def test_every_page_has_a_title_and_the_readme_links_it():
    readme = (ROOT / "README.md").read_text()
    for p in PAGES:
        assert p.read_text().startswith("# "), p.name
        assert f"(docs/{p.name})" in readme, f"the README does not link docs/{p.name}"


# -- flags: the parsers against docs/usage.md (and docs/server.md for serve.py)

class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


def options(face: str) -> set:
    """Every option string of a face's parser, its subcommands' included, -h/--help aside: the parser is
    taken as the face's parse_args builds it, before it parses anything."""
    module = importlib.import_module(face)

    def grab(self, *args, **kwargs):
        raise _Parser(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", grab), pytest.raises(_Parser) as got:
        module.parse_args([])
    out, todo = set(), [got.value.parser]
    while todo:
        p = todo.pop()
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += list(a.choices.values())
            out |= {s for s in a.option_strings if s.startswith("--")}
    return out - {"--help"}


def documented(name: str) -> set:
    """The --flags a page names as graft's: not those of scripts/*.py commands (their own --help holds
    them, and tests/test_readme.py checks the commands in code blocks), and in a table only the first
    column's (the others set graft's flags beside other engines' own: SGLang's, vLLM's)."""
    text = re.sub(r"scripts/\w+\.py[^`\n]*", "", (ROOT / name).read_text())
    lines = [ln.split("|")[1] if ln.startswith("|") else ln for ln in text.splitlines()]
    return set(FLAG.findall("\n".join(lines))) - {"--help"}


@pytest.mark.parametrize("face", ["generate", "bench", "train"])
def test_every_flag_is_in_the_usage_page(face):
    missing = sorted(options(face) - documented("docs/usage.md"))
    assert not missing, f"{face}.py flags not in docs/usage.md: {missing}"


def test_every_flag_of_the_server_is_documented():
    missing = sorted(options("serve") - documented("docs/usage.md") - documented("docs/server.md"))
    assert not missing, f"serve.py flags in neither docs/usage.md nor docs/server.md: {missing}"


def test_every_documented_flag_exists():
    faces = {f: options(f) for f in ("generate", "bench", "train", "serve")}
    every = set().union(*faces.values())
    assert not sorted(documented("docs/usage.md") - every), sorted(documented("docs/usage.md") - every)
    server = documented("docs/server.md") - faces["serve"]
    assert not server, f"docs/server.md names flags serve.py does not have: {sorted(server)}"


# -- RESULTS.md and the README's table come from the reports

def results_script():
    spec = importlib.util.spec_from_file_location("results_script", ROOT / "scripts" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_md_is_what_the_script_writes():
    r = results_script()
    assert (ROOT / "RESULTS.md").read_text() == r.results_md(), "RESULTS.md was edited by hand: run python scripts/results.py"
    readme = (ROOT / "README.md").read_text()
    assert readme == r.readme_md(readme), "the README's results table is stale: run python scripts/results.py"
    assert r.main(["--check"]) == 0


def test_a_table_names_the_cpu_and_kernels_its_report_ran_on():
    """A report that records its CPU and kernel path (cli.machine) shows them under its table; an older
    one, its processor."""
    r = results_script()
    m = {"processor": "x86_64", "cpu_count": 2, "torch_threads": 1, "torch": "2.13.0+cpu", "device": "cpu"}
    assert r.machine({"machine": m}).startswith("x86_64, 2 cores, 1 torch thread")
    m |= {"cpu": "AMD EPYC (family 25, model 17)", "kernels": "avx512_bf16"}
    assert r.machine({"machine": m}).startswith("AMD EPYC (family 25, model 17), 2 cores, avx512_bf16 kernels, 1 torch thread")


def test_every_results_table_names_its_report_and_command():
    r = results_script()
    for s in r.SECTIONS:
        for f in s.files:
            assert (ROOT / f).is_file(), f
    text = (ROOT / "RESULTS.md").read_text()
    for f in {f for s in r.SECTIONS for f in s.files}:
        assert f"--json-out {f}" in text, f"RESULTS.md has no command that writes {f}"
    assert sum(s.readme for s in r.SECTIONS) == 1


# -- links

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path) -> set:
    return {slug(m) for m in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}


@pytest.mark.parametrize("name", TEXTS)
def test_links_lead_somewhere(name):
    here = (ROOT / name).parent
    text = re.sub(r"```.*?```", "", (ROOT / name).read_text(), flags=re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (here / path).resolve() if path else (ROOT / name)
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(target)
    assert not bad, f"{name}: links to nothing: {bad}"
