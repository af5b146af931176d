"""Per-GEMM numerics: what each low-precision GEMM's casts really did, measured.

``with measure_gemms(model, every=k) as m:`` records, every ``k``-th training step, one
record per GEMM that a technique observes (:mod:`lowprec.core.observe`: a float8 linear's
three GEMMs, unit scaling's FP8 matmuls), forward and backward::

    {"step": 10, "layer": "blocks.0.attn.qkv", "gemm": "input_grad", "rel_err": 0.031,
     "operands": {"grad_output": {...}, "weight": {...}}}

``gemm`` is ``"forward"`` (``y = x Wᵀ``), ``"input_grad"`` (``dx = g W``) or
``"weight_grad"`` (``dW = gᵀ x``); a layer that runs the same GEMM more than once in a step
(weight sharing, several matmuls of one attention module) gets ``#2``, ``#3``... appended
to its ``gemm``. For each operand, with ``h`` its high-precision value, ``c`` the value the
GEMM multiplies (cast and dequantized), ``s`` the scale of each element, ``n`` the number of
elements and ``F`` the format (:func:`cast_stats`):

* ``flushed`` = #{``h ≠ 0``, ``c = 0``} / n: values the cast flushed to zero;
* ``saturated`` = #{``|h| > F.max · s · (1 + 2^-(m+1))``} / n (finite ``h``, ``m`` the
  format's mantissa bits): values beyond the format's range, clamped to its largest value
  (a value within half a step of ``F.max`` rounds to it in any case);
* ``nonfinite`` = #{``h`` not finite} / n;
* ``sqnr_db`` = ``10 log10(Σh² / Σ(h − c)²)`` over the finite values (``Infinity`` for an
  exact cast, ``None`` for an all-zero ``h``);
* ``scale_min``, ``scale_max``, ``n_scales``: the distinct scales (one per tensor, row or
  block; a scale-free cast, e.g. ``fp8-naive`` or unit scaling's FP8, has scale 1);
* ``format``, ``granularity``, ``high_precision`` (True: the GEMM multiplies ``h`` as it
  is, in its dtype: nothing is cast).

``rel_err`` is the GEMM's relative error ``‖c_a c_b − h_a h_b‖ / ‖h_a h_b‖`` (Frobenius,
in float32), sampled: on at most :data:`REL_ERR_ROWS` evenly spaced rows of the output (of
evenly spaced matrices of a batched GEMM).
Steps not sampled cost one integer test per module hook. Records are JSON-ready dicts;
:meth:`GemmRecorder.save` appends them to a JSON-lines file (``gemms.jsonl`` in a run
directory).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lowprec._json import dumps
from lowprec.core.formats import get_format
from lowprec.core.observe import GEMMS, CastOperand, GemmSink, observing

__all__ = [
    "DEFAULT_EVERY",
    "GEMMS",
    "REL_ERR_ROWS",
    "GemmRecorder",
    "cast_stats",
    "gemm_rel_err",
    "measure_gemms",
]

DEFAULT_EVERY = 50  # lowprec train's interval: its cost per step, benchmarks/bench_gemms.py
REL_ERR_ROWS = 256  # output rows of a GEMM its sampled relative error is taken over


def _norm(x: Tensor) -> float:
    """``‖x‖₂`` (float32 accumulation, float64 where that overflows)."""
    v = float(torch.linalg.vector_norm(x))
    return v if math.isfinite(v) else float(torch.linalg.vector_norm(x, dtype=torch.float64))


def cast_stats(op: CastOperand) -> dict[str, Any]:
    """The statistics of one operand (see the module docstring), in a few fused passes:
    ``flushed`` is ``nnz(h) − nnz(c)`` (a cast never makes a zero nonzero), ``saturated``
    is counted only when ``max |h| / s`` passes the limit, the SQNR's sums of squares are
    norms (float32 accumulation; float64 where that would overflow)."""
    h = op.hp.detach()
    n = max(h.numel(), 1)
    rec: dict[str, Any] = {
        "format": op.fmt,
        "granularity": op.granularity,
        "high_precision": op.high_precision,
        "numel": h.numel(),
    }
    hf = h if h.dtype in (torch.float32, torch.float64) else h.float()
    finite = math.isfinite(float(hf.sum())) or bool(torch.isfinite(hf).all())
    rec["nonfinite"] = 0.0 if finite else float((~torch.isfinite(hf)).sum()) / n
    if op.high_precision:
        rec.update(flushed=0.0, saturated=0.0, sqnr_db=math.inf)
        rec.update(scale_min=None, scale_max=None, n_scales=0)
        return rec
    cf = op.cast.detach().to(device=h.device, dtype=hf.dtype)
    if not finite:  # Inf/NaN are counted in nonfinite, not in the other measures
        keep = torch.isfinite(hf)
        hf, cf = torch.where(keep, hf, 0.0), torch.where(keep, cf, 0.0)
    nnz_h, nnz_c = int(torch.count_nonzero(hf)), int(torch.count_nonzero(cf))
    rec["flushed"] = max(nnz_h - nnz_c, 0) / n
    f = get_format(op.fmt)
    limit = f.max * (1.0 + 2.0 ** -(f.mantissa_bits + 1))
    sv = None if op.scale is None else op.scale.detach().to(device=h.device, dtype=hf.dtype)
    over = 0
    if hf.numel():
        lo, hi = hf.aminmax()
        amax = max(-float(lo), float(hi))
        if sv is not None:  # no quotient exceeds amax / min(s): nothing to count below it
            amax /= float(sv.min())
        if amax > limit:  # count, element by element (rare: saturation)
            ratio = hf.abs()
            if sv is not None:
                shaped = sv.reshape(hf.shape) if sv.numel() == hf.numel() > 1 else sv
                ratio = ratio / shaped
            over = int(torch.count_nonzero(ratio > limit))
    rec["saturated"] = over / n
    d = float(torch.dist(hf, cf))
    if not math.isfinite(d):
        d = _norm(hf.double() - cf.double())
    sig, noise = _norm(hf) ** 2, d**2
    if sig == 0.0 or not math.isfinite(sig):
        rec["sqnr_db"] = None
    else:
        rec["sqnr_db"] = math.inf if noise == 0.0 else 10.0 * math.log10(sig / noise)
    scales = op.scales if op.scales is not None else op.scale
    if scales is None:
        rec.update(scale_min=1.0, scale_max=1.0, n_scales=1)
    else:
        sv = scales.detach().float().reshape(-1)
        rec.update(scale_min=float(sv.min()), scale_max=float(sv.max()), n_scales=sv.numel())
    return rec


def _rows(t: Tensor, rows: int) -> Tensor:
    """At most ``rows`` evenly spaced rows (dimension -2) of ``t``."""
    m = t.shape[-2]
    if m <= rows:
        return t
    idx = torch.linspace(0, m - 1, rows, device=t.device).round().long()
    return t.index_select(-2, idx)


def _batches(t: Tensor, keep: int) -> Tensor:
    """At most ``keep`` evenly spaced matrices of a batched ``t`` (``(..., M, K)``), as
    ``(k, M, K)``; a 2-D ``t`` as it is."""
    if t.dim() <= 2:
        return t
    flat = t.reshape(-1, *t.shape[-2:])
    n = flat.shape[0]
    if n <= keep:
        return flat
    return flat.index_select(0, torch.linspace(0, n - 1, keep, device=t.device).round().long())


def gemm_rel_err(a: CastOperand, b: CastOperand, rows: int = REL_ERR_ROWS) -> float | None:
    """``‖c_a c_b − h_a h_b‖ / ‖h_a h_b‖`` on at most ``rows`` rows of the output (a batched
    GEMM, e.g. attention's: on evenly spaced matrices of the batch, ``rows`` rows in all;
    ``None`` when the reference product is zero or not finite)."""
    keep = max(1, rows // max(a.hp.shape[-2], 1)) if a.hp.dim() > 2 else 1
    ha, hb = _batches(a.hp.detach(), keep), _batches(b.hp.detach(), keep)
    ca, cb = _batches(a.cast.detach(), keep), _batches(b.cast.detach(), keep)
    ha, ca = _rows(ha, rows).float(), _rows(ca, rows).float()
    hb, cb = hb.float(), cb.float()
    ref = torch.matmul(ha, hb)
    den = float(torch.linalg.vector_norm(ref))
    if den == 0.0 or not math.isfinite(den):
        return None
    num = float(torch.linalg.vector_norm(torch.matmul(ca, cb) - ref))
    return num / den if math.isfinite(num) else math.inf


class GemmRecorder:
    """Records per-GEMM numerics of ``model`` every ``every`` steps (see the module
    docstring). Use :func:`measure_gemms`; read :attr:`records`.

    With ``auto_step`` a step is one forward call of ``model`` in training mode (eval
    passes are neither counted nor recorded); without it the caller sets :attr:`step` and
    :attr:`enabled` before each step (as ``lowprec train`` does). The recorder must be the
    active observer (:func:`lowprec.core.observe.observing`) while the model runs."""

    def __init__(
        self,
        model: nn.Module,
        every: int = DEFAULT_EVERY,
        start_step: int = 0,
        auto_step: bool = True,
        rel_err_rows: int = REL_ERR_ROWS,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if isinstance(rel_err_rows, bool) or not isinstance(rel_err_rows, int) or rel_err_rows < 1:
            raise ValueError(f"rel_err_rows must be a positive int, got {rel_err_rows!r}")
        self.every, self.rel_err_rows = every, rel_err_rows
        self.enabled = True
        self.records: list[dict[str, Any]] = []
        self._auto = auto_step
        self._layers: list[str] = []  # the modules running now, innermost last
        self._seen: dict[tuple[int, str, str], int] = {}
        self._handles: list[RemovableHandle] = []
        if auto_step:
            self.step = start_step - 1
            self._handles.append(model.register_forward_pre_hook(self._on_step))
        else:
            self.step = start_step
        for name, mod in model.named_modules():
            self._handles.append(mod.register_forward_pre_hook(partial(self._enter, name)))
            self._handles.append(
                mod.register_forward_hook(partial(self._leave, name), always_call=True)
            )

    @property
    def sampling(self) -> bool:
        return self.enabled and self.step % self.every == 0

    def _on_step(self, module: nn.Module, args: Any) -> None:
        self.enabled = module.training
        if module.training:
            self.step += 1
            self._layers.clear()

    def _enter(self, name: str, module: nn.Module, args: Any) -> None:
        # Traced by torch.compile: nothing (compiled GEMMs are not observed), and no guard
        # on the step counter, which would recompile the graph every step.
        if not torch.compiler.is_compiling() and self.sampling:
            self._layers.append(name or "model")

    def _leave(self, name: str, module: nn.Module, args: Any, out: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self._layers and self._layers[-1] == (name or "model"):
            self._layers.pop()

    def capture(self) -> GemmSink | None:
        """The sink for a GEMM built now (:class:`~lowprec.core.observe.GemmObserver`)."""
        if not self.sampling:
            return None
        return partial(self._on_gemm, self.step, self._layers[-1] if self._layers else "model")

    def _on_gemm(self, step: int, layer: str, gemm: str, a: CastOperand, b: CastOperand) -> None:
        key = (step, layer, gemm)
        k = self._seen.get(key, 0) + 1
        self._seen[key] = k
        with torch.no_grad():
            ops = {a.role: cast_stats(a), b.role: cast_stats(b)}
            if a.high_precision and b.high_precision:
                err: float | None = 0.0
            else:
                err = gemm_rel_err(a, b, self.rel_err_rows)
        self.records.append(
            {
                "step": step,
                "layer": layer,
                "gemm": gemm if k == 1 else f"{gemm}#{k}",
                "rel_err": err,
                "operands": ops,
            }
        )

    def remove(self) -> None:
        """Remove every hook (the records stay)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def clear(self) -> None:
        """Forget the records (after they were written elsewhere)."""
        self.records.clear()
        self._seen.clear()

    def save(self, path: str | Path) -> Path:
        """Append the records to the JSON-lines file ``path`` (strict JSON,
        :mod:`lowprec._json`) and forget them."""
        path = Path(path)
        with open(path, "a") as f:
            for r in self.records:
                f.write(dumps(r) + "\n")
        self.clear()
        return path


@contextmanager
def measure_gemms(
    model: nn.Module, every: int = DEFAULT_EVERY, start_step: int = 0
) -> Iterator[GemmRecorder]:
    """Record the per-GEMM numerics of ``model`` inside the block (module docstring): a
    step is one forward call in training mode; steps ``start_step``, ``start_step + every``,
    ... are measured.

    Example:
        >>> import torch
        >>> from lowprec.float8 import Float8Linear
        >>> m = torch.nn.Sequential(Float8Linear.from_linear(torch.nn.Linear(64, 32), "naive"))
        >>> with measure_gemms(m, every=1) as g:
        ...     x = (torch.randn(8, 64) * 1e-4).requires_grad_()
        ...     m(x).sum().backward()
        >>> [(r["layer"], r["gemm"]) for r in g.records]
        [('0', 'forward'), ('0', 'input_grad'), ('0', 'weight_grad')]
        >>> g.records[0]["operands"]["input"]["flushed"] > 0.5  # 1e-4 at scale 1 in E4M3
        True
    """
    rec = GemmRecorder(model, every, start_step)
    try:
        with observing(rec):
            yield rec
    finally:
        rec.remove()
