#!/usr/bin/env bash
# deploy/compose-smoke.sh — the Docker Compose deployment, end to end (CI runs
# it last). Needs root and a Debian-like host; needs no registry (Docker Hub
# is not reachable from CI):
#
#   1. installs Debian's docker.io and docker-compose (and haproxy) when missing;
#   2. starts a private dockerd: data root, exec root, pidfile, socket, config
#      and key all in one temporary directory, with --iptables=false
#      --ip-forward=false --bridge=none, so it leaves the host's firewall and
#      sysctls alone (containers on one user-defined bridge need neither, and
#      published ports go through docker-proxy); its --dns is a stub that
#      answers NXDOMAIN (see "DNS for the containers" below);
#   3. builds kvrouter:local (docker/Dockerfile, from static binaries built into
#      the temporary directory; bin/ is not touched) and kvrouter-haproxy:smoke
#      (docker/haproxy/Dockerfile: the host's haproxy and the libraries ldd lists);
#   4. starts docker-compose.yml + compose-smoke.yml: the one-shot certs
#      service (CA, certificates, tokens), r1-r3, mock-1..4 and haproxy
#      (Prometheus and Grafana come from Docker Hub: not started), all with
#      TLS and authentication on, as the deployment runs;
#   5. copies ca.pem out of the certs volume (docker cp), checks that the
#      replicas refuse plaintext HTTP and admin calls without the token, and
#      that HAProxy's TLS health checks pass (L7OK), then routes POST
#      /v1/chat/completions (model kvmock) through HAProxy on
#      https://127.0.0.1:8000 (curl --cacert) and expects 200 with an
#      X-Worker-Id;
#   6. docker kill's the Raft leader's container, waits for HAProxy to mark it
#      DOWN, routes again, and checks https /cluster/status on the two
#      survivors: both ready, one leader they agree on, four workers, equal
#      FSM digests;
#   7. whatever happened (trap on EXIT): compose stop and down -v, dockerd
#      stopped, its mounts, bridge and directory removed, the host firewall
#      and sysctls compared with what they were before (and restored if
#      Docker changed them), and all of that verified.
# Exit status 0 only if every step passed and the host is back as it was.
# Logs (dockerd, builds, every service) end up in tmp/compose-smoke/.
#
# Settings (environment; defaults in brackets):
#   KVROUTER_SMOKE_INSTALL=0   never apt-get install; fail if something is missing
#   KVROUTER_SMOKE_TIMEOUT     seconds each wait may take [90]
#   KVROUTER_SMOKE_REQUESTS    requests routed before and after the kill [5]
#   KVROUTER_SMOKE_LOG_DIR     logs, wiped at start [<repo>/tmp/compose-smoke]
set -euo pipefail

me='compose-smoke.sh'
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

install=${KVROUTER_SMOKE_INSTALL:-1}
timeout_s=${KVROUTER_SMOKE_TIMEOUT:-90}
n_requests=${KVROUTER_SMOKE_REQUESTS:-5}
log_dir=${KVROUTER_SMOKE_LOG_DIR:-$root/tmp/compose-smoke}

# Fixed by docker-compose.yml and compose-smoke.yml.
project=kvrouter
bridge=kvsmoke0
haproxy_port=8000
stats_port=8404
declare -A http_port=([r1]=8001 [r2]=8002 [r3]=8003)
replicas=(r1 r2 r3)
workers=(mock-1 mock-2 mock-3 mock-4)
base=https://127.0.0.1 # every replica port is HTTPS only (TLS on)

# --- output and timing --------------------------------------------------------
now_ms() { local t=${EPOCHREALTIME//[!0-9]/}; echo $((t / 1000)); }
t0=$(now_ms)
secs() { local d=$(($(now_ms) - $1)); printf '%d.%01ds' $((d / 1000)) $((d % 1000 / 100)); }
log() { printf '%s: [%7s] %s\n' "$me" "$(secs "$t0")" "$*"; }
fail() {
  printf '%s: [%7s] FAIL: %s\n' "$me" "$(secs "$t0")" "$*" >&2
  exit 1
}

phase_names=() phase_times=() phase_name='' phase_start=0
phase() { # closes the running phase, opens the next one (none with no argument)
  if [ -n "$phase_name" ]; then
    phase_names+=("$phase_name")
    phase_times+=("$(secs "$phase_start")")
  fi
  phase_name=${1:-}
  phase_start=$(now_ms)
  [ -z "$phase_name" ] || log "== $phase_name"
}

is_uint() { case $1 in '' | *[!0-9]*) return 1 ;; *) return 0 ;; esac; }
for v in timeout_s n_requests; do
  is_uint "${!v}" || fail "$v must be a whole number, got '${!v}'"
done

# --- state the cleanup needs (set as things are created) ----------------------
work=''               # the temporary directory: dockerd's roots, socket, contexts
dockerd_pid=''        # our dockerd
events_pid=''         # `docker events` into events.log
dns_pid=''            # the DNS stub for the containers
compose_up=0          # compose up ran: compose down -v
policy_rc_created=0   # we wrote /usr/sbin/policy-rc.d for the install
lock_held=0
lock_file=/tmp/kvrouter-compose-smoke.lock
run_dirs_before=()    # which of /run/docker, /run/containerd existed before
why=''                # the last check's reason for failing
docker0_before=''     # `ip link show docker0` before we started

# Host network state compared after teardown.
sysctls=(net/ipv4/ip_forward net/ipv6/conf/all/forwarding
  net/bridge/bridge-nf-call-iptables net/bridge/bridge-nf-call-ip6tables)
declare -A sysctl_before=()
fw_tools=()

# --- teardown (trap on EXIT, set before anything is created) -----------------
# The firewall as text without counters and comments, to compare.
fw_dump() { "$1" 2>/dev/null | sed -e '/^#/d' -e 's/ \[[0-9]*:[0-9]*\]$//'; }
docker_made() { grep -E '^:DOCKER|-j DOCKER' "$1" || true; }

# Docker-made chains in tables the snapshot did not cover: drop the rules that
# jump to them, then the chains.
purge_docker_chains() { # iptables|ip6tables
  local ipt=$1 t c rule
  for t in $("$ipt-save" | sed -n 's/^\*//p'); do
    while read -r rule; do
      [ -n "$rule" ] && eval "$ipt -t $t -D ${rule#-A }"
    done < <("$ipt-save" -t "$t" | grep -E '^-A .* -j DOCKER' || true)
    for c in $("$ipt-save" -t "$t" | sed -n 's/^:\(DOCKER[^ ]*\) .*/\1/p'); do "$ipt" -t "$t" -F "$c"; done
    for c in $("$ipt-save" -t "$t" | sed -n 's/^:\(DOCKER[^ ]*\) .*/\1/p'); do "$ipt" -t "$t" -X "$c"; done
  done
}

restore_host_network() {
  local ipt changed
  for ipt in "${fw_tools[@]}"; do
    fw_dump "$ipt-save" >"$work/$ipt.after"
    if ! cmp -s "$work/$ipt.before" "$work/$ipt.after"; then
      changed=$(docker_made "$work/$ipt.after")
      # Without Docker's chains the difference is someone else's (a chaos
      # run adds its own FORWARD rule): leave it alone.
      if [ -n "$changed" ] || ! diff <(grep '^:FORWARD' "$work/$ipt.before") <(grep '^:FORWARD' "$work/$ipt.after") >/dev/null; then
        log "$ipt: Docker changed the firewall; restoring the saved rules:"
        diff "$work/$ipt.before" "$work/$ipt.after" | sed "s/^/$me:   /" || true
        "$ipt-restore" <"$work/$ipt.save"
        purge_docker_chains "$ipt"
      fi
    fi
  done
  local s v
  for s in "${!sysctl_before[@]}"; do
    v=$(cat "/proc/sys/$s")
    if [ "$v" != "${sysctl_before[$s]}" ]; then
      log "sysctl $s is $v, was ${sysctl_before[$s]}: restoring"
      echo "${sysctl_before[$s]}" >"/proc/sys/$s"
    fi
  done
}

# Processes started for our daemon (containerd, shims, docker-proxy) all name
# the temporary directory on their command line.
our_pids() {
  local p
  for p in /proc/[0-9]*; do
    tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF -- "$work/" && echo "${p#/proc/}"
  done
  return 0
}

stop_dockerd() {
  [ -n "$dockerd_pid" ] || return 0
  if kill -0 "$dockerd_pid" 2>/dev/null; then
    kill -TERM "$dockerd_pid"
    local deadline=$(($(now_ms) + 30000))
    while kill -0 "$dockerd_pid" 2>/dev/null && [ "$(now_ms)" -lt "$deadline" ]; do sleep 0.2; done
    if kill -0 "$dockerd_pid" 2>/dev/null; then
      log "dockerd $dockerd_pid still running 30 s after SIGTERM: SIGKILL"
      kill -KILL "$dockerd_pid" 2>/dev/null || true
    fi
  fi
  wait "$dockerd_pid" 2>/dev/null || true
  local left
  left=$(our_pids)
  if [ -n "$left" ]; then
    log "left behind by dockerd, killing: $(echo "$left" | tr '\n' ' ')"
    # shellcheck disable=SC2086 # one pid per word
    kill -KILL $left 2>/dev/null || true
    sleep 0.5
  fi
  dockerd_pid=''
}

stop_bg() { # pid of a background job of ours, or nothing
  [ -n "$1" ] || return 0
  kill "$1" 2>/dev/null
  wait "$1" 2>/dev/null
  return 0
}

unmount_work() {
  local m
  # Deepest first (container rootfs, netns files, overlay layers).
  while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" || log "cannot unmount $m"
  done < <(awk -v w="$work/" 'index($5, w) == 1 {print $5}' /proc/self/mountinfo | sort -r)
}

save_logs() {
  [ -n "$work" ] || return 0
  cp "$work"/*.log "$log_dir/" 2>/dev/null || true
}

dump_failure() {
  log "---- diagnostics"
  if [ "$compose_up" = 1 ]; then
    "${compose[@]}" ps 2>&1 | sed "s/^/$me:   /" || true
    local s
    for s in certs "${replicas[@]}" haproxy "${workers[@]}"; do
      log "---- last lines of $s"
      "${compose[@]}" logs --no-color --tail 15 "$s" 2>&1 | sed "s/^/$me:   /" || true
    done
  fi
  if [ -n "$work" ] && [ -f "$work/dockerd.log" ]; then
    log "---- last lines of dockerd.log"
    tail -n 15 "$work/dockerd.log" | sed "s/^/$me:   /"
  fi
}

# Checks that the host is as it was; prints what is not, returns non-zero then.
verify_host() {
  local bad=0 ipt pol_before pol_after
  if [ -n "$(our_pids)" ]; then
    log "verify: processes still name $work: $(our_pids | tr '\n' ' ')"
    bad=1
  fi
  if [ -n "$(awk -v w="$work/" 'index($5, w) == 1' /proc/self/mountinfo)" ]; then
    log "verify: mounts left under $work"
    bad=1
  fi
  if ip link show "$bridge" >/dev/null 2>&1; then
    log "verify: bridge $bridge still exists"
    bad=1
  fi
  if [ -z "$docker0_before" ] && ip link show docker0 >/dev/null 2>&1; then
    log "verify: docker0 exists (it did not before)"
    bad=1
  fi
  for ipt in "${fw_tools[@]}"; do
    # From the dumps: `ip6tables -S` would show a default for a table that
    # does not exist.
    pol_before=$(sed -n 's/^:FORWARD //p' "$work/$ipt.before")
    pol_after=$(fw_dump "$ipt-save" | sed -n 's/^:FORWARD //p')
    if [ "$pol_before" != "$pol_after" ]; then
      log "verify: $ipt FORWARD policy is '${pol_after:-none}', was '${pol_before:-none}'"
      bad=1
    fi
    if "$ipt-save" | grep -Eq '^:DOCKER|-j DOCKER'; then
      log "verify: $ipt has DOCKER chains: $("$ipt-save" | grep -E '^:DOCKER' | tr '\n' ' ')"
      bad=1
    fi
  done
  local s
  for s in "${!sysctl_before[@]}"; do
    if [ "$(cat "/proc/sys/$s")" != "${sysctl_before[$s]}" ]; then
      log "verify: sysctl $s is $(cat "/proc/sys/$s"), was ${sysctl_before[$s]}"
      bad=1
    fi
  done
  if [ "$bad" = 0 ]; then
    log "host verified: iptables FORWARD policy $(fw_dump iptables-save | sed -n 's/^:FORWARD //p') as before, no DOCKER chains; no dockerd, containerd or shim of ours; no mounts; no $bridge, no docker0; sysctls as before"
  fi
  return "$bad"
}

cleanup() {
  local rc=$? d t
  set +e
  trap - EXIT INT TERM HUP
  phase "teardown"
  [ "$rc" = 0 ] || dump_failure
  if [ "$policy_rc_created" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  if [ "$compose_up" = 1 ]; then
    # Stop first, so the services' logs include how they shut down.
    t=$(now_ms)
    timeout 120 "${compose[@]}" stop -t 10 >"$work/compose-stop.log" 2>&1 ||
      log "compose stop failed: $(tail -n 3 "$work/compose-stop.log")"
    log "compose stop ($(secs "$t"))"
    "${compose[@]}" logs --no-color --timestamps >"$work/compose.log" 2>&1
    t=$(now_ms)
    if timeout 120 "${compose[@]}" down -v --remove-orphans -t 10 >"$work/compose-down.log" 2>&1; then
      log "compose down -v ($(secs "$t"))"
    else
      log "compose down -v failed ($(secs "$t")):"
      tail -n 20 "$work/compose-down.log" | sed "s/^/$me:   /"
    fi
  fi
  # No container is left to ask the DNS stub; `docker events` ends with dockerd.
  stop_bg "$dns_pid"
  if [ -n "$dockerd_pid" ]; then
    t=$(now_ms)
    stop_dockerd
    log "dockerd stopped ($(secs "$t"))"
  fi
  stop_bg "$events_pid"
  if [ -n "$work" ]; then
    unmount_work
    if ip link show "$bridge" >/dev/null 2>&1; then
      log "removing bridge $bridge"
      ip link del "$bridge"
    fi
    [ ${#fw_tools[@]} -eq 0 ] || restore_host_network
    # dockerd and containerd create these fixed paths whatever their roots;
    # remove them if they were not there before and only empty dirs remain.
    for d in /run/docker /run/containerd; do
      if [[ " ${run_dirs_before[*]} " != *" $d "* ]] && [ -d "$d" ]; then
        find "$d" -depth -type d -empty -delete 2>/dev/null
        [ ! -e "$d" ] || log "note: $d is not empty: $(find "$d" | head -5 | tr '\n' ' ')"
      fi
    done
    save_logs
    if [ ${#fw_tools[@]} -gt 0 ] && ! verify_host; then
      log "the host is not back as it was"
      [ "$rc" != 0 ] || rc=1
    fi
    rm -rf "$work"
  fi
  if [ "$lock_held" = 1 ]; then rm -f "$lock_file"; fi
  phase
  log "timings:"
  local i
  for i in "${!phase_names[@]}"; do
    printf '%s:   %-26s %8s\n' "$me" "${phase_names[$i]}" "${phase_times[$i]}"
  done
  printf '%s:   %-26s %8s\n' "$me" total "$(secs "$t0")"
  if [ "$rc" = 0 ]; then log "PASS"; else log "FAILED (exit $rc); logs in $log_dir"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# --- preflight ----------------------------------------------------------------
phase "preflight"
[ "$(id -u)" = 0 ] || fail "needs root (dockerd, apt-get); run as root or with sudo"
[ "$(uname -s)" = Linux ] || fail "Linux only"

exec 9>"$lock_file"
flock -n 9 || fail "another compose-smoke.sh holds $lock_file"
lock_held=1

# Published ports of the stack (127.0.0.1): docker-proxy must be able to bind them.
for p in "$haproxy_port" "$stats_port" "${http_port[@]}"; do
  if ss -Hltn "sport = :$p" | awk '{print $4}' | grep -Eq "^(127\.0\.0\.1|0\.0\.0\.0|\*|\[::\]|\[::ffff:127\.0\.0\.1\]):$p\$"; then
    fail "port 127.0.0.1:$p is taken (see: ss -ltnp 'sport = :$p'); the stack publishes 8000-8003 and 8404"
  fi
done

# --- install ------------------------------------------------------------------
phase "install"
docker_ok() { command -v dockerd >/dev/null && [ -x /usr/bin/docker ]; }
compose_ok() { /usr/bin/docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; }
need=()
docker_ok || need+=(docker.io)
compose_ok || need+=(docker-compose)
command -v haproxy >/dev/null || need+=(haproxy)
for t in curl:curl python3:python3 iptables-save:iptables ss:iproute2 ldd:libc-bin; do
  command -v "${t%%:*}" >/dev/null || need+=("${t#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  [ "$install" = 1 ] || fail "missing ${need[*]} (KVROUTER_SMOKE_INSTALL=0: not installing)"
  log "apt-get install ${need[*]}"
  # The packages' maintainer scripts would start the system dockerd (default
  # data root, iptables on): policy-rc.d 101 forbids it for this install.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\n# compose-smoke.sh: no service starts during its apt-get install\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    policy_rc_created=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt_log=$(mktemp /tmp/kvrouter-compose-smoke-apt.XXXXXX)
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } >"$apt_log" 2>&1; then
    tail -n 20 "$apt_log" | sed "s/^/$me:   /"
    rm -f "$apt_log"
    fail "apt-get install ${need[*]} failed"
  fi
  rm -f "$apt_log"
  if [ "$policy_rc_created" = 1 ]; then rm -f /usr/sbin/policy-rc.d && policy_rc_created=0; fi
  docker_ok || fail "docker.io installed but dockerd or /usr/bin/docker is missing"
fi
docker=/usr/bin/docker # the daemon's own client (builds with the daemon's BuildKit)
if "$docker" compose version >/dev/null 2>&1; then
  compose_cmd=("$docker" compose)
else
  compose_cmd=(docker-compose)
fi
log "dockerd: $(dockerd --version)"
log "compose: $("${compose_cmd[@]}" version 2>/dev/null | head -1)"
log "haproxy: $(haproxy -v | head -1)"
if pgrep -x dockerd >/dev/null; then
  log "note: another dockerd runs on this host (pid $(pgrep -x dockerd | tr '\n' ' ')); ours is separate"
fi
# dockerd 20.10 attaches to a running system containerd instead of starting
# its own, which would put our containers into the system's containerd state.
if [ -S /run/containerd/containerd.sock ]; then
  fail "a system containerd listens on /run/containerd/containerd.sock; dockerd would share it instead of starting a private one (stop it first)"
fi

# Logs directory: ours (marker) or empty, then wiped.
if [ -d "$log_dir" ] && [ -n "$(ls -A "$log_dir")" ] && [ ! -e "$log_dir/.compose-smoke" ]; then
  fail "$log_dir is not empty and was not made by this script; set KVROUTER_SMOKE_LOG_DIR"
fi
rm -rf "$log_dir"
mkdir -p "$log_dir"
touch "$log_dir/.compose-smoke"

work=$(mktemp -d /tmp/kvrouter-compose-smoke.XXXXXX)
for d in /run/docker /run/containerd; do [ ! -e "$d" ] || run_dirs_before+=("$d"); done
docker0_before=$(ip link show docker0 2>/dev/null || true)

# A bridge left by an interrupted run (we hold the lock: no other run owns it).
if ip link show "$bridge" >/dev/null 2>&1; then
  log "removing $bridge left over from an earlier run"
  ip link del "$bridge"
fi

# --- host state before --------------------------------------------------------
for ipt in iptables ip6tables; do
  if command -v "$ipt-save" >/dev/null && "$ipt-save" >"$work/$ipt.save" 2>/dev/null; then
    fw_dump "$ipt-save" >"$work/$ipt.before"
    fw_tools+=("$ipt")
  fi
done
for s in "${sysctls[@]}"; do
  [ ! -r "/proc/sys/$s" ] || sysctl_before[$s]=$(cat "/proc/sys/$s")
done
log "host before: $(iptables -S FORWARD | head -1), ip_forward=${sysctl_before[net/ipv4/ip_forward]:-?}, bridge-nf-call-iptables=${sysctl_before[net/bridge/bridge-nf-call-iptables]:--}"

# --- build --------------------------------------------------------------------
phase "go build (static)"
ctx=$work/ctx
mkdir -p "$ctx/bin" "$ctx/deploy/docker"
CGO_ENABLED=0 GOOS=linux go build -o "$ctx/bin/" ./cmd/kvrouter ./cmd/kvmock
cp -r deploy/docker/rootfs "$ctx/deploy/docker/rootfs"
log "built kvrouter, kvmock into the image context"

# The HAProxy image's rootfs: the binary and what the dynamic loader needs.
hctx=$work/haproxy-ctx
haproxy_bin=$(readlink -f "$(command -v haproxy)")
mkdir -p "$hctx/usr/sbin" "$hctx/usr/local/etc/haproxy"
cp "$haproxy_bin" "$hctx/usr/sbin/haproxy"
if ldd "$haproxy_bin" | grep -q 'not found'; then
  fail "haproxy's libraries are incomplete: $(ldd "$haproxy_bin" | grep 'not found')"
fi
for lib in $(ldd "$haproxy_bin" | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^\//) print $i}'); do
  mkdir -p "$hctx$(dirname "$lib")"
  cp -L "$lib" "$hctx$lib"
done
log "haproxy rootfs: $(find "$hctx" -type f | wc -l) files, $(du -sh "$hctx" | cut -f1)"
# The image runs haproxy as nobody: the bind-mounted config must be readable.
[ "$(stat -c %A deploy/haproxy/haproxy-compose.cfg | cut -c8)" = r ] ||
  fail "deploy/haproxy/haproxy-compose.cfg is not world-readable (umask at checkout?): haproxy runs as nobody"

# --- DNS for the containers ------------------------------------------------------
phase "start dockerd"
# Docker's embedded DNS (127.0.0.11) answers service names itself and forwards
# other names, from inside the container, to the daemon's upstream servers.
# Without forwarding and NAT no upstream is reachable, and dockerd 20.10 then
# drops the query: looking up a stopped service (r2 after the kill) hangs for
# the client's whole DNS timeout instead of failing at once as it does in a
# normal deployment, and Raft dials, NATS routes and kvmock's deregistration
# stall for seconds (replicas then overrun their stop grace period). So the
# upstream is a stub on the network's gateway answering NXDOMAIN to
# everything (the stack needs no outside names). The daemon's address pool
# fixes the network's subnet, hence the gateway, before dockerd starts; the
# pool is one that overlaps no route or address of the host.
subnet=$(python3 - <<'PY'
import ipaddress, subprocess
out = subprocess.run(["ip", "-4", "-o", "route", "show", "table", "all"], capture_output=True, text=True).stdout
out += subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
taken = []
for word in out.split():
    try:
        net = ipaddress.ip_network(word, strict=False)
    except ValueError:
        continue
    if net.prefixlen > 0:
        taken.append(net)
for cand in ["172.30.250.0/24", "10.213.250.0/24", "192.168.250.0/24", "172.29.251.0/24"]:
    c = ipaddress.ip_network(cand)
    if not any(c.overlaps(t) for t in taken):
        print(cand)
        break
PY
)
[ -n "$subnet" ] || fail "no free /24 for the compose network (every candidate overlaps a host route)"
gateway=${subnet%.0/24}.1
cat >"$work/dns-stub.py" <<'PY'
# NXDOMAIN for every UDP query (compose-smoke.sh); bound before the address exists.
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_IP, 15, 1)  # IP_FREEBIND
s.bind((sys.argv[1], 53))
while True:
    q, peer = s.recvfrom(4096)
    if len(q) < 17 or q[2] & 0x80:
        continue
    end = 12  # header, then the question: labels, a zero byte, type, class
    while end < len(q) and q[end]:
        end += q[end] + 1
    end += 5
    if end > len(q):
        continue
    flags = bytes([0x80 | (q[2] & 0x79), 0x80 | 3])  # QR, opcode+RD kept; RA, NXDOMAIN
    s.sendto(q[:2] + flags + b"\x00\x01\x00\x00\x00\x00\x00\x00" + q[12:end], peer)
PY
python3 "$work/dns-stub.py" "$gateway" >"$work/dns-stub.log" 2>&1 &
dns_pid=$!

# --- dockerd --------------------------------------------------------------------
mkdir -p "$work/docker-config"
printf '{\n  "deprecated-key-path": "%s/key.json"\n}\n' "$work" >"$work/daemon.json"
export DOCKER_HOST=unix://$work/docker.sock DOCKER_CONFIG=$work/docker-config DOCKER_BUILDKIT=1
unset DOCKER_CONTEXT DOCKER_TLS_VERIFY DOCKER_CERT_PATH COMPOSE_FILE COMPOSE_PROJECT_NAME
dockerd --config-file "$work/daemon.json" \
  --data-root "$work/data" --exec-root "$work/exec" --pidfile "$work/dockerd.pid" \
  -H "$DOCKER_HOST" \
  --iptables=false --ip-forward=false --ip-masq=false --bridge=none \
  --default-address-pool "base=$subnet,size=24" --dns "$gateway" \
  >"$work/dockerd.log" 2>&1 &
dockerd_pid=$!
deadline=$(($(now_ms) + timeout_s * 1000))
until "$docker" version >/dev/null 2>&1; do
  kill -0 "$dockerd_pid" 2>/dev/null || { dockerd_pid=''; fail "dockerd exited at start: $(grep -E 'level=(error|fatal)|failed' "$work/dockerd.log" | tail -3)"; }
  [ "$(now_ms)" -lt "$deadline" ] || fail "dockerd did not answer on $DOCKER_HOST within ${timeout_s}s"
  sleep 0.2
done
# Container lifecycle (create, kill, die, stop, with timestamps) for the logs.
"$docker" events >"$work/events.log" 2>&1 &
events_pid=$!
kill -0 "$dns_pid" 2>/dev/null || fail "the DNS stub on $gateway:53 exited: $(tail -3 "$work/dns-stub.log")"
log "DNS stub (NXDOMAIN) on $gateway:53 for the compose network $subnet"
log "dockerd $dockerd_pid up: storage $("$docker" info -f '{{.Driver}}'), cgroups $("$docker" info -f '{{.CgroupDriver}} v{{.CgroupVersion}}'), socket $DOCKER_HOST"

phase "docker build"
"$docker" build -q -f deploy/docker/Dockerfile -t kvrouter:local "$ctx" >"$work/build-kvrouter.log" 2>&1 ||
  fail "docker build kvrouter:local: $(tail -5 "$work/build-kvrouter.log")"
"$docker" build -q -f deploy/docker/haproxy/Dockerfile -t kvrouter-haproxy:smoke "$hctx" >"$work/build-haproxy.log" 2>&1 ||
  fail "docker build kvrouter-haproxy:smoke: $(tail -5 "$work/build-haproxy.log")"
log "images: $("$docker" images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | tr '\n' ' ')"

# --- compose up -----------------------------------------------------------------
phase "compose up"
# docker-compose.yml names its project (top-level `name:`, Compose v2); the
# Debian docker-compose 1.29 rejects that key, so it gets a copy without it
# and the same name through -p. Relative paths stay relative to deploy/.
sed '/^name:/d' deploy/docker-compose.yml >"$work/docker-compose.yml"
compose=("${compose_cmd[@]}" --project-directory "$root/deploy" -p "$project"
  -f "$work/docker-compose.yml" -f "$root/deploy/compose-smoke.yml")
"${compose[@]}" config -q || fail "compose config rejects docker-compose.yml + compose-smoke.yml"
compose_up=1
"${compose[@]}" up -d --no-build "${replicas[@]}" "${workers[@]}" haproxy >"$work/compose-up.log" 2>&1 ||
  fail "compose up: $(tail -5 "$work/compose-up.log")"
log "running: $("${compose[@]}" ps --services --filter status=running 2>/dev/null | sort | tr '\n' ' ')"
certs_cid=$("${compose[@]}" ps -a -q certs)
[ -n "$certs_cid" ] || fail "no certs container (the one-shot service the others depend on)"
log "certs service: $("$docker" inspect -f '{{.State.Status}} (exit {{.State.ExitCode}})' "$certs_cid"); $("$docker" logs "$certs_cid" 2>&1 | grep -E '^(certs|exported)' | tr '\n' ';')"
# The CA as a client on the host gets it: out of the volume, through a
# replica that mounts it (the image is FROM scratch; docker cp needs no tar in it).
r1_cid=$("${compose[@]}" ps -q r1)
"$docker" cp "$r1_cid:/certs/ca.pem" "$work/ca.pem" || fail "docker cp r1:/certs/ca.pem"
"$docker" cp "$r1_cid:/certs/admin-token" "$work/admin-token" || fail "docker cp r1:/certs/admin-token"
openssl_subject=$(openssl x509 -in "$work/ca.pem" -noout -subject 2>/dev/null || echo '?')
log "CA copied out of the certs volume: $work/ca.pem ($openssl_subject)"
got=$("$docker" network inspect -f '{{range .IPAM.Config}}{{.Subnet}} {{.Gateway}}{{end}}' "${project}_default")
[ "$got" = "$subnet $gateway" ] || fail "compose network is '$got', want '$subnet $gateway' (the DNS stub's address)"

# --- checks -----------------------------------------------------------------------
# wait_for WHAT CHECK [ARGS]: poll CHECK every 0.25 s until it passes or the
# timeout; CHECK leaves its reason in $why.
wait_for() {
  local what=$1 t deadline
  shift
  t=$(now_ms)
  deadline=$((t + timeout_s * 1000))
  why=''
  until "$@"; do
    [ "$(now_ms)" -lt "$deadline" ] || fail "$what: not within ${timeout_s}s; last: $why"
    sleep 0.25
  done
  log "$what ($(secs "$t"))"
}

# tls_curl: curl trusting the deployment's CA only (no -k anywhere).
tls_curl() { curl --cacert "$work/ca.pem" "$@"; }

ready() { # port
  local code
  code=$(tls_curl -s -m 2 -o /dev/null -w '%{http_code}' "$base:$1/ready") || true
  [ "$code" = 200 ] || { why="$base:$1/ready: ${code:-no answer}"; return 1; }
}
all_ready() {
  local r
  for r in "${replicas[@]}"; do ready "${http_port[$r]}" || return 1; done
}

# chat: one completion through HAProxy; 200, an X-Worker-Id naming a worker,
# and a body with choices. Sets $worker.
n_sent=0
chat() {
  n_sent=$((n_sent + 1))
  local code body
  body=$(printf '{"model":"kvmock","max_tokens":8,"messages":[{"role":"user","content":"compose smoke test, request %d: the same long shared prefix for every request so that the router has blocks to match"}]}' "$n_sent")
  code=$(tls_curl -sS -m 10 -o "$work/chat.body" -D "$work/chat.hdr" -w '%{http_code}' \
    -H 'Content-Type: application/json' --data-binary "$body" \
    "$base:$haproxy_port/v1/chat/completions" 2>"$work/chat.err") ||
    { why="curl: $(tail -1 "$work/chat.err")"; return 1; }
  worker=$(tr -d '\r' <"$work/chat.hdr" | sed -n 's/^[Xx]-[Ww][Oo][Rr][Kk][Ee][Rr]-[Ii][Dd]: *//p' | tail -1)
  [ "$code" = 200 ] || { why="HTTP $code: $(head -c 300 "$work/chat.body")"; return 1; }
  [ -n "$worker" ] || { why="200 without X-Worker-Id"; return 1; }
  [[ " ${workers[*]} " == *" $worker "* ]] || { why="X-Worker-Id '$worker' is not one of ${workers[*]}"; return 1; }
  grep -q '"choices"' "$work/chat.body" || { why="200 without choices: $(head -c 300 "$work/chat.body")"; return 1; }
}
# route_n N: N requests in a row, each must pass (no retries).
route_n() {
  local i seen=()
  for ((i = 1; i <= $1; i++)); do
    chat || fail "request $i of $1 through HAProxy: $why"
    seen+=("$worker")
  done
  log "$1 of $1 requests through HAProxy: 200, X-Worker-Id ${seen[*]}"
}

haproxy_status() { # server → UP, DOWN, MAINT, … from the stats CSV (field 18)
  curl -s -m 2 "http://127.0.0.1:$stats_port/stats;csv" | awk -F, -v s="$1" '$1 == "replicas" && $2 == s {print $18}'
}
haproxy_check() { # server → its last check: status and code (fields 37, 38), e.g. "L7OK 200"
  curl -s -m 2 "http://127.0.0.1:$stats_port/stats;csv" | awk -F, -v s="$1" '$1 == "replicas" && $2 == s {print $37, $38}'
}
haproxy_all_up() {
  local r st
  for r in "${replicas[@]}"; do
    st=$(haproxy_status "$r")
    [[ $st == UP* ]] || { why="HAProxy sees $r as '${st:-?}' (last check: $(haproxy_check "$r"))"; return 1; }
  done
}
haproxy_down() { # server
  local st
  st=$(haproxy_status "$1")
  [[ $st == DOWN* ]] || { why="HAProxy sees $1 as '${st:-?}'"; return 1; }
}

# cluster_agrees PORT…: every replica answers /cluster/status, is ready, names
# the same leader (one of them, the only one in state leader), knows the four
# workers, and all FSM digests are equal. Sets $summary.
cluster_agrees() {
  local p files=()
  for p in "$@"; do
    tls_curl -sf -m 3 "$base:$p/cluster/status" >"$work/status.$p" 2>/dev/null ||
      { why="$base:$p/cluster/status does not answer"; return 1; }
    files+=("$work/status.$p")
  done
  summary=$(python3 - "${#workers[@]}" "${files[@]}" 2>&1 <<'PY'
import json, sys
n_workers, docs = int(sys.argv[1]), [json.load(open(f)) for f in sys.argv[2:]]
ids = [d["node_id"] for d in docs]
def each(key):
    return ", ".join(f"{d['node_id']}={d.get(key)!r}" for d in docs)
if not all(d.get("ready") for d in docs):
    sys.exit("not all ready: " + ", ".join(f"{d['node_id']}={d.get('ready_reason')!r}" for d in docs))
leaders = {d.get("leader_id") for d in docs}
if len(leaders) != 1 or not leaders <= set(ids):
    sys.exit(f"leader_id: {each('leader_id')} (want one of {ids}, the same everywhere)")
leader = leaders.pop()
if [d["node_id"] for d in docs if d.get("state") == "leader"] != [leader]:
    sys.exit(f"state: {each('state')}")
for d in docs:
    ws = sorted(w["id"] for w in d.get("workers") or [])
    if len(ws) != n_workers:
        sys.exit(f"{d['node_id']} knows workers {ws}, want {n_workers}")
if len({d.get("digest") for d in docs}) != 1 or not docs[0].get("digest"):
    sys.exit(f"digests differ: {each('digest')} (applied {each('applied_index')})")
print(f"leader {leader}, term {docs[0]['term']}, applied {each('applied_index')}, digest {docs[0]['digest']}")
PY
  ) || { why=$summary; return 1; }
}
leader_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["leader_id"])' "$work/status.$1"; }

phase "cluster up"
wait_for "all three replicas ready (GET https /ready 200 on 127.0.0.1:8001-8003, CA verified)" all_ready
wait_for "HAProxy sees r1 r2 r3 UP" haproxy_all_up
checks=''
for r in "${replicas[@]}"; do
  c=$(haproxy_check "$r")
  [ "${c% *}" = L7OK ] || fail "HAProxy's last check of $r is '$c', want L7OK (an HTTPS GET /ready answered 200)"
  checks+=" $r=${c// /:}"
done
log "HAProxy checks over TLS (check-ssl, verify required, check-sni):$checks"

# TLS and authentication are on: plaintext is refused on every replica port,
# and so are admin calls without the token (and with a wrong one); with it,
# an admin read goes through. Nothing here changes state.
plain_status() { # port → what a plaintext GET /ready gets (the replica answers 400 in plain HTTP)
  curl -s -m 3 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/ready" || true
}
admin_status() { # port [token]
  local auth=()
  [ -z "${2:-}" ] || auth=(-H "Authorization: Bearer $2")
  tls_curl -s -m 3 -o /dev/null -w '%{http_code}' ${auth[@]+"${auth[@]}"} \
    -H 'Content-Type: application/json' --data-binary '{}' "$base:$1/workers/register" || true
}
sec=''
for r in "${replicas[@]}"; do
  p=${http_port[$r]}
  plain=$(plain_status "$p")
  [ "$plain" != 200 ] || fail "plain http://127.0.0.1:$p/ready answered 200: $r takes plaintext"
  none=$(admin_status "$p")
  wrong=$(admin_status "$p" not-the-token)
  [ "$none" = 401 ] && [ "$wrong" = 401 ] ||
    fail "$r: POST /workers/register without the admin token answered $none, with a wrong one $wrong; want 401"
  sec+=" $r: plain http $plain, admin without/wrong token $none/$wrong;"
done
good=$(admin_status "${http_port[r1]}" "$(cat "$work/admin-token")")
[ "$good" = 400 ] || fail "r1: POST /workers/register {} with the admin token answered $good, want 400 (invalid, not unauthenticated)"
log "refused:$sec with the token: $good (the empty registration is invalid: the token was accepted)"
wait_for "first completion routed through HAProxy" chat
log "answered by $worker"
route_n "$n_requests"
wait_for "r1 r2 r3 agree" cluster_agrees "${http_port[@]}"
log "cluster: $summary"

phase "kill the leader"
victim=$(leader_of "${http_port[r1]}")
[ -n "${http_port[$victim]:-}" ] || fail "leader '$victim' is not one of ${replicas[*]}"
survivors=()
for r in "${replicas[@]}"; do [ "$r" = "$victim" ] || survivors+=("$r"); done
cid=$("$docker" ps -q --filter "label=com.docker.compose.project=$project" --filter "label=com.docker.compose.service=$victim")
[ -n "$cid" ] || fail "no container for $victim"
"$docker" kill "$cid" >/dev/null
t_kill=$(now_ms)
log "docker kill $victim (the Raft leader, container ${cid:0:12})"
wait_for "HAProxy marks $victim DOWN" haproxy_down "$victim"
wait_for "a completion routed through HAProxy again" chat
log "first success $(secs "$t_kill") after the kill, answered by $worker"
route_n "$n_requests"
wait_for "survivors ${survivors[*]} agree" cluster_agrees "${http_port[${survivors[0]}]}" "${http_port[${survivors[1]}]}"
log "survivors: $summary"
state=$("$docker" inspect -f '{{.State.Status}} (exit {{.State.ExitCode}}, restarts {{.RestartCount}})' "$cid")
log "$victim container: $state"

log "all checks passed"
# cleanup (trap) tears down, verifies the host and prints the timings.
