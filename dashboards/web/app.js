/* gradwatch dashboard: the pages' behaviour. Plain browser JavaScript and plotly.js, no build step.
 *
 * Every name that comes from a run (run, layer, message) reaches the page through textContent or,
 * for plotly (which reads a little HTML in labels), through esc(): nothing user-named is parsed as HTML.
 */
"use strict";

(() => {
  const boot = JSON.parse(document.getElementById("boot").textContent || "{}");
  const COLOURS = { error: "#d92d20", warning: "#e39c0b", info: "#5b8def" };
  const RESTART = "#475467";  // the line where a resumed run went on (RESTART of gradwatch/report/figures.py)
  const SYMBOLS = { warn: "circle", clip: "diamond", skip: "x", rollback: "triangle-left", halt: "square",
                    scale_lr: "star" };
  const PALETTE = ["#2f6fde", "#d92d20", "#0f9960", "#7c3aed", "#e39c0b", "#0891b2", "#db2777", "#65a30d"];
  const FONT = { family: "Inter, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif", size: 12,
                 color: "#1f2933" };
  const GRID = "#edf0f3";
  const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  const MAX_TICKS = 24;
  // a log axis whose values all lie in this range labels its ticks as plain numbers (as the report's figures.py)
  const PLAIN_LOG = [1e-3, 1e4];
  // the digits a plain log axis labels in each decade, densest first, and the pixels between two labels
  const MANTISSAS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 5, 7], [1, 2, 5], [1, 3], [1]];
  const LABEL_GAP = 18;

  // ------------------------------------------------------------------ helpers
  const esc = (s) => String(s).replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", "\"": "&quot;", "'": "&#39;" })[c]);
  const $ = (id) => document.getElementById(id);

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "—";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v) && Math.abs(v) < 1e9) return v.toLocaleString("en-US");
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
    return String(Number(v.toPrecision(4)));
  }

  function ago(seconds) {
    const d = Math.max(0, Date.now() / 1000 - seconds);
    if (d < 60) return `${Math.round(d)} s ago`;
    if (d < 3600) return `${Math.round(d / 60)} min ago`;
    if (d < 86400) return `${Math.round(d / 3600)} h ago`;
    return new Date(seconds * 1000).toLocaleString();
  }

  async function api(path, params) {
    const url = new URL(path, location.origin);
    for (const [key, value] of Object.entries(params || {})) {
      for (const v of Array.isArray(value) ? value : [value]) {
        if (v !== null && v !== undefined) url.searchParams.append(key, v);
      }
    }
    const response = await fetch(url, { headers: { accept: "application/json" } });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error || response.statusText);
    return body;
  }

  function setLive(state, text) {
    const badge = $("live");
    if (!badge) return;
    badge.dataset.state = state;
    badge.querySelector("b").textContent = text;
  }

  /** Server-Sent Events from /api/events; handlers by event name. */
  function listen(params, handlers) {
    const url = new URL("/api/events", location.origin);
    for (const run of params.runs || []) url.searchParams.append("run", run);
    const source = new EventSource(url);
    source.onopen = () => setLive("live", "live");
    source.onerror = () => setLive("offline", "reconnecting…");
    for (const [name, handler] of Object.entries(handlers)) {
      source.addEventListener(name, (event) => handler(JSON.parse(event.data)));
    }
    return source;
  }

  /** Run ``fn`` now; calls made while it runs fold into one more run after it. */
  function serial(fn) {
    let running = null;
    let again = false;
    const run = async () => {
      if (running) { again = true; return running; }
      running = (async () => {
        try {
          do { again = false; await fn(); } while (again);
        } catch (error) {
          console.warn("gradwatch dashboard:", error.message || error);
        } finally {
          running = null;
        }
      })();
      return running;
    };
    return run;
  }

  // A log-scale axis on which every tick label reads as its value, for the values of the arrays given,
  // on an axis about `px` pixels tall. plotly labels the ticks between two powers of ten with their
  // first digit alone (0.4 reads "4", 20 reads "2"): values within PLAIN_LOG are labelled as plain
  // numbers (0.3, 0.5, 1, 2, 20), wider ones by powers of ten with every tick between them written
  // whole (5x10^-1). The report's log_axis (gradwatch/report/figures.py) decides the same way. Plain
  // labels are placed at the densest of 1..9, 1-2-3-5-7, 1-2-5, 1-3 and 1 per decade whose labels
  // stand LABEL_GAP pixels apart (every digit labelled on a short axis overlapped: 1, 0.9, 0.8, 0.7).
  function logAxis(px, ...series) {
    let lo = Infinity;
    let hi = -Infinity;
    for (const values of series) {
      for (const v of values || []) {
        if (typeof v === "number" && v > 0 && Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
      }
    }
    if (lo === Infinity) return { type: "log", tickformat: "~g" };
    if (lo < PLAIN_LOG[0] || hi > PLAIN_LOG[1]) return { type: "log", exponentformat: "power", minorloglabels: "complete" };
    const span = Math.max(Math.log10(hi / lo), 0.02) * 1.1;  // plotly's autorange pads the data's span
    for (const digits of MANTISSAS) {
      const ticks = [];
      for (let e = Math.floor(Math.log10(lo)) - 1; e <= Math.ceil(Math.log10(hi)); e += 1) {
        for (const d of digits) {
          const v = Number((d * 10 ** e).toPrecision(6));
          if (v >= lo / 1.02 && v <= hi * 1.02) ticks.push(v);
        }
      }
      if (ticks.length < 2) break;  // a narrow span: plotly's own ticks, as many as fit
      const gap = Math.min(...ticks.slice(1).map((v, i) => Math.log10(v / ticks[i])));
      if (gap / span * px >= LABEL_GAP) return { type: "log", tickformat: "~g", tickvals: ticks };
    }
    return { type: "log", tickformat: "~g", nticks: Math.max(2, Math.floor(px / (2 * LABEL_GAP))) };
  }

  function layout(extra) {
    const base = {
      font: FONT, paper_bgcolor: "white", plot_bgcolor: "white", hoverlabel: { font: FONT },
      margin: { l: 64, r: 24, t: 12, b: 44 }, showlegend: false, uirevision: "keep",
    };
    return Object.assign(base, extra);
  }
  const axis = (extra) => Object.assign({ gridcolor: GRID, zeroline: false, linecolor: "#c9d1d9", showline: true },
    extra);

  function draw(id, traces, lay) {
    if (!window.Plotly) return;
    Plotly.react($(id), traces, lay, CONFIG);
  }

  function ticks(names) {
    const n = names.length;
    const idx = [];
    const count = Math.min(n, MAX_TICKS);
    for (let i = 0; i < count; i++) {
      const k = count === 1 ? 0 : Math.round(i * (n - 1) / (count - 1));
      if (!idx.includes(k)) idx.push(k);
    }
    return { tickvals: idx, ticktext: idx.map((k) => esc(names[k])) };
  }

  function empty(id, text) {
    draw(id, [], layout({
      height: 160, xaxis: { visible: false }, yaxis: { visible: false },
      annotations: [{ text: esc(text), showarrow: false, font: { color: "#8a94a6" }, xref: "paper", yref: "paper",
                      x: 0.5, y: 0.5 }],
    }));
  }

  // ------------------------------------------------------------------ index: the runs
  function indexPage() {
    const body = document.querySelector("#runs tbody");
    const chosen = new Set();
    const known = new Set();
    let first = true;
    const button = $("compare");
    button.addEventListener("click", () => {
      const query = new URLSearchParams();
      for (const id of chosen) query.append("run", id);
      location.href = `/compare?${query}`;
    });
    const sync = () => { button.disabled = chosen.size < 2; };

    function render(rows) {
      body.replaceChildren(...rows.map((row) => {
        const box = el("input", { type: "checkbox", "aria-label": `select ${row.run}`, checked: chosen.has(row.id),
          onchange: (e) => { if (e.target.checked) chosen.add(row.id); else chosen.delete(row.id); sync(); } });
        const counts = row.findings || {};
        const verdict = row.error ? `unreadable: ${row.error}` : row.worst ? `worst: ${row.worst}` : "clean";
        const tr = el("tr", { class: !first && !known.has(row.id) ? "fresh" : null, "data-run": row.id },
          el("td", {}, box),
          el("td", { class: "name" }, el("a", { href: `/run?run=${encodeURIComponent(row.id)}`, text: row.run })),
          el("td", { class: "num steps", text: row.steps === null ? "—" : fmt(row.steps) }),
          el("td", {}, el("span", { class: `status status-${row.status}`, text: row.status_detail || row.status })),
          el("td", { class: `verdict-${row.error ? "error" : row.worst || "clean"}`, text: verdict }),
          el("td", { class: "num", text: counts.error ?? "—" }),
          el("td", { class: "num", text: counts.warning ?? "—" }),
          el("td", { class: "updated", "data-t": row.updated, text: ago(row.updated) }));
        known.add(row.id);
        return tr;
      }));
      for (const id of [...chosen]) if (!rows.some((r) => r.id === id)) chosen.delete(id);
      sync();
      first = false;
      $("no-runs").hidden = rows.length > 0;
    }
    setInterval(() => {
      for (const cell of document.querySelectorAll("td.updated")) cell.textContent = ago(Number(cell.dataset.t));
    }, 5000);
    api("/api/runs").then(render).catch((e) => console.warn(e.message));
    listen({}, { runs: render });
  }

  // ------------------------------------------------------------------ one run
  function runPage(id) {
    const state = { start: null, stop: null, metric: "grad_norm", layer: null, findings: [], curves: null,
                    progress: null, summaryKey: null, layers: [], flowLayers: [], heatLayers: [] };
    const range = () => ({ run: id, start: state.start, stop: state.stop });

    // ---------------- header
    async function loadSummary() {
      const s = await api("/api/run/summary", { run: id });
      const banner = $("banner");
      banner.className = `banner state-${s.state}`;
      $("headline").textContent = s.headline;
      $("status").textContent = s.status_detail || s.status;
      $("steps").textContent = fmt(s.steps);
      for (const sev of ["error", "warning"]) {
        $(`n-${sev}`).textContent = fmt(s.counts[sev]);
        $(`n-${sev}`).classList.toggle("some", s.counts[sev] > 0);
      }
      $("facts").replaceChildren(...s.facts.map(([k, v]) => el("div", {}, el("dt", { text: k }), el("dd", { text: v }))));
      state.layers = s.layers;
      const tabs = $("metrics");
      if (!tabs.children.length) {
        for (const m of s.metrics) {
          tabs.append(el("button", { role: "tab", "data-metric": m.metric, "aria-selected": String(m.metric === state.metric),
            text: m.title, onclick: () => selectMetric(m.metric) }));
        }
      }
      document.title = `${s.name} · gradwatch`;
    }

    function selectMetric(metric) {
      state.metric = metric;
      for (const b of $("metrics").children) b.setAttribute("aria-selected", String(b.dataset.metric === metric));
      loadHeat();
    }

    // ---------------- timeline
    async function loadCurves() {
      state.curves = await api("/api/run/curves", range());
      drawTimeline();
    }

    function drawTimeline() {
      const c = state.curves;
      if (!c) return;
      const traces = [];
      const has = (name) => c.curves[name] && c.curves[name].steps.length;
      const lanes = [...new Set(state.findings.map((f) => f.kind))];
      if (c.skipped.length) lanes.push("skipped step");
      const rows = [];
      if (has("loss")) rows.push("loss");
      if (has("grad_norm")) rows.push("grad");
      if (lanes.length) rows.push("events");
      if (!rows.length) { empty("timeline", "No steps recorded yet."); return; }
      const weights = { loss: 0.42, grad: 0.42, events: Math.min(0.3, 0.07 * lanes.length + 0.06) };
      const total = rows.reduce((a, r) => a + weights[r], 0);
      const gap = 0.05;
      let top = 1;
      const lay = layout({ height: 200 * (rows.length - (lanes.length ? 1 : 0)) + (lanes.length ? 40 + 26 * lanes.length : 0) + 60,
                           hovermode: "closest", margin: { l: 72, r: 24, t: 12, b: 44 } });
      const yname = {};
      const px = {};  // each row's height in pixels, for its log axis's labels
      rows.forEach((row, k) => {
        const h = (weights[row] / total) * (1 - gap * (rows.length - 1));
        const key = k === 0 ? "yaxis" : `yaxis${k + 1}`;
        yname[row] = k === 0 ? "y" : `y${k + 1}`;
        px[row] = h * (lay.height - 56);
        lay[key] = axis({ domain: [Math.max(0, top - h), top], anchor: "x" });
        top -= h + gap;
      });
      if (has("loss")) {
        traces.push({ x: c.curves.loss.steps, y: c.curves.loss.values, yaxis: yname.loss, mode: "lines", name: "loss",
                      line: { color: "#2f6fde", width: 1.4 }, hovertemplate: "step %{x}<br>loss %{y:.4g}<extra></extra>" });
        Object.assign(lay[yname.loss === "y" ? "yaxis" : `yaxis${yname.loss.slice(1)}`],
                      { title: { text: "loss" }, ...(c.curves.loss.log ? logAxis(px.loss, c.curves.loss.values) : {}) });
      }
      if (has("grad_norm")) {
        traces.push({ x: c.curves.grad_norm.steps, y: c.curves.grad_norm.values, yaxis: yname.grad, mode: "lines",
                      name: "global grad norm", line: { color: "#7c3aed", width: 1.4 },
                      hovertemplate: "step %{x}<br>grad norm %{y:.3g}<extra></extra>" });
        Object.assign(lay[yname.grad === "y" ? "yaxis" : `yaxis${yname.grad.slice(1)}`],
                      { title: { text: "grad norm" }, ...logAxis(px.grad, c.curves.grad_norm.values) });
      }
      if (lanes.length) {
        const key = yname.events === "y" ? "yaxis" : `yaxis${yname.events.slice(1)}`;
        Object.assign(lay[key], { tickvals: lanes.map((_, i) => i), ticktext: lanes.map(esc),
                                  range: [lanes.length - 0.4, -0.6], showgrid: true });
        for (const sev of ["info", "warning", "error"]) {
          const group = state.findings.filter((f) => f.severity === sev);
          if (!group.length) continue;
          traces.push({
            x: group.map((f) => f.step), y: group.map((f) => lanes.indexOf(f.kind)), yaxis: yname.events,
            mode: "markers", name: sev, customdata: group.map((f) => f.index),
            marker: { color: COLOURS[sev], size: 11, symbol: group.map((f) => SYMBOLS[f.action] || "circle-open"),
                      line: { width: 1, color: "white" } },
            text: group.map((f) => `<b>${esc(f.title)}</b> · ${sev} · step ${f.step}<br>${esc(f.where)}`
                                   + `<br>action: ${esc(f.action || "none")}`),
            hovertemplate: "%{text}<extra></extra>",
          });
        }
        if (c.skipped.length) {
          traces.push({ x: c.skipped, y: c.skipped.map(() => lanes.indexOf("skipped step")), yaxis: yname.events,
                        mode: "markers", name: "skipped step", hovertemplate: "step %{x} skipped<extra></extra>",
                        marker: { color: "#8a94a6", size: 9, symbol: "line-ns-open", line: { width: 2 } } });
        }
      }
      lay.xaxis = axis({ title: { text: "step" }, anchor: yname[rows[rows.length - 1]] });
      if (state.start !== null || state.stop !== null) {
        lay.xaxis.range = [state.start ?? 0, (state.stop ?? (state.progress?.last_step ?? 0) + 1) - 1];
        lay.xaxis.autorange = false;
      }
      lay.shapes = state.findings.filter((f) => f.severity === "error" || f.action === "halt" || f.action === "rollback")
        .slice(0, 30).map((f) => ({ type: "line", xref: "x", yref: "paper", x0: f.step, x1: f.step, y0: 0, y1: 1,
                                    line: { color: COLOURS.error, width: 1, dash: "dot" }, opacity: 0.5 }));
      // a resumed run: where a later process went on (the report's timeline marks it alike)
      for (const step of c.restarts || []) {
        lay.shapes.push({ type: "line", xref: "x", yref: "paper", x0: step, x1: step, y0: 0, y1: 1,
                          line: { color: RESTART, width: 1.2, dash: "dash" } });
        (lay.annotations = lay.annotations || []).push({ x: step, y: 1, xref: "x", yref: "paper", text: "resumed",
                                                         showarrow: false, yshift: 8, font: { color: RESTART, size: 11 },
                                                         hovertext: `the run resumed at step ${step}` });
      }
      draw("timeline", traces, lay);
    }

    function zoom(start, stop) {
      state.start = start;
      state.stop = stop;
      const zoomed = start !== null || stop !== null;
      $("reset").hidden = !zoomed;
      $("range").textContent = zoomed ? `steps ${fmt(start ?? 0)} – ${stop === null ? "latest" : fmt(stop - 1)}` : "all steps";
      refreshRange();
    }

    // ---------------- findings
    async function loadFindings() {
      const f = await api("/api/run/findings", { run: id });
      state.findings = f.findings;
      $("findings-count").textContent = f.total > f.findings.length
        ? `${fmt(f.findings.length)} of ${fmt(f.total)}, most severe first` : `${fmt(f.total)}, most severe first`;
      $("findings").replaceChildren(...f.findings.map(findingItem));
      $("no-findings").hidden = f.total > 0;
      drawTimeline();
    }

    function findingItem(f) {
      const li = el("li", { class: f.severity, "data-index": f.index, "data-kind": f.kind, "data-step": f.step },
        el("div", { class: "head" },
          el("span", { class: `sev sev-${f.severity}`, text: f.severity }),
          el("span", { class: "kind", text: f.title }),
          el("span", { class: "where", text: f.where }),
          el("span", { class: "step", text: `step ${fmt(f.step)}${f.repeats > 1 ? ` · ×${f.repeats}` : ""}` })),
        el("p", { class: "message", text: f.message }),
        f.root_cause && f.root_cause.length ? el("dl", { class: "rootcause" }, ...f.root_cause.flatMap(([k, v]) =>
          [el("dt", { text: k }), k === "code" ? el("dd", {}, el("code", { text: v })) : el("dd", { text: v })])) : null,
        f.outcome ? el("p", { class: "outcome", text: `${f.action}: ${f.outcome}` }) : null,
        f.remedies.length ? el("details", {}, el("summary", { text: "what to try" }),
          el("ul", {}, ...f.remedies.map((r) => el("li", { text: r })))) : null);
      li.addEventListener("click", (event) => {
        if (event.target.closest("details")) return;
        const before = 50;
        zoom(Math.max(0, f.step - before), f.step + before + 1);
        if (f.layer && state.layers.some((l) => l.name === f.layer)) openLayer(f.layer);
      });
      return li;
    }

    // ---------------- gradient flow
    async function loadFlow() {
      const f = await api("/api/run/flow", { run: id });
      if (f.step === null) { empty("flow", "No gradients recorded yet."); $("flow-step").textContent = ""; return; }
      $("flow-step").textContent = `step ${fmt(f.step)}`;
      const n = f.layers.length;
      const x = f.layers.map((_, i) => i);
      // a bar is coloured by a finding that holds at the step shown (red: error, amber: warning); a layer whose
      // findings ended before it keeps its blue bar with an amber outline, and its hover names that step
      // a layer whose gradient is NaN/Inf at this step has no norm to draw: its bar reaches the top, in red
      const now = f.flagged, earlier = f.earlier, bad = new Set(f.nonfinite || []);
      const finite = [...f.values, ...f.first].filter((v) => v > 0);
      const top = finite.length ? Math.max(...finite) * 3 : 1;
      const types = new Map(state.layers.map((l) => [l.name, l.type]));
      const custom = f.layers.map((name, i) => [esc(name), esc(types.get(name) || ""),
        name in now ? `<br>${now[name]} at this step` : name in earlier ? `<br>finding at step ${earlier[name]}` : "",
        bad.has(name) ? "NaN/Inf" : f.values[i] > 0 ? Number(f.values[i]).toPrecision(3) : "-"]);
      const traces = [
        { type: "bar", x, y: f.values.map((v, i) => (bad.has(f.layers[i]) ? top : v > 0 ? v : null)),
          name: `step ${f.step}`, customdata: custom,
          marker: { color: f.layers.map((name) => (bad.has(name) ? COLOURS.error : name in now ? COLOURS[now[name]] : "#2f6fde")),
                    line: { color: f.layers.map((name) => (name in earlier ? COLOURS.warning : "rgba(0,0,0,0)")),
                            width: f.layers.map((name) => (name in earlier ? 2 : 0)) } },
          hovertemplate: "%{customdata[0]} (%{customdata[1]})<br>grad norm %{customdata[3]}%{customdata[2]}<extra>latest</extra>" },
        { type: "scatter", mode: n <= 200 ? "lines+markers" : "lines", x, y: f.first.map((v) => (v > 0 ? v : null)),
          name: `first step (${f.first_step})`, customdata: custom, line: { color: "#8a94a6", width: 1.2 },
          marker: { size: 4 }, hovertemplate: "%{customdata[0]}<br>grad norm %{y:.3g}<extra>first step</extra>" },
      ];
      const t = ticks(f.layers);
      draw("flow", traces, layout({
        height: 380, bargap: n > 100 ? 0 : 0.2, showlegend: true, legend: { orientation: "h", y: 1.12, x: 0 },
        yaxis: axis({ ...logAxis(280, traces[0].y, traces[1].y), title: { text: "grad norm" } }),
        xaxis: axis({ title: { text: "layer (input → output)" }, tickvals: t.tickvals, ticktext: t.ticktext,
                      tickangle: n > 6 ? -35 : 0, automargin: true, range: [-0.5, n - 0.5] }),
      }));
      $("flow").dataset.layers = String(n);
      $("flow").dataset.step = String(f.step);
      bindClick("flow", (point) => openLayer(state.flowLayers[point.x]));
      state.flowLayers = f.layers;
    }

    // ---------------- heatmap
    async function loadHeat() {
      const h = await api("/api/run/heatmap", { ...range(), metric: state.metric });
      $("heat-note").textContent = h.note || "";
      if (!h.layers.length || !h.steps.length) { empty("heatmap", `No ${h.title} recorded in this range.`); return; }
      const unit = h.log ? `log10 ${h.title}` : h.title;
      const scale = h.log ? "Viridis" : [[0, "#f7f9fc"], [0.5, "#f5a524"], [1, "#b42318"]];
      draw("heatmap", [{
        type: "heatmap", z: h.z, x: h.steps, y: h.layers.map(esc), colorscale: scale, hoverongaps: false,
        zmin: h.log ? null : 0, zmax: h.log ? null : 1,
        colorbar: { title: { text: esc(unit), side: "right" }, thickness: 12 },
        hovertemplate: `%{y}<br>step %{x}<br>${esc(unit)} %{z:.3g}<extra></extra>`,
      }], layout({
        height: Math.min(900, Math.max(300, 14 * h.layers.length + 110)), margin: { l: 64, r: 24, t: 12, b: 44 },
        yaxis: axis({ type: "category", autorange: "reversed", automargin: true, title: { text: "layer" } }),
        xaxis: axis({ title: { text: "step" } }),
      }));
      $("heatmap").dataset.columns = String(h.steps.length);
      $("heatmap").dataset.lastStep = String(h.steps[h.steps.length - 1]);
      state.heatLayers = h.layers;
      bindClick("heatmap", (point) => openLayer(state.heatLayers[point.pointNumber[0]]));
    }

    // ---------------- one layer
    function openLayer(name) {
      state.layer = name;
      $("layer-panel").hidden = false;
      $("layer-name").textContent = name;
      loadLayer().then(() => $("layer-panel").scrollIntoView({ behavior: "smooth", block: "nearest" }));
    }

    async function loadLayer() {
      if (!state.layer) return;
      const d = await api("/api/run/layer", { ...range(), layer: state.layer });
      $("layer-info").textContent = `${d.type} · ${fmt(d.params)} parameters${d.exact ? "" : " · each point: a bucket's low and high"}`;
      const metrics = Object.keys(d.series);
      if (!metrics.length) { empty("layer", "Nothing recorded for this layer in this range."); }
      else {
        const traces = [];
        const lay = layout({ height: 150 * metrics.length + 60, hovermode: "x unified" });
        const gap = 0.06;
        const h = (1 - gap * (metrics.length - 1)) / metrics.length;
        metrics.forEach((m, k) => {
          const s = d.series[m];
          const meta = d.metrics[m];
          const y = k === 0 ? "y" : `y${k + 1}`;
          lay[k === 0 ? "yaxis" : `yaxis${k + 1}`] = axis({
            domain: [1 - (k + 1) * h - k * gap, 1 - k * gap - k * h], anchor: "x",
            ...(meta.log ? logAxis(h * (lay.height - 56), s.values, s.low, s.high) : { type: "linear", exponentformat: "power" }),
            title: { text: esc(meta.title), font: { size: 11 } } });
          const colour = PALETTE[k % PALETTE.length];
          if (s.values) {
            traces.push({ x: s.steps, y: s.values, yaxis: y, mode: "lines", name: esc(meta.title),
                          line: { color: colour, width: 1.4 } });
          } else {
            traces.push({ x: s.steps, y: s.low, yaxis: y, mode: "lines", name: `${esc(meta.title)} low`,
                          line: { color: colour, width: 0.8 } });
            traces.push({ x: s.steps, y: s.high, yaxis: y, mode: "lines", name: `${esc(meta.title)} high`,
                          line: { color: colour, width: 1.2 }, fill: "tonexty", fillcolor: `${colour}33` });
          }
        });
        lay.xaxis = axis({ title: { text: "step" }, anchor: metrics.length === 1 ? "y" : `y${metrics.length}` });
        draw("layer", traces, lay);
      }
      $("layer-findings").replaceChildren(...d.findings.map(findingItem));
    }

    // ---------------- wiring
    function bindClick(id, handler) {
      const node = $(id);
      if (!window.Plotly || node.dataset.bound) return;
      node.dataset.bound = "1";
      node.on("plotly_click", (event) => { if (event.points && event.points.length) handler(event.points[0]); });
    }

    const refreshAll = serial(async () => {
      await Promise.all([loadFindings(), loadCurves(), loadFlow(), loadHeat(), loadLayer()]);
    });
    const refreshRange = serial(async () => { await Promise.all([loadCurves(), loadHeat(), loadLayer()]); });
    const refreshSummary = serial(loadSummary);

    function onProgress(p) {
      if (p.error) { setLive("offline", "run unreadable"); return; }
      const before = state.progress;
      state.progress = p;
      $("steps").textContent = fmt(p.steps);
      $("status").textContent = p.status;
      const key = `${p.status}/${p.findings}/${p.restarts}`;  // a restart adds a fact: read the summary again
      if (key !== state.summaryKey) { state.summaryKey = key; refreshSummary(); }
      if (!before || before.row !== p.row || before.findings !== p.findings || before.steps !== p.steps) refreshAll();
    }

    $("reset").addEventListener("click", () => zoom(null, null));
    $("layer-close").addEventListener("click", () => { state.layer = null; $("layer-panel").hidden = true; });
    refreshSummary().then(() => {
      const timeline = $("timeline");
      refreshAll().then(() => {
        if (!window.Plotly || timeline.dataset.bound) return;
        timeline.dataset.bound = "1";
        timeline.on("plotly_relayout", (e) => {
          if (e["xaxis.autorange"]) { if (state.start !== null || state.stop !== null) zoom(null, null); return; }
          const a = e["xaxis.range[0]"] ?? (e["xaxis.range"] || [])[0];
          const b = e["xaxis.range[1]"] ?? (e["xaxis.range"] || [])[1];
          if (a === undefined || b === undefined) return;
          const start = Math.max(0, Math.floor(a));
          const stop = Math.max(start + 1, Math.ceil(b) + 1);
          if (start !== state.start || stop !== state.stop) zoom(start, stop);
        });
        timeline.on("plotly_click", (e) => {
          const point = e.points && e.points[0];
          if (!point || point.customdata === undefined) return;
          const item = document.querySelector(`#findings li[data-index="${Number(point.customdata)}"]`);
          if (item) { item.scrollIntoView({ behavior: "smooth", block: "nearest" }); item.click(); }
        });
      });
    });
    listen({ runs: [id] }, { progress: onProgress });
  }

  // ------------------------------------------------------------------ compare
  function comparePage(ids) {
    const colour = (k) => PALETTE[k % PALETTE.length];
    document.querySelectorAll("#legend li").forEach((li, k) => { li.style.borderLeft = `4px solid ${colour(k)}`;
      li.style.paddingLeft = "8px"; });

    const load = serial(async () => {
      const curves = await Promise.all(ids.map((run) => api("/api/run/curves", { run })));
      const flows = await Promise.all(ids.map((run) => api("/api/run/flow", { run })));
      // the loss is on a log scale when every compared run's is (the rule of the run page and the report)
      const logLoss = curves.some((c) => c.curves.loss) && curves.every((c) => !c.curves.loss || c.curves.loss.log);
      for (const [name, target, log] of [["grad_norm", "cmp-grad", true], ["loss", "cmp-loss", logLoss]]) {
        const traces = curves.map((c, k) => (c.curves[name] ? {
          x: c.curves[name].steps, y: c.curves[name].values, mode: "lines", name: esc(ids[k]),
          line: { color: colour(k), width: 1.4 }, hovertemplate: `${esc(ids[k])}<br>step %{x}<br>%{y:.4g}<extra></extra>`,
        } : null)).filter(Boolean);
        if (!traces.length) { empty(target, `No ${name === "loss" ? "loss" : "gradient norm"} recorded.`); continue; }
        draw(target, traces, layout({ height: 320, showlegend: true, legend: { orientation: "h", y: 1.14, x: 0 },
          yaxis: axis(log ? logAxis(230, ...traces.map((trace) => trace.y)) : { type: "linear", exponentformat: "power" }),
          xaxis: axis({ title: { text: "step" } }) }));
      }
      const order = [];
      const seen = new Set();
      for (const f of flows) for (const name of f.layers) if (!seen.has(name)) { seen.add(name); order.push(name); }
      const position = new Map(order.map((name, i) => [name, i]));
      const traces = flows.map((f, k) => (f.step === null ? null : {
        x: f.layers.map((name) => position.get(name)), y: f.values.map((v) => (v > 0 ? v : null)),
        mode: order.length <= 200 ? "lines+markers" : "lines", name: `${esc(ids[k])} (step ${f.step})`, connectgaps: true,
        customdata: f.layers.map(esc), line: { color: colour(k), width: 1.4 }, marker: { size: 4 },
        hovertemplate: `%{customdata}<br>grad norm %{y:.3g}<extra>${esc(ids[k])}</extra>`,
      })).filter(Boolean);
      if (!traces.length) { empty("cmp-flow", "No gradients recorded yet."); return; }
      const t = ticks(order);
      draw("cmp-flow", traces, layout({ height: 380, showlegend: true, legend: { orientation: "h", y: 1.12, x: 0 },
        yaxis: axis({ ...logAxis(280, ...traces.map((trace) => trace.y)), title: { text: "grad norm" } }),
        xaxis: axis({ title: { text: "layer (input → output)" }, tickvals: t.tickvals, ticktext: t.ticktext,
                      tickangle: order.length > 6 ? -35 : 0, automargin: true }) }));
    });
    load();
    const last = new Map();
    listen({ runs: ids }, { progress: (p) => {
      const key = `${p.row}/${p.steps}/${p.status}`;
      if (last.get(p.id) !== key) { last.set(p.id, key); load(); }
    } });
  }

  // ------------------------------------------------------------------ start
  if (boot.page === "index") indexPage();
  else if (boot.page === "run") runPage(boot.run);
  else if (boot.page === "compare") comparePage(boot.runs);
  else setLive("offline", "");
})();
