"""MX block scales, OCP floor against round-up (issue 40, item 2): which should the MX
presets use by default?

``mx_scale="floor"`` is OCP MX v1.0's ``2^(floor(log2 amax) - emax_elem)``: a block's
largest value lands in ``[2^emax, 2^(emax+1))``, so where its mantissa exceeds the
format's largest (E4M3: 1.75, E2M1: 1.5) it saturates. ``"ceil"`` rounds
``amax / fmt.max`` up to a power of two (NVIDIA's MXFP8 training recipe): nothing
saturates, at the cost of up to one binade of headroom.

For each model, one forward and backward on one batch, every variant against an FP64 copy
of the same model and batch: SQNR in dB (``_common.sqnr_db``) of the output, of the input
gradient of the first float8 layer's input... reported as the output (``out``) and all
linear weight gradients concatenated (``dW``). Models:

* ``ffn``: a LLaMA-style SwiGLU feed-forward block (dim 256, hidden 768, 512 tokens, input
  RMS-normalised with per-channel gains drawn log-normal, as trained activations have
  outlier channels), loss ``sum(y * g)``;
* ``reference``: the demo's CharGPT (width 64, depth 2, 4 heads, seq 128), trained 60 FP32
  steps on the shipped corpus first (trained weights and activations), then measured on a
  training batch with its own loss;
* the HF architectures of ``lowprec.jobs.hf_models`` (random init, real corpus tokens).

Variants: ``tensorwise`` (for scale), ``mxfp8`` and ``mxfp4`` presets with each ``mx_scale``.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import replace
from typing import Any

import torch
from _common import arg_parser, parse_args, print_table, run_record, sqnr_db, write_json
from torch import Tensor, nn

from lowprec.float8 import Float8Config, convert_to_float8

VARIANTS = ("tensorwise", "mxfp8 floor", "mxfp8 ceil", "mxfp4 floor", "mxfp4 ceil")


def recipe(variant: str) -> Float8Config:
    name, _, how = variant.partition(" ")
    r = Float8Config.from_name(name)
    if not how:
        return r
    return r.replace(
        input=replace(r.input, mx_scale=how),
        weight=replace(r.weight, mx_scale=how),
        grad_output=replace(r.grad_output, mx_scale=how),
    )


class SwiGLU(nn.Module):
    def __init__(self, dim: int = 256, hidden: int = 768) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        for lin in (self.gate, self.up, self.down):
            nn.init.normal_(lin.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.down(nn.functional.silu(self.gate(x)) * self.up(x))
        return y


def _ffn_case() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    m = SwiGLU()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 256, generator=g)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    x = x * torch.exp(torch.randn(256, generator=g))  # log-normal channel gains
    w = torch.randn(512, 256, generator=g)
    return m, (lambda mod, dt: (mod(x.to(dt)) * w.to(dt)).sum(), lambda mod, dt: mod(x.to(dt)))


def _lm_case(name: str, trained_steps: int) -> tuple[nn.Module, Any]:
    from lowprec.jobs.data import CharData
    from lowprec.jobs.model import ModelConfig, build_model

    torch.manual_seed(0)
    # fp32_sensitive=False: the same maths in FP32, and an FP64 copy stays FP64 throughout
    cfg = ModelConfig(width=64, depth=2, heads=4, seq_len=128, fp32_sensitive=False)
    m = build_model(name, cfg)
    data = CharData(128, 16)
    if trained_steps:
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        for i in range(trained_steps):
            x, y = data.batch("train", i)
            m(x, y)[1].backward()  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
    x, y = data.batch("train", 10_000)

    def loss(mod: nn.Module, dt: torch.dtype) -> Tensor:
        out: Tensor = mod(x, y)[1]
        return out

    def out(mod: nn.Module, dt: torch.dtype) -> Tensor:
        logits: Tensor = mod(x)[0]
        return logits

    return m, (loss, out)


def measure(model: nn.Module, fns: Any, variant: str) -> dict[str, float | None]:
    loss_fn, out_fn = fns
    ref = copy.deepcopy(model).double()
    ref_loss = loss_fn(ref, torch.float64)
    ref_loss.backward()
    ref_out = out_fn(ref, torch.float64).detach()
    m = convert_to_float8(copy.deepcopy(model), recipe(variant))
    loss_fn(m, torch.float32).backward()
    with torch.no_grad():
        out = out_fn(m, torch.float32)
    names = [n for n, mod in ref.named_modules() if isinstance(mod, nn.Linear)]
    mods = dict(m.named_modules())
    refs = dict(ref.named_modules())
    gw = torch.cat([mods[n].weight.grad.flatten().double() for n in names])  # type: ignore[union-attr]
    rw = torch.cat([refs[n].weight.grad.flatten() for n in names])  # type: ignore[union-attr]
    return {"out": sqnr_db(out, ref_out), "dW": sqnr_db(gw, rw)}


def main() -> None:
    ap = arg_parser(__doc__, quick="ffn and reference only, 5 steps")
    ap.add_argument("--models", nargs="+", default=None, help="default: ffn, reference, HF")
    ap.add_argument("--trained-steps", type=int, default=60)
    a = parse_args(ap, None, "mx_scale_cpu")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from lowprec.jobs.hf_models import HF_MODELS

    models = a.models or (["ffn", "reference"] if a.quick else ["ffn", "reference", *HF_MODELS])
    steps = 5 if a.quick else a.trained_steps
    results: dict[str, dict[str, dict[str, float | None]]] = {}
    for name in models:
        model, fns = (
            _ffn_case() if name == "ffn" else _lm_case(name, steps if name == "reference" else 0)
        )
        results[name] = {v: measure(model, fns, v) for v in VARIANTS}
        print(
            f"{name}: "
            + ", ".join(f"{v} {r['out']:.2f}/{r['dW']:.2f}" for v, r in results[name].items())
        )
    rows = []
    for name, res in results.items():
        rows.append([name, *(res[v]["out"] for v in VARIANTS), *(res[v]["dW"] for v in VARIANTS)])
    cols = ["model", *(f"out {v}" for v in VARIANTS), *(f"dW {v}" for v in VARIANTS)]
    print_table("SQNR (dB) against FP64: output and all linear weight gradients", cols, rows)
    gains = {
        fmt: [res[f"{fmt} ceil"][k] - res[f"{fmt} floor"][k]  # type: ignore[operator]
              for res in results.values() for k in ("out", "dW")]
        for fmt in ("mxfp8", "mxfp4")
    }  # fmt: skip
    summary = {
        f: {"min": min(g), "median": statistics.median(g), "max": max(g)} for f, g in gains.items()
    }
    for f, s in summary.items():
        print(f"{f}: ceil - floor, dB over models x (out, dW): min {s['min']:.2f}, "
              f"median {s['median']:.2f}, max {s['max']:.2f}")  # fmt: skip
    record = run_record("mx_scale", "cpu", models=models, trained_steps=steps)
    record.update(results=results, ceil_minus_floor_db=summary)
    path = write_json(record, a.out)
    print(f"wrote {path}")
    assert all(math.isfinite(v) for g in gains.values() for v in g)


if __name__ == "__main__":
    main()
