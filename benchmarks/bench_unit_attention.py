"""How unit the unit-scaled attention is at each ``softmax_mult``: the rms of the output and
of ``∂q, ∂k, ∂v`` of ``lowprec.unit.functional.scaled_dot_product_attention`` for unit
``q, k, v`` and a unit incoming gradient, causal and not, over a range of key counts.

A numerics measurement, not a timing: the rule scales by the sampled expectations of
``Σ_j p_ij²`` and of ``∂q``'s variance for independent unit inputs (docs/unit-scaling.md),
so every row should read 1 up to the sampling of these 2×4 heads.
``--quick``: fewer key counts, temp JSON.
"""

from __future__ import annotations

import math

import torch
from _common import arg_parser, parse_args, print_table, run_record, setup_torch, write_json

from lowprec.unit import functional as U

MULTS = (0.25, 0.5, 1.0, 2.0, 4.0)
HEADS, D = 4, 64


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().double().square().mean().sqrt())


def measure(keys: int, causal: bool, mult: float, batch: int = 2) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, HEADS, keys, D, generator=g) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(True)
    y = U.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=mult / math.sqrt(D))
    y.backward(torch.randn(y.shape, generator=g))
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"y": _rms(y), "dq": _rms(q.grad), "dk": _rms(k.grad), "dv": _rms(v.grad)}


def main(argv: list[str] | None = None) -> None:
    p = arg_parser(__doc__, threads=1, quick="key counts 64 and 512 only, temp JSON")
    args = parse_args(p, argv, "unit_attention")
    setup_torch(args.threads)
    key_counts = (64, 512) if args.quick else (64, 512, 4096)
    rows, results = [], []
    for keys in key_counts:
        for causal in (True, False):
            for mult in MULTS:
                r = measure(keys, causal, mult)
                results.append({"keys": keys, "causal": causal, "mult": mult, **r})
                rows.append([keys, "yes" if causal else "no", mult, r["y"], r["dq"], r["dk"],
                             r["dv"]])  # fmt: skip
    print_table(
        "unit-scaled attention: rms at init (1 is unit)",
        ["keys", "causal", "softmax_mult", "output", "∂q", "∂k", "∂v"],
        rows,
    )
    record = run_record("unit_attention", "cpu", heads=HEADS, head_dim=D, results=results)
    print(f"wrote {write_json(record, args.out)}")


if __name__ == "__main__":
    main()
