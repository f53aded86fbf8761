#!/usr/bin/env bash
# deploy/local/drain-sessions-live.sh — issue 29's drain with agent sessions,
# live on `make run` (three replicas, four kvmock workers, TLS and the admin
# token on) with session affinity: what a drained worker's sessions keep of
# their cache, a plain drain against --router-drain-shadow (api/DESIGN.md,
# "Drain by shadow prefills"). For each mode (DRAIN_SESSIONS_LIVE_MODES
# [plain shadow]) a fresh cluster runs DRAIN_SESSIONS_LIVE_SESSIONS [24]
# sessions side by side, DRAIN_SESSIONS_LIVE_TURNS [4] turns each (every turn
# the conversation so far after a system prompt all sessions share, turn t of
# session i through replica (i + t) mod 3, or i mod 3 with
# DRAIN_SESSIONS_LIVE_SPREAD=0: a client keeping its connection); then the
# worker bound to most sessions is drained through a follower; in shadow
# mode the script waits until every replica shows those sessions rebound (at
# most 30 s; plain: 2 s, they stay bound to the drained worker until their
# next turn); then every
# session plays one more turn. It reports, for the drained worker's sessions
# and the others, that next turn's cached fraction (kvmock's
# usage.prompt_tokens_details.cached_tokens over prompt_tokens) and checks
# that
#   - every turn is answered (200), none by the drained worker after the drain
#     (X-Worker-Id), and the worker gets no request after the drain (its /stats);
#   - shadow mode: every drained session was rebound before its next turn, the
#     replicas counted the copies (kvrouter_drain_copies_total), none failed.
#
#   make build-core && deploy/local/drain-sessions-live.sh
#
# Settings (environment): KVROUTER_RUN_PORT_OFFSET [300], the ones above, and
# DRAIN_SESSIONS_LIVE_JSON (the summary [tmp/drain-sessions-live.json]). Uses
# KVROUTER_RUN_DIR [tmp/run-drain-sessions]. Exit 0 only when every check holds.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
offset=${KVROUTER_RUN_PORT_OFFSET:-300}
modes=${DRAIN_SESSIONS_LIVE_MODES:-plain shadow}
summary=${DRAIN_SESSIONS_LIVE_JSON:-$root/tmp/drain-sessions-live.json}
run_dir=${KVROUTER_RUN_DIR:-$root/tmp/run-drain-sessions}
for b in kvrouter kvmock; do
  [ -x "bin/$b" ] || { echo "drain-sessions-live: bin/$b missing: run make build-core" >&2; exit 1; }
done
command -v python3 >/dev/null || { echo "drain-sessions-live: needs python3" >&2; exit 1; }
mkdir -p "$(dirname "$summary")"
echo '{"command": "deploy/local/drain-sessions-live.sh", "modes": {}}' >"$summary"
rc=0
for mode in $modes; do
  args="--router-session-affinity-ttl-secs 300"
  [ "$mode" = shadow ] && args="$args --router-drain-shadow"
  log=$(mktemp /tmp/kvrouter-drain-sessions-live.XXXXXX)
  KVROUTER_RUN_PORT_OFFSET=$offset KVROUTER_RUN_DIR=$run_dir KVROUTER_RUN_WORKERS=4 KVROUTER_RUN_TAIL=0 \
    KVROUTER_SERVE_ARGS="$args" setsid ./deploy/local/run.sh >"$log" 2>&1 </dev/null &
  pg=$!
  stop() {
    kill -TERM -- -"$pg" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pg" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- -"$pg" 2>/dev/null || true
  }
  trap stop EXIT
  PYTHONPATH="$root/deploy/local${PYTHONPATH:+:$PYTHONPATH}" python3 - "$offset" "$mode" "$summary" "$run_dir" "$log" "$args" \
    "${DRAIN_SESSIONS_LIVE_SESSIONS:-24}" "${DRAIN_SESSIONS_LIVE_TURNS:-4}" "${DRAIN_SESSIONS_LIVE_SPREAD:-1}" <<'PY' || rc=1
import json, os, re, sys, threading, time
import requests
from livecluster import admin_headers, wait_ready

offset, mode, summary, run_dir, runlog, args, n_sess, n_turns, spread = \
    int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6], int(sys.argv[7]), int(sys.argv[8]), sys.argv[9] != "0"
R = [f"http://127.0.0.1:{8000 + i + offset}" for i in (1, 2, 3)]
W = {f"mock-{j}": 9000 + j + offset for j in (1, 2, 3, 4)}
out = {"serve_args": args, "sessions": n_sess, "turns_before_drain": n_turns, "turns_spread_over_replicas": spread, "checks": {}}

def save(ok):
    doc = json.load(open(summary))
    out["passed"] = ok
    doc["modes"][mode] = out
    json.dump(doc, open(summary, "w"), indent=2)

def fail(msg):
    out["error"] = msg
    save(False)
    print(f"drain-sessions-live {mode}: FAILED: {msg}")
    sys.exit(1)

S = requests.Session()
t0 = time.time()
wait_ready(S, R, 4, runlog, fail)
hdr = admin_headers(run_dir, fail)

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
SYSTEM = "You are a careful coding assistant. " + " ".join(WORDS) * 6
convs = {}  # session → messages so far

def turn(sid, i, t):
    msgs = convs.setdefault(sid, [{"role": "system", "content": SYSTEM}])
    msgs.append({"role": "user", "content": f"turn {t} of {sid}: " + " ".join(WORDS[(i * 7 + t + k) % len(WORDS)] for k in range(48))})
    r = (i + t) % 3 if spread else i % 3
    try:
        resp = S.post(R[r] + "/v1/chat/completions", json={"model": "kvmock", "messages": msgs, "max_tokens": 24},
                      headers={"X-Dynamo-Session-ID": sid}, timeout=30)
        body = resp.json() if resp.status_code == 200 else {}
        u = body.get("usage") or {}
        answer = body["choices"][0]["message"]["content"] if resp.status_code == 200 else "ok"
        res = {"status": resp.status_code, "worker": resp.headers.get("X-Worker-Id", ""), "prompt": u.get("prompt_tokens", 0),
               "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "t": time.time()}
    except (requests.RequestException, ValueError, KeyError, IndexError) as e:
        res, answer = {"status": 0, "worker": "", "prompt": 0, "cached": 0, "error": repr(e)[:200], "t": time.time()}, "ok"
    msgs.append({"role": "assistant", "content": answer or "ok"})
    return res

sids = [f"ds-{mode}-{int(t0)}-{i:02d}" for i in range(n_sess)]
before = {}
def play(i, sid):
    before[sid] = [turn(sid, i, t) for t in range(n_turns)]
th = [threading.Thread(target=play, args=(i, s)) for i, s in enumerate(sids)]
[x.start() for x in th]
[x.join() for x in th]
bad = [(s, x) for s, v in before.items() for x in v if x["status"] != 200]
if bad:
    fail(f"turns before the drain failed: {bad[:3]}")
home = {s: v[-1]["worker"] for s, v in before.items()}
count = {}
for w in home.values():
    count[w] = count.get(w, 0) + 1
target = max(sorted(count), key=lambda w: count[w])
moved_sids = [s for s in sids if home[s] == target]
out["sessions_per_worker"] = dict(sorted(count.items()))
out["drained_worker"] = target

def mock_requests():
    d = S.get(f"http://127.0.0.1:{W[target]}/stats", timeout=2).json()["requests"]
    return d["chat"] + d["completions"]
def metric_sum(name):
    n = 0.0
    for u in R:
        m = re.search(r"^%s (\S+)$" % name, S.get(u + "/metrics", headers=hdr, timeout=5).text, re.M)
        n += float(m.group(1)) if m else 0.0
    return n

at_drain = mock_requests()
follower = next(u for u in R if S.get(u + "/cluster/status?digest=0", headers=hdr, timeout=2).json().get("state") != "leader")
t_drain = time.time()
resp = S.post(follower + "/workers/drain", headers=hdr, json={"id": target}, timeout=10)
if resp.status_code not in (200, 202):
    fail(f"POST /workers/drain: {resp.status_code} {resp.text[:200]}")

def bound(u, sid):
    b = S.get(u + "/sessions/" + sid, headers=hdr, timeout=5)
    return b.json().get("worker") if b.status_code == 200 else None
rebound_at = None
limit = 30 if mode == "shadow" else 2
while time.time() - t_drain < limit:
    if all(bound(u, s) not in (target, None) for u in R for s in moved_sids):
        rebound_at = time.time()
        break
    time.sleep(0.1)
if mode != "shadow":
    time.sleep(max(0, limit - (time.time() - t_drain)))
out["rebound_everywhere_s"] = round(rebound_at - t_drain, 2) if rebound_at else None

after = {}
def play_next(i, sid):
    after[sid] = turn(sid, i, n_turns)
th = [threading.Thread(target=play_next, args=(i, s)) for i, s in enumerate(sids)]
[x.start() for x in th]
[x.join() for x in th]
at_end = mock_requests()

def frac(group):
    p = sum(after[s]["prompt"] for s in group)
    return round(sum(after[s]["cached"] for s in group) / p, 3) if p else None
others = [s for s in sids if s not in moved_sids]
out["next_turn_cached_fraction"] = {"drained_sessions": frac(moved_sids), "other_sessions": frac(others)}
out["drained_sessions"] = len(moved_sids)
out["drained_sessions_next_turn_workers"] = sorted({after[s]["worker"] for s in moved_sids})
out["worker_requests_after_drain"] = at_end - at_drain
out["copies"] = metric_sum("kvrouter_drain_copies_total")
out["copy_failures"] = metric_sum("kvrouter_drain_copy_failures_total")
out["sessions_moved_by_copy"] = metric_sum("kvrouter_drain_sessions_moved_total")

c = out["checks"]
c["every_turn_answered"] = all(x["status"] == 200 for x in after.values())
c["none_on_drained_worker_after_drain"] = all(x["worker"] != target for x in after.values()) and at_end == at_drain
if mode == "shadow":
    c["rebound_before_next_turn"] = rebound_at is not None
    c["copies_sent_none_failed"] = out["copies"] >= len(moved_sids) and out["copy_failures"] == 0
ok = all(c.values())
save(ok)
print(f"drain-sessions-live {mode}: {'passed' if ok else 'FAILED'}: {target} drained with {len(moved_sids)} of {n_sess} sessions; "
      f"next turn cached fraction {out['next_turn_cached_fraction']}; copies {out['copies']:.0f} "
      f"(failed {out['copy_failures']:.0f}, moved {out['sessions_moved_by_copy']:.0f}); rebound in {out['rebound_everywhere_s']} s")
sys.exit(0 if ok else 1)
PY
  stop
  trap - EXIT
done
cat "$summary"
exit $rc
