"""The documentation's commands parse: every `python generate.py`, `python bench.py`, `python train.py`,
`python serve.py` and `python scripts/*.py` in a fenced code block of README.md, RESULTS.md or a page of
docs/ names only flags that exist.

`--help`-level: nothing heavy runs. generate.py, bench.py and train.py are parsed in-process by their own
parse_args (which rejects an unknown flag or a bad choice); every `--flag` must also be spelled exactly
as its parser spells it (argparse would accept an abbreviation). Scripts are asked for `--help` in a
subprocess. Values are not checked (DIR, FILE, TARGET are placeholders). The top code block runs what
.ci/run runs, in its order.
"""
import contextlib
import io
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT
from model import GraftError

DOCS = ["README.md", "RESULTS.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
FACES = ("generate.py", "bench.py", "train.py", "serve.py")
EMPTY = "@EMPTY@"
STOP = {"|", "||", "&&", ";", "&", ">", ">>", ">&", "<", "(", ")", "2>", "2>&1"}


def code_blocks(text: str):
    """(first line number, body) of each fenced code block."""
    out, body, start = [], None, 0
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if body is None:
                body, start = [], i + 1
            else:
                out.append((start, "\n".join(body)))
                body = None
        elif body is not None:
            body.append(line)
    return out


def substitute(line: str) -> str:
    """Each `$(...)` (balanced, nested parentheses included) becomes the placeholder SUBST: a value."""
    while "$(" in line:
        i = line.index("$(")
        depth, j = 0, i + 1
        while j < len(line):
            depth += {"(": 1, ")": -1}.get(line[j], 0)
            if depth == 0:
                break
            j += 1
        line = line[:i] + "SUBST" + line[j + 1:]
    return line


def commands(text: str, where: str = "text"):
    """(where:line, script, argv) for every python (or torchrun) command of ours in the text's code blocks.
    Line continuations are joined, comments dropped, a `$(...)` is a value, a redirection or a pipe ends a
    command, and
    `[...]` around optional flags is taken off."""
    found = []
    for start, body in code_blocks(text):
        lines = body.split("\n")
        i = 0
        while i < len(lines):
            first, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
            line = re.sub(r"(?<!\S)\d*(>>?|<)&?\d*", " > ", substitute(line))     # 2>&1, > FILE: the command ends
            line = re.sub(r"(?<!\S)(\"\"|'')(?!\S)", EMPTY, line)         # shlex drops an empty argument
            lex = shlex.shlex(line, posix=True, punctuation_chars=True)
            lex.whitespace_split = True
            try:
                tokens = list(lex)
            except ValueError:              # unbalanced quotes: not a shell line (sample output)
                continue
            for k, tok in enumerate(tokens):
                if re.fullmatch(r"python3?", tok) and k + 1 < len(tokens):
                    at = k + 1
                elif tok == "torchrun":         # torchrun [its flags] SCRIPT [the script's flags]
                    at = next((j for j in range(k + 1, len(tokens)) if tokens[j] in FACES), None)
                else:
                    continue
                script = tokens[at] if at is not None else ""
                if script not in FACES and not re.fullmatch(r"scripts/\w+\.py", script):
                    continue
                argv = []
                for t in tokens[at + 1:]:
                    if t in STOP or t.startswith("$") or t.startswith(">"):
                        break
                    t = "" if t == EMPTY else t.strip("[]")
                    if t != "...":
                        argv.append(t)
                found.append((f"{where}:{start + first}", script, argv))
    return found


def doc_commands():
    out = []
    for name in DOCS:
        path = ROOT / name
        if path.is_file():
            out += commands(path.read_text(), name)
    return out


def flags(argv):
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def help_text(script: str, argv) -> str:
    """The --help of a face (in-process) or a script (a subprocess), for train.py its subcommand's."""
    sub = argv[:1] if script == "train.py" and argv and not argv[0].startswith("-") else []
    if script in FACES:
        module = __import__(script[:-3])
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
            module.parse_args(sub + ["--help"])
        return buf.getvalue()
    r = subprocess.run([sys.executable, str(ROOT / script), *sub, "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{script} --help failed: {r.stderr[-500:]}"
    return r.stdout


_HELP = {}


def check(script: str, argv) -> list:
    """The problems of one command: argparse's error, and flags its --help does not name exactly."""
    problems = []
    if script in FACES:
        module = __import__(script[:-3])
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                module.parse_args(list(argv))
        except GraftError as e:                 # the faces' parsers raise it for a bad command line
            problems.append(str(e))
        except SystemExit as e:
            if e.code:
                problems.append(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}")
    key = (script, argv[0] if script == "train.py" and argv else None)
    if key not in _HELP:
        _HELP[key] = set(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", help_text(script, argv)))
    problems += [f"unknown flag {f}" for f in flags(argv) if f not in _HELP[key]]
    return problems


COMMANDS = doc_commands()


def test_the_docs_hold_commands_of_every_face():
    assert "docs/usage.md" in DOCS and "docs/graft.md" in DOCS, DOCS
    scripts = {s for _, s, _ in COMMANDS}
    assert {"generate.py", "bench.py", "train.py", "serve.py"} <= scripts, scripts
    assert any(s.startswith("scripts/") for s in scripts), scripts


@pytest.mark.parametrize("where,script,argv", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_readme_command_parses(where, script, argv):
    assert not check(script, argv), f"{where}: python {script} {' '.join(argv)}: {check(script, argv)}"


def test_a_made_up_flag_is_caught():
    text = ("```bash\npython generate.py --max-new-tokens 8 \\\n    --no-such-flag 3   # a comment\n"
            "python bench.py --methods ar --limit 1 --no-such-flag\n"
            "python train.py eagle3 --ckpt TARGET --prompts FILE --out DIR [--no-such-flag 1]\n"
            "python scripts/gpu_check.py --out DIR --no-such-flag\n"
            "python generate.py --max-new 8\n```\n")
    found = commands(text)
    assert [s for _, s, _ in found] == ["generate.py", "bench.py", "train.py", "scripts/gpu_check.py", "generate.py"]
    for _, script, argv in found:
        assert check(script, argv), (script, argv)      # --max-new: an abbreviation argparse would take
    assert commands('```\npython generate.py --prompt "" --json\n```')[0][2] == ["--prompt", "", "--json"]
    ok = commands("```\nGRAFT_CACHE=/tmp/c python generate.py --json 2>&1 | tail -12   # $(pwd)\n"
                  "python generate.py --ckpt \"$(python -c 'print(f(1))')\"/m.gguf $(echo --chat)\n```\n")
    assert ok == [("text:2", "generate.py", ["--json"]), ("text:3", "generate.py", ["--ckpt", "SUBST/m.gguf", "SUBST"])] and not check("generate.py", ["--json"])


def test_quick_start_runs_what_ci_runs():
    """The README's first code block holds .ci/run's commands (the fresh environment, the install, the
    tests), in its order, exactly."""
    ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()
          if l.strip() and not l.strip().startswith(("#", "set ", "cd "))]
    assert any(l.startswith("python -m venv") for l in ci) and ci[-1] == "python -m pytest -q", ci
    first = [l.strip() for l in code_blocks((ROOT / "README.md").read_text())[0][1].splitlines()]
    assert [l for l in first if l in ci] == ci, (first, ci)
