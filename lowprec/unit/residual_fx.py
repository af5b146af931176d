"""Residual adds found with ``torch.fx``, module by module (children kept as leaves).

An ``add(a, b)`` in a module's traced graph where ``a`` is an ancestor of ``b``
(``b = f(a)``) is a residual. It becomes ``residual_split`` at the branch point and
``residual_add`` with the branch's ``τ``. An add of two embedding lookups (an
``nn.Embedding`` child or ``F.embedding``, or sums of them: token + position embeddings)
is an *embedding sum*: ``n`` lookups summed become the weighted unit ``add``, unit variance
(as :mod:`lowprec.unit.residual_run` weights it). A module that cannot be traced (a Python ``if``
on a tensor, a cache object, ...) is returned with fx's own message, for
:mod:`lowprec.unit.residual_run` to analyse by running it.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from lowprec.unit import functional as U

__all__ = ["find_residual_modules", "rewrite_embedding_sums", "rewrite_residual"]

_ADDS = {operator.add, torch.add, operator.iadd}
_SKIP = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Conv1d, nn.ModuleList,
         nn.ModuleDict)  # fmt: skip


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _is_add(n: fx.Node) -> bool:
    """A plain two-operand add node."""
    is_add = (n.op == "call_function" and n.target in _ADDS) or (
        n.op == "call_method" and n.target in ("add", "__add__")
    )
    return is_add and len(n.args) == 2 and not n.kwargs


def _embedding_sums(m: nn.Module, graph: fx.Graph) -> list[tuple[fx.Node, int, int]]:
    """``(add, n_a, n_b)`` of every embedding sum in ``graph`` (module ``m``'s), in order:
    the add of ``n_a`` and ``n_b`` embedding lookups."""
    lookups: dict[fx.Node, int] = {}
    found = []
    for n in graph.nodes:
        if n.op == "call_module" and isinstance(m.get_submodule(str(n.target)), nn.Embedding):
            lookups[n] = 1
        elif n.op == "call_function" and n.target is F.embedding:
            lookups[n] = 1
        elif _is_add(n) and all(isinstance(a, fx.Node) and a in lookups for a in n.args):
            a, b = (_node(x) for x in n.args)
            found.append((n, lookups[a], lookups[b]))
            lookups[n] = lookups[a] + lookups[b]
    return found


def _node(x: Any) -> fx.Node:
    """``x``, an fx node (for the type checker)."""
    assert isinstance(x, fx.Node)
    return x


def rewrite_embedding_sums(m: nn.Module, graph: fx.Graph) -> list[str]:
    """Make every embedding sum of ``graph`` a weighted unit ``add`` (see the module doc);
    returns the add nodes' names."""
    names = []
    for add, na, nb in _embedding_sums(m, graph):
        add.target, add.op = U.add, "call_function"
        add.args = (add.args[0], add.args[1], (math.sqrt(na), math.sqrt(nb)))
        names.append(add.name)
    return names


def _find_residuals(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """``(add, skip, branch_out)`` of every residual add in ``graph``, in order."""
    found = []
    for n in graph.nodes:
        if not _is_add(n):
            continue
        a, b = n.args
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            continue
        if a in _ancestors(b):
            found.append((n, a, b))
        elif b in _ancestors(a):
            found.append((n, b, a))
    return found


def rewrite_residual(
    graph: fx.Graph, add: fx.Node, skip: fx.Node, out: fx.Node, tau: float
) -> fx.Node:
    """Rewrite one residual ``add`` of ``graph`` in place (see the module doc); returns the
    ``residual_split`` node (its ``τ``, like the add's, can be changed before compiling)."""
    branch = _ancestors(out) | {out}
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((u for u in skip.users if u in branch), key=order.__getitem__)
    with graph.inserting_before(first):
        split = graph.call_function(U.residual_split, (skip, tau))
        res_in = graph.call_function(operator.getitem, (split, 0))
        skip_out = graph.call_function(operator.getitem, (split, 1))
    for user in list(skip.users):
        if user in branch:
            user.replace_input_with(skip, res_in)
    add.target, add.op = U.residual_add, "call_function"
    add.args, add.kwargs = (out, skip_out, tau), {}
    return split


def _cause(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else "(no message)"
    return f"{type(e).__name__}: {text[:200]}"


def find_residual_modules(
    model: nn.Module,
) -> tuple[list[tuple[str, nn.Module, fx.Graph, list[Any]]], list[tuple[str, str]]]:
    """``(found, untraced)``: ``(name, module, graph, residuals)`` of each traced module
    with residual adds or embedding sums, and ``(name, "Class: fx's message")`` of each
    untraceable one."""
    found, untraced = [], []
    for name, m in model.named_modules():
        if isinstance(m, _SKIP) or not list(m.children()):
            continue
        try:
            graph = _LeafTracer().trace(m)
        except Exception as e:
            untraced.append((name or "<root>", f"{type(m).__name__}: {_cause(e)}"))
            continue
        res = _find_residuals(graph)
        if res or _embedding_sums(m, graph):
            found.append((name, m, graph, res))
    return found, untraced
