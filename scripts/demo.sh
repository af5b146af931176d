#!/usr/bin/env bash
# The main job: set up, then run it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${LOWPREC_VENV:-.venv}
"$VENV/bin/lowprec" formats --snr snr.png "$@"
