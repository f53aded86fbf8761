import json, os, re, signal, subprocess, sys, threading, time, urllib.request
R = {1: "http://127.0.0.1:8001", 2: "http://127.0.0.1:8002", 3: "http://127.0.0.1:8003"}
def get(u, t=3):
    return urllib.request.urlopen(u, timeout=t).read().decode()
def inflight(u):
    m = get(u + "/metrics")
    return sum(float(x) for x in re.findall(r'^kvrouter_worker_inflight_requests\{[^}]*\} (\S+)', m, re.M))
def status(u): return json.loads(get(u + "/cluster/status?digest=0"))
def long_req(i):
    body = json.dumps({"model": "kvmock", "prompt": "word " * 200 + str(i), "max_tokens": 3000}).encode()
    try:
        urllib.request.urlopen(urllib.request.Request(R[1] + "/v1/completions", body, {"content-type": "application/json"}), timeout=120).read()
    except Exception:
        pass
N = 8
ths = [threading.Thread(target=long_req, args=(i,), daemon=True) for i in range(N)]
for t in ths: t.start()
t0 = time.time()
while time.time() - t0 < 10 and inflight(R[2]) < N: time.sleep(0.02)
print(f"r2 sees {inflight(R[2]):.0f} of {N} in-flight requests routed by r1 after {time.time()-t0:.2f} s")
pid1 = status(R[1])["pid"]
cmd = open(f"/proc/{pid1}/cmdline").read().split("\0")[:-1]
os.kill(pid1, signal.SIGKILL); tk = time.time()
while inflight(R[2]) > 0 and time.time() - tk < 30: time.sleep(0.02)
print(f"phantom load of killed r1 gone from r2 after {time.time()-tk:.2f} s (remaining {inflight(R[2]):.0f})")
# load on r2, then restart r1 and time until it sees r2's load
ths = []
def long_req2(i):
    body = json.dumps({"model": "kvmock", "prompt": "other " * 200 + str(i), "max_tokens": 3000}).encode()
    try: urllib.request.urlopen(urllib.request.Request(R[2] + "/v1/completions", body, {"content-type": "application/json"}), timeout=120).read()
    except Exception: pass
for i in range(N):
    t = threading.Thread(target=long_req2, args=(i,), daemon=True); t.start()
time.sleep(1)
p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open("/tmp/r1-restart.log", "w"), start_new_session=True)
ts = time.time()
while True:
    try:
        if inflight(R[1]) >= N: break
    except Exception: pass
    if time.time() - ts > 60: break
    time.sleep(0.02)
print(f"restarted r1 sees r2's {N} in-flight requests {time.time()-ts:.2f} s after its process started")
try:
    while time.time() - ts < 60:
        try:
            if urllib.request.urlopen(R[1] + "/ready", timeout=1).status == 200: break
        except Exception: pass
        time.sleep(0.05)
    print(f"restarted r1 ready after {time.time()-ts:.2f} s")
finally:
    p.terminate(); p.wait(10)
