"""Recipes: named, serialisable descriptions of how a model is trained.

A :class:`Recipe` says which dtype holds the parameters and runs the compute, whether FP32
master weights carry the update, how the loss is scaled, whether torch autocast is used,
and which technique is applied. :func:`prepare` applies a recipe to any ``nn.Module`` and
returns what a training loop needs (:class:`Prepared`).

Adding a recipe takes one call::

    register(Recipe("fp16-ls-1024", "FP16, static loss scale 1024", param_dtype="fp16",
                    master_weights=True, loss_scaling="static", loss_scale=1024.0))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import torch
from torch import nn

from lowprec.amp import (
    DynamicLossScaler,
    LossScaler,
    MasterWeights,
    MatmulInFp32,
    NoLossScaler,
    StaticLossScaler,
    native_bf16_matmul,
)
from lowprec.float8 import Float8Recipe, convert_to_float8

__all__ = ["Prepared", "Recipe", "get_recipe", "prepare", "recipe_names", "register"]

DType = Literal["fp32", "bf16", "fp16"]
Technique = Literal["mixed-precision", "float8", "unit", "scalify"]
_TECHNIQUES = ("mixed-precision", "float8", "unit", "scalify")
_SCALIFY_FORMATS = ("fp16", "fp8")
_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class Recipe:
    """How a model is trained (see the module docstring). Validated on construction."""

    name: str
    description: str
    param_dtype: DType = "fp32"
    master_weights: bool = False
    loss_scaling: Literal["none", "static", "dynamic"] = "none"
    loss_scale: float = 2.0**16
    growth_interval: int = 2000
    autocast: DType | None = None
    stochastic_rounding: bool = False
    technique: Technique = "mixed-precision"
    float8: str | None = None
    float8_skip: tuple[str, ...] = ("head", "lm_head")
    unit_fp8: bool = False
    scalify_format: str | None = None
    options: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("name must be a non-empty string")
        if self.param_dtype not in _DTYPES:
            raise ValueError(
                f"param_dtype must be one of {list(_DTYPES)}, got {self.param_dtype!r}"
            )
        if self.autocast is not None and self.autocast not in _DTYPES:
            raise ValueError(f"autocast must be None or one of {list(_DTYPES)}")
        if self.autocast is not None and self.param_dtype != "fp32":
            raise ValueError("autocast needs fp32 parameters (param_dtype='fp32')")
        if self.loss_scaling not in ("none", "static", "dynamic"):
            raise ValueError(
                f"loss_scaling must be 'none', 'static' or 'dynamic', got {self.loss_scaling!r}"
            )
        if self.master_weights and self.param_dtype == "fp32":
            raise ValueError("master_weights only makes sense with bf16/fp16 parameters")
        if self.stochastic_rounding and not self.master_weights:
            raise ValueError("stochastic_rounding rounds the master-weight write-back")
        if self.technique not in _TECHNIQUES:
            raise ValueError(
                f"technique must be one of {list(_TECHNIQUES)}, got {self.technique!r}"
            )
        if self.float8 is not None:
            Float8Recipe.from_name(self.float8)  # ValueError listing the presets
        if (self.technique == "float8") != (self.float8 is not None):
            raise ValueError("float8 (a preset name) is set exactly when technique='float8'")
        if self.unit_fp8 and self.technique != "unit":
            raise ValueError("unit_fp8 needs technique='unit'")
        if self.technique == "scalify":
            if self.scalify_format not in _SCALIFY_FORMATS:
                raise ValueError(
                    f"scalify_format must be one of {list(_SCALIFY_FORMATS)} with "
                    f"technique='scalify', got {self.scalify_format!r}"
                )
            if self.param_dtype != "fp32" or self.loss_scaling != "none":
                raise ValueError(
                    "technique='scalify' keeps fp32 parameters (the scales carry the range) "
                    "and needs no loss scaling"
                )
        elif self.scalify_format is not None:
            raise ValueError("scalify_format needs technique='scalify'")
        if isinstance(self.float8_skip, list):
            object.__setattr__(self, "float8_skip", tuple(self.float8_skip))  # from JSON

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.param_dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"recipe dict has unknown keys {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_name(cls, name: str) -> Recipe:
        return get_recipe(name)


_REGISTRY: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    """Add ``recipe`` to the named recipes (``ValueError`` if the name is taken)."""
    if recipe.name in _REGISTRY:
        raise ValueError(f"a recipe named {recipe.name!r} is already registered")
    _REGISTRY[recipe.name] = recipe
    return recipe


def recipe_names() -> list[str]:
    return list(_REGISTRY)


def get_recipe(name: str | Recipe) -> Recipe:
    """The recipe called ``name``; an unknown name raises ``ValueError`` listing the valid ones."""
    if isinstance(name, Recipe):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"recipe: unknown name {name!r}; valid: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


register(Recipe("fp32", "FP32 everything: the reference"))
register(Recipe("bf16", "BF16 params and compute, FP32 master weights", "bf16", True))
register(
    Recipe(
        "fp16",
        "FP16 params and compute, FP32 master weights, no loss scaling",
        "fp16",
        True,
    )
)
register(
    Recipe(
        "fp16-static-ls",
        "FP16 as above with a static loss scale of 2^12",
        "fp16",
        True,
        loss_scaling="static",
        loss_scale=2.0**12,
    )
)
register(
    Recipe(
        "fp16-dynamic-ls",
        "FP16 as above with dynamic loss scaling (2^16, x0.5 on overflow, x2 per 200 steps)",
        "fp16",
        True,
        loss_scaling="dynamic",
        growth_interval=200,
    )
)
register(Recipe("amp-bf16", "FP32 params, torch.autocast to BF16 for compute", autocast="bf16"))
for _name, _what in (
    ("tensorwise", "dynamic per-tensor scales"),
    ("delayed", "delayed per-tensor scales (amax history of 16, max)"),
    ("rowwise", "dynamic per-row scales"),
):
    register(
        Recipe(
            f"fp8-{_name}",
            f"BF16 params (FP32 master weights), float8 linears with {_what}; E4M3 forward, "
            "E5M2 gradients; output head in BF16",
            "bf16",
            True,
            technique="float8",
            float8=_name,
        )
    )
register(
    Recipe(
        "mxfp8",
        "BF16 params (FP32 master weights), float8 linears with OCP MX scales (blocks of 32, "
        "E8M0); E4M3 forward, E5M2 gradients; output head in BF16",
        "bf16",
        True,
        technique="float8",
        float8="mxfp8",
    )
)
for _dt, _what in (
    ("fp32", "FP32 params and compute"),
    ("fp16", "FP16 params and compute (FP32 master weights), no loss scaling"),
    ("bf16", "BF16 params and compute (FP32 master weights), no loss scaling"),
):
    register(
        Recipe(
            f"{_dt}-unit",
            f"Unit-scaled model (lowprec.unit.unit_scale) with u-muP learning rates; {_what}",
            _dt,  # type: ignore[arg-type]
            _dt != "fp32",
            technique="unit",
        )
    )
register(
    Recipe(
        "fp8-unit",
        "Unit-scaled model with u-muP learning rates; every hidden matmul's inputs rounded "
        "to E4M3 in forward and its gradients to E5M2 in backward, with no per-tensor scales "
        "and no loss scaling; the readout matmul stays in BF16 (BF16 params, FP32 "
        "master weights)",
        "bf16",
        True,
        technique="unit",
        unit_fp8=True,
    )
)
register(
    Recipe(
        "fp16-scalify",
        "Scaled arithmetic (lowprec.scalify): FP16 data with FP32 scales propagated through "
        "every op of forward and backward; FP32 params; no unit scaling, no loss scaling",
        technique="scalify",
        scalify_format="fp16",
    )
)
register(
    Recipe(
        "fp8-scalify",
        "Scaled arithmetic: matmul inputs in FP8 (E4M3 forward, E5M2 backward) with "
        "propagated scales, FP16 data elsewhere; FP32 params; no loss scaling",
        technique="scalify",
        scalify_format="fp8",
    )
)


@dataclass
class Prepared:
    """What a training loop needs after :func:`prepare`.

    Use ``with prepared.compute(): loss = ...; prepared.scaler.scale(loss).backward()``, then
    ``prepared.scaler.step(prepared.optimizer)`` and ``prepared.scaler.update()``.
    """

    model: nn.Module
    optimizer: Any
    scaler: LossScaler
    recipe: Recipe

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Context for forward and backward: autocast and/or CPU FP16/BF16 matmul handling."""
        with contextlib.ExitStack() as stack:
            if self.recipe.autocast is not None:
                device = next(self.model.parameters()).device.type
                stack.enter_context(torch.autocast(device, dtype=_DTYPES[self.recipe.autocast]))
            dtype = self.recipe.param_dtype
            if _on_cpu(self.model) and (
                dtype == "fp16" or (dtype == "bf16" and not native_bf16_matmul())
            ):
                stack.enter_context(MatmulInFp32(_DTYPES[dtype]))  # type: ignore[no-untyped-call]
            yield

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe.to_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["recipe"]
        if saved != self.recipe.to_dict():
            raise ValueError(
                f"state: saved with recipe {saved.get('name')!r}, not {self.recipe.name!r}"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])


def _factory_lr(factory: OptimizerFactory) -> float:
    """The learning rate ``factory`` gives its optimizer (the base of u-μP's groups)."""
    probe = factory([nn.Parameter(torch.zeros(1))])
    return float(probe.param_groups[0]["lr"])


def _on_cpu(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu"


OptimizerFactory = Callable[[list[Any]], torch.optim.Optimizer]


def prepare(
    model: nn.Module,
    recipe: str | Recipe,
    optimizer_factory: OptimizerFactory | None = None,
    generator: torch.Generator | None = None,
) -> Prepared:
    """Apply ``recipe`` to ``model`` (in place: its parameters are cast) and build the
    optimizer (``optimizer_factory(params)``, default AdamW lr 1e-3) and the loss scaler.

    With ``float8`` set, every ``nn.Linear`` whose name (last component) is not in
    ``float8_skip`` becomes a :class:`~lowprec.float8.Float8Linear` with that preset.
    With technique ``"unit"`` the model is first made unit-scaled
    (:func:`lowprec.unit.unit_scale`, with FP8 matmul operands if ``unit_fp8``) and the
    optimizer gets u-μP parameter groups: each group's ``"lr_mult"`` times the factory's
    learning rate (a loop that schedules the lr sets ``group["lr"] = lr_now * lr_mult``).
    With technique ``"scalify"`` the model is wrapped by :func:`lowprec.scalify.scalify`
    (its state_dict keys gain the wrapper's prefix).
    With ``master_weights`` the optimizer is a :class:`MasterWeights` around the factory's
    optimizer on FP32 copies. ``generator`` drives stochastic rounding, if the recipe uses it.

    Example:
        >>> p = prepare(nn.Linear(8, 8), "bf16")
        >>> p.model.weight.dtype, type(p.optimizer).__name__, type(p.scaler).__name__
        (torch.bfloat16, 'MasterWeights', 'NoLossScaler')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    r = get_recipe(recipe)
    factory = optimizer_factory or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    params: list[Any] | None = None
    if r.technique == "unit":
        from lowprec.unit.recipe import apply_unit  # the techniques load on demand

        lr = _factory_lr(factory)
        model, params = apply_unit(model, float8=r.unit_fp8, lr=lr)
    elif r.technique == "scalify":
        from lowprec.scalify.recipe import apply_scalify

        assert r.scalify_format is not None
        model = apply_scalify(model, data_format=r.scalify_format)
    model.to(r.torch_dtype)
    if r.float8 is not None:
        skip = r.float8_skip
        convert_to_float8(model, r.float8, lambda m, fqn: fqn.rsplit(".", 1)[-1] not in skip)
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    optimizer: Any
    if r.master_weights:
        optimizer = MasterWeights(params, factory, r.stochastic_rounding, generator)
    else:
        optimizer = factory(params)
    scaler: LossScaler
    if r.loss_scaling == "static":
        scaler = StaticLossScaler(r.loss_scale)
    elif r.loss_scaling == "dynamic":
        scaler = DynamicLossScaler(r.loss_scale, growth_interval=r.growth_interval)
    else:
        scaler = NoLossScaler()
    return Prepared(model, optimizer, scaler, r)
