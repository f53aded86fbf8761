#!/usr/bin/env bash
# deploy/local/drain-live.sh — issue 29's live check of a worker drain on
# `make run` (three replicas, four kvmock workers, TLS and the admin token on):
# under `kvbench load`, drain one worker (the fleet plan's cheapest) through a
# follower and check that
#   - no request fails (kvbench load: errors 0, nothing unsent);
#   - no replica routes a request to the worker after it applied the drain
#     (kvrouter_routed_total{worker} of each replica process, sampled only
#     between two status reads that both show the worker drained, never
#     moves), and the worker receives none once every replica deregistered it
#     (its own /stats);
#   - it is deregistered when idle, on every replica (time from the drain's
#     commit to the last replica without it);
#   - every replica agrees: each showed it drained, each dropped it, the final
#     worker sets and digests are equal.
# Then it stops the worker (SIGTERM, as the Kubernetes preStop recipe does
# after the drain: deploy/k8s/drain/README.md), so its lease renewal cannot
# register it again while the load still runs.
#
#   make build-core && deploy/local/drain-live.sh
#   make drain-live                                  # the same
#
# Settings (environment): KVROUTER_RUN_PORT_OFFSET [300], DRAIN_LIVE_LOAD_S
# (seconds of load, [45]), DRAIN_LIVE_AT_S (drain after this much load [10]),
# DRAIN_LIVE_JSON (where the summary goes [tmp/drain-live.json]). Uses
# KVROUTER_RUN_DIR [tmp/run] like make run. Exit 0 only when every check holds.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
offset=${KVROUTER_RUN_PORT_OFFSET:-300}
load_s=${DRAIN_LIVE_LOAD_S:-45}
at_s=${DRAIN_LIVE_AT_S:-10}
summary=${DRAIN_LIVE_JSON:-$root/tmp/drain-live.json}
run_dir=${KVROUTER_RUN_DIR:-$root/tmp/run}
for b in kvrouter kvmock kvbench; do
  [ -x "bin/$b" ] || { echo "drain-live: bin/$b missing: run make build-core" >&2; exit 1; }
done
command -v python3 >/dev/null || { echo "drain-live: needs python3" >&2; exit 1; }
mkdir -p "$(dirname "$summary")"
log=$(mktemp /tmp/kvrouter-drain-live.XXXXXX)

# The cluster in its own process group, stopped by that group at exit.
KVROUTER_RUN_PORT_OFFSET=$offset KVROUTER_RUN_DIR=$run_dir KVROUTER_RUN_WORKERS=4 KVROUTER_RUN_TAIL=0 \
  setsid ./deploy/local/run.sh >"$log" 2>&1 </dev/null &
pg=$!
stop() {
  kill -TERM -- -"$pg" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pg" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- -"$pg" 2>/dev/null || true
}
trap stop EXIT

PYTHONPATH="$root/deploy/local${PYTHONPATH:+:$PYTHONPATH}" python3 - "$offset" "$load_s" "$at_s" "$summary" "$run_dir" "$root" "$log" <<'PY'
import json, os, re, signal, subprocess, sys, threading, time
import requests
from livecluster import admin_headers, wait_ready

offset, load_s, at_s, summary, run_dir, root, runlog = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7]
R = {f"r{i}": f"http://127.0.0.1:{8000 + i + offset}" for i in (1, 2, 3)}
W = {f"mock-{j}": 9000 + j + offset for j in (1, 2, 3, 4)}
out = {"command": "deploy/local/drain-live.sh", "port_offset": offset, "checks": {}}

load = None

def fail(msg):
    if load is not None and load.poll() is None:
        load.kill()
    out["error"] = msg
    json.dump(out, open(summary, "w"), indent=2)
    print("drain-live: FAILED: " + msg)
    sys.exit(1)

hdr = {}  # the admin token, read once the cluster is up: run.sh writes a new one after wiping the run directory
S = requests.Session()

def status(u, t=1.0):
    return S.get(u + "/cluster/status?digest=0", headers=hdr, timeout=t).json()

def workers_of(st):
    return {w["id"]: w for w in st.get("workers", [])}

# --- ready: three replicas, four workers everywhere -----------------------------
out["ready_after_s"] = wait_ready(S, list(R.values()), 4, runlog, fail)
hdr.update(admin_headers(run_dir, fail))

# --- the poller: status, metrics, status, per replica ---------------------------
target = None           # the drained worker, once chosen
samples = {r: [] for r in R}   # (t, pid, drained_before, drained_after, present_after, routed)
stop_poll = threading.Event()
route_re = None

def routed(text, w):
    m = re.search(r'^kvrouter_routed_total\{model="kvmock",worker="%s"\} (\S+)$' % re.escape(w), text, re.M)
    return float(m.group(1)) if m else 0.0

def poll(r, u):
    sess = requests.Session()
    while not stop_poll.is_set():
        w = target
        if w is not None:
            try:
                s1 = sess.get(u + "/cluster/status?digest=0", headers=hdr, timeout=1).json()
                m = sess.get(u + "/metrics", headers=hdr, timeout=1).text
                s2 = sess.get(u + "/cluster/status?digest=0", headers=hdr, timeout=1).json()
                a, b = workers_of(s1).get(w), workers_of(s2).get(w)
                samples[r].append((time.time(), s1.get("pid"), s2.get("pid"), bool(a and a.get("drained")),
                                   bool(b and b.get("drained")), b is not None, routed(m, w)))
            except (requests.RequestException, ValueError):
                pass
        time.sleep(0.05)

threads = [threading.Thread(target=poll, args=(r, u), daemon=True) for r, u in R.items()]
for th in threads:
    th.start()

# --- load --------------------------------------------------------------------------
rep = os.path.join(os.path.dirname(summary), "drain-live-load.json")
load = subprocess.Popen([os.path.join(root, "bin", "kvbench"), "load", "--target", ",".join(R.values()),
                         "--admin-token-file", os.path.join(run_dir, "secrets", "admin-token"),
                         "--prefixes", "16", "--prefix-tokens", "512", "--tail-tokens", "64", "--output-tokens", "48",
                         "--requests", "100000", "--concurrency", "8", "--max-duration", f"{load_s}s", "--json", rep],
                        stdout=subprocess.DEVNULL, stderr=open(rep + ".log", "w"))
time.sleep(at_s)
if load.poll() is not None:
    fail(f"kvbench load ended early (exit {load.returncode}); see {rep}.log")

# --- drain the plan's cheapest worker through a follower --------------------------
sts = {r: status(u) for r, u in R.items()}
follower = next(r for r, s in sts.items() if s["state"] != "leader")
plan = S.get(R[follower] + "/fleet/plan", headers=hdr, timeout=5).json()
ranked = [w for w in plan.get("workers", []) if w.get("model") == "kvmock"]
target_id = ranked[0]["worker"] if ranked else "mock-4"
out["worker"], out["drained_via"] = target_id, follower
out["plan_cheapest_first"] = [w["worker"] for w in ranked]
target = target_id
time.sleep(0.5)  # the poller's first samples, before the drain
t_post = time.time()
resp = S.post(R[follower] + "/workers/drain", headers=hdr, json={"id": target_id}, timeout=10)
t_commit = time.time()  # the answer comes once the follower applied it: the commit is before
if resp.status_code not in (200, 202):
    fail(f"POST /workers/drain: {resp.status_code} {resp.text[:200]}")
out["drain_post_s"] = round(t_commit - t_post, 3)

# --- wait for the deregistration everywhere ------------------------------------------
gone = {}
while len(gone) < 3 and time.time() - t_commit < 60:
    for r, u in R.items():
        if r not in gone:
            try:
                if target_id not in workers_of(status(u)):
                    gone[r] = time.time()
            except requests.RequestException:
                pass
    time.sleep(0.05)
if len(gone) < 3:
    fail(f"{target_id} not deregistered on every replica 60 s after the drain: gone on {sorted(gone)}")
t_gone = max(gone.values())
out["drain_commit_to_deregistered_s"] = {r: round(t - t_commit, 2) for r, t in sorted(gone.items())}
out["drain_commit_to_deregistered_everywhere_s"] = round(t_gone - t_commit, 2)

# The worker's own count once no replica has it, then stop it (preStop: drained, now SIGTERM).
def mock_requests():
    d = S.get(f"http://127.0.0.1:{W[target_id]}/stats", timeout=2).json()["requests"]
    return d["chat"] + d["completions"]
at_gone = mock_requests()
pid = None
ss = subprocess.run(["ss", "-Hltnp", f"sport = :{W[target_id]}"], capture_output=True, text=True).stdout
m = re.search(r"pid=(\d+)", ss)
before_stop = None
if m:
    pid = int(m.group(1))
    time.sleep(2)  # nothing may reach it meanwhile
    before_stop = mock_requests()
    os.kill(pid, signal.SIGTERM)
out["worker_requests_at_deregistration"] = at_gone
out["worker_requests_2s_later"] = before_stop
out["worker_stopped_pid"] = pid

load.wait(timeout=load_s + 120)
stop_poll.set()
for th in threads:
    th.join(timeout=3)
rj = json.load(open(rep))
res = rj["results"][0]
per = {w["worker"]: w["requests"] for w in res.get("per_worker", [])}
# kvbench counts the requests --max-duration left unsent as errors (misses
# at --timeout); the failures are the rest.
failed = res["errors"] - res.get("not_sent", 0)
out["load"] = {"sent": res["requests"] - res.get("not_sent", 0), "completed": res.get("completed"), "failed": failed,
               "not_sent_at_max_duration": res.get("not_sent"), "per_worker": per, "error_samples": res.get("error_samples", [])[:5]}

# --- routed after the drain, per replica process ------------------------------------
after = {}
first_drained = {}
for r, xs in samples.items():
    segs = {}
    for (t, p1, p2, d1, d2, present, n) in xs:
        if d1 and d2 and p1 == p2:
            segs.setdefault(p1, []).append((t, n))
            first_drained.setdefault(r, t)
    after[r] = {"samples_while_drained": sum(len(v) for v in segs.values()),
                "routed_after_drain": int(sum(max(n for _, n in v) - min(n for _, n in v) for v in segs.values())),
                "routed_total_at_drain": int(min((n for v in segs.values() for _, n in v), default=0))}
out["per_replica"] = after
out["drain_commit_to_drained_seen_s"] = {r: round(t - t_commit, 3) for r, t in sorted(first_drained.items())}

# --- agreement -----------------------------------------------------------------------
final = {}
for r, u in R.items():
    s = S.get(u + "/cluster/status", headers=hdr, timeout=5).json()
    final[r] = (sorted(workers_of(s)), s.get("digest"), s.get("applied_index"))
t_agree = time.time()
while len({(tuple(w), d) for w, d, _ in final.values()}) > 1 and time.time() - t_agree < 15:
    time.sleep(0.5)
    final = {r: (sorted(workers_of(s)), s.get("digest"), s.get("applied_index"))
             for r, s in ((r, S.get(u + "/cluster/status", headers=hdr, timeout=5).json()) for r, u in R.items())}
out["final_workers"] = {r: w for r, (w, _, _) in final.items()}
out["final_digests_equal"] = len({d for _, d, _ in final.values()}) == 1

c = out["checks"]
c["no_request_failed"] = failed == 0 and res.get("completed") == out["load"]["sent"]
c["load_ran_through_drain"] = out["load"]["sent"] > 0 and per.get(target_id, 0) > 0
c["every_replica_saw_it_drained"] = all(after[r]["samples_while_drained"] > 0 for r in R)
c["no_routing_after_drain"] = all(after[r]["routed_after_drain"] == 0 for r in R)
c["no_request_at_worker_after_deregistration"] = before_stop is not None and before_stop == at_gone
c["deregistered_everywhere"] = len(gone) == 3
c["replicas_agree"] = out["final_digests_equal"] and all(target_id not in w for w in out["final_workers"].values()) \
    and len({tuple(w) for w in out["final_workers"].values()}) == 1
out["passed"] = all(c.values())
json.dump(out, open(summary, "w"), indent=2)
print(json.dumps(out, indent=2))
print(f"drain-live: {'passed' if out['passed'] else 'FAILED'}: {target_id} drained via {follower}; "
      f"{out['load']['sent']} requests, {failed} failed; routed there after the drain: "
      f"{sum(a['routed_after_drain'] for a in after.values())}; deregistered everywhere "
      f"{out['drain_commit_to_deregistered_everywhere_s']} s after the commit; digests equal {out['final_digests_equal']}")
sys.exit(0 if out["passed"] else 1)
PY
