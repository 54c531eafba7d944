#!/usr/bin/env bash
# The GPU bundle's run script (copied to <bundle>/run.sh by scripts/gpu-bundle.sh). Runs every
# bundled test binary, the main job with --device and the benchmark against an installed
# PyTorch's libtorch, and writes under $OUT (the device tool's output folder; default
# <bundle>/out):
#   run.log      everything, in order
#   summary.txt  one line per step: status, seconds, what ran
#   fashion_mnist/record.json, fashion_mnist/curves.png   the main job's record and plot
# Exit status: 0 when every step passed.
#
#   bash .gpu-bundle/run.sh [--device cuda|cuda:N|cpu] [--skip-bench] [-- MAIN_JOB_ARGS...]
#
# Environment: TORCH_DIR = site-packages/torch of the PyTorch 2.11 to run against (default:
# the one in /opt/torch/.venv, the GPU machine's); MAIN_JOB_ARGS may also come after `--`
# (default: the README's default run, 30,000 images, 3 epochs, O0-O3); BENCH_ARGS (default
# --no-python unless TCH_AMP_PYTHON is set).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
device=cuda
bench=1
main_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --device) device=$2; shift 2 ;;
    --device=*) device=${1#--device=}; shift ;;
    --skip-bench) bench=0; shift ;;
    --) shift; main_args=("$@"); break ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-$here/out}
mkdir -p "$OUT"
log=$OUT/run.log
summary=$OUT/summary.txt
: > "$log"
: > "$summary"

if [ -z "${TORCH_DIR:-}" ]; then
  TORCH_DIR=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/torch 2>/dev/null | head -n 1)
fi
[ -n "${TORCH_DIR:-}" ] && [ -f "$TORCH_DIR/lib/libtorch_cpu.so" ] \
  || { echo "run.sh: no libtorch found; set TORCH_DIR to a site-packages/torch" | tee -a "$log" >&2; exit 2; }
site=$(dirname "$TORCH_DIR")
ld=$TORCH_DIR/lib
for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && ld=$ld:$d; done
export LD_LIBRARY_PATH=$ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The binaries are stripped: a backtrace has no names, the panic message says what failed.
export RUST_BACKTRACE=0

failed=0
step() { # name, command...: runs it, appends its output to run.log and a line to summary.txt
  local name=$1; shift
  local t0 rc ms secs
  echo "=== $name: $*" >> "$log"
  t0=$(date +%s%N)
  "$@" >> "$log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  secs=$(printf '%d.%02d' $((ms / 1000)) $((ms % 1000 / 10)))
  printf '%-4s %8ss  %s\n' "$([ $rc = 0 ] && echo ok || echo FAIL)" "$secs" "$name (exit $rc)" >> "$summary"
  echo "=== $name: exit $rc, ${secs}s" >> "$log"
  [ $rc = 0 ] || failed=1
}

{
  echo "tch-amp GPU bundle run, $(date -u +%Y-%m-%dT%H:%M:%SZ), device $device"
  echo "host: $(uname -srm), $(nproc) cores"
  echo "TORCH_DIR=$TORCH_DIR ($(sed -n "s/^__version__ = '\(.*\)'.*/\1/p" "$TORCH_DIR/version.py" 2>/dev/null))"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  head -n 4 "$here/MANIFEST.txt" 2>/dev/null
  echo "libraries of bin/test-linking:"
  ldd "$here/bin/test-linking" | grep -E 'torch|c10|cudart|cublas|not found'
} >> "$log" 2>&1

for t in "$here"/bin/test-*; do
  step "$(basename "$t")" "$t"
done
[ ${#main_args[@]} -gt 0 ] || read -r -a main_args <<< "${MAIN_JOB_ARGS:-}"
mkdir -p "$OUT/fashion_mnist"
step "fashion_mnist --device $device" "$here/bin/fashion_mnist" --data "$here/data" --device "$device" \
  --out "$OUT/fashion_mnist" "${main_args[@]}"
if [ $bench = 1 ]; then
  if [ -n "${BENCH_ARGS:-}" ]; then read -r -a bench_args <<< "$BENCH_ARGS"
  elif [ -n "${TCH_AMP_PYTHON:-}" ]; then bench_args=()
  else bench_args=(--no-python); fi
  # The bench finds scripts/bench_torch.py relative to the working directory.
  step "bench-amp ${bench_args[*]}" bash -c 'cd "$1" && shift && exec "$@"' _ "$here" "$here/bin/bench-amp" "${bench_args[@]}"
fi

{
  echo
  echo "=== summary"
  cat "$summary"
} | tee -a "$log"
exit $failed
