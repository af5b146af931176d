"""float8 on HF transformers' linear-like layers: ``Conv1D`` (GPT-2), and the one warning
that names every linear-like layer left unconverted."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from lowprec.float8 import Float8Linear, convert_back, convert_to_float8
from lowprec.float8.conv1d import Float8Conv1D, is_conv1d

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


def _pair(nx: int, nf: int) -> tuple[nn.Module, nn.Linear]:
    """A Conv1D and the nn.Linear computing the same ``x W + b`` (weight transposed)."""
    torch.manual_seed(0)
    c = Conv1D(nf, nx)
    nn.init.normal_(c.bias)
    lin = nn.Linear(nx, nf)
    with torch.no_grad():
        lin.weight.copy_(c.weight.t())
        lin.bias.copy_(c.bias)
    return c, lin


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "mxfp8"])
def test_conv1d_equals_the_equivalent_linear(recipe: str) -> None:
    """Bit-identical forward, dx, dW (transposed) and db: the GEMMs read the same operands
    (the (out, in) view of the stored weight), so no tolerance is needed."""
    c, lin = _pair(64, 48)
    fc = convert_to_float8(c, recipe)
    fl = convert_to_float8(lin, recipe)
    assert isinstance(fc, Float8Conv1D) and fc.weight is c.weight
    assert fc.weight.shape == (64, 48)
    for step in range(2):  # the second step uses the delayed histories of the first
        x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(step))
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = fc(xa), fl(xb)
        assert torch.equal(ya, yb)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        assert xa.grad is not None and xb.grad is not None
        assert torch.equal(xa.grad, xb.grad)
    assert fc.weight.grad is not None and fl.weight.grad is not None
    assert torch.equal(fc.weight.grad, fl.weight.grad.t())
    assert fc.bias is not None and fc.bias.grad is not None and fl.bias.grad is not None
    assert torch.equal(fc.bias.grad, fl.bias.grad)
    for k, v in fl.state_dict().items():
        if "amax" in k:
            assert torch.equal(fc.state_dict()[k], v), k


def _gpt2(n_layer: int = 2) -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=n_layer,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def test_gpt2_every_conv1d_converted_checkpoint_keys_unchanged() -> None:
    """GPT-2: 4 Conv1D per block (c_attn, c_proj, mlp.c_fc, mlp.c_proj) plus lm_head; the
    state_dict keeps its keys and shapes, so the original checkpoint loads strictly."""
    model = _gpt2().eval()  # no dropout: the outputs are compared
    ref = copy.deepcopy(model)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    convert_to_float8(model, "delayed")
    assert sum(isinstance(m, Float8Conv1D) for m in model.modules()) == 4 * 2
    assert sum(type(m) is Float8Linear for m in model.modules()) == 1  # lm_head
    got = {k: v.shape for k, v in model.state_dict().items() if "amax" not in k}
    assert got == shapes
    model.load_state_dict(ref.state_dict(), strict=True)  # a plain HF checkpoint loads
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(idx, labels=idx).loss
    loss.backward()
    assert torch.isfinite(loss)
    # E4M3 operands in every GEMM: the loss of a random-init model moves by well under 1%
    ref_loss = ref(idx, labels=idx).loss
    assert abs(float(loss.detach()) / float(ref_loss) - 1) < 0.01
    back = convert_back(model)
    assert sum(type(m) is Conv1D for m in back.modules()) == 4 * 2
    assert not any(isinstance(m, Float8Linear) for m in back.modules())
    torch.testing.assert_close(back(idx).logits, ref(idx).logits, rtol=0, atol=0)


def test_is_conv1d_duck_typing() -> None:
    assert is_conv1d(Conv1D(8, 4))

    class Conv1D_(nn.Module):  # another name: not recognised
        pass

    odd = Conv1D(8, 4)
    odd.nf = 5  # inconsistent layout: not treated as a Conv1D
    assert not is_conv1d(odd) and not is_conv1d(Conv1D_()) and not is_conv1d(nn.Linear(4, 8))


def test_one_warning_names_every_skipped_layer(caplog: pytest.LogCaptureFixture) -> None:
    class Doubled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    class QuantLinear(nn.Module):  # another library's linear: not handled, named
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.t()

    m = nn.Sequential(nn.Linear(8, 8), Doubled(8, 8), QuantLinear(), Conv1D(8, 8), nn.Linear(8, 8))
    with caplog.at_level(logging.INFO, logger="lowprec.float8.convert"):
        convert_to_float8(m, "tensorwise", module_filter=lambda mod, fqn: fqn != "4")
    recs = [r for r in caplog.records if r.name == "lowprec.float8.convert"]
    # one WARNING for the layers left against the caller's wish; the module_filter's
    # exclusion was asked for: one INFO line
    assert [r.levelno for r in recs] == [logging.INFO, logging.WARNING]
    info, warn = (r.getMessage() for r in recs)
    assert "1 linear-like layer(s)" in info and "4 (Linear: module_filter" in info
    assert "2 linear-like layer(s)" in warn
    assert "1 (Doubled" in warn and "2 (QuantLinear" in warn and "module_filter" not in warn
    assert [type(c).__name__ for c in m] == [
        "Float8Linear",
        "Doubled",
        "QuantLinear",
        "Float8Conv1D",
        "Linear",
    ]


def test_linear_subclass_computing_f_linear_is_converted(caplog: pytest.LogCaptureFixture) -> None:
    """Falcon's ``FalconLinear`` (``x @ W.T + b`` in its own forward) computes ``F.linear``:
    converted (the same GEMMs as a plain ``nn.Linear``'s float8 layer: bit-identical), and
    ``convert_back`` returns the original module. A subclass with state of its own (a
    LoRA-like adapter, zero at init so its output equals ``F.linear`` there) is refused and
    named: its forward would be lost."""
    from transformers.models.falcon.modeling_falcon import FalconLinear

    class Lora(nn.Linear):
        def __init__(self, n: int) -> None:
            super().__init__(n, n)
            self.a = nn.Parameter(torch.randn(2, n))
            self.b = nn.Parameter(torch.zeros(n, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + x @ self.a.t() @ self.b.t()

    torch.manual_seed(0)
    fl, lora = FalconLinear(16, 8), Lora(8)
    plain = nn.Linear(16, 8)
    with torch.no_grad():
        plain.weight.copy_(fl.weight)
        plain.bias.copy_(fl.bias)
    m = nn.Sequential(fl, nn.ReLU(), lora)
    with caplog.at_level(logging.WARNING, logger="lowprec.float8.convert"):
        convert_to_float8(m, "tensorwise")
    assert isinstance(m[0], Float8Linear) and m[0].weight is fl.weight
    assert type(m[2]) is Lora
    msg = " ".join(r.getMessage() for r in caplog.records if r.name == "lowprec.float8.convert")
    assert "2 (Lora: nn.Linear subclass, own forward)" in msg and "FalconLinear" not in msg
    x = torch.randn(4, 16)
    ref = convert_to_float8(plain, "tensorwise")
    assert torch.equal(m[0](x), ref(x))
    convert_back(m)
    assert m[0] is fl


class _RawMatmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.w)


@pytest.mark.parametrize("make", [_RawMatmul, lambda: nn.LSTM(8, 8)])
def test_a_model_with_nothing_to_convert_is_warned_of(
    caplog: pytest.LogCaptureFixture, make: object
) -> None:
    """A model with no layer float8 converts (a matmul of a raw parameter, an RNN) trained
    under an FP8 recipe name in high precision without a word (trial T); now one WARNING.
    A model whose every layer is converted, or whose layers the caller's filter excluded,
    gets none."""
    with caplog.at_level(logging.WARNING, logger="lowprec.float8"):
        convert_to_float8(make())  # type: ignore[operator]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "nothing runs in FP8" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowprec.float8"):
        convert_to_float8(nn.Sequential(nn.Linear(8, 8)))
        convert_to_float8(nn.Sequential(nn.Linear(8, 8)), module_filter=lambda m, f: False)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
