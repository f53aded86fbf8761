"""What the live check scripts (drain-live.sh, drain-sessions-live.sh,
sessions-live.sh) share: waiting for make run's cluster and reading its admin
token. Each script starts run.sh itself and passes its run directory, log and
a fail function that records the error in its own summary before exiting."""
import os
import time

import requests


def wait_ready(session, urls, workers, runlog, fail, model="kvmock", timeout_s=180):
    """Wait until every replica answers /ready and lists `workers` workers of
    `model`; returns the seconds it took. Calls fail (which must not return)
    with the tail of run.sh's log when the cluster is not ready in time."""
    t0 = time.time()
    while True:
        try:
            if all(session.get(u + "/ready", timeout=1).status_code == 200 for u in urls) and \
               all(len([w for w in session.get(u + "/cluster/status?digest=0", timeout=1).json().get("workers", [])
                        if w.get("model") == model]) == workers for u in urls):
                return round(time.time() - t0, 1)
        except (requests.RequestException, ValueError):
            pass
        if time.time() - t0 > timeout_s:
            fail(f"cluster not ready with {workers} workers in {timeout_s} s; run.sh log: "
                 + open(runlog).read()[-600:].replace("\n", " | "))
        time.sleep(0.5)


def admin_headers(run_dir, fail, wait_s=20):
    """The Authorization header for admin endpoints. run.sh writes a new token
    after wiping its run directory, so read it only once the cluster is up, and
    wait a little for the file. An empty dict when the cluster runs without
    auth (no secrets directory at all)."""
    secrets = os.path.join(run_dir, "secrets")
    if not os.path.isdir(secrets):
        return {}
    p = os.path.join(secrets, "admin-token")
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if os.path.exists(p) and os.path.getsize(p) > 0:
            return {"Authorization": "Bearer " + open(p).read().strip()}
        time.sleep(0.2)
    fail("no admin token in " + p)
