"""FP8 attention (issue 33 item 5): the SQNR of each of attention's GEMMs in FP8 against
FP32 attention, and the loss gap of training with it on top of fp8-tensorwise.

Training rows, each a :class:`~lowprec.recipes.Recipe`: ``fp8-tensorwise`` (the preset,
attention in FP32) and ``fp8-tensorwise +attn-<scaling>``, the preset with
``Float8Config.attention=<scaling>`` (``--train-scalings``, default tensorwise and
rowwise). Each (row, seed) is one ``lowprec train --recipe <row>.json --seed S``
subprocess (the project's loop, ``OMP_NUM_THREADS=1``, ``--jobs`` at a time) on the
reference model; defaults: width 64, depth 4, 4 heads (head dim 16), batch 16x64
characters, 300 steps, AdamW lr 1e-2 (30 warm-up steps, cosine), the val loss over 16 val
batches at the end. Per row: val loss per seed, mean, sample sd, and the paired gap (same
seed) to ``fp8-tensorwise``: mean and sample sd over the seeds.

SQNR (``10 log10(Σ ref² / Σ (fp8 − ref)²)``, dB, pooled over the layers): the attention
inputs ``q, k, v`` and output gradient ``dO`` of every layer are captured on one val batch
from the ``fp8-tensorwise`` model of each seed, at initialisation and after training (its
final checkpoint); for each scaling (tensorwise, headwise, rowwise):

* per GEMM (:func:`lowprec.float8.attention.attention_gemms`): ``S = Q Kᵀ``, ``O = P V``,
  ``dP = dO Vᵀ``, ``dV = Pᵀ dO``, ``dQ = dS K``, ``dK = dSᵀ Q``, each on FP32 attention's
  operands, its FP8 product against the FP32 product (that GEMM's quantization alone);
* end to end: :func:`lowprec.float8.fp8_attention`'s output and ``q, k, v`` gradients
  against FP32 attention's (``F.scaled_dot_product_attention``).

The gradients ``dO``, ``dS`` are E5M2 (the preset's ``grad_output`` format), and, for the
trained model, also E4M3 (``grad_fmt="e4m3fn"``, what a recipe with E4M3 gradients such as
``fp8-deepseek`` gives attention).

Cost: forward + backward of one attention call (the first trained layer's inputs) per
scaling and for FP32 SDPA, median of 9 repeats of the thread's CPU time, one thread.

Prints the tables and writes ``--out`` (default ``benchmarks/results/fp8_attention_cpu.json``:
machine, lscpu model and flags, torch, git revision, the configuration and every run).
Finished runs in ``--runs`` are reused. ``--quick``: a tiny model, 6 steps, 1 seed, JSON in
the temp dir.

    OMP_NUM_THREADS=1 python benchmarks/bench_fp8_attention.py --jobs 2 --runs /tmp/fa_runs

The recorded run and the findings: ``benchmarks/README.md``, "FP8 attention".
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import arg_parser, parse_args, print_table, run_record, time_many, write_json
from bench_fp4 import LOWPREC, add_train_args, lscpu, paired, run_cmd, train_config
from torch import Tensor

from lowprec.float8 import fp8_attention
from lowprec.float8.attention import ATTENTION_GEMMS, attention_gemms
from lowprec.float8.config import ATTENTION_SCALINGS
from lowprec.jobs.rundir import load_checkpoint, read_metrics
from lowprec.jobs.train_config import saved_config
from lowprec.jobs.train_setup import build
from lowprec.recipes import Recipe, get_recipe

BASE = "fp8-tensorwise"
SQNR_CASES = (  # (name, trained, gradient format)
    ("init", False, "e5m2"), ("trained", True, "e5m2"), ("trained, E4M3 gradients", True, "e4m3fn"),
)  # fmt: skip
END_TO_END = ("out", "grad_q", "grad_k", "grad_v")


def rows(scalings: list[str]) -> dict[str, Recipe]:
    base = get_recipe(BASE)
    assert base.float8 is not None
    out = {BASE: base}
    for s in scalings:
        name = f"{BASE} +attn-{s}"
        cfg = base.float8.replace(attention=s)
        out[name] = replace(base, name=f"{BASE}+attn-{s}", technique=(cfg,))
    return out


# ---- SQNR -----------------------------------------------------------------------------------


def capture(run: Path, trained: bool) -> list[tuple[Tensor, ...]]:
    """``(q, k, v, dO, scale)`` of every attention layer of the run's model on val batch
    0: the model as built from the run's config (initialisation) or from its checkpoint."""
    cfg = saved_config(run)
    prepared, data = build(cfg)
    if trained:
        prepared.load_state_dict(load_checkpoint(run)["run"])
    model = prepared.model
    hooked = [m for m in model.modules() if "attention_fn" in m.__dict__]
    got: list[list[Any]] = []

    def fn(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, **kw: Any) -> Tensor:
        entry: list[Any] = [q.detach(), k.detach(), v.detach(), None, kw.get("scale")]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=kw.get("scale"))
        y.register_hook(lambda g: entry.__setitem__(3, g.detach()))
        got.append(entry)
        return y

    for m in hooked:
        m.attention_fn = fn
    with prepared.compute():
        _, loss = model(*data.batch("val", 0))
    assert loss is not None
    loss.backward()
    for m in hooked:
        m.attention_fn = None
    return [tuple(e) for e in got]


def _acc(acc: dict[str, list[float]], key: str, got: Tensor, ref: Tensor) -> None:
    a = acc.setdefault(key, [0.0, 0.0])
    ref, got = ref.detach(), got.detach()
    a[0] += float((ref.double() ** 2).sum())
    a[1] += float(((got.double() - ref.double()) ** 2).sum())


def sqnr(layers: list[tuple[Tensor, ...]], grad_fmt: str) -> dict[str, dict[str, float | None]]:
    """Per scaling, pooled over ``layers``: each GEMM's and the end-to-end SQNR (dB), the
    gradients in ``grad_fmt``."""
    n = layers[0][0].shape[-2]
    causal = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    out: dict[str, dict[str, float | None]] = {}
    for scaling in ATTENTION_SCALINGS:
        acc: dict[str, list[float]] = {}
        for q, k, v, do, scale in layers:
            for name, (fp8, ref) in attention_gemms(q, k, v, do, causal, scale, scaling=scaling,
                                                    grad_fmt=grad_fmt).items():  # fmt: skip
                _acc(acc, name, fp8, ref)
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            y = fp8_attention(*ins, is_causal=True, scale=scale, scaling=scaling,
                              grad_fmt=grad_fmt)  # fmt: skip
            y.backward(do)
            ref_ins = [t.clone().requires_grad_() for t in (q, k, v)]
            r = F.scaled_dot_product_attention(*ref_ins, is_causal=True, scale=scale)
            r.backward(do)
            for key, got, want in zip(END_TO_END, [y, *(t.grad for t in ins)],
                                      [r, *(t.grad for t in ref_ins)], strict=True):  # fmt: skip
                assert got is not None and want is not None
                _acc(acc, key, got, want)
        out[scaling] = {k: (10 * math.log10(s / e) if e > 0 else None) for k, (s, e) in acc.items()}
    return out


def cost(layer: tuple[Tensor, ...], repeats: int) -> dict[str, Any]:
    """Forward + backward of one attention call on ``layer``'s inputs, per scaling and for
    FP32 SDPA: median ms over ``repeats`` (thread CPU time, one thread)."""
    q, k, v, do, scale = layer

    def call(scaling: str | None) -> Any:
        def run() -> None:
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            if scaling is None:
                y = F.scaled_dot_product_attention(*ins, is_causal=True, scale=scale)
            else:
                y = fp8_attention(*ins, is_causal=True, scale=scale, scaling=scaling)
            y.backward(do)

        return run

    calls = {"fp32 sdpa": call(None), **{s: call(s) for s in ATTENTION_SCALINGS}}
    torch.set_num_threads(1)
    t = time_many(calls, repeats=repeats, clock="thread")
    return {n: x.median_ms for n, x in t.items()} | {"shape": list(q.shape)}


# ---- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = arg_parser(__doc__, quick="tiny model, 6 steps, 1 seed, JSON in the temp dir")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--train-scalings", nargs="+", default=["tensorwise", "rowwise"],
                   choices=list(ATTENTION_SCALINGS))  # fmt: skip
    add_train_args(p, steps=300, batch_size=16, lr=1e-2, warmup=30, eval_batches=16,
                   budget=False)  # fmt: skip
    a = parse_args(p, argv, "fp8_attention_cpu")
    seeds = a.seeds[:1] if a.quick else a.seeds
    train_cfg = train_config(a)
    recipes = rows(a.train_scalings)
    root = Path(a.runs) if a.runs else Path(tempfile.mkdtemp(prefix="bench_fp8_attention_"))
    (root / "recipes").mkdir(parents=True, exist_ok=True)
    print(f"runs in {root}")
    t_start = time.perf_counter()
    files = {}
    for n, r in recipes.items():
        files[n] = root / "recipes" / f"{n.replace(' ', '_')}.json"
        files[n].write_text(json.dumps(r.to_dict(), indent=1) + "\n")
    pool = ThreadPoolExecutor(max(1, a.jobs))
    jobs = {}
    for s in seeds:
        for n in recipes:
            out = root / f"seed{s}" / n.replace(" ", "_")
            cmd = [*LOWPREC, "train", "--recipe", str(files[n]), "--seed", str(s),
                   "--out", str(out), "--no-progress"]  # fmt: skip
            for k, v in train_cfg.items():
                cmd += ["--" + k.replace("_", "-"), str(v)]
            out.parent.mkdir(parents=True, exist_ok=True)
            log = out.parent / f"{out.name}.log"
            jobs[n, s] = (cmd, out, pool.submit(run_cmd, cmd, log, out / "summary.json"))
    runs: dict[str, dict[str, dict[str, Any]]] = {n: {} for n in recipes}
    for (n, s), (cmd, out, fut) in jobs.items():
        rc, secs = fut.result()
        entry: dict[str, Any] = {"rc": rc, "wall_s": secs, "command": " ".join(cmd[1:])}
        try:
            recs = read_metrics(out)
            vals = [x["val_loss"] for x in recs if "val_loss" in x]
            done = len(recs) == train_cfg["steps"] and vals and math.isfinite(vals[-1])
            entry["val_loss"] = float(vals[-1]) if done else None
            summ = json.loads((out / "summary.json").read_text())
            entry["step_time_ms"] = summ.get("step_time_ms")
        except Exception as e:  # a failed run: no value, with the reason
            entry.update(val_loss=None, error=repr(e))
        runs[n][str(s)] = entry
    pool.shutdown()
    t_sqnr = time.perf_counter()
    sq: dict[str, dict[str, Any]] = {}
    for when, trained, grad_fmt in SQNR_CASES:
        per_seed = [sqnr(capture(root / f"seed{s}" / BASE, trained), grad_fmt) for s in seeds]
        sq[when] = {
            sc: {k: statistics.fmean(x[sc][k] for x in per_seed) for k in per_seed[0][sc]}
            for sc in ATTENTION_SCALINGS
        }
    sqnr_s = time.perf_counter() - t_sqnr
    timing = cost(capture(root / f"seed{seeds[0]}" / BASE, True)[0], 3 if a.quick else 9)

    def vals(n: str) -> list[float | None]:
        return [runs[n][str(s)]["val_loss"] for s in seeds]

    summary: dict[str, Any] = {}
    for n in recipes:
        v = vals(n)
        ok = [x for x in v if x is not None]
        times = [runs[n][str(s)].get("step_time_ms") for s in seeds]
        summary[n] = {
            "val_loss": v,
            "mean": statistics.fmean(ok) if ok else None,
            "sd": statistics.stdev(ok) if len(ok) > 1 else None,
            "gap_base": paired(v, vals(BASE)),
            "step_time_ms": statistics.fmean(t for t in times if t) if any(times) else None,
        }
    c = train_cfg
    pct = lambda x: None if x is None else 100 * x  # noqa: E731
    print_table(
        "FP8 attention: val loss per seed",
        ["row", *(f"seed {s}" for s in seeds), "mean", "sd", f"vs {BASE} %", "sd", "ms/step"],
        [[n, *sm["val_loss"], sm["mean"], sm["sd"], pct(sm["gap_base"]["mean"]),
          pct(sm["gap_base"]["sd"]), sm["step_time_ms"]] for n, sm in summary.items()],
        f"{c['steps']} steps, batch {c['batch_size']}x{c['seq_len']}, width {c['width']}, "
        f"depth {c['depth']}, heads {c['heads']}, lr {c['lr']}; gap: paired (same seed), in %",
    )  # fmt: skip
    for when, table in sq.items():
        print_table(
            f"SQNR (dB) against FP32 attention, {when} ({BASE} model, mean over seeds)",
            ["scaling", *ATTENTION_GEMMS, *END_TO_END],
            [[sc, *(d[k] for k in (*ATTENTION_GEMMS, *END_TO_END))] for sc, d in table.items()],
            "per GEMM: that GEMM alone on FP32 attention's operands; out, grad_q/k/v: end to end",
        )  # fmt: skip
    print_table(
        "cost: forward + backward of one attention call (ms, thread CPU time, one thread)",
        ["", *(k for k in timing if k != "shape")],
        [["median ms", *(v for k, v in timing.items() if k != "shape")]],
        f"q, k, v, dO of shape {timing['shape']} (batch, heads, tokens, head dim), causal",
    )
    total_s = time.perf_counter() - t_start
    print(f"total {total_s:.0f} s (SQNR {sqnr_s:.0f} s)")
    record = run_record(
        "fp8_attention", "cpu", lscpu=lscpu(), seeds=seeds, jobs=a.jobs, threads_per_job=1,
        train=train_cfg, rows={n: r.to_dict() for n, r in recipes.items()}, summary=summary,
        sqnr_db=sq, cost_ms=timing, runs=runs, total_s=total_s,
        argv=sys.argv[1:] if argv is None else argv,
    )  # fmt: skip
    print(f"JSON: {write_json(record, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
