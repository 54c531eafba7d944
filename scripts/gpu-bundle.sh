#!/usr/bin/env bash
# Builds the GPU bundle: tch-amp's CUDA test binaries, the main job
# (examples/fashion_mnist.rs) and the benchmark (benches/amp.rs), compiled here against the
# libtorch of the GPU machine, packed with Fashion-MNIST and a run script into one folder that
# the device tool carries to the GPU machine and runs there.
#
#   bash scripts/gpu-bundle.sh [OUT_DIR]        # default OUT_DIR: <repo>/.gpu-bundle (git-ignored)
#
# What it does:
# 1. A venv with PyPI's torch==2.11.0 in $TCH_AMP_CACHE/venv-torch-2.11.0 (default
#    ~/.cache/tch-amp; one time, ~4.3 GB, beside setup-libtorch.sh's 2.13 venv). That wheel is
#    2.11.0+cu130, the build the GPU machine has (PyTorch 2.11.0+cu130 in /opt/torch/.venv);
#    the script stops unless torch.version.cuda is 13.0. For the `nccl` feature it adds
#    nvidia-cuda-crt and nvidia-cuda-cccl 13.0.* (headers ProcessGroupNCCL.hpp needs; the
#    wheel's nvidia-* packages have the CUDA runtime and NCCL ones). GPU_BUNDLE_NCCL=0 builds
#    without NCCL.
# 2. A scratch copy of this checkout (tracked and untracked-not-ignored files) in
#    $TCH_AMP_CACHE/gpu-bundle/src, where tch and torch-sys become =0.24.0 (the tch release for
#    libtorch 2.11; the repo uses 0.26 for 2.13) and build.rs's TORCH_VERSION becomes 2.11.0.
#    benches/amp.rs starts the bundle's scripts/bench_torch.py (run.sh runs the bench from the
#    bundle's folder). No other source change is needed. Files are only rewritten when their content changed, and
#    the target folder ($TCH_AMP_CACHE/gpu-bundle/target) persists, so a re-run rebuilds only
#    what changed (cold: ~6 min on 2 cores).
# 3. Release builds of tests/cuda/ (amp and O1 on CUDA), tests/linking.rs and
#    tests/distributed/ (run.sh runs its cuda:: tests: Gloo on CUDA tensors and SyncBatchNorm
#    on two processes, an NCCL group of one) with `--features cuda-tests,nccl`, of the
#    fashion_mnist example and of the amp bench; stripped.
# 4. OUT_DIR/{bin/, data/ (the four Fashion-MNIST gzip files from
#    /usr/share/datasets/fashion-mnist, `make data`), run.sh (scripts/gpu-run.sh),
#    scripts/bench_torch.py, MANIFEST.txt}; the script fails if it exceeds 60 MiB (the device
#    tool carries at most 64 MiB, the repository included).
#
# Then, from a session that has the device tool and a GPU machine (see DEVELOPERS.md / the
# device tool's README), in the checkout the session runs from:
#   bash scripts/gpu-bundle.sh
#   run(command="bash .gpu-bundle/run.sh --device cuda", carry=[".gpu-bundle"], timeout_s=600)
# run.sh sets LD_LIBRARY_PATH to the GPU machine's torch/lib and every nvidia/*/lib folder
# beside it, runs every bundled test binary, the main job with --device and the benchmark, and
# writes run.log, summary.txt and the main job's record.json and curves.png under $OUT
# (gpu-run.sh's header has its options).
#
# Here, without a GPU: TORCH_DIR=<this script's 2.11 venv>/.../torch bash .gpu-bundle/run.sh
# --device cpu runs the same binaries against libtorch 2.11 on the CPU (the cuda-tests fail
# with "needs a CUDA device").
set -euo pipefail
TORCH_VERSION=2.11.0
TORCH_CUDA=13.0
TCH_VERSION=0.24.0
MAX_BYTES=$((60 * 1024 * 1024))
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root/.gpu-bundle}
cache=${TCH_AMP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tch-amp}
venv=$cache/venv-torch-$TORCH_VERSION
work=$cache/gpu-bundle
data_dir=${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}

die() { echo "gpu-bundle: $*" >&2; exit 1; }
say() { echo "gpu-bundle: $*" >&2; }

# 1. torch 2.11.0+cu130 from PyPI.
mkdir -p "$cache"
exec 9>"$cache/.lock-$TORCH_VERSION"
flock 9
if ! "$venv/bin/python" -c "import torch" 2>/dev/null \
   || [ "$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$TORCH_VERSION" ]; then
  command -v python3 >/dev/null || die "python3 is needed to install torch==$TORCH_VERSION from PyPI"
  say "installing torch==$TORCH_VERSION into $venv (one time, ~4.3 GB)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "torch==$TORCH_VERSION"
fi
cuda=$("$venv/bin/python" -c 'import torch; print(torch.version.cuda)' 2>/dev/null | tail -n 1)
[ "$cuda" = "$TORCH_CUDA" ] || die "torch==$TORCH_VERSION in $venv is built for CUDA '$cuda', the GPU machine's for $TORCH_CUDA"
torch_dir=$(ls -d "$venv"/lib/python3*/site-packages/torch | head -n 1)
[ -f "$torch_dir/lib/libtorch_cuda.so" ] || die "$torch_dir/lib has no libtorch_cuda.so"
nccl=${GPU_BUNDLE_NCCL:-1}
nv=$(dirname "$torch_dir")/nvidia/cu13/include
if [ "$nccl" = 1 ] && { [ ! -f "$nv/crt/host_config.h" ] || [ ! -d "$nv/cccl/cuda/std" ]; }; then
  say "installing nvidia-cuda-crt and nvidia-cuda-cccl $TORCH_CUDA.* into $venv (headers for the nccl feature)"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "nvidia-cuda-crt==$TORCH_CUDA.*" "nvidia-cuda-cccl==$TORCH_CUDA.*"
fi
flock -u 9

# 2. Scratch copy with tch 0.24.
src=$work/src
stage=$work/stage
rm -rf "$stage"
mkdir -p "$stage" "$src"
(cd "$root" && git ls-files -z --cached --others --exclude-standard) > "$work/files"
(cd "$root" && tar --null -T "$work/files" -cf - 2>/dev/null) | tar -C "$stage" -xpf - 2>/dev/null || true
sub() { # file, from, to: a substitution that must apply
  grep -qF -- "$2" "$stage/$1" || die "$1 no longer contains '$2': update scripts/gpu-bundle.sh"
  local tmp; tmp=$(mktemp)
  F="$2" T="$3" awk '{ while ((i = index($0, ENVIRON["F"])) > 0) { $0 = substr($0, 1, i - 1) ENVIRON["T"] substr($0, i + length(ENVIRON["F"])) } print }' \
    "$stage/$1" > "$tmp"
  cat "$tmp" > "$stage/$1"; rm -f "$tmp"
}
sub Cargo.toml 'tch = "=0.26.0"' "tch = \"=$TCH_VERSION\""
sub Cargo.toml 'torch-sys = "=0.26.0"' "torch-sys = \"=$TCH_VERSION\""
sub build.rs 'const TORCH_VERSION: &str = "2.13.0";' "const TORCH_VERSION: &str = \"$TORCH_VERSION\";"
sub build.rs 'tch 0.26.0 needs' "tch $TCH_VERSION needs"
# The bench starts scripts/bench_torch.py from the source folder it was built in; in the bundle
# that is the bundle's own copy, relative to the folder run.sh runs the bench from.
sub benches/amp.rs 'concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/bench_torch.py")' '"scripts/bench_torch.py"'
# Copy what changed (content), drop what is gone; keep the scratch's own Cargo.lock (cargo
# re-resolves tch/torch-sys for 0.24 on the first build and keeps that).
(cd "$stage" && find . -type f -print0) | while IFS= read -r -d '' f; do
  [ "$f" = ./Cargo.lock ] && [ -f "$src/Cargo.lock" ] && continue
  if ! cmp -s "$stage/$f" "$src/$f"; then mkdir -p "$(dirname "$src/$f")"; cp -p "$stage/$f" "$src/$f"; fi
done
(cd "$src" && find . -type f ! -name Cargo.lock -print0) | while IFS= read -r -d '' f; do
  [ -e "$stage/$f" ] || rm -f "$src/$f"
done
rm -rf "$stage"

# 3. Release builds against libtorch 2.11.
say "building in $src against $torch_dir (tch $TCH_VERSION)"
start=$(date +%s)
json=$work/artifacts.json
features=cuda-tests
[ "$nccl" = 1 ] && features=cuda-tests,nccl
(cd "$src" && LIBTORCH="$torch_dir" CARGO_TARGET_DIR="$work/target" cargo build --release --features "$features" \
  --test cuda --test linking --test distributed --example fashion_mnist --bench amp \
  --message-format=json-render-diagnostics) > "$json"
say "built in $(( $(date +%s) - start )) s"
exe() { # kind name -> path of the executable cargo reported
  jq -r --arg k "$1" --arg n "$2" \
    'select(.reason == "compiler-artifact" and .executable != null and .target.name == $n and (.target.kind | index($k))) | .executable' \
    "$json" | tail -n 1
}

# 4. The bundle.
rm -rf "$out"
mkdir -p "$out/bin" "$out/data" "$out/scripts"
for t in cuda linking distributed; do
  p=$(exe test "$t"); [ -n "$p" ] || die "no test binary for $t in $json"
  strip -o "$out/bin/test-$t" "$p"
done
p=$(exe example fashion_mnist); [ -n "$p" ] || die "no fashion_mnist binary in $json"
strip -o "$out/bin/fashion_mnist" "$p"
p=$(exe bench amp); [ -n "$p" ] || die "no amp bench binary in $json"
strip -o "$out/bin/bench-amp" "$p"
for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
  [ -s "$data_dir/$f" ] || die "$data_dir/$f is missing: run \`make data\` (Debian's dataset-fashion-mnist)"
  cp "$data_dir/$f" "$out/data/"
done
cp "$root/scripts/gpu-run.sh" "$out/run.sh"
cp "$root/scripts/bench_torch.py" "$out/scripts/"
chmod +x "$out/run.sh" "$out"/bin/*
{
  echo "tch-amp GPU bundle, built $(date -u +%Y-%m-%dT%H:%M:%SZ) by scripts/gpu-bundle.sh"
  echo "source: $(cd "$root" && git rev-parse HEAD)$(cd "$root" && git diff --quiet HEAD || echo ' (with uncommitted changes)')"
  echo "features: $features"
  echo "tch/torch-sys $TCH_VERSION, libtorch $("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null | tail -n 1) (PyPI wheel, CUDA $cuda)"
  echo "rustc: $(rustc --version)"
  echo
  (cd "$out" && find . -type f ! -name MANIFEST.txt | sort | xargs sha256sum)
} > "$out/MANIFEST.txt"
bytes=$(du -sb "$out" | cut -f1)
say "bundle $out: $bytes bytes ($(du -sh "$out" | cut -f1))"
(cd "$out" && ls -l bin data)
[ "$bytes" -le "$MAX_BYTES" ] || die "the bundle is $bytes bytes, over $MAX_BYTES"
