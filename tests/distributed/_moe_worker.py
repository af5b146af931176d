"""Worker of ``test_moe_fsdp.py``: run under ``torch.distributed.run --nproc-per-node 2``.

``python -m torch.distributed.run --nproc-per-node 2 tests/distributed/_moe_worker.py
two OUT.json`` (the repository root on ``PYTHONPATH``; :func:`launch` runs it) trains
tiny HF MoE models (:func:`lowprec.jobs.hf_models.build_hf_model`: 8
experts of 3-D weights, top-2, 2 layers) under FSDP2 with
:func:`lowprec.distributed.parallel.prepare` (each rank on its half of the global batch)
for every (model, recipe) of :data:`CASES`; each rank also trains the one-process
reference (:func:`lowprec.recipes.prepare`, the whole batch) and computes the
one-process loss of its own half batch at the initial weights. The experts' all-gather
inputs are recorded (:func:`_record`) and the bytes on the wire counted
(:class:`CountingAllGather`), here and in a run that gathers in ``param_dtype``
(``fp8_all_gather=False``). A DCP checkpoint (:mod:`lowprec.distributed.checkpoint`) of
the fp8 runs is saved after 2 steps and resumed in a fresh ``prepare``. One launch for
all: a process start costs seconds. Rank 0 writes the results.

Stage ``uneven`` (3 processes): a tiny GPT-OSS (4 experts of transposed 3-D weights
``(E, in, out)`` with biases, clamped SwiGLU) sharded 2, 2, 0 experts over the ranks,
trained with the FP8 and the BF16 gather of the expert weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lowprec.distributed import checkpoint as dcp_state
from lowprec.distributed import fsdp_experts, shutdown
from lowprec.distributed.parallel import prepare as dist_prepare
from lowprec.float8 import Float8Experts, Float8Linear
from lowprec.jobs.data import CharData
from lowprec.jobs.hf_models import build_hf_model
from lowprec.jobs.model import ModelConfig
from lowprec.recipes import prepare
from lowprec.recipes.step import train_step
from tests import _moe
from tests._helpers import torchrun_json
from tests.distributed._gather import CountingAllGather

STEPS = 4
CASES: list[tuple[str, str]] = [
    ("qwen3moe", "fp8-tensorwise"),
    ("qwen3moe", "fp8-delayed"),
    ("qwen3moe", "bf16"),
    ("qwen3moe", "fp8-rowwise"),
    ("mixtral", "fp8-tensorwise"),
]
RESUME = ["fp8-tensorwise", "fp8-delayed"]
EXPERTS = 8
_DATA = CharData(32, 8, seed=0)
_GATHERS: list[dict[str, Any]] = []


def _record() -> None:
    """Record every expert weight's all-gather input (dtype, elements, scales)."""
    inner = fsdp_experts.pre_gather

    def pre_gather(*args: Any, **kwargs: Any) -> Any:
        inputs, meta = inner(*args, **kwargs)
        _GATHERS.append(
            {
                "dtype": str(inputs[0].dtype),
                "numel": inputs[0].numel(),
                "shape": list(args[0].shape),
                "scale": meta[1].tolist(),
            }
        )
        return inputs, meta

    fsdp_experts.pre_gather = pre_gather  # type: ignore[assignment]


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_hf_model(name, ModelConfig(65, 32, 2, 2, 32))


def _factory(ps: list[Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=3e-3)


def _half(s: int, parallel: bool) -> tuple[Tensor, Tensor]:
    x, y = _DATA.batch("train", s)
    if not parallel:
        return x, y
    r, w = dist.get_rank(), dist.get_world_size()
    n = x.shape[0] // w
    return x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]


def _train(p: Any, start: int, end: int, parallel: bool) -> tuple[list[float], list[float]]:
    """Per step: the global batch's loss (the mean of the ranks' equal halves) and this
    rank's own loss."""
    out, own = [], []
    for s in range(start, end):
        res = train_step(p, *_half(s, parallel), 3e-3, skip_nonfinite=True)
        loss = res.loss.detach().float().clone()
        own.append(float(loss))
        if parallel:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        out.append(float(loss))
    return out, own


def _counting(p: Any) -> None:
    for mod in p.model.modules():
        if hasattr(mod, "set_custom_all_gather"):
            mod.set_custom_all_gather(CountingAllGather())


def _ref_scales(name: str, recipe: str) -> dict[str, list[float]]:
    """One process's per-expert weight scales at the initial weights (the grouped GEMMs'
    tensor-wise weight cast of the model's weights in ``param_dtype``)."""
    q = prepare(_model(name), recipe, _factory)
    out = {}
    for n, m in q.model.named_modules():
        if isinstance(m, Float8Experts):
            cast = m.grouped_recipe.cast("weight")
            for w in fsdp_experts.expert_weight_names(m):
                a = m.get_parameter(w).detach().abs().amax(dim=(1, 2)).float()
                out[f"{n}.{w}"] = cast.scale_for(a).tolist()
    return out


def _case(name: str, recipe: str) -> dict[str, Any]:
    _GATHERS.clear()
    CountingAllGather.bytes = 0
    p = dist_prepare(_model(name), recipe, "fsdp", _factory)
    _counting(p)
    wrapped = sum(
        type(getattr(w, "_local_tensor", w)).__name__ == "Float8AllGatherWeight"
        for m in p.model.modules()
        if isinstance(m, Float8Experts)
        for w in m._parameters.values()
    )
    par, own = _train(p, 0, STEPS, True)
    gathers, fp8_bytes = list(_GATHERS), CountingAllGather.bytes
    hist = {k: v.tolist() for k, v in p.model.named_buffers() if "weight_amax_history" in k}
    ref_model = prepare(_model(name), recipe, _factory)
    ref, _ = _train(ref_model, 0, STEPS, False)
    ref_hist = {
        k: v.tolist() for k, v in ref_model.model.named_buffers() if "weight_amax_history" in k
    }
    x, y = _half(0, True)  # one process, this rank's half batch, the initial weights
    half = float(train_step(prepare(_model(name), recipe, _factory), x, y, 3e-3).loss)
    out = {
        "parallel": par,
        "reference": ref,
        "own_first": own[0],
        "half_first": half,
        "wrapped": wrapped,
        "gathers": gathers,
        "bytes": fp8_bytes,
        "experts_hist": {k: v[:STEPS] for k, v in hist.items() if "experts" in k},
        "ref_experts_hist": {k: v[:STEPS] for k, v in ref_hist.items() if "experts" in k},
    }
    if recipe.startswith("fp8") and wrapped:
        out["ref_scales"] = _ref_scales(name, recipe)
        CountingAllGather.bytes = 0  # the same run, gathered in param_dtype
        h = dist_prepare(_model(name), recipe, "fsdp", _factory, fp8_all_gather=False)
        _counting(h)
        out["hp_parallel"], _ = _train(h, 0, STEPS, True)
        out["hp_bytes"] = CountingAllGather.bytes
        out["linear_numel"] = sum(
            m.weight.numel() for m in h.model.modules() if isinstance(m, Float8Linear)
        )
    return out


def _resume(recipe: str, base: Path) -> dict[str, Any]:
    """2 steps, DCP save, 2 more (straight); a fresh ``prepare`` loads and redoes them."""
    p = dist_prepare(_model("qwen3moe"), recipe, "fsdp", _factory)
    _train(p, 0, 2, True)
    dcp_state.save(p, base / f"moe-{recipe}", {"step": 2})
    saved = {k: v.tolist() for k, v in p.model.named_buffers() if "amax" in k}
    straight, _ = _train(p, 2, STEPS, True)
    q = dist_prepare(_model("qwen3moe"), recipe, "fsdp", _factory)
    extra = dcp_state.load(q, base / f"moe-{recipe}")
    loaded = {k: v.tolist() for k, v in q.model.named_buffers() if "amax" in k}
    resumed, _ = _train(q, 2, STEPS, True)
    return {
        "step": extra["step"],
        "straight": straight,
        "resumed": resumed,
        "state_equal": saved == loaded,
        "experts_amax": sum("experts" in k for k in saved),
    }


def _uneven(recipe: str, fp8: bool) -> dict[str, Any]:
    p = dist_prepare(
        _moe.model("gpt_oss", routers=False), recipe, "fsdp", _factory, fp8_all_gather=fp8
    )
    local = [
        getattr(w, "_local_tensor", w)
        for m in p.model.modules()
        if isinstance(m, Float8Experts)
        for w in m._parameters.values()
        if w.dim() == 3
    ]
    losses = []
    for s in range(3):
        g = torch.Generator().manual_seed(10 * s + dist.get_rank())
        ids = torch.randint(0, 64, (2, 12), generator=g)
        with p.compute():
            loss = p.model(input_ids=ids, labels=ids).loss
        loss.backward()
        p.optimizer.step()
        p.optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "experts": [t.shape[0] for t in local],
        "wrapped": sum(type(t).__name__ == "Float8AllGatherWeight" for t in local),
    }


def main(path: str, stage: str = "two") -> None:
    dist.init_process_group("gloo")
    if stage == "uneven":
        out = {r: {"fp8": _uneven(r, True), "hp": _uneven(r, False)} for r in RESUME}
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, out)
        if dist.get_rank() == 0:
            Path(path).write_text(json.dumps(ranks))
        shutdown()
        return
    _record()
    result: dict[str, Any] = {}
    for name, recipe in CASES:
        r = _case(name, recipe)
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, {k: r.pop(k) for k in ("own_first", "half_first")})
        r["first"] = ranks
        result[f"{name}/{recipe}"] = r
    for recipe in RESUME:
        result[f"resume/{recipe}"] = _resume(recipe, Path(path).parent)
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(result))
    shutdown()


def _run(out: Path, n: int, stage: str) -> Any:
    return torchrun_json(Path(__file__), n, out / f"moe-{stage}.json", stage)


def launch(out: Path) -> dict[str, Any]:
    """Run the worker on 2 processes (gloo), then stage ``uneven`` on 3; rank 0's results
    of the first, every rank's of the second under ``"uneven"``."""
    result: dict[str, Any] = _run(out, 2, "two")
    result["uneven"] = _run(out, 3, "uneven")
    return result


if __name__ == "__main__":
    main(sys.argv[2], sys.argv[1])
