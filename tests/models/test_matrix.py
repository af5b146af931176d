"""Model × technique matrix: every technique trains HF transformers architectures.

Models (tiny configs, random init, no downloads; width 32, 2 layers, 4 heads, 16 tokens):

* ``llama``: pre-norm RMSNorm, grouped-query attention (2 key/value heads), SDPA;
* ``gpt2``: pre-norm, ``Conv1D`` linears, dropout 0.1, SDPA, tied embeddings;
* ``gpt_neox``: pre-norm, parallel residual branches, eager attention;
* ``bert``: encoder, post-norm, masked-LM head;
* ``vit``: vision encoder (``ViTForImageClassification``): a ``Conv2d`` patch embedding,
  a class token and position embeddings (parameters, not lookups), pre-norm layers, a
  classification head on the class token; its inputs are images (``pixel_values``), and
  HF's generic ``dummy_inputs`` (``input_ids``) are not its inputs;
* ``gemma``: embedding scaled by √width (an ``nn.Embedding`` subclass), ``(1 + w)`` RMSNorm,
  GeGLU, multi-query attention, tied head;
* ``phi``: parallel attention and MLP on one shared LayerNorm, partial rotary, biases;
* ``falcon``: ``FalconLinear`` (``nn.Linear`` subclass with its own forward), parallel
  branches summed in place (``mlp_output += attention_output``), multi-query attention;
* ``qwen3moe``, ``mixtral`` (``lowprec train``'s MoE models): every MLP one experts module
  of 8 experts (3-D weights, hidden 2·width), top-2 routing, the load-balancing loss added
  to the loss; Qwen3 renormalises the top-k weights and norms q and k;
* ``gpt_oss``: experts with biases and a clamped SwiGLU, a router with a bias, attention
  sinks, sliding-window and full layers.

Techniques: ``unit_scale``, float8 with every preset, scalify fp16 and fp8, and ``prepare``
with every recipe (the last three models: three presets and seven recipes, see BREADTH).
Each case trains a few steps on one fixed batch (memorising it): the loss is finite at every
step and lower at the end than at the start. Besides:

* unit scaling: the residual stream (every layer's output) has std in [0.7, 1.4] at init
  for the pre-norm models (and the same measurement of the plain model is far below, so the
  check can fail);
* float8: the number of converted layers equals the linear-like layers of the architecture;
  in the MoE models every experts module is a ``Float8Experts`` and every matmul weight but
  the routers' (high precision by default) is in a float8 module, ≥ 95% of them;
* scalify: the gradients match FP32's within the bound of the data format (in an MoE layer
  where rounding flips a token's top-k choice, the whole model's bound only).

``gpt_oss`` is outside the unit-scaling residual band (strict xfail, reason at UNIT_XFAIL);
it trains unit-scaled in the ``prepare`` cases.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lowprec.float8 import Float8Experts, Float8Linear, calibrate, convert_to_float8, recipe_names
from lowprec.jobs.hf_models import CausalLM, build_hf_model
from lowprec.jobs.model import ModelConfig
from lowprec.recipes import prepare
from lowprec.recipes import recipe_names as prepare_recipes
from lowprec.recipes.step import Plain, train_step

transformers = pytest.importorskip("transformers")

VOCAB, WIDTH, DEPTH, HEADS, SEQ, BATCH = 48, 32, 2, 4, 16, 4
STEPS = 4
IMAGE, PATCH, CLASSES = 16, 4, 10  # ViT: 16 patches of 4x4 pixels and the class token
CFG = ModelConfig(vocab_size=VOCAB, width=WIDTH, depth=DEPTH, heads=HEADS, seq_len=SEQ)


class _MaskedLM(nn.Module):
    """BERT with the (idx, targets) -> (logits, loss) contract of the training loop."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def dummy_inputs(self) -> dict[str, Tensor]:
        return {"idx": torch.zeros(2, SEQ, dtype=torch.long)}

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits: Tensor = self.model(input_ids=idx).logits
        loss = None
        if targets is not None:
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss


class _ImageClassifier(nn.Module):
    """ViT with the (x, targets) -> (logits, loss) contract of the training loop; no
    ``dummy_inputs`` of its own (unit_scale analyses it on its first call)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits: Tensor = self.model(pixel_values=x).logits
        loss = None
        if targets is not None:
            loss = nn.functional.cross_entropy(logits.float(), targets)
        return logits, loss


def _vit() -> nn.Module:
    cfg = transformers.ViTConfig(
        image_size=IMAGE,
        patch_size=PATCH,
        num_channels=3,
        hidden_size=WIDTH,
        num_hidden_layers=DEPTH,
        num_attention_heads=HEADS,
        intermediate_size=4 * WIDTH,
        num_labels=CLASSES,
    )
    return _ImageClassifier(transformers.ViTForImageClassification(cfg))


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=DEPTH,
        num_attention_heads=HEADS,
        intermediate_size=4 * WIDTH,
        max_position_embeddings=SEQ,
        pad_token_id=0,
    )
    return _MaskedLM(transformers.BertForMaskedLM(cfg))


def _gpt_oss() -> nn.Module:
    """GPT-OSS: experts with biases and a clamped SwiGLU (``glu = clamp(gate) · σ(1.702 ·
    gate)``, ``(up + 1)``), attention sinks, alternating sliding-window and full layers."""
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=DEPTH,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        head_dim=WIDTH // HEADS,
        intermediate_size=2 * WIDTH,
        num_local_experts=8,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"][:DEPTH],
        sliding_window=SEQ // 2,
        max_position_embeddings=SEQ,
        output_router_logits=True,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return CausalLM(transformers.GptOssForCausalLM(cfg), SEQ)


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: build_hf_model("llama", CFG),
    "gpt2": lambda: build_hf_model("gpt2", CFG),
    "gpt_neox": lambda: build_hf_model("gpt_neox", CFG, attn_implementation="eager"),
    "bert": _bert,
    "vit": _vit,
    "gemma": lambda: build_hf_model("gemma", CFG),
    "phi": lambda: build_hf_model("phi", CFG),
    "falcon": lambda: build_hf_model("falcon", CFG),
    "qwen3moe": lambda: build_hf_model("qwen3moe", CFG),
    "mixtral": lambda: build_hf_model("mixtral", CFG),
    "gpt_oss": _gpt_oss,
}
PRE_NORM = ("llama", "gpt2", "gpt_neox", "gemma", "phi", "falcon", "vit", "qwen3moe",
            "mixtral", "gpt_oss")  # fmt: skip
# The MoE models: each MLP one experts module (3-D expert weights) and its router.
MOE = ("qwen3moe", "mixtral", "gpt_oss")
# Linear-like layers (x W + b) by structure: per layer, plus the heads.
LINEARS = {
    "llama": 7 * DEPTH + 1,  # q, k, v, o, gate, up, down; lm_head
    "gpt2": 4 * DEPTH + 1,  # Conv1D c_attn, c_proj, mlp.c_fc, mlp.c_proj; lm_head (tied)
    "gpt_neox": 4 * DEPTH + 1,  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h; embed_out
    "bert": 6 * DEPTH + 2,  # q, k, v, attention out, intermediate, output; transform, decoder
    "vit": 6 * DEPTH + 1,  # q, k, v, attention out, intermediate, output; classifier
    "gemma": 7 * DEPTH + 1,  # as Llama; lm_head (tied)
    "phi": 6 * DEPTH + 1,  # q, k, v, dense, fc1, fc2; lm_head
    "falcon": 4 * DEPTH + 1,  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h; lm_head
    # MoE: q, k, v, o; lm_head (the experts are counted as modules, the router stays high
    # precision: Float8Config.fp8_router is off in every preset)
    "qwen3moe": 4 * DEPTH + 1,
    "mixtral": 4 * DEPTH + 1,
    "gpt_oss": 4 * DEPTH + 1,
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Tiny GEMMs: one intra-op thread is faster, and immune to a busy machine's
    oversubscription (measured 10x on 2 shared cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return BUILDERS[name]().train()


def _batch(name: str) -> tuple[Tensor, Tensor]:
    """Model ``name``'s fixed batch: next-token ids, or (for ViT) images and labels."""
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        images = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)
        return images, torch.randint(0, CLASSES, (BATCH,), generator=g)
    seq = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _train(run: Any, name: str, lr: float | None = None) -> list[float]:
    """``STEPS`` applied steps on the fixed batch; the losses (finite, falling) are
    asserted. A skipped step is allowed only as dynamic loss scaling's back-off (the next
    step's scale is lower): ViT's FP16 gradients overflow at the initial scale 2^16."""
    x, y = _batch(name)
    losses: list[float] = []
    backed_off_from = None
    for _ in range(2 * STEPS):
        r = train_step(run, x, y, lr)
        if backed_off_from is not None:
            assert r.loss_scale < backed_off_from, (losses, "skipped without a back-off")
        backed_off_from = r.loss_scale if r.skipped else None
        if not r.skipped:
            losses.append(float(r.loss.detach()))
        if len(losses) == STEPS:
            break
    assert len(losses) == STEPS and backed_off_from is None, (losses, r.nonfinite)
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    return losses


def _layers(model: nn.Module) -> nn.ModuleList:
    """The list of transformer layers (the one ``nn.ModuleList`` of ``DEPTH`` modules)."""
    found = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == DEPTH]
    assert found, "no ModuleList of the model's layers"
    return found[0]


@torch.no_grad()
def _residual_stds(model: nn.Module, name: str) -> list[float]:
    """Std of the residual stream after every layer, at init, on the fixed batch."""
    stds: list[float] = []

    def hook(mod: nn.Module, args: Any, out: Any) -> None:
        h = out[0] if isinstance(out, (tuple, list)) else out
        stds.append(float(h.float().std()))

    handles = [layer.register_forward_hook(hook) for layer in _layers(model)]
    try:
        model(*_batch(name))
    finally:
        for h in handles:
            h.remove()
    return stds


MODELS = list(BUILDERS)
# The models added for breadth (their layer forms, not the recipes, are what is new) run a
# subset of the float8 presets and recipes, one per kind: the CI time of the matrix stays
# small (≈ 13 cases each instead of 34).
BREADTH = ("gemma", "phi", "falcon", "vit", "mixtral", "gpt_oss")
BREADTH_FLOAT8 = ("tensorwise", "rowwise", "static")
# The MoE models of BREADTH add a grouped-GEMM case per kind of granularity (block, MX, NV);
# qwen3moe runs every preset and recipe.
MOE_BREADTH_FLOAT8 = (*BREADTH_FLOAT8, "blockwise", "mxfp8", "nvfp4")
BREADTH_RECIPES = ("bf16", "fp16-dynamic-ls", "fp8-delayed", "mxfp8", "fp16-unit", "fp8-unit",
                   "fp8-scalify")  # fmt: skip


def _cases(
    options: list[str], subset: tuple[str, ...], moe_subset: tuple[str, ...] | None = None
) -> list[tuple[str, str]]:
    """(model, option) pairs: every option for the first models, ``subset`` for BREADTH
    (``moe_subset`` for its MoE models where given)."""

    def keep(m: str, o: str) -> bool:
        if m not in BREADTH:
            return True
        return o in (moe_subset if moe_subset and m in MOE else subset)

    return [(m, o) for m in MODELS for o in options if keep(m, o)]


# ---- unit scaling --------------------------------------------------------------------------


# GPT-OSS's attention sinks (a parameter with no unit rule, named in unit_scale's WARNING)
# lift its residual stream to 1.45-1.48 at init, above the band (docs/unit-scaling.md, MoE).
UNIT_XFAIL = {"gpt_oss": "attention sinks have no unit rule: residual std 1.45-1.48 at init"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=UNIT_XFAIL[m]))
     if m in UNIT_XFAIL else m for m in MODELS],
)  # fmt: skip
def test_unit_scale(name: str) -> None:
    from lowprec.unit import umup_param_groups, unit_scale

    model = _model(name)
    plain = _residual_stds(model, name)
    x, y = _batch(name)
    unit = unit_scale(model, reinit=True, example_inputs=(x, y))
    if name in PRE_NORM:
        stds = _residual_stds(unit, name)
        assert len(stds) == DEPTH
        assert all(0.7 <= s <= 1.4 for s in stds), stds
        assert max(plain) < 0.7, plain  # HF's N(0, 0.02) init: the check can fail
    opt = torch.optim.AdamW(umup_param_groups(unit, lr=2**-4))
    _train(Plain(unit, opt), name)


# ---- float8 ---------------------------------------------------------------------------------


def _matmul_weights(model: nn.Module) -> tuple[int, int, list[str]]:
    """(matmul weight elements, those in float8 modules, the modules holding the others):
    every module's own 2-D ``weight`` (embeddings, lookups, excluded) and 3-D expert
    weights."""
    total = fp8 = 0
    high: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding):
            continue
        n = sum(p.numel() for k, p in mod.named_parameters(recurse=False)
                if p.dim() == 3 or (p.dim() == 2 and k == "weight"))  # fmt: skip
        total += n
        if isinstance(mod, (Float8Linear, Float8Experts)):
            fp8 += n
        elif n:
            high.append(name)
    return total, fp8, high


@pytest.mark.parametrize(
    ("name", "preset"), _cases(recipe_names(), BREADTH_FLOAT8, MOE_BREADTH_FLOAT8)
)
def test_float8(name: str, preset: str) -> None:
    model = convert_to_float8(_model(name), preset)
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == LINEARS[name]
    experts = sum(isinstance(m, Float8Experts) for m in model.modules())
    assert experts == (DEPTH if name in MOE else 0)
    if name in MOE:  # every matmul weight but the routers' (high precision by default)
        total, fp8, high = _matmul_weights(model)
        assert all(h.endswith(("gate", "router")) for h in high), high
        assert fp8 / total >= 0.95, fp8 / total  # the bar (routers: ~1% here)
    x, y = _batch(name)
    if any(isinstance(m, Float8Linear) and m.needs_calibration for m in model.modules()):
        with calibrate(model):  # the static preset: scales from one batch, then frozen
            loss = model(x, y)[1]
            assert loss is not None
            loss.backward()
        model.zero_grad(set_to_none=True)
    _train(Plain(model, torch.optim.AdamW(model.parameters(), lr=1e-2)), name)


# ---- scalify --------------------------------------------------------------------------------

# Relative L2 error of the gradients against FP32 (whole model, and per tensor against the
# larger of its norm and 1e-3 of the whole): fp16 rounds every op's data to 11 bits
# (u = 2^-11 ≈ 4.9e-4), a few tens of roundings in series: 2e-2 (≈ 40 u). fp8 rounds the
# matmul inputs to E4M3 (u = 2^-4) and their gradients to E5M2 (u = 2^-3): a GEMM of random
# signs keeps ≈ u/√3 relative error per rounded operand, a few in series: 0.35.
SCALIFY_BOUND = {"fp16": 2e-2, "fp8": 0.35}


def _routes(model: nn.Module) -> list[list[Tensor]]:
    """The MoE routers' top-k expert ids (sorted per token), per call, appended as
    ``model`` runs (forward hooks on every ``mlp.gate``/``mlp.router``; none for a dense
    model)."""
    picks: list[list[Tensor]] = [[]]

    def hook(mod: nn.Module, args: Any, out: Any) -> None:
        ids = [o for o in out if isinstance(o, Tensor) and o.dtype == torch.long]
        picks[0].append(ids[0].detach().as_subclass(Tensor).sort(-1).values)

    for n, m in model.named_modules():
        if n.endswith(("mlp.gate", "mlp.router")):
            m.register_forward_hook(hook)
    return picks[0]


def _flipped_layers(ref: list[Tensor], got: list[Tensor], name: str) -> set[int]:
    """The layers where rounding changed some token's top-k experts against FP32.

    Top-k routing is discontinuous: a token whose k-th and (k+1)-th router logits lie
    within the format's rounding error of each other may pick another expert, and that
    layer's router, experts and norm gradients then differ by a discrete change, not a
    rounding error (measured: 0-6 of the 64 tokens per layer, fp16 and fp8), so the
    per-tensor bound skips those layers; the whole-model bound still holds. A routing bug
    flips most tokens (two random top-2 sets of 8 agree with probability 1/28): at most
    a quarter may flip."""
    if name not in MOE:
        assert not ref and not got
        return set()
    assert len(ref) == len(got) == DEPTH, (len(ref), len(got))
    flips = [int((a != b).any(-1).sum()) for a, b in zip(ref, got, strict=True)]
    assert all(f <= ref[0].shape[0] // 4 for f in flips), flips
    return {i for i, f in enumerate(flips) if f}


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("name", MODELS)
def test_scalify(name: str, fmt: str) -> None:
    from lowprec.scalify import scalify

    model = _model(name).eval()  # no dropout: the gradients are compared
    ref = copy.deepcopy(model)
    x, y = _batch(name)
    ref_picks, sm_picks = _routes(ref), _routes(model)
    ref(x, y)[1].backward()
    sm = scalify(model, fmt)
    sm(x, y)[1].backward()
    flipped = _flipped_layers(ref_picks, sm_picks, name)
    g_ref = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    got = dict(model.named_parameters())
    total = torch.cat([g.flatten() for g in g_ref.values()]).norm()
    err = torch.cat([(got[n].grad - g).flatten() for n, g in g_ref.items()])  # type: ignore[operator]
    bound = SCALIFY_BOUND[fmt]
    assert float(err.norm() / total) < bound
    for n, g in g_ref.items():
        gg = got[n].grad
        assert gg is not None and bool(torch.isfinite(gg).all()), n
        if any(f".layers.{i}." in n for i in flipped):
            continue  # a token's top-k choice flipped in this layer: a discrete change
        floor = max(float(g.norm()), 1e-3 * float(total))
        assert float((gg - g).norm()) <= bound * floor, n
    model.zero_grad(set_to_none=True)
    model.train()
    _train(Plain(sm, torch.optim.AdamW(model.parameters(), lr=1e-2)), name)


# ---- prepare with every recipe ----------------------------------------------------------------


# Recipes that exist to show a failure (their description says so): the negative controls.
# fp16-pure keeps Adam's state in FP16, where eps = 1e-8 underflows to 0: 0/0 on the first
# update of any weight whose gradient rounds to zero, so the weights turn NaN.
FAILS_BY_DESIGN = ("fp16-pure",)


@pytest.mark.parametrize(("name", "recipe"), _cases(prepare_recipes(), BREADTH_RECIPES))
def test_prepare(name: str, recipe: str) -> None:
    # lr 3e-3: lowprec train's default; the unit recipes map it to u-μP's rates (lr_mult)
    run = prepare(_model(name), recipe, lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    if recipe in FAILS_BY_DESIGN:
        with pytest.raises(AssertionError):
            _train(run, name)
        return
    _train(run, name)


def test_causal_lm_contract() -> None:
    """The adapter's loss is HF's own next-token loss (labels shifted inside HF) on the same
    logits, up to FP32 summation order."""
    model = _model("llama").eval()
    assert isinstance(model, CausalLM)
    seq = _batch("llama")[0]
    logits, loss = model(seq[:, :-1], seq[:, 1:])
    hf = model.model(input_ids=seq, labels=seq)
    torch.testing.assert_close(logits, hf.logits[:, :-1])
    assert loss is not None
    torch.testing.assert_close(loss, hf.loss, rtol=1e-5, atol=1e-6)
