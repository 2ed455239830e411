"""Weight-only int8 (--quantization int8): a target's linears read one byte a weight instead of two or four.

On a CPU, decoding one token is bound by reading the weights, so halving the bytes a token reads is the
largest speedup plain decoding has left (gpt-fast's, vLLM's and llama.cpp's int8 weights). Each linear
layer of the target (q, k, v, o, gate, up, down and the lm_head) is quantized once, at load:

    scale[n] = max_k |W[n, k]| / 127         one float32 a row (output channel), symmetric
    q[n, k]  = round(W[n, k] / scale[n])     int8 in [-127, 127]
    y[n]     = (sum_k x[k] q[n, k]) * scale[n] + b[n]

The activations keep the run's dtype; the embedding, the norms and every head or drafter stay as they
are. The lm_head is quantized too, by measurement: it is a fifth of SmolLM2-135M's bytes (its tied
49152 x 576 embedding); kept bfloat16 (quantize(lm_head=False)) it raised the median greedy agreement
with the bfloat16 target from 16.5 to 20 of 64 tokens on 40 MT-bench prompts, and cost about 1.2 ms a
token of 10.

On a CPU cpu_kernels.linear reads q as it streams and widens it in registers (bfloat16: each weight as
two bfloat16 terms, cpu_kernels.cpp's I8BF16Dot), one fixed sequence of float32 operations an output,
then the one multiply by the scale, so a row's result is still a function of that row alone: every
method on an int8 target is bit for bit `ar` on the same int8 target (not `ar` on the float target:
the weights differ; bench.py reports how much). Elsewhere the weight is widened for each
call and multiplied by torch: on a CPU without the kernels in float32, rows padded in exact mode (exact,
slower than the float weights); on a GPU in the activations' dtype, then scaled (gpt-fast's int8: not
exact, and untried on a GPU here).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_kernels
from model import GraftError, Linear, MoE, pad_rows, use_kernels

CHOICES = ("none", "int8")          # --quantization (vLLM's and SGLang's flag name)


def int8_rows(w: torch.Tensor) -> tuple:
    """W (N, K) float -> (q (N, K) int8, scale (N,) float32): one symmetric scale a row, max |W| / 127
    (an all-zero row: scale 1, q 0). Computed in float32 whatever W's dtype."""
    wf = w.detach().float()
    scale = wf.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(Linear):
    """A Linear whose weight is int8 (N, K) with a float32 scale (N,) a row; the bias (N,) in the
    activations' dtype as before. `weight` keeps its name (and Linear's place in a model), so
    model.Block's fused route passes it to cpu_kernels.block with `scale` beside it."""

    def __init__(self, lin: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = lin.in_features, lin.out_features
        q, scale = int8_rows(lin.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("scale", scale)
        self.bias = lin.bias
        self.exact = lin.exact                     # set_exact's mode carries over

    def forward(self, x):
        if use_kernels(x) and not torch.is_grad_enabled():
            return cpu_kernels.linear(x, self.weight, self.bias, self.scale)
        if x.device.type != "cpu":      # a GPU: gpt-fast's int8, the weight widened to x's dtype for torch's matmul
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
            return y + self.bias if self.bias is not None else y
        # a CPU without the kernels: the integers widened for this call (exact: |q| <= 127), summed in
        # float32, then scaled; in exact mode rows padded as model.Linear pads them (float32 GEMM rows agree then)
        h = x.reshape(-1, x.shape[-1]).float()
        h = pad_rows(h) if self.exact else h
        y = F.linear(h, self.weight.float())[:x.shape[:-1].numel()] * self.scale
        y = y + self.bias.float() if self.bias is not None else y
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def quantize(model: nn.Module, how: str = "int8", lm_head: bool = True) -> nn.Module:
    """Replace the target's linears (every model.Linear of its layers but a MoE's router, and lm_head unless lm_head=False)
    by Int8Linear, in place, once; the float weights are dropped (a tied lm_head keeps the embedding).
    how: "none" (nothing) or "int8". Records model.quantization (the warm-up cache's key). Errors:
    GraftError for another `how`, or a model already quantized."""
    if how not in CHOICES:
        raise GraftError(f"--quantization must be one of {', '.join(CHOICES)}, got {how!r}")
    if how == "none":
        return model
    if getattr(model, "quantization", "none") != "none":
        raise GraftError(f"the model is already quantized ({model.quantization})")
    todo = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is Linear and not isinstance(parent, MoE)       # a MoE's router and experts stay
            and (lm_head or child is not getattr(model, "lm_head", None))]
    for parent, name, child in todo:
        setattr(parent, name, Int8Linear(child))
    model.quantization = how
    return model
