#!/usr/bin/env bash
# deploy/local/disagg-live.sh — seed 001's disaggregation experiment, live:
# one kvrouter replica, one prefill-only and one decode-only kvmock whose KV
# transfer crosses one shared LINK_MBPS link, measured with kvbench load for
# --disagg off, always and auto side by side.
#
#   make build && deploy/local/disagg-live.sh            # 104 MB/s (1 GbE)
#   LINK_MBPS=5000 deploy/local/disagg-live.sh           # a faster link
#
# Prints one line per (mode, prompt tokens, concurrency) with TTFT p50/p99
# from kvbench's JSON, and the router's disaggregation decisions.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=$PWD/bin
link=${LINK_MBPS:-104}
base=${PORT_BASE:-18000}
work=$(mktemp -d /tmp/kvrouter-disagg.XXXXXX)
pids=()
stop() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap 'stop; [ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
for b in kvrouter kvmock kvbench; do
  [ -x "$bin/$b" ] || { echo "disagg-live: $bin/$b missing: run make build" >&2; exit 1; }
done

http=127.0.0.1:$((base + 1))
start() { # mode
  rm -rf "$work/data"
  "$bin/kvrouter" serve --node-id dg1 --single-node --data-dir "$work/data" --http-addr "$http" \
    --raft-addr 127.0.0.1:$((base + 2)) --nats-addr 127.0.0.1:$((base + 3)) --nats-cluster-addr 127.0.0.1:$((base + 4)) \
    --model kvmock --disagg "$1" --disagg-link-mbps "$link" --log-level warn >"$work/router-$1.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do curl -fs "http://$http/health" >/dev/null && break; sleep 0.1; done
  local common=(--model kvmock --nats nats://127.0.0.1:$((base + 3)) --register "http://$http" --log-level warn)
  "$bin/kvmock" --id dg-p --addr 127.0.0.1:$((base + 11)) --role prefill --link-mbps "$link" "${common[@]}" >"$work/p-$1.log" 2>&1 &
  pids+=($!)
  "$bin/kvmock" --id dg-d --addr 127.0.0.1:$((base + 12)) --role decode "${common[@]}" >"$work/d-$1.log" 2>&1 &
  pids+=($!)
  # Ready needs one worker; the measurement needs both registered.
  for _ in $(seq 100); do
    curl -fs "http://$http/ready" >/dev/null &&
      [ "$(curl -fs "http://$http/cluster/status?digest=0" | grep -o '"role":"[a-z]*"' | sort -u | wc -l)" = 2 ] && return 0
    sleep 0.1
  done
  echo "disagg-live: replica not ready or workers missing:" >&2; curl -s "http://$http/cluster/status?digest=0" >&2; exit 1
}

printf '%-7s %7s %4s %12s %12s\n' mode prompt conc "TTFT p50 s" "TTFT p99 s"
for mode in off always auto; do
  start "$mode"
  for run in "1500 1 4" "3000 1 4" "1500 4 8"; do
    read -r tokens conc reqs <<<"$run"
    "$bin/kvbench" load --target "http://$http" --prefixes 1 --prefix-tokens 0 --tail-tokens "$tokens" \
      --output-tokens 8 --requests "$reqs" --concurrency "$conc" --json "$work/r.json" >/dev/null
    python3 - "$work/r.json" "$mode" "$tokens" "$conc" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["results"][0]
print(f"{sys.argv[2]:<7} {sys.argv[3]:>7} {sys.argv[4]:>4} {r['ttft_ms']['p50']/1000:12.3f} {r['ttft_ms']['p99']/1000:12.3f}")
PY
  done
  curl -s "http://$http/metrics" | grep '^kvrouter_disagg_decisions_total' | sed 's/^/    /' || true
  stop
done
