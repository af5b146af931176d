#!/usr/bin/env bash
# The whole test suite: set up, lint and format check (ruff), type-check (mypy), then pytest
# (tests/ and the >>> examples of every module under lowprec/, see pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."

# Headless Chromium for tests/test_report_browser.py: Debian's chromium and chromium-driver
# (/usr/bin/chromium, /usr/bin/chromedriver), installed with apt-get when missing and when
# this user may (root, or passwordless sudo). Otherwise a note, and that test skips (it
# fails instead when LOWPREC_REQUIRE_BROWSER=1, as in CI).
install_browser() {
    if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
        return 0
    fi
    local sudo=() log
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "[test] NOTE: no apt-get, cannot install chromium/chromium-driver; the browser test will skip"
        return 0
    fi
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            echo "[test] NOTE: not root and no passwordless sudo, cannot install chromium/chromium-driver;" \
                "the browser test will skip (install them: apt-get install chromium chromium-driver)"
            return 0
        fi
    fi
    local install=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q
                   --no-install-recommends chromium chromium-driver)
    log=$(mktemp)
    echo "[test] installing chromium chromium-driver (apt-get)"
    if ! "${install[@]}" >"$log" 2>&1; then
        echo "[test] install failed (no or stale package lists?); apt-get update, then retrying"
        if ! { "${sudo[@]}" apt-get update -q && "${install[@]}"; } >"$log" 2>&1; then
            tail -n 20 "$log"
            echo "[test] NOTE: could not install chromium/chromium-driver; the browser test will skip"
            rm -f "$log"
            return 0
        fi
    fi
    rm -f "$log"
    echo "[test] $(/usr/bin/chromium --version 2>/dev/null || echo 'chromium ?'), $(/usr/bin/chromedriver --version 2>/dev/null | cut -d' ' -f1-2)"
}

bash scripts/bootstrap.sh
install_browser
VENV=${LOWPREC_VENV:-.venv}
"$VENV/bin/python" -m ruff check lowprec tests benchmarks
"$VENV/bin/python" -m ruff format --check lowprec tests benchmarks
"$VENV/bin/python" -m mypy
# pytest in parallel (pytest-xdist, a dev extra): one worker per core, at most 4
# (LOWPREC_TEST_WORKERS overrides; 0 runs in this process), each test file whole on one
# worker (--dist loadfile: a file's module-scoped fixtures are built once), and torch on
# one thread in each (OMP_NUM_THREADS, unless set: workers x torch's default threads would
# oversubscribe the cores). Arguments after the script's name go to pytest and win
# (`bash scripts/test.sh -n 0 tests/core`).
workers=${LOWPREC_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
case "$workers" in
    "" | *[!0-9]*) echo "error: LOWPREC_TEST_WORKERS must be a whole number, got '$workers'" >&2; exit 2 ;;
esac
if [ "$workers" -gt 4 ]; then workers=4; fi
if [ "$workers" -gt 1 ]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    "$VENV/bin/python" -m pytest -n "$workers" --dist loadfile "$@"
else
    "$VENV/bin/python" -m pytest "$@"
fi
