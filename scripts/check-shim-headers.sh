#!/usr/bin/env bash
# Compiles every file of the C++ shim (src/shim/*.cpp; distributed.cpp depends on a torch
# version's class layout) against the headers of another torch version, syntax only, with
# build.rs's flags, so the GPU machine's build (scripts/gpu-bundle.sh) keeps compiling: the
# per-version table and static_assert run without that version's 4 GB install. The headers come from, in this order: TORCH_HEADERS (a site-packages/torch or a
# folder holding include/), the venv scripts/gpu-bundle.sh makes
# ($TCH_AMP_CACHE/venv-torch-VERSION), a cached extract ($TCH_AMP_CACHE/headers-torch-VERSION),
# or else the PyPI wheel itself: pip resolves its URL (metadata only) and
# scripts/torch_headers.py fetches torch/include/ with HTTP range requests (about 18 MB of
# the 500 MB wheel, a few seconds), kept in that cache.
#
#   bash scripts/check-shim-headers.sh [VERSION]      # default 2.11.0, the GPU machine's torch
set -euo pipefail
version=${1:-2.11.0}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${TCH_AMP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tch-amp}
die() { echo "check-shim-headers: $*" >&2; exit 1; }

torch=${TORCH_HEADERS:-}
if [ -z "$torch" ]; then
  torch=$(ls -d "$cache/venv-torch-$version"/lib/python3*/site-packages/torch 2>/dev/null | head -n 1 || true)
  [ -n "$torch" ] && [ -d "$torch/include" ] || torch=$cache/headers-torch-$version/torch
fi
if [ ! -f "$torch/include/torch/headeronly/version.h" ]; then
  command -v python3 >/dev/null || die "python3 is needed to fetch the torch $version headers"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip install --dry-run --no-deps --ignore-installed --quiet --disable-pip-version-check \
    --only-binary=:all: --report "$tmp/report.json" "torch==$version" \
    || die "pip could not resolve torch==$version"
  url=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["install"][0]["download_info"]["url"])' "$tmp/report.json")
  python3 "$root/scripts/torch_headers.py" "$url" "$tmp/headers"
  rm -rf "$cache/headers-torch-$version"
  mkdir -p "$cache"
  mv "$tmp/headers" "$cache/headers-torch-$version"
  torch=$cache/headers-torch-$version/torch
fi
found=$(sed -n 's/^#define TORCH_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' "$torch/include/torch/headeronly/version.h" | paste -sd.)
[ "$found" = "$version" ] || die "the headers in $torch are torch $found, not $version"
echo "check-shim-headers: src/shim/*.cpp against torch $found headers in $torch" >&2
cd "$root"
"${CXX:-c++}" -std=c++17 -fsyntax-only -fopenmp \
  -I "$torch/include" -I "$torch/include/torch/csrc/api/include" -I src/shim/gloo_stub \
  -D_GLIBCXX_USE_CXX11_ABI=1 -DGLOG_USE_GLOG_EXPORT \
  -Wno-unused-parameter -Wno-deprecated-declarations -Wno-c++20-extensions \
  src/shim/*.cpp
echo "check-shim-headers: ok (torch $found)" >&2
