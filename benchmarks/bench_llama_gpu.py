"""End-to-end training step of a ~1.1B-parameter Llama-style model on a GPU: BF16 against
lowprec's and torchao's float8 training (issue 37, item 4).

Written for a lent CUDA machine (Hopper: H100/H200); ``--device cpu --quick`` is a dry run
of the same code with a tiny model, eager (no GPU timing means anything there).

**Model** (self-contained, the shape of Llama 3.2 1B with a 32000-token vocabulary):
token embedding; ``--layers`` (16) pre-norm decoder blocks, each RMSNorm → attention
(``--heads`` 32 query heads, ``--kv-heads`` 8 key/value heads, head dim 64, rotary
position embedding, ``F.scaled_dot_product_attention`` with ``is_causal=True``) → residual,
RMSNorm → SwiGLU MLP (``--hidden`` 2048 → ``--intermediate`` 8192 → 2048) → residual; a
final RMSNorm and an untied ``lm_head`` (2048 → ``--vocab`` 32000); cross-entropy on the
next token in float32. No biases. 1.10B parameters at the defaults, bf16, initialised
N(0, 0.02) (output projections 0.02/√(2·layers)) from the same seed in every row.

**Step**: forward, loss, backward, ``torch.optim.AdamW`` (fused on CUDA; lr 3e-4, betas
0.9/0.95, weight decay 0.1), ``zero_grad``, on ``--batch`` (8) sequences of ``--seq``
(2048) random tokens (two fixed batches, alternating, so the loss falls). No activation
checkpointing. Compiled as torchtitan does it: each decoder block ``torch.compile``d on
its own (the blocks share one compiled graph) and the head (final norm, ``lm_head``, loss)
compiled; the embedding and the optimizer run eagerly.

**Rows** (each in a fresh model, the previous one freed, dynamo reset):

* ``bf16``: the model as is;
* ``lowprec tensorwise`` / ``lowprec rowwise``: ``lowprec.float8.apply(model, preset,
  module_filter=...)`` on every linear layer except ``lm_head`` (hardware
  ``torch._scaled_mm`` GEMMs on CUDA with compute capability ≥ 8.9);
* ``torchao tensorwise`` / ``torchao rowwise``: ``torchao.float8.convert_to_float8_training``
  with ``Float8LinearConfig.from_recipe_name(...)`` and the same filter (skipped, with the
  reason, where torchao does not import; ``emulate=True`` on the CPU dry run);
* ``lowprec mxfp8``: only on hardware with MX GEMMs (compute capability ≥ 10.0); recorded
  as skipped elsewhere. (lowprec's ``mxfp8`` preset always emulates today: the row is
  there for when it does not.)

**Timing**: ``_common.time_fn`` (the benchmarks' harness) with ``min_repeat_s=0``: the row's
first ``--warmup`` (3) steps untimed (the first compiles: ``first_step_s``), then ``--steps``
(10) steps, each timed alone with the device synchronised around it; the median step is
the result. ``tokens/s`` = batch × seq / median step; ``× bf16`` and ``× torchao`` are
ratios of tokens/s (above 1: faster), the torchao one against the same recipe. ``peak
GiB``: ``torch.cuda.max_memory_allocated`` over the warm-up and timed steps (reset after
the model and optimizer are built; parameters, gradients, optimizer state and activations
included). ``loss``: the first and last step's loss (sanity: finite, close across rows).

``saved GiB`` (``saved_by_forward_gib``; CUDA): after the timed steps, one more step's
memory allocated when backward starts, above what the previous step left (the activations
kept for backward, the loss's included). ``--profile N``: then ``torch.profiler`` over N
more steps per row; the JSON's ``profile`` holds the per-step device time by kernel (the
40 largest) and its sums by kind (GEMM, attention, inductor's Triton kernels, other).

``--interleave``: every row's model is built and compiled first (all resident at once:
5 rows of the 2.0B model need about 80 GiB), then the ``--steps`` timed steps run in
rounds, one step of every row per round (``_common.time_many``), so that a drift of the
machine hits every row alike. Each row also gets ``paired_x_bf16`` / ``paired_x_torchao``:
per round, its tokens/s over the other row's in the same round, median, min, max and the
rounds it was faster. ``peak GiB`` is then one more step's peak less the memory the other
rows' parameters, buffers and optimizer state hold.

``--budget-s`` stops before a row would start past that many seconds; the JSON is written
after every row (a later failure keeps the earlier ones), a row's error is recorded and
the next row runs.

Usage::

    python benchmarks/bench_llama_gpu.py [--batch 8] [--steps 10] [--budget-s 420]
        [--rows bf16,lowprec tensorwise,...] [--out benchmarks/results/llama_gpu.json]
    python benchmarks/bench_llama_gpu.py --interleave --rows bf16,lowprec tensorwise,...
    python benchmarks/bench_llama_gpu.py --device cpu --quick   # dry run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import math
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F
from _common import (
    Timing,
    arg_parser,
    dynamo_counts,
    optional_import,
    parse_args,
    print_table,
    run_record,
    time_fn,
    time_many,
    write_json,
)
from torch import Tensor, nn

T0 = time.monotonic()
GIB = 2**30
ROWS = (
    "bf16",
    "lowprec tensorwise",
    "torchao tensorwise",
    "lowprec rowwise",
    "torchao rowwise",
    "lowprec mxfp8",
)
QUICK_HELP = "dry run: 2 layers of width 64, vocab 256, batch 2 x 64 tokens, 1+2 steps"


def elapsed() -> float:
    return time.monotonic() - T0


# ---- model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32000
    hidden: int = 2048
    intermediate: int = 8192
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    seq: int = 2048
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.c = c
        d = c.head_dim
        self.q_proj = nn.Linear(c.hidden, c.heads * d, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.heads * d, c.hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        c, d = self.c, self.c.head_dim
        q = self.q_proj(x).view(b, s, c.heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, c.kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.kv_heads, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = c.heads // c.kv_heads  # grouped-query attention: repeat each key/value head
        k = k[:, :, None].expand(b, c.kv_heads, rep, s, d).reshape(b, c.heads, s, d)
        v = v[:, :, None].expand(b, c.kv_heads, rep, s, d).reshape(b, c.heads, s, d)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, c.heads * d))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden, c.eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.eps)
        self.mlp = MLP(c)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Head(nn.Module):
    """Final norm, ``lm_head`` and the next-token cross-entropy (in float32)."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(c.hidden, c.eps)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, h: Tensor, targets: Tensor) -> Tensor:
        logits = self.lm_head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.head = Head(c)
        inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        ang = torch.outer(torch.arange(c.seq).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            out_proj = name.endswith(("o_proj.weight", "down_proj.weight"))
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.layers) if out_proj else 0.02)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.head(h, targets)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build(c: LlamaConfig, device: torch.device, seed: int) -> Llama:
    """The model with seed ``seed``'s weights (the same in every row), bf16, on ``device``."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Llama(c)
    return model.to(torch.bfloat16)


def not_lm_head(mod: nn.Module, fqn: str) -> bool:
    """The float8 conversions' filter: every linear layer except the output projection."""
    return not fqn.endswith("lm_head")


# ---- rows ----------------------------------------------------------------------------------


def _torchao() -> dict[str, Any] | str:
    """torchao's float8 training API, or why it does not import (its rows are skipped)."""
    ao = optional_import("torchao.float8")
    if isinstance(ao, str):
        return ao
    return {
        "version": importlib.import_module("torchao").__version__,
        "config": ao.Float8LinearConfig,
        "convert": ao.convert_to_float8_training,
    }


def converter(
    row: str, device: torch.device, ao: dict[str, Any] | str
) -> Callable[[nn.Module], nn.Module] | str:
    """The conversion a row applies to the bf16 model, or why the row is skipped."""
    if row == "bf16":
        return lambda m: m
    lib, recipe = row.split(" ", 1)
    if recipe == "mxfp8":
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if cap is None or cap < (10, 0):
            return (
                f"no MX GEMMs on this hardware ({'CPU' if cap is None else f'sm_{cap[0]}{cap[1]}'};"
                " MXFP8 matrix instructions need compute capability 10.0, Blackwell)"
            )
    if lib == "lowprec":
        import lowprec.float8

        return lambda m: lowprec.float8.apply(m, recipe, module_filter=not_lm_head)
    if lib == "torchao":
        if isinstance(ao, str):
            return f"torchao does not import: {ao}"
        cfg = ao["config"].from_recipe_name(recipe)
        if device.type != "cuda":
            cfg = dataclasses.replace(cfg, emulate=True)
        return lambda m: ao["convert"](m, config=cfg, module_filter_fn=not_lm_head)
    raise ValueError(f"unknown row {row!r}")


def free(device: torch.device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@dataclass
class Prepared:
    """A row's model, optimizer and training step, built and ready to time."""

    out: dict[str, Any]
    step: Callable[[], None]
    losses: list[Tensor]
    own_bytes: Callable[[], int]  # bytes of its parameters, buffers and optimizer state


def tensor_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes held by ``model``'s parameters and buffers and ``opt``'s state tensors."""
    ts = [*model.parameters(), *model.buffers()]
    ts += [v for st in opt.state.values() for v in st.values() if isinstance(v, Tensor)]
    return sum(t.numel() * t.element_size() for t in ts)


def prepare_row(
    convert: Callable[[nn.Module], nn.Module],
    c: LlamaConfig,
    args: Any,
    device: torch.device,
    batches: list[tuple[Tensor, Tensor]],
) -> Prepared:
    """Build the row's model (seed ``args.seed``), convert, compile, and its AdamW step."""
    cuda = device.type == "cuda"
    model = build(c, device, args.seed)
    out: dict[str, Any] = {"params": n_params(model)}
    model = convert(model)
    assert isinstance(model, Llama)
    out["modules"] = sorted(
        {type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}
    )
    if args.compile:
        for layer in model.layers:
            layer.compile()
        model.head.compile()
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda
    )
    losses: list[Tensor] = []
    i = [0]

    def step() -> None:
        x, y = batches[i[0] % len(batches)]
        i[0] += 1
        loss = model(x, y)
        if _SAVED_HOOK:
            loss.register_hook(_SAVED_HOOK[0])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return Prepared(out, step, losses, own_bytes=lambda: tensor_bytes(model, opt))


def finish_row(p: Prepared, t: Timing, c: LlamaConfig, args: Any) -> dict[str, Any]:
    """The row's timing and loss results, into ``p.out``."""
    out = p.out
    loss_values = [float(v) for v in p.losses]
    if not all(math.isfinite(v) for v in loss_values):
        out["error"] = f"non-finite loss: {loss_values}"
    tokens = args.batch * c.seq
    out.update(
        step_ms=t.median_ms,
        min_step_ms=t.min_ms,
        steps_ms=list(t.repeats_ms),
        first_step_s=t.first_call_ms / 1e3,
        tokens_per_s=tokens / (t.median_ms * 1e-3),
        losses=loss_values,
        loss_first=loss_values[0],
        loss_last=loss_values[-1],
        n_steps=len(loss_values),
    )
    return out


def run_row(
    convert: Callable[[nn.Module], nn.Module],
    c: LlamaConfig,
    args: Any,
    device: torch.device,
    batches: list[tuple[Tensor, Tensor]],
) -> dict[str, Any]:
    """One row alone: its model built, timed, measured, profiled (the others freed)."""
    free(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    p = prepare_row(convert, c, args, device, batches)
    if cuda:
        torch.cuda.synchronize(device)
        p.out["allocated_before_gib"] = torch.cuda.memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    counts0 = dynamo_counts()
    t = time_fn(p.step, device, repeats=args.steps, warmup=args.warmup, min_repeat_s=0)
    counts1 = dynamo_counts()
    out = finish_row(p, t, c, args)
    out["dynamo"] = {k: counts1[k] - counts0[k] for k in counts0}
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        out["saved_by_forward_gib"] = saved_by_forward(p.step, device)
    if args.profile:
        out["profile"] = profile_steps(p.step, device, args.profile)
    return out


def run_interleaved(
    convs: dict[str, Callable[[nn.Module], nn.Module]],
    c: LlamaConfig,
    args: Any,
    device: torch.device,
    batches: list[tuple[Tensor, Tensor]],
    rows: dict[str, Any],
) -> dict[str, int]:
    """Every row's model built and compiled first (all resident at once), then
    ``args.steps`` rounds with one step of every row per round (``time_many``), so that a
    drift of the machine hits every row alike; per-round paired ratios in ``paired``.
    Returns dynamo's graph and graph-break counts over all rows."""
    free(device)
    cuda = device.type == "cuda"
    prepared: dict[str, Prepared] = {}
    for row, conv in convs.items():
        if elapsed() > args.budget_s:
            rows[row] = {"skipped": f"budget: {elapsed():.0f} s > {args.budget_s:.0f} s"}
            continue
        print(f"[{elapsed():.0f} s] build {row} ...", flush=True)
        try:
            prepared[row] = prepare_row(conv, c, args, device, batches)
        except Exception as e:
            rows[row] = failed(row, e)
    counts0 = dynamo_counts()
    timings = time_many({r: p.step for r, p in prepared.items()}, device,
                        repeats=args.steps, warmup=args.warmup, min_repeat_s=0)  # fmt: skip
    counts1 = dynamo_counts()
    for row, p in prepared.items():
        rows[row] = finish_row(p, timings[row], c, args)
        rows[row]["interleaved_with"] = sorted(set(prepared) - {row})
    for row, p in prepared.items():
        if not cuda:
            continue
        # This row's peak: one more step, less what the other rows' models hold.
        torch.cuda.synchronize(device)
        others = torch.cuda.memory_allocated(device) - p.own_bytes()
        torch.cuda.reset_peak_memory_stats(device)
        p.step()
        torch.cuda.synchronize(device)
        rows[row]["peak_gib"] = (torch.cuda.max_memory_allocated(device) - others) / GIB
        rows[row]["saved_by_forward_gib"] = saved_by_forward(p.step, device)
    paired(rows, {r: list(timings[r].repeats_ms) for r in prepared})
    return {k: counts1[k] - counts0[k] for k in counts0}


def paired(rows: dict[str, Any], steps: dict[str, list[float]]) -> None:
    """Per round, each row's tokens/s over bf16's and over torchao's same recipe (steps
    taken side by side): the median, min and max of those ratios and the rounds won."""
    for name, ts in steps.items():
        for key, peer in (("bf16", "bf16"), ("torchao", name.replace("lowprec", "torchao"))):
            if peer == name or peer not in steps or (key == "torchao" and "lowprec" not in name):
                continue
            r = [b / a for a, b in zip(ts, steps[peer], strict=True)]
            rows[name][f"paired_x_{key}"] = {
                "median": statistics.median(r), "min": min(r), "max": max(r),
                "rounds_faster": sum(v > 1 for v in r), "rounds": len(r),
            }  # fmt: skip


def saved_by_forward(step: Callable[[], None], device: torch.device) -> float:
    """GiB allocated after a forward and its loss, above what a finished step leaves: the
    activations kept for backward (after the timed steps; one more training step runs)."""
    torch.cuda.synchronize(device)
    holder: dict[str, float] = {}
    before = torch.cuda.memory_allocated(device)

    def hook(grad: Tensor) -> Tensor:  # runs at the start of backward
        holder["at_backward"] = torch.cuda.memory_allocated(device)
        return grad

    _SAVED_HOOK[:] = [hook]
    try:
        step()
    finally:
        _SAVED_HOOK[:] = []
    torch.cuda.synchronize(device)
    return (holder.get("at_backward", before) - before) / GIB


_SAVED_HOOK: list[Callable[[Tensor], Tensor]] = []  # set by saved_by_forward for one step


def kernel_kind(name: str) -> str:
    """A CUDA kernel's group in the profile: GEMM, attention, inductor's Triton, other."""
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if any(k in n for k in ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "cublas")):
        return "gemm"
    if n.startswith("triton"):
        return "triton"
    return "other"


def profile_steps(step: Callable[[], None], device: torch.device, n: int) -> dict[str, Any]:
    """``torch.profiler`` over ``n`` more training steps: per-step device time by kernel
    (self CUDA time; the 40 largest kernels, and the sums per :func:`kernel_kind`)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        for _ in range(n):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    kernels = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0)
        if getattr(ev, "is_user_annotation", False):  # a range, e.g. the optimizer's step
            continue
        if dev_us and getattr(ev, "device_type", None) != torch.autograd.DeviceType.CPU:
            kernels.append({"name": ev.key[:160], "ms_per_step": dev_us / 1e3 / n,
                            "calls_per_step": ev.count / n,
                            "kind": kernel_kind(ev.key)})  # fmt: skip
    kernels.sort(key=lambda k: -k["ms_per_step"])
    by_kind: dict[str, float] = {}
    for k in kernels:
        by_kind[k["kind"]] = by_kind.get(k["kind"], 0.0) + k["ms_per_step"]
    return {
        "steps": n,
        "device_ms_per_step": sum(k["ms_per_step"] for k in kernels),
        "by_kind_ms_per_step": by_kind,
        "kernels_per_step": sum(k["calls_per_step"] for k in kernels),
        "top": kernels[:40],
    }


def failed(what: str, e: Exception) -> dict[str, Any]:
    """The JSON record of ``what``'s exception ``e`` (message and traceback), also printed."""
    print(f"{what}: {type(e).__name__}: {e}", file=sys.stderr)
    traceback.print_exc()
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def ratios(rows: dict[str, Any]) -> None:
    """``x_bf16`` and ``x_torchao`` (tokens/s ratios) and the loss check, in place."""
    base = rows.get("bf16", {})
    for name, r in rows.items():
        if "tokens_per_s" not in r:
            continue
        if "tokens_per_s" in base:
            r["x_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["loss_rel_diff_vs_bf16"] = (r["loss_last"] - base["loss_last"]) / base["loss_last"]
        peer = rows.get(name.replace("lowprec", "torchao"), {})
        if name.startswith("lowprec") and "tokens_per_s" in peer:
            r["x_torchao"] = r["tokens_per_s"] / peer["tokens_per_s"]


def lscpu_model() -> str | None:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith("Model name")), None)  # fmt: skip


# ---- main ----------------------------------------------------------------------------------


def main() -> None:
    p = arg_parser(__doc__, devices=("cuda", "cpu"), quick=QUICK_HELP)
    p.add_argument("--rows", default=",".join(ROWS), help="comma list of rows, in order")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile (default: on CUDA only)")  # fmt: skip
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile N more steps per row")  # fmt: skip
    p.add_argument("--interleave", action="store_true",
                   help="build every row first, then time them step by step in turn")  # fmt: skip
    p.add_argument("--revision", default=None, help="the git commit, where .git is absent")
    args = parse_args(p, None, "llama_gpu_{device}")
    if args.quick:
        args.batch, args.seq, args.layers, args.hidden = 2, 64, 2, 64
        args.intermediate, args.heads, args.kv_heads, args.vocab = 256, 4, 2, 256
        args.steps, args.warmup = 2, 1
    device = torch.device(args.device)
    if args.compile is None:
        args.compile = device.type == "cuda"
    rows_wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows_wanted if r not in ROWS]
    if bad:
        p.error(f"unknown rows {bad}; choose from {list(ROWS)}")
    c = LlamaConfig(vocab=args.vocab, hidden=args.hidden, intermediate=args.intermediate,
                    layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                    seq=args.seq)  # fmt: skip
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    ao = _torchao()
    import lowprec

    record = run_record(
        "llama_gpu",
        device,
        config=dataclasses.asdict(c),
        batch=args.batch,
        tokens_per_step=args.batch * c.seq,
        steps=args.steps,
        warmup=args.warmup,
        lr=args.lr,
        compile=args.compile,
        torchao=ao["version"] if isinstance(ao, dict) else ao,
        lowprec_file=lowprec.__file__,
        lscpu_model=lscpu_model(),
        argv=sys.argv[1:],
    )
    if args.revision is not None:
        record["git"]["commit"] = args.revision
    if device.type == "cuda":
        record["capability"] = list(torch.cuda.get_device_capability(device))
        record["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / GIB
    print(
        f"lowprec from {lowprec.__file__}; torch {torch.__version__}; torchao {record['torchao']}"
    )
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = []
    for _ in range(2):
        t = torch.randint(0, c.vocab, (args.batch, c.seq + 1), generator=gen).to(device)
        batches.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    rows: dict[str, Any] = {}
    record["rows"] = rows
    record["interleaved"] = args.interleave
    out = Path(args.out)
    convs: dict[str, Callable[[nn.Module], nn.Module]] = {}
    for row in rows_wanted:
        conv = converter(row, device, ao)
        if isinstance(conv, str):
            rows[row] = {"skipped": conv}
        else:
            convs[row] = conv
    if args.interleave:
        try:
            record["dynamo_all_rows"] = run_interleaved(convs, c, args, device, batches, rows)
        except Exception as e:
            record.update(failed("interleaved run", e))
        ratios(rows)
        write_json(record, out)
    else:
        for row, conv in convs.items():
            if elapsed() > args.budget_s:
                rows[row] = {"skipped": f"budget: {elapsed():.0f} s > {args.budget_s:.0f} s"}
            else:
                t0 = time.perf_counter()
                print(f"[{elapsed():.0f} s] {row} ...", flush=True)
                try:
                    rows[row] = run_row(conv, c, args, device, batches)
                except Exception as e:
                    rows[row] = failed(row, e)
                rows[row]["row_s"] = time.perf_counter() - t0
                r = rows[row]
                print(f"[{elapsed():.0f} s] {row}: {r.get('tokens_per_s', 0):.0f} tokens/s, "
                      f"first step {r.get('first_step_s', 0):.1f} s, "
                      f"peak {r.get('peak_gib', 0):.1f} GiB, loss {r.get('loss_last')}",
                      flush=True)  # fmt: skip
            ratios(rows)
            write_json(record, out)
    record["total_s"] = elapsed()
    write_json(record, out)
    report(record)
    print(f"wrote {out} ({elapsed():.0f} s)")


def report(record: dict[str, Any]) -> None:
    rows = record["rows"]
    n = next((r["params"] for r in rows.values() if "params" in r), None)
    print_table(
        f"Llama {n / 1e9 if n else 0:.2f}B, batch {record['batch']} x {record['config']['seq']}"
        f" ({record['machine'].get('gpu', record['device'])}, torch {record['torch']}, "
        f"torchao {record['torchao']})",
        ["row", "tokens/s", "x bf16", "x torchao", "step ms", "peak GiB", "saved GiB",
         "first step s", "loss first", "loss last", "graphs", "breaks"],
        [[k, r.get("tokens_per_s"), r.get("x_bf16"), r.get("x_torchao"), r.get("step_ms"),
          r.get("peak_gib"), r.get("saved_by_forward_gib"), r.get("first_step_s"),
          r.get("loss_first"), r.get("loss_last"),
          r.get("dynamo", {}).get("graphs"), r.get("dynamo", {}).get("graph_breaks")]
         for k, r in rows.items() if "tokens_per_s" in r],
    )  # fmt: skip
    for k, r in rows.items():
        for key in ("bf16", "torchao"):
            pr = r.get(f"paired_x_{key}")
            if pr:
                print(
                    f"paired x {key} {k}: median {pr['median']:.3f} (min {pr['min']:.3f}, "
                    f"max {pr['max']:.3f}; faster in {pr['rounds_faster']}/{pr['rounds']})"
                )
    if record.get("dynamo_all_rows"):
        print(f"dynamo, all rows: {record['dynamo_all_rows']}")
    if record.get("error"):
        print(f"error: {record['error']}")
    for k, r in rows.items():
        if "skipped" in r:
            print(f"skipped {k}: {r['skipped']}")
        if "error" in r:
            print(f"error {k}: {r['error']}")
    for k, r in rows.items():
        prof = r.get("profile")
        if prof:
            kinds = ", ".join(f"{n} {v:.1f}" for n, v in prof["by_kind_ms_per_step"].items())
            print(f"profile {k}: {prof['device_ms_per_step']:.1f} ms of kernels a step "
                  f"({prof['kernels_per_step']:.0f} kernels; {kinds})")  # fmt: skip
            for kern in prof["top"][:15]:
                print(f"    {kern['ms_per_step']:7.2f} ms {kern['calls_per_step']:5.0f}x "
                      f"{kern['kind']:9s} {kern['name'][:110]}")  # fmt: skip


if __name__ == "__main__":
    main()
