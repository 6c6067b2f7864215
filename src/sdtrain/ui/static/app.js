// The sdtrain UI page: four views over the JSON API (/api/...), which it uses for everything it shows and does.
// No build step and no framework: what a user reads comes from the API as text (textContent), never as markup.
"use strict";

const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f",
                 "#ff9da7", "#bab0ac"];
const main = document.getElementById("main");
// What the current view started (timers, event streams, charts), undone when the view changes.
let cleanups = [];

// ------------------------------------------------------------------------------------------------- helpers

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "on") for (const [event, fn] of Object.entries(value)) el.addEventListener(event, fn);
    else if (key === "class") el.className = value;
    else if (value !== null && value !== undefined && value !== false) el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function fill(el, ...children) {
  // replaceChildren writes a null as the text "null": leave the gaps out.
  el.replaceChildren(...children.flat().filter(c => c !== null && c !== undefined && c !== false));
}

async function api(path, body) {
  const options = body === undefined ? {} :
    {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const response = await fetch(path, options);
  let data = null;
  try { data = await response.json(); } catch (e) { data = null; }
  if (!response.ok) {
    const error = new Error((data && data.error) || `${response.status} ${response.statusText}`);
    error.data = data;
    throw error;
  }
  return data;
}

function banner(message, kind) {
  const el = document.getElementById("banner");
  el.hidden = !message;
  el.className = kind || "";
  el.textContent = message || "";
}

function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return value.toLocaleString();
  return Number(value.toPrecision(digits)).toString();
}

function bytes(n) {
  if (!n) return "";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n < 10 && i ? 1 : 0)} ${units[i]}`;
}

function ago(seconds) {
  if (!seconds) return "";
  const s = Date.now() / 1000 - seconds;
  if (s < 60) return "just now";
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return new Date(seconds * 1000).toLocaleDateString();
}

function runLink(id) { return "#/run/" + id.split("/").map(encodeURIComponent).join("/"); }

function every(ms, fn) {
  const timer = setInterval(fn, ms);
  cleanups.push(() => clearInterval(timer));
}

// ------------------------------------------------------------------------------------------------- charts

// A uPlot chart of series fetched from the API; a drag zooms and asks the server for that range at full
// resolution, a double click goes back to the whole run.
class Chart {
  constructor(parent, title, fetchSeries) {
    this.fetchSeries = fetchSeries;
    this.box = h("div", {class: "chart"}, h("div", {class: "title"}, title));
    this.body = h("div", {}, h("div", {class: "empty"}, "loading…"));
    this.box.append(this.body);
    parent.append(this.box);
    this.plot = null;
    this.zoomed = null;
    this.box.addEventListener("dblclick", () => { this.zoomed = null; this.load(); });
    const onResize = () => this.plot && this.plot.setSize(this.size());
    window.addEventListener("resize", onResize);
    cleanups.push(() => { window.removeEventListener("resize", onResize); if (this.plot) this.plot.destroy(); });
  }

  size() { return {width: Math.max(this.box.clientWidth - 16, 200), height: 220}; }

  async load() {
    const range = this.zoomed || [null, null];
    const series = (await this.fetchSeries(range[0], range[1])).filter(s => s.x.length);
    if (!series.length) {
      if (this.plot) { this.plot.destroy(); this.plot = null; }
      this.body.replaceChildren(h("div", {class: "empty"}, "nothing logged yet"));
      return;
    }
    const data = uPlot.join(series.map(s => [s.x, s.y]));
    const labels = series.map(s => s.label).join("\u0000");
    if (this.plot && this.labels === labels) {
      this.plot.setData(data, !this.zoomed);
      if (this.zoomed) this.plot.setScale("x", {min: this.zoomed[0], max: this.zoomed[1]});
      return;
    }
    if (this.plot) this.plot.destroy();
    this.labels = labels;
    this.body.replaceChildren();
    this.plot = new uPlot(this.options(series), data, this.body);
  }

  options(series) {
    return {
      ...this.size(),
      scales: {x: {time: false}},
      legend: {live: true},
      cursor: {drag: {x: true, y: false}},
      series: [{label: series.xLabel || "step"},
               ...series.map((s, i) => ({label: s.label, stroke: s.color || PALETTE[i % PALETTE.length],
                                         width: 1.5, spanGaps: true, points: {show: false}}))],
      hooks: {setSelect: [u => {
        if (u.select.width < 5) return;
        this.zoomed = [u.posToVal(u.select.left, "x"), u.posToVal(u.select.left + u.select.width, "x")];
        this.load();
      }]},
    };
  }
}

function metricsUrl(id, keys, by, lo, hi) {
  const query = new URLSearchParams({keys: keys.join(","), by});
  if (lo !== null) { query.set("from", lo); query.set("to", hi); }
  return `/api/runs/${id}/metrics?${query}`;
}

const GROUPS = [
  ["Loss", k => k.includes("loss") || k === "reconstruction" || k === "kl"],
  ["Learning rate", k => k === "lr" || k.startsWith("lr_")],
  ["Throughput (images/s)", k => k.endsWith("_per_s")],
];

// ------------------------------------------------------------------------------------------------- runs

async function runsPage() {
  const filter = h("input", {type: "search", placeholder: "filter: name, family, mode, status", size: 40});
  const compare = h("button", {disabled: true}, "Compare selected");
  const table = h("table", {id: "runs"});
  main.replaceChildren(h("h1", {}, "Runs"), h("div", {class: "toolbar"}, filter, compare,
    h("a", {href: "#/start"}, "Start a run")), table);
  const selected = new Set();
  let rows = [];
  const render = () => {
    const words = filter.value.toLowerCase().split(/\s+/).filter(Boolean);
    const shown = rows.filter(r => words.every(w =>
      [r.id, r.family, r.mode, r.status, r.stage].some(v => v && String(v).toLowerCase().includes(w))));
    const head = h("tr", {}, h("th", {}, ""), ...["run", "family", "mode", "status"].map(t => h("th", {}, t)),
      ...["step", "loss", "img/s", "last save", "disk"].map(t => h("th", {class: "num"}, t)));
    table.replaceChildren(head, ...shown.map(r => {
      const box = h("input", {type: "checkbox", checked: selected.has(r.id), on: {change: () => {
        box.checked ? selected.add(r.id) : selected.delete(r.id);
        compare.disabled = selected.size < 2;
      }}});
      return h("tr", {"data-run": r.id},
        h("td", {}, box),
        h("td", {}, h("a", {href: runLink(r.id)}, r.id), r.problem ? h("div", {class: "problem"}, r.problem) : null),
        h("td", {}, r.family || ""), h("td", {}, r.mode || r.stage || ""),
        h("td", {}, h("span", {class: "status " + r.status}, r.status)),
        h("td", {class: "num"}, r.step === null ? "" : `${fmt(r.step)}${r.max_steps ? " / " + fmt(r.max_steps) : ""}`),
        h("td", {class: "num"}, fmt(r.loss)), h("td", {class: "num"}, fmt(r.images_per_second, 3)),
        h("td", {class: "num"}, ago(r.last_save)), h("td", {class: "num"}, bytes(r.disk_bytes)));
    }));
  };
  compare.addEventListener("click", () => { location.hash = "#/compare/" + [...selected].join(","); });
  filter.addEventListener("input", render);
  const refresh = async () => {
    try {
      const data = await api("/api/runs");
      document.getElementById("root").textContent = data.root;
      rows = data.runs;
      render();
    } catch (e) { banner(e.message); }
  };
  await refresh();
  every(5000, refresh);
}

// ------------------------------------------------------------------------------------------------- a run

function actionButton(id, label, path, confirmText, then) {
  return h("button", {on: {click: async () => {
    if (confirmText && !confirm(confirmText)) return;
    try {
      const result = await api(`/api/runs/${id}/${path}`, {});
      banner(`${label}: ${result.stopping ? "stopping after a save" : result.cancelled ? "taken off the queue" :
        result.out ? "exporting to " + result.out : "queued"}`, "info");
      then();
    } catch (e) { banner(e.message); }
  }}}, label);
}

function drawRunHead(head, actions, id, state, refresh) {
  const s = state.summary;
  fill(head, h("h1", {}, id, " ", h("span", {class: "status " + s.status, id: "status"}, s.status)),
    h("div", {class: "muted", id: "facts"}, [s.family, s.mode || s.stage, s.step !== null ? `step ${fmt(s.step)}${s.max_steps ?
      " of " + fmt(s.max_steps) : ""}` : null, s.loss !== null ? `loss ${fmt(s.loss)}` : null,
      s.images_per_second ? `${fmt(s.images_per_second, 3)} img/s` : null, s.last_save ? `saved ${ago(s.last_save)}` : null,
      bytes(s.disk_bytes)].filter(Boolean).join(" · ")),
    s.problem ? h("div", {class: "problem"}, s.problem) : null,
    s.job && s.job.message ? h("div", {class: s.job.state === "failed" ? "problem" : "muted"},
      `${s.job.kind} ${s.job.state}: ${s.job.message}`) : null);
  const live = ["running", "starting", "queued"].includes(s.status);
  fill(actions, live ? actionButton(id, "Stop", "stop", "Stop this run after a save?", refresh) : null,
    !live && state.resumable && s.status !== "finished" ? actionButton(id, "Resume", "resume", null, refresh) : null,
    state.checkpoints.length ? actionButton(id, "Export", "export", null, refresh) : null,
    h("a", {href: "#/compare/" + id}, "Compare with…"));
}

function drawRunImages(images, samples) {
  if (!samples.length) { fill(images, h("div", {class: "muted"}, "none yet")); return; }
  const img = h("img", {alt: "validation images", src: samples[0].url});
  const caption = h("figcaption", {}, `step ${fmt(samples[0].step)}`);
  const slider = h("input", {type: "range", min: 0, max: samples.length - 1, value: 0, on: {input: () => {
    img.src = samples[slider.value].url;
    caption.textContent = `step ${fmt(samples[slider.value].step)}`;
  }}});
  fill(images, h("div", {class: "toolbar"}, "newest", slider, "oldest"),
    h("div", {class: "images"}, h("figure", {}, img, caption)));
}

function drawCheckpoints(el, checkpoints) {
  fill(el, checkpoints.length ? h("table", {}, checkpoints.slice().reverse().map(c =>
    h("tr", {}, h("td", {}, c.name), h("td", {}, c.files.filter(f => f.weights || c.files.length < 8).map(f =>
      h("div", {}, h("a", {href: f.url + "?download"}, f.path), " ", h("span", {class: "muted"}, bytes(f.size)))))))) :
    h("div", {class: "muted"}, "none yet"));
}

function drawRunCharts(charts, id, keys, by) {
  charts.replaceChildren();
  const groups = GROUPS.map(([title, match]) => [title, keys.filter(match)]).filter(([, ks]) => ks.length);
  if (!groups.length) charts.append(h("div", {class: "muted"}, "no metrics logged yet"));
  return groups.map(([title, ks]) => {
    const chart = new Chart(charts, title, async (lo, hi) => {
      const data = await api(metricsUrl(id, ks, by, lo, hi));
      const series = ks.map(k => ({label: k, ...data.series[k]})).filter(s => s.x);
      series.xLabel = by;
      return series;
    });
    chart.load().catch(e => banner(e.message));
    return chart;
  });
}

async function runPage(id) {
  let state = await api(`/api/runs/${id}`);
  const [head, actions, charts, images, checkpoints] = [0, 0, 0, 0, 0].map(() => h("div", {}));
  charts.className = "charts";
  const by = h("select", {}, h("option", {value: "step"}, "by step"), h("option", {value: "samples"}, "by samples seen"));
  const log = h("pre", {id: "log"});
  const environment = h("div", {}, h("button", {on: {click: async () => {
    const env = await api("/api/environment");
    fill(environment, h("table", {}, env.environment.map(([k, v]) => h("tr", {}, h("th", {}, k), h("td", {}, v)))));
  }}}, "Show the environment"));
  const preview = h("div", {id: "preview-result"});
  const data = h("div", {}, h("button", {id: "preview-data", on: {click: () =>
    previewData(preview, () => ({}), `/api/runs/${id}/preview`)}}, "Preview data"), preview);
  actions.className = "toolbar";
  main.replaceChildren(head, actions, h("h2", {}, "Curves ", by), charts,
    h("h2", {}, "Validation images"), images, h("h2", {}, "Checkpoints"), checkpoints,
    h("h2", {}, "Log"), log, h("h2", {}, "Config"), h("pre", {id: "config"}, state.config_text || "(no config yet)"),
    h("h2", {}, "Data, as training receives it"), data, h("h2", {}, "Environment"), environment);
  let chartList = [];
  const draw = () => {
    drawRunHead(head, actions, id, state, refresh);
    drawRunImages(images, state.samples);
    drawCheckpoints(checkpoints, state.checkpoints);
    log.textContent = (state.log.length ? state.log : state.child_log).join("\n") || "(no log yet)";
    log.scrollTop = log.scrollHeight;
  };
  const refresh = async () => {
    try {
      const keys = state.metric_keys.join();
      state = await api(`/api/runs/${id}`);
      draw();
      if (keys !== state.metric_keys.join()) chartList = drawRunCharts(charts, id, state.metric_keys, by.value);
      else chartList.forEach(c => c.load());
    } catch (e) { banner(e.message); }
  };
  by.addEventListener("change", () => { chartList = drawRunCharts(charts, id, state.metric_keys, by.value); });
  draw();
  chartList = drawRunCharts(charts, id, state.metric_keys, by.value);
  // Live: the summary as it changes (a new step reloads curves and images), each event as it happens.
  const stream = new EventSource(`/api/runs/${id}/events`);
  let lastStep = state.summary.step;
  stream.addEventListener("summary", e => {
    state.summary = JSON.parse(e.data);
    drawRunHead(head, actions, id, state, refresh);
    if (state.summary.step !== lastStep) { lastStep = state.summary.step; refresh(); }
  });
  stream.addEventListener("run", e => { if (JSON.parse(e.data).event !== "start") refresh(); });
  cleanups.push(() => stream.close());
}

// ------------------------------------------------------------------------------------------------- compare

async function comparePage(ids) {
  if (ids.length < 2) {
    const all = (await api("/api/runs")).runs.filter(r => !ids.includes(r.id));
    main.replaceChildren(h("h1", {}, "Compare"), h("p", {}, "Pick runs to compare with ", ids.join(", ") || "nothing", ":"),
      h("ul", {}, all.map(r => h("li", {}, h("a", {href: "#/compare/" + [...ids, r.id].join(",")}, r.id)))));
    return;
  }
  const data = await api(`/api/compare?runs=${ids.map(encodeURIComponent).join(",")}`);
  const keys = new Set();
  // Each run's metric names, with as few points as the API gives: the curves come once a metric is chosen.
  const named = await Promise.all(ids.map(id => api(metricsUrl(id, ["loss"], "step", null, null) + "&points=10")
    .catch(() => ({keys: []}))));
  named.forEach(d => d.keys.forEach(k => keys.add(k)));
  const key = h("select", {}, [...keys].map(k => h("option", {value: k, selected: k === "loss"}, k)));
  const by = h("select", {}, h("option", {value: "step"}, "by step"), h("option", {value: "samples"}, "by samples seen"));
  const charts = h("div", {class: "charts", style: "grid-template-columns: 1fr"});
  const step = h("select", {}, data.common_sample_steps.slice().reverse().map(s => h("option", {value: s}, `step ${fmt(s)}`)));
  const images = h("div", {class: "images"});
  main.replaceChildren(h("h1", {}, "Compare ", ids.join(" · ")),
    h("table", {}, data.runs.map((r, i) => h("tr", {}, h("td", {}, h("span", {style: `color:${PALETTE[i % PALETTE.length]}`}, "■")),
      h("td", {}, h("a", {href: runLink(r.id)}, r.id)), h("td", {}, h("span", {class: "status " + r.status}, r.status)),
      h("td", {class: "num"}, fmt(r.step)), h("td", {class: "num"}, fmt(r.loss)))).flat()),
    h("h2", {}, "Curves ", key, " ", by), charts,
    h("h2", {}, "Validation images ", data.common_sample_steps.length ? step : h("span", {class: "muted"}, "(no step they share)")), images,
    h("h2", {}, "Config differences"), data.differences.length ? h("table", {id: "differences"},
      h("tr", {}, h("th", {}, "key"), ids.map(id => h("th", {}, id))),
      data.differences.map(d => h("tr", {}, h("td", {}, d.key), d.values.map(v => h("td", {}, v === null ? "—" : JSON.stringify(v)))))) :
      h("p", {class: "muted"}, "their configs are the same"));
  const drawChart = () => {
    charts.replaceChildren();
    new Chart(charts, key.value, async (lo, hi) => {
      const all = await Promise.all(ids.map(id => api(metricsUrl(id, [key.value], by.value, lo, hi))));
      const series = all.map((d, i) => ({label: ids[i], color: PALETTE[i % PALETTE.length], ...(d.series[key.value] || {x: [], y: []})}));
      series.xLabel = by.value;
      return series;
    }).load().catch(e => banner(e.message));
  };
  const drawImages = () => fill(images, ids.map((id, i) => {
    const url = data.samples[i][step.value];
    return url ? h("figure", {}, h("img", {src: url, alt: id}), h("figcaption", {}, `${id} · step ${fmt(Number(step.value))}`)) : null;
  }));
  key.addEventListener("change", drawChart);
  by.addEventListener("change", drawChart);
  step.addEventListener("change", drawImages);
  drawChart();
  drawImages();
}

// ------------------------------------------------------------------------------------------------- start

// The configuration reference (GET /api/config/keys), asked once a page load: key -> {type, default, doc}.
let referencePromise = null;
function reference() {
  if (!referencePromise) {
    referencePromise = api("/api/config/keys").then(d => new Map(d.keys.map(k => [k.name, k])))
      .catch(e => { referencePromise = null; throw e; });
  }
  return referencePromise;
}

// The dotted key written on the caret's line of a YAML text, from the indentation of the lines above it (a
// list item or a blank line belongs to the key above it).
function keyAtLine(text, lineIndex) {
  const lines = text.split("\n");
  const keyLine = /^(\s*)([A-Za-z_][\w.\-]*)\s*:/;
  let i = lineIndex;
  while (i >= 0 && !keyLine.test(lines[i] || "")) i--;
  if (i < 0) return null;
  let [, indent, key] = lines[i].match(keyLine);
  const path = [key];
  for (let j = i - 1; j >= 0 && indent.length > 0; j--) {
    const m = (lines[j] || "").match(keyLine);
    if (m && m[1].length < indent.length) { path.unshift(m[2]); indent = m[1]; }
  }
  return path.join(".");
}

async function showHelp(panel, key) {
  if (!key) { fill(panel, h("span", {class: "muted"}, "Put the cursor on a key to read its documentation.")); return; }
  let keys;
  try { keys = await reference(); } catch (e) { fill(panel, h("span", {class: "problem"}, e.message)); return; }
  const found = keys.get(key);
  if (found) {
    fill(panel, h("div", {}, h("code", {class: "key"}, found.name), " ", h("span", {class: "muted"},
      `${found.type} · default ${found.default}`)), h("div", {class: "doc"}, found.doc.replace(/``/g, "")));
    return;
  }
  const inside = [...keys.keys()].filter(k => k.startsWith(key + "."));
  fill(panel, inside.length ? h("div", {}, h("code", {class: "key"}, key), h("span", {class: "muted"},
    ` (a section): ${inside.map(k => k.slice(key.length + 1)).join(", ")}`)) :
    h("div", {class: "problem"}, `${key}: not a config key`));
}

// The config as typed, checked in the UI's process about 400 ms after the last keystroke: unknown keys and bad
// values, one line each, under the editor. The full check (family, mode) stays on the Check button.
function watchKeys(config, overrides, problems) {
  let timer = null, asked = 0;
  const check = async () => {
    const ticket = ++asked;
    try {
      const r = await api("/api/check/keys", {config: config.value, overrides: overrideLines(overrides)});
      if (ticket !== asked) return;  // a later keystroke's answer wins
      fill(problems, r.ok ? h("span", {class: "ok"}, "every key known, every value of its type") :
        h("ul", {class: "problems"}, r.problems.map(p => h("li", {"data-key": p.key || ""},
          p.line ? `line ${p.line}: ${p.message}` : p.message))));
    } catch (e) { if (ticket === asked) fill(problems, h("span", {class: "problem"}, e.message)); }
  };
  const later = () => { clearTimeout(timer); timer = setTimeout(check, 400); };
  config.addEventListener("input", later);
  overrides.addEventListener("input", later);
  cleanups.push(() => clearTimeout(timer));
  return check;
}

function overrideLines(el) { return el.value.split("\n").map(s => s.trim()).filter(Boolean); }

function gpuPicker(devices) {
  if (!devices.length) return h("div", {id: "gpus", class: "muted"}, "no GPU found (nvidia-smi): the run gets none");
  return h("div", {id: "gpus", class: "toolbar"}, devices.map(d => h("label", {title: d.memory},
    h("input", {type: "checkbox", value: d.index}), ` ${d.index}: ${d.name}`)));
}

function chosenGpus(picker) {
  return [...picker.querySelectorAll("input:checked")].map(box => Number(box.value));
}

// The data folder: shards are ready; a folder of images and captions is offered to `sdtrain prepare folder`,
// queued, into ROOT/data/NAME, whose path then fills the field.
function dataField(input, status) {
  const inspect = async () => {
    if (!input.value.trim()) { fill(status); return; }
    try {
      const r = await api("/api/data/inspect", {path: input.value.trim()});
      if (r.kind !== "images") {
        fill(status, h("span", {class: r.kind === "shards" ? "ok" : "problem"},
          {shards: "shards: ready", empty: "no image in it", missing: "no such folder here (fine if the " +
            "trainer's machine has it, or it is a bucket URL)"}[r.kind]));
        return;
      }
      const name = h("input", {id: "prepare-name", size: 16,
        value: r.path.split("/").filter(Boolean).pop().replace(/[^\w.+-]/g, "-")});
      fill(status, h("span", {class: "muted"}, `${r.images}${r.images >= 1000 ? "+" : ""} images: prepare them ` +
        "into shards first, into data/"), name, h("button", {id: "prepare", on: {click: () =>
          prepare(input, status, r.path, name.value)}}, "Prepare"));
    } catch (e) { fill(status, h("span", {class: "problem"}, e.message)); }
  };
  input.addEventListener("change", inspect);
  return inspect;
}

async function prepare(input, status, source, name) {
  try {
    const r = await api("/api/data/prepare", {source, name});
    fill(status, h("span", {class: "muted"}, `preparing into ${r.out}…`));
    const timer = setInterval(async () => {
      const state = await api(`/api/data/prepare/${encodeURIComponent(name)}`).catch(e => ({error: e.message}));
      if (state.error || !["queued", "running"].includes(state.job.state)) {
        clearInterval(timer);
        if (state.job && state.job.state === "done") { input.value = r.out; fill(status, h("span", {class: "ok"}, "shards: ready")); }
        else fill(status, h("span", {class: "problem"}, state.error || state.job.message || state.job.state));
      }
    }, 2000);
    cleanups.push(() => clearInterval(timer));
  } catch (e) { fill(status, h("span", {class: "problem"}, e.message)); }
}

// The short form: family, base model, data, mode and the usual numbers make a recipe plus overrides, which fill
// the editor below; from there it is checked and started as any config.
function quickForm(families, onFilled) {
  const field = (label, el, key) => {
    if (key) el.addEventListener("focus", () => onFilled.help(key));
    return h("div", {class: "field"}, h("label", {}, label), el);
  };
  // The families come from a child that imports every family (seconds, once a UI): the form does not wait.
  const family = h("select", {id: "f-family"}, h("option", {value: ""}, "(the base model's own)"));
  const familyStatus = h("div", {class: "small muted"}, "loading the families…");
  families.then(found => { family.append(...found.map(f => h("option", {value: f.name}, `${f.title} (${f.name})`)));
    fill(familyStatus); }).catch(e => fill(familyStatus, h("span", {class: "problem"}, e.message)));
  family.addEventListener("focus", () => onFilled.help("model.family"));
  const inputs = {
    pretrained: h("input", {id: "f-pretrained", placeholder: "a Hub id or a local folder", size: 34}),
    data: h("input", {id: "f-data", placeholder: "shards under the root, or any path", size: 34}),
    mode: h("select", {id: "f-mode"}, ["lora", "full", "dreambooth", "textual_inversion"].map(m => h("option", {value: m}, m))),
    steps: h("input", {id: "f-steps", type: "number", min: 1, placeholder: "the recipe's"}),
    lr: h("input", {id: "f-lr", placeholder: "the recipe's", size: 10}),
    resolution: h("input", {id: "f-resolution", type: "number", min: 8, step: 8, placeholder: "the recipe's"}),
    batch_size: h("input", {id: "f-batch", type: "number", min: 1, placeholder: "the recipe's"}),
  };
  const dataStatus = h("div", {id: "data-kind", class: "small"});
  dataField(inputs.data, dataStatus);
  const shown = h("div", {id: "form-result"});
  const button = h("button", {id: "fill", on: {click: async () => {
    const body = {family: family.value || null};
    for (const [k, el] of Object.entries(inputs)) body[k] = el.value.trim();
    try {
      const r = await api("/api/form", body);
      fill(shown, h("div", {class: "muted"}, `recipe ${r.recipe} with:`), h("pre", {}, r.overrides.join("\n")));
      await onFilled(r);
    } catch (e) { fill(shown, h("div", {class: "problem"}, e.message)); }
  }}}, "Fill the config");
  return h("details", {open: true, id: "quick"}, h("summary", {}, "A common fine-tune, in a few fields"),
    h("div", {class: "grid4"}, h("div", {class: "field"}, h("label", {}, "family"), family, familyStatus),
      field("base model", inputs.pretrained, "model.pretrained"),
      h("div", {class: "field"}, h("label", {}, "data folder"), inputs.data, dataStatus),
      field("mode", inputs.mode, "mode"), field("steps", inputs.steps, "train.max_steps"),
      field("learning rate", inputs.lr, "optim.lr"), field("resolution", inputs.resolution, "data.resolution"),
      field("batch size", inputs.batch_size, "data.batch_size")),
    h("div", {class: "toolbar"}, button, h("span", {class: "muted"}, "then Check and Start below")), shown);
}

async function previewData(result, bodyFn, path) {
  fill(result, h("p", {class: "muted"}, "reading the first samples…"));
  try {
    const r = await api(path, bodyFn());
    fill(result, h("p", {class: "muted"}, r.message), h("div", {class: "images"},
      h("figure", {}, h("img", {id: "preview", alt: "data preview", src: r.url}))));
  } catch (e) { fill(result, h("p", {class: "problem", id: "preview-error"}, e.message)); }
}

async function startPage() {
  const families = api("/api/families").then(d => d.families);
  const [recipes, devices] = await Promise.all([api("/api/recipes").then(d => d.recipes),
    api("/api/devices").then(d => d.devices)]);
  const source = h("select", {id: "source"}, h("option", {value: ""}, "(a config of my own)"),
    recipes.map(r => h("option", {value: r}, r)));
  const file = h("input", {type: "file", accept: ".yaml,.yml"});
  const config = h("textarea", {id: "config", rows: 28, spellcheck: "false"});
  const keyProblems = h("div", {id: "key-problems", class: "small"});
  const help = h("div", {id: "key-help"});
  const name = h("input", {id: "name", placeholder: "run name (a folder under the root)", size: 40});
  const overrides = h("textarea", {id: "overrides", rows: 6, placeholder: "key=value, one a line\ntrain.max_steps=1000"});
  const gpus = gpuPicker(devices);
  const result = h("div", {id: "result"});
  const preview = h("div", {id: "preview-result"});
  const checkKeys = watchKeys(config, overrides, keyProblems);
  const body = () => ({config: config.value, name: name.value.trim() || undefined, overrides: overrideLines(overrides),
                       gpus: chosenGpus(gpus)});
  const show = (ok, lines) => result.replaceChildren(ok ? h("p", {class: "ok"}, lines[0] || "ok") :
    h("ul", {class: "problems"}, lines.map(l => h("li", {}, l))));
  const helpAtCaret = () => showHelp(help, keyAtLine(config.value, config.value.slice(0, config.selectionStart).split("\n").length - 1));
  ["keyup", "click", "focus"].forEach(e => config.addEventListener(e, helpAtCaret));
  const load = async recipe => { config.value = (await api(`/api/recipes/${recipe}`)).config; checkKeys(); };
  source.addEventListener("change", () => source.value && load(source.value));
  file.addEventListener("change", async () => {
    if (file.files[0]) { config.value = await file.files[0].text(); source.value = ""; checkKeys(); }
  });
  const filled = async r => { source.value = r.recipe; await load(r.recipe); overrides.value = r.overrides.join("\n"); checkKeys(); };
  filled.help = key => showHelp(help, key);
  const check = h("button", {on: {click: async () => {
    result.replaceChildren(h("p", {class: "muted"}, "checking…"));
    try { const r = await api("/api/check", body()); show(r.ok, r.ok ? [r.message] : r.problems); }
    catch (e) { show(false, [e.message]); }
  }}}, "Check");
  const start = h("button", {class: "primary", on: {click: async () => {
    result.replaceChildren(h("p", {class: "muted"}, "checking, then queueing…"));
    try {
      const r = await api("/api/runs", body());
      location.hash = runLink(r.run);
    } catch (e) { show(false, (e.data && e.data.problems) || [e.message]); }
  }}}, "Start");
  const previewButton = h("button", {id: "preview-data", on: {click: () => previewData(preview, body, "/api/preview")}},
    "Preview data");
  main.replaceChildren(h("h1", {}, "Start a run"), quickForm(families, filled),
    h("p", {class: "muted"}, "Each key is checked as you type; Check runs `sdtrain train CONFIG --check` (family and " +
      "mode included) before anything loads; Start checks, then queues. Its folder is its name under the root."),
    h("div", {class: "grid2"},
      h("div", {}, h("div", {class: "field"}, h("label", {}, "recipe"), source),
        h("div", {class: "field"}, h("label", {}, "or a config file"), file),
        h("div", {class: "field"}, h("label", {}, "config (YAML)"), config), keyProblems),
      h("div", {}, h("div", {class: "field"}, h("label", {}, "key help"), help),
        h("div", {class: "field"}, h("label", {}, "name"), name),
        h("div", {class: "field"}, h("label", {}, "overrides"), overrides),
        h("div", {class: "field"}, h("label", {}, "GPUs (2 or more: torchrun, one process a GPU)"), gpus),
        h("div", {class: "toolbar"}, check, previewButton, start), result, preview)));
  showHelp(help, null);
}

// ------------------------------------------------------------------------------------------------- routing

async function route() {
  cleanups.forEach(fn => fn());
  cleanups = [];
  banner("");
  const hash = decodeURIComponent(location.hash.replace(/^#\/?/, ""));
  try {
    if (hash.startsWith("run/")) await runPage(hash.slice(4));
    else if (hash.startsWith("compare")) await comparePage(hash.slice(8).split(",").filter(Boolean));
    else if (hash === "start") await startPage();
    else await runsPage();
  } catch (e) {
    banner(e.message);
  }
}

window.addEventListener("hashchange", route);
route();
