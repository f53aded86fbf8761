#!/usr/bin/env bash
# chaos/run.sh SCENARIOS DURATION — what `make chaos` runs (docs/CONTRACTS.md).
#
#   SCENARIOS  comma list (T1,T4,T6), "short" (the CI tier), "all"; default T1,T4,T6
#   DURATION   fault phase of each scenario (60s, 2m); default 60s
#   PREV_REF   (environment) the previous release U1 upgrades from; default 27008e8
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

# U1 starts a replica on the previous release's kvrouter: build it once per
# PREV_REF (a commit or tag; default the last commit before snapshot format 2
# and the halt-on-unknown-command policy). That default predates TLS, so U1
# then runs its whole cluster insecure (the harness checks the binary's
# flags; see u1Nemesis in chaos/scenarios.go for why not 2e93e6a).
prev_ref=${PREV_REF:-27008e8}
prev_bin=$root/bin/kvrouter-prev-$prev_ref
case ",$(printf %s "${scenarios:-}" | tr 'A-Z ' 'a-z,')," in
*,u1,* | *,all,*)
  if [ ! -x "$prev_bin" ]; then
    say "building the previous release's kvrouter from $prev_ref"
    wt=$(mktemp -d)
    if git -C "$root" worktree add --detach "$wt" "$prev_ref" >/dev/null 2>&1 &&
      (cd "$wt" && go build -o "$prev_bin" ./cmd/kvrouter); then
      :
    else
      say "cannot build $prev_ref: U1 will fail its preflight"
    fi
    git -C "$root" worktree remove --force "$wt" 2>/dev/null
  fi
  ;;
esac

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
"$harness" -root "$root" -scenarios "$scenarios" -duration "$duration" -prev-bin "$prev_bin" &
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
