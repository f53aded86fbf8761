#!/usr/bin/env bash
# chaos/run.sh SCENARIOS DURATION — what `make chaos` runs (CONTRACTS.md).
#
#   SCENARIOS  comma list (T1,T4,T6), "short" (the CI tier), "all"; default T1,T4,T6
#   DURATION   fault phase of each scenario (60s, 2m); default 60s
#
# Builds the harness (package chaos, build tag `chaos`) and runs it as root:
# three network namespaces, real kvrouter replicas from bin/, HAProxy, kvmock
# workers, ledger workers, clients and the nemesis. Writes
# chaos/out/report.json and an artifact folder chaos/out/<run-id>/<scenario>/
# (logs, data dirs, histories, timeline). Exit status 0 only when every
# scenario passed.
#
# Whatever happens (failure, Ctrl-C, the harness crashing), the trap below
# kills the processes the harness started and deletes its namespaces and
# bridge; the harness restores any host firewall rule it added itself.
set -u
cd "$(dirname "$0")/.." || exit 1
root=$PWD
out=$root/chaos/out
scenarios=${1:-${SCENARIOS:-}}
duration=${2:-${DURATION:-}}
mkdir -p "$out"

say() { printf 'chaos/run.sh: %s\n' "$*"; }

fail_report() { # reason: a report that says why nothing ran
  python3 - "$out/report.json" "$scenarios" "$1" <<'PY' 2>/dev/null || printf '{"scenarios": [], "error": "%s"}\n' "$1" >"$out/report.json"
import json, sys
path, sc, why = sys.argv[1], sys.argv[2] or "T1,T4,T6", sys.argv[3]
ids = [s.strip() for s in sc.split(",") if s.strip()]
json.dump({"scenarios": [{"id": i, "passed": False, "lost": -1, "duplicates": -1, "failover_p99_s": -1,
           "availability": -1, "error": why} for i in ids], "passed": False}, open(path, "w"), indent=2)
PY
}

if [ "$(id -u)" != 0 ]; then
  say "needs root (network namespaces, iptables); run as root or with sudo"
  fail_report "needs root"
  exit 1
fi
missing=()
command -v haproxy >/dev/null || missing+=(haproxy)
command -v iptables >/dev/null || missing+=(iptables)
command -v ip >/dev/null || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" >/dev/null 2>&1 ||
    { say "cannot install ${missing[*]}"; fail_report "missing ${missing[*]}"; exit 1; }
fi

harness=$out/chaosrun
say "building the harness (-tags chaos)"
if ! go build -tags chaos -o "$harness" ./chaos/cmd/chaosrun; then
  fail_report "harness does not build"
  exit 1
fi

pidfile=$out/pids
cleanup() {
  # Children of a harness that died: kill them by the pids it recorded.
  if [ -s "$pidfile" ]; then
    while read -r p; do
      [ -n "$p" ] && kill -0 "$p" 2>/dev/null && kill -KILL "$p" 2>/dev/null
    done <"$pidfile"
    : >"$pidfile"
  fi
  for i in 1 2 3 4; do
    ip netns del "kvc$i" 2>/dev/null
    ip link del "kvc${i}h" 2>/dev/null
  done
  ip link del kvcbr0 2>/dev/null
  while iptables -D FORWARD -i kvcbr0 -o kvcbr0 -j ACCEPT 2>/dev/null; do :; done
  true
}
trap cleanup EXIT
trap 'say interrupted; [ -n "${hp:-}" ] && kill -TERM "$hp" 2>/dev/null; wait "${hp:-}" 2>/dev/null; exit 130' INT TERM HUP

cleanup
rm -f "$out/report.json" # never leave an earlier run's report to be mistaken for this one
"$harness" -root "$root" -scenarios "$scenarios" -duration "$duration" &
hp=$!
wait "$hp"
code=$?
hp=
if [ -f "$out/report.json" ]; then
  say "report: $out/report.json"
else
  fail_report "harness exited $code without a report"
fi
exit "$code"
