#!/usr/bin/env bash
# The main job: set up, then train the reference model once per recipe and compare
# (`lowprec demo`; pass --quick for a two-minute smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${LOWPREC_VENV:-.venv}
"$VENV/bin/lowprec" demo "$@"
