"""Reports the fuzz suite's call counts after the run (docs/reliability.md quotes them)."""

from __future__ import annotations

from typing import Any

from tests.fuzz._support import CALLS, EXAMPLES, REFUSED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not CALLS:
        return
    total, refused = sum(CALLS.values()), sum(REFUSED.values())
    terminalreporter.write_sep("-", "lowprec fuzz")
    terminalreporter.write_line(
        f"{total} calls of {len(CALLS)} entry points ({refused} refused with a named "
        f"ValueError/TypeError), {EXAMPLES} examples per test function"
    )
    for name, n in sorted(CALLS.items()):
        terminalreporter.write_line(f"  {name}: {n} calls, {REFUSED[name]} refused")
