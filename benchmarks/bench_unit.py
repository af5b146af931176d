"""Step time (forward + backward + AdamW) of the unit-scaled CharGPT against the standard
CharGPT at the demo shape, eager and ``torch.compile``d, and the ratios.

The ``unit-scaling`` package (Graphcore; ``pip install --no-deps unit-scaling
docstring_parser einops tabulate``) is the peer baseline: its ``TransformerDecoder`` on the
same shapes (its ``unit_scale`` transform does not run on CharGPT; the JSON says why). If
it does not import against this torch, the JSON records why.
Goal (issue 18): unit-scaled compiled step <= 1.03x the standard compiled step (issue 4: 1.05x).
``--threads`` defaults to 1 (shared 2-core machine); ``--quick``: tiny shape, temp JSON.
"""

from __future__ import annotations

from typing import Any

import torch
from _common import (
    arg_parser,
    lm_step_fn,
    parse_args,
    print_mode_ratio_table,
    reference_lm_setup,
    run_record,
    setup_torch,
    time_many,
    write_json,
)

from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.unit import umup_param_groups, unit_scale


def _peer_step(shape: dict[str, int], batches: list[Any], compiled: bool) -> Any:
    """The ``unit-scaling`` package's own unit-scaled decoder at the same shape, with its
    u-μP AdamW: ``TransformerDecoder`` (token embedding only, RMSNorm, no biases, fused
    causal attention) is its nearest model to CharGPT; its ``unit_scale`` transform does not
    run on CharGPT (see ``_peer_transform_status``)."""
    import unit_scaling as uu  # type: ignore[import-not-found, unused-ignore]
    from unit_scaling.optim import AdamW  # type: ignore[import-not-found, unused-ignore]

    torch.manual_seed(0)
    model = uu.TransformerDecoder(hidden_size=shape["width"], vocab_size=65,
                                  layers=shape["depth"], heads=shape["heads"])  # fmt: skip
    opt = AdamW(model.parameters(), lr=1.0)
    ids = [torch.cat([x, y[:, -1:]], dim=1) for x, y in batches]  # seq + 1 tokens: seq losses
    loss_fn = torch.compile(model.loss) if compiled else model.loss
    i = [0]

    def step() -> None:
        loss = loss_fn(ids[i[0] % len(ids)])
        i[0] += 1
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _peer_status() -> str:
    try:
        import unit_scaling  # type: ignore[import-not-found, unused-ignore]
    except Exception as e:  # record why
        return f"not importable: {type(e).__name__}: {e}"
    return f"unit-scaling {getattr(unit_scaling, '__version__', '?')}: importable"


def _peer_transform_status(cfg: ModelConfig, batches: list[Any]) -> str:
    """Whether ``unit_scaling.transforms.unit_scale`` runs on the standard CharGPT."""
    try:
        from unit_scaling.transforms import unit_scale as peer_unit_scale

        x, y = batches[0]
        peer_unit_scale(CharGPT(cfg))(x, y)
    except Exception as e:
        return f"fails on CharGPT: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return "runs on CharGPT"


def main() -> None:
    ap = arg_parser(__doc__, threads=1, repeats=5, quick="tiny shape")
    a = parse_args(ap, None, "unit_cpu")
    setup_torch(a.threads)
    shape, cfg, batches = reference_lm_setup(a.quick)
    calls = {}
    for name in ("standard", "unit"):
        for mode in ("eager", "compiled"):
            torch.manual_seed(0)
            m: torch.nn.Module = CharGPT(cfg)
            if name == "unit":
                m = unit_scale(m, reinit=True)
                opt = torch.optim.AdamW(umup_param_groups(m, 1.0))
            else:
                opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
            run = torch.compile(m) if mode == "compiled" else m
            calls[f"{name}/{mode}"] = lm_step_fn(run, opt, batches)
    peer = _peer_status()
    if peer.endswith("importable"):
        for mode in ("eager", "compiled"):
            calls[f"unit-scaling pkg/{mode}"] = _peer_step(shape, batches, mode == "compiled")
    t = time_many(calls, repeats=a.repeats, warmup=3, min_repeat_s=0.3)
    print_mode_ratio_table("unit-scaled vs standard CharGPT step (fwd+bwd+AdamW)", t,
                           "standard", "x standard (same mode)")  # fmt: skip
    rec = run_record("bench_unit", "cpu", shape=shape, threads=a.threads)
    rec["timings"] = {k: v.as_dict() for k, v in t.items()}
    rec["ratio_eager"] = t["unit/eager"].median_ms / t["standard/eager"].median_ms
    rec["ratio_compiled"] = t["unit/compiled"].median_ms / t["standard/compiled"].median_ms
    rec["goal_compiled_ratio"] = 1.03
    rec["unit_scaling_package"] = peer
    print(f"ratio eager {rec['ratio_eager']:.3f}, compiled {rec['ratio_compiled']:.3f}")
    if "unit-scaling pkg/eager" in t:
        for mode in ("eager", "compiled"):
            p = t[f"unit-scaling pkg/{mode}"].median_ms
            rec[f"peer_ratio_{mode}"] = p / t[f"standard/{mode}"].median_ms
            rec[f"unit_vs_peer_{mode}"] = t[f"unit/{mode}"].median_ms / p
        rec["peer_transform_on_chargpt"] = _peer_transform_status(cfg, batches)
        rec["peer_note"] = (
            "unit_scaling.TransformerDecoder at the same width/depth/heads/batch/seq with its "
            "u-muP AdamW; not the same model (no position embedding, RMSNorm, no biases, "
            "fused causal attention), so ratios compare implementations, not identical maths"
        )
    print("unit-scaling package:", peer, rec.get("peer_transform_on_chargpt", ""))
    write_json(rec, a.out)


if __name__ == "__main__":
    main()
