"""The dashboard's one page: HTML, a little CSS and vanilla JavaScript, no build step.

The server renders the page's frame (the namespace, whether actions are enabled, the refresh
interval); the script polls ``/api/status``, ``/api/weights`` and ``/api/dead`` and fills the
tables. Every value from Redis reaches the page as text (``textContent``), never as markup.
Elements the tests read carry ``id`` or ``data-*`` attributes named after the status document's fields.
"""

from __future__ import annotations

import html
import json

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2em; color: #1d2330; background: #f6f7f9; }
h1 { font-size: 1.3em; margin: 0 0 .2em; } h2 { font-size: 1.05em; margin: 1.2em 0 .4em; }
.sub { color: #5b6473; font-size: .9em; }
section { background: #fff; border: 1px solid #dde1e7; border-radius: 6px; padding: .6em .9em; margin: .8em 0; }
table { border-collapse: collapse; width: 100%; } th, td { text-align: left; padding: .25em .6em; }
th { color: #5b6473; font-weight: 600; border-bottom: 1px solid #dde1e7; } td { border-bottom: 1px solid #f0f2f5; }
.figures { display: grid; grid-template-columns: repeat(auto-fill, minmax(11em, 1fr)); gap: .5em; }
.figure { background: #f6f7f9; border-radius: 4px; padding: .4em .6em; }
.figure b { display: block; font-size: 1.35em; } .figure span { color: #5b6473; font-size: .85em; }
#alerts li.alert { color: #a3161a; font-weight: 600; } #alerts li.warning { color: #8a5a00; }
#alerts:empty::after { content: "none"; color: #5b6473; }
.stale { color: #a3161a; } .old { color: #8a5a00; } .mono { font-family: ui-monospace, monospace; }
button { cursor: pointer; } #connection.down { color: #a3161a; font-weight: 600; }
pre { background: #f6f7f9; padding: .5em; overflow: auto; max-height: 24em; }
"""

_BODY = """
<h1>redroll pipeline <span class="mono" id="namespace"></span></h1>
<div class="sub">status as of <span id="snapshot-time" data-time="">-</span>;
 refreshed every <span id="interval"></span> s; <span id="connection">connecting</span></div>

<section><h2>Alerts</h2><ul id="alerts"></ul></section>

<section><h2>Pipeline</h2>
<div class="figures">
 <div class="figure"><b id="queued-total">-</b><span>queued in all</span></div>
 <div class="figure"><b id="queued-normal">-</b><span>queued, normal priority</span></div>
 <div class="figure"><b id="queued-high">-</b><span>queued, high priority</span></div>
 <div class="figure"><b id="queued-lanes">-</b><span>queued in affinity lanes</span></div>
 <div class="figure"><b id="inflight-normal">-</b><span>in flight, normal</span></div>
 <div class="figure"><b id="inflight-high">-</b><span>in flight, high</span></div>
 <div class="figure"><b id="inflight-lanes">-</b><span>in flight, lanes</span></div>
 <div class="figure"><b id="rate-finished">-</b><span>finished / s</span></div>
 <div class="figure"><b id="rate-tokens">-</b><span>tokens / s</span></div>
 <div class="figure"><b id="rate-finished-1m">-</b><span>finished / s, 1 min (heartbeats)</span></div>
 <div class="figure"><b id="rate-tokens-1m">-</b><span>tokens / s, 1 min (heartbeats)</span></div>
 <div class="figure"><b id="results-length">-</b><span>records in results stream</span></div>
 <div class="figure"><b id="dead-count">-</b><span>dead letters</span></div>
 <div class="figure"><b id="workers-alive">-</b><span>workers alive</span></div>
 <div class="figure"><b id="workers-stale">-</b><span>workers stale</span></div>
</div>
<p class="sub">finished / s and tokens / s are differences between two status reads: each live worker's
counters of published records and of tokens (decoded so far where its engine counts them, else those of
published records), from its heartbeat, over the time between its two heartbeats.
The 1-minute figures are the workers' own averages of published records and their tokens.</p>
<div id="lanes-box" hidden><h2>Affinity lanes</h2><table id="lanes"><thead><tr><th>lane stream</th>
<th>queued</th><th>in flight</th><th>owner</th></tr></thead><tbody></tbody></table></div>
<div id="partitions-box" hidden><h2>Partitions</h2><table id="partitions"><thead><tr><th>partition</th>
<th>node</th><th>queued</th><th>in flight</th><th>results</th><th>dead letters</th></tr></thead><tbody></tbody></table></div>
<h2>Result consumer groups</h2>
<table id="groups"><thead><tr><th>group</th><th>consumers</th><th>pending</th><th>lag</th></tr></thead>
<tbody></tbody></table>
</section>

<section><h2>Workers</h2>
<table id="workers"><thead><tr><th>name</th><th>host</th><th>engine</th><th>model</th><th>state</th>
<th>weight version</th><th>in flight / capacity</th><th>tokens / s</th><th>last seen</th><th>lanes</th></tr></thead>
<tbody></tbody></table></section>

<section><h2>Weight versions</h2>
<p>desired: <b class="mono" id="weights-desired">-</b> <span class="sub" id="weights-path"></span>;
live workers on another version: <b id="weights-old">-</b></p>
<table id="versions"><thead><tr><th>weight version</th><th>live workers</th></tr></thead><tbody></tbody></table>
</section>

<section><h2>Dead letters</h2>
<p id="token-box" class="sub" hidden>bearer token for requeue and purge:
 <input id="token" type="password" size="36" autocomplete="off"></p>
<p id="actions-off" class="sub" hidden>requeue and purge are disabled on this dashboard
 (see redroll dashboard --allow-actions); use redroll dead requeue / purge.</p>
<p id="action-result" class="sub"></p><p id="dead-shown" class="sub"></p>
<table id="dead"><thead><tr><th>when</th><th>request id</th><th>source</th><th>deliveries</th><th>reason</th>
<th></th></tr></thead><tbody></tbody></table></section>

<section><h2>A request</h2>
<form id="lookup"><input id="lookup-id" size="40" placeholder="request id"> <button>look up</button></form>
<div id="timeline"></div></section>
"""

_SCRIPT = r"""
const CONFIG = JSON.parse(document.getElementById("config").textContent);
const $ = (id) => document.getElementById(id);
let previous = {};   // worker name -> {seen, published, tokens, finished_s, tokens_s}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c ?? "-")));
  return node;
}
function fill(tableId, rows) { $(tableId).querySelector("tbody").replaceChildren(...rows); }
function cell(col, value, extra) { return el("td", Object.assign({"data-col": col}, extra || {}), value); }
function fixed1(x) { return Number(x || 0).toFixed(1); }
function clock(unix) { return new Date(unix * 1000).toLocaleTimeString(); }
function workerState(w) { return w.alive ? String(w.state ?? "?") : "stale (last: " + String(w.state ?? "?") + ")"; }

function rates(status) {   // differences between this read and the previous one, per live worker
  const next = {};
  let finished = 0, tokens = 0;
  for (const w of status.workers) {
    const before = previous[w.name];
    const made = w.tokens_decoded ?? w.tokens;   // tokens decoded so far where the engine counts them
    let r = {seen: w.seen, published: w.published, tokens: made, finished_s: 0, tokens_s: 0};
    if (w.alive && before && w.seen > before.seen && w.published >= before.published && made >= before.tokens) {
      const dt = w.seen - before.seen;
      r.finished_s = (w.published - before.published) / dt;
      r.tokens_s = (made - before.tokens) / dt;
    } else if (w.alive && before && w.seen === before.seen) {   // no new heartbeat yet: keep the last rate
      r = before;
    }
    next[w.name] = r;
    if (w.alive) { finished += r.finished_s; tokens += r.tokens_s; }
  }
  previous = next;
  return {finished, tokens, per: next};
}

function renderStatus(s, desired) {
  $("snapshot-time").textContent = clock(s.time);
  $("snapshot-time").dataset.time = s.time;
  const lanes = s.lanes || {backlog: 0, pending: 0, per_lane: []};
  $("queued-total").textContent = s.queued_total;
  $("queued-normal").textContent = s.requests.backlog;
  $("queued-high").textContent = s.requests_high.backlog;
  $("queued-lanes").textContent = lanes.backlog;
  $("inflight-normal").textContent = s.requests.pending;
  $("inflight-high").textContent = s.requests_high.pending;
  $("inflight-lanes").textContent = lanes.pending || 0;
  $("results-length").textContent = s.results.length;
  $("dead-count").textContent = s.dead_letters;
  $("workers-alive").textContent = s.workers_alive;
  $("workers-stale").textContent = s.workers_stale;
  $("rate-finished-1m").textContent = fixed1(s.rates_1m.requests_per_s);
  $("rate-tokens-1m").textContent = fixed1(s.rates_1m.tokens_per_s);
  const r = rates(s);
  $("rate-finished").textContent = fixed1(r.finished);
  $("rate-tokens").textContent = fixed1(r.tokens);
  $("alerts").replaceChildren(...s.alerts.map((a) => el("li", {class: "alert"}, a)),
                              ...s.warnings.map((w) => el("li", {class: "warning"}, w)));
  fill("groups", s.results.groups.map((g) => el("tr", {"data-group": g.group}, cell("group", g.group),
    cell("consumers", g.consumers), cell("pending", g.pending), cell("lag", g.backlog))));
  $("lanes-box").hidden = !lanes.per_lane.length;
  fill("lanes", lanes.per_lane.map((l) => el("tr", {}, cell("stream", l.stream), cell("queued", l.backlog),
    cell("in_flight", l.pending), cell("owner", l.owner || "-"))));
  const partitions = s.partitions || [];
  $("partitions-box").hidden = !partitions.length;
  fill("partitions", partitions.map((p) => el("tr", {}, cell("tag", p.tag), cell("node", p.node || "-"),
    cell("queued", p.queued), cell("in_flight", p.in_flight), cell("results", p.results),
    cell("dead_letters", p.dead_letters))));
  const want = desired ? desired.weight_version : null;
  fill("workers", s.workers.map((w) => {
    const version = w.weight_version ?? "-";
    return el("tr", {"data-worker": w.name, class: w.alive ? "" : "stale"},
      cell("name", w.name), cell("host", w.host ?? "-"), cell("engine", w.engine ?? "-"), cell("model", w.model ?? "-"),
      cell("state", workerState(w)),
      cell("weight_version", version, {class: w.alive && want != null && String(version) !== want ? "old" : ""}),
      cell("inflight", (w.inflight ?? 0) + " / " + (w.max_inflight ?? "?")),
      cell("tokens_s", fixed1(r.per[w.name] ? r.per[w.name].tokens_s : 0)),
      cell("seen", Math.round(w.age_s) + " s ago", {"data-seen": w.seen ?? ""}),
      cell("lanes", (w.lanes || []).join(", ") || "-"));
  }));
  const counts = {};
  for (const w of s.workers) if (w.alive) { const v = String(w.weight_version ?? "-"); counts[v] = (counts[v] || 0) + 1; }
  $("weights-desired").textContent = want ?? "none set";
  $("weights-path").textContent = desired && desired.model_path ? "(" + desired.model_path + ")" : "";
  $("weights-old").textContent = want == null ? 0 :
    Object.entries(counts).filter(([v]) => v !== want).reduce((n, [, c]) => n + c, 0);
  fill("versions", Object.keys(counts).sort().map((v) => el("tr", {"data-version": v},
    cell("version", v, {class: want != null && v !== want ? "old" : ""}), cell("workers", counts[v]))));
}

let shownDead = null;
function renderDead(entries) {   // redrawn only when the entries change (a button about to be clicked stays)
  const key = JSON.stringify(entries.map((e) => [e.id, e.request_id, e.source, e.deliveries, e.reason]));
  if (key === shownDead) return;
  shownDead = key;
  fill("dead", entries.map((e) => {
    const actions = el("td", {});
    if (CONFIG.actions) {
      const requeue = el("button", {class: "requeue"}, "requeue");
      requeue.onclick = () => act("requeue", e);
      const purge = el("button", {class: "purge"}, "purge");
      purge.onclick = () => act("purge", e);
      actions.append(requeue, " ", purge);
    }
    const when = Number(e.id.split("-")[0]) / 1000;
    return el("tr", {"data-dead": e.id}, cell("when", clock(when), {title: e.id}), cell("request_id", e.request_id ?? "-"),
      cell("source", e.source), cell("deliveries", e.deliveries), cell("reason", e.reason), actions);
  }));
}

async function getJSON(path) {
  const response = await fetch(path, {cache: "no-store"});
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

let deadRead = {count: null, at: 0};
async function refresh(force) {
  try {
    const [status, weights] = await Promise.all([getJSON("/api/status"), getJSON("/api/weights")]);
    // The dead letters carry their requests: read again when their number changed, after an action,
    // and every 10 s, not on every refresh. (Everything is drawn once everything is read.)
    const dead = force === true || status.dead_letters !== deadRead.count || Date.now() - deadRead.at > 10000 ?
      await getJSON("/api/dead") : null;
    renderStatus(status, weights.desired);
    if (dead !== null) {
      deadRead = {count: status.dead_letters, at: Date.now()};
      renderDead(dead.entries);
      $("dead-shown").textContent = dead.entries.length < status.dead_letters ?
        "showing the oldest " + dead.entries.length + " of " + status.dead_letters : "";
    }
    $("connection").textContent = "live"; $("connection").className = "";
  } catch (err) {
    $("connection").textContent = "not updating: " + err.message; $("connection").className = "down";
  }
}

async function act(action, entry) {
  const what = action + " dead letter " + entry.id + " (request " + (entry.request_id ?? "-") + ")?";
  if (!window.confirm(what)) return;
  sessionStorage.setItem("redroll-token", $("token").value);
  const response = await fetch("/api/dead/" + action, {method: "POST",
    headers: {"Content-Type": "application/json", "Authorization": "Bearer " + $("token").value},
    body: JSON.stringify({ids: [entry.id]})});
  const body = await response.json();
  const out = $("action-result");
  if (!response.ok) out.textContent = action + " refused: " + body.error;
  else if (action === "requeue") out.textContent = "requeued " + body.requeued.length +
    (body.refused.length ? "; refused: " + body.refused.join("; ") : "");
  else out.textContent = "purged " + body.purged;
  await refresh(true);
}

async function lookup(event) {
  event.preventDefault();
  const id = $("lookup-id").value.trim();
  if (!id) return;
  const box = $("timeline");
  const response = await fetch("/api/request/" + encodeURIComponent(id), {cache: "no-store"});
  const body = await response.json();
  if (!response.ok) { box.replaceChildren(el("p", {class: "stale"}, body.error)); return; }
  const steps = Array.isArray(body.steps) ? body.steps : null;
  if (steps && steps.length) {
    const when = (at) => at == null ? "" : new Date(at * 1000).toISOString().slice(11, 23);
    box.replaceChildren(el("table", {}, el("thead", {}, el("tr", {}, ...["time (UTC)", "step", "what"].map((c) =>
      el("th", {}, c)))), el("tbody", {}, ...steps.map((s) =>
        el("tr", {}, el("td", {}, when(s.at)), el("td", {}, s.step), el("td", {}, s.what))))));
  } else {
    box.replaceChildren(el("p", {}, "no step of " + id + " is known"));
  }
  for (const gap of body.gaps || []) box.append(el("p", {class: "stale"}, "not in Redis: " + gap));
}

$("namespace").textContent = CONFIG.namespace;
$("interval").textContent = CONFIG.interval_ms / 1000;
$("token-box").hidden = !CONFIG.actions;
$("actions-off").hidden = CONFIG.actions;
$("token").value = sessionStorage.getItem("redroll-token") || "";
$("lookup").addEventListener("submit", lookup);
refresh();
let polling = false;   // one refresh at a time: a slow read is not overtaken by the next
setInterval(async () => {
  if (polling) return;
  polling = true;
  try { await refresh(); } finally { polling = false; }
}, CONFIG.interval_ms);
"""


def render_page(*, namespace: str, actions: bool, interval_ms: int) -> str:
    """The page for one pipeline: its frame, with the settings the script reads."""
    config = json.dumps({"namespace": namespace, "actions": actions, "interval_ms": interval_ms})
    config = config.replace("<", "\\u003c")  # (never ends the script element)
    return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>redroll {html.escape(namespace)}</title><style>{_STYLE}</style></head>\n<body>{_BODY}"
            f"<script type=\"application/json\" id=\"config\">{config}</script>\n<script>{_SCRIPT}</script>"
            f"</body></html>\n")
