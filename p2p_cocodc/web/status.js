// The bootstrap's status page: a chart per metric with a line per peer (from /history) and a table
// of the run's peers (from /status), polled every few seconds. Every string shown was written by an
// untrusted peer: it enters the page as text or an attribute value, never as HTML.
"use strict";

const POLL_MS = 3000;
const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 480, HEIGHT = 200, LEFT = 58, RIGHT = 8, TOP = 8, BOTTOM = 22;
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const CHARTS = [
  { metric: "val_ppl", title: "validation perplexity of θ̄ (log scale)", log: true, digits: 2 },
  { metric: "tokens_per_s", title: "tokens/s", digits: 0 },
  { metric: "bytes_sent", title: "MB sent", scale: 1e-6, digits: 2 },
  { metric: "bytes_received", title: "MB received", scale: 1e-6, digits: 2 },
  { metric: "stall_s", title: "stall (s)", digits: 1 },
];
const COLUMNS = ["region", "state", "health", "step", "tokens/s", "val ppl", "fragment versions",
  "last round", "MB in", "MB out", "stall", "peer"];
const TEXT_COLUMNS = ["region", "state", "health", "peer"];

let chosenRun = null;

function element(tag, attributes = {}, text = null, namespace = null) {
  const node = namespace ? document.createElementNS(namespace, tag) : document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  if (text !== null) node.textContent = text;
  return node;
}

function svgElement(tag, attributes = {}, text = null) {
  return element(tag, attributes, text, SVG);
}

function clock(seconds) {
  return new Date(seconds * 1000).toTimeString().slice(0, 8);
}

function fixed(value, digits) {
  return Number(value).toFixed(digits);
}

function setUp() {
  const charts = document.getElementById("charts");
  for (const chart of CHARTS) {
    const figure = element("figure", { class: "chart", "data-metric": chart.metric });
    figure.append(element("figcaption", {}, chart.title));
    figure.append(svgElement("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img" }));
    figure.append(element("ul", { class: "legend" }));
    charts.append(figure);
  }
  const head = document.querySelector("#peers thead tr");
  for (const name of COLUMNS) {
    head.append(element("th", TEXT_COLUMNS.includes(name) ? { class: "text" } : {}, name));
  }
  document.getElementById("run").addEventListener("change", (event) => {
    chosenRun = event.target.value;
    poll(false);
  });
}

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

// The runs to choose from: the live ones first, then those only the history remembers.
function listRuns(status, history) {
  const live = Object.keys(status.runs).sort();
  const past = Object.keys(history.runs).filter((run) => !live.includes(run)).sort();
  const runs = [...live, ...past];
  if (!runs.includes(chosenRun)) chosenRun = runs.length ? runs[0] : null;
  const select = document.getElementById("run");
  if ([...select.options].map((option) => option.value).join("\n") !== runs.join("\n")) {
    select.replaceChildren(...runs.map((run) => element("option", { value: run }, run))); // closes it
  }
  if (chosenRun !== null) select.value = chosenRun;
}

// A peer keeps its colour while its run's set of peers stays the same: peers sorted by id.
function peerColors(peers) {
  return new Map(peers.map((peer, i) => [peer, COLORS[i % COLORS.length]]));
}

function drawChart(figure, chart, series, colors, fields) {
  const index = fields.indexOf(chart.metric);
  const time = fields.indexOf("t");
  const scale = chart.scale || 1;
  const lines = [];
  for (const [peer, { region, points }] of series) {
    const kept = points
      .filter((p) => p[index] !== null && (!chart.log || p[index] > 0))
      .map((p) => [p[time], p[index] * scale]);
    if (kept.length) lines.push({ peer, region, points: kept });
  }
  const svg = figure.querySelector("svg");
  const legend = figure.querySelector("ul");
  svg.replaceChildren(svgElement("rect", {
    class: "frame", x: LEFT, y: TOP, width: WIDTH - LEFT - RIGHT, height: HEIGHT - TOP - BOTTOM,
  }));
  legend.replaceChildren();
  if (!lines.length) {
    svg.append(svgElement("text", { x: LEFT + 10, y: HEIGHT / 2 }, "no values yet"));
    return;
  }
  const y = (v) => (chart.log ? Math.log10(v) : v);
  const all = lines.flatMap((line) => line.points);
  let [t0, t1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [v0, v1] = [Math.min(...all.map((p) => y(p[1]))), Math.max(...all.map((p) => y(p[1])))];
  if (t1 === t0) t1 = t0 + 1;
  if (v1 === v0) [v0, v1] = [v0 - 0.5, v1 + 0.5];
  const px = (t) => LEFT + ((t - t0) / (t1 - t0)) * (WIDTH - LEFT - RIGHT);
  const py = (v) => HEIGHT - BOTTOM - ((y(v) - v0) / (v1 - v0)) * (HEIGHT - TOP - BOTTOM);
  for (const fraction of [0, 0.5, 1]) {
    const level = v0 + fraction * (v1 - v0);
    const value = chart.log ? 10 ** level : level;
    const top = HEIGHT - BOTTOM - fraction * (HEIGHT - TOP - BOTTOM);
    const label = { x: LEFT - 4, y: top + 4, "text-anchor": "end" };
    svg.append(svgElement("text", label, fixed(value, chart.digits)));
  }
  svg.append(svgElement("text", { x: LEFT, y: HEIGHT - 6 }, clock(t0)));
  svg.append(svgElement("text", { x: WIDTH - RIGHT, y: HEIGHT - 6, "text-anchor": "end" }, clock(t1)));
  for (const line of lines) {
    const d = line.points.map(([t, v], i) => `${i ? "L" : "M"}${px(t).toFixed(1)},${py(v).toFixed(1)}`);
    const path = svgElement("path", {
      class: "series", d: d.join(""), stroke: colors.get(line.peer),
      "data-peer": line.peer, "data-region": line.region,
    });
    path.append(svgElement("title", {}, line.region));
    const [tLast, latest] = line.points[line.points.length - 1];
    const dot = svgElement("circle", {
      cx: px(tLast).toFixed(1), cy: py(latest).toFixed(1), r: 2.5, fill: colors.get(line.peer),
    });
    svg.append(path, dot);
    const item = element("li", {
      "data-peer": line.peer, "data-region": line.region, "data-value": fixed(latest, chart.digits),
    });
    const swatch = element("span", { class: "swatch" });
    swatch.style.background = colors.get(line.peer); // CSSOM: the policy refuses inline style attributes
    item.append(swatch);
    item.append(document.createTextNode(`${line.region}: ${fixed(latest, chart.digits)}`));
    legend.append(item);
  }
}

function cell(text, className = null) {
  return element("td", className ? { class: className } : {}, text);
}

function fillTable(peers) {
  const rows = Object.entries(peers)
    .sort(([a, x], [b, y]) => (x.region || a).localeCompare(y.region || b))
    .map(([peer, r]) => {
      const row = element("tr", { "data-peer": peer });
      const words = r.health.length ? r.health.join(", ") : "ok";
      const versions = r.versions.slice(0, 8).join(" ") + (r.versions.length > 8 ? " …" : "");
      row.append(
        cell(r.region || peer.slice(0, 12), "text"),
        cell(r.state, "text"),
        cell(words, r.health.length ? "text bad" : "text"),
        cell(String(r.step)),
        cell(fixed(r.tokens_per_s, 0)),
        cell(r.val_ppl >= 0 ? fixed(r.val_ppl, 2) : "–"),
        cell(versions),
        cell(r.last_round_s >= 0 ? `${fixed(r.last_round_s, 1)} s` : "–"),
        cell(fixed(r.bytes_received / 1e6, 2)),
        cell(fixed(r.bytes_sent / 1e6, 2)),
        cell(`${fixed(r.stall_s, 1)} s`),
        cell(peer.slice(0, 12), "text"),
      );
      return row;
    });
  document.querySelector("#peers tbody").replaceChildren(...rows);
}

function render(status, history) {
  listRuns(status, history);
  const run = chosenRun;
  const series = Object.entries((run !== null && history.runs[run]) || {});
  series.sort(([a], [b]) => a.localeCompare(b));
  const colors = peerColors(series.map(([peer]) => peer));
  for (const chart of CHARTS) {
    const figure = document.querySelector(`figure[data-metric="${chart.metric}"]`);
    drawChart(figure, chart, series, colors, history.fields);
  }
  fillTable(run !== null && status.runs[run] ? status.runs[run].peers : {});
  const updated = status.updated_at ? `board read at ${clock(status.updated_at)}` : "board not read yet";
  document.getElementById("updated").textContent = updated;
  showError(status.error ? `the bootstrap cannot read the board: ${status.error}` : "");
}

function showError(text) {
  const line = document.getElementById("error");
  line.textContent = text;
  line.hidden = !text;
}

async function poll(again = true) {
  try {
    const [status, history] = await Promise.all([getJSON("status"), getJSON("history")]);
    render(status, history);
  } catch (error) {
    showError(`the bootstrap does not answer (${error.message}); showing what it said last`);
  }
  if (again) setTimeout(poll, POLL_MS);
}

setUp();
poll();
