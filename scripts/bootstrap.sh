#!/usr/bin/env bash
# Create .venv (if missing), install torch==2.13.0 only when no torch is importable, then
# install lowprec: with its test/dev extras (the default, for scripts/test.sh), or with
# `--runtime` only what it needs to run (scripts/demo.sh: torch, numpy, matplotlib, rich),
# skipping pip altogether when this checkout's lowprec and those already import.
# Safe to run repeatedly.
#
# Never pulls the CUDA build of torch: torch is installed first, pinned, and the package
# install afterwards is checked not to have replaced it. Set LOWPREC_TORCH_INDEX (for
# example https://download.pytorch.org/whl/cpu) where the default index would give a
# CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    "") TARGET=".[dev]" ;;
    --runtime) TARGET="." ;;
    *) echo "error: unknown option ${1} (usage: bootstrap.sh [--runtime])" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
VENV=${LOWPREC_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    echo "[bootstrap] creating $VENV (sees system site-packages, so an installed torch is reused)"
    "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
# -P: import lowprec as installed, not from the current directory
if [ "$TARGET" = "." ] && [ -x "$VENV/bin/lowprec" ] && "$VPY" -P - "$PWD" 2>/dev/null <<'PYEOF'
import sys
from pathlib import Path

import matplotlib, numpy, rich, torch  # noqa: F401  (the runtime dependencies)
import lowprec

assert Path(lowprec.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve())
PYEOF
then
    echo "[bootstrap] ready: lowprec and its runtime dependencies already importable"
    exit 0
fi
if "$VPY" -c "import torch" 2>/dev/null; then
    echo "[bootstrap] torch $("$VPY" -c 'import torch; print(torch.__version__)') already importable"
else
    echo "[bootstrap] installing torch==2.13.0"
    if [ -n "${LOWPREC_TORCH_INDEX:-}" ]; then
        "$VPY" -m pip install -q "torch==2.13.0" --index-url "$LOWPREC_TORCH_INDEX"
    else
        "$VPY" -m pip install -q "torch==2.13.0"
    fi
fi
before=$("$VPY" -c 'import torch; print(torch.__version__)')
echo "[bootstrap] installing lowprec ($TARGET)"
# The extras (transformers, accelerate, lightning) depend on torch: pin the one installed.
constraints=$(mktemp)
echo "torch==$before" >"$constraints"
"$VPY" -m pip install -q -c "$constraints" -e "$TARGET"
rm -f "$constraints"
after=$("$VPY" -c 'import torch; print(torch.__version__)')
if [ "$before" != "$after" ]; then
    echo "[bootstrap] ERROR: installing lowprec replaced torch $before with $after" >&2
    exit 1
fi
echo "[bootstrap] ready: $("$VPY" -c 'import torch, lowprec; print("lowprec", lowprec.__version__, "torch", torch.__version__)')"
