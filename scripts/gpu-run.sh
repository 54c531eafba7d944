#!/usr/bin/env bash
# The GPU bundle's run script (copied to <bundle>/run.sh by scripts/gpu-bundle.sh). Runs every
# bundled test binary, the main job with --device and the benchmark against an installed
# PyTorch's libtorch, and writes under $OUT (the device tool's output folder; default
# <bundle>/out):
#   run.log      everything, in order
#   summary.txt  one line per step: status, seconds, what ran
#   fashion_mnist/record.json, fashion_mnist/curves.png   the main job's record and plot
#   bench.json   the benchmark's figures
# Exit status: 0 when every step passed.
#
# bin/test-distributed runs its cuda:: tests only (Gloo on CUDA tensors and SyncBatchNorm on
# two processes sharing GPU 0, and, in a build with the `nccl` feature, an NCCL group of one
# rank: NCCL cannot put two ranks on one GPU). On CUDA each summary line also gives the
# largest GPU memory in use that nvidia-smi saw during the step (every 100 ms, the whole GPU).
#
#   bash .gpu-bundle/run.sh [--device cuda|cuda:N|cpu] [--skip-bench] [-- MAIN_JOB_ARGS...]
#
# The bundle's binaries are built by scripts/gpu-bundle.sh against PyPI's torch 2.11.0+cu130
# with tch/torch-sys 0.24.0, not the repository's torch 2.13 / tch 0.26: the GPU machine has
# PyTorch 2.11.0+cu130, and libtorch must be the version the binaries were built against.
#
# Environment: TORCH_DIR = site-packages/torch of a PyTorch 2.11.0 (CUDA 13.0 build) to run
# against (default: the one in /opt/torch/.venv, the GPU machine's); MAIN_JOB_ARGS may also come after `--`
# (default: the README's default run, 30,000 images, 3 epochs, O0-O3); BENCH_ARGS (default:
# none, on --device); TCH_AMP_PYTHON, the Python with torch for the benchmark's PyTorch rows
# (default: the one of the venv holding TORCH_DIR; without one, --no-python); STEP_TIMEOUT,
# seconds after which a step is stopped and counted as failed (default 900).
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
gpu_mem=0
case $device in cuda*) command -v nvidia-smi >/dev/null && gpu_mem=1 ;; esac
step() { # name, command...: runs it, appends its output to run.log and a line to summary.txt
  local name=$1; shift
  local t0 rc ms secs sampler="" mem=""
  echo "=== $name: $*" >> "$log"
  if [ $gpu_mem = 1 ]; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/.gpu-mem" 2>/dev/null &
    sampler=$!
  fi
  t0=$(date +%s%N)
  timeout --kill-after=10 "${STEP_TIMEOUT:-900}" "$@" >> "$log" 2>&1
  rc=$?
  [ $rc = 124 ] && echo "=== $name: stopped after STEP_TIMEOUT=${STEP_TIMEOUT:-900} s" >> "$log"
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  if [ -n "$sampler" ]; then
    kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
    mem=$(sort -n "$OUT/.gpu-mem" | tail -n 1)
    rm -f "$OUT/.gpu-mem"
    [ -n "$mem" ] && mem=", GPU memory peak $mem MiB"
  fi
  secs=$(printf '%d.%02d' $((ms / 1000)) $((ms % 1000 / 10)))
  printf '%-4s %8ss  %s\n' "$([ $rc = 0 ] && echo ok || echo FAIL)" "$secs" "$name (exit $rc$mem)" >> "$summary"
  echo "=== $name: exit $rc, ${secs}s" >> "$log"
  [ $rc = 0 ] || failed=1
}

{
  echo "tch-amp GPU bundle run, $(date -u +%Y-%m-%dT%H:%M:%SZ), device $device"
  echo "host: $(uname -srm), $(nproc) cores"
  echo "TORCH_DIR=$TORCH_DIR ($(sed -n "s/^__version__ = '\(.*\)'.*/\1/p" "$TORCH_DIR/version.py" 2>/dev/null))"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  head -n 5 "$here/MANIFEST.txt" 2>/dev/null
  echo "libraries of bin/test-linking:"
  ldd "$here/bin/test-linking" | grep -E 'torch|c10|cudart|cublas|not found'
} >> "$log" 2>&1

for t in "$here"/bin/test-*; do
  case $(basename "$t") in
    test-distributed) step "$(basename "$t") cuda::" "$t" cuda:: --test-threads=1 ;;
    *) step "$(basename "$t")" "$t" ;;
  esac
done
[ ${#main_args[@]} -gt 0 ] || read -r -a main_args <<< "${MAIN_JOB_ARGS:-}"
mkdir -p "$OUT/fashion_mnist"
step "fashion_mnist --device $device" "$here/bin/fashion_mnist" --data "$here/data" --device "$device" \
  --out "$OUT/fashion_mnist" "${main_args[@]}"
if [ $bench = 1 ]; then
  bench_args=(--device "$device" --json "$OUT/bench.json")
  [ -n "${BENCH_ARGS:-}" ] && read -r -a extra <<< "$BENCH_ARGS" && bench_args+=("${extra[@]}")
  venv_python=$(cd "$site/../../.." 2>/dev/null && pwd)/bin/python
  if [ -z "${TCH_AMP_PYTHON:-}" ] && [ -x "$venv_python" ]; then export TCH_AMP_PYTHON=$venv_python; fi
  [ -n "${TCH_AMP_PYTHON:-}" ] || bench_args+=(--no-python)
  # The bench finds scripts/bench_torch.py relative to the working directory.
  step "bench-amp ${bench_args[*]}" bash -c 'cd "$1" && shift && exec "$@"' _ "$here" "$here/bin/bench-amp" "${bench_args[@]}"
fi

{
  echo
  echo "=== summary"
  cat "$summary"
} | tee -a "$log"
exit $failed
