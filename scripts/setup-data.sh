#!/usr/bin/env bash
# Make Fashion-MNIST available: Debian's dataset-fashion-mnist package puts the four gzip IDX
# files in /usr/share/datasets/fashion-mnist/. Installs it with apt when running as root;
# otherwise says what to run. Use --data DIR in the examples to point elsewhere.
set -euo pipefail
dir=/usr/share/datasets/fashion-mnist
files="train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz"
have() { for f in $files; do [ -s "$dir/$f" ] || return 1; done; }
have && exit 0
if [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || {
    apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null; }
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  sudo -n apt-get install -y -q dataset-fashion-mnist >/dev/null
else
  echo "setup-data: Fashion-MNIST is missing from $dir; run: sudo apt-get install dataset-fashion-mnist" >&2
  exit 1
fi
have || { echo "setup-data: dataset-fashion-mnist installed but $dir is incomplete" >&2; exit 1; }
echo "setup-data: Fashion-MNIST in $dir" >&2
