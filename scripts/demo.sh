#!/usr/bin/env bash
# End-to-end demo: starts a 4-rank tally-server (dp_shard 2 x tp 2) with the
# embedded demo model on free ports, trains it for 30 steps with tallyctl on
# the bundled corpus, samples a completion from the trained weights, shows a
# few of the server's metrics, then stops the server with SIGTERM and checks
# that it shut down cleanly.
#
#   scripts/demo.sh [BUILD_DIR]   # default: build
#
# The server's log is kept in BUILD_DIR/demo/server.log.
set -euo pipefail

build_dir="${1:-build}"
server="$build_dir/server/tally-server"
tallyctl="$build_dir/client/tallyctl"
for binary in "$server" "$tallyctl"; do
  if [[ ! -x "$binary" ]]; then
    echo "demo: $binary not found; build first: cmake --build $build_dir -j2" >&2
    exit 1
  fi
done

work_dir="$build_dir/demo"
rm -rf "$work_dir"
mkdir -p "$work_dir"
port_file="$work_dir/ports.json"
server_log="$work_dir/server.log"
server_pid=""

# On any failure: show the server's log and make sure it does not outlive us.
on_exit() {
  local status=$?
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -KILL "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  if ((status != 0)) && [[ -s "$server_log" ]]; then
    echo "demo: failed; last lines of $server_log:" >&2
    tail -n 40 "$server_log" >&2
  fi
}
trap on_exit EXIT

# Prints the value of "key": N in the port file, or nothing.
port_of() {
  sed -n "s/.*\"$1\": *\([0-9][0-9]*\).*/\1/p" "$port_file" 2>/dev/null
}

# Four local ranks: 2 ZeRO-3 shards x 2 tensor-parallel ranks. The results
# equal a single-rank run (tests/golden/multirank_golden_test.cc).
mesh_flags=(--nproc-per-node 4 --dp-shard 2 --tp 2)
echo "demo: starting $server ${mesh_flags[*]}"
"$server" "${mesh_flags[@]}" --grpc-port 0 --metrics-port 0 \
  --port-file "$port_file" --demo-model >"$server_log" 2>&1 &
server_pid=$!

# The server writes the port file (atomically) once it is SERVING.
wait_limit=$((SECONDS + 60))
until [[ -s "$port_file" ]]; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    server_status=0
    wait "$server_pid" || server_status=$?
    server_pid=""
    echo "demo: the server exited early with status $server_status" >&2
    exit 1
  fi
  if ((SECONDS >= wait_limit)); then
    echo "demo: no port file after 60 s" >&2
    exit 1
  fi
  sleep 0.2
done
grpc_port="$(port_of grpc_port)"
metrics_port="$(port_of metrics_port)"
if [[ -z "$grpc_port" || -z "$metrics_port" ]]; then
  echo "demo: cannot read the ports from $port_file: $(cat "$port_file")" >&2
  exit 1
fi
metrics_url="http://localhost:$metrics_port/metrics"
echo "demo: server pid $server_pid serving gRPC on localhost:$grpc_port," \
  "metrics on $metrics_url"
echo

"$tallyctl" train demo --target "localhost:$grpc_port" --steps 30 \
  --metrics-url "$metrics_url"
echo

# Sampling from the weights just trained, on the same 4-rank mesh: the demo
# model's tokens are bytes, so the completion reads as text.
prompt="The "
prompt_ids=$(printf '%s' "$prompt" | od -An -tu1 | xargs | tr ' ' ',')
echo "demo: the trained model completes \"$prompt\" (greedy, 40 tokens):"
sampled=$("$tallyctl" sample --target "localhost:$grpc_port" --model demo \
  --prompt-ids "$prompt_ids" --max-tokens 40 --temperature 0 --stop-ids none)
echo "$sampled"
completion=$(sed -n 's/^sample 0 ([a-z]*): //p' <<<"$sampled")
text=""
for id in ${completion//,/ }; do
  text+=$(printf "\\$(printf '%03o' "$id")")
done
echo "demo: as text: \"$prompt$text\""
echo

if command -v curl >/dev/null; then
  echo "demo: a few tally metrics from $metrics_url:"
  curl -fsS "$metrics_url" | grep '^tally_' | head -n 15 || true
  echo
fi

echo "demo: stopping the server (SIGTERM)"
kill -TERM "$server_pid"
stop_limit=$((SECONDS + 30))
while kill -0 "$server_pid" 2>/dev/null; do
  if ((SECONDS >= stop_limit)); then
    echo "demo: the server did not exit within 30 s of SIGTERM" >&2
    exit 1
  fi
  sleep 0.2
done
server_status=0
wait "$server_pid" || server_status=$?
server_pid=""
if ((server_status != 0)); then
  echo "demo: the server exited with status $server_status after SIGTERM" >&2
  exit 1
fi
echo "demo: the server shut down cleanly (exit status 0); log: $server_log"
echo "demo: metrics were served at $metrics_url while the server ran"
