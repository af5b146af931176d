"""The fx side of :func:`~lowprec.unit.transform.unit_scale`: the ``GraphModule`` of each
module ``torch.fx`` traced (:mod:`lowprec.unit.residual_fx` finds their residual adds).

:func:`_apply_fx` rewrites each residual add into ``residual_split`` + ``residual_add`` and
each sum of embedding lookups into a unit ``add``, and puts the ``GraphModule`` in its
module's place; :func:`_set_fx_taus` sets the adds' τ once their number is known (and
recompiles). A ``GraphModule`` keeps the call signature of the module it was traced from
(:func:`_keep_signature`, :func:`_graph_forward`): fx's generated ``forward`` orders its
parameters differently where there are positional-only, keyword-only, ``*args`` or
``**kwargs`` ones.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any, cast

from torch import fx, nn

from lowprec.unit.residual_fx import rewrite_embedding_sums, rewrite_residual


def _generated_forward(gm: fx.GraphModule) -> Callable[..., Any]:
    """The forward fx generated for ``gm``'s graph (its class's; recompiling replaces it)."""
    for c in type(gm).__mro__:
        if not c.__dict__.get("_unit_wrapper") and "forward" in c.__dict__:
            return cast(Callable[..., Any], c.__dict__["forward"])
    raise AssertionError("unreachable: a GraphModule class has a generated forward")


def _graph_forward(gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """Call ``gm``'s generated forward with the signature of the module it was traced from.

    fx's generated ``forward`` lists the parameters in the traced code's order, keyword-only
    ones moved before ``*args`` and none positional-only (``(a, /, b, *args, c, **kw)``
    becomes ``(a, b, c, *args, **kw)``): a call in the original form would bind its inputs
    to other parameters. The inputs are bound to the original signature and passed on in
    the generated one's order."""
    fwd = _generated_forward(gm)
    sig = gm.__dict__.get("_unit_signature")
    if sig is None:
        return fwd(gm, *args, **kwargs)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    pos, var, varkw = [], (), {}
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            var = a.get(p.name, ())
        elif p.kind is p.VAR_KEYWORD:
            varkw = a.get(p.name, {})
        else:
            pos.append(a[p.name])
    return fwd(gm, *pos, *var, **varkw)


def _keep_signature(gm: fx.GraphModule, original: Callable[..., Any], root: bool) -> None:
    """Make ``gm`` (traced from a module whose bound forward is ``original``) take its
    inputs as ``original`` does (:func:`_graph_forward`), where fx's generated signature
    differs: positional-only, keyword-only, ``*args`` or ``**kwargs`` parameters. A root
    is called through the unit model's forward; a child gets an instance ``forward``."""
    try:
        sig = inspect.signature(original)
    except (TypeError, ValueError):
        return
    if all(p.kind is p.POSITIONAL_OR_KEYWORD for p in sig.parameters.values()):
        return
    gm.__dict__["_unit_signature"] = sig
    if not root:
        gm.forward = types.MethodType(_graph_forward, gm)  # type: ignore[method-assign]


def _apply_fx(
    model: nn.Module, found: list[tuple[str, nn.Module, fx.Graph, list[Any]]]
) -> tuple[nn.Module, list[tuple[str, str, str, str]], list[str]]:
    """Rewrite the residual adds fx found (τ set later by :func:`_set_fx_taus`) and its
    embedding sums; returns the model (a new root if the root was traced), for each
    residual add ``(label, module name, split node name, add node name)`` (names, not
    nodes: they survive a deep copy), and the embedding sums' labels."""
    adds: list[tuple[str, str, str, str]] = []
    sums: list[str] = []
    for name, m, graph, res in found:
        for add, skip, out in res:
            split = rewrite_residual(graph, add, skip, out, 0.5)
            adds.append((f"{name or '<root>'}.{add.name}", name, split.name, add.name))
        sums += [f"{name or '<root>'}.{n} (embed_sum)" for n in rewrite_embedding_sums(m, graph)]
    for name, m, graph, _ in reversed(found):  # deepest first: parents copy rewritten children
        gm = fx.GraphModule(m, graph, class_name=type(m).__name__)
        _keep_signature(gm, m.forward, root=not name)
        if not name:
            model = gm
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, gm)
    return model, adds, sums


def _set_fx_taus(
    model: nn.Module, adds: list[tuple[str, str, str, str]], taus: list[float]
) -> list[str]:
    """Set each fx residual add's τ (and its split's), recompiling the modules changed."""
    names, dirty = [], {}
    for (label, mname, split_name, add_name), t in zip(adds, taus, strict=True):
        gm = cast(fx.GraphModule, model.get_submodule(mname))
        nodes = {n.name: n for n in gm.graph.nodes}
        split, add = nodes[split_name], nodes[add_name]
        if split.args[1] != t or add.args[2] != t:
            split.args = (split.args[0], t)
            add.args = (add.args[0], add.args[1], t)
            dirty[id(gm)] = gm
        names.append(f"{label} (tau={t:.4g})")
    for gm in dirty.values():
        cls = type(gm)
        if cls.__dict__.get("_unit_wrapper"):  # the unit root: recompile into its fx class
            gm.__class__ = cls.__bases__[0]
            try:
                gm.recompile()
            finally:
                gm.__class__ = cls
        else:
            gm.recompile()
    return names
