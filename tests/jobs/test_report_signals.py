"""``lowprec report`` stopped by a signal while its chart workers draw: SIGINT and SIGTERM
stop the workers, remove the temporary files, keep the old page and say so in one line;
after a SIGKILL of the report the workers die with it, and the next report removes the
temporary directory it left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from lowprec.jobs.report import write_report
from lowprec.jobs.train import train
from tests._helpers import ROOT, TINY

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir()
    or not hasattr(os, "sched_getaffinity")
    or len(os.sched_getaffinity(0)) < 2,
    reason="needs /proc and 2 CPUs (the report draws in worker processes only then)",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three tiny runs: 10 charts, enough for the report's worker processes."""
    root = tmp_path_factory.mktemp("runs")
    cfg = replace(TINY, steps=4, eval_every=2, ckpt_every=4)
    out = []
    for r in ("fp32", "fp16", "bf16"):
        train(replace(cfg, recipe=r), root / r, progress=False)
        out.append(root / r)
    return out


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that no one reaps does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _start(runs: list[Path], out: Path, tmp: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """``lowprec report RUNS -o out --force`` with its temporary files in ``tmp``, once its
    chart workers have started; the process and its workers' pids."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    argv = ["report", *map(str, runs), "-o", str(out), "--force"]
    p = subprocess.Popen(
        [sys.executable, "-m", "lowprec", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 240
    while not (kids := _children(p.pid)):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            _, err = p.communicate()
            pytest.fail(f"no chart workers started (rc {p.returncode}): {err[-2000:]}")
        time.sleep(0.01)
    time.sleep(0.3)  # every worker started
    return p, _children(p.pid) or kids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_drawing_stops_the_workers_and_keeps_the_old_page(
    runs: list[Path], tmp_path: Path, sig: signal.Signals
) -> None:
    """SIGTERM killed the report by the signal, orphaning its workers and leaving their
    pickles and PNGs in the temporary folder; a Ctrl-C said "aborted; run directories keep
    their last checkpoint"."""
    out, tmp = tmp_path / "page.html", tmp_path / "tmp"
    tmp.mkdir()
    out.write_text("the old page")
    p, kids = _start(runs, out, tmp)
    p.send_signal(sig)
    stdout, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, err
    assert err == f"lowprec report: interrupted ({sig.name}); no report written to {out}\n"
    assert stdout == ""
    assert out.read_text() == "the old page"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["page.html", "tmp"]  # no .tmp
    assert list(tmp.iterdir()) == []  # the workers' pickles and PNGs are gone
    assert not any(_alive(k) for k in kids)


def test_workers_die_with_a_killed_report_and_the_next_report_cleans_up(
    runs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL cannot be handled: the workers notice their parent is gone and exit (they
    drew on, orphaned), and the temporary directory left behind is removed by the next
    report (it stayed forever)."""
    out, tmp = tmp_path / "page.html", tmp_path / "tmp"
    tmp.mkdir()
    p, kids = _start(runs, out, tmp)
    p.kill()
    p.communicate(timeout=60)
    deadline = time.monotonic() + 3  # the workers were still importing torch
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(k) for k in kids), "a chart worker outlived the killed report"
    assert not out.exists()
    assert list(tmp.iterdir())  # what the killed report left behind
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    write_report(runs[:1], tmp_path / "next.html")
    assert list(tmp.iterdir()) == []


def test_a_ctrl_c_during_the_final_write_waits_for_the_page(
    runs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C inside the page's atomic write cut it (a stale ``.tmp``, no page) and was
    then reported as "no report written" even where the rename had happened: it now waits
    for the write, and comes after it as a plain ``KeyboardInterrupt``."""
    import lowprec.jobs.report as report

    real = report.write_atomic

    def write(path: Path, data: str) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**6):  # Python code for a handler to run in
            pass
        real(path, data)

    monkeypatch.setattr(report, "write_atomic", write)
    out = tmp_path / "page.html"
    with pytest.raises(KeyboardInterrupt) as e:
        write_report(runs[:1], out)
    assert not isinstance(e.value, report.ReportInterrupted)
    assert out.read_text().endswith("</html>")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["page.html"]
