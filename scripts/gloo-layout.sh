#!/usr/bin/env bash
# Prints the size a libtorch allocates for c10d::ProcessGroupGloo: the argument of the
# `operator new` call in c10d::ProcessGroupGloo::split (the only place libtorch_cpu.so creates
# one), read with binutils' nm and objdump. src/shim/distributed.cpp keeps these sizes in a
# table keyed on torch/version.h and checks its own sizeof against them.
#
#   bash scripts/gloo-layout.sh [TORCH_DIR]     # default: $LIBTORCH
set -euo pipefail
torch_dir=${1:-${LIBTORCH:-}}
[ -n "$torch_dir" ] || { echo "gloo-layout: give a torch dir (site-packages/torch or libtorch)" >&2; exit 2; }
lib=$torch_dir/lib/libtorch_cpu.so
[ -f "$lib" ] || { echo "gloo-layout: $lib is missing" >&2; exit 2; }
addr=$(nm -D --defined-only "$lib" | awk '$3 ~ /^_ZN4c10d16ProcessGroupGloo5splitE/ && a == "" { a = $1 } END { print a }')
[ -n "$addr" ] || { echo "gloo-layout: no c10d::ProcessGroupGloo::split in $lib" >&2; exit 1; }
size=$(objdump -d --no-show-raw-insn --start-address=0x"$addr" \
         --stop-address="$(printf '0x%x' $((0x$addr + 0x800)))" "$lib" \
       | grep -B1 'call.*<_Znwm@plt>' | sed -n 's/.*mov *\$\(0x[0-9a-f]*\),%edi.*/\1/p' | awk 'NR == 1')
[ -n "$size" ] || { echo "gloo-layout: found no operator new call with a constant size in split" >&2; exit 1; }
version=$(sed -n "s/^__version__ = '\([^']*\)'.*/\1/p" "$torch_dir/version.py" 2>/dev/null || true)
echo "sizeof(c10d::ProcessGroupGloo) = $size (${version:-$torch_dir})"
