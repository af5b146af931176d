"""Compiled against eager float8 Linear, bit for bit, on the device at hand.

Forward and backward of ``Linear(K, N, bias=False)`` in bf16 on ``M`` random tokens,
converted with a float8 preset (hardware GEMMs, ``emulate=False``), eager and under
``torch.compile(fullgraph=True)`` in three variants:

* ``default``: inductor's default options;
* ``divrn``: ``options={"eager_numerics.division_rounding": True}`` (Triton divides float32
  correctly rounded, as eager CUDA does, instead of its approximate ``div.full``);
* ``f64``: lowprec's scale division replaced by a float64 quotient rounded to float32 (a
  candidate fix: for float32 operands the double rounding is innocuous).

Prints, per preset and variant, the share of the elements of ``y``, ``dx`` and ``dW`` that
differ from eager (0.0 everywhere: the same bits). Written for a lent CUDA machine; on the
CPU it runs a small shape.

Usage::

    python benchmarks/check_compiled_bits.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch import Tensor, nn

import lowprec.float8.quant as quant
from lowprec.float8 import Float8Config, convert_to_float8

_APPLY_SCALE = quant.apply_scale


def _f64_apply_scale(x: Tensor, s: Tensor, op: str = "mul") -> Tensor:
    if op == "div" and x.device.type == "cuda":
        return _APPLY_SCALE(x.double(), s.double(), op="div").float()
    return _APPLY_SCALE(x, s, op)  # type: ignore[arg-type]


def run(lin: nn.Linear, x0: Tensor, g0: Tensor, preset: str, mode: str) -> list[Tensor]:
    torch._dynamo.reset()
    quant.apply_scale = _f64_apply_scale if mode == "f64" else _APPLY_SCALE  # type: ignore[assignment]
    try:
        m = convert_to_float8(nn.Sequential(lin), Float8Config.from_name(preset, emulate=False))
        m.zero_grad()
        x = x0.clone().requires_grad_(True)
        if mode == "eager":
            f: Any = m
        elif mode == "divrn":
            opts = {"eager_numerics.division_rounding": True}
            f = torch.compile(m, fullgraph=True, options=opts)
        else:
            f = torch.compile(m, fullgraph=True)
        y = f(x)
        y.backward(g0)
    finally:
        quant.apply_scale = _APPLY_SCALE  # type: ignore[assignment]
    assert x.grad is not None and m[0].weight.grad is not None
    return [y.detach().float(), x.grad.float(), m[0].weight.grad.float()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the shares as JSON here")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m, k, n = (2048, 4096, 4096) if dev.type == "cuda" else (64, 128, 128)
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False).to(dev, torch.bfloat16)
    x0 = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    g0 = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    out: dict[str, Any] = {}
    for preset in ("tensorwise", "rowwise"):
        ref = run(lin, x0, g0, preset, "eager")
        for mode in ("default", "divrn", "f64"):
            r = run(lin, x0, g0, preset, mode)
            out[f"{preset}/{mode}"] = {
                name: float((a != b).float().mean())
                for name, a, b in zip(("y", "dx", "dW"), ref, r, strict=True)
            }
            print(preset, mode, out[f"{preset}/{mode}"], flush=True)
    if args.out:
        device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        record = {"device": device, "torch": torch.__version__, "shape_MxKxN": [m, k, n]}
        with open(args.out, "w") as f:
            json.dump({**record, "differ_vs_eager": out}, f, indent=1)


if __name__ == "__main__":
    main()
