#!/usr/bin/env bash
# The main job: set up, then train the reference model once per recipe and compare
# (`lowprec demo`: each failure next to its cure, under 5 minutes on 2 cores; --quick: a
# smoke run under a minute; --all: every recipe).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --runtime
VENV=${LOWPREC_VENV:-.venv}
"$VENV/bin/lowprec" demo "$@"
