"""lowprec.jobs.report and ``lowprec report``: the HTML page, diagnoses, bad input, divergence."""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from lowprec.cli import main
from lowprec.jobs.report import Run, diagnose, load_run, write_report
from lowprec.jobs.rundir import RunNote
from lowprec.jobs.train import NUMERICS, RunError, TrainConfig, train
from tests._helpers import cli_error

TINY = TrainConfig(
    steps=6, batch_size=8, seq_len=32, width=32, depth=1, heads=2, eval_every=3, eval_batches=2
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for r in ("fp32", "fp16"):
        train(replace(TINY, recipe=r), root / r, progress=False)
        out[r] = root / r
    return out


def test_train_records_numerics_at_first_and_last_step(runs: dict[str, Path]) -> None:
    recs = [json.loads(ln) for ln in (runs["fp16"] / NUMERICS).read_text().splitlines()]
    assert {r["step"] for r in recs} == {0, TINY.steps - 1}
    names = {(r["name"], r["kind"]) for r in recs}
    for want in (
        ("head", "output"),
        ("head", "grad_output"),
        ("blocks.0.fc.weight", "weight"),
        ("blocks.0.fc.weight", "weight_grad"),
        ("tok", "output"),
    ):
        assert want in names
    assert set(recs[0]["below_normal"]) == {"fp16", "bf16", "e4m3fn", "e5m2"}


def test_resume_keeps_numerics_exact(tmp_path: Path) -> None:
    cfg = replace(TINY, recipe="bf16")
    train(cfg, tmp_path / "a", progress=False)
    train(cfg, tmp_path / "b", progress=False, stop_after=3)
    train(cfg, tmp_path / "b", resume=True, progress=False)
    a, b = ((tmp_path / d / NUMERICS).read_text() for d in ("a", "b"))
    assert a == b  # same records, no duplicates after the resume


def test_report_page(runs: dict[str, Path], tmp_path: Path) -> None:
    out = write_report([runs["fp32"], runs["fp16"]], tmp_path / "r.html", title="t")
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<h1>t</h1>" in page
    # loss curves + per run: scale charts at init and end + exponent histograms
    assert len(re.findall(r'<img src="data:image/png;base64,', page)) == 1 + 3 * 2
    assert 'src="http' not in page and "<script" not in page  # self-contained, static
    assert "underflow in fp16" in page  # the fp16 run's own gradients
    # the summary's worst gradient underflow is judged in the format each run stores its
    # tensors in: nothing underflows FP32; the fp16 run in its own fp16. No table judges a
    # tensor in a format it did not pass through (these runs have no FP8 casts).
    worst = re.findall(r"<td>[\d.]+% \((\w+), [\w.]+ [a-z ]+\)</td>", page)
    assert worst == ["fp16"], worst
    cells = re.findall(r"<td>([^<]*)</td>", page)
    assert not [c for c in cells if "e4m3" in c or "e5m2" in c or c == "bf16"], cells
    assert page.count('class="run"') == 2


def test_diagnosis_names_tensor_format_and_fix(runs: dict[str, Path]) -> None:
    notes = diagnose(load_run(runs["fp16"]))
    first = notes[0]
    assert re.match(
        r"[\d.]+% of the (activation|weight) gradients of \S+ underflow in fp16 "
        r"\(below its smallest normal, 6.1e-05\) at step 5",
        first,
    ), first
    assert "use loss scaling or unit scaling" in first
    fp32 = diagnose(load_run(runs["fp32"]))
    assert not any("underflow" in n and "Healthy" not in n for n in fp32), fp32  # stored in FP32


def test_healthy_run_says_so(runs: dict[str, Path]) -> None:
    run = load_run(runs["fp32"])
    calm = [
        {
            **r,
            "below_normal": {k: 0.0 for k in r["below_normal"]},
            "above_max": {k: 0.0 for k in r["above_max"]},
        }
        for r in run.numerics
    ]
    notes = diagnose(Run(run.path, run.config, run.metrics, run.summary, calm))
    assert notes == [
        f"Healthy at step {TINY.steps - 1}: no gradient has 25% of its values below the "
        "smallest normal and nothing overflows in fp32, and no low-precision GEMM cast "
        "flushes 25% or saturates."
    ]
    assert "gradients" in diagnose(load_run(runs["fp16"]))[0]


def test_diverged_run_is_reported_with_its_step(runs: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "diverged"
    shutil.copytree(runs["fp32"], d)
    lines = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        if r["step"] >= 4:
            r["loss"] = math.nan
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (d / "summary.json").unlink()
    run = load_run(d)
    assert run.summary["diverged_at"] == 4
    assert diagnose(run)[0].startswith("The loss became NaN/Inf at step 4")
    page = write_report([runs["fp32"], d], tmp_path / "r.html").read_text()
    assert "<td>step 4</td>" in page and "diverged" in page


def test_not_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RunError, match=r"not a lowprec run directory: no config\.json"):
        load_run(tmp_path)
    with pytest.raises(RunError, match="not a directory"):
        load_run(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(RunError, match="no recorded steps"):
        load_run(tmp_path)
    with pytest.raises(ValueError, match="at least one"):
        write_report([], tmp_path / "x.html")


def test_cli_report(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli.html"
    assert main(["report", str(runs["fp32"]), str(runs["fp16"]), "-o", str(out)]) == 0
    assert f"report: {out}" in capsys.readouterr().out and out.is_file()
    for argv, msg in (
        ([str(tmp_path)], "not a lowprec run directory"),
        ([str(runs["fp32"]), "-o", str(tmp_path / "r.txt")], "--out"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["report", *argv])
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_report_out_takes_html_or_htm(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``-o`` ends in ``.html`` or ``.htm``, in any case (docs/cli.md); anything else is
    one ``error:`` line naming both, and nothing is written."""
    for name in ("r.htm", "R.HTML"):
        out = tmp_path / name
        assert main(["report", str(runs["fp32"]), "-o", str(out)]) == 0
        assert out.read_text().startswith("<!DOCTYPE html>")
    capsys.readouterr()
    for name in ("r.txt", "r.html.bak", "r"):
        line = cli_error(["report", str(runs["fp32"]), "-o", str(tmp_path / name)], capsys)
        assert line == (
            f"lowprec report: error: --out: {tmp_path / name} must end in .html or .htm "
            f"(got {Path(name).suffix or 'no suffix'})"
        )
        assert not (tmp_path / name).exists()


def test_float8_run_is_judged_in_its_own_format(tmp_path: Path) -> None:
    """A float8 recipe's tracked tensors are judged in the run's own format (bf16); its
    FP8 casts by what they measurably did (gemms.jsonl), never by unscaled shares."""
    train(replace(TINY, recipe="fp8-tensorwise"), tmp_path / "f8", progress=False)
    run = load_run(tmp_path / "f8")
    assert run.float8 == "tensorwise" and run.gemms
    assert {r["gemm"] for r in run.gemms} == {"forward", "input_grad", "weight_grad"}
    notes = diagnose(run)
    assert notes[0].startswith("The low-precision GEMMs' casts flush and saturate little")
    assert not any("e5m2" in n or "e4m3fn" in n or "would" in n for n in notes)


def test_truncated_numerics_and_runs_without_evaluation(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(runs["fp32"], bad)
    text = (bad / NUMERICS).read_text()
    lines = text.splitlines(keepends=True)
    (bad / NUMERICS).write_text(text[: len(text) // 2])  # killed mid-write: a torn last line
    whole = text[: len(text) // 2].count("\n")
    with pytest.warns(RunNote, match="dropped a torn last line"):
        assert len(load_run(bad).numerics) == whole  # the whole lines before it are kept
    (bad / NUMERICS).write_text("".join(lines[:2]) + "{torn\n" + "".join(lines[2:]))
    with pytest.raises(RunError, match=r"line 3 is not a JSON object.*corrupt or truncated"):
        load_run(bad)  # a bad line in the middle is not a torn append: an error
    early = tmp_path / "early"
    train(replace(TINY, recipe="fp32"), early, progress=False, stop_after=2)  # no eval yet
    page = write_report([early, runs["fp32"]], tmp_path / "r.html").read_text()
    row = re.findall(r"<tr><td>early</td>.*?</tr>", page)[0]
    assert "NaN" not in page.split("<h2>Loss curves")[0] and "<td>–</td>" in row


def test_stopped_runs_and_same_named_runs(runs: dict[str, Path], tmp_path: Path) -> None:
    stopped = tmp_path / "a" / "fp32"
    train(replace(TINY, recipe="fp32"), stopped, progress=False, stop_after=4)
    run = load_run(stopped)
    assert run.stopped_early and run.planned_steps == TINY.steps
    assert any(n.startswith("The run stopped at step 4 of 6") for n in diagnose(run))
    page = write_report([runs["fp32"], stopped], tmp_path / "r.html").read_text()
    assert "<td>4 of 6</td>" in page and "<td>6</td>" in page
    # two directories both named fp32 get told apart by their parent folder
    assert f"<td>{runs['fp32'].parent.name}/fp32</td>" in page and "<td>a/fp32</td>" in page
    assert not load_run(runs["fp32"]).stopped_early


_UNGUARDED_SCRIPT = """
import sys
from pathlib import Path
with open(sys.argv[1], "a") as f:  # one line per execution of this script
    f.write("ran\\n")
from lowprec.jobs.report import write_report
write_report([sys.argv[2], sys.argv[3], sys.argv[4]], sys.argv[5])
"""


def test_report_from_a_script_without_main_guard(runs: dict[str, Path], tmp_path: Path) -> None:
    """A user's script that calls ``write_report`` at top level (no ``if __name__ ==
    "__main__"``), with enough charts for the parallel drawing: the chart workers never
    re-run the script (the spawn start method would, and crash it)."""
    import shutil
    import subprocess
    import sys

    script, ran, page = tmp_path / "user.py", tmp_path / "ran.txt", tmp_path / "r.html"
    script.write_text(_UNGUARDED_SCRIPT)
    twin = tmp_path / "fp32-copy"  # a third run (the same run twice is refused)
    shutil.copytree(runs["fp32"], twin)
    args = [str(ran), str(runs["fp32"]), str(runs["fp16"]), str(twin), str(page)]
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ran.read_text() == "ran\n"
    # 1 + 3 per run: 10 charts, over 8
    assert len(re.findall(r'<img src="data:image/png;base64,', page.read_text())) == 10
