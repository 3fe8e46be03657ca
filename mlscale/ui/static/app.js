// mlscale ui: one page, three views (runs, registry, serving), drawn from the UI's JSON API.
// Plain JavaScript, no build step; charts by Apache ECharts (static/echarts.min.js, see THIRD_PARTY_LICENSES.txt).
"use strict";

const view = document.getElementById("view");
const EVENT_COLORS = {
  kill: "#c62f2f", kill_in_step: "#c62f2f", hang: "#c62f2f", kill_during_checkpoint: "#c62f2f", error: "#8f1d1d",
  restart: "#c7831a", resume: "#1e8a4c", live_recovery: "#2f5bd3", replica_restart: "#c7831a",
  degraded: "#b38600", straggler: "#7b3fbf", bad_sample: "#6b6b6b",
};
const SPLIT = [["compute_ms", "compute", "#4c72b0"], ["comm_exposed_ms", "communication (exposed)", "#dd8452"],
  ["data_wait_ms", "data wait", "#55a868"], ["optimizer_ms", "optimizer", "#8172b3"]];
const POINTS = 600;
let page = { charts: [], timers: [], timeouts: [], sources: [], generation: 0 };  // released on leaving the view
let generation = 0;  // which view is current: work begun for an earlier one stops when it finds it left

// ---- small helpers ------------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;  // through the CSSOM: the page's CSP allows no style attribute
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
let fetchMs = 0;  // time this view spent waiting on the API (the rest of its load is drawing)
async function api(path) {
  const start = performance.now();
  const response = await fetch(path, { headers: { accept: "application/json" } });
  const body = await response.json().catch(() => ({ error: response.statusText }));
  fetchMs += performance.now() - start;
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}
function fmt(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value) && Math.abs(value) < 1e15) return value.toLocaleString("en-US");
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(2);
  return value.toLocaleString("en-US", { maximumFractionDigits: abs < 1 ? digits + 1 : digits });
}
function when(seconds) {
  if (!seconds) return "–";
  const date = new Date(seconds * 1000);
  return date.toISOString().replace("T", " ").slice(0, 19);
}
function badge(text, kind) { return el("span", { class: `badge ${String(kind || text).replace(/[^\w-]/g, "")}` }, String(text)); }
const kindName = (kind) => String(kind ?? "").replace(/_/g, " ");
function chart(id, cls = "") { return el("div", { id, class: `chart ${cls}` }); }
function draw(id, option) {
  const node = document.getElementById(id);
  if (!node) return null;
  let instance = echarts.getInstanceByDom(node);
  if (!instance) { instance = echarts.init(node, null, { renderer: "canvas" }); page.charts.push(instance); }
  instance.setOption(option, { notMerge: true });
  return instance;
}
function every(ms, fn) { const timer = setInterval(fn, ms); page.timers.push(timer); return timer; }
function later(ms, fn) { const timer = setTimeout(fn, ms); page.timeouts.push(timer); return timer; }
// A view's own work, run only while that view is current (a late answer for a view left is dropped).
class Left extends Error {}
function current(own) { if (own !== generation) throw new Left(); }
function leave() {
  for (const instance of page.charts) instance.dispose();
  for (const timer of page.timers) clearInterval(timer);
  for (const timer of page.timeouts) clearTimeout(timer);
  for (const source of page.sources) source.close();
  generation += 1;
  page = { charts: [], timers: [], timeouts: [], sources: [], generation };
}
// Polling that never overlaps itself: the next call is scheduled when the last one has finished.
function poll(ms, fn) {
  const own = generation;
  const tick = async () => {
    try { await fn(); } catch (error) { if (!(error instanceof Left)) console.warn(error); }
    if (own === generation) later(ms, tick);
  };
  later(ms, tick);
}
function failed(error) { view.replaceChildren(el("p", { class: "error" }, String(error.message || error))); }
window.addEventListener("resize", () => page.charts.forEach((c) => c.resize()));

// ---- routing ------------------------------------------------------------------------------------------
async function route() {
  leave();
  const hash = location.hash.slice(1) || "/runs";
  const at = hash.indexOf("?");
  const path = at < 0 ? hash : hash.slice(0, at);
  const params = new URLSearchParams(at < 0 ? "" : hash.slice(at + 1));
  const parts = path.split("/").filter(Boolean).map((part) => { try { return decodeURIComponent(part); } catch { return part; } });
  document.querySelectorAll("[data-nav]").forEach((a) => a.classList.toggle("active", a.dataset.nav === parts[0]));
  const start = performance.now();
  fetchMs = 0;
  try {
    if (parts[0] === "run") await runPage(parts.slice(1).join("/"), params);
    else if (parts[0] === "registry" && parts.length > 1) await modelPage(parts.slice(1).join("/"));
    else if (parts[0] === "registry") await registryPage();
    else if (parts[0] === "serving") await servingPage();
    else await runsPage();
    Object.assign(document.body.dataset, { fetchMs: fetchMs.toFixed(1), viewMs: (performance.now() - start).toFixed(1) });
    document.body.dataset.ready = hash;  // the view has drawn (browser tests and the benchmark wait for it)
  } catch (error) {
    if (error instanceof Left) return;  // another view was asked for meanwhile: it says when it is ready
    failed(error);
    document.body.dataset.ready = hash;
  }
}
window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", async () => {
  try {
    const info = await api("/api/info");
    document.getElementById("where").textContent = [info.runs && `runs: ${info.runs}`,
      info.registry && `registry: ${info.registry}`, info.servers.length && `${info.servers.length} server(s)`]
      .filter(Boolean).join(" · ");
  } catch (error) { /* the view says what failed */ }
  route();
});
const runHref = (id, params) => `#/run/${encodeURIComponent(id)}${params ? "?" + params : ""}`;

// ---- runs ---------------------------------------------------------------------------------------------
const RUN_COLUMNS = [["id", "run"], ["status", "status"], ["task", "task"], ["strategy", "strategy"],
  ["world", "world", true], ["steps", "steps", true], ["loss", "loss", true], ["samples_per_s", "samples/s", true],
  ["restarts", "restarts", true], ["started", "started"]];

async function runsPage() {
  let rows = await api("/api/runs");
  let sortKey = "started", descending = true, filter = "";
  const search = el("input", { type: "search", placeholder: "search runs (name, task, strategy, status)",
    "aria-label": "search runs", id: "run-search" });
  const body = el("tbody");
  const head = el("tr", {}, RUN_COLUMNS.map(([key, label, numeric]) => el("th", {
    class: `sortable${numeric ? " num" : ""}`, "data-key": key,
    onclick: () => { descending = sortKey === key ? !descending : numeric || key === "started"; sortKey = key; fill(); },
  }, label)));
  const count = el("span", { class: "muted" });
  function fill() {
    const words = filter.toLowerCase().split(/\s+/).filter(Boolean);
    const shown = rows.filter((r) => words.every((w) => [r.id, r.task, r.strategy, r.status].join(" ").toLowerCase().includes(w)));
    shown.sort((a, b) => {
      const x = a[sortKey], y = b[sortKey];
      const order = x === y ? 0 : x === null || x === undefined ? 1 : y === null || y === undefined ? -1
        : typeof x === "number" ? x - y : String(x).localeCompare(String(y));
      return descending ? -order : order;
    });
    head.querySelectorAll("th").forEach((th) => { th.dataset.sorted = th.dataset.key === sortKey ? (descending ? "desc" : "asc") : ""; });
    body.replaceChildren(...shown.map((r) => el("tr", { "data-run": r.id },
      el("td", {}, el("a", { href: runHref(r.id) }, r.id)), el("td", {}, badge(r.status), r.reason ? el("span", { class: "muted", "data-reason": "" }, ` ${r.reason}`) : null), el("td", {}, r.task),
      el("td", {}, r.strategy), el("td", { class: "num" }, fmt(r.world)),
      el("td", { class: "num" }, r.total_steps ? `${fmt(r.steps)} / ${fmt(r.total_steps)}` : fmt(r.steps)),
      el("td", { class: "num" }, fmt(r.loss, 4)), el("td", { class: "num" }, fmt(r.samples_per_s, 1)),
      el("td", { class: "num" }, fmt(r.restarts)), el("td", {}, when(r.started)))));
    count.textContent = `${shown.length} of ${rows.length} run(s)`;
  }
  search.addEventListener("input", () => { filter = search.value; fill(); });
  const table = el("table", { id: "runs-table" }, el("thead", {}, head), body);
  const empty = el("p", { class: "muted" }, "No run directories here yet (a run directory holds config.json).");
  const card = el("div", { class: "card" }, el("div", { class: "toolbar" }, search, count), rows.length ? table : empty);
  view.replaceChildren(el("h1", {}, "Runs"), card);
  fill();
  const own = generation;
  poll(5000, async () => {
    rows = await api("/api/runs").catch(() => rows);
    current(own);
    card.lastChild.replaceWith(rows.length ? table : empty);
    fill();
  });
}

// ---- one run ------------------------------------------------------------------------------------------
async function runPage(id, params) {
  const own = generation;
  const detail = await api(`/api/run?id=${encodeURIComponent(id)}`);
  current(own);
  const state = { id, detail, from: null, to: null, rank: "all", overlay: params.get("vs") || "", zoom: [0, 100],
    data: null, other: null, syncing: false, own, zoomTimer: null };
  const others = (await api("/api/runs")).filter((r) => r.id !== id);
  current(own);
  const rankChoice = el("select", { id: "rank-choice", "aria-label": "which rank's split",
    onchange: () => { state.rank = rankChoice.value; refetch(state); } },
    el("option", { value: "all" }, "mean over ranks"), detail.ranks.map((r) => el("option", { value: r }, `rank ${r}`)));
  const overlay = el("select", { id: "overlay-choice", "aria-label": "overlay another run",
    onchange: () => { location.hash = runHref(id, overlay.value ? `vs=${encodeURIComponent(overlay.value)}` : ""); } },
    el("option", { value: "" }, "overlay another run…"),
    others.map((r) => el("option", { value: r.id, selected: r.id === state.overlay }, r.id)));
  view.replaceChildren(
    el("h1", {}, `Run ${id} `, badge(detail.status)),
    detail.reason ? el("p", { class: "error", id: "run-reason" }, `This run cannot be read: ${detail.reason}`) : null,
    el("div", { class: "card" }, el("div", { class: "facts", id: "run-facts" }, facts(detail))),
    el("div", { class: "toolbar" }, overlay, el("span", { class: "muted", id: "resolution" })),
    el("div", { class: "grid" },
      el("div", { class: "card" }, el("h2", {}, "Loss and evaluation"), chart("chart-loss")),
      el("div", { class: "card" }, el("h2", {}, "Samples per second"), chart("chart-speed")),
      el("div", { class: "card" }, el("div", { class: "toolbar" }, el("h2", {}, "Where a step's time goes (ms)"), rankChoice),
        chart("chart-split")),
      el("div", { class: "card" }, el("h2", {}, "Each rank's step, mean over the range shown (ms)"), chart("chart-ranks")),
      el("div", { class: "card" }, el("h2", {}, "Stragglers: each rank's own work against the fastest rank's"),
        chart("chart-stragglers", "tall")),
      el("div", { class: "card" }, el("h2", {}, "Events"), eventsTable(detail.events))),
    el("div", { class: "grid", style: "margin-top:16px" },
      detail.memory.length ? el("div", { class: "card" }, el("h2", {}, "Memory per rank (MB)"), chart("chart-memory")) : null,
      detail.pipeline ? el("div", { class: "card" }, el("h2", {}, "Pipeline stages"), chart("chart-stages"),
        el("p", { class: "muted" }, `${detail.pipeline.schedule}, ${detail.pipeline.microbatches} microbatches, ideal bubble ${fmt(detail.pipeline.ideal_bubble * 100, 1)}%`)) : null),
    el("div", { class: "two", style: "margin-top:16px" },
      el("div", { class: "card" }, el("details", {}, el("summary", {}, "Configuration"), el("pre", { id: "run-config" }, JSON.stringify(detail.config, null, 2)))),
      el("div", { class: "card" }, el("details", {}, el("summary", {}, "Plan"), el("pre", { id: "run-plan" }, JSON.stringify(detail.plan, null, 2))))),
  );
  drawMemory(detail);
  drawStages(detail);
  await refetch(state);
  if (detail.status === "running") follow(state);
}

function facts(d) {
  const items = [["task", d.task], ["strategy", d.strategy], ["world", fmt(d.world)],
    ["steps", d.total_steps ? `${fmt(d.steps)} / ${fmt(d.total_steps)}` : fmt(d.steps)], ["loss", fmt(d.loss, 4)],
    ["samples/s", fmt(d.samples_per_s, 1)], ["restarts", fmt(d.restarts)], ["started", when(d.started)]];
  return items.map(([k, v]) => el("div", { "data-fact": k }, el("span", {}, k), el("b", {}, v ?? "–")));
}

function eventsTable(events) {
  if (!events.length) return el("p", { class: "muted", id: "events" }, "No failures, restarts, recoveries or stragglers.");
  return el("div", { style: "max-height:300px;overflow:auto" }, el("table", { class: "events", id: "events" },
    el("thead", {}, el("tr", {}, el("th", {}, "step"), el("th", {}, "what"), el("th", {}, ""))),
    el("tbody", {}, events.map((e) => el("tr", { "data-kind": e.kind, "data-step": e.step ?? "" },
      el("td", {}, e.step ?? "–"), el("td", {}, el("span", { class: "dot", style: `background:${EVENT_COLORS[e.kind] || "#888"}` }), kindName(e.kind)),
      el("td", { title: e.error || "" }, e.text))))));
}

// Lines at the events' steps, shaded spans where steps ran without every replica.
function eventMarks(events) {
  const lines = events.filter((e) => e.step !== null && e.step !== undefined && e.kind !== "degraded").map((e) => ({
    xAxis: e.step, name: e.kind, lineStyle: { color: EVENT_COLORS[e.kind] || "#888", type: e.kind === "straggler" ? "dotted" : "dashed" },
    label: { formatter: kindName(e.kind), position: "insideEndTop", color: EVENT_COLORS[e.kind] || "#888", fontSize: 10 } }));
  const areas = events.filter((e) => e.kind === "degraded").map((e) => [{ xAxis: e.step, itemStyle: { color: "rgba(179,134,0,0.12)" } }, { xAxis: e.until }]);
  return { markLine: { silent: true, symbol: "none", data: lines }, markArea: { silent: true, data: areas } };
}

function stepAxis(state) {
  const d = state.data;
  return { type: "value", name: "step", nameLocation: "middle", nameGap: 26,
    min: Math.min(d.first_step ?? 0, state.other?.first_step ?? Infinity),
    max: Math.max(d.last_step ?? 1, state.other?.last_step ?? 0), scale: true };
}
function zoomOf(state) {
  return [{ type: "inside", start: state.zoom[0], end: state.zoom[1], filterMode: "none" },
    { type: "slider", start: state.zoom[0], end: state.zoom[1], height: 16, bottom: 4, filterMode: "none" }];
}
const pairs = (xs, ys) => xs.map((x, i) => [x, ys[i]]);

async function refetch(state) {
  const q = new URLSearchParams({ id: state.id, points: POINTS, rank: state.rank });
  if (state.from !== null) q.set("from", state.from);
  if (state.to !== null) q.set("to", state.to);
  const data = await api(`/api/series?${q}`);
  let other = null;
  if (state.overlay) {
    const o = new URLSearchParams({ id: state.overlay, points: POINTS });
    if (state.from !== null) o.set("from", state.from);
    if (state.to !== null) o.set("to", state.to);
    other = await api(`/api/series?${o}`).catch(() => null);
  }
  current(state.own);  // the page was left meanwhile: nothing to draw
  state.data = data; state.other = other;
  drawSeries(state);
}

function drawSeries(state) {
  const d = state.data, other = state.other, marks = eventMarks(state.detail.events);
  const per = d.per_point > 1.0001 ? `down-sampled: ${fmt(d.per_point, 1)} records a point (means; stragglers: the highest); zoom in for every record`
    : `every record (${fmt(d.to - d.from)} of ${fmt(d.points_total)})`;
  document.getElementById("resolution").textContent = per;
  const grid = { left: 60, right: 24, top: 34, bottom: 56 };
  const evalKeys = [...new Set(d.eval.flatMap((e) => Object.keys(e).filter((k) => k !== "step")))];
  const loss = [{ name: `loss (${state.id})`, type: "line", showSymbol: d.steps.length < 60, data: pairs(d.steps, d.loss), ...marks }];
  for (const key of evalKeys) loss.push({ name: `eval ${key}`, type: "line", yAxisIndex: 1, data: d.eval.map((e) => [e.step, e[key]]) });
  if (other) loss.push({ name: `loss (${state.overlay})`, type: "line", showSymbol: false, lineStyle: { type: "dashed" }, data: pairs(other.steps, other.loss) });
  const lossChart = draw("chart-loss", { animation: false, grid, tooltip: { trigger: "axis" }, legend: { top: 0, type: "scroll" },
    xAxis: stepAxis(state), yAxis: [{ type: "value", name: "loss", scale: true }, { type: "value", name: "eval", scale: true, show: evalKeys.length > 0 }],
    dataZoom: zoomOf(state), series: loss });
  const speed = [{ name: `samples/s (${state.id})`, type: "line", showSymbol: d.steps.length < 60, data: pairs(d.steps, d.samples_per_s), ...marks }];
  if (other) speed.push({ name: `samples/s (${state.overlay})`, type: "line", showSymbol: false, lineStyle: { type: "dashed" }, data: pairs(other.steps, other.samples_per_s) });
  const speedChart = draw("chart-speed", { animation: false, grid, tooltip: { trigger: "axis" }, legend: { top: 0 },
    xAxis: stepAxis(state), yAxis: { type: "value", name: "samples/s" }, dataZoom: zoomOf(state), series: speed });
  const splitChart = draw("chart-split", { animation: false, grid, tooltip: { trigger: "axis" }, legend: { top: 0 },
    xAxis: stepAxis(state), yAxis: { type: "value", name: "ms" }, dataZoom: zoomOf(state),
    series: SPLIT.map(([key, name, color], i) => ({ name, type: "line", stack: "split", areaStyle: {}, showSymbol: false,
      color, data: pairs(d.steps, d.split[key]), ...(i === 0 ? marks : {}) })) });
  draw("chart-ranks", { animation: false, grid: { ...grid, bottom: 40 }, tooltip: { trigger: "axis" }, legend: { top: 0 },
    xAxis: { type: "category", name: "rank", nameLocation: "middle", nameGap: 26, data: d.ranks.map(String) },
    yAxis: { type: "value", name: "ms" },
    series: SPLIT.map(([key, name, color]) => ({ name, type: "bar", stack: "rank", color, data: d.rank_means[key] })) });
  drawHeat(state);
  for (const c of [lossChart, speedChart, splitChart]) {
    if (!c || c.__linked) continue;
    c.__linked = true;
    c.on("datazoom", () => zoomed(state, c));
  }
}

function drawHeat(state) {
  const d = state.data, cells = [];
  let high = 1.5;
  d.straggler.forEach((row, r) => row.forEach((score, i) => {
    if (score !== null) { cells.push([i, r, score]); high = Math.max(high, score); }
  }));
  const threshold = state.detail.report?.straggler_detection?.threshold ?? 1.5;
  const heatSteps = d.heat_steps, steps = heatSteps.map(String);
  const stepIndex = new Map(heatSteps.map((s, i) => [s, i]));
  const nearest = (step) => { let best = 0; heatSteps.forEach((s, i) => { if (Math.abs(s - step) < Math.abs(heatSteps[best] - step)) best = i; }); return best; };
  const lines = state.detail.events.filter((e) => ["kill", "kill_in_step", "hang", "restart", "live_recovery"].includes(e.kind) && e.step !== null
    && e.step >= (heatSteps[0] ?? 0) && e.step <= (heatSteps[heatSteps.length - 1] ?? 0))
    .map((e) => ({ xAxis: stepIndex.has(e.step) ? stepIndex.get(e.step) : nearest(e.step), lineStyle: { color: EVENT_COLORS[e.kind] }, label: { formatter: kindName(e.kind), position: "insideEndTop", color: EVENT_COLORS[e.kind], fontSize: 10 } }));
  draw("chart-stragglers", { animation: false, grid: { left: 60, right: 90, top: 16, bottom: 40 },
    tooltip: { formatter: (p) => `rank ${d.ranks[p.value[1]]}, step ${steps[p.value[0]]}: ${fmt(p.value[2], 2)}× the fastest` },
    xAxis: { type: "category", data: steps, name: "step", nameLocation: "middle", nameGap: 26 },
    yAxis: { type: "category", data: d.ranks.map((r) => `rank ${r}`), inverse: true },
    visualMap: { type: "continuous", min: 1, max: Math.max(high, threshold * 1.5), calculable: false, orient: "vertical", right: 0, top: "middle",
      text: ["slow", "even"], inRange: { color: ["#f3f6fb", "#f2c14e", "#c62f2f"] } },
    series: [{ name: "straggler score", type: "heatmap", data: cells, progressive: 0,
      markLine: { silent: true, symbol: "none", data: lines } }] });
}

function zoomed(state, source) {
  if (state.syncing) return;
  const option = source.getOption().dataZoom[0];
  state.zoom = [option.start, option.end];
  state.syncing = true;
  for (const id of ["chart-loss", "chart-speed", "chart-split"]) {
    const c = echarts.getInstanceByDom(document.getElementById(id));
    if (c && c !== source) c.dispatchAction({ type: "dataZoom", start: option.start, end: option.end });
  }
  state.syncing = false;
  clearTimeout(state.zoomTimer);
  state.zoomTimer = later(250, () => {
    const axis = stepAxis(state), first = axis.min, last = axis.max;  // the extent the percentages are of
    const whole = option.start <= 0 && option.end >= 100;
    state.from = whole ? null : Math.floor(first + (last - first) * option.start / 100);
    state.to = whole ? null : Math.ceil(first + (last - first) * option.end / 100);
    refetch(state).catch((error) => { if (!(error instanceof Left)) console.warn(error); });
  });
}

// A run in progress: its new records arrive as server-sent events and are added to the charts.
function follow(state) {
  const source = new EventSource(`/api/live?id=${encodeURIComponent(state.id)}&after=${state.data.lines}`);
  page.sources.push(source);
  let pending = false;
  source.addEventListener("reset", () => refetch(state).catch(() => {}));  // the records were read again
  source.addEventListener("rows", (message) => {
    const rows = JSON.parse(message.data);
    const d = state.data;
    const fullView = state.from === null && state.to === null && d.per_point <= 1.0001 && d.points_total < POINTS
      && d.heat_steps.length === d.steps.length;
    const newRank = rows.some((row) => Object.keys(row.per_rank).some((rank) => !d.ranks.includes(Number(rank))));
    if (!fullView || newRank) {  // down-sampled, zoomed in or a rank not seen yet: the range again (every 2 s at most)
      if (!pending) {
        pending = true;
        later(2000, () => { pending = false; refetch(state).catch(() => {}); });
      }
      return;
    }
    for (const row of rows) {
      while (d.steps.length && d.steps[d.steps.length - 1] >= row.step) {  // a resumed run redoes steps
        d.steps.pop(); d.loss.pop(); d.samples_per_s.pop();
        for (const key of Object.keys(d.split)) d.split[key].pop();
        for (const r of d.straggler) r.pop();
        d.heat_steps.pop();
      }
      d.steps.push(row.step); d.loss.push(row.loss); d.samples_per_s.push(row.samples_per_s);
      const ranks = Object.values(row.per_rank);
      for (const [key] of [...SPLIT, ["step_ms"]]) {
        const chosen = state.rank === "all" ? ranks : ranks.filter((_, i) => Object.keys(row.per_rank)[i] === state.rank);
        d.split[key].push(chosen.length ? chosen.reduce((a, r) => a + r[key], 0) / chosen.length : null);
      }
      d.ranks.forEach((rank, i) => { (d.straggler[i] ||= []).push(row.per_rank[rank]?.straggler_score ?? null); });
      d.heat_steps.push(row.step);
      for (const e of row.eval || []) d.eval.push(e);
      d.last_step = row.step;
      d.points_total += 1; d.to = d.points_total; d.lines = row.line + 1;
    }
    drawSeries(state);
    const last = rows[rows.length - 1], total = state.detail.total_steps;  // the facts follow the records
    const steps = document.querySelector("[data-fact=steps] b"), loss = document.querySelector("[data-fact=loss] b");
    if (steps) steps.textContent = total ? `${fmt(last.step)} / ${fmt(total)}` : fmt(last.step);
    if (loss && last.loss !== null) loss.textContent = fmt(last.loss, 4);
  });
  const status = every(3000, async () => {
    const detail = await api(`/api/run?id=${encodeURIComponent(state.id)}`).catch(() => null);
    if (!detail || state.own !== generation) return;
    state.detail = detail;
    document.getElementById("run-facts")?.replaceChildren(...facts(detail));
    const events = document.getElementById("events");
    if (events) events.closest(".card").replaceChildren(el("h2", {}, "Events"), eventsTable(detail.events));
    if (detail.status !== "running") { clearInterval(status); source.close(); refetch(state).catch(() => {}); }
  });
}

function drawMemory(detail) {
  if (!detail.memory.length) return;
  const keys = [...new Set(detail.memory.flatMap((m) => Object.keys(m).filter((k) => k.endsWith("_mb") && k !== "peak_mb" && k !== "state_mb")))];
  const series = keys.map((k) => ({ name: k.replace(/_mb$/, ""), type: "bar", stack: "state", data: detail.memory.map((m) => m[k] ?? 0) }));
  if (detail.memory.some((m) => m.peak_mb)) series.push({ name: "process peak (right)", type: "line", yAxisIndex: 1, data: detail.memory.map((m) => m.peak_mb ?? null) });
  draw("chart-memory", { animation: false, grid: { left: 60, right: 20, top: 34, bottom: 40 }, tooltip: { trigger: "axis" }, legend: { top: 0 },
    xAxis: { type: "category", data: detail.memory.map((m) => `rank ${m.rank}`) },
    yAxis: [{ type: "value", name: "training state MB" }, { type: "value", name: "peak MB" }], series });
}

function drawStages(detail) {
  const p = detail.pipeline;
  if (!p) return;
  const stageMs = (detail.report.per_rank || []).slice(0, p.stages);
  const series = [{ name: "parameters", type: "bar", data: p.stage_params }];
  if (stageMs.length === p.stages) series.push({ name: "step ms (p50, replica 0)", type: "line", yAxisIndex: 1, data: stageMs.map((r) => r.step_ms_p50) });
  draw("chart-stages", { animation: false, grid: { left: 70, right: 60, top: 34, bottom: 40 }, tooltip: { trigger: "axis" }, legend: { top: 0 },
    xAxis: { type: "category", data: p.stage_params.map((_, i) => `stage ${i}`) },
    yAxis: [{ type: "value", name: "parameters" }, { type: "value", name: "ms" }], series });
}

// ---- registry -----------------------------------------------------------------------------------------
async function registryPage() {
  const own = generation;
  const data = await api("/api/registry");
  current(own);
  if (!data.configured) {
    view.replaceChildren(el("h1", {}, "Registry"), el("p", { class: "muted" }, "No registry given: start the UI with --registry URL (or set $MLSCALE_REGISTRY)."));
    return;
  }
  view.replaceChildren(el("h1", {}, "Registry ", el("span", { class: "muted" }, data.location)), el("div", { class: "card" },
    el("table", { id: "models-table" }, el("thead", {}, el("tr", {}, ["model", "latest", "stages", "aliases", "updated"].map((h) => el("th", {}, h)))),
      el("tbody", {}, data.models.map((m) => el("tr", { "data-model": m.name },
        el("td", {}, el("a", { href: `#/registry/${encodeURIComponent(m.name)}` }, m.name)), el("td", {}, `v${m.latest_version}`),
        el("td", {}, Object.entries(m.stages).map(([stage, v]) => [badge(`${stage} v${v}`, stage), " "])),
        el("td", {}, Object.entries(m.aliases).map(([a, v]) => `@${a} → v${v}`).join(", ") || "–"),
        el("td", {}, (m.updated_at || "").slice(0, 19))))))));
}

async function modelPage(name) {
  const own = generation;
  const m = await api(`/api/registry/model?name=${encodeURIComponent(name)}`);
  current(own);
  view.replaceChildren(el("h1", {}, el("a", { href: "#/registry" }, "Registry"), ` / ${m.name}`),
    ...m.versions.map(versionCard),
    el("div", { class: "card" }, el("h2", {}, "History"), el("table", { id: "history-table" },
      el("thead", {}, el("tr", {}, ["at", "who", "version", "action", "from", "to"].map((h) => el("th", {}, h)))),
      el("tbody", {}, m.history.map((h) => el("tr", {}, el("td", {}, (h.at || "").slice(0, 23)), el("td", {}, h.who),
        el("td", {}, h.version ?? "–"), el("td", {}, h.action), el("td", {}, h.from_value ?? "–"), el("td", {}, h.to_value ?? "–")))))));
}

function versionCard(v) {
  const state = (v.source_run_state || "unknown").split(":")[0];
  const run = v.source_run_id ? el("a", { href: runHref(v.source_run_id), class: "source-run" }, v.source_run_id)
    : el("span", {}, v.source_run || "–");
  const onnx = v.artifacts.filter((a) => a.parity);
  const t = v.training;
  const rows = [
    ["source run", [run, " ", badge(state, state)]],
    ["training", `${t.task}, ${t.strategy}, ${t.workers} worker(s), batch ${t.batch_size}, lr ${t.lr}, seed ${t.seed}, ${t.dtype}`],
    ["metrics", Object.entries(v.metrics).flatMap(([k, x]) => typeof x === "number" ? [[k, x]]
      : x && typeof x === "object" ? Object.entries(x).filter(([, y]) => typeof y === "number").map(([j, y]) => [`${k} ${j}`, y]) : [])
      .map(([k, x]) => `${k} ${fmt(x, 4)}`).join(", ") || "–"],
    ["data", v.data_fingerprint || "–"],
    ["features", v.features ? `${v.features.service}: ${v.features.features.join(", ")}` : "–"],
    ["ONNX parity", onnx.length ? onnx.map((a) => `max abs ${fmt(a.parity.max_abs_err)} · max rel ${fmt(a.parity.max_rel_err)} (${a.parity.samples} inputs)`).join("; ") : "not exported"],
    ["code", v.code_version?.git_commit ? `git ${v.code_version.git_commit.slice(0, 12)}${v.code_version.git_dirty ? " (local changes)" : ""}` : `mlscale ${v.code_version?.mlscale || "?"}`],
    ["artifacts", v.artifacts.map((a) => `${a.name} (${fmt(a.size_bytes / 1e3, 0)} kB)`).join(", ")],
    ["created", `${(v.created_at || "").slice(0, 19)} by ${v.created_by}`],
  ];
  return el("div", { class: "card version", "data-version": v.version },
    el("h2", {}, `v${v.version} `, badge(v.stage), " ", v.aliases.map((a) => [badge(`@${a}`, "alias"), " "]), el("span", { class: "muted" }, v.description || "")),
    el("table", {}, el("tbody", {}, rows.map(([k, value]) => el("tr", { "data-field": k }, el("th", {}, k), el("td", { style: "white-space:normal" }, value))))));
}

// ---- serving ------------------------------------------------------------------------------------------
// The language models' table: token latencies (last interval), tokens/s, sequences, KV blocks, prefix cache.
function fillGeneration(card, lms) {
  card.querySelector(".generation").hidden = !lms.length;
  const pct = (x) => (x === null ? "–" : `${fmt(x * 100, 1)}%`);
  card.querySelector(".generation-table").replaceChildren(
    el("thead", {}, el("tr", {}, ["model", "version", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "TPOT p50 ms",
      "TPOT p99 ms", "tokens in/s", "tokens out/s", "running", "waiting", "preempted", "KV blocks", "KV used", "prefix hits"].map((h) => el("th", {}, h)))),
    el("tbody", {}, lms.map((v) => {
      const g = v.generation;
      return el("tr", { "data-version": `${v.model}/${v.version}` }, el("td", {}, v.model), el("td", {}, v.version),
        ...[fmt(g.ttft_ms.p50, 2), fmt(g.ttft_ms.p99, 2), fmt(g.itl_ms.p50, 2), fmt(g.itl_ms.p99, 2), fmt(g.tpot_ms.p50, 2),
          fmt(g.tpot_ms.p99, 2), fmt(g.prompt_tokens_per_s, 1), fmt(g.generated_tokens_per_s, 1), fmt(g.running), fmt(g.waiting),
          fmt(g.preemptions), `${fmt(g.kv_blocks_used)} / ${fmt(g.kv_blocks)}`, pct(g.kv_usage), pct(g.prefix_hit_rate)]
          .map((text) => el("td", { class: "num" }, text)));
    })));
}

async function servingPage() {
  view.replaceChildren(el("h1", {}, "Serving"), el("div", { id: "servers" }, el("p", { class: "muted" }, "Scraping…")));
  const box = document.getElementById("servers");
  let built = false;
  const own = generation;
  async function tick() {
    const servers = await api("/api/servers");
    current(own);
    if (!servers.length) {
      box.replaceChildren(el("p", { class: "muted" }, "No server given: start the UI with --server URL (one per server)."));
      return;
    }
    if (!built) { box.replaceChildren(...servers.map((s, i) => serverCard(s, i))); built = true; }
    servers.forEach((s, i) => fillServer(s, i));
  }
  await tick();
  poll(2000, tick);
}

function serverCard(s, i) {
  return el("div", { class: "card server", "data-server": i },
    el("h2", {}, s.url, " ", el("span", { class: "server-state" })),
    el("div", { class: "facts server-facts" }),
    el("div", { style: "overflow:auto" }, el("table", { class: "versions-table" })),
    el("div", { class: "generation", style: "overflow:auto", hidden: "" }, el("h2", {}, "Text generation"),
      el("table", { class: "generation-table" })),
    el("div", { class: "grid", style: "margin-top:12px" },
      el("div", {}, el("h2", {}, "Goodput and answers per second"), chart(`srv${i}-rate`, "short")),
      el("div", {}, el("h2", {}, "Latency in the server (ms)"), chart(`srv${i}-latency`, "short")),
      el("div", {}, el("h2", {}, "Batch sizes (last interval)"), chart(`srv${i}-batches`, "short")),
      el("div", {}, el("h2", {}, "Traffic per version (answers/s)"), chart(`srv${i}-traffic`, "short")),
      el("div", {}, el("h2", {}, "Queue depth"), chart(`srv${i}-queue`, "short")),
      el("div", {}, el("h2", {}, "Feature skew (training vs served)"), chart(`srv${i}-skew`, "short"))));
}

function fillServer(s, i) {
  const card = document.querySelector(`[data-server="${i}"]`);
  card.querySelector(".server-state").replaceChildren(s.up ? badge("up") : badge("down"), s.up ? "" : ` ${s.error}`);
  if (!s.up) return;
  const p = s.point;
  card.querySelector(".server-facts").replaceChildren(...[["goodput/s", fmt(p.goodput_per_s, 1)], [`p50 ms`, fmt(p.p50_ms, 2)],
    ["p99 ms", fmt(p.p99_ms, 2)], ["queue", fmt(p.queue)], ["failed/s", fmt(p.failed_per_s, 1)],
    ["SLO", `${fmt(s.slo_ms)} ms`]].map(([k, v]) => el("div", { "data-fact": k }, el("span", {}, k), el("b", {}, v))));
  card.querySelector(".versions-table").replaceChildren(
    el("thead", {}, el("tr", {}, ["model", "version", "role", "share %", "goodput/s", "answers/s", "failed/s", "p50 ms", "p90 ms", "p99 ms", "queue", "cache hits"].map((h) => el("th", {}, h)))),
    el("tbody", {}, s.versions.map((v) => el("tr", { "data-version": `${v.model}/${v.version}` },
      el("td", {}, v.model), el("td", {}, v.version), el("td", {}, v.role),
      el("td", { class: "num" }, v.share_percent ? fmt(v.share_percent, 1) : "–"),
      el("td", { class: "num" }, fmt(v.goodput_per_s, 1)), el("td", { class: "num" }, fmt(v.answered_per_s, 1)),
      el("td", { class: "num" }, fmt(v.failed_per_s, 1)), el("td", { class: "num" }, fmt(v.latency_ms.p50, 2)),
      el("td", { class: "num" }, fmt(v.latency_ms.p90, 2)), el("td", { class: "num" }, fmt(v.latency_ms.p99, 2)),
      el("td", { class: "num" }, fmt(v.queue)), el("td", { class: "num" }, v.cache_hit_rate === null ? "–" : `${fmt(v.cache_hit_rate * 100, 1)}%`)))));
  fillGeneration(card, s.versions.filter((v) => v.generation));
  const times = s.history.map((h) => new Date(h.at * 1000).toISOString().slice(11, 19));
  const small = { animation: false, grid: { left: 50, right: 16, top: 30, bottom: 28 }, tooltip: { trigger: "axis" }, legend: { top: 0 } };
  draw(`srv${i}-rate`, { ...small, xAxis: { type: "category", data: times }, yAxis: { type: "value" }, series: [
    { name: "goodput/s", type: "line", showSymbol: false, data: s.history.map((h) => h.goodput_per_s) },
    { name: "answers/s", type: "line", showSymbol: false, data: s.history.map((h) => h.answered_per_s) },
    { name: "failed/s", type: "line", showSymbol: false, data: s.history.map((h) => h.failed_per_s) }] });
  draw(`srv${i}-latency`, { ...small, xAxis: { type: "category", data: times }, yAxis: { type: "value", name: "ms" }, series: [
    { name: "p50", type: "line", showSymbol: false, data: s.history.map((h) => h.p50_ms) },
    { name: "p99", type: "line", showSymbol: false, data: s.history.map((h) => h.p99_ms) }] });
  draw(`srv${i}-queue`, { ...small, xAxis: { type: "category", data: times }, yAxis: { type: "value", minInterval: 1 }, series: [
    { name: "requests waiting", type: "line", showSymbol: false, step: "end", data: s.history.map((h) => h.queue) }] });
  const sizes = [...new Set(s.versions.flatMap((v) => v.batch_sizes.map((b) => b.le)))].sort((a, b) => Number(a) - Number(b));
  draw(`srv${i}-batches`, { ...small, xAxis: { type: "category", name: "rows ≤", data: sizes }, yAxis: { type: "value", name: "batches" },
    series: s.versions.map((v) => ({ name: `${v.model} v${v.version}`, type: "bar", data: sizes.map((le) => v.batch_sizes.find((b) => b.le === le)?.count ?? 0) })) });
  draw(`srv${i}-traffic`, { ...small, xAxis: { type: "category", data: s.versions.map((v) => `${v.model} v${v.version} (${v.role})`) }, yAxis: { type: "value" },
    series: [{ name: "answers/s", type: "bar", data: s.versions.map((v) => v.answered_per_s ?? 0) }] });
  const features = [...new Set(s.versions.flatMap((v) => Object.keys(v.skew)))];
  const skewBox = document.getElementById(`srv${i}-skew`);
  skewBox.dataset.empty = features.length ? "" : "no feature model served here (skew is measured for models trained on a feature service)";
  draw(`srv${i}-skew`, { ...small, xAxis: { type: "category", data: features }, yAxis: { type: "value", name: "distance" },
    series: s.versions.filter((v) => Object.keys(v.skew).length).map((v) => ({ name: `${v.model} v${v.version}`, type: "bar", data: features.map((f) => v.skew[f] ?? null) })) });
}
