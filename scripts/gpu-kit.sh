#!/usr/bin/env bash
# The GPU kit: builds and checks tally on a GPU host that has nvcc, CMake,
# ninja and a CUDA PyTorch wheel but no package registry.
#
#   scripts/gpu-kit.sh prepare [DIR]        # on Debian 12, with network
#   scripts/gpu-kit.sh check [OPTIONS] DIR OUT   # on the GPU host, offline
#
# prepare downloads the .deb files of what tally needs beyond CUDA and PyTorch
# (gRPC, Protobuf, Abseil, prometheus-cpp, civetweb, GoogleTest, ...) and their
# dependencies into DIR (default .gpu-kit, git-ignored), with a MANIFEST.
# check unpacks them into a prefix, configures -DTALLY_WITH_CUDA=ON against
# the wheel's LibTorch, builds what the checks need, runs the CUDA tests and
# bench_train, and writes OUT/report.json, OUT/summary.txt and OUT/logs.tar.gz.
# docs/deploy.md ("GPU kit") has the details.
set -euo pipefail

SOURCE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly SOURCE_DIR

# What tally links or runs at build time, beyond CUDA, NCCL and LibTorch.
readonly KIT_PACKAGES=(
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc
  libprotobuf-dev protobuf-compiler libprotoc32
  libabsl-dev
  prometheus-cpp-dev libcivetweb-dev
  libre2-dev libc-ares-dev libssl-dev zlib1g-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  nlohmann-json3-dev libgloo-dev
)
# Never downloaded (nor followed): what any glibc 2.36+ Linux with a C++
# toolchain and systemd already has, and pkg-config, which the build does not
# use (check gives re2 a CMake config instead).
readonly KIT_EXCLUDE='^(libc6(-dev)?|libc-dev-bin|linux-libc-dev|libcrypt(1|-dev)|libnsl(2|-dev)|libtirpc[0-9a-z-]*|rpcsvc-proto|libgcc-s1|libgcc-[0-9]+-dev|gcc(-[0-9]+)?(-base)?|g\+\+(-[0-9]+)?|cpp(-[0-9]+)?|libstdc\+\+6|libstdc\+\+-[0-9]+-dev|binutils[a-z0-9-]*|debconf(-2\.0)?|perl-base|dpkg|tar|pkgconf(-bin)?|libpkgconf[0-9]+|pkg-config|libsystemd0|python3[a-z0-9.-]*)$'
# Downloaded, but their dependencies not followed: prometheus-cpp's CMake
# config finds libcurl (for the push client tally does not link), which only
# needs the files to exist; and c10d's ProcessGroupGloo.hpp includes Gloo's
# headers, which a torch wheel does not ship (its Gloo is inside
# libtorch_cpu): only libgloo-dev's headers are used.
readonly KIT_NO_FOLLOW='^(libcurl4|libgloo-dev)$'

# check: the targets built and the tests run (missing targets are skipped and
# reported, so a target another change adds later does not break the kit).
read -ra KIT_TARGETS <<<"${KIT_TARGETS:-tally_cuda_kernels_test \
  fused_optimizer_cuda_test nccl_communicator_test cuda_golden_test \
  bench_train tally-server}"
read -ra KIT_TESTS <<<"${KIT_TESTS:-tally_cuda_kernels_test \
  fused_optimizer_cuda_test nccl_communicator_test cuda_golden_test}"
BENCH_TRAIN_ARGS="${BENCH_TRAIN_ARGS:---device cuda}"
KIT_WORK="${KIT_WORK:-/tmp/tally-kit}"
KIT_TEST_TIMEOUT="${KIT_TEST_TIMEOUT:-120}"
KIT_BENCH_TIMEOUT="${KIT_BENCH_TIMEOUT:-180}"

usage() {
  cat <<EOF
usage: $0 prepare [DIR]
       $0 check [--cpu] [--stop-after STEP] DIR OUT

prepare  Download the .deb files tally needs beyond CUDA and PyTorch, with
         their dependencies, into DIR (default .gpu-kit) and write
         DIR/MANIFEST (package=version). Debian 12 only; no root needed.
check    On the GPU host: host facts, unpack DIR, configure, build, CUDA
         tests, bench_train; logs and OUT/report.json. Steps: facts unpack
         configure build tests bench. The first failing step stops the run
         (a failing test or bench does not, but the exit status is nonzero).
  --cpu            configure without requiring CUDA (try the kit here)
  --stop-after S   stop after step S (e.g. configure)

Environment: KIT_TARGETS, KIT_TESTS, BENCH_TRAIN_ARGS ("$BENCH_TRAIN_ARGS"),
KIT_WORK ($KIT_WORK), KIT_CUDA_ARCH (default: the GPU's compute capability),
KIT_TEST_TIMEOUT ($KIT_TEST_TIMEOUT s), KIT_BENCH_TIMEOUT ($KIT_BENCH_TIMEOUT s),
KIT_JOBS (default: nproc).
EOF
}

die() {
  echo "gpu-kit: $*" >&2
  exit 2
}

# ---------------------------------------------------------------- prepare

# Prints the direct Depends and Pre-Depends of the packages given, one a line:
# of alternatives the first, of a virtual package its first provider.
direct_depends() {
  apt-cache depends --no-recommends --no-suggests --no-conflicts \
    --no-breaks --no-replaces --no-enhances "$@" | awk '
      /^[^ ]/ { alternative = 0; virtual = 0; next }
      /^ [ |](Pre)?Depends: / {
        name = $2
        if (!alternative) {
          if (name ~ /^</) { virtual = 1 } else { print name; virtual = 0 }
        } else { virtual = 0 }
        alternative = ($1 ~ /^\|/)
        next
      }
      /^    [^ ]/ { if (virtual) { print $1; virtual = 0 } }'
}

# Prints the closure of KIT_PACKAGES under direct_depends, less KIT_EXCLUDE.
resolve_packages() {
  local -A seen=()
  local queue=("${KIT_PACKAGES[@]}") next pkg
  while ((${#queue[@]})); do
    next=()
    for pkg in "${queue[@]}"; do
      pkg="${pkg%%:*}"  # libfoo:amd64 -> libfoo
      [[ -n "${seen[$pkg]:-}" || "$pkg" =~ $KIT_EXCLUDE ]] && continue
      seen[$pkg]=1
      [[ "$pkg" =~ $KIT_NO_FOLLOW ]] || next+=("$pkg")
    done
    ((${#next[@]})) || break
    mapfile -t queue < <(direct_depends "${next[@]}" | sort -u)
  done
  printf '%s\n' "${!seen[@]}" | sort
}

cmd_prepare() {
  local dir="${1:-$SOURCE_DIR/.gpu-kit}"
  [[ -r /etc/debian_version ]] || die "prepare needs a Debian 12 host (apt)"
  if ! apt-cache show "${KIT_PACKAGES[0]}" >/dev/null 2>&1; then
    echo "gpu-kit: no package lists; running apt-get update"
    apt-get update -qq
  fi
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  local packages
  mapfile -t packages < <(resolve_packages)
  echo "gpu-kit: ${#packages[@]} packages"
  rm -f "$dir"/*.deb "$dir/MANIFEST"
  (cd "$dir" && apt-get download -q "${packages[@]}")
  local deb
  for deb in "$dir"/*.deb; do
    # shellcheck disable=SC2016  # dpkg-deb's fields, not the shell's
    dpkg-deb --show --showformat='${Package}=${Version}\n' "$deb"
  done | sort >"$dir/MANIFEST"
  echo "gpu-kit: $(wc -l <"$dir/MANIFEST") packages in $dir/MANIFEST," \
    "$(du -sh --apparent-size "$dir" | cut -f1) in all"
}

# ---------------------------------------------------------------- check

# Step bookkeeping: one "name status seconds reason" line per step in
# $WORK/steps.tsv; logs in $LOGS; report.json is written on any exit.
step_begin() {
  STEP="$1"
  STEP_START=$(date +%s.%N)
  echo "== $STEP"
}

step_end() {  # status [reason]
  local seconds
  seconds=$(awk -v a="$STEP_START" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\n' "$STEP" "$1" "$seconds" "${2:-}" >>"$WORK/steps.tsv"
  echo "== $STEP: $1 (${seconds} s)${2:+: $2}"
}

# Ends the run at a failed step: the reason, the log's tail, and the report.
step_fail() {  # reason log
  step_end failed "$1"
  echo "FAILED: $STEP: $1"
  if [[ -s "$2" ]]; then
    echo "--- last lines of $2"
    tail -n 40 "$2"
  fi
  exit 1
}

stop_after() {
  if [[ "$STOP_AFTER" == "$1" ]]; then
    echo "gpu-kit: stopping after $1 (--stop-after)"
    exit "$STATUS"
  fi
}

# Writes OUT/report.json, OUT/summary.txt and OUT/logs.tar.gz (the EXIT trap).
write_report() {
  local rc=$?
  ((rc == 0)) && rc=$STATUS
  python3 - "$WORK" "$OUT" "$rc" <<'PY' || echo "gpu-kit: report.json not written" >&2
import glob, json, os, sys
work, out, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
logs = os.path.join(work, "logs")

def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

steps = []
if os.path.exists(os.path.join(work, "steps.tsv")):
    for line in open(os.path.join(work, "steps.tsv")):
        name, status, seconds, reason = (line.rstrip("\n").split("\t") + [""])[:4]
        steps.append({"step": name, "status": status,
                      "seconds": float(seconds), "reason": reason})

tests = {}
for path in sorted(glob.glob(os.path.join(logs, "test_*.json"))):
    name = os.path.basename(path)[len("test_"):-len(".json")]
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for suite in (read_json(path) or {}).get("testsuites", []):
        for case in suite.get("testsuite", []):
            if case.get("failures"):
                counts["failed"] += 1
            elif case.get("result") == "SKIPPED" or case.get("status") == "NOTRUN":
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    tests[name] = counts
for path in sorted(glob.glob(os.path.join(logs, "test_*.rc"))):
    name = os.path.basename(path)[len("test_"):-len(".rc")]
    exit_code = int(open(path).read().strip() or -1)
    tests.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})
    tests[name]["exit_code"] = exit_code

bench_log = os.path.join(logs, "bench_train.log")
bench = open(bench_log, errors="replace").read().splitlines()[-60:] \
    if os.path.exists(bench_log) else []

report = {
    "status": "passed" if rc == 0 else "failed",
    "exit_code": rc,
    "host": read_json(os.path.join(work, "host.json")) or {},
    "steps": steps,
    "tests": tests,
    "missing_targets": open(os.path.join(work, "missing_targets")).read().split()
        if os.path.exists(os.path.join(work, "missing_targets")) else [],
    "build_errors": open(os.path.join(work, "build_errors.txt"), errors="replace")
        .read().splitlines() if os.path.exists(os.path.join(work, "build_errors.txt")) else [],
    "bench_train": bench,
}
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f, indent=2)
with open(os.path.join(out, "summary.txt"), "w") as f:
    f.write("gpu-kit check: %s (exit %d)\n" % (report["status"], rc))
    for s in steps:
        f.write("  %-10s %-8s %7.1f s  %s\n" % (s["step"], s["status"], s["seconds"], s["reason"]))
    for name, c in tests.items():
        f.write("  test %s: %d passed, %d failed, %d skipped (exit %s)\n"
                % (name, c["passed"], c["failed"], c["skipped"], c.get("exit_code")))
    for line in report["build_errors"][:60]:
        f.write("  " + line + "\n")
PY
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null || true
  [[ -f "$OUT/summary.txt" ]] && cat "$OUT/summary.txt"
  exit "$rc"
}

# Host facts into $LOGS/host.txt (readable) and $WORK/host.json (report).
collect_facts() {
  local txt="$LOGS/host.txt"
  {
    echo "# os"; cat /etc/os-release 2>/dev/null || true
    echo "# glibc"; ldd --version 2>&1 | head -1 || true
    echo "# gcc"; gcc --version 2>&1 | head -1 || true
    echo "# g++"; g++ --version 2>&1 | head -1 || true
    echo "# nvcc"; "$NVCC" --version 2>&1 | tail -2 || true
    echo "# cmake"; cmake --version 2>&1 | head -1 || true
    echo "# ninja"; ninja --version 2>&1 || true
    echo "# nproc"; nproc
    echo "# memory"; free -g 2>&1 | head -2 || true
    echo "# nvidia-smi"
    nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version \
      --format=csv 2>&1 || true
  } >"$txt"
  "$PYTHON" - "$NVCC" "$WORK/host.json" <<'PY' >>"$txt" 2>&1
import json, os, platform, subprocess, sys
nvcc, out = sys.argv[1], sys.argv[2]

def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""

facts = {"python": sys.executable, "machine": platform.machine()}
try:
    facts["os"] = dict(l.split("=", 1) for l in open("/etc/os-release").read()
                       .splitlines() if "=" in l).get("PRETTY_NAME", "").strip('"')
except OSError:
    facts["os"] = ""
facts["glibc"] = platform.libc_ver()[1]
facts["gcc"] = run("gcc", "-dumpfullversion")
facts["gxx"] = run("g++", "-dumpfullversion")
facts["nvcc"] = next((l for l in run(nvcc, "--version").splitlines()
                     if "release" in l), "")
facts["cmake"] = (run("cmake", "--version").splitlines() or [""])[0]
facts["ninja"] = run("ninja", "--version")
facts["nproc"] = os.cpu_count()
try:
    facts["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
except (ValueError, OSError):
    facts["memory_gib"] = None
gpus = run("nvidia-smi", "--query-gpu=name,compute_cap,memory.total,driver_version",
           "--format=csv,noheader")
facts["gpus"] = [dict(zip(["name", "compute_capability", "memory", "driver"],
                          [f.strip() for f in line.split(",")]))
                 for line in gpus.splitlines() if line.strip()]
try:
    import torch, torch.utils
    facts["torch"] = torch.__version__
    facts["torch_cuda"] = torch.version.cuda
    facts["torch_cxx11_abi"] = bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    facts["torch_cmake_prefix"] = torch.utils.cmake_prefix_path
    facts["torch_include_has_gloo"] = os.path.isdir(os.path.join(
        os.path.dirname(torch.__file__), "include", "gloo"))
    facts["torch_cuda_available"] = torch.cuda.is_available()
    if torch.version.cuda:
        try:
            facts["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001 - a fact, not a failure
            facts["torch_nccl"] = "unknown: %s" % e
except ImportError as e:
    facts["torch"] = "not importable: %s" % e
# One NCCL per process: the wheel's, which torch loads, else the toolkit's.
nccl_h, nccl_lib = "", ""
try:
    import nvidia.nccl
    wheel = nvidia.nccl.__path__[0]
    if os.path.exists(os.path.join(wheel, "include", "nccl.h")):
        nccl_h = os.path.join(wheel, "include")
    for name in ("libnccl.so", "libnccl.so.2"):
        if nccl_h and not nccl_lib and os.path.exists(os.path.join(wheel, "lib", name)):
            nccl_lib = os.path.join(wheel, "lib", name)
except ImportError:
    pass
if not nccl_lib:
    for include, lib in (("/usr/local/cuda/include", "/usr/local/cuda/lib64/libnccl.so"),
                         ("/usr/include", "/usr/lib/x86_64-linux-gnu/libnccl.so")):
        if os.path.exists(os.path.join(include, "nccl.h")) and os.path.exists(lib):
            nccl_h, nccl_lib = include, lib
            break
facts["nccl_include_dir"], facts["nccl_library"] = nccl_h, nccl_lib
json.dump(facts, open(out, "w"), indent=2)
print(json.dumps(facts, indent=2))
PY
}

# Reads one string fact from host.json.
fact() {
  python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get(sys.argv[2]) or "")' \
    "$WORK/host.json" "$1"
}

# Unpacks every .deb of $DIR into $PREFIX and writes a protoc that finds the
# prefix's libprotoc (CMake runs it at configure and build time).
unpack_kit() {
  local deb
  rm -rf "$PREFIX"
  mkdir -p "$PREFIX/kit-bin"
  for deb in "$DIR"/*.deb; do
    dpkg-deb -x "$deb" "$PREFIX"
  done
  # Absolute links (libz.so -> /lib/x86_64-linux-gnu/libz.so.1.2.13) would
  # name the host's files: point them into the prefix.
  local link
  while IFS= read -r -d '' link; do
    ln -sfn "$PREFIX$(readlink "$link")" "$link"
  done < <(find "$PREFIX" -type l -lname '/*' -print0)
  cat >"$PREFIX/kit-bin/protoc" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$LIBDIR\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$PREFIX/usr/bin/protoc" "\$@"
EOF
  chmod +x "$PREFIX/kit-bin/protoc"
  # gRPC's Findre2 wants a CMake config or else pkg-config, which the host
  # may lack and whose re2.pc names /usr: give it the config.
  mkdir -p "$LIBDIR/cmake/re2"
  cat >"$LIBDIR/cmake/re2/re2Config.cmake" <<EOF
add_library(re2::re2 SHARED IMPORTED)
set_target_properties(re2::re2 PROPERTIES
  IMPORTED_LOCATION "$LIBDIR/libre2.so"
  INTERFACE_INCLUDE_DIRECTORIES "$PREFIX/usr/include")
EOF
  local missing=()
  local header
  for header in grpcpp/grpcpp.h google/protobuf/message.h absl/status/status.h \
    prometheus/registry.h civetweb.h nlohmann/json.hpp gtest/gtest.h \
    gmock/gmock.h benchmark/benchmark.h re2/re2.h ares.h openssl/sha.h zlib.h; do
    [[ -e "$PREFIX/usr/include/$header" ]] || missing+=("$header")
  done
  ((${#missing[@]} == 0)) || { echo "missing headers: ${missing[*]}"; return 1; }
  "$PREFIX/kit-bin/protoc" --version
}

configure_tally() {
  local rpath_flag=-Wl,--disable-new-dtags
  local args=(
    -G Ninja -S "$SOURCE_DIR" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release
    -DTALLY_PYTHON="$PYTHON"
    "-DCMAKE_PREFIX_PATH=$PREFIX/usr${TORCH_PREFIX:+;$TORCH_PREFIX}"
    -DProtobuf_PROTOC_EXECUTABLE="$PREFIX/kit-bin/protoc"
    -DGRPC_CPP_PLUGIN="$PREFIX/usr/bin/grpc_cpp_plugin"
    -DGRPC_PYTHON_PLUGIN="$PREFIX/usr/bin/grpc_python_plugin"
    # DT_RPATH, unlike DT_RUNPATH, also finds the libraries that the
    # prefix's libraries need (libgrpc++ -> libgrpc -> libabsl_*).
    -DCMAKE_EXE_LINKER_FLAGS="$rpath_flag"
    -DCMAKE_SHARED_LINKER_FLAGS="$rpath_flag"
  )
  if ((CPU_ONLY)); then
    args+=(-DTALLY_WITH_CUDA=AUTO)
  else
    args+=(-DTALLY_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC"
      -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH")
    local nccl_include nccl_library
    nccl_include="$(fact nccl_include_dir)"
    nccl_library="$(fact nccl_library)"
    [[ -n "$nccl_include" ]] && args+=(-DTALLY_NCCL_INCLUDE_DIR="$nccl_include")
    [[ -n "$nccl_library" ]] && args+=(-DTALLY_NCCL_LIBRARY="$nccl_library")
  fi
  echo "cmake ${args[*]}"
  cmake "${args[@]}"
}

# Builds the KIT_TARGETS that exist; records the others in missing_targets.
build_tally() {
  local all present=() target
  all="$(ninja -C "$BUILD" -t targets all | cut -d: -f1)"
  : >"$WORK/missing_targets"
  for target in "${KIT_TARGETS[@]}"; do
    if grep -qx "$target" <<<"$all"; then
      present+=("$target")
    else
      echo "$target" >>"$WORK/missing_targets"
    fi
  done
  echo "targets: ${present[*]}; missing: $(paste -sd' ' "$WORK/missing_targets")"
  ((${#present[@]})) || return 0
  cmake --build "$BUILD" -j"$JOBS" --target "${present[@]}" -- -k 0
}

# Runs each KIT_TESTS binary that was built; a failing one fails the run at
# the end, not the remaining tests.
run_tests() {
  local name binary rc
  for name in "${KIT_TESTS[@]}"; do
    binary="$(find "$BUILD" -type f -perm -u+x -name "$name" | head -1)"
    if [[ -z "$binary" ]]; then
      echo "$name: not built"
      continue
    fi
    rc=0
    timeout "$KIT_TEST_TIMEOUT" "$binary" \
      --gtest_output="json:$LOGS/test_$name.json" >"$LOGS/test_$name.log" 2>&1 || rc=$?
    echo "$rc" >"$LOGS/test_$name.rc"
    echo "$name: exit $rc ($(grep -cE '^\[ +(OK|SKIPPED|FAILED) +\]' "$LOGS/test_$name.log") results)"
    ((rc == 0)) || TESTS_FAILED+=("$name")
  done
  ((${#TESTS_FAILED[@]} == 0))
}

# Runs bench_train with BENCH_TRAIN_ARGS in $LOGS (where any file it writes
# joins the logs).
run_bench() {
  # BENCH_TRAIN_ARGS is split into words on purpose.
  # shellcheck disable=SC2086
  (cd "$LOGS" && timeout "$KIT_BENCH_TIMEOUT" "$1" $BENCH_TRAIN_ARGS)
}

cmd_check() {
  CPU_ONLY=0
  STOP_AFTER=""
  while [[ $# -gt 0 && "$1" == --* ]]; do
    case "$1" in
      --cpu) CPU_ONLY=1; shift ;;
      --stop-after) STOP_AFTER="${2:?--stop-after needs a step}"; shift 2 ;;
      *) die "unknown option $1" ;;
    esac
  done
  [[ $# -eq 2 ]] || { usage >&2; exit 2; }
  DIR="$(cd "$1" && pwd)" || die "no kit directory $1"
  compgen -G "$DIR/*.deb" >/dev/null || die "no .deb files in $DIR (run prepare)"
  mkdir -p "$2"
  OUT="$(cd "$2" && pwd)"
  WORK="$KIT_WORK"
  [[ "$WORK" == /* && "$WORK" != / ]] || die "KIT_WORK must be an absolute path other than /"
  PREFIX="$WORK/prefix"
  LIBDIR="$PREFIX/usr/lib/x86_64-linux-gnu"
  BUILD="$WORK/build"
  LOGS="$WORK/logs"
  JOBS="${KIT_JOBS:-$(nproc)}"
  PYTHON="$(command -v python3)"
  NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  STATUS=0
  TESTS_FAILED=()
  rm -rf "$LOGS" "$WORK/steps.tsv" "$WORK/host.json" "$WORK/missing_targets" \
    "$WORK/build_errors.txt" "$OUT/report.json" "$OUT/summary.txt" "$OUT/logs.tar.gz"
  mkdir -p "$LOGS"
  trap write_report EXIT
  local started=$SECONDS

  step_begin facts
  collect_facts || step_fail "could not collect the host facts" "$LOGS/host.txt"
  TORCH_PREFIX="$(fact torch_cmake_prefix)"
  if ((!CPU_ONLY)); then
    [[ -x "$NVCC" ]] || step_fail "no nvcc on PATH or in /usr/local/cuda/bin" "$LOGS/host.txt"
    [[ -n "$TORCH_PREFIX" ]] || step_fail "$PYTHON has no torch" "$LOGS/host.txt"
    [[ "$(fact torch_cuda)" ]] || step_fail "$PYTHON's torch has no CUDA" "$LOGS/host.txt"
    [[ "$(fact torch_cxx11_abi)" == True ]] ||
      step_fail "$PYTHON's torch uses the old C++ ABI (_GLIBCXX_USE_CXX11_ABI=0)" "$LOGS/host.txt"
    CUDA_ARCH="${KIT_CUDA_ARCH:-$(python3 -c 'import json, sys
gpus = json.load(open(sys.argv[1])).get("gpus") or [{}]
print(gpus[0].get("compute_capability", "").replace(".", ""))' "$WORK/host.json")}"
    [[ "$CUDA_ARCH" =~ ^[0-9]+$ ]] ||
      step_fail "no GPU compute capability from nvidia-smi (set KIT_CUDA_ARCH)" "$LOGS/host.txt"
  fi
  step_end ok
  stop_after facts

  step_begin unpack
  unpack_kit >"$LOGS/unpack.log" 2>&1 || step_fail "unpacking $DIR into $PREFIX" "$LOGS/unpack.log"
  step_end ok "$(compgen -G "$DIR/*.deb" | wc -l) packages into $PREFIX"
  stop_after unpack

  step_begin configure
  configure_tally >"$LOGS/configure.log" 2>&1 || step_fail "cmake configure" "$LOGS/configure.log"
  step_end ok
  stop_after configure

  step_begin build
  if ! build_tally >"$LOGS/build.log" 2>&1; then
    grep -E -m60 'error:|undefined reference|FAILED:|CMake Error' "$LOGS/build.log" >"$WORK/build_errors.txt" || true
    cat "$WORK/build_errors.txt"
    step_fail "build (the first 60 error lines are in report.json)" "$LOGS/build.log"
  fi
  step_end ok
  stop_after build

  step_begin tests
  if run_tests >"$LOGS/tests.log" 2>&1; then
    step_end ok
  else
    STATUS=1
    step_end failed "${TESTS_FAILED[*]}"
  fi
  cat "$LOGS/tests.log"
  stop_after tests

  step_begin bench
  local bench="$BUILD/bench/bench_train"
  if [[ ! -x "$bench" ]]; then
    STATUS=1
    step_end failed "bench_train was not built"
  elif run_bench "$bench" >"$LOGS/bench_train.log" 2>&1; then
    step_end ok
  else
    STATUS=1
    step_end failed "bench_train $BENCH_TRAIN_ARGS (see bench_train.log)"
  fi
  tail -n 20 "$LOGS/bench_train.log"
  echo "gpu-kit: check took $((SECONDS - started)) s"
}

main() {
  case "${1:-}" in
    prepare) shift; cmd_prepare "$@" ;;
    check) shift; cmd_check "$@" ;;
    -h|--help|help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

main "$@"
