#!/usr/bin/env bash
# Provision libtorch 2.13.0 for tch 0.26.0 and tell cargo where it is.
#
# - LIBTORCH already set: it is checked (must be PyTorch/libtorch 2.13.0) and used as is.
# - Otherwise a Python venv with torch==2.13.0 (requirements.txt) is created once in a cache
#   outside the clone ($TCH_AMP_CACHE, default ~/.cache/tch-amp), so every clone and every CI
#   run on the machine reuses the 4.7 GB install. Re-running is a no-op taking well under 1 s.
# - The test references' Python packages (requirements-test.txt: torchao) go into the same venv
#   when missing (a file check when present).
# - Writes the git-ignored .cargo/config.toml with LIBTORCH in [env], so a plain
#   `cargo build/test/run` in this clone finds libtorch without any exported variable.
set -euo pipefail
TORCH_VERSION=2.13.0
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${TCH_AMP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tch-amp}
venv=$cache/venv-torch-$TORCH_VERSION

die() { echo "setup-libtorch: $*" >&2; exit 1; }

version_of() { # $1 = torch dir (site-packages/torch or an unpacked libtorch)
  if [ -f "$1/version.py" ]; then sed -n "s/^__version__ = '\([^'+]*\).*/\1/p" "$1/version.py"
  elif [ -f "$1/build-version" ]; then cut -d+ -f1 < "$1/build-version"
  else echo unknown; fi
}

if [ -n "${LIBTORCH:-}" ]; then
  torch_dir=$LIBTORCH
  [ -d "$torch_dir/lib" ] || die "LIBTORCH=$torch_dir has no lib/ folder; point it at an unpacked libtorch or at site-packages/torch"
else
  mkdir -p "$cache"
  exec 9>"$cache/.lock"
  flock 9   # two clones setting up at once share one install
  installed=$(ls -d "$venv"/lib/python3*/site-packages/torch 2>/dev/null | head -n 1 || true)
  if [ -z "$installed" ] || [ "$(version_of "$installed")" != "$TORCH_VERSION" ] \
     || [ ! -f "$installed/lib/libtorch_cpu.so" ]; then
    command -v python3 >/dev/null || die "python3 is needed to install torch==$TORCH_VERSION from PyPI"
    echo "setup-libtorch: installing torch==$TORCH_VERSION into $venv (one time, ~5 GB)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$root/requirements.txt"
  fi
  torch_dir=$(ls -d "$venv"/lib/python3*/site-packages/torch | head -n 1)
  # Test-only packages (requirements-test.txt, pinned): a glob per package, no Python start-up.
  missing=0
  while read -r req; do
    case $req in ''|'#'*) continue ;; esac
    name=${req%%==*} version=${req#*==}
    ls -d "$venv"/lib/python3*/site-packages/"$name-$version".dist-info >/dev/null 2>&1 || missing=1
  done < "$root/requirements-test.txt"
  if [ "$missing" = 1 ]; then
    echo "setup-libtorch: installing the test references' packages (requirements-test.txt) into $venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$root/requirements-test.txt"
  fi
fi

found=$(version_of "$torch_dir")
[ "$found" = "$TORCH_VERSION" ] || die "tch 0.26.0 needs libtorch $TORCH_VERSION but $torch_dir is $found; unset LIBTORCH to let this script install torch==$TORCH_VERSION, or pip install torch==$TORCH_VERSION"

mkdir -p "$root/.cargo"
cfg="$root/.cargo/config.toml"
new=$(printf '# Written by scripts/setup-libtorch.sh; git-ignored.\n[env]\nLIBTORCH = "%s"\nTCH_AMP_PYTHON = "%s"\n' \
  "$torch_dir" "${venv}/bin/python")
if [ ! -f "$cfg" ] || [ "$(cat "$cfg")" != "$new" ]; then printf '%s\n' "$new" > "$cfg"; fi
echo "setup-libtorch: libtorch $found at $torch_dir" >&2
if [ -z "${CI:-}" ]; then
  printf '%s\n' "setup-libtorch: to build your own crate against this libtorch (README, \"Using tch-amp" \
    "from another crate\"), put this in its .cargo/config.toml:" "[env]" "LIBTORCH = \"$torch_dir\"" >&2
fi
