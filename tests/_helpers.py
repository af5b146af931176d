"""Plain helper functions and constants shared by the test folders.

The rule of the test suite: a test module imports shared helpers from ``_``-prefixed
modules (this one, ``tests/_bits.py``, a folder's own ``_*.py``), never from another
``test_*.py`` module nor from a ``conftest.py``, which holds fixtures and hooks only
(``tests/test_layers.py`` checks it).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lowprec.jobs.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def torchrun_json(script: Path, nproc: int, out: Path, *args: str) -> Any:
    """Run ``script`` on ``nproc`` processes (gloo, one thread each) with torch's launcher,
    passing ``*args`` then ``out``; the JSON that rank 0 wrote to ``out``. ``RuntimeError``
    with the end of the workers' output if the launch fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(script), *args, str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{script.name} on {nproc} processes failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
        )
    return json.loads(Path(out).read_text())


def cli_error(
    argv: list[str], capsys: pytest.CaptureFixture[str], code: int = 2, notes: bool = False
) -> str:
    """Run ``lowprec argv`` expecting it to fail with exit ``code`` and exactly one
    ``error:`` line on stderr, no traceback (``notes``: ``note: ...`` lines may precede
    it); that line."""
    from lowprec.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    lines = [
        ln for ln in err.splitlines() if ln.strip() and not (notes and ln.startswith("note: "))
    ]
    assert len(lines) == 1 and "error: " in lines[0] and "Traceback" not in err, err
    return lines[0]


# A tiny training run (a second or so on one CPU thread), for the jobs' and recipes' tests.
TINY = TrainConfig(
    steps=8,
    batch_size=4,
    seq_len=16,
    width=32,
    depth=1,
    heads=2,
    lr=3e-3,
    warmup=2,
    eval_every=4,
    eval_batches=2,
    ckpt_every=2,
)


# The reference task of the recipe-quality tests (a few seconds a recipe): every recipe
# against bf16 on the same seed, data and steps.
REFERENCE_TASK = TrainConfig(
    steps=120,
    batch_size=16,
    seq_len=64,
    width=64,
    depth=2,
    heads=4,
    lr=3e-3,
    warmup=10,
    eval_every=120,
    eval_batches=8,
    ckpt_every=1000,
)


def assert_compiled_equals_eager(model: Any, ids: Any, min_grads: int = 1) -> None:
    """``torch.compile(model, backend="eager")`` gives eager's loss and every parameter
    gradient exactly (the ``eager`` backend runs the traced ops with eager's kernels in
    eager's order, so only the graph's autograd can differ); ``model`` an HF causal LM
    called with ``input_ids=ids, labels=ids``, at least ``min_grads`` gradients."""
    import torch

    def run(m: Any) -> tuple[Any, dict[str, Any]]:
        model.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.loss.detach(), grads

    torch._dynamo.reset()
    (l_e, g_e), (l_c, g_c) = run(model), run(torch.compile(model, backend="eager"))
    assert torch.equal(l_c, l_e), (float(l_c), float(l_e))
    assert g_c.keys() == g_e.keys() and len(g_e) >= min_grads, (len(g_e), len(g_c))
    for n in g_e:
        assert torch.equal(g_c[n], g_e[n]), n


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """A gloo process group of one rank for the block (none started when one exists).
    On exit, a garbage collection first: DDP's reducer holds the group, and freed later,
    by a collection inside another test, it was the group's last owner, and the group's
    destructor joined a gloo thread waiting for the GIL that the freeing thread held (a
    hung xdist worker)."""
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        store = dist.FileStore(tempfile.mktemp(), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()
        if own:
            dist.destroy_process_group()
