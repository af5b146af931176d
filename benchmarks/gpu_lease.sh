#!/usr/bin/env bash
# The checks of a lent GPU machine (benchmarks/README.md, "On a lent GPU"), in parts, each
# bounded by its own timeout so that one call of the device tool fits its 10-minute limit:
#
#   bash benchmarks/gpu_lease.sh PART...        (from the repository root or a snapshot of it)
#
# Parts (seconds each on an H200 from a fresh machine, measured 2026-11-27 where given):
#   llama          Llama 2.0B (Llama-3-8B-shaped blocks) training step, interleaved rows:
#                  bf16, lowprec and torchao tensorwise and rowwise (issue 37 item 4; ~135 s)
#   compiled-bits  compiled vs eager float8 Linear, bit for bit (check_compiled_bits.py; ~60 s)
#   bits           bench_fp8_gpu's bit check of the CUDA quantize kernels against the CPU
#                  (more than 120 s)
#   host-cpu       the machine's own CPU (an Intel Xeon with AVX512-FP16 and AMX on the
#                  lent H100/H200 machines: the CPU of issue 37's report) on 2 of its cores
#                  (taskset): bench_quantize and bench_emulation's reported command
#   probe          what makes that CPU slower (benchmarks/host_probe.py: core layout, compiler,
#                  vector ISA, 1 and 2 threads, subnormals flushed or not, inductor's C++)
#                  and whether its matrix products depend on the operands' alignment
#   repeat         whether a straight run is repeatable there (scripts/repeat_runs.py: the
#                  stress test's command 16 times per recipe, 7 at a time)
#   stress         issue 39's interrupt stress test (scripts/interrupt_stress.py) on that CPU;
#                  STRESS_S (default 400) bounds it, STRESS_TRIALS (default 60) trials
#
# Writes under $OUT (the device tool brings back at most 8 files): lscpu.txt, lease.log
# (everything printed) and one JSON per part. Wheels in .whl/ (torchao, carried) are
# installed first. Nothing here needs the network.
set -u -o pipefail
OUT=${OUT:?set OUT to a folder for the results}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REV=$(cat "$ROOT/REV" 2>/dev/null || git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
LOG="$OUT/lease.log"
if [ "$#" -eq 0 ]; then
  echo "usage: bash benchmarks/gpu_lease.sh PART... (llama, compiled-bits, bits, host-cpu, probe, repeat, stress)" >&2
  exit 2
fi
for part in "$@"; do
  case "$part" in
    llama | compiled-bits | bits | host-cpu | probe | repeat | stress) ;;
    *) echo "error: unknown part '$part' (llama, compiled-bits, bits, host-cpu, probe, repeat, stress)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
if ls "$ROOT"/.whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$ROOT"/.whl/*.whl || exit 1
fi
export PYTHONPATH="/tmp/site:$ROOT" PYTHONUNBUFFERED=1
{ lscpu; echo; lscpu -e; echo; python3 -c "import torch; print('torch', torch.__version__)"; } \
  > "$OUT/lscpu.txt" 2>&1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1; echo "revision $REV"; } | tee -a "$LOG"
cd "$ROOT/benchmarks" || exit 1

run() {  # run SECONDS NAME COMMAND...: one bounded step, its output into the log
  local limit=$1 name=$2 t0=$SECONDS
  shift 2
  echo "== $name (limit $limit s)" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | grep -v -e "SyntaxWarning" -e '"""Configuration class' | tee -a "$LOG" | tail -n 25
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$LOG"
}

for part in "$@"; do
  case "$part" in
    llama)
      run 240 llama python3 bench_llama_gpu.py --interleave --layers 8 --hidden 4096 \
        --intermediate 14336 --heads 32 --kv-heads 8 --batch 8 --steps 20 --budget-s 200 \
        --rows "bf16,lowprec tensorwise,torchao tensorwise,lowprec rowwise,torchao rowwise" \
        --revision "$REV" --out "$OUT/llama_gpu_2b_interleaved.json" ;;
    compiled-bits)
      run 120 compiled-bits python3 check_compiled_bits.py --out "$OUT/compiled_bits.json" ;;
    bits)
      run 240 bits python3 bench_fp8_gpu.py --sections bits --revision "$REV" \
        --out "$OUT/fp8_gpu_bits.json" ;;
    host-cpu)
      run 150 host-quantize taskset -c 0,1 python3 bench_quantize.py --device cpu --threads 2 \
        --repeats 7 --out "$OUT/quantize_host_2t.json"
      run 300 host-emulation taskset -c 0,1 python3 bench_emulation.py --threads 2 \
        --modes eager,compiled --repeats 7 --presets tensorwise,nvfp4 --no-peers --clock wall \
        --profile 2 --out "$OUT/emulation_host_2t.json" ;;
    probe)
      rm -rf /tmp/probe_code /tmp/probe_cache
      export TORCHINDUCTOR_CACHE_DIR=/tmp/probe_cache  # fresh: its generated C++ comes back
      run 200 probe taskset -c 0,1 python3 host_probe.py --out "$OUT/host_probe.json" \
        --code-dir /tmp/probe_code
      unset TORCHINDUCTOR_CACHE_DIR
      tar -czf "$OUT/probe_code.tar.gz" -C /tmp probe_code 2>/dev/null
      # issue 39's hypothesis: oneMKL's GEMMs move a bit with the operands' alignment
      # unless its conditional numerical reproducibility is on
      run 60 probe-cnr env MKL_CBWR=AUTO taskset -c 0,1 python3 host_probe.py --repeat-only \
        --out "$OUT/host_probe_cnr.json" ;;
    repeat)
      run 200 repeat python3 "$ROOT/scripts/repeat_runs.py" --runs 16 --jobs 7 --threads 2 \
        --out /tmp/repeat
      cp /tmp/repeat/results.json "$OUT/repeat_results.json" 2>/dev/null ;;
    stress)
      limit=${STRESS_S:-400}  # LEASE_DEADLINE_S: end by then (seconds since this script began)
      if [ -n "${LEASE_DEADLINE_S:-}" ] && [ $((LEASE_DEADLINE_S - SECONDS)) -lt "$limit" ]; then
        limit=$((LEASE_DEADLINE_S - SECONDS))
      fi
      run "$limit" stress python3 "$ROOT/scripts/interrupt_stress.py" \
        --trials "${STRESS_TRIALS:-60}" --jobs 7 \
        --threads 2 --out /tmp/stress
      cp /tmp/stress/results.json "$OUT/stress_results.json" 2>/dev/null ;;
  esac
done
