#!/usr/bin/env bash
# Lays out what the runtime image holds, under PREFIX (the image copies
# PREFIX to /):
#   PREFIX/usr/local/bin/tally-server, tallyctl
#   PREFIX/usr/local/share/tally/python/   the Python client + its stubs
#   PREFIX/usr/local/share/tally/pride_and_prejudice.txt, linked from
#       tallyctl's compiled-in default --text path
#   PREFIX/usr/local/share/tally/runtime-packages.txt
#       the Debian packages that provide every shared library the binaries
#       load (ldd + dpkg -S), which the runtime stage apt-installs;
#       libraries under $TALLY_BUNDLED_LIB_DIR (e.g. an official LibTorch
#       unpacked in /opt) are left out: the image copies that directory;
#       so are the CUDA toolkit's (under /usr/local/cuda*: the CUDA runtime
#       and NCCL of a build with the CUDA pieces), which a CUDA image's
#       runtime stage installs from NVIDIA's packages (Dockerfile.cuda).
# CI runs it into a temporary prefix (tests/deploy/test_docker_build.py).
#
#   deploy/docker/install-runtime.sh SOURCE_DIR BUILD_DIR PREFIX
set -euo pipefail

if [ $# -ne 3 ]; then
  echo "usage: $0 SOURCE_DIR BUILD_DIR PREFIX" >&2
  exit 2
fi
source_dir=$1
build_dir=$2
prefix=$3

bin_dir="$prefix/usr/local/bin"
share_dir="$prefix/usr/local/share/tally"
mkdir -p "$bin_dir" "$share_dir/python"

install -m 0755 "$build_dir/server/tally-server" "$bin_dir/tally-server"
install -m 0755 "$build_dir/client/tallyctl" "$bin_dir/tallyctl"
# The bundled corpus, at a fixed place for `tallyctl train --text`.
install -m 0644 "$source_dir/data/pride_and_prejudice.txt" "$share_dir/"
# tallyctl's default --text is the source tree's path, compiled in (the
# build stage's /src/data/...): a relative link there makes `tallyctl train`
# work in the image without --text.
default_text=$("$bin_dir/tallyctl" train --help |
  sed -n 's/^ *--text STR .*(default: \(.*\))$/\1/p')
if [ -z "$default_text" ]; then
  echo "install-runtime: no default --text in 'tallyctl train --help'" >&2
  exit 1
fi
mkdir -p "$prefix$(dirname "$default_text")"
ln -sfr "$share_dir/pride_and_prejudice.txt" "$prefix$default_text"
cp -r "$source_dir/client/python/tally_client" "$share_dir/python/"
cp -r "$build_dir/python_stubs/tally_client/_proto" "$share_dir/python/tally_client/"
find "$share_dir/python" -name __pycache__ -prune -exec rm -rf {} +

# Libraries the binaries load, mapped to the packages that ship them.
libraries=$(ldd "$bin_dir/tally-server" "$bin_dir/tallyctl" |
  awk '/=> \// { print $3 }' | sort -u)
missing=$(ldd "$bin_dir/tally-server" "$bin_dir/tallyctl" | grep 'not found' || true)
if [ -n "$missing" ]; then
  echo "install-runtime: unresolved libraries:" >&2
  echo "$missing" >&2
  exit 1
fi
# One dpkg -S for every path (a call per library takes minutes): ldd
# names some libraries by their /lib path while dpkg knows them by /usr/lib,
# or by a symlink's target, so each library is looked up under all three.
declare -A owner_of
candidates=()
for library in $libraries; do
  if [ -n "${TALLY_BUNDLED_LIB_DIR:-}" ] && [[ $library == "$TALLY_BUNDLED_LIB_DIR"/* ]]; then
    continue
  fi
  if [[ $library == /usr/local/cuda* || $(readlink -f "$library") == /usr/local/cuda* ]]; then
    continue
  fi
  candidates+=("$library" "/usr$library" "$(readlink -f "$library")")
done
while IFS= read -r line; do
  # "pkg:arch[, pkg2:arch]: /path"
  owner_of[${line##*: }]=${line%%[:,]*}
done < <(dpkg -S "${candidates[@]}" 2>/dev/null || true)
packages=()
for ((i = 0; i < ${#candidates[@]}; i += 3)); do
  owner=""
  for path in "${candidates[@]:i:3}"; do
    owner=${owner:-${owner_of[$path]:-}}
  done
  if [ -z "$owner" ]; then
    echo "install-runtime: no Debian package ships ${candidates[i]}" >&2
    exit 1
  fi
  packages+=("$owner")
done
printf '%s\n' "${packages[@]}" | sort -u > "$share_dir/runtime-packages.txt"
echo "install-runtime: $(wc -l < "$share_dir/runtime-packages.txt") runtime packages"
