#!/usr/bin/env bash
# deploy/local/run.sh — the local cluster behind `make run` (docs/CONTRACTS.md):
#   three kvrouter replicas   HTTP 127.0.0.1:8001-8003, Raft :7001-7003,
#                             NATS clients :4222-4224, NATS routes :6222-6224
#   four kvmock workers       HTTP 127.0.0.1:9001-9004
#   HAProxy (if installed)    127.0.0.1:8000 -> the three replicas (stats :8404)
# Data and logs go to a run directory that is wiped at every start. The script
# stays in the foreground until SIGINT/SIGTERM/SIGHUP, then stops everything it
# started and exits 0. A child that dies (say a replica killed on purpose) is
# reported and the rest keeps running.
#
# Settings (environment; defaults in brackets):
#   KVROUTER_BIN_DIR          where kvrouter and kvmock are [<repo>/bin]
#   KVROUTER_RUN_DIR          data + logs, wiped at start [<repo>/tmp/run]
#   KVROUTER_RUN_KEEP_DATA=1  keep the run directory (restart on old state)
#   KVROUTER_RUN_PORT_OFFSET  added to every port above [0]
#   KVROUTER_RUN_WORKERS      number of kvmock workers [4]
#   KVROUTER_RUN_MODEL        model name served [kvmock]
#   KVROUTER_RUN_BLOCK_SIZE   KV block size, router and workers [16]
#   KVMOCK_KV_BLOCKS          KV cache blocks per worker [2048]
#   KVMOCK_SPEEDUP            simulated-time speedup of the workers [10]
#   KVMOCK_MAX_BATCHED_TOKENS scheduler budget per step [kvmock's default]
#   KVROUTER_SERVE_ARGS       extra flags for every `kvrouter serve` (split on spaces)
#   KVMOCK_ARGS               extra flags for every kvmock (split on spaces)
#   KVROUTER_RUN_HAPROXY      auto (if on PATH) or 0 [auto]
#   KVROUTER_RUN_TAIL         1: copy every log to the terminal, prefixed
#                             [1 when stdout is a terminal, else 0]
#   KVROUTER_RUN_READY_TIMEOUT seconds to wait for /ready before warning [180]
#   KVROUTER_RUN_STOP_TIMEOUT  seconds children get after SIGTERM before SIGKILL [15]
#   KVROUTER_RUN_INSECURE=1   no certificates: Raft, NATS and /cluster/* unauthenticated
#                             (the replicas are started with --insecure) [0]
#   KVROUTER_RUN_CAPTURE=1    every replica captures its answered requests as a
#                             trace, <run dir>/<replica>/capture.jsonl (block
#                             hashes and lengths; kvbench sim --trace / kvbench
#                             tune --trace r1,r2,r3 replay them together) [0]
#   KVROUTER_RUN_ADMIN_TOKEN=0 no admin token: the admin endpoints (worker
#                             registration included) open to every user of this
#                             host; each replica warns [1: a fresh token in
#                             secrets/admin-token, required, see below]
#   KVROUTER_RUN_WORKER_API_KEY=0 workers without an API key [1: a fresh key in
#                             secrets/worker-api-key, required by every kvmock
#                             on /v1/* and sent by the replicas]
#
# Security (SECURITY.md): by default the run directory gets a private CA and
# certificates (certs/, from `kvrouter certs`): every replica serves Raft over
# mutual TLS (members only), NATS with TLS and authentication (replicas by
# node certificate, each kvmock by its worker certificate, publishing only its
# own events; tools by the replica token in secrets/replica-token), and
# HTTPS on its HTTP port, where /cluster/* takes a member's certificate only.
# The HTTP ports also answer plaintext http:// (they bind loopback), so curl,
# HAProxy and the acceptance scripts work unchanged.
# The admin endpoints (worker registration, deregistration, moves, /debug/*,
# /workers) take the admin token in secrets/admin-token — also from this
# host: otherwise any local user could register a "worker" at a port of
# theirs and receive other users' prompts. The one exception is
# /busy_threshold from loopback (--admin-open-to-loopback, below). kvbench
# reads the token, the replica token and the worker API key from secrets/
# by itself (cmd/kvbench/README.md); with curl:
#   curl -H "Authorization: Bearer $(cat tmp/run/secrets/admin-token)" ...
# Every other KVROUTER_* / DYN_* variable reaches `kvrouter serve` unchanged
# (e.g. KVROUTER_LOG_LEVEL=debug, DYN_ROUTER_MODE=round-robin), and KVMOCK_*
# ones reach kvmock (which reads KVMOCK_<FLAG>; flags given here win).
set -u

me=run.sh
say() { printf '%s: %s\n' "$me" "$*"; }
die() { printf '%s: %s\n' "$me" "$*" >&2; exit 1; }

caller_dir=$PWD
root=$(cd "$(dirname "$0")/../.." && pwd) || die "cannot find the repository root"
cd "$root" || die "cannot cd to $root"

bin_dir=${KVROUTER_BIN_DIR:-$root/bin}
case $bin_dir in /*) ;; *) bin_dir=$caller_dir/$bin_dir ;; esac
run_dir=${KVROUTER_RUN_DIR:-$root/tmp/run}
keep_data=${KVROUTER_RUN_KEEP_DATA:-0}
offset=${KVROUTER_RUN_PORT_OFFSET:-0}
n_workers=${KVROUTER_RUN_WORKERS:-4}
model=${KVROUTER_RUN_MODEL:-kvmock}
block_size=${KVROUTER_RUN_BLOCK_SIZE:-16}
kv_blocks=${KVMOCK_KV_BLOCKS:-2048}
speedup=${KVMOCK_SPEEDUP:-10}
max_batched=${KVMOCK_MAX_BATCHED_TOKENS:-}
use_haproxy=${KVROUTER_RUN_HAPROXY:-auto}
ready_timeout=${KVROUTER_RUN_READY_TIMEOUT:-180}
insecure=${KVROUTER_RUN_INSECURE:-0}
want_admin_token=${KVROUTER_RUN_ADMIN_TOKEN:-1}
want_worker_key=${KVROUTER_RUN_WORKER_API_KEY:-1}
stop_timeout=${KVROUTER_RUN_STOP_TIMEOUT:-15}
capture=${KVROUTER_RUN_CAPTURE:-0}
if [ -t 1 ]; then tail_logs=${KVROUTER_RUN_TAIL:-1}; else tail_logs=${KVROUTER_RUN_TAIL:-0}; fi
read -r -a serve_extra <<<"${KVROUTER_SERVE_ARGS:-}"
read -r -a mock_extra <<<"${KVMOCK_ARGS:-}"

is_uint() { case $1 in '' | *[!0-9]*) return 1 ;; *) return 0 ;; esac; }
for v in offset n_workers block_size kv_blocks ready_timeout stop_timeout; do
  is_uint "${!v}" || die "$v must be a whole number, got '${!v}'"
done
if [ "$n_workers" -lt 1 ] || [ "$n_workers" -gt 99 ]; then die "KVROUTER_RUN_WORKERS must be 1..99"; fi
[ $((9000 + n_workers + offset)) -le 65535 ] || die "KVROUTER_RUN_PORT_OFFSET $offset pushes ports past 65535"

kvrouter=$bin_dir/kvrouter
kvmock=$bin_dir/kvmock
for b in "$kvrouter" "$kvmock"; do
  [ -x "$b" ] || die "$b not found or not executable: run \`make build\` first (or set KVROUTER_BIN_DIR)"
done

# --- the layout -------------------------------------------------------------
host=127.0.0.1
replicas=(r1 r2 r3)
declare -A http_port raft_port nats_port route_port
for i in 1 2 3; do
  r=r$i
  http_port[$r]=$((8000 + i + offset))
  raft_port[$r]=$((7000 + i + offset))
  nats_port[$r]=$((4221 + i + offset))
  route_port[$r]=$((6221 + i + offset))
done
lb_port=$((8000 + offset))
stats_port=$((8404 + offset))
workers=()
declare -A worker_port
for ((j = 1; j <= n_workers; j++)); do
  w=mock-$j
  workers+=("$w")
  worker_port[$w]=$((9000 + j + offset))
done

if [ "$use_haproxy" != 0 ] && command -v haproxy >/dev/null 2>&1; then
  haproxy_bin=$(command -v haproxy)
else
  haproxy_bin=
fi

peers='' nats_urls='' replica_urls=''
for r in "${replicas[@]}"; do
  peers+="${peers:+,}$r=$host:${raft_port[$r]}"
  nats_urls+="${nats_urls:+,}nats://$host:${nats_port[$r]}"
  replica_urls+="${replica_urls:+,}http://$host:${http_port[$r]}"
done

# --- refuse to start on ports somebody else holds -----------------------------
port_busy() {
  if command -v ss >/dev/null 2>&1; then
    # Only listeners that collide with ours: on $host or on every address
    # (another network namespace's 10.x:8000, say, does not).
    ss -Hltn "sport = :$1" 2>/dev/null | awk -v h="$host" -v p="$1" '
      { a = $4 } a == h":"p || a == "0.0.0.0:"p || a == "*:"p || a == "[::]:"p || a == "[::ffff:"h"]:"p { found = 1 }
      END { exit !found }' && return 0
  fi
  # Something accepts connections there (covers systems without ss).
  (exec 3<>"/dev/tcp/$host/$1") 2>/dev/null
}
busy=()
check_port() { # port what
  if port_busy "$1"; then busy+=("$1 ($2)"); fi
}
for r in "${replicas[@]}"; do
  check_port "${http_port[$r]}" "$r HTTP"
  check_port "${raft_port[$r]}" "$r Raft"
  check_port "${nats_port[$r]}" "$r NATS clients"
  check_port "${route_port[$r]}" "$r NATS routes"
done
for w in "${workers[@]}"; do check_port "${worker_port[$w]}" "$w HTTP"; done
if [ -n "$haproxy_bin" ]; then
  check_port "$lb_port" "HAProxy"
  check_port "$stats_port" "HAProxy stats"
fi
if [ ${#busy[@]} -gt 0 ]; then
  {
    echo "$me: cannot start, these ports on $host are already in use:"
    for b in "${busy[@]}"; do echo "    $b"; done
    echo "  Another \`make run\` (or a leftover kvrouter/kvmock/haproxy) is probably still running."
    p=${busy[0]%% *}
    echo "  See who holds one:  ss -ltnp 'sport = :$p'    (or: lsof -iTCP:$p -sTCP:LISTEN)"
    echo "  Stop it, or shift every port: KVROUTER_RUN_PORT_OFFSET=100 make run"
  } >&2
  exit 1
fi

# --- a fresh run directory ---------------------------------------------------
marker=.kvrouter-run
case $run_dir in /*) ;; *) run_dir=$caller_dir/$run_dir ;; esac
if [ -e "$run_dir" ] && [ "$keep_data" != 1 ]; then
  [ -d "$run_dir" ] || die "KVROUTER_RUN_DIR=$run_dir exists and is not a directory"
  if [ -n "$(ls -A "$run_dir")" ] && [ ! -e "$run_dir/$marker" ]; then
    die "KVROUTER_RUN_DIR=$run_dir is not empty and was not made by run.sh; refusing to wipe it (choose another directory)"
  fi
  rm -rf -- "$run_dir" || die "cannot wipe $run_dir"
fi
mkdir -p "$run_dir" || die "cannot create $run_dir"
touch "$run_dir/$marker"

# --- process bookkeeping and shutdown -----------------------------------------
pids=() names=() logs=()
tail_pid='' sleeper='' stopping=0 force=0 stop_t0=0

alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }

stop_all() {
  [ "$stopping" = 1 ] && return
  stopping=1
  [ ${#pids[@]} = 0 ] && return
  # A second Ctrl-C while stopping skips the grace period. Signals within the
  # first seconds do not count: `make` forwards the same SIGTERM/SIGINT to us
  # right after the process group got it.
  # shellcheck disable=SC2034 # read by the trap string below
  stop_t0=$SECONDS
  trap '[ $((SECONDS - stop_t0)) -ge 2 ] && force=1' INT TERM HUP
  local i pid left deadline
  say "stopping everything it started..."
  for i in "${!pids[@]}"; do
    pid=${pids[$i]}
    alive "$pid" && kill -TERM "$pid" 2>/dev/null
  done
  deadline=$((SECONDS + stop_timeout))
  while :; do
    left=0
    for i in "${!pids[@]}"; do alive "${pids[$i]}" && left=$((left + 1)); done
    [ "$left" = 0 ] && break
    if [ "$force" = 1 ] || [ "$SECONDS" -ge "$deadline" ]; then
      for i in "${!pids[@]}"; do
        pid=${pids[$i]}
        if alive "$pid"; then
          say "${names[$i]} (pid $pid) still running after SIGTERM: SIGKILL"
          kill -KILL "$pid" 2>/dev/null
        fi
      done
      break
    fi
    sleep 0.2
  done
  for i in "${!pids[@]}"; do
    [ -n "${pids[$i]}" ] && wait "${pids[$i]}" 2>/dev/null
  done
  alive "$sleeper" && kill "$sleeper" 2>/dev/null
  alive "$tail_pid" && kill "$tail_pid" 2>/dev/null
  say "stopped; logs and data are in $run_dir"
}
on_signal() {
  echo
  say "got SIG$1"
  stop_all
  exit 0
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM
trap 'on_signal HUP' HUP
trap 'stop_all' EXIT

# start NAME COMMAND... : runs COMMAND in the background with its output in
# $run_dir/NAME.log. `cmd >file &` makes bash exec the command in the forked
# child, so $! is the program itself (its pid is what /cluster/status reports).
start() {
  local name=$1
  shift
  "$@" >"$run_dir/$name.log" 2>&1 </dev/null &
  pids+=("$!")
  names+=("$name")
  logs+=("$run_dir/$name.log")
}

# nap SECONDS: a sleep that a signal interrupts at once (the trap runs
# immediately instead of after the sleep).
nap() {
  sleep "$1" &
  sleeper=$!
  wait "$sleeper" 2>/dev/null
  sleeper=''
}

describe_exit() { # code -> words
  if [ "$1" -gt 128 ]; then
    local sig
    sig=$(kill -l "$(($1 - 128))" 2>/dev/null) || sig=$(($1 - 128))
    echo "was killed by SIG$sig"
  else
    echo "exited with status $1"
  fi
}

# reap: report every child that ended since the last call.
reap() {
  local i pid code
  for i in "${!pids[@]}"; do
    pid=${pids[$i]}
    [ -n "$pid" ] || continue
    alive "$pid" && continue
    wait "$pid" 2>/dev/null
    code=$?
    pids[i]=''
    say "${names[$i]} (pid $pid) $(describe_exit "$code"); the rest keeps running. Last lines of ${logs[$i]}:" >&2
    tail -n 8 "${logs[$i]}" 2>/dev/null | sed 's/^/    | /' >&2
  done
}
replicas_alive() {
  local i n=0
  for i in "${!pids[@]}"; do
    case ${names[$i]} in r[0-9]) alive "${pids[$i]}" && n=$((n + 1)) ;; esac
  done
  echo "$n"
}

# http_status URL: the HTTP status code, or 000 when nothing answers.
if command -v curl >/dev/null 2>&1; then
  http_status() { curl -s -o /dev/null -w '%{http_code}' --max-time 1 "$1" 2>/dev/null || true; }
else
  http_status() { # plain bash: http://host:port/path only
    local hp=${1#http://} line
    hp=${hp%%/*}
    line=$(
      exec 3<>"/dev/tcp/${hp%:*}/${hp#*:}" 2>/dev/null || exit 0
      printf 'GET /%s HTTP/1.0\r\nHost: %s\r\n\r\n' "${1#http://*/}" "$hp" >&3
      read -r -t 1 line <&3 && echo "$line"
    )
    # shellcheck disable=SC2086 # split the status line into words
    set -- $line
    echo "${2:-000}"
  }
fi

# --- credentials --------------------------------------------------------------
# new_secret FILE: 32 random bytes, hex, written 0600 before a byte of it.
new_secret() {
  (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$1") || die "cannot write $1"
}
certs_dir=$run_dir/certs
secrets_dir=$run_dir/secrets
serve_sec=() scheme=http
if [ "$insecure" = 1 ]; then
  serve_sec=(--insecure)
  say "KVROUTER_RUN_INSECURE=1: Raft, NATS and /cluster/* run without TLS or authentication"
else
  node_hosts='' worker_ids=''
  for r in "${replicas[@]}"; do node_hosts+="${node_hosts:+,}$r=$host"; done
  for w in "${workers[@]}"; do worker_ids+="${worker_ids:+,}$w"; done
  "$kvrouter" certs --dir "$certs_dir" --nodes "$node_hosts" --workers "$worker_ids" >"$run_dir/certs.log" 2>&1 ||
    { cat "$run_dir/certs.log" >&2; die "kvrouter certs failed"; }
  mkdir -p "$secrets_dir" && chmod 700 "$secrets_dir"
  new_secret "$secrets_dir/replica-token"
  scheme=https
fi
if [ "$want_admin_token" = 1 ]; then
  mkdir -p "$secrets_dir" && chmod 700 "$secrets_dir"
  new_secret "$secrets_dir/admin-token"
else
  say "WARNING: KVROUTER_RUN_ADMIN_TOKEN=$want_admin_token: no admin token - every user of this host may register a worker (and receive other users' prompts and the worker API key), deregister or move workers; each replica warns too" >&2
fi
if [ "$want_worker_key" = 1 ]; then
  mkdir -p "$secrets_dir" && chmod 700 "$secrets_dir"
  new_secret "$secrets_dir/worker-api-key"
fi
# serve_security R: the security flags of replica R.
serve_security() {
  local r=$1 a=("${serve_sec[@]}")
  if [ "$insecure" != 1 ]; then
    a+=(--tls-ca "$certs_dir/ca.pem" --tls-cert "$certs_dir/node-$r.pem" --tls-key "$certs_dir/node-$r-key.pem"
      --replica-token-file "$secrets_dir/replica-token")
  fi
  if [ "$want_admin_token" = 1 ]; then
    # The one admin path left open to this host's callers without the
    # token: /busy_threshold is the contract's runtime tuning API
    # (docs/CONTRACTS.md), tuned with a plain POST - the live-cluster
    # acceptance check sets a threshold on a follower without a credential.
    # It changes routing thresholds only: registering, deregistering or
    # moving workers, /debug/*, /workers and /cluster/* keep their
    # credential. Each replica warns at start and logs the uses (SECURITY.md).
    a+=(--admin-token-file "$secrets_dir/admin-token" --admin-open-to-loopback /busy_threshold)
  fi
  [ "$want_worker_key" = 1 ] && a+=(--worker-api-key-file "$secrets_dir/worker-api-key")
  [ ${#a[@]} = 0 ] || printf '%s\n' "${a[@]}"
}
# mock_security W: the security flags of worker W (its own certificate; it
# registers over HTTPS, trusting the CA).
mock_security() {
  local w=$1 a=()
  if [ "$insecure" != 1 ]; then
    a+=(--nats-tls-ca "$certs_dir/ca.pem" --nats-tls-cert "$certs_dir/worker-$w.pem" --nats-tls-key "$certs_dir/worker-$w-key.pem")
  fi
  [ "$want_admin_token" = 1 ] && a+=(--admin-token-file "$secrets_dir/admin-token")
  [ "$want_worker_key" = 1 ] && a+=(--api-key-file "$secrets_dir/worker-api-key")
  [ ${#a[@]} = 0 ] || printf '%s\n' "${a[@]}"
}
register_urls=''
for r in "${replicas[@]}"; do register_urls+="${register_urls:+,}$scheme://$host:${http_port[$r]}"; done

# --- go ----------------------------------------------------------------------
say "run directory $run_dir (wiped at start; logs are <name>.log there)"

for r in "${replicas[@]}"; do
  routes=
  for o in "${replicas[@]}"; do
    [ "$o" = "$r" ] || routes+="${routes:+,}nats://$host:${route_port[$o]}"
  done
  mkdir -p "$run_dir/$r"
  mapfile -t sec < <(serve_security "$r")
  capt=()
  [ "$capture" = 1 ] && capt=(--capture-file "$run_dir/$r/capture.jsonl")
  start "$r" "$kvrouter" serve \
    --node-id "$r" \
    --data-dir "$run_dir/$r" \
    --http-addr "$host:${http_port[$r]}" \
    --raft-addr "$host:${raft_port[$r]}" \
    --nats-addr "$host:${nats_port[$r]}" \
    --nats-cluster-addr "$host:${route_port[$r]}" \
    --nats-routes "$routes" \
    --peers "$peers" \
    --model "$model" \
    --block-size "$block_size" \
    ${sec[@]+"${sec[@]}"} \
    ${capt[@]+"${capt[@]}"} \
    ${serve_extra[@]+"${serve_extra[@]}"}
done

if [ "$tail_logs" = 1 ]; then
  # One tail for all logs; awk turns tail's "==> file <==" headers into a
  # "[name] " prefix on every line. --pid makes tail quit with this script
  # even if it is SIGKILLed. Started early so replica start-up shows.
  touch "$run_dir/r1.log"
  for w in "${workers[@]}"; do : >"$run_dir/$w.log"; done
  [ -n "$haproxy_bin" ] && : >"$run_dir/haproxy.log"
  tail_args=(-v -n +1 -F)
  tail --pid=$$ -n 0 /dev/null >/dev/null 2>&1 && tail_args+=(--pid=$$)
  # mawk reads a pipe in large blocks unless told to go line by line.
  awk_args=()
  awk -W version 2>&1 | grep -qi mawk && awk_args=(-W interactive)
  tail "${tail_args[@]}" "$run_dir"/*.log 2>/dev/null </dev/null > >(
    awk ${awk_args[@]+"${awk_args[@]}"} '/^==> .* <==$/ { n = $2; sub(/^.*\//, "", n); sub(/\.log$/, "", n); blank = 0; next }
         /^$/ { blank++; next }
         { for (; blank > 0; blank--) print "[" n "] "; print "[" n "] " $0; fflush() }'
  ) &
  tail_pid=$!
fi

# Workers register with the replicas and publish to their NATS servers; give
# the replicas a moment to listen first (both sides retry anyway).
t0=$SECONDS
while [ $((SECONDS - t0)) -lt 30 ]; do
  up=0
  for r in "${replicas[@]}"; do
    [ "$(http_status "http://$host:${http_port[$r]}/health")" = 200 ] && up=$((up + 1))
  done
  [ "$up" = 3 ] && break
  reap
  if [ "$(replicas_alive)" = 0 ]; then
    say "every replica exited during start-up; see the logs above (and in $run_dir)" >&2
    exit 1
  fi
  nap 0.3
done
[ "$up" = 3 ] || say "only $up/3 replicas answer /health after 30 s; starting the workers anyway" >&2

for w in "${workers[@]}"; do
  args=(--id "$w" --addr "$host:${worker_port[$w]}" --advertise-url "http://$host:${worker_port[$w]}"
    --model "$model" --block-size "$block_size" --kv-blocks "$kv_blocks" --speedup "$speedup"
    --nats "$nats_urls" --register "$register_urls")
  [ -n "$max_batched" ] && args+=(--max-batched-tokens "$max_batched")
  mapfile -t sec < <(mock_security "$w")
  args+=(${sec[@]+"${sec[@]}"})
  start "$w" "$kvmock" "${args[@]}" ${mock_extra[@]+"${mock_extra[@]}"}
done

lb_url=''
lb_note="not started (haproxy not on PATH; apt-get install haproxy) - use a replica directly"
[ "$use_haproxy" = 0 ] && lb_note="not started (KVROUTER_RUN_HAPROXY=0)"
if [ -n "$haproxy_bin" ]; then
  template=$root/deploy/haproxy/haproxy.cfg
  cfg=$run_dir/haproxy.cfg
  # Same config as deploy/haproxy/haproxy.cfg, bound to loopback, ports shifted.
  sed -e "s/^\([[:space:]]*bind[[:space:]]\{1,\}\):8000\b/\1$host:$lb_port/" \
    -e "s/^\([[:space:]]*bind[[:space:]]\{1,\}\):8404\b/\1$host:$stats_port/" \
    -e "s/127\.0\.0\.1:8001\b/$host:${http_port[r1]}/" \
    -e "s/127\.0\.0\.1:8002\b/$host:${http_port[r2]}/" \
    -e "s/127\.0\.0\.1:8003\b/$host:${http_port[r3]}/" \
    "$template" >"$cfg"
  if check=$("$haproxy_bin" -c -q -f "$cfg" 2>&1); then
    start haproxy "$haproxy_bin" -db -f "$cfg"
    lb_url=http://$host:$lb_port
    lb_note="$lb_url  (status page http://$host:$stats_port/stats)"
  else
    say "HAProxy rejects $cfg, not starting it:" >&2
    printf '%s\n' "$check" | sed 's/^/    /' >&2
    lb_note="not started (config rejected, see above)"
  fi
fi

try_url=${lb_url:-http://$host:${http_port[r1]}}
cat <<EOF
$me: kvrouter local cluster
  replicas:
$(for r in "${replicas[@]}"; do printf '    %s  http://%s:%s  raft %s:%s  nats nats://%s:%s  routes :%s  pid %s\n' \
    "$r" "$host" "${http_port[$r]}" "$host" "${raft_port[$r]}" "$host" "${nats_port[$r]}" "${route_port[$r]}" \
    "${pids[${r#r} - 1]}"; done)
  workers (model $model, block size $block_size, $kv_blocks KV blocks, speedup $speedup):
$(for w in "${workers[@]}"; do printf '    %s  http://%s:%s\n' "$w" "$host" "${worker_port[$w]}"; done)
  haproxy:  $lb_note
  security: $(if [ "$insecure" = 1 ]; then echo "OFF (KVROUTER_RUN_INSECURE=1)"; else
    echo "Raft mTLS, NATS TLS+auth, HTTPS (and http:// on loopback); /cluster/* needs a member certificate (/cluster/status is open)"; fi)
$(if [ "$insecure" != 1 ]; then
    printf '            CA + certificates %s/ (ca-key.pem too: keep it off real replicas)\n' "$certs_dir"
    printf '            replica token for bus tools (kvbench ingest) %s/replica-token\n' "$secrets_dir"
    printf '            peer call: curl --cacert %s/ca.pem --cert %s/node-r1.pem --key %s/node-r1-key.pem https://%s:%s/cluster/commit\n' \
      "$certs_dir" "$certs_dir" "$certs_dir" "$host" "${http_port[r1]}"
  fi)
  admin:    $(if [ "$want_admin_token" = 1 ]; then echo "token required, in $secrets_dir/admin-token (kvbench reads it; curl -H \"Authorization: Bearer \$(cat $secrets_dir/admin-token)\")"; else
    echo "NO TOKEN: admin endpoints and worker registration open to every user of this host (KVROUTER_RUN_ADMIN_TOKEN=0)"; fi)
$(if [ "$want_admin_token" = 1 ]; then
    printf '            except /busy_threshold from this host (--admin-open-to-loopback: runtime tuning as the contract has it)\n'
  fi)
  kvmocks:  $(if [ "$want_worker_key" = 1 ]; then echo "API key required on /v1/*, in $secrets_dir/worker-api-key (the replicas send it; kvbench load --direct reads it)"; else
    echo "no API key (KVROUTER_RUN_WORKER_API_KEY=0)"; fi)
  logs:     $run_dir/<name>.log
  try:      curl -s $try_url/v1/chat/completions -H 'content-type: application/json' \\
              -d '{"model":"$model","messages":[{"role":"user","content":"hello"}],"max_tokens":16}'
            curl -s http://$host:${http_port[r1]}/cluster/status
  Ctrl-C stops everything.
EOF

# --- wait for /ready, then watch -------------------------------------------------
say "waiting for /ready on ${replicas[*]} (up to ${ready_timeout} s)..."
t0=$SECONDS
last='' all_ready=0 warned=0
while :; do
  reap
  if [ "$all_ready" = 0 ]; then
    ready=()
    for r in "${replicas[@]}"; do
      [ "$(http_status "http://$host:${http_port[$r]}/ready")" = 200 ] && ready+=("$r")
    done
    now="${ready[*]-}"
    if [ "$now" != "$last" ]; then
      say "ready: ${now:-none} (${#ready[@]}/3) after $((SECONDS - t0)) s"
      last=$now
    fi
    if [ ${#ready[@]} = 3 ]; then
      all_ready=1
      say "cluster ready: ${replica_urls//,/ }${lb_url:+ (HAProxy $lb_url)}"
    elif [ "$(replicas_alive)" = 0 ]; then
      say "every replica exited before the cluster was ready; see the logs above (and in $run_dir)" >&2
      exit 1
    elif [ "$warned" = 0 ] && [ $((SECONDS - t0)) -ge "$ready_timeout" ]; then
      say "not all replicas ready after $ready_timeout s; still waiting. GET /ready explains why, logs are in $run_dir" >&2
      warned=1
    fi
  fi
  nap 1
done
