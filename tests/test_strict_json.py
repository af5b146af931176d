"""Every JSON file lowprec writes is strict JSON: no module of ``lowprec/`` calls
``json.dump``/``json.dumps`` itself except ``lowprec/_json.py`` (NaN/Inf as strings) or with
``allow_nan=False``; and the demo's files are written through ``lowprec._json``."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from lowprec._json import dumps, loads

PKG = Path(__file__).resolve().parents[1] / "lowprec"


def _loose_dumps() -> list[str]:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "_json.py" and path.parent == PKG:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            f = node.func
            if (
                isinstance(f.value, ast.Name)
                and f.value.id == "json"
                and f.attr in ("dump", "dumps")
            ):
                strict = any(
                    k.arg == "allow_nan"
                    and isinstance(k.value, ast.Constant)
                    and k.value.value is False
                    for k in node.keywords
                )
                if not strict:
                    found.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    return found


def test_no_module_writes_loose_json() -> None:
    assert not _loose_dumps(), "json.dump(s) without allow_nan=False: " + ", ".join(_loose_dumps())


def test_the_strict_writer_round_trips_non_finite_numbers() -> None:
    text = dumps({"loss": float("nan"), "hi": float("inf"), "lo": -float("inf"), "x": 1.5})

    def refuse(name: str) -> None:
        raise ValueError(f"bare {name} in strict JSON")

    json.loads(text, parse_constant=refuse)  # a strict parser accepts it
    back = loads(text)
    assert math.isnan(back["loss"]) and back["hi"] == math.inf and back["lo"] == -math.inf
    assert back["x"] == 1.5
    with pytest.raises(ValueError, match="bare NaN"):
        json.loads(json.dumps(float("nan")), parse_constant=refuse)  # the control
