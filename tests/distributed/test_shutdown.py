"""``lowprec.distributed.shutdown``: the process group ends while the interpreter is alive,
and the FSDP2 objects that hold it (in reference cycles) are freed first.

Without the collection, a gloo process group held by such cycles was freed only during
interpreter finalisation, and a ``torchrun`` worker aborted there after its work was done
("terminate called without an active exception", SIGABRT; CI's
``test_train_parallel.py`` fixture hit it). The check runs in a fresh interpreter with the
automatic collector off, so only ``shutdown`` can free the cycle.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch.distributed as dist

from lowprec.distributed import shutdown

SCRIPT = r"""
import gc, json, sys, tempfile, weakref
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from lowprec.distributed import shutdown

gc.disable()
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
fully_shard(m[0])
fully_shard(m)
m(torch.randn(2, 4)).sum().backward()
ref = weakref.ref(m)
del m
out = {"alive_after_del": ref() is not None}
if sys.argv[1] == "plain":
    dist.destroy_process_group()
else:
    shutdown()
out["alive_after"] = ref() is not None
out["initialized_after"] = dist.is_initialized()
shutdown()  # again: nothing to do
print(json.dumps(out))
"""


def _run(how: str) -> dict[str, bool]:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_shutdown_frees_the_sharded_model_and_ends_the_group() -> None:
    plain, ours = _run("plain"), _run("shutdown")
    # The premise: a sharded model outlives its last name (cycles), and a plain
    # destroy_process_group() leaves it alive, holding the group.
    assert plain == {"alive_after_del": True, "alive_after": True, "initialized_after": False}
    assert ours == {"alive_after_del": True, "alive_after": False, "initialized_after": False}


def test_shutdown_without_a_process_group_does_nothing() -> None:
    assert not dist.is_initialized()
    shutdown()
    assert not dist.is_initialized()
