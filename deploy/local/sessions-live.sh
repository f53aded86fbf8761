#!/usr/bin/env bash
# deploy/local/sessions-live.sh — issue 28's live check of session affinity on
# `make run` (three replicas, four kvmock workers, TLS and the admin token on),
# started with --router-session-affinity-ttl-secs 300 (hard mode, the
# default): SESSIONS_LIVE_SESSIONS [20] sessions of SESSIONS_LIVE_TURNS [8]
# turns each, run side by side, every turn of a session sent to the next
# replica in turn (r1, r2, r3, r1, ... shifted per session), each turn's
# OpenAI chat body the conversation so far (every earlier user message and
# the answer it got) plus a new user message. Two phases on the same cluster:
#   header  the session in X-Dynamo-Session-ID
#   body    the session in the body's prompt_cache_key (no session header)
# It checks, per phase, that
#   - every turn is answered (200) by a worker (X-Worker-Id);
#   - every session's turns are answered by one worker;
#   - every replica's GET /sessions/{id} (admin) names that worker;
# and at the end that the replicas' digests are equal.
#
#   make build-core && deploy/local/sessions-live.sh
#   make sessions-live                                  # the same
#
# Settings (environment): KVROUTER_RUN_PORT_OFFSET [400], SESSIONS_LIVE_SESSIONS,
# SESSIONS_LIVE_TURNS, SESSIONS_LIVE_JSON (where the summary goes
# [tmp/sessions-live.json]), SESSIONS_LIVE_SERVE_ARGS (flags for every
# replica [--router-session-affinity-ttl-secs 300]; the run passes them as
# KVROUTER_SERVE_ARGS). Uses KVROUTER_RUN_DIR [tmp/run-sessions] like make
# run. Exit 0 only when every check holds.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
offset=${KVROUTER_RUN_PORT_OFFSET:-400}
sessions=${SESSIONS_LIVE_SESSIONS:-20}
turns=${SESSIONS_LIVE_TURNS:-8}
summary=${SESSIONS_LIVE_JSON:-$root/tmp/sessions-live.json}
run_dir=${KVROUTER_RUN_DIR:-$root/tmp/run-sessions}
serve_args=${SESSIONS_LIVE_SERVE_ARGS:---router-session-affinity-ttl-secs 300}
for b in kvrouter kvmock; do
  [ -x "bin/$b" ] || { echo "sessions-live: bin/$b missing: run make build-core" >&2; exit 1; }
done
command -v python3 >/dev/null || { echo "sessions-live: needs python3" >&2; exit 1; }
mkdir -p "$(dirname "$summary")"
log=$(mktemp /tmp/kvrouter-sessions-live.XXXXXX)

# The cluster in its own process group, stopped by that group at exit.
KVROUTER_RUN_PORT_OFFSET=$offset KVROUTER_RUN_DIR=$run_dir KVROUTER_RUN_WORKERS=4 KVROUTER_RUN_TAIL=0 \
  KVROUTER_SERVE_ARGS="$serve_args" setsid ./deploy/local/run.sh >"$log" 2>&1 </dev/null &
pg=$!
stop() {
  kill -TERM -- -"$pg" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pg" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- -"$pg" 2>/dev/null || true
}
trap stop EXIT

PYTHONPATH="$root/deploy/local${PYTHONPATH:+:$PYTHONPATH}" python3 - "$offset" "$sessions" "$turns" "$summary" "$run_dir" "$log" "$serve_args" <<'PY'
import json, os, sys, threading, time
import requests
from livecluster import admin_headers, wait_ready

offset, n_sess, n_turns, summary, run_dir, runlog, serve_args = \
    int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7]
R = [f"http://127.0.0.1:{8000 + i + offset}" for i in (1, 2, 3)]
out = {"command": "deploy/local/sessions-live.sh", "port_offset": offset, "serve_args": serve_args,
       "sessions_per_phase": n_sess, "turns_per_session": n_turns, "phases": {}, "checks": {}}

def fail(msg):
    out["error"] = msg
    json.dump(out, open(summary, "w"), indent=2)
    print("sessions-live: FAILED: " + msg)
    sys.exit(1)

S = requests.Session()
t0 = time.time()
out["ready_after_s"] = wait_ready(S, R, 4, runlog, fail)
hdr = admin_headers(run_dir, fail)
st = S.get(R[0] + "/cluster/status?digest=0", headers=hdr, timeout=2).json()
out["affinity"] = {k: st.get("sessions", {}).get(k) for k in ("ttl_seconds", "mode")}
# Affinity off (SESSIONS_LIVE_SERVE_ARGS=" "): the run goes on, to show what
# KV-aware routing alone does with the same sessions; the checks fail.

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()

def run_session(phase, i, res):
    """One session: n_turns turns, turn t through replica (i + t) % 3."""
    sid = f"live-{phase}-{int(t0)}-{i:03d}"
    sess = requests.Session()
    msgs = [{"role": "system", "content": f"You are session {sid}'s assistant. " + " ".join(WORDS) * 4}]
    served = []  # (turn, replica, status, worker, latency_s, error)
    for t in range(n_turns):
        msgs.append({"role": "user", "content": f"turn {t} of {sid}: " + " ".join(WORDS[(i + t + k) % len(WORDS)] for k in range(24))})
        body = {"model": "kvmock", "messages": msgs, "max_tokens": 12}
        h = {}
        if phase == "header":
            h["X-Dynamo-Session-ID"] = sid
        else:
            body["prompt_cache_key"] = sid
        r = (i + t) % 3
        t1 = time.time()
        try:
            resp = sess.post(R[r] + "/v1/chat/completions", json=body, headers=h, timeout=30)
            w = resp.headers.get("X-Worker-Id", "")
            err = "" if resp.status_code == 200 else resp.text[:200]
            answer = resp.json()["choices"][0]["message"]["content"] if resp.status_code == 200 else ""
        except (requests.RequestException, ValueError, KeyError, IndexError) as e:
            resp, w, err, answer = None, "", repr(e)[:200], ""
        served.append({"turn": t, "replica": f"r{r + 1}", "status": resp.status_code if resp is not None else 0,
                       "worker": w, "s": round(time.time() - t1, 3), "error": err})
        msgs.append({"role": "assistant", "content": answer or "ok"})
    res[sid] = served

def phase(name):
    res = {}
    th = [threading.Thread(target=run_session, args=(name, i, res)) for i in range(n_sess)]
    t1 = time.time()
    for x in th:
        x.start()
    for x in th:
        x.join()
    elapsed = time.time() - t1
    turns = [x for v in res.values() for x in v]
    failed = [x for x in turns if x["status"] != 200 or not x["worker"]]
    one = {sid: len({x["worker"] for x in v if x["worker"]}) == 1 and all(x["status"] == 200 for x in v)
           for sid, v in res.items()}
    # The session's worker: the one that answered most of its turns (all of them when it passes).
    main = {}
    elsewhere = 0
    for sid, v in res.items():
        ws = [x["worker"] for x in v if x["worker"]]
        m = max(set(ws), key=ws.count) if ws else ""
        main[sid] = m
        elsewhere += sum(1 for w in ws if w != m)
    # Every replica's binding for every session.
    agree, mismatches = 0, []
    for sid in sorted(res):
        got = {}
        for k, u in enumerate(R):
            try:
                b = S.get(u + "/sessions/" + sid, headers=hdr, timeout=5)
                got[f"r{k + 1}"] = b.json().get("worker") if b.status_code == 200 else f"HTTP {b.status_code}"
            except (requests.RequestException, ValueError) as e:
                got[f"r{k + 1}"] = repr(e)[:80]
        if all(w == main[sid] for w in got.values()):
            agree += 1
        else:
            mismatches.append({"session": sid, "served_by": main[sid], "bindings": got})
    per_worker = {}
    for m in main.values():
        per_worker[m] = per_worker.get(m, 0) + 1
    lat = sorted(x["s"] for x in turns if x["status"] == 200)
    ph = {"sessions": len(res), "turns": len(turns), "turns_ok": len(turns) - len(failed),
          "sessions_answered_by_one_worker": sum(one.values()), "turns_served_elsewhere": elsewhere,
          "failures": len(failed), "failure_samples": failed[:5],
          "bindings_agree_on_every_replica": agree, "binding_mismatches": mismatches[:5],
          "sessions_per_worker": dict(sorted(per_worker.items())), "elapsed_s": round(elapsed, 2),
          "turn_latency_s": {"p50": lat[len(lat) // 2] if lat else None,
                             "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None}}
    out["phases"][name] = ph
    return ph

for name in ("header", "body"):
    ph = phase(name)
    print(f"sessions-live: {name}: {ph['sessions_answered_by_one_worker']}/{ph['sessions']} sessions by one worker, "
          f"{ph['turns_ok']}/{ph['turns']} turns answered, {ph['turns_served_elsewhere']} elsewhere, "
          f"bindings agree {ph['bindings_agree_on_every_replica']}/{ph['sessions']}, per worker {ph['sessions_per_worker']}")

# Agreement of the whole state: digests (the bindings are part of it).
digests = {}
for _ in range(30):
    digests = {}
    for k, u in enumerate(R):
        s = S.get(u + "/cluster/status", headers=hdr, timeout=5).json()
        digests[f"r{k + 1}"] = (s.get("digest"), (s.get("sessions") or {}).get("bindings"))
    if len({d for d, _ in digests.values()}) == 1:
        break
    time.sleep(0.5)
out["final"] = {r: {"digest": d, "bindings": b} for r, (d, b) in digests.items()}

c = out["checks"]
c["affinity_on"] = bool(out["affinity"]["ttl_seconds"])
for name, ph in out["phases"].items():
    c[f"{name}_every_turn_answered"] = ph["failures"] == 0 and ph["turns_ok"] == n_sess * n_turns
    c[f"{name}_every_session_one_worker"] = ph["sessions_answered_by_one_worker"] == n_sess
    c[f"{name}_bindings_agree"] = ph["bindings_agree_on_every_replica"] == n_sess
    c[f"{name}_sessions_spread"] = len(ph["sessions_per_worker"]) > 1  # not one worker for everything
c["digests_equal"] = len({d for d, _ in digests.values()}) == 1
c["bindings_count_equal"] = len({b for _, b in digests.values()}) == 1 and \
    next(iter(digests.values()))[1] == 2 * n_sess
out["passed"] = all(c.values())
json.dump(out, open(summary, "w"), indent=2)
print(json.dumps(out["checks"], indent=2))
print(f"sessions-live: {'passed' if out['passed'] else 'FAILED'}; summary in {summary}")
sys.exit(0 if out["passed"] else 1)
PY
