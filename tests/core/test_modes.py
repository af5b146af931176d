"""``lowprec.core.modes.eager_frames``: a torch function mode under ``torch.compile`` when
a graph break inside a loop makes Dynamo run a frame eagerly.

Without the decorator, torch 2.13 compiles the mode's ``__torch_function__`` as a frame of
its own when that eager frame reads a tensor property, guarded without ``func``: every
later property read (``x.shape``, ``x.dtype``) returns the first one's value (``x.device``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lowprec.core.modes import eager_frames


class _Marked(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return func(*args, **(kwargs or {}))


class _Unmarked(TorchFunctionMode):  # the same handler, its own code object
    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return func(*args, **(kwargs or {}))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        y = self.lin(x)
        torch._dynamo.graph_break()  # inside the caller's loop: Dynamo skips that frame
        return x + y


class _Model(nn.Module):
    """An HF-like stack: embedding, positions from the input's size and device, layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, ids: Tensor) -> tuple[Tensor, Any, Any, Any]:
        x = self.emb(ids)
        pos = torch.arange(x.shape[1], device=x.device)  # in the frame Dynamo runs eagerly
        props = (x.device, x.shape, x.dtype)
        for layer in self.layers:
            x = layer(x)
        return (x + pos[:, None], *props)


class _Under(nn.Module):
    """Enters the mode in its forward, as a unit model does, around ``_Model``."""

    def __init__(self, mode_cls: type[TorchFunctionMode]) -> None:
        super().__init__()
        self.mode_cls, self.inner = mode_cls, _Model()

    def forward(self, x: Tensor) -> tuple[Tensor, Any, Any, Any]:
        with self.mode_cls():
            return self.inner(x)


def _run(mode_cls: type[TorchFunctionMode]) -> tuple[Tensor, Tensor, Any, Any, Any]:
    """(eager output, compiled output, and the device, shape and dtype read compiled)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Under(mode_cls)
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(1))
    return (model(ids)[0], *torch.compile(model, backend="eager")(ids))


def test_properties_under_a_marked_mode_are_eagers() -> None:
    eager, y, device, shape, dtype = _run(eager_frames(_Marked))
    assert device == torch.device("cpu") and shape == torch.Size([2, 5, 8])
    assert dtype == torch.float32 and torch.equal(y, eager)


def test_the_unmarked_mode_shows_the_torch_bug() -> None:
    """The failure the decorator avoids (if a torch release fixes it, this test says so:
    the decorator can then go)."""
    with pytest.raises(TypeError):  # arange(5, device=torch.Size) or the like
        _run(_Unmarked)


def test_bad_input_names_the_argument() -> None:
    with pytest.raises(TypeError, match="cls must be a TorchFunctionMode subclass"):
        eager_frames(nn.Module)  # type: ignore[type-var]
    with pytest.raises(TypeError, match="cls must be a TorchFunctionMode subclass"):
        eager_frames(3)  # type: ignore[type-var]

    class NoHandler(TorchFunctionMode):
        pass

    with pytest.raises(TypeError, match="does not define __torch_function__"):
        eager_frames(NoHandler)
