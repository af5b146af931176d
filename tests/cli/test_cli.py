"""Tests of the ``lowprec`` command line tool (``lowprec/cli.py``).

The SNR numbers are checked against independent oracles: numpy's ``float16`` cast and
``ml_dtypes``' ``bfloat16`` / ``float8_e4m3fn`` / ``float8_e5m2`` casts of the same sample.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import lowprec
from lowprec.cli import SNR_SAMPLES, SNR_SEED, main, unit_normal
from lowprec.core.formats import format_names

ORACLE_DTYPES: dict[str, type] = {
    "fp16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
}
MANTISSA_BITS = {"fp16": 10, "bf16": 7, "e4m3fn": 3, "e5m2": 2}
KS = range(-30, 31)  # the default sweep


def _rows(text: str) -> list[list[str]]:
    """Cells of every table row in rich's output (unicode or ASCII box characters)."""
    rows = []
    for line in text.splitlines():
        if line.count("│") + line.count("┃") + line.count("|") >= 2:
            rows.append([c.strip() for c in re.split(r"[│┃|]", line)[1:-1]])
    return rows


def _table(text: str, first_header: str) -> dict[str, dict[str, str]]:
    """The table whose header row starts with ``first_header``, as ``{first cell: row}``."""
    rows = _rows(text)
    i = next(i for i, r in enumerate(rows) if r and r[0] == first_header)
    header = rows[i]
    table = {}
    for r in rows[i + 1 :]:
        if len(r) != len(header) or r[0] == header[0]:
            break  # the next table
        table[r[0]] = dict(zip(header, r, strict=True))
    return table


def _oracle_snr(x: np.ndarray, dtype: type) -> float:
    """``snr_db``'s definition with an independent cast: overflow (Inf/NaN) loses ``x``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns on overflow to inf
        q = x.astype(dtype).astype(np.float64)
    err = np.where(np.isfinite(q), x - q, x)
    return 10.0 * math.log10(float((x**2).sum()) / float((err**2).sum()))


def _window(ks: list[int], snr: list[float], db: float = 3.0) -> tuple[int, int]:
    """Contiguous run of k around the first peak that stays within ``db`` of the peak."""
    i = int(np.argmax(snr))
    lo = hi = i
    while lo > 0 and snr[lo - 1] >= snr[i] - db:
        lo -= 1
    while hi < len(snr) - 1 and snr[hi + 1] >= snr[i] - db:
        hi += 1
    return ks[lo], ks[hi]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Output of ``lowprec formats --snr PATH`` with the default formats and k range."""
    path = tmp_path_factory.mktemp("cli") / "plots" / "snr.png"  # parent dir is created
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["formats", "--snr", str(path)]) == 0
    return out.getvalue(), path


def test_formats_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats"]) == 0
    table = _table(capsys.readouterr().out, "name")
    assert list(table) == format_names()
    assert table["e4m3fn"]["max"] == "448"
    assert table["e5m2"]["max"] == "57344"
    assert table["fp16"]["max"] == "65504"
    assert table["fp16"]["min subnormal"] == "2^-24"
    assert table["fp16"]["binades"] == "40.0"
    assert table["e4m3fn"]["torch dtype"] == "float8_e4m3fn"
    assert table["e2m1"]["torch dtype"] == "-"
    assert table["e8m0"]["special"] == "fn, unsigned"


def test_unit_normal_is_the_documented_sample() -> None:
    g = torch.Generator().manual_seed(SNR_SEED)
    expected = torch.randn(SNR_SAMPLES, generator=g, dtype=torch.float64)
    assert torch.equal(unit_normal(), expected)


def test_snr_png(sweep: tuple[str, Path]) -> None:
    out, path = sweep
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 600 and height >= 400
    assert len(data) > 20_000  # four curves, axes and a legend; a blank figure is ~5 kB
    assert f"wrote {path}" in out


@pytest.mark.parametrize("name", list(ORACLE_DTYPES))
def test_snr_summary_matches_independent_cast(sweep: tuple[str, Path], name: str) -> None:
    row = _table(sweep[0], "format")[name]
    x = np.asarray(
        torch.randn(
            SNR_SAMPLES, generator=torch.Generator().manual_seed(SNR_SEED), dtype=torch.float64
        )
    )
    oracle = [_oracle_snr(x * 2.0**k, ORACLE_DTYPES[name]) for k in KS]
    # Both round the same sample exactly, so only the printed 2 decimals differ.
    assert float(row["peak SNR (dB)"]) == pytest.approx(max(oracle), abs=0.0051)
    lo, hi = _window(list(KS), oracle)
    assert (int(row["usable k from"]), int(row["to"])) == (lo, hi)
    assert row["width"].rstrip("*") == str(hi - lo + 1)


@pytest.mark.parametrize("name", list(ORACLE_DTYPES))
def test_snr_peak_near_theory(sweep: tuple[str, Path], name: str) -> None:
    # Rounding error uniform in ±ulp/2 with log-uniform significands gives
    # SNR = 10·log10(12 · 3/(2 ln 2) · 4^M) = 6.02·M + 14.15 dB. A normal sample's
    # significands are not quite log-uniform: it reads about 0.7 dB lower; allow 0.4..1.0.
    peak = float(_table(sweep[0], "format")[name]["peak SNR (dB)"])
    theory = 10 * math.log10(12 * 3 / (2 * math.log(2)) * 4.0 ** MANTISSA_BITS[name])
    assert theory - 1.0 < peak < theory - 0.4
    expected_peak = {"fp16": 73.65, "bf16": 55.60, "e4m3fn": 31.52, "e5m2": 25.51}[name]
    assert peak == pytest.approx(expected_peak, abs=0.01)  # seed 0, measured once


def test_snr_windows_and_edge_marker(sweep: tuple[str, Path]) -> None:
    table = _table(sweep[0], "format")
    assert list(table) == ["fp16", "bf16", "e4m3fn", "e5m2"]
    assert table["bf16"]["width"] == "61*"  # bf16's range covers the whole sweep
    assert not table["e4m3fn"]["width"].endswith("*")


def test_snr_formats_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "snr.png"
    argv = [
        "formats",
        "--snr",
        str(path),
        "--formats",
        "e4m3fn,e2m1",
        "fp8_e4m3",
        "e3m4",
        "--kmin",
        "-2",
        "--kmax",
        "2",
    ]
    assert main(argv) == 0
    table = _table(capsys.readouterr().out, "format")
    assert list(table) == ["e4m3fn", "e2m1", "e3m4"]  # alias fp8_e4m3 is e4m3fn: no repeat
    assert table["e4m3fn"]["width"] == "5*"
    assert path.is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["formats", "--snr", "x.png", "--formats", "fp16,bogus"], "argument --formats"),
        (["formats", "--snr", "x.png", "--formats", "e9m2"], "argument --formats"),
        (["formats", "--formats", "fp16"], "--formats: only used together with --snr"),
        (["formats", "--snr", "x.png", "--kmin", "3", "--kmax", "2"], "--kmin/--kmax"),
        (["formats", "--snr", "x.png", "--kmax", "1000"], "--kmin/--kmax"),
        (["nonsense"], "invalid choice"),
        ([], "COMMAND"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""  # nothing printed before the error
    assert not (tmp_path / "x.png").exists()


def test_bad_format_message_names_option_and_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["formats", "--snr", "x.png", "--formats", "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--formats" in err and "'bogus'" in err and "e4m3fn" in err  # lists valid names


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"lowprec {lowprec.__version__}"


def _console_script() -> Path:
    return Path(sys.executable).parent / "lowprec"


@pytest.mark.parametrize(
    "command",
    [
        pytest.param([sys.executable, "-m", "lowprec"], id="python-m"),
        pytest.param(
            [str(_console_script())],
            id="console-script",
            marks=pytest.mark.skipif(
                not _console_script().is_file(), reason="package not installed in this environment"
            ),
        ),
    ],
)
def test_subprocess(command: list[str]) -> None:
    proc = subprocess.run([*command, "formats"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "e4m3fn" in proc.stdout and "57344" in proc.stdout
