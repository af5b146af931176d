"""``Recipe``: a precision policy plus optional technique configs, serialisable to JSON.

Example:
    >>> from lowprec.float8 import Float8Config
    >>> from lowprec.unit import UnitConfig
    >>> r = Recipe("bf16-unit-rowwise", "unit-scaled, float8 rowwise linears",
    ...            Policy("bf16", master_weights=True),
    ...            (Float8Config.from_name("rowwise"), UnitConfig()))
    >>> r.kind, r.float8.name, r.compute_dtype
    ('unit+float8', 'rowwise', 'bf16')
    >>> Recipe.from_dict(r.to_dict()) == r
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from lowprec.core.registry import Registry
from lowprec.float8 import Float8Config
from lowprec.recipes import compose
from lowprec.recipes.compose import KINDS, TechniqueConfig
from lowprec.recipes.layers import LayerRule, rules_from_list, rules_to_list
from lowprec.recipes.policy import DType, LossScaling, Policy
from lowprec.recipes.serial import decode, encode
from lowprec.scalify import ScalifyConfig
from lowprec.unit import UnitConfig

__all__ = ["Recipe", "build_recipe", "get_recipe", "recipe_names", "register"]

_POLICY_KEYS = tuple(f.name for f in fields(Policy))
# Keys of the flat Recipe (lowprec 0.1, before composable recipes) not in today's dict.
_FLAT_KEYS = ("float8", "unit_fp8", "scalify_format", "options")
_FLAT_TECHNIQUES = ("mixed-precision", "float8", "unit", "scalify")


@dataclass(frozen=True)
class Recipe:
    """How a model is trained: ``policy`` + ``technique`` (validated on construction).

    Attributes:
        name, description: how the recipe is listed.
        policy: dtypes, master weights, loss scaling (:class:`Policy`).
        technique: ``None``, one of :class:`~lowprec.unit.UnitConfig`,
            :class:`~lowprec.float8.Float8Config`, :class:`~lowprec.scalify.ScalifyConfig`,
            or a tuple of them; stored as a tuple in application order. Which combinations
            are accepted, and why the others are refused: :mod:`lowprec.recipes.compose`.
        float8_skip: with a float8 config, linears whose last name component is listed
            stay in the policy's dtype (the output head by default).
        calibration_batches: with a float8 config that has static roles without a fixed
            scale, the number of training batches :func:`~lowprec.recipes.prepare`'s
            ``compute()`` calibrates on before the scales freeze (>= 1).
        layers: per-layer float8 configs (:class:`~lowprec.recipes.layers.LayerRule`: an
            fqn pattern and a config, or ``None`` for high precision; the first match
            wins, over ``float8_skip`` too); needs a float8 technique, whose config the
            layers no rule matches get. What ``lowprec tune`` writes.

    ``param_dtype``, ``master_weights``, ``loss_scaling``, ``loss_scale``,
    ``growth_interval``, ``autocast``, ``stochastic_rounding``, ``torch_dtype`` and
    ``compute_dtype`` read the policy's.
    """

    name: str
    description: str = ""
    policy: Policy = field(default_factory=Policy)
    technique: tuple[TechniqueConfig, ...] = ()
    float8_skip: tuple[str, ...] = ("head", "lm_head")
    calibration_batches: int = 4
    layers: tuple[LayerRule, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.description, str):
            raise TypeError(f"description must be a str, got {type(self.description).__name__}")
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a Policy, got {type(self.policy).__name__}")
        object.__setattr__(self, "technique", compose.normalize(self.technique))
        compose.check(self.policy, self.technique)
        skip = self.float8_skip
        if isinstance(skip, list):
            skip = tuple(skip)  # from JSON
        if not isinstance(skip, tuple) or not all(isinstance(s, str) for s in skip):
            raise TypeError(f"float8_skip must be a tuple of module names, got {skip!r}")
        object.__setattr__(self, "float8_skip", skip)
        n = self.calibration_batches
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"calibration_batches must be an int >= 1, got {n!r}")
        object.__setattr__(self, "layers", rules_from_list(self.layers))
        if self.layers and self.float8 is None:
            raise ValueError(
                "layers: per-layer float8 configs need a float8 technique (the config of "
                "the layers no rule matches); add a Float8Config to technique"
            )

    # ---- the techniques ----

    def _get(self, kind: str) -> Any:
        return next((c for c in self.technique if compose.kind_of(c) == kind), None)

    @property
    def float8(self) -> Float8Config | None:
        return self._get("float8")  # type: ignore[no-any-return]

    @property
    def unit(self) -> UnitConfig | None:
        return self._get("unit")  # type: ignore[no-any-return]

    @property
    def scalify(self) -> ScalifyConfig | None:
        return self._get("scalify")  # type: ignore[no-any-return]

    @property
    def kind(self) -> str:
        """``"mixed-precision"`` without a technique, else the techniques joined by ``+``."""
        return "+".join(compose.kind_of(c) for c in self.technique) or "mixed-precision"

    @property
    def needs_calibration(self) -> bool:
        """True if the float8 config has a static role without a fixed scale."""
        f8 = self.float8
        return f8 is not None and any(
            (c := f8.cast(role)).scaling == "static" and c.static_scale is None
            for role in ("input", "weight", "grad_output")
        )

    # ---- the policy, read through ----

    @property
    def param_dtype(self) -> DType:
        return self.policy.param_dtype

    @property
    def master_weights(self) -> bool:
        return self.policy.master_weights

    @property
    def loss_scaling(self) -> LossScaling:
        return self.policy.loss_scaling

    @property
    def loss_scale(self) -> float:
        return self.policy.loss_scale

    @property
    def growth_interval(self) -> int:
        return self.policy.growth_interval

    @property
    def autocast(self) -> DType | None:
        return self.policy.autocast

    @property
    def stochastic_rounding(self) -> bool:
        return self.policy.stochastic_rounding

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.policy.torch_dtype

    @property
    def compute_dtype(self) -> DType:
        return self.policy.compute_dtype

    # ---- serialisation ----

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: name, description, the policy's fields (flat), ``technique`` as a
        list of ``{"technique": kind, "config": fields}``, ``float8_skip``,
        ``calibration_batches`` and ``layers`` (:func:`~lowprec.recipes.layers.rules_to_list`)."""
        return {
            "name": self.name,
            "description": self.description,
            **asdict(self.policy),
            "technique": [
                {"technique": compose.kind_of(c), "config": encode(c)} for c in self.technique
            ],
            "float8_skip": list(self.float8_skip),
            "calibration_batches": self.calibration_batches,
            "layers": rules_to_list(self.layers),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        """Inverse of :meth:`to_dict`; also reads the flat dict of lowprec 0.1 recipes
        (``technique`` a string, ``float8`` a preset name, ``unit_fp8``, ``scalify_format``)."""
        if not isinstance(d, dict):
            raise TypeError(f"recipe dict must be a dict, got {type(d).__name__}")
        if isinstance(d.get("technique"), str) or any(k in d for k in _FLAT_KEYS):
            return _from_flat(d)
        known = {"name", "description", "technique", "float8_skip", "calibration_batches"}
        known.add("layers")
        unknown = set(d) - known - set(_POLICY_KEYS)
        if unknown:
            raise ValueError(f"recipe dict has unknown keys {sorted(unknown)}")
        techniques: list[TechniqueConfig] = []
        for i, t in enumerate(d.get("technique", [])):
            if not isinstance(t, dict) or t.get("technique") not in KINDS or "config" not in t:
                raise ValueError(
                    f"technique[{i}] must be {{'technique': one of {list(KINDS)}, 'config': "
                    f"{{...}}}}, got {t!r}"
                )
            techniques.append(decode(KINDS[t["technique"]], t["config"]))
        rest = {k: d[k] for k in ("float8_skip", "calibration_batches", "layers") if k in d}
        policy = Policy(**{k: d[k] for k in _POLICY_KEYS if k in d})
        return cls(d["name"], d.get("description", ""), policy, tuple(techniques), **rest)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> Recipe:
        """A preset (:func:`~lowprec.recipes.get_recipe`), with keyword ``overrides``."""
        return get_recipe(name, **overrides)


def _from_flat(d: dict[str, Any]) -> Recipe:
    """A recipe from the flat dict that lowprec 0.1 wrote into config.json and checkpoints."""
    keys = {"name", "description", "technique", "float8_skip", *_POLICY_KEYS, *_FLAT_KEYS}
    unknown = set(d) - keys
    if unknown:
        raise ValueError(f"recipe dict has unknown keys {sorted(unknown)}")
    tech = d.get("technique", "mixed-precision")
    if tech not in _FLAT_TECHNIQUES:
        raise ValueError(f"technique must be one of {list(_FLAT_TECHNIQUES)}, got {tech!r}")
    f8, unit_fp8, fmt = d.get("float8"), d.get("unit_fp8", False), d.get("scalify_format")
    if (tech == "float8") != (f8 is not None):
        raise ValueError("float8 (a preset name) is set exactly when technique='float8'")
    if unit_fp8 and tech != "unit":
        raise ValueError("unit_fp8 needs technique='unit'")
    if tech == "scalify" and fmt not in ("fp16", "fp8"):
        raise ValueError(
            f"scalify_format must be one of ['fp16', 'fp8'] with technique='scalify', got {fmt!r}"
        )
    if tech != "scalify" and fmt is not None:
        raise ValueError("scalify_format needs technique='scalify'")
    technique: tuple[TechniqueConfig, ...] = ()
    if tech == "float8":
        technique = (Float8Config.from_name(str(f8)),)
    elif tech == "unit":
        technique = (UnitConfig(float8=bool(unit_fp8)),)
    elif tech == "scalify":
        technique = (ScalifyConfig(data_format=str(fmt)),)
    policy = Policy(**{k: d[k] for k in _POLICY_KEYS if k in d})
    skip = tuple(d.get("float8_skip", ("head", "lm_head")))
    return Recipe(d["name"], d.get("description", ""), policy, technique, skip)


# ---- the named recipes (filled by lowprec.recipes.presets) ----------------------------


def build_recipe(name: str, description: str, **kwargs: Any) -> Recipe:
    """A :class:`Recipe` from a preset's keyword arguments (:class:`Policy` fields plus
    ``technique``, ``float8_skip``, ``calibration_batches``, ``layers``)."""
    policy = Policy(**{k: v for k, v in kwargs.items() if k in _POLICY_KEYS})
    rest = {k: v for k, v in kwargs.items() if k not in _POLICY_KEYS}
    return Recipe(name, description, policy, **rest)


_PRESETS: Registry[Recipe] = Registry("recipe", build_recipe)


def register(recipe: Recipe) -> Recipe:
    """Add ``recipe`` to the named recipes (``ValueError`` if the name is taken)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe, got {type(recipe).__name__}")
    kwargs = {f.name: getattr(recipe.policy, f.name) for f in fields(Policy)}
    kwargs.update(
        technique=recipe.technique,
        float8_skip=recipe.float8_skip,
        calibration_batches=recipe.calibration_batches,
        layers=recipe.layers,
    )
    _PRESETS.add(recipe.name, description=recipe.description, **kwargs)
    return recipe


def recipe_names() -> list[str]:
    """The registered names, in registration order."""
    return _PRESETS.names()


def get_recipe(name: str | Recipe, **overrides: Any) -> Recipe:
    """The recipe called ``name`` (a :class:`Recipe` is returned as it is), its keyword
    arguments replaced by ``overrides``; an unknown name raises ``ValueError`` listing the
    valid ones."""
    if isinstance(name, Recipe):
        if overrides:
            raise TypeError("get_recipe: overrides apply to a preset name, not to a Recipe")
        return name
    if not isinstance(name, str):
        raise TypeError(f"recipe name must be a str or Recipe, got {type(name).__name__}")
    if name not in _PRESETS:
        raise ValueError(f"recipe: unknown name {name!r}; valid: {', '.join(_PRESETS.names())}")
    return build_recipe(name, _PRESETS.description(name), **{**_PRESETS.kwargs(name), **overrides})
