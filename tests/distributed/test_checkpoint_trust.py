"""DCP checkpoints (:mod:`lowprec.distributed.checkpoint`) hold no pickles, and loading one
never runs code from it (issue 36): each test plants a payload that would create a file
if it were unpickled, loads through the public API, and checks that the file does not
exist and that the error says what is wrong. One process (DCP saves and loads without a
process group)."""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from lowprec.distributed import checkpoint as ckpt
from lowprec.recipes import prepare
from lowprec.recipes.prepared import Prepared
from lowprec.recipes.step import train_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.body(x.to(self.body[0].weight.dtype))
        return out, (out.float() - y).square().mean()


def _prepared(recipe: str = "fp16-dynamic-ls", seed: int = 0) -> Prepared:
    torch.manual_seed(seed)
    return prepare(_Net(), recipe)


def _trained(recipe: str = "fp16-dynamic-ls") -> Prepared:
    p = _prepared(recipe)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        train_step(p, torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
    return p


EXTRA: dict[str, Any] = {
    "step": 7,
    "rng": torch.arange(5, dtype=torch.uint8),
    "nested": {3: (1.5, "a", None, True), "nan": math.nan, "inf": -math.inf, "l": [[1], {}]},
}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and bool(a == b)


def test_round_trip_restores_every_tensor_and_the_extra_exactly(tmp_path: Path) -> None:
    p = _trained()
    ckpt.save(p, tmp_path / "c", EXTRA)
    q = _prepared(seed=5)  # other weights: everything must come from the checkpoint
    extra = ckpt.load(q, tmp_path / "c")
    assert _equal(EXTRA, extra)  # int keys, tuples, NaN/Inf floats, tensors
    assert _equal(p.model.state_dict(), q.model.state_dict())
    assert _equal(p.optimizer.state_dict(), q.optimizer.state_dict())
    assert _equal(p.scaler.state_dict(), q.scaler.state_dict())


def test_the_checkpoint_holds_no_pickled_object(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt.save(_trained(), tmp_path / "c", EXTRA)
    meta = ckpt._SafeReader(str(tmp_path / "c")).read_metadata().state_dict_metadata
    assert all(isinstance(md, TensorStorageMetadata) for md in meta.values())


def test_state_that_a_checkpoint_cannot_hold_is_refused_on_save(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"/extra/bad holds a set"):
        ckpt.save(_prepared(), tmp_path / "c", {"bad": {1, 2}})


def test_format_1_checkpoint_is_refused_without_unpickling(
    tmp_path: Path, payload: tuple[Any, bytes, Path]
) -> None:
    # lowprec's format 1 stored the structure as a pickled object "skeleton".
    obj, _, marker = payload
    dcp_save({"skeleton": obj, "model/body.0.weight": torch.zeros(16, 8)}, checkpoint_id=tmp_path)
    with pytest.raises(ValueError, match=r"format 1, whose structure is a pickle.*never unpickles"):
        ckpt.load(_prepared(), tmp_path)
    assert not marker.exists()


def test_payload_in_the_dcp_metadata_never_runs(
    tmp_path: Path, payload: tuple[Any, bytes, Path]
) -> None:
    _, data, marker = payload
    ckpt.save(_prepared(), tmp_path, {})
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(ValueError, match=r"not a readable DCP checkpoint.*refused to load"):
        ckpt.load(_prepared(), tmp_path)
    assert not marker.exists()


def test_pickled_objects_beside_a_valid_checkpoint_are_never_read(
    tmp_path: Path, payload: tuple[Any, bytes, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A checkpoint edited to carry an object entry (DCP unpickles those when asked): load
    # asks DCP for tensors only, so it loads and the payload never runs.
    obj, _, marker = payload
    real = ckpt.dcp_save
    monkeypatch.setattr(ckpt, "dcp_save", lambda sd, **kw: real({**sd, "evil": obj}, **kw))
    p = _trained()
    ckpt.save(p, tmp_path, {"step": 3})
    monkeypatch.undo()
    q = _prepared(seed=5)
    assert ckpt.load(q, tmp_path) == {"step": 3}
    assert _equal(p.model.state_dict(), q.model.state_dict())
    assert not marker.exists()


def _rewrite_metadata(path: Path, change: Any) -> None:
    with open(path / ".metadata", "rb") as f:
        md = ckpt._read_metadata(f)
    change(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def test_storage_entries_outside_the_checkpoint_are_refused(tmp_path: Path) -> None:
    ckpt.save(_prepared(), tmp_path / "c", {})

    def escape(md: Any) -> None:
        for info in md.storage_data.values():
            info.relative_path = "../outside.distcp"

    _rewrite_metadata(tmp_path / "c", escape)
    with pytest.raises(ValueError, match=r"'../outside.distcp' is not a file of the checkpoint"):
        ckpt.load(_prepared(), tmp_path / "c")


@pytest.mark.parametrize(
    ("index", "match"),
    [
        (b"\x80\x04not json", "malformed lowprec index"),
        (b'{"format": 1, "state": {}}', r"malformed lowprec index \(format 1\)"),
        (b'{"format": 2, "state": {"dict": [["a", {"eval": "x"}]]}}', "malformed index entry"),
        (b'{"format": 2, "state": {"dict": []}}', "missing recipe, layout or extra"),
    ],
)
def test_a_malformed_index_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, index: bytes, match: str
) -> None:
    real = ckpt.dcp_save
    blob = torch.frombuffer(bytearray(index), dtype=torch.uint8)
    monkeypatch.setattr(ckpt, "dcp_save", lambda sd, **kw: real({**sd, ckpt._INDEX: blob}, **kw))
    ckpt.save(_prepared(), tmp_path, {})
    monkeypatch.undo()
    with pytest.raises(ValueError, match=match):
        ckpt.load(_prepared(), tmp_path)


def test_an_index_naming_a_missing_tensor_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ckpt.dcp_save
    monkeypatch.setattr(
        ckpt,
        "dcp_save",
        lambda sd, **kw: real({k: v for k, v in sd.items() if k != "/extra/t"}, **kw),
    )
    ckpt.save(_prepared(), tmp_path, {"t": torch.ones(2)})
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"names tensor '/extra/t', which is missing"):
        ckpt.load(_prepared(), tmp_path)


def test_the_metadata_reader_refuses_every_other_global(payload: tuple[Any, bytes, Path]) -> None:
    _, data, marker = payload
    with pytest.raises(ValueError, match=r"refused to load (builtins|io)\.open"):
        ckpt._read_metadata(io.BytesIO(data))
    assert not marker.exists()


def test_another_optimizer_class_is_refused(tmp_path: Path) -> None:
    """An AdamW checkpoint loaded into an SGD run was accepted: SGD took AdamW's rate and
    weight decay and the moments stayed unused (a new user's trial). The same class loads;
    another is refused with both named, and nothing of the run changes."""
    p = _trained()
    ckpt.save(p, tmp_path / "c")
    torch.manual_seed(0)
    q = prepare(_Net(), "fp16-dynamic-ls", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9))
    before = {k: v.clone() for k, v in q.model.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"MasterWeights\(AdamW\), this run has MasterWeights\(SGD\)"
    ):
        ckpt.load(q, tmp_path / "c")
    assert _equal(before, q.model.state_dict())
    assert q.optimizer.param_groups[0]["lr"] == 1e-3
    ckpt.load(_prepared(seed=5), tmp_path / "c")  # the same class loads
