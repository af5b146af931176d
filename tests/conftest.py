"""Fixtures shared by the test folders."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from lowprec.core.warn import reset_warnings


@pytest.fixture(autouse=True)
def _fresh_warn_once() -> None:
    """Every test starts with lowprec's warn-once keys forgotten: a test that checks a
    warning is logged must not depend on which tests its pytest worker ran before it."""
    reset_warnings()


class Payload:
    """An object whose unpickling creates the file ``marker`` (``open(marker, "w")``): the
    stand-in for code hidden in a file that lowprec reads."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.marker, "w"))


@pytest.fixture
def payload(tmp_path: Path) -> tuple[Payload, bytes, Path]:
    """``(object, its pickle, marker)``: unpickling either creates ``marker``."""
    marker = tmp_path / "payload-ran"
    obj = Payload(marker)
    data = pickle.dumps(obj)
    pickle.loads(data).close()  # the payload is live: unpickling it does create the file
    assert marker.exists()
    marker.unlink()
    return obj, data, marker
