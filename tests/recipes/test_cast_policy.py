"""What a recipe's FP16/BF16 cast leaves in FP32 for any model, not only lowprec's own
(found by a new user's trial against ``torch.autocast``): softmax, the normalisations and
the loss run in FP32 inside ``compute()`` (``lowprec.amp.SensitiveInFp32``), and BatchNorm
keeps FP32 running statistics.

Oracles: the same model in FP64 (loss), torch's FP32 BatchNorm on the same (FP16-rounded)
inputs (running statistics), ``torch.autocast`` (the op dtypes)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import lowprec
from lowprec.amp import SensitiveInFp32

V, D = 50, 32


class _TinyLM(nn.Module):
    """A user's model: LayerNorm, a softmax of its own, GroupNorm; the loss outside."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln = nn.Embedding(V, D), nn.LayerNorm(D)
        self.qk, self.gn, self.head = nn.Linear(D, D), nn.GroupNorm(4, D), nn.Linear(D, V)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.ln(self.emb(ids))
        att = torch.softmax(self.qk(h) @ h.transpose(-2, -1) / D**0.5, dim=-1)
        h = h + self.gn((att @ h).transpose(1, 2)).transpose(1, 2)
        return self.head(h)


class _OpDtypes(TorchDispatchMode):
    """The dtypes the aten softmax, norm and loss kernels see."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        if name in ("_softmax", "native_layer_norm", "native_group_norm", "_log_softmax"):
            self.seen.setdefault(name, set()).add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("recipe", "bound"), [("fp16", 8e-4), ("bf16", 6e-3)])
def test_softmax_norms_and_loss_in_fp32(recipe: str, bound: float) -> None:
    """The per-token losses of a user's model under ``prepare(recipe)`` and ``compute()``,
    against FP64: rms error measured 5.5e-4 (fp16) and 4.4e-3 (bf16) with the FP32 ops
    (the matmuls' rounding is left), 1.2e-3 and 9.6e-3 when LayerNorm, GroupNorm, softmax
    and the loss ran in FP16/BF16. The kernels see FP32, and the loss comes back in FP32
    (as under autocast)."""
    torch.manual_seed(0)
    base = _TinyLM()
    g = torch.Generator().manual_seed(1)
    ids, tgt = torch.randint(0, V, (4, 16), generator=g), torch.randint(0, V, (4, 16), generator=g)
    with torch.no_grad():
        ref = F.cross_entropy(
            copy.deepcopy(base).double()(ids).reshape(-1, V), tgt.reshape(-1), reduction="none"
        )
    run = lowprec.prepare(copy.deepcopy(base), recipe)
    ops = _OpDtypes()
    with run.compute(), ops:
        logits = run.model(ids)
        losses = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), reduction="none")
    assert logits.dtype == run.recipe.torch_dtype and losses.dtype == torch.float32
    assert ops.seen and all(s == {torch.float32} for s in ops.seen.values()), ops.seen
    assert float((losses.detach().double() - ref).square().mean().sqrt()) < bound
    losses.mean().backward()  # through the FP32 ops: gradients in the parameters' dtype
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in run.model.parameters())


def test_sensitive_ops_mode_rounds_once_and_leaves_others() -> None:
    """Each op against the same op on the exactly upcast inputs, rounded once to FP16 (the
    losses not rounded); FP32 inputs, tensor subclasses and non-sensitive ops untouched."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 8, generator=g) * 4).half()
    w, b = torch.randn(8, generator=g).half(), torch.randn(8, generator=g).half()
    t = torch.randint(0, 8, (6,), generator=g)
    cases = [
        (lambda a, w, b: torch.softmax(a, -1), True),
        (lambda a, w, b: a.log_softmax(-1), True),
        (lambda a, w, b: F.layer_norm(a, (8,), w, b), True),
        (lambda a, w, b: F.rms_norm(a, (8,), w), True),
        (lambda a, w, b: F.group_norm(a, 2, w, b), True),
        (lambda a, w, b: F.cross_entropy(a, t), False),
        (lambda a, w, b: F.mse_loss(a, a.flip(0)), False),
    ]
    for fn, keep in cases:
        with SensitiveInFp32():
            got = fn(x, w, b)
        want = fn(x.float(), w.float(), b.float())
        assert got.dtype == (torch.float16 if keep else torch.float32)
        assert torch.equal(got, want.half() if keep else want)
    with SensitiveInFp32():
        assert F.gelu(x).dtype == torch.float16 and torch.equal(F.gelu(x), F.gelu(x))
        xf = x.float()
        assert torch.equal(torch.softmax(xf, -1), torch.softmax(xf, -1))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast decides
            inside = F.layer_norm(x, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outside = F.layer_norm(x, (8,))
    assert inside.dtype == outside.dtype and torch.equal(inside, outside)


def test_batchnorm_keeps_fp32_running_statistics() -> None:
    """A channel of std 300 over 200 batches: ``running_var`` ~9e4 overflows FP16 (it read
    inf) and BF16 stops moving it (2.5% off); with the BatchNorm left in FP32 the running
    statistics equal FP32 BatchNorm's on the same FP16-rounded inputs (to FP32 rounding),
    and the prepared model's eval output stays finite and close to that reference."""
    for recipe in ("fp16", "bf16"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 2))
        ref_bn = copy.deepcopy(model[0])
        run = lowprec.prepare(model, recipe)
        bn = run.model[0]
        assert all(
            t.dtype == torch.float32
            for t in (*bn.parameters(), *bn.buffers())
            if t.is_floating_point()
        )
        g = torch.Generator().manual_seed(1)
        scale = torch.tensor([1.0, 300.0, 1e-3])
        for _ in range(200):
            x = torch.randn(16, 3, generator=g) * scale - 50.0
            with run.compute():
                run.model(x)
            ref_bn(x.to(run.recipe.torch_dtype).float())
        torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=1e-5, atol=1e-9)
        run.model.eval()
        with run.compute():
            out = run.model(torch.randn(4, 3, generator=g) * scale)
        assert torch.isfinite(out).all()
