// The kvrouter status page: reads this replica's own JSON endpoints every
// two seconds and fills the tables. Plain DOM, textContent only (values
// from the status documents never become markup), no dependencies.
"use strict";

const REFRESH_MS = 2000;
// The digest hashes the whole index: ask for it on one refresh in five so
// an open page stays cheap for a replica with millions of blocks.
const DIGEST_EVERY = 5;
const TOKEN_KEY = "kvrouter-admin-token";

let refreshes = 0;
let lastDigest = "";

const $ = (id) => document.getElementById(id);

function setText(id, v) { $(id).textContent = v === undefined || v === null ? "—" : String(v); }

// row appends a table row of cells; a cell is a value or {text, cls}.
function row(tbody, cells) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = document.createElement("td");
    const o = (c !== null && typeof c === "object") ? c : { text: c };
    td.textContent = o.text === undefined || o.text === null ? "—" : String(o.text);
    if (o.cls) td.className = o.cls;
    if (o.href) {
      td.textContent = "";
      const a = document.createElement("a");
      a.href = o.href;
      a.textContent = o.text;
      td.appendChild(a);
    }
    tr.appendChild(td);
  }
  tbody.appendChild(tr);
  return tr;
}

function clearBody(id) {
  const tb = $(id).querySelector("tbody");
  tb.replaceChildren();
  return tb;
}

// NeedToken is thrown when an endpoint answers 401: the page then asks
// for the admin token once and keeps it for the tab.
class NeedToken extends Error {}

async function getJSON(path) {
  const headers = {};
  const tok = sessionStorage.getItem(TOKEN_KEY);
  if (tok) headers["Authorization"] = "Bearer " + tok;
  const resp = await fetch(path, { headers, cache: "no-store" });
  if (resp.status === 401) throw new NeedToken(path + " needs the admin token");
  if (!resp.ok) {
    const err = new Error(path + ": HTTP " + resp.status);
    err.status = resp.status;
    throw err;
  }
  return resp.json();
}

function renderCluster(st) {
  setText("node-id", st.node_id);
  setText("state", st.state);
  setText("leader", st.leader_id || "none known");
  setText("term", st.term);
  setText("indexes", st.applied_index + " / " + st.commit_index);
  setText("snapshot", st.last_snapshot_index ? st.last_snapshot_index : "none yet");
  setText("index-blocks", st.index_blocks);
  setText("ready", st.ready ? "yes" : "no: " + st.ready_reason);
  if (st.digest) lastDigest = st.digest;
  setText("digest", lastDigest || "(computing)");

  const nodes = st.nodes || [];
  const peers = new Map((st.peers || []).map((p) => [p.id, p]));
  const tb = clearBody("nodes");
  for (const n of nodes) {
    const p = peers.get(n.id) || {};
    const role = p.leader ? "leader" : (n.id === st.node_id ? st.state : "follower");
    row(tb, [n.id === st.node_id ? { text: n.id + " (this one)", cls: "chosen" } : n.id,
      n.raft_addr, p.suffrage, role, n.http_addr ? { text: n.http_addr + "/ui", href: n.http_addr + "/ui" } : "—"]);
  }
  // The replica compares its state with its peers' itself (the browser
  // cannot read their origins): state_agreement, from digest checkpoints
  // taken at the same log indexes.
  setText("agreement", agreementText(nodes, st));

  const f = st.fsm || {};
  const rej = f.Rejected || {};
  setText("fsm-line", "Index: " + (f.Events ?? "—") + " events applied, " + (f.Gaps ?? "—") + " event gaps (events missing, worker resynced), " +
    (rej.over_capacity ?? "—") + " over-capacity refusals, " + (f.Duplicates ?? "—") + " duplicates. " +
    "Cool-downs (workers tried last for a few seconds after a failed connection) are not exposed yet.");
}

function agreementText(nodes, st) {
  if (nodes.length <= 1) return "single replica: nothing to compare";
  const ag = st.state_agreement || {};
  const peers = Object.keys(ag).sort();
  if (peers.length === 0) return "not compared yet (peers are checked every 15-45 s)";
  return peers.map((p) => {
    const v = ag[p];
    if (v.verdict === "agree") return p + ": same state at log index " + v.index;
    if (v.verdict === "differ") return p + ": DIFFERENT state at log index " + v.index + " (" + v.digest_here.slice(0, 12) + " here, " + v.digest_there.slice(0, 12) + " there)";
    return p + ": not compared (" + (v.detail || "no common index yet") + ")";
  }).join("; ");
}

function renderWorkers(st, loads) {
  const tb = clearBody("workers");
  for (const w of st.workers || []) {
    const ranks = w.ranks || [];
    const blocks = ranks.reduce((s, r) => s + (r.blocks || 0), 0);
    const lastIDs = ranks.map((r) => r.last_event_id).join(", ");
    // Per rank: stale (a gap or a missing parent, being resynced) and
    // events_missing_for_s (routed to but silent: routing to it is blind).
    const trouble = ranks.filter((r) => r.stale || r.events_missing_for_s).map((r) =>
      (ranks.length > 1 ? "rank " + r.rank + ": " : "") + [r.stale ? "stale (" + r.stale + ")" : "",
        r.events_missing_for_s ? "no events for " + r.events_missing_for_s.toFixed(0) + " s" : ""].filter(Boolean).join(", ")).join("; ");
    const gaps = (w.capacity_gaps || []).map((g) => g.setting + " (" + g.missing + " missing)").join("; ");
    const l = loads.get(w.id);
    // A drained worker takes no new request and leaves once idle.
    const id = w.drained ? w.id + " (drained" + (w.drain_deadline ? ", leaves by " + w.drain_deadline : "") + ")" : w.id;
    row(tb, [w.drained ? { text: id, cls: "bad" } : id, w.model, w.role, { text: w.total_kv_blocks, cls: "num" }, { text: blocks, cls: "num" },
      { text: w.index_block_cap, cls: "num" }, { text: lastIDs, cls: "mono" }, trouble ? { text: trouble, cls: "bad" } : "no", { text: w.over_capacity_refused, cls: "num" },
      gaps ? { text: gaps, cls: "bad" } : "none",
      { text: w.session_bindings || 0, cls: "num" }, { text: w.pins || 0, cls: "num" },
      l ? l.active_requests + " req · " + l.active_blocks + " blocks · " + l.active_prefill_tokens + " prefill tok" : "no decision yet"]);
  }
  if (!(st.workers || []).length) row(tb, ["no workers registered"]);
}

// The fleet plan (GET /fleet/plan, in /cluster/status as fleet_plan):
// every worker from the cheapest to remove to the dearest.
function renderFleetPlan(st) {
  const tb = clearBody("fleet-plan");
  const plan = st.fleet_plan || {};
  (plan.workers || []).forEach((w, i) => {
    row(tb, [{ text: i + 1, cls: "num" }, w.drained ? { text: w.worker + " (drained)", cls: "bad" } : w.worker, w.model,
      { text: Math.round(w.removal_cost), cls: "num" }, { text: w.recompute_tokens_per_s.toFixed(1), cls: "num" },
      { text: pct(w.hit_rate_loss), cls: "num" }, { text: w.unique_blocks + " / " + w.held_blocks, cls: "num" },
      { text: pct(w.cached_token_share), cls: "num" }, w.reason]);
  });
  if (!(plan.workers || []).length) row(tb, ["no workers registered"]);
  setText("fleet-plan-note", plan.note ? plan.note + " Window: " + plan.window + "." : "");
}

function renderHits(st) {
  const tb = clearBody("hits");
  const audit = st.cache_audit || {};
  const ids = Object.keys(audit).sort();
  for (const id of ids) {
    const a = audit[id];
    row(tb, [id, { text: a.requests, cls: "num" }, { text: a.predicted_cached_tokens, cls: "num" },
      { text: a.reported_cached_tokens, cls: "num" },
      { text: typeof a.reported_over_predicted === "number" ? a.reported_over_predicted.toFixed(2) : "—", cls: "num" },
      a.drifting ? { text: "yes", cls: "bad" } : { text: "no", cls: "good" }]);
  }
  if (!ids.length) row(tb, ["no audited requests yet"]);
}

function pct(v) { return typeof v === "number" ? (100 * v).toFixed(1) + " %" : "—"; }

function gapText(gaps) {
  return (gaps || []).map((g) => g.between + " " + g.points.toFixed(1) + " pts: " + g.cause.replace("_", " ") + " — " + g.why).join("; ");
}

// renderHitRates fills the four numbers (issue 18 item 3): per model the
// fleet-wide row of each window, then each worker's captured and delivered
// (available and reachable are fleet-wide only).
function renderHitRates(st) {
  const tb = clearBody("hit-rates");
  const hr = st.hit_rates || {};
  for (const m of hr.models || []) {
    const rows = [{ worker: "fleet (" + m.fleet_kv_blocks + " KV blocks)", windows: m.windows || [], fleet: true }]
      .concat((m.workers || []).map((w) => ({ worker: w.worker, windows: w.windows || [] })));
    for (const r of rows) {
      for (const w of r.windows) {
        const gaps = gapText(w.gaps);
        const tr = row(tb, [m.model, r.fleet ? { text: r.worker, cls: "chosen" } : r.worker, w.window, { text: w.requests, cls: "num" },
          { text: r.fleet ? pct(w.available) : "fleet-wide", cls: "num" }, { text: r.fleet ? pct(w.reachable) : "fleet-wide", cls: "num" },
          { text: pct(w.captured), cls: "num" }, { text: pct(w.delivered), cls: "num" }, gaps ? { text: gaps, cls: "bad" } : "none"]);
        tr.className = "hit-rate";
      }
    }
  }
  if (!(hr.models || []).length) row(tb, [hr.note === undefined ? "hit rates are off on this replica" : "no requests served yet"]);
  recordHitHistory(hr);
  drawHitHistory();
  setText("hit-note", hr.note ? hr.note + " History bound: " + (hr.models || []).map((m) => m.model + " " + m.history_blocks + "/" + m.history_bound_blocks + " blocks").join(", ") : "");
}

// The four fleet numbers over time: the replica keeps windows, not
// history, so the page remembers what each refresh showed (the last 10
// minutes at one refresh every 2 s) and draws them as lines.
const hitHistory = new Map(); // model → [{t, available, reachable, captured, delivered}]
const hitSeries = [["available", "#1f77b4"], ["reachable", "#2ca02c"], ["captured", "#ff7f0e"], ["delivered", "#d62728"]];
const hitHistoryPoints = 300;

function recordHitHistory(hr) {
  const now = Date.now();
  for (const m of hr.models || []) {
    const w = (m.windows || []).find((x) => x.window === "1m") || (m.windows || [])[0];
    if (!w || !w.requests) continue;
    const h = hitHistory.get(m.model) || [];
    h.push({ t: now, available: w.available, reachable: w.reachable, captured: w.captured, delivered: w.delivered });
    if (h.length > hitHistoryPoints) h.splice(0, h.length - hitHistoryPoints);
    hitHistory.set(m.model, h);
  }
}

function svgEl(name, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

function drawHitHistory() {
  const box = document.getElementById("hit-history");
  box.replaceChildren();
  const W = 640, H = 160, L = 40, B = 20, T = 8;
  for (const [model, h] of [...hitHistory.entries()].sort()) {
    if (h.length < 2) continue;
    const svg = svgEl("svg", { width: W, height: H + 24, class: "hit-chart", "data-model": model, role: "img",
      "aria-label": "hit rates of " + model + " over time" });
    const t0 = h[0].t, t1 = h[h.length - 1].t;
    const x = (t) => L + (W - L - 8) * (t1 > t0 ? (t - t0) / (t1 - t0) : 1);
    const y = (v) => T + (H - T - B) * (1 - Math.max(0, Math.min(1, v)));
    for (const v of [0, 0.5, 1]) {
      svg.appendChild(svgEl("line", { x1: L, x2: W - 8, y1: y(v), y2: y(v), stroke: "#ddd" }));
      const lab = svgEl("text", { x: L - 4, y: y(v) + 4, "text-anchor": "end", "font-size": 11, fill: "#555" });
      lab.textContent = (v * 100).toFixed(0) + "%";
      svg.appendChild(lab);
    }
    const span = svgEl("text", { x: W - 8, y: H - 4, "text-anchor": "end", "font-size": 11, fill: "#555" });
    span.textContent = model + ": last " + Math.round((t1 - t0) / 1000) + " s";
    svg.appendChild(span);
    hitSeries.forEach(([key, color], i) => {
      const pts = h.filter((p) => typeof p[key] === "number").map((p) => x(p.t).toFixed(1) + "," + y(p[key]).toFixed(1));
      if (pts.length > 1) svg.appendChild(svgEl("polyline", { points: pts.join(" "), fill: "none", stroke: color, "stroke-width": 2, class: "series-" + key }));
      const leg = svgEl("text", { x: L + i * 110, y: H + 18, "font-size": 12, fill: color });
      leg.textContent = "■ " + key;
      svg.appendChild(leg);
    });
    box.appendChild(svg);
  }
  if (!box.children.length) box.textContent = "collecting: the chart starts after two refreshes with requests";
}

function candidateText(d, c) {
  return (c.worker === d.worker ? "▶ " : "") + c.worker + ": " + c.cached_blocks + " · " +
    c.active_requests + "r/" + c.active_blocks + "b · " + Number(c.cost).toFixed(3) + (c.busy ? " busy(" + c.busy_reason + ")" : "");
}

function outcomeText(o) {
  if (!o) return "pending";
  const parts = [];
  if (o.status) parts.push("HTTP " + o.status);
  if (o.ttft_ms) parts.push("TTFT " + o.ttft_ms.toFixed(0) + " ms");
  if (o.prompt_tokens) parts.push((o.cached_tokens || 0) + "/" + o.prompt_tokens + " cached");
  if (o.error) parts.push(o.error);
  return parts.join(" · ");
}

// renderDecisions fills the table and returns each worker's load as the
// newest decision saw it.
function renderDecisions(doc) {
  const tb = clearBody("decisions");
  const loads = new Map();
  const ds = doc.decisions || [];
  for (const d of ds) {
    for (const c of d.candidates || []) if (!loads.has(c.worker)) loads.set(c.worker, c);
    const tr = row(tb, [new Date(d.time).toLocaleTimeString(), { text: d.request_id, cls: "mono" }, d.model,
      d.worker ? { text: d.worker, cls: "chosen" } : { text: d.route_error || "none", cls: "bad" },
      { text: d.index_epoch, cls: "num" }, "", outcomeText(d.outcome)]);
    tr.className = "decision";
    const cell = tr.children[5];
    for (const c of d.candidates || []) {
      const div = document.createElement("div");
      div.textContent = candidateText(d, c);
      if (c.worker === d.worker) div.className = "chosen";
      cell.appendChild(div);
    }
  }
  setText("decisions-note", ds.length ? "newest first; ring of " + doc.ring_size + " decisions on this replica" : "no decisions yet");
  return loads;
}

async function refresh() {
  refreshes++;
  const withDigest = refreshes % DIGEST_EVERY === 1;
  const errors = [];
  let loads = new Map();
  try {
    const doc = await getJSON("/debug/decisions?limit=20");
    loads = renderDecisions(doc);
  } catch (e) {
    if (e instanceof NeedToken) askToken();
    else if (e.status === 404) setText("decisions-note", "the decision log is off on this replica (--decision-log-size 0)");
    else errors.push(e.message);
  }
  try {
    const st = await getJSON(withDigest ? "/cluster/status" : "/cluster/status?digest=0");
    renderCluster(st);
    renderWorkers(st, loads);
    renderFleetPlan(st);
    renderHitRates(st);
    renderHits(st);
  } catch (e) {
    if (e instanceof NeedToken) askToken();
    else errors.push(e.message);
  }
  setText("error", errors.join("; "));
  setText("refreshed", "updated " + new Date().toLocaleTimeString());
}

function askToken() { $("token-form").hidden = false; }

function start() {
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value);
    $("token-form").hidden = true;
    refresh();
  });
  refresh();
  setInterval(refresh, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", start);
