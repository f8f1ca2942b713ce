#!/usr/bin/env bash
# Builds tally-server and tallyctl the way CI does (the Makefile's
# `cmake -S . -B build -DCMAKE_BUILD_TYPE=Release`), minus tests and
# benchmarks, which an image does not ship.
#
#   deploy/docker/build.sh SOURCE_DIR BUILD_DIR [extra cmake args...]
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 SOURCE_DIR BUILD_DIR [cmake args...]" >&2
  exit 2
fi
source_dir=$1
build_dir=$2
shift 2

cmake -S "$source_dir" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_TESTING=OFF -DTALLY_BUILD_BENCHMARKS=OFF "$@"
cmake --build "$build_dir" --target tally-server tallyctl tally_python_stubs \
  -j"${TALLY_BUILD_JOBS:-$(nproc)}"
