"""Step time (forward + backward + AdamW) of the unit-scaled CharGPT against the standard
CharGPT at the demo shape, eager and ``torch.compile``d, and the ratios.

The ``unit-scaling`` package (Graphcore) is the intended baseline on the same shapes; if
it does not install with ``--no-deps`` or import against this torch, the JSON records why.
Issue 4's goal: unit-scaled compiled step <= 1.05x the standard compiled step.
``--threads`` defaults to 1 (shared 2-core machine); ``--quick``: tiny shape, temp JSON.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _common import default_out, print_table, run_record, setup_torch, time_many, write_json

from lowprec.models import CharData, CharGPT, ModelConfig
from lowprec.unit import umup_param_groups, unit_scale


def _step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[Any]) -> Any:
    i = [0]

    def step() -> None:
        x, y = batches[i[0] % len(batches)]
        i[0] += 1
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _baseline_status() -> str:
    try:
        import unit_scaling  # type: ignore[import-not-found]  # noqa: F401
    except Exception as e:  # record why
        return f"not importable: {type(e).__name__}: {e}"
    return "importable (model comparison not built in this run)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    setup_torch(a.threads, cold_compile=False)
    shape = dict(batch=32, seq=128, width=64, depth=2, heads=4)
    if a.quick:
        shape = dict(batch=4, seq=16, width=32, depth=1, heads=2)
    cfg = ModelConfig(width=shape["width"], depth=shape["depth"], heads=shape["heads"],
                      seq_len=shape["seq"])  # fmt: skip
    data = CharData(shape["seq"], shape["batch"])
    batches = [data.batch("train", i) for i in range(4)]
    calls = {}
    for name in ("standard", "unit"):
        for mode in ("eager", "compiled"):
            torch.manual_seed(0)
            m: torch.nn.Module = CharGPT(cfg)
            if name == "unit":
                m = unit_scale(m)
                opt = torch.optim.AdamW(umup_param_groups(m, 0.125))
            else:
                opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
            run = torch.compile(m) if mode == "compiled" else m
            calls[f"{name}/{mode}"] = _step_fn(run, opt, batches)
    t = time_many(calls, repeats=a.repeats, warmup=3, min_repeat_s=0.3)
    rows = []
    for k, v in t.items():
        base = t[f"standard/{k.split('/')[1]}"].median_ms
        rows.append([k, v.median_ms, v.median_ms / base, v.first_call_ms / 1e3])
    print_table("unit-scaled vs standard CharGPT step (fwd+bwd+AdamW)",
                ["variant", "ms/step", "x standard (same mode)", "first call s"], rows)  # fmt: skip
    rec = run_record("bench_unit", "cpu", shape=shape, threads=a.threads)
    rec["timings"] = {k: v.as_dict() for k, v in t.items()}
    rec["ratio_eager"] = t["unit/eager"].median_ms / t["standard/eager"].median_ms
    rec["ratio_compiled"] = t["unit/compiled"].median_ms / t["standard/compiled"].median_ms
    rec["goal_compiled_ratio"] = 1.05
    rec["unit_scaling_package"] = _baseline_status()
    print(f"ratio eager {rec['ratio_eager']:.3f}, compiled {rec['ratio_compiled']:.3f}")
    print("unit-scaling package:", rec["unit_scaling_package"])
    write_json(rec, a.out or default_out("unit_cpu", a.quick))


if __name__ == "__main__":
    main()
