#!/usr/bin/env bash
# Installs tally's build and test dependencies from Debian 12's archive.
# Idempotent: packages already present are skipped, and apt is not touched at all
# when nothing is missing (so it works offline on a prepared machine).
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config
  libtorch-dev libgloo-dev
  libdnnl-dev                      # oneDNN headers, for kernels/onednn_matmul.h
  libblis4-pthread                 # the fast BLAS behind libblas.so.3 (below)
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-grpcio python3-protobuf python3-torch python3-numpy
  nlohmann-json3-dev curl
  # deploy/ checks and tests: manifests, alert rules, a real Prometheus,
  # network namespaces for the multi-host rendezvous test, pip for the
  # Python client package, its wheel and its type check.
  yamllint python3-yaml prometheus iproute2 python3-pip python3-setuptools
  python3-wheel python3-venv mypy  # the client wheel, its offline install, its types
  libssl-dev openssl               # checkpoint SHA-256; test certificates
  clang libclang-rt-14-dev         # the libFuzzer request fuzzer
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
else
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# LibTorch's fp32/fp64 matmuls call whatever libblas.so.3 points to. Debian's
# reference BLAS runs ~5 GFLOP/s per core, BLIS 70-95 (docs/performance.md):
# move the link off the reference one, and leave any other choice alone
# (OpenBLAS, MKL, or an administrator's own).
triplet=$(gcc -dumpmachine)
BLAS_LINK=libblas.so.3-$triplet
BLIS=/usr/lib/$triplet/blis-pthread/libblas.so.3
current=$(update-alternatives --query "$BLAS_LINK" 2>/dev/null | sed -n 's/^Value: //p')
case "$current" in
  */blas/libblas.so.3|"")
    if [ -e "$BLIS" ]; then
      $SUDO update-alternatives --set "$BLAS_LINK" "$BLIS" >/dev/null
      echo "install-deps: libblas.so.3 -> BLIS"
    fi ;;
esac
