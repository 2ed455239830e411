"""Train an EAGLE-3 head or a DFlash block drafter for any target this engine loads (and, for the demo,
a small target).

    python train.py eagle3 --ckpt TARGET --prompts FILE --out DIR [--minutes 10] [--device cuda]
    python train.py eagle3 --ckpt TARGET --texts DIR [DIR ...] --seq-len 1024 [--init HEAD_DIR] --out DIR
    python train.py dflash --ckpt TARGET --prompts FILE --out DIR [--layers 2] [--minutes 35]

DFlash (train_dflash): the target continues the prompts; blocks start at random anchors inside its
continuations; a block is [the anchor's token, mask tokens] reading the target's features before the
anchor and the whole block, and learns the target's next block_size - 1 tokens, position k of the
block weighted exp(-(k-1)/gamma) (later guesses count for less: they are only used when every one
before them was right). Saved in z-lab's layout (checkpoint.save_dflash).

EAGLE-3 recipe (arXiv 2503.01840, training-time test), small enough to read in one go:
  1. Self-distillation data: the target's own continuations of the prompts (greedy by default), made
     in batches with the static KV cache. Or, with --texts, windows of real long texts (long-context
     heads): the tokens are the text's, every label is still the target's own distribution there.
  2. Draft vocabulary: the most frequent target tokens in that data (all of them if the vocabulary is
     small), sorted ascending -> d2t.
  3. Training-time test: each batch is unrolled `--ttt` steps. Step 0 reads the target's features;
     step j reads the head's own step j-1 output one position back, as tree drafting at depth j will.
     Its attention sees real rows up to p-j plus the diagonal of earlier steps (the tree path).
     Loss: cross-entropy against the target's distribution (its top entries, renormalised on the draft vocabulary),
     step j weighted 0.8^j.
  4. Saved in the published format (config.json + model.safetensors with fc, midlayer.*, norm,
     lm_head, d2t, t2d; no embedding), loadable by checkpoint.load_head and by EAGLE/SGLang/vLLM.
The target runs once over the data (features and its top next-token probabilities, cached in
train_views.safetensors); training then reads only the head. Progress on stderr, a loss log
(train_log.jsonl), resumable from train_state.safetensors in --out
(tensors + JSON, never a pickle). --init HEAD_DIR fine-tunes a published head (same parameters, its
draft vocabulary kept) instead of starting from a fresh one.
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from checkpoint import hf_model_args, load_dflash, load_head, load_model, read_config, save_dflash, save_head
from dflash import DFlash, DFlashConfig, default_layer_ids
from model import GraftError, KVCache, ModelArgs
from draft import Eagle3, HeadConfig
from tokenizer import load_tokenizer
from verify import Sampling
from data import PROMPT_FORMATS, STORIES, chat_prompts, code_prompts, continue_batch, instruction_prompts, is_heldout, read_prompts, sample_openings, stdlib_files, stdlib_snippets, stdlib_training_files
from calibrate import cache_dir


# ----------------------------------------------------------------------------- resumable state

# Resume files never hold pickles: tensors go into safetensors, everything else (step, optimizer
# hyper-parameters, the Python RNG) into JSON inside the same file's metadata. Loading them cannot run
# code, whatever a file placed in --out contains.

def save_state(path: str, tensors: dict, meta: dict):
    """Write {name: tensor} and a JSON-able dict to one safetensors file, atomically (a temporary file,
    then os.replace), so an interrupted save never leaves half a file."""
    from safetensors.torch import save_file
    tmp = path + ".tmp"
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp,
              metadata={"graft": json.dumps(meta)})
    os.replace(tmp, path)


def load_state(path: str) -> tuple:
    """(tensors, meta) from save_state's file. Errors: GraftError, one line."""
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt") as fh:
            meta = json.loads((fh.metadata() or {})["graft"])
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as e:
        raise GraftError(f"cannot resume from {path} ({type(e).__name__}); delete it or pass --restart") from None
    if not isinstance(meta, dict):
        raise GraftError(f"cannot resume from {path}: malformed metadata; delete it or pass --restart")
    return tensors, meta


def pack(model_sd: dict, opt, extra: dict) -> tuple:
    """A module's and an optimizer's state as (tensors, meta) for save_state."""
    osd = opt.state_dict()
    tensors = {f"model.{k}": v for k, v in model_sd.items()}
    state = {}
    for idx, st in osd["state"].items():
        state[str(idx)] = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"opt.{idx}.{k}"] = v
            else:
                state[str(idx)][k] = v
    return tensors, {"opt_groups": osd["param_groups"], "opt_state": state, **extra}


def unpack(tensors: dict, meta: dict, path: str) -> tuple:
    """(model state dict, optimizer state dict, meta) from pack's output."""
    try:
        model_sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        state = {int(i): dict(st) for i, st in meta["opt_state"].items()}
        for k, v in tensors.items():
            if k.startswith("opt."):
                _, idx, name = k.split(".", 2)
                state.setdefault(int(idx), {})[name] = v
        return model_sd, {"state": state, "param_groups": meta["opt_groups"]}, meta
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise GraftError(f"cannot resume from {path}: malformed state ({e}); delete it or pass --restart") from None


def save_sequences(path: str, seqs: list, source: dict | None = None):
    """Token sequences as one flat int32 tensor and their lengths (no pickle); `source` (JSON) says what
    they were made from, so a run with other inputs does not reuse them (data_source)."""
    flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
    save_state(path, {"tokens": flat, "lengths": torch.tensor([len(s) for s in seqs], dtype=torch.int64)},
               {"source": source} if source else {})


def sequences_source(path: str) -> dict | None:
    """The `source` save_sequences stored (None for files written before it was stored)."""
    return load_state(path)[1].get("source")


def load_sequences(path: str) -> list:
    tensors, _ = load_state(path)
    try:
        flat, lengths = tensors["tokens"].tolist(), tensors["lengths"].tolist()
    except KeyError:
        raise GraftError(f"{path} holds no token sequences; delete it to regenerate") from None
    if sum(lengths) != len(flat) or min(lengths, default=0) < 0:
        raise GraftError(f"{path}: lengths do not match the tokens; delete it to regenerate")
    out, i = [], 0
    for n in lengths:
        out.append(flat[i:i + n])
        i += n
    return out


# ----------------------------------------------------------------------------- data

def text_files(paths: list) -> list:
    """The files --texts names: each PATH a file, a folder whose .py files (all depths; __pycache__
    left out) are taken, or `stdlib`: the running Python's standard library, its training split; each folder's files sorted, folders in the order given, duplicates once.
    Errors: GraftError, one line, for a path that does not exist or a folder without .py files."""
    out = []
    for p in paths:
        if p == "stdlib" and not os.path.exists(p):     # the stdlib's training split (never lcc's or repobench's files)
            found = stdlib_training_files()
        elif os.path.isfile(p):
            found = [os.path.abspath(p)]
        elif os.path.isdir(p):
            found = []
            for d, dirs, files in os.walk(p):
                dirs[:] = sorted(x for x in dirs if x != "__pycache__")
                found += [os.path.abspath(os.path.join(d, f)) for f in files if f.endswith(".py")]
            if not found:
                raise GraftError(f"--texts: {p} is a folder without .py files")
            found.sort()
        else:
            raise GraftError(f"--texts: {p} is neither a file nor a folder")
        out += [f for f in found if f not in out]
    return out


def text_windows(tok, files: list, seq_len: int, max_windows: int = 0, log=print) -> list:
    """Training sequences cut from real texts: each file read as UTF-8 (bad bytes replaced), encoded
    with the tokenizer's special tokens (its BOS, if any), and cut into non-overlapping windows of
    seq_len + 1 tokens (seq_len training rows: feature t with token t+1); a file's tail shorter than a
    window is left out. max_windows > 0 keeps that many, evenly spaced over all windows in file order
    (deterministic). Returns [[token id] * (seq_len + 1)]. Errors: GraftError when no file holds a
    whole window."""
    n = seq_len + 1
    wins, t0 = [], time.time()
    for i, f in enumerate(files):
        with open(f, encoding="utf-8", errors="replace") as fh:
            ids = tok.encode(fh.read())
        wins += [ids[a:a + n] for a in range(0, len(ids) - n + 1, n)]
        progress("texts", i + 1, len(files), t0, f"{len(wins)} windows")
    if not wins:
        raise GraftError(f"--texts: no file holds {n} tokens (--seq-len {seq_len} + 1)")
    if max_windows and len(wins) > max_windows:
        total = len(wins)
        wins = [wins[k * total // max_windows] for k in range(max_windows)]
        log(f"data: {max_windows} of {total} windows kept (--max-windows), evenly spaced")
    return wins


def data_source(a, files: list | None, prompts: str | None = None) -> dict:
    """What train_data.safetensors is made from: for --texts the files (path, size, mtime), --seq-len
    and --max-windows; for self-distillation the prompts file and the options that shape it."""
    if files is not None:
        return {"texts": [[f, os.path.getsize(f), int(os.path.getmtime(f))] for f in files],
                "seq_len": a.seq_len, "max_windows": a.max_windows}
    return {"prompts": os.path.abspath(prompts), "new_tokens": a.new_tokens, "chat": a.chat,
            "max_prompts": a.max_prompts, "data_temperature": a.data_temperature, "seed": a.seed}


def self_distill(model, tok, prompts: list, new_tokens: int, batch: int, sampling: Sampling, log=print,
                 chat: bool = False) -> list:
    """Token sequences = each prompt (in the model's chat template with chat=True) followed by the
    target's own continuation."""
    seqs, t0 = [], time.time()
    room = model.args.max_position_embeddings - new_tokens
    enc = [e for e in ((tok.apply_chat(p) if chat else tok.encode(p)) for p in prompts) if 0 < len(e) <= room]
    if len(enc) < len(prompts):
        log(f"data: skipped {len(prompts) - len(enc)} empty prompts or prompts longer than {room} tokens")
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))      # similar lengths pad less
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        seqs += continue_batch(model, [enc[i] for i in idx], new_tokens, sampling, tok.eos_ids)
        progress("data", min(s + batch, len(order)), len(order), t0)
    return seqs


_BARS = {}


def progress(what: str, i: int, n: int, t0: float, extra: str = ""):
    """Step i of n of `what` (data, views, train): tqdm's bar on stderr, a count, the time and an
    estimate; one bar per `what` until it is done (a resumed run's bar starts at its step). t0 is kept
    for the callers' own logs; tqdm keeps its own clock."""
    b = _BARS.get(what)
    if b is None or b.total != n or i < b.n:
        if b is not None:
            b.close()
        b = _BARS[what] = tqdm(total=n, initial=max(i - 1, 0), desc=what, file=sys.stderr, dynamic_ncols=True)
    b.update(i - b.n)
    if extra:
        b.set_postfix_str(extra, refresh=False)
    if i >= n:
        b.close()
        del _BARS[what]


def draft_vocab(seqs: list, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids in the data (all of the vocabulary when it is small),
    sorted ascending, as the published heads do."""
    if size >= vocab:
        return torch.arange(vocab)
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=vocab).double()
    counts += torch.arange(vocab, 0, -1).double() * 1e-9     # deterministic ties: lower ids first
    return torch.sort(counts.topk(size).indices).values


# ----------------------------------------------------------------------------- training-time test

def ttt_mask(T: int, step: int, device) -> torch.Tensor:
    """(T, (step+1)*T) bool: the query of unrolled step `step` at position p sees real (step-0) rows
    at positions <= p - step and the step-i row at position p - step + i (its tree path)."""
    p = torch.arange(T, device=device)
    blocks = [p[None, :] <= (p[:, None] - step)]
    for i in range(1, step + 1):
        blocks.append(p[None, :] == (p[:, None] - step + i))
    return torch.cat(blocks, dim=1)     # every row sees at least its own step's diagonal


def ttt_loss(head: Eagle3, feats, ids, tgt_idx, tgt_p, valid, steps: int):
    """feats (B, T, 3Ht); ids (B, T) the token after each feature; the target's distribution of the
    token after that as its top entries in the draft vocabulary: tgt_idx (B, T, K) draft ids (-1: not
    in it), tgt_p (B, T, K) their probabilities renormalised; valid (B, T) bool.
    Returns (loss, per-step top-1 agreement with the target's choice)."""
    B, T, _ = feats.shape
    pos = torch.arange(T, device=feats.device)
    idx = tgt_idx.clamp(min=0)
    best = tgt_idx[..., 0]                                          # the target's own choice (-1: outside)
    kv, hidden, losses, accs = [], feats, 0.0, []
    for j in range(steps):
        out = head(hidden, ids, pos, mask=ttt_mask(T, j, feats.device), fused=(j == 0), steps_kv=kv)
        logp = head.logprobs(out)                                   # (B, T, Vd)
        ok = valid & (pos[None, :] >= j)
        ce = -(tgt_p * logp.gather(-1, idx)).sum(-1)
        losses = losses + 0.8 ** j * (ce * ok).sum() / ok.sum().clamp(min=1)
        accs.append(((logp.argmax(-1) == best) & ok).sum().item() / max(ok.sum().item(), 1))
        hidden = torch.cat([out[:, :1] * 0, out[:, :-1]], dim=1)      # own output, one position on
    return losses, accs


@torch.no_grad()
def target_views(target, seqs: list, k: int, batch_tokens: int, log) -> list:
    """What the head learns from, computed once per sequence with the target: its EAGLE-3 features
    (n, 3*Ht) float16, and its next-token distribution at every position as the top k entries, ids
    (n, k) int32 and log-probs (n, k) float16. The target runs once over the data instead of once per
    training step (for a 135M target on a CPU that is most of the time a step would take)."""
    t0 = time.time()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    views = [None] * len(seqs)
    i = 0
    while i < len(order):
        n = len(seqs[order[i]])
        group = order[i:i + max(1, batch_tokens // max(n, 1))]
        T = max(len(seqs[j]) for j in group)
        x = torch.tensor([seqs[j] + [0] * (T - len(seqs[j])) for j in group], device=target.embed_tokens.weight.device)
        logits, feats = target(x, torch.arange(T, device=x.device), capture=True)
        top = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
        for b, j in enumerate(group):
            m = len(seqs[j])
            views[j] = (feats[b, :m].half().cpu(), top.indices[b, :m].int().cpu(), top.values[b, :m].half().cpu())
        i += len(group)
        progress("views", i, len(order), t0)
    return views


def views_key(seqs: list, target, k: int) -> str:
    """What the views depend on: the tokens (a sha256 over them), the target's captured layers and k."""
    import hashlib
    h = hashlib.sha256(torch.tensor([t for s in seqs for t in s] + [-1] + [len(s) for s in seqs],
                                    dtype=torch.int64).numpy().tobytes()).hexdigest()
    return json.dumps({"tokens": h, "capture": list(target.capture_layers), "k": k})


def save_views(path: str, views: list, key: str = ""):
    cat = lambda n: torch.cat([v[n] for v in views])
    save_state(path, {"feats": cat(0), "ids": cat(1), "logp": cat(2),
                      "lengths": torch.tensor([len(v[0]) for v in views], dtype=torch.int64)}, {"key": key})


def load_views(path: str, seqs: list, key: str = "") -> list | None:
    """The cached views, or None when they do not match the sequences (other lengths, or a views_key
    stored and different: then they are recomputed)."""
    tensors, meta = load_state(path)
    try:
        lengths = tensors["lengths"].tolist()
        if lengths != [len(s) for s in seqs] or (meta.get("key") and key and meta["key"] != key):
            return None
        out, i = [], 0
        for n in lengths:
            out.append((tensors["feats"][i:i + n], tensors["ids"][i:i + n], tensors["logp"][i:i + n]))
            i += n
        return out
    except KeyError:
        return None


def batches(seqs: list, views: list, to_draft: torch.Tensor, seq_len: int, batch: int, rng: random.Random):
    """Endless shuffled batches of windows of seq_len rows: row t pairs feature t with token t+1 and
    learns the target's distribution after token t+1 (renormalised on the draft vocabulary).
    Yields feats (B, T, 3Ht), ids (B, T), tgt_idx (B, T, K), tgt_p (B, T, K), valid (B, T)."""
    windows = [(s, a) for s, seq in enumerate(seqs) for a in range(0, max(len(seq) - 2, 1), seq_len)
               if len(seq) - a >= 3]
    if not windows:
        raise GraftError("no training data: the prompts produced no sequences of 3+ tokens")
    while True:
        rng.shuffle(windows)
        for i in range(0, len(windows) - batch + 1 if len(windows) >= batch else 1, batch):
            rows = []
            for s, a in windows[i:i + batch]:
                f, ti, tl = views[s]
                n = min(seq_len, len(seqs[s]) - a - 1)
                d = to_draft[ti[a + 1:a + 1 + n].long()]                          # (n, K) draft ids or -1
                p = tl[a + 1:a + 1 + n].float().exp() * (d >= 0)
                rows.append((f[a:a + n], torch.tensor(seqs[s][a + 1:a + 1 + n]), d, p / p.sum(-1, keepdim=True).clamp(min=1e-9)))
            T = max(r[0].shape[0] for r in rows)
            pad = lambda x, v=0: torch.cat([x, x.new_full((T - x.shape[0], *x.shape[1:]), v)])
            yield (torch.stack([pad(r[0]) for r in rows]).float(), torch.stack([pad(r[1]) for r in rows]),
                   torch.stack([pad(r[2], -1) for r in rows]), torch.stack([pad(r[3]) for r in rows]),
                   torch.stack([torch.arange(T) < r[0].shape[0] for r in rows]))


def new_head(target, draft_vocab_size: int) -> Eagle3:
    """A head shaped like one target layer, reading the target's embedding."""
    ta = target.args
    layer = ModelArgs(arch="llama", vocab_size=ta.vocab_size, dim=ta.dim, n_layers=1, n_heads=ta.n_heads,
                      n_kv_heads=ta.n_kv_heads, head_dim=ta.head_dim, intermediate_size=ta.intermediate_size,
                      norm_eps=ta.norm_eps, rope_theta=ta.rope_theta, max_position_embeddings=ta.max_position_embeddings)
    head = Eagle3(HeadConfig(layer=layer, target_hidden=ta.dim, vocab_size=ta.vocab_size,
                             draft_vocab_size=draft_vocab_size))
    head.embed_tokens = target.embed_tokens
    return head


def init_head(path: str, target, dev) -> Eagle3:
    """The head --init names, in float32 on dev, to fine-tune: loaded by checkpoint.load_head (which
    sets the target's captured layers to the ones it reads); its draft vocabulary (d2t) is kept.
    Errors: GraftError, one line, for a head that does not load or whose weights are not shaped as
    new_head would shape them for this target (training would then change other parameters)."""
    if not os.path.isdir(path):
        raise GraftError(f"--init: head folder not found: {path}")
    head = load_head(path, target, device=dev, dtype=torch.float32)
    fresh = head_state(new_head(target, head.config.draft_vocab_size)).items()
    have = head_state(head)
    for k, v in fresh:
        if k not in have or tuple(have[k].shape) != tuple(v.shape):
            got = tuple(have[k].shape) if k in have else "none"
            raise GraftError(f"--init: head {path} does not fit this target: {k} has shape {got}, "
                             f"a head of this target has {tuple(v.shape)}")
    extra = set(have) - {k for k, _ in fresh}
    if extra:
        raise GraftError(f"--init: head {path} has weights a head of this target has not: {sorted(extra)[:3]}")
    for n, p in head.named_parameters():        # its own copies: never train a tensor shared with the target
        if not n.startswith("embed_tokens"):
            p.data = p.data.clone()
    return head.to(dev)


def head_state(head) -> dict:
    """What training changes: everything but the target's (frozen, shared) embedding."""
    return {k: v for k, v in head.state_dict().items() if not k.startswith("embed_tokens")}


def training_data(a, kind: str, files, target, tok, data_path: str, views_path: str, log,
                  prompts: str | None = None) -> tuple:
    """(sequences, views) of one kind of data: the target's continuations of a prompts file, or windows
    of --texts; read from data_path/views_path when they were made from the same inputs, else made and saved."""
    source = data_source(a, files if kind == "texts" else None, prompts)
    cached = sequences_source(data_path) if os.path.isfile(data_path) else None
    if os.path.isfile(data_path) and cached not in (None, source):
        log(f"data: {data_path} was made from other inputs: made again")
    if os.path.isfile(data_path) and (cached == source or (cached is None and kind == "prompts")):
        seqs = load_sequences(data_path)
        vocab = target.args.vocab_size
        if any(t < 0 or t >= vocab for s in seqs for t in s):
            raise GraftError(f"{data_path} holds token ids outside the target's vocabulary; delete it to regenerate")
        log(f"data: {len(seqs)} sequences from {data_path}")
    elif kind == "texts":
        t0 = time.time()
        seqs = text_windows(tok, files, a.seq_len, a.max_windows, log)
        save_sequences(data_path, seqs, source)
        log(f"data: {len(seqs)} windows of {a.seq_len + 1} tokens from {len(files)} files, {time.time() - t0:.0f}s")
    else:
        prompts = read_prompts(prompts, "--prompts")
        if a.max_prompts:
            prompts = prompts[:a.max_prompts]
        s = Sampling(a.data_temperature, 1.0, 0, a.seed)
        t0 = time.time()
        seqs = self_distill(target, tok, prompts, a.new_tokens, a.gen_batch, s, log, chat=a.chat)
        save_sequences(data_path, seqs, source)
        log(f"data: {len(seqs)} sequences, {sum(map(len, seqs))} tokens, {time.time() - t0:.0f}s")
    key = views_key(seqs, target, a.top_k_targets)
    views = load_views(views_path, seqs, key) if os.path.isfile(views_path) else None
    if views is None:
        views = target_views(target, seqs, a.top_k_targets, a.view_tokens, log)
        save_views(views_path, views, key)
    return seqs, views


def train_eagle3(a) -> str:
    """Train (or with --init fine-tune) a head; returns --out. Data: self-distillation of --prompts,
    windows of --texts labelled with the target's own distribution, or both mixed (every window of
    either kind equally likely in a batch). Errors: GraftError, one line, for
    bad options, paths or caches, all before the target's first pass."""
    dev = a.device
    torch.manual_seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.ttt < 1:
        raise GraftError("--ttt must be at least 1")
    if a.prompts is None and a.texts is None:
        raise GraftError("pass --prompts (self-distillation), --texts (real texts) or both (mixed)")
    if a.seq_len < 2:
        raise GraftError("--seq-len must be at least 2")
    files = text_files(a.texts) if a.texts is not None else None
    if a.init and not os.path.isdir(a.init):
        raise GraftError(f"--init: head folder not found: {a.init}")
    # no cache is needed to train; self-distillation sizes one per batch
    target = load_model(a.ckpt, device=dev, dtype=torch.float32 if dev == "cpu" else torch.bfloat16, max_seq_len=1)
    for p in target.parameters():
        p.requires_grad_(False)
    init = init_head(a.init, target, dev) if a.init else None     # before the views: it names the features
    tok = load_tokenizer(target.path, target.args)
    os.makedirs(a.out, exist_ok=True)
    state_path = os.path.join(a.out, "train_state.safetensors")
    log = lambda s: print(s, file=sys.stderr)
    # 1. the data: each kind made once and cached in --out under its own name (a mixed run reuses both)
    seqs, views = [], []
    parts = [("prompts", p, "" if i == 0 else f"_prompts{i + 1}") for i, p in enumerate(a.prompts or [])]
    parts += [("texts", None, "_texts" if a.prompts else "")] if files is not None else []
    for kind, prompts, name in parts:
        s, v = training_data(a, kind, files, target, tok, os.path.join(a.out, f"train_data{name}.safetensors"),
                             os.path.join(a.out, f"train_views{name}.safetensors"), log, prompts)
        seqs, views = seqs + s, views + v
    if init is not None:        # its draft vocabulary, as it is
        head = init
        used = head.to_target(torch.arange(head.config.draft_vocab_size, device=head.d2t.device)).cpu()
    else:
        used = draft_vocab(seqs, target.args.vocab_size, a.draft_vocab)
        head = new_head(target, used.numel()).to(dev)          # float32 weights; features are cast to them
        head.d2t.copy_(used - torch.arange(used.numel()))
    to_draft = torch.full((target.args.vocab_size,), -1, dtype=torch.long)
    to_draft[used] = torch.arange(used.numel())
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, rng = 0, random.Random(a.seed)
    if os.path.isfile(state_path) and not a.restart:
        head_sd, opt_sd, meta = unpack(*load_state(state_path), state_path)
        try:
            head.load_state_dict({k: v.to(dev) for k, v in head_sd.items()}, strict=False)
            opt.load_state_dict(opt_sd)
            step = int(meta["step"])
            rng.setstate((meta["rng"][0], tuple(meta["rng"][1]), meta["rng"][2]))
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise GraftError(f"cannot resume from {state_path}: it does not fit this run ({str(e)[:120]}); "
                             f"delete it or pass --restart") from None
        log(f"resumed at step {step}")
    data = batches(seqs, views, to_draft, a.seq_len, a.batch, rng)
    t0, deadline = time.time(), time.time() + a.minutes * 60 if a.minutes else float("inf")
    logf = open(os.path.join(a.out, "train_log.jsonl"), "a")
    head.train()
    while step < a.steps and time.time() < deadline:
        feats, ids, tgt_idx, tgt_p, valid = (x.to(dev) for x in next(data))
        lr = lr_at(a, step, max(step / a.steps, (time.time() - t0) / (a.minutes * 60) if a.minutes else 0.0))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(torch.device(dev).type, dtype=torch.bfloat16, enabled=a.bf16):
            loss, accs = ttt_loss(head, feats, ids, tgt_idx, tgt_p, valid, a.ttt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        step += 1
        if step % a.log_every == 0 or step == a.steps:
            rec = {"step": step, "loss": round(loss.item(), 4), "acc": [round(x, 3) for x in accs],
                   "lr": lr, "seconds": round(time.time() - t0, 1)}
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            progress("train", step, a.steps, t0, f"loss {rec['loss']:.3f} acc0 {accs[0]:.2f}")
        if step % a.save_every == 0:
            save_state(state_path, *pack(head_state(head), opt, {"step": step, "rng": rng.getstate()}))
    sys.stderr.write("\n")
    save_state(state_path, *pack(head_state(head), opt, {"step": step, "rng": rng.getstate()}))
    head.eval()
    extra = {}
    if init is not None:        # the features it reads, as its config named them
        cfg = read_config(init.path)
        extra = {k: cfg[k] for k in ("eagle_config", "eagle_aux_hidden_state_layer_ids") if k in cfg}
    for n, p in head.named_parameters():        # the head's weights only: the embedding is the target's
        if not n.startswith("embed_tokens"):
            p.data = p.data.to(getattr(torch, a.save_dtype))
    save_head(head, a.out, extra_config=extra)
    log(f"saved head to {a.out} after {step} steps ({time.time() - t0:.0f}s)")
    return a.out


# ----------------------------------------------------------------------------- a DFlash drafter

def dflash_batches(seqs: list, starts: list, seq_len: int, batch: int, anchors: int, S: int, rng: random.Random):
    """Endless batches of windows of seq_len tokens, each with `anchors` block starts sampled where the
    target generated the block's tokens (at or after the continuation's start, the whole block inside
    the window). Yields tokens (B, T), anchors (B, A), real lengths (B,)."""
    windows = [(s, w) for s, seq in enumerate(seqs) for w in range(0, max(len(seq) - S, 1), seq_len)
               if min(len(seq), w + seq_len) - max(w, starts[s] - 1) >= S]
    if not windows:
        raise GraftError("no training data: no sequence has a continuation of a whole block")
    while True:
        rng.shuffle(windows)
        for i in range(0, max(len(windows) - batch + 1, 1), batch):
            toks, anc, lens = [], [], []
            for s, w in windows[i:i + batch]:
                seq = seqs[s][w:w + seq_len]
                lo, hi = max(0, starts[s] - 1 - w), len(seq) - S
                toks.append(seq + [0] * (seq_len - len(seq)))
                anc.append([rng.randint(lo, hi) for _ in range(anchors)])
                lens.append(len(seq))
            yield torch.tensor(toks), torch.tensor(anc), torch.tensor(lens)


def dflash_loss(model: DFlash, feats, toks, anc, gamma: float):
    """The published objective on one batch: feats (B, T, k*H) the target's features, toks (B, T) its
    tokens, anc (B, A) block starts. Each block is [toks[a], mask, ...] at positions a..a+S-1; it reads
    the context rows before a and its own block (all of it: no causal mask) and predicts toks[a+1..a+S-1],
    position k weighted exp(-(k-1)/gamma). Returns (loss, top-1 accuracy per block position)."""
    B, T, _ = feats.shape
    A, S, dev = anc.shape[1], model.config.block_size, feats.device
    j = torch.arange(S, device=dev)
    pos = (anc[:, :, None] + j).reshape(B, A * S)                                        # (B, A*S)
    ids = torch.where(j[None, None] == 0, toks.gather(1, anc)[:, :, None], model.config.mask_token_id)
    ids = ids.reshape(B, A * S)
    block = torch.arange(A, device=dev).repeat_interleave(S)                              # (A*S,)
    see_ctx = torch.arange(T, device=dev)[None, None] < anc.repeat_interleave(S, 1)[:, :, None]   # (B, A*S, T)
    see_blk = (block[:, None] == block[None, :]).expand(B, -1, -1)                        # (B, A*S, A*S)
    cache = KVCache(model.config.n_layers, B, model.config.layer.n_kv_heads, T + A * S, model.config.layer.head_dim,
                    model.fc.weight.dtype, dev)       # the drafter's dtype (features may be the target's bf16)
    rows = (T + torch.arange(A * S, device=dev))[None].expand(B, -1)
    ctx_rows = torch.arange(T, device=dev)[None].expand(B, -1)
    h = model(feats, ctx_rows, torch.ones(B, T, dtype=torch.bool, device=dev), ids, rows, pos,
              torch.cat([see_ctx, see_blk], 2), cache)                                   # (B, A*S, H)
    logp = model.logprobs(h.view(B, A, S, -1)[:, :, 1:])                                  # (B, A, S-1, V)
    labels = toks.gather(1, (anc[:, :, None] + j[1:]).reshape(B, -1)).view(B, A, S - 1)
    w = torch.exp(-(j[1:] - 1).float() / gamma)
    ce = -logp.gather(-1, labels[..., None])[..., 0]                                      # (B, A, S-1)
    acc = (logp.argmax(-1) == labels).float().mean((0, 1))
    return (ce * w).sum(-1).mean() / w.sum(), acc.tolist()


def train_dflash(a) -> str:
    """Train a DFlash drafter for --ckpt by the published recipe: the target continues --prompts (its
    own tokens are the labels), blocks start at random anchors inside those continuations, each block
    is [anchor token, mask tokens] and predicts the target's next block_size - 1 tokens, with a
    position-decayed cross-entropy. Saved in z-lab's layout (checkpoint.save_dflash). Errors:
    GraftError, one line, for bad options."""
    dev = a.device
    torch.manual_seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.block_size < 2 or a.layers < 1 or a.seq_len < a.block_size + 1 or a.anchors < 1:
        raise GraftError("--block-size >= 2, --layers >= 1, --anchors >= 1 and --seq-len > --block-size, please")
    # --bf16: the target (features, embedding, lm_head) in bfloat16 as it runs in inference, the drafter's
    # weights float32 under autocast
    target = load_model(a.ckpt, device=dev, dtype=torch.bfloat16 if a.bf16 else torch.float32, max_seq_len=1)
    for p in target.parameters():
        p.requires_grad_(False)
    ta, tok = target.args, load_tokenizer(target.path, target.args)
    log = lambda s: print(s, file=sys.stderr)
    os.makedirs(a.out, exist_ok=True)
    data_path = os.path.join(a.out, "train_data.safetensors")
    if os.path.isfile(data_path):
        t, _ = load_state(data_path)
        flat, lens, starts = t["tokens"].tolist(), t["lengths"].tolist(), t["starts"].tolist()
        seqs, i = [], 0
        for n in lens:
            seqs.append(flat[i:i + n])
            i += n
        log(f"data: {len(seqs)} sequences from {data_path}")
    else:
        prompts = read_prompts(a.prompts, "--prompts")[:a.max_prompts or None]
        enc = [e for e in ((tok.apply_chat(p) if a.chat else tok.encode(p)) for p in prompts)
               if 0 < len(e) <= ta.max_position_embeddings - a.new_tokens]
        seqs, starts, t0 = [], [], time.time()
        for s in range(0, len(enc), a.gen_batch):
            part = enc[s:s + a.gen_batch]
            seqs += continue_batch(target, part, a.new_tokens, Sampling(0.0), tok.eos_ids)
            starts += [len(e) for e in part]
            progress("data", min(s + a.gen_batch, len(enc)), len(enc), t0)
        save_state(data_path, {"tokens": torch.tensor([t for s in seqs for t in s]), "lengths": torch.tensor(
            [len(s) for s in seqs]), "starts": torch.tensor(starts)}, {})
        log(f"data: {len(seqs)} sequences, {sum(map(len, seqs))} tokens, {time.time() - t0:.0f}s")
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=ta.vocab_size)
    if a.init:                   # go on training a drafter (its shape, target layers and mask token kept)
        model = load_dflash(a.init, target, dev, torch.float32)
        ids, mask_id, a.layers, a.block_size = (model.config.target_layer_ids, model.config.mask_token_id,
                                                model.config.n_layers, model.config.block_size)
    else:
        ids = tuple(default_layer_ids(ta.n_layers, a.layers))
        mask_id = a.mask_token_id if a.mask_token_id is not None else ta.vocab_size - 1 - int(counts.flip(0).argmin())
        layer = ModelArgs(arch="qwen3", vocab_size=ta.vocab_size, dim=ta.dim, n_layers=a.layers, n_heads=ta.n_heads,
                          n_kv_heads=ta.n_kv_heads, head_dim=ta.head_dim, intermediate_size=ta.intermediate_size,
                          norm_eps=ta.norm_eps, rope_theta=ta.rope_theta, rope_scaling=ta.rope_scaling,
                          max_position_embeddings=ta.max_position_embeddings, qk_norm=True)
        model = DFlash(DFlashConfig(layer, a.layers, a.block_size, mask_id, ids), target).to(dev)
    target.capture_layers = tuple(i + 1 for i in ids)        # the outputs of those layers
    log(f"drafter: {a.layers} layers, block {a.block_size}, target layers {list(ids)}, mask token {mask_id} "
        f"(seen {int(counts[mask_id])} times in the data)")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng, step = random.Random(a.seed), 0
    data = dflash_batches(seqs, starts, a.seq_len, a.batch, a.anchors, a.block_size, rng)
    t0, deadline = time.time(), time.time() + a.minutes * 60 if a.minutes else float("inf")
    logf = open(os.path.join(a.out, "train_log.jsonl"), "a")
    logf.write(json.dumps({"command": "python train.py " + " ".join(sys.argv[1:])}) + "\n")
    model.train()
    while step < a.steps and time.time() < deadline:
        toks, anc, _ = (x.to(dev) for x in next(data))
        with torch.no_grad():
            _, feats = target(toks, torch.arange(toks.shape[1], device=dev), capture=True)
        lr = lr_at(a, step, max(step / a.steps, (time.time() - t0) / (a.minutes * 60) if a.minutes else 0.0))
        with torch.autocast(torch.device(dev).type, dtype=torch.bfloat16, enabled=a.bf16):
            loss, acc = dflash_loss(model, feats, toks, anc, a.gamma)
        optimize(opt, model, loss, lr)
        step += 1
        if step % a.log_every == 0:
            rec = {"step": step, "loss": round(loss.item(), 4), "acc": [round(x, 3) for x in acc], "lr": lr,
                   "seconds": round(time.time() - t0, 1)}
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            progress("train", step, a.steps, t0, f"loss {rec['loss']:.3f} acc1 {acc[0]:.2f}")
        if step % a.save_every == 0:
            save_dflash(model, a.out)
    model.eval()
    save_dflash(model, a.out)
    log(f"saved DFlash drafter to {a.out} after {step} steps ({time.time() - t0:.0f}s)")
    return a.out


# ----------------------------------------------------------------------------- a small target from scratch







def train_tokenizer(files: list, vocab: int, out_dir: str):
    """Byte-level BPE (as GPT-2/Qwen use) over the training files; <|endoftext|> separates documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train(files, trainer)
    tk.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                   "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 2048}, fh, indent=2)
    return tk


def tokenize_files(tk, files: list) -> torch.Tensor:
    eot = tk.token_to_id("<|endoftext|>")
    ids = []
    texts = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    for enc in tk.encode_batch(texts):
        ids += enc.ids + [eot]
    return torch.tensor(ids, dtype=torch.int32)


def target_config(a, vocab: int) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
            "hidden_size": a.dim, "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
            "max_position_embeddings": a.context, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False,
            "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "float16"}


def optimize(opt, model, loss, lr: float):
    """One optimizer step at learning rate lr, gradients clipped to norm 1."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def lr_at(a, step: int, frac: float) -> float:
    """Linear warm-up, then cosine to 10% over the run (frac: share of steps or minutes used)."""
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def save_target_state(path, model, opt, g, step: int, seconds: float):
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}     # tied: stored once
    tensors, meta = pack(sd, opt, {"step": step, "seconds": seconds})
    save_state(path, {**tensors, "gen": g.get_state()}, meta)


def train_target(a) -> str:
    """Pretrain a small Qwen3-architecture model (qk-norm) on a local corpus, CPU-friendly (bf16
    autocast where the CPU has it), and save it as a standard HF folder in float16."""
    from model import Transformer
    torch.manual_seed(a.seed)
    os.makedirs(a.out, exist_ok=True)
    log = lambda s: print(s, file=sys.stderr)
    import sysconfig
    train_files, held = [], []
    for c in a.corpus or [sysconfig.get_paths()["stdlib"]]:
        root = c if os.path.isdir(c) else os.path.dirname(c)
        for f in (stdlib_files(c) if os.path.isdir(c) else [c]):
            (held if is_heldout(f, root) else train_files).append(f)
    if not held and len(train_files) > 1:
        held.append(train_files.pop())          # a tiny corpus still gets a held-out file
    if not train_files or not held:
        raise GraftError("the corpus needs at least two files (one is held out)")
    with open(os.path.join(a.out, "heldout.txt"), "w") as fh:
        fh.write("\n".join(os.path.basename(f) if a.corpus else os.path.relpath(f, root) for f in held) + "\n")
    tok_path = os.path.join(a.out, "tokenizer.json")
    if os.path.isfile(tok_path):
        from tokenizers import Tokenizer as TK
        tk = TK.from_file(tok_path)
    else:
        t0 = time.time()
        tk = train_tokenizer(train_files, a.vocab, a.out)
        log(f"tokenizer: {tk.get_vocab_size()} tokens in {time.time() - t0:.0f}s")
    data = tokenize_files(tk, train_files)
    val = tokenize_files(tk, held)
    log(f"corpus: {len(train_files)} files, {data.numel()} tokens; held out {len(held)} files, {val.numel()} tokens")
    cfg = target_config(a, tk.get_vocab_size())
    with open(os.path.join(a.out, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    args = hf_model_args(cfg)
    model = Transformer(args)
    std = 0.02
    for n, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std / math.sqrt(2 * a.layers) if n.endswith(("o_proj.weight", "down_proj.weight")) else std)
    model.lm_head.weight = model.embed_tokens.weight
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state_path = os.path.join(a.out, "train_state.safetensors")
    step, spent, g = 0, 0.0, torch.Generator().manual_seed(a.seed)
    if os.path.isfile(state_path) and not a.restart:
        tensors, meta = load_state(state_path)
        model_sd, opt_sd, meta = unpack(tensors, meta, state_path)
        try:
            model_sd["lm_head.weight"] = model_sd["embed_tokens.weight"]
            model.load_state_dict(model_sd)
            model.lm_head.weight = model.embed_tokens.weight
            opt.load_state_dict(opt_sd)
            step, spent = int(meta["step"]), float(meta["seconds"])
            g.set_state(tensors["gen"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise GraftError(f"cannot resume from {state_path}: it does not fit this run ({str(e)[:120]}); "
                             f"delete it or pass --restart") from None
        log(f"resumed at step {step} ({spent:.0f}s spent)")
    T = a.seq_len
    pos = torch.arange(T)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16)
    vg = torch.Generator().manual_seed(1)
    val_starts = torch.randint(0, val.numel() - T - 1, (8,), generator=vg)

    from model import rope_table
    model.rope = rope_table(args, T)

    def lm_loss(xs):
        with amp:
            logits = model(xs[:, :-1], pos)
        return F.cross_entropy(logits.float().flatten(0, 1), xs[:, 1:].flatten())

    # torch.compile fuses the many small element-wise ops (norms, RoPE): about 3x faster on CPU
    step_loss = torch.compile(lm_loss) if a.compile else lm_loss

    def val_loss():
        model.eval()
        with torch.no_grad():
            loss = lm_loss(torch.stack([val[s:s + T + 1] for s in val_starts]).long())
        model.train()
        return loss.item()

    logf = open(os.path.join(a.out, "train_log.jsonl"), "a")
    t0 = time.time() - spent
    budget = a.minutes * 60 if a.minutes else float("inf")
    model.train()
    while step < a.steps and time.time() - t0 < budget:
        starts = torch.randint(0, data.numel() - T - 1, (a.batch,), generator=g)
        xs = torch.stack([data[s:s + T + 1] for s in starts]).long()                # (B, T+1)
        frac = max(step / a.steps, (time.time() - t0) / budget)
        lr = lr_at(a, step, frac)
        loss = step_loss(xs)
        optimize(opt, model, loss, lr)
        step += 1
        if step % a.log_every == 0:
            rec = {"step": step, "loss": round(loss.item(), 4), "lr": round(lr, 6), "seconds": round(time.time() - t0, 1)}
            if step % (a.log_every * 10) == 0:
                rec["val_loss"] = round(val_loss(), 4)
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            progress("train", step, a.steps, t0, f"loss {rec['loss']:.3f}" + (f" val {rec['val_loss']:.3f}" if "val_loss" in rec else ""))
        if step % a.save_every == 0:
            save_target_state(state_path, model, opt, g, step, time.time() - t0)
    save_target_state(state_path, model, opt, g, step, time.time() - t0)
    vl = val_loss()
    from safetensors.torch import save_file
    sd = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v.detach().half().contiguous()
          for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    summary = {"steps": step, "seconds": round(time.time() - t0), "train_tokens": step * a.batch * T,
               "final_val_loss": round(vl, 4), "corpus_files": len(train_files), "heldout_files": len(held),
               "corpus_tokens": int(data.numel()), "heldout_tokens": int(val.numel())}
    with open(os.path.join(a.out, "train_summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    log(f"\nsaved target to {a.out}: {summary}")
    return a.out


# ----------------------------------------------------------------------------- stories260K







def ensure_stories_head(out: str | None = None, minutes: float = 0, log=True) -> str:
    """Train the EAGLE-3 head for ../shared/models/stories260K-hf into `out` (default: the cache
    folder; the repository ships the same recipe's head in data.stories_head_dir()), about two
    minutes on 2 CPU cores, unless `out` already holds one. Prompts: 300 openings the model samples
    itself (seed 0); bench.py holds out openings sampled with another seed."""
    out = out or os.path.join(cache_dir(), "stories-260k-eagle3")
    if os.path.isfile(os.path.join(out, "model.safetensors")) and os.path.isfile(os.path.join(out, "config.json")):
        return out
    if not os.path.isdir(STORIES):
        raise GraftError(f"stories260K-hf not found at {STORIES}")
    os.makedirs(out, exist_ok=True)
    prompts = os.path.join(out, "prompts.jsonl")
    if not os.path.isfile(prompts):
        m = load_model(STORIES)
        ops = sample_openings(m, load_tokenizer(STORIES, m.args), 300, seed=0)
        with open(prompts, "w") as fh:
            fh.write("".join(json.dumps({"prompt": o}) + "\n" for o in ops))
    argv = ["eagle3", "--ckpt", STORIES, "--prompts", prompts, "--out", out, "--device", "cpu",
            "--new-tokens", "160", "--steps", "400", "--batch", "32", "--seq-len", "64", "--ttt", "5",
            "--lr", "3e-3"]
    if minutes:
        argv += ["--minutes", str(minutes)]
    main(argv)
    return out


# ----------------------------------------------------------------------------- command line

def loop_flags(p):
    """The training loop's flags, the same for every kind of drafter."""
    p.add_argument("--minutes", type=float, default=0, help="stop after this many minutes (0 = no limit)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train an EAGLE-3 head (eagle3) or a small demo target (target).")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eagle3", help="train an EAGLE-3 head for a target by self-distillation")
    e.add_argument("--ckpt", required=True, help="target: local HF folder, .gguf file or hub id")
    e.add_argument("--prompts", nargs="+", default=None, metavar="FILE",
                   help=PROMPT_FORMATS + "; several files: each continued and cached on its own, all mixed")
    e.add_argument("--texts", nargs="+", default=None, metavar="PATH",
                   help="real texts (files, folders: their .py files, sorted, or `stdlib`: the standard library's "
                        "training split) cut into windows of --seq-len + 1 tokens, labelled with the target's own "
                        "distribution; with --prompts too, both kinds are mixed")
    e.add_argument("--max-windows", type=int, default=0, help="with --texts: keep at most this many windows, "
                                                              "evenly spaced (0 = all)")
    e.add_argument("--init", default=None, metavar="HEAD_DIR",
                   help="fine-tune this head (its draft vocabulary kept) instead of starting from scratch")
    e.add_argument("--save-dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="dtype of the saved head's weights")
    e.add_argument("--out", required=True)
    e.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    e.add_argument("--new-tokens", type=int, default=256, help="continuation length per prompt")
    e.add_argument("--data-temperature", type=float, default=0.0, help="0 = greedy continuations")
    e.add_argument("--max-prompts", type=int, default=0)
    e.add_argument("--gen-batch", type=int, default=32)
    e.add_argument("--draft-vocab", type=int, default=32000)
    e.add_argument("--chat", action="store_true", help="render each prompt with the target's chat template")
    e.add_argument("--top-k-targets", type=int, default=32,
                   help="the target's distribution is kept as its top entries (computed once over the data)")
    e.add_argument("--view-tokens", type=int, default=2048, help="tokens per target pass when computing them")
    e.add_argument("--steps", type=int, default=2000)
    e.add_argument("--batch", type=int, default=16)
    e.add_argument("--seq-len", type=int, default=256)
    e.add_argument("--ttt", type=int, default=7, help="unrolled training-time-test steps")
    loop_flags(e)
    e.add_argument("--restart", action="store_true", help="ignore a saved train_state.safetensors")
    e.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                   help="the head's step under bf16 autocast (its weights and optimizer float32)")
    f = sub.add_parser("dflash", help="train a DFlash block drafter for a target (the published recipe)")
    f.add_argument("--ckpt", required=True, help="target: local HF folder, .gguf file or hub id")
    f.add_argument("--prompts", required=True, help=PROMPT_FORMATS)
    f.add_argument("--out", required=True)
    f.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    f.add_argument("--chat", action="store_true", help="render each prompt with the target's chat template")
    f.add_argument("--new-tokens", type=int, default=256, help="the target's continuation per prompt")
    f.add_argument("--max-prompts", type=int, default=0)
    f.add_argument("--gen-batch", type=int, default=32)
    f.add_argument("--init", default=None, metavar="DIR", help="go on training this drafter (its shape kept)")
    f.add_argument("--layers", type=int, default=2, help="draft layers (5 for an 8B target in the published ones)")
    f.add_argument("--block-size", type=int, default=16)
    f.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                   help="the target in bfloat16 and the drafter under bf16 autocast (its weights float32)")
    f.add_argument("--mask-token-id", type=int, default=None,
                   help="default: the token the data uses least (highest id on ties)")
    f.add_argument("--anchors", type=int, default=16, help="blocks per window")
    f.add_argument("--gamma", type=float, default=7.0, help="position k of a block weighs exp(-(k-1)/gamma)")
    f.add_argument("--seq-len", type=int, default=256)
    f.add_argument("--batch", type=int, default=8)
    f.add_argument("--steps", type=int, default=100000)
    loop_flags(f)
    t = sub.add_parser("target", help="pretrain a small Qwen3-architecture target from scratch")
    t.add_argument("--out", required=True)
    t.add_argument("--corpus", nargs="*", default=None,
                   help="folders (all .py files) or files; default: this interpreter's standard library")
    t.add_argument("--vocab", type=int, default=4096)
    t.add_argument("--dim", type=int, default=192)
    t.add_argument("--layers", type=int, default=8)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--head-dim", type=int, default=64)
    t.add_argument("--intermediate", type=int, default=512)
    t.add_argument("--context", type=int, default=2048)
    t.add_argument("--seq-len", type=int, default=1024)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--steps", type=int, default=100000)
    t.add_argument("--minutes", type=float, default=60)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup-steps", type=int, default=30)
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    t.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile the step")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log-every", type=int, default=5)
    t.add_argument("--save-every", type=int, default=50)
    t.add_argument("--restart", action="store_true")
    sp = sub.add_parser("stdlib-prompts", help="write code prompts from the stdlib (train or held-out files)")
    sp.add_argument("--out", required=True, help="FILE.jsonl")
    sp.add_argument("--n", type=int, default=400)
    sp.add_argument("--lines", type=int, default=24)
    sp.add_argument("--heldout", action="store_true")
    sp.add_argument("--seed", type=int, default=0)
    kp = sub.add_parser("code-prompts", help="write HumanEval-shaped prompts (a def and its docstring) from the "
                        "stdlib's training split")
    kp.add_argument("--out", required=True, help="FILE.jsonl")
    kp.add_argument("--n", type=int, default=400)
    kp.add_argument("--seed", type=int, default=0)
    ip = sub.add_parser("instruction-prompts", help="write templated chat requests of many kinds (data.TEMPLATES)")
    ip.add_argument("--out", required=True, help="FILE.jsonl")
    ip.add_argument("--n", type=int, default=400)
    ip.add_argument("--seed", type=int, default=0)
    cp = sub.add_parser("chat-prompts", help="write chat prompts from ../shared/data (no benchmark set we report)")
    cp.add_argument("--out", required=True, help="FILE.jsonl")
    h = sub.add_parser("stories-head", help="train the stories260K-hf head (the recipe of the shipped one) into --out "
                                            "(default: the cache folder)")
    h.add_argument("--out", default=None)
    h.add_argument("--minutes", type=float, default=0)
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    if a.cmd == "eagle3":
        return train_eagle3(a)
    if a.cmd == "target":
        return train_target(a)
    if a.cmd == "dflash":
        return train_dflash(a)
    if a.cmd in ("stdlib-prompts", "chat-prompts", "code-prompts", "instruction-prompts") and not a.out.endswith(".jsonl"):
        raise GraftError(f"{a.cmd} writes JSON lines: name --out FILE.jsonl (a prompts file's format is read "
                         f"from its name), not {a.out}")
    if a.cmd == "stdlib-prompts":
        with open(a.out, "w") as fh:
            for t in stdlib_snippets(a.heldout, a.n, a.lines, a.seed):
                fh.write(json.dumps({"prompt": t}) + "\n")
        return a.out
    if a.cmd in ("code-prompts", "instruction-prompts"):
        with open(a.out, "w") as fh:
            for t in (code_prompts if a.cmd == "code-prompts" else instruction_prompts)(a.n, a.seed):
                fh.write(json.dumps({"prompt": t}) + "\n")
        return a.out
    if a.cmd == "chat-prompts":
        with open(a.out, "w") as fh:
            for p in chat_prompts():
                fh.write(json.dumps({"prompt": p}) + "\n")
        return a.out
    if a.cmd == "stories-head":
        out = ensure_stories_head(a.out, a.minutes)
        print(out)
        return out


if __name__ == "__main__":
    try:
        main()
    except GraftError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
