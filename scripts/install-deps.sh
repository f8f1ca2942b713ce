#!/usr/bin/env bash
# Installs tally's build and test dependencies from Debian 12's archive.
# Idempotent: packages already present are skipped, and apt is not touched at all
# when nothing is missing (so it works offline on a prepared machine).
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config
  libtorch-dev libgloo-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-grpcio python3-protobuf python3-torch python3-numpy
  nlohmann-json3-dev curl
  # deploy/ checks and tests: manifests, alert rules, a real Prometheus,
  # network namespaces for the multi-host rendezvous test, pip for the
  # Python client package.
  yamllint python3-yaml prometheus iproute2 python3-pip python3-setuptools
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
