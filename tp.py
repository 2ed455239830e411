"""Tensor parallelism: one target sharded over the ranks of torch.distributed, launched by torchrun
(gpt-fast's tp.py form: column/row sharding, two all-reduces a layer).

    torchrun --nproc-per-node 2 generate.py --ckpt Qwen/Qwen3-32B --draft HEAD ...

What each of the N ranks holds (Shards.take names the slice of every checkpoint tensor; a rank reads
only that, so its peak memory is about 1/N of the sharded weights plus the replicated ones):
  attention  q/k/v by heads (columns): H/N query heads and H_kv/N KV heads, contiguous, so local query
             head h still reads local KV head h // G (with fewer KV heads than ranks, the one KV head its
             query heads read, repeated); the q/k norms are per head (each rank its own heads'); the KV
             cache holds the rank's KV heads only. o_proj by rows (its input columns), then one
             all-reduce of its output.
  MLP        gate/up by columns (I/N), down by rows, then one all-reduce.
  Qwen3-MoE  every expert's gate/up/down the same way on every rank, the router replicated (every rank
             routes identically), one all-reduce after the experts' weighted combine.
  the rest   replicated: the embedding, the norms, lm_head; and outside the model the EAGLE-3 head,
             the continuation matrix and retrieval.
The embedding and lm_head are replicated, not split by vocabulary: every rank then holds the full hidden
states and full logits, so verification, sampling, drafting (the head reads the residual stream after
the all-reduces) and retrieval run on every rank with no communication at all, and the one host sync a
round stays one. A vocabulary split would save (N-1)/N of the two V x D matrices a rank (about 2.2 GB
for Qwen3-235B-A22B at N=8 in bfloat16, under 2% of an H200) for a gather of (B, T, V) logits every pass.

Every rank decides the same tokens: an all-reduce leaves the same bits on every rank (each element is
summed once, then copied), sampling is position noise keyed on the seed (verify.position_noise, no
random state), and whatever a rank would decide from its own clock (the warm-up's calibration) is
rank 0's, broadcast (same). Against one process the sums are split (a rank's partial sum, then the
all-reduce), so float32 logits differ in the last bits: the tokens are the same away from exact ties.
"""
import atexit
import dataclasses
import os
import resource
import sys

import torch
import torch.distributed as dist

from model import GraftError, ModelArgs


def world() -> tuple:
    """(rank, world size) from torchrun's environment; (0, 1) in a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def quiet():
    """Output is rank 0's: every other rank's stdout and stderr go to /dev/null (the faces' entry, cli.run)."""
    if world()[0] != 0:
        sys.stdout = sys.stderr = open(os.devnull, "w")


def init(device: str) -> str:
    """Join the process group (once; NCCL on CUDA, gloo on the CPU) and return this rank's device:
    cuda:LOCAL_RANK on a GPU (one GPU a rank), `device` otherwise. A plain process: `device`, untouched."""
    if world()[1] == 1:
        return device
    cuda = torch.device(device).type == "cuda"
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():      # (NCCL's communicator made now, before any CUDA graph captures)
        dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": torch.device(device)} if cuda else {}))
        atexit.register(leave)
    return device


def leave():
    """At exit: wait for every rank, then leave the group. A rank that tore its group down while
    another still used it would abort in gloo's threads ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def end(code: int = 0):
    """Under torchrun: leave the group (leave), then end this rank's process at once (os._exit, stdio
    flushed first), so that the interpreter's teardown never destroys c10d's and gloo's C++ objects
    itself: in that teardown a rank once aborted ("terminate called without an active exception", CI,
    rank 1 of the compiled TP test) after all its work was done. A plain process: returns."""
    if world()[1] == 1:
        return
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    leave()
    os._exit(code)


def same(obj):
    """Rank 0's `obj` on every rank (pickled): what a rank decides from its own clock must agree."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def every(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank ([obj] in a plain process)."""
    if world()[1] == 1:
        return [obj]
    out = [None] * world()[1]
    dist.all_gather_object(out, obj)
    return out


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def all_reduce(module, inputs, out):
    """A forward hook: the sum over ranks of a row-sharded projection's partial output (B, T, D).
    Functional, so torch.compile traces it into the step's graph (gpt-fast does the same)."""
    from torch.distributed import _functional_collectives as funcol
    return funcol.all_reduce(out, "sum", dist.group.WORLD)


class Shards:
    """This rank's part of a target. args: the whole model's ModelArgs; `self.args` describes the rank's
    modules (its heads, its MLP and expert widths), so model.Transformer(self.args) builds them.
    Errors: GraftError, one line, for a world size the heads (or the MLP widths) cannot be split into."""

    def __init__(self, args: ModelArgs, rank: int, n: int):
        sizes = {"query heads": args.n_heads}
        if not all(args.sparse_layers) or not args.sparse_layers:
            sizes["intermediate_size"] = args.intermediate_size
        if args.n_experts:
            sizes["moe_intermediate_size"] = args.moe_intermediate_size
        kv_fits = lambda k: args.n_kv_heads % k == 0 or k % args.n_kv_heads == 0
        if any(v % n for v in sizes.values()) or not kv_fits(n):
            fits = [k for k in range(1, args.n_heads + 1) if not any(v % k for v in sizes.values()) and kv_fits(k)]
            raise GraftError(f"cannot split this model over {n} ranks: its {', '.join(f'{k} ({v})' for k, v in sizes.items())} "
                             f"must each divide evenly, and its {args.n_kv_heads} KV heads divide evenly or evenly "
                             f"repeat; world sizes that fit: {', '.join(map(str, fits))}")
        self.full, self.rank, self.n = args, rank, n
        # KV heads: H_kv/N a rank; with fewer KV heads than ranks (Qwen3-235B-A22B: 4 on 8) each rank
        # holds the one its query heads read, repeated on N/H_kv ranks (as vLLM does)
        self.kv = max(args.n_kv_heads // n, 1)
        self.kv_first = rank * args.n_kv_heads // n if args.n_kv_heads < n else rank * self.kv
        self.args = dataclasses.replace(args, n_heads=args.n_heads // n, n_kv_heads=self.kv,
                                        intermediate_size=args.intermediate_size // n,
                                        moe_intermediate_size=args.moe_intermediate_size // n)

    def take(self, name: str, shape) -> tuple | None:
        """The part of checkpoint tensor `name` (HF or model.py names; `shape` its full shape in the
        file) this rank reads: (dim, [(start, stop), ...]) to concatenate along dim, or None: all of it
        (replicated, or a shape the config does not imply, which load_model then refuses)."""
        a = self.full
        hd = a.head_dim
        parts = name.removeprefix("model.").split(".")
        if parts[0] != "layers" or len(parts) < 4:
            return None
        what = ".".join(p for p in parts[2:] if not p.isdigit())        # the expert's index dropped
        moe = a.moe_intermediate_size
        rule = {"self_attn.q_proj.weight": (0, a.n_heads * hd, 1), "self_attn.q_proj.bias": (0, a.n_heads * hd, 1),
                "self_attn.k_proj.weight": (0, a.n_kv_heads * hd, 1), "self_attn.k_proj.bias": (0, a.n_kv_heads * hd, 1),
                "self_attn.v_proj.weight": (0, a.n_kv_heads * hd, 1), "self_attn.v_proj.bias": (0, a.n_kv_heads * hd, 1),
                "self_attn.o_proj.weight": (1, a.n_heads * hd, 1),
                "mlp.gate_proj.weight": (0, a.intermediate_size, 1), "mlp.up_proj.weight": (0, a.intermediate_size, 1),
                "mlp.down_proj.weight": (1, a.intermediate_size, 1),
                "mlp.experts.gate_proj.weight": (0, moe, 1), "mlp.experts.up_proj.weight": (0, moe, 1),
                "mlp.experts.down_proj.weight": (1, moe, 1),
                "mlp.experts.gate_up_proj": (1, 2 * moe, 2),      # transformers 5's fused (E, 2I, D): [gate; up]
                "mlp.experts.down_proj": (2, moe, 1)}.get(what)   # and (E, D, I)
        if rule is None:
            return None
        dim, size, pieces = rule
        if len(shape) <= dim or shape[dim] != size:
            return None
        if what.startswith(("self_attn.k_proj", "self_attn.v_proj")):       # this rank's KV heads
            return 0, [(self.kv_first * hd, (self.kv_first + self.kv) * hd)]
        part, local = size // pieces, size // pieces // self.n
        return dim, [(p * part + self.rank * local, p * part + (self.rank + 1) * local) for p in range(pieces)]

    @staticmethod
    def cut(t, take: tuple) -> torch.Tensor:
        """The part `take` (Shards.take) of t: a tensor, or a safetensors slice (get_slice: only that part
        is read from the file)."""
        dim, spans = take
        pieces = [t[(slice(None),) * dim + (slice(a, b),)] for a, b in spans]
        return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim)

    def connect(self, model):
        """The two all-reduces of every layer, as forward hooks on its attention and its MLP (or MoE)
        block, whose outputs are this rank's partial sums; and the Shards on model.shards."""
        for block in model.layers:
            block.self_attn.register_forward_hook(all_reduce)
            block.mlp.register_forward_hook(all_reduce)
        model.shards = self
        return model


def shards(args: ModelArgs) -> Shards | None:
    """This rank's Shards of a target (None in a plain process). Call init first."""
    rank, n = world()
    return Shards(args, rank, n) if n > 1 else None
