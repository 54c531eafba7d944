#!/usr/bin/env bash
# Make Fashion-MNIST available: Debian's dataset-fashion-mnist package puts the four gzip IDX
# files in /usr/share/datasets/fashion-mnist/. Installs it with apt when running as root;
# otherwise says what to run. Use --data DIR in the examples to point elsewhere. Also installs
# the font of the examples' plots (fonts-dejavu-core), which is optional.
set -euo pipefail
dir=/usr/share/datasets/fashion-mnist
files="train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz"
have() { for f in $files; do [ -s "$dir/$f" ] || return 1; done; }

# The examples' plots (plotters with its pure-Rust ab_glyph renderer) take their text from
# DejaVu Sans, Debian's fonts-dejavu-core. Not fatal: without it the plots have no text.
font=/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
if [ ! -s "$font" ]; then
  if [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q fonts-dejavu-core >/dev/null 2>&1 || {
      apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q fonts-dejavu-core >/dev/null 2>&1; } || true
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo -n apt-get install -y -q fonts-dejavu-core >/dev/null 2>&1 || true
  fi
  [ -s "$font" ] || echo "setup-data: $font is missing (Debian package fonts-dejavu-core): plots will be drawn without text" >&2
fi

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
