"""Scoped configuration: a scalify'd call's config holds for its forward and its backward
only, whatever runs in between and in whichever thread.

Reference numbers: a 64-256-64 MLP's first-layer weight gradient in FP16 scaled arithmetic
is within ~1e-3 of FP64 (a few FP16 roundings chained, unit roundoff 2^-11); with FP8 matmul
inputs (E5M2 gradients, unit roundoff 2^-3) the error is tens of times larger. So an FP16
model's backward that ran under an FP8 config would miss the 5e-3 bound by far; the
stronger check is bitwise equality with the same call run alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from lowprec.scalify import ScalifyConfig, config, current_config, scaled, scalify, set_config
from lowprec.scalify.domains import is_grad

FP16_GRAD_TOL = 5e-3  # chained FP16 roundings (see test_scalify.py); FP8 gradients: ~6e-2
X = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def grads(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in m.parameters() if p.grad is not None]


def isolated(fmt: str, steps: int = 1) -> list[torch.Tensor]:
    m = mlp()
    s = scalify(m, fmt)
    for _ in range(steps):
        s(X).square().mean().backward()
    return grads(m)


def fp64_grad() -> torch.Tensor:
    m = mlp().double()
    m(X.double()).square().mean().backward()
    w = m[0].weight.grad
    assert w is not None
    return w


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


ORDERS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "fA fB bA bB": lambda a, b: (a.backward(), b.backward()) and None,
    "fA fB bB bA": lambda a, b: (b.backward(), a.backward()) and None,
    "one backward": lambda a, b: (a + b).backward(),
}


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("first", ["fp16", "fp8"])
def test_interleaved_models_keep_their_own_config(order: str, first: str) -> None:
    """An FP16 and an FP8 model called one after the other: each backward uses its own
    model's config (bitwise the isolated result), in every interleaving."""
    ma, mb = mlp(), mlp()
    a, b = scalify(ma, "fp16"), scalify(mb, "fp8")
    if first == "fp16":
        la, lb = a(X).square().mean(), b(X).square().mean()
    else:
        lb = b(X).square().mean()
        la = a(X).square().mean()
    ORDERS[order](la, lb)
    for got, want in zip(grads(ma), isolated("fp16"), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(grads(mb), isolated("fp8"), strict=True):
        assert torch.equal(got, want)
    assert rel(ma[0].weight.grad, fp64_grad()) < FP16_GRAD_TOL  # type: ignore[arg-type]
    assert current_config() == ScalifyConfig()  # nothing outlives the calls


def test_fp8_gradient_error_is_what_the_bound_excludes() -> None:
    """The tolerance above separates the configs: FP8's weight-gradient error exceeds it."""
    ref = fp64_grad()
    assert rel(isolated("fp16")[0], ref) < FP16_GRAD_TOL < rel(isolated("fp8")[0], ref)


@pytest.fixture
def one_intra_op_thread() -> Iterator[None]:
    """Bitwise comparisons across threads need kernels whose reduction order does not
    depend on how many of torch's intra-op workers are free when a thread calls them:
    with one intra-op thread every kernel runs serially, whoever calls it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.mark.usefixtures("one_intra_op_thread")
def test_two_threads_match_isolated_runs_bitwise() -> None:
    """Two threads train an FP16 and an FP8 model concurrently (forced to overlap at every
    step); each thread's gradients equal the isolated run's bit for bit."""
    steps = 3
    want = {"fp16": isolated("fp16", steps), "fp8": isolated("fp8", steps)}
    got: dict[str, list[torch.Tensor]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    # Built here, not in the threads: mlp() seeds and draws from the global RNG.
    models = {fmt: mlp() for fmt in want}

    def work(fmt: str) -> None:
        try:
            m = models[fmt]
            s = scalify(m, fmt)
            for _ in range(steps):
                loss = s(X).square().mean()
                barrier.wait()  # both forwards done before either backward
                loss.backward()
                barrier.wait()
            got[fmt] = grads(m)
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(f,)) for f in ("fp16", "fp8")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for fmt in want:
        for g, w in zip(got[fmt], want[fmt], strict=True):
            assert torch.equal(g, w), fmt


def test_config_blocks_are_per_thread() -> None:
    seen: list[str] = []
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        seen.append(current_config().pow2)  # main thread is inside its block now
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with config(pow2="down"):
        inside.set()
        done.wait()
        assert current_config().pow2 == "down"
    t.join()
    assert seen == ["none"] and current_config().pow2 == "none"


def test_set_config_is_the_calling_threads_default_only() -> None:
    seen: list[str] = []
    set_config(ScalifyConfig(pow2="up"))
    try:
        t = threading.Thread(target=lambda: seen.append(current_config().pow2))
        t.start()
        t.join()
        assert seen == ["none"] and current_config().pow2 == "up"
        y = scaled(torch.ones(4).half(), 1.0) * 3.0  # hand-made tensors: the thread's config
        assert float(y.scale) == 4.0
        with pytest.raises(TypeError, match="cfg must be a ScalifyConfig"):
            set_config("fp16")  # type: ignore[arg-type]
    finally:
        set_config(ScalifyConfig())


def test_region_ignores_the_callers_config_and_records_its_own() -> None:
    """A scalify'd module runs under its own config even inside a caller's block; its
    gradients record it (domain ``scalify.grad@<key>``)."""
    m = mlp()
    seen: list[str] = []
    m[1].register_full_backward_hook(lambda mod, gi, go: seen.append(go[0].domain))
    with config(data_format="bf16"):
        y = scalify(m, "fp8")(X)
    y.square().mean().backward()
    assert seen and all(d.startswith("scalify.grad@fp8,") for d in seen)
    for g, w in zip(grads(m), isolated("fp8"), strict=True):
        assert torch.equal(g, w)
    assert is_grad(scaled(torch.ones(1), 1.0)) is False


@pytest.mark.slow
def test_torch_compile_two_configs_each_match_eager() -> None:
    """Two compiled models of different configs (one forward code): each equals its eager
    run (the config is in the ScaledTensor metadata, which the compiled graphs guard on)."""
    import torch._inductor.config as inductor_config

    eager = {f: isolated(f) for f in ("fp16", "fp8")}
    models = {f: mlp() for f in eager}
    with inductor_config.patch(emulate_precision_casts=True):
        compiled = {f: torch.compile(scalify(m, f)) for f, m in models.items()}
        losses = {f: c(X).square().mean() for f, c in compiled.items()}
        losses["fp16"].backward()
        losses["fp8"].backward()
    for f, m in models.items():
        for g, w in zip(grads(m), eager[f], strict=True):
            # same rules traced, same roundings: equal up to float32 reassociation
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), f


def test_pickled_module_runs_in_a_fresh_process(tmp_path: object) -> None:
    """A Scalified module unpickled where its config was never seen registers it again."""
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    m = mlp()
    path = Path(str(tmp_path)) / "m.pkl"
    path.write_bytes(pickle.dumps(scalify(m, "fp8", policy="dynamic")))
    code = (
        "import pickle, sys, torch\n"
        f"s = pickle.loads(open({str(path)!r}, 'rb').read())\n"
        "s(torch.ones(2, 64)).sum().backward()\n"
        "print(s.config.rescale, s.module[0].weight.grad.isfinite().all().item())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["max", "True"]
