"""lowprec in Lightning: ``Trainer(plugins=[LowprecPrecision(recipe)])`` trains a
LightningModule and resumes exactly from a Lightning checkpoint; Fabric's plugin trains."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
L = pytest.importorskip("lightning")

from torch.utils.data import DataLoader  # noqa: E402

from lowprec.amp import MasterWeights  # noqa: E402
from lowprec.integrations.lightning import LowprecFabricPrecision, LowprecPrecision  # noqa: E402
from tests.integrations._tiny import Tokens, tiny_gpt2, tiny_llama  # noqa: E402


class LM(L.LightningModule):  # type: ignore[misc]
    """A tiny Llama (or GPT-2) as a LightningModule, with a StepLR schedule; records its
    losses."""

    def __init__(self, seed: int = 0, arch: str = "llama") -> None:
        super().__init__()
        self.net = tiny_llama(seed) if arch == "llama" else tiny_gpt2(seed)
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], idx: int) -> torch.Tensor:
        loss = self.net(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


def _loader() -> DataLoader[Any]:
    return DataLoader(Tokens(16), batch_size=4, shuffle=False)  # 4 steps per epoch


def _trainer(root: Path, recipe: str, **kw: Any) -> Any:
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1)
    base: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "gradient_clip_val": 1.0,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(root),
        "callbacks": [ckpt],
    }
    return L.Trainer(plugins=[LowprecPrecision(recipe)], **{**base, **kw})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "arch"),
    # gpt2: dropout (the plugin restores torch's RNG), tied head, Conv1D; scalify: a new module
    [("fp8-delayed", "llama"), ("fp16-dynamic-ls", "llama"), ("bf16-unit", "llama"),
     ("fp16-scalify", "gpt2")],
)  # fmt: skip
def test_trains_and_resumes_exactly_from_a_lightning_checkpoint(
    tmp_path: Path, recipe: str, arch: str
) -> None:
    a_mod = LM(arch=arch)
    a = _trainer(tmp_path / "a", recipe)
    a.fit(a_mod, _loader())
    plugin = a.precision_plugin
    assert isinstance(plugin, LowprecPrecision)
    assert len(a_mod.losses) == 8 and all(math.isfinite(x) for x in a_mod.losses)
    if recipe != "fp16-scalify":  # scalify keeps FP32 parameters: no masters
        assert isinstance(a.optimizers[0], MasterWeights), "the recipe's FP32 masters"
    else:
        assert type(a_mod.net).__name__ == "Scalified", "the child replaced by the wrapper"
    assert len(plugin.prepared.scaler.history) == 8
    if recipe == "fp8-delayed":
        assert type(a_mod.net.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    if recipe == "bf16-unit":
        assert type(a_mod.net).__name__.startswith("Unit")
        assert len({g["lr_mult"] for g in a.optimizers[0].param_groups}) > 1, "u-muP groups"
    # Resume a fresh module (other initial weights) from the end of the first epoch.
    b_mod = LM(seed=1, arch=arch)
    b = _trainer(tmp_path / "b", recipe)
    b.fit(b_mod, _loader(), ckpt_path=str(tmp_path / "a" / "ckpt" / "epoch=0-step=4.ckpt"))
    assert b_mod.losses == a_mod.losses[4:], "the resumed steps are bit-identical"
    sa, sb = a_mod.state_dict(), b_mod.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert (
        b.lr_scheduler_configs[0].scheduler.get_last_lr()
        == a.lr_scheduler_configs[0].scheduler.get_last_lr()
    )


@pytest.mark.slow
def test_fabric_plugin_trains_with_loss_scaling_and_masters() -> None:
    fabric = L.Fabric(
        accelerator="cpu", devices=1, plugins=[LowprecFabricPrecision("fp16-dynamic-ls")]
    )
    model = fabric.setup_module(tiny_llama())
    plugin = fabric.strategy.precision
    opt = fabric.setup_optimizers(plugin.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3)))
    assert next(model.parameters()).dtype == torch.float16
    assert isinstance(opt.optimizer, MasterWeights)
    losses = []
    for batch in _loader():
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, opt, max_norm=1.0)
        assert float(norm) < 100, "unscaled before clipping"
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert [r.scale for r in plugin.prepared.scaler.history] == [2.0**16] * 4
    assert plugin.state_dict()["scaler"]["scale"] == 2.0**16


@pytest.mark.parametrize("recipe", ["fp16-dynamic-ls", "fp16-static-ls", "fp16"])
def test_fabric_update_is_the_fp32_update(recipe: str) -> None:
    """One SGD step (lr 1) through ``fabric.backward`` and ``opt.step`` moves the weights by
    the FP32 gradient, whatever the loss scale: the loss is scaled in ``fabric.backward``
    and unscaled before the step (Fabric's strategy discards ``pre_backward``'s result: a
    scaling there shrank every update by the scale, 2^16). Tolerance 2e-2: the model runs in
    FP16 (weights, activations and gradients rounded to 2^-11 relative). With
    ``fabric.clip_gradients(max_norm=1e-4)`` the returned norm is the FP32 gradient's and
    the update's norm is 0.01."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    x = torch.randn(32, 16)
    (net(x).pow(2).mean() * 1e-2).backward()  # scaled by 2^16, no FP16 overflow
    grads = [p.grad.detach().clone() for p in net.parameters() if p.grad is not None]
    ref_norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    for clip in (None, 1e-4):
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[LowprecFabricPrecision(recipe)])
        model = fabric.setup_module(copy.deepcopy(net))
        plugin = fabric.strategy.precision
        opt = fabric.setup_optimizers(plugin.optimizer(torch.optim.SGD(model.parameters(), lr=1.0)))
        params = [p for g in opt.optimizer.param_groups for p in g["params"]]  # FP32 masters
        ref = [p.detach().float().clone() for p in params]  # the FP16 weights' values
        fabric.backward(model(x.half()).float().pow(2).mean() * 1e-2)
        if clip is not None:
            norm = float(fabric.clip_gradients(model, opt, max_norm=clip))
            assert norm == pytest.approx(ref_norm, rel=2e-2)
        opt.step()
        moved = [b - p.detach().float() for p, b in zip(params, ref, strict=True)]
        if clip is None:
            for m, g in zip(moved, grads, strict=True):
                torch.testing.assert_close(m, g, rtol=2e-2, atol=2e-2 * float(g.abs().max()))
        else:
            size = float(torch.linalg.vector_norm(torch.cat([m.flatten() for m in moved])))
            assert size == pytest.approx(clip, rel=2e-2)


@pytest.mark.slow
def test_fabric_save_and_load_resume_exactly(tmp_path: Path) -> None:
    def setup(seed: int) -> Any:
        fabric = L.Fabric(
            accelerator="cpu", devices=1, plugins=[LowprecFabricPrecision("fp8-delayed")]
        )
        model = fabric.setup_module(tiny_llama(seed))
        plugin = fabric.strategy.precision
        opt = plugin.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        return fabric, model, fabric.setup_optimizers(opt), plugin

    def steps(fabric: Any, model: Any, opt: Any, batches: list[Any]) -> list[float]:
        out = []
        for batch in batches:
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            out.append(float(loss.detach()))
        return out

    batches = list(_loader())
    fabric, model, opt, plugin = setup(0)
    steps(fabric, model, opt, batches[:2])
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "lowprec": plugin})
    tail = steps(fabric, model, opt, batches[2:])
    fabric2, model2, opt2, plugin2 = setup(1)  # other initial weights
    fabric2.load(tmp_path / "ckpt.pt", {"model": model2, "optimizer": opt2, "lowprec": plugin2})
    assert steps(fabric2, model2, opt2, batches[2:]) == tail
    sa, sb = model.state_dict(), model2.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa), "parameters and amax histories"


@pytest.mark.slow
def test_fabric_handle_is_the_trained_unit_model(tmp_path: Path) -> None:
    """A unit recipe builds a new module (a u-μP copy with parameters of its own); the
    handle ``fabric.setup_module`` returns shows it everywhere after training:
    ``state_dict()`` (the trained values, not the initial ones), ``parameters()``,
    ``named_parameters()``, ``.module`` (whose loss, in the recipe's ``compute()``, is the
    handle's), ``save_pretrained`` through ``.module``. Fabric's handle pointed them at
    the module given to ``setup_module``: the untrained, non-unit model."""
    from safetensors.torch import load_file

    hooks = torch.nn.modules.module._global_module_registration_hooks
    n_hooks = len(hooks)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[LowprecFabricPrecision("bf16-unit")])
    raw = tiny_llama()
    model = fabric.setup_module(raw)
    plugin = fabric.strategy.precision
    net = plugin.prepared.model
    assert net is not raw and type(net).__name__ == "UnitLlamaForCausalLM"
    assert model.module is net
    init = {k: v.detach().clone() for k, v in net.state_dict().items()}
    opt = fabric.setup_optimizers(plugin.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2)))
    for batch in _loader():
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    assert len(hooks) == n_hooks, "the plugin's module-registration hook is removed"
    trained = dict(net.named_parameters())
    sd = model.state_dict()
    assert sd.keys() == init.keys()
    for name, p in trained.items():
        assert torch.equal(sd[name], p.detach()), name
        assert not torch.equal(sd[name], init[name]), f"{name} was trained"
    assert {id(p) for p in model.parameters()} == {id(p) for p in trained.values()}
    assert {id(p) for _, p in model.named_parameters()} == {id(p) for p in trained.values()}
    ids = Tokens(8, seed=1).ids
    with torch.no_grad():
        handle_loss = float(model(input_ids=ids, labels=ids).loss)
        with plugin.prepared.compute():
            module_loss = float(model.module(input_ids=ids, labels=ids).loss)
    assert module_loss == handle_loss
    model.module.save_pretrained(tmp_path / "hf")
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(saved[name], p.detach()) for name, p in trained.items())


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown name"):
        LowprecPrecision("no-such-recipe")
    with pytest.raises(ValueError, match="module_filter"):
        LowprecPrecision("bf16", module_filter=lambda m, fqn: True)
    with pytest.raises(TypeError, match="module must be"):
        LowprecPrecision("bf16", module=3)  # type: ignore[arg-type]


class _SGDLM(L.LightningModule):  # type: ignore[misc]
    """A tiny Llama with plain SGD (no momentum, no decay, constant lr); keeps a copy of
    the network it trains (the plugin's converted one) as it was before the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_llama(0)
        self.start: Any = None

    def on_train_start(self) -> None:
        self.start = copy.deepcopy(self.net)

    def training_step(self, batch: dict[str, torch.Tensor], idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.net(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_unit_recipe_step_is_the_one_batch_unit_gradient(tmp_path: Path, accumulate: int) -> None:
    """A unit recipe's first SGD step with ``k`` accumulated batches equals lr·lr_mult
    times the unit gradient of one batch of all ``4k`` rows: each micro-batch's unit
    weight gradient carries ``b^-1/2`` of its own ``b`` tokens, and Lightning divides the
    loss by ``k``, so the plugin scales the backward by ``√k`` (without it the step was
    ``1/√k`` of that batch's). Every row is the same sequence: the batches do not depend
    on the sampler. float32 sums in another order: 1e-4."""
    ids = Tokens(1).ids[0]
    data = [{"input_ids": ids, "labels": ids}] * (4 * accumulate)
    lm = _SGDLM()
    trainer = _trainer(tmp_path, "fp32-unit", max_steps=1, max_epochs=None,
                       gradient_clip_val=None, accumulate_grad_batches=accumulate)  # fmt: skip
    trainer.fit(lm, DataLoader(data, batch_size=4, shuffle=False))
    ref = lm.start
    rows = ids.repeat(4 * accumulate, 1)
    ref(input_ids=rows, labels=rows).loss.backward()
    opt = trainer.optimizers[0]
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    trained = dict(lm.net.named_parameters())
    for name, p0 in ref.named_parameters():
        assert p0.grad is not None
        want = -lr_of[id(trained[name])] * p0.grad
        got = trained[name].detach() - p0.detach()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), name
