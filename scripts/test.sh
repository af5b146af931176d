#!/usr/bin/env bash
# The whole test suite: set up, lint (ruff), type-check (mypy), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${LOWPREC_VENV:-.venv}
"$VENV/bin/python" -m ruff check lowprec tests benchmarks
"$VENV/bin/python" -m mypy
"$VENV/bin/python" -m pytest "$@"
