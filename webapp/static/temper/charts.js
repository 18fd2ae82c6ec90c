/* Temper charts: series from /api/v1/metrics/, live points over the run's websocket, no point lost.
 *
 * - Each chart loads its own series, downsampled on the server to ~1,000 points (min and max per bucket,
 *   so spikes survive); zooming asks the server for the window again, finer.
 * - LiveStream tracks sequence numbers: a point is applied once; a gap that stays open, or a reconnect,
 *   backfills over ?since_seq= so nothing is lost and nothing is drawn twice.
 * - Redraws are batched (at most ~4 a second) and keep zoom, pan and legend selection (uirevision).
 * - Smoothing is a debiased exponential moving average, applied at draw time; raw points are kept.
 * - With many domains (opts.overall) a chart draws only the run-wide series; heatmap.js draws the domains.
 * - On the run page plotly.js (1.5 MB: its parse is one 0.3-0.9 s long task on a busy machine) runs only
 *   after the first chart with points and the heatmap have their data (loadPlotly, called by run.js): until
 *   then a chart is drawn as a plain SVG of the same
 *   lines (axes, ticks, smoothing), then redrawn by plotly; data-points and onDrawn stay plotly's
 *   (data-preview marks the SVG one).
 */
(function (global) {
  "use strict";

  const MAX_POINTS = 1000;
  const REDRAW_MS = 250;
  const COLORS = ["#2f6fed", "#e4572e", "#17a398", "#f3a712", "#8e44ad", "#4c5760", "#d7263d", "#1b998b",
                  "#2e86ab", "#a23b72", "#3b1f2b", "#6a994e"];

  function ema(ys, alpha) {
    if (!alpha) return ys;
    const out = new Array(ys.length);
    let acc = 0, n = 0;
    for (let i = 0; i < ys.length; i++) {
      const y = ys[i];
      if (!Number.isFinite(y)) { out[i] = y; continue; }
      acc = acc * alpha + (1 - alpha) * y;
      n += 1;
      out[i] = acc / (1 - Math.pow(alpha, n));
    }
    return out;
  }

  function metricsUrl(runId, names, extra) {
    const q = new URLSearchParams({run: String(runId)});
    names.forEach(n => q.append("name", n));
    Object.entries(extra || {}).forEach(([k, v]) => { if (v !== undefined && v !== null) q.set(k, String(v)); });
    return "/api/v1/metrics/?" + q.toString();
  }

  // plotly.js on the run page: preloaded by the template, run only when loadPlotly() is called (by run.js),
  // since its parse is one long task that would hold every fetch's answer.
  let plotlyResolve = null, plotlyReject = null, plotlyStarted = false;
  const plotlyPromise = new Promise((resolve, reject) => { plotlyResolve = resolve; plotlyReject = reject; });
  plotlyPromise.catch(() => {});  // a page that never needs it does not report it

  /** Resolves with window.Plotly once it has run. */
  function plotlyReady() { return global.Plotly ? Promise.resolve(global.Plotly) : plotlyPromise; }

  /** Run the preloaded plotly.js (link#plotly-preload), once. */
  function loadPlotly() {
    if (global.Plotly) { plotlyResolve(global.Plotly); return plotlyPromise; }
    if (plotlyStarted) return plotlyPromise;
    plotlyStarted = true;
    const link = document.getElementById("plotly-preload");
    if (!link) { plotlyReject(new Error("plotly.js is not on this page")); return plotlyPromise; }
    const tag = document.createElement("script");
    tag.src = link.href;
    tag.onload = () => plotlyResolve(global.Plotly);
    tag.onerror = () => plotlyReject(new Error("plotly.js did not load"));
    document.head.append(tag);
    return plotlyPromise;
  }

  /** Put ``node`` (an SVG or canvas preview) in ``el`` in place of the one there. */
  function showPreview(el, node) {
    const old = el.querySelector(".chart-preview");
    if (old) old.replaceWith(node); else el.append(node);
    el.dataset.preview = "1";
  }

  function clearPreview(el) {
    const old = el.querySelector(".chart-preview");
    if (old) { old.remove(); delete el.dataset.preview; }
  }

  /** Call ``redraw`` once plotly has run (once per ``owner``, however often it is asked). */
  function redrawWithPlotly(owner, redraw, onError) {
    if (owner.awaitingPlotly) return;
    owner.awaitingPlotly = true;
    plotlyReady().then(redraw, onError);
  }

  function tickLabel(v) {
    if (!Number.isFinite(v)) return "";
    const a = Math.abs(v);
    return a !== 0 && (a >= 1e5 || a < 1e-3) ? v.toExponential(1) : String(Number(v.toPrecision(3)));
  }

  /** The lines of ``traces`` as one SVG (the shape of plotly's chart, without its interaction). */
  function previewSvg(traces, def, width, height) {
    const NS = "http://www.w3.org/2000/svg";
    const L = 48, R = 10, T = 8, B = 32;
    const ty = def.log ? (v => (v > 0 ? Math.log10(v) : NaN)) : (v => v);
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const t of traces) {
      t.x.forEach((x, i) => {
        const y = ty(t.y[i]);
        if (!Number.isFinite(x) || !Number.isFinite(y)) return;
        x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
      });
    }
    if (!Number.isFinite(x0)) return null;
    if (def.range) { y0 = def.range[0]; y1 = def.range[1]; }  // plotly's units: log10 on a log axis
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
    const sx = x => L + (x - x0) / (x1 - x0) * (width - L - R);
    const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (height - T - B);
    const el = (name, attrs, text) => {
      const node = document.createElementNS(NS, name);
      Object.entries(attrs).forEach(([k, v]) => node.setAttribute(k, String(v)));
      if (text !== undefined) node.textContent = text;
      return node;
    };
    const svg = el("svg", {class: "chart-preview", width: width, height: height, viewBox: `0 0 ${width} ${height}`,
                           role: "img", "aria-label": "chart (interactive once plotly has loaded)"});
    svg.append(el("path", {d: `M${L},${T}V${height - B}H${width - R}`, stroke: "#c8ccd2", fill: "none"}));
    const label = def.log ? (v => tickLabel(Math.pow(10, v))) : tickLabel;
    for (const y of [y0, (y0 + y1) / 2, y1]) {
      svg.append(el("text", {x: L - 4, y: sy(y) + 3, "text-anchor": "end", "font-size": 10, fill: "#555"}, label(y)));
    }
    for (const [x, anchor] of [[x0, "start"], [x1, "end"]]) {
      svg.append(el("text", {x: sx(x), y: height - B + 13, "text-anchor": anchor, "font-size": 10, fill: "#555"}, tickLabel(x)));
    }
    svg.append(el("text", {x: (L + width - R) / 2, y: height - 4, "text-anchor": "middle", "font-size": 11, fill: "#444"}, "step"));
    for (const t of traces) {
      let d = "", pen = "M";
      t.x.forEach((x, i) => {
        const y = ty(t.y[i]);
        if (!Number.isFinite(x) || !Number.isFinite(y)) { pen = "M"; return; }
        d += pen + sx(x).toFixed(1) + "," + sy(Math.min(y1, Math.max(y0, y))).toFixed(1);
        pen = "L";
      });
      svg.append(el("path", {d: d, stroke: t.line.color, "stroke-width": t.line.width, fill: "none"}));
    }
    return svg;
  }

  async function getJSON(url) {
    const r = await fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}});
    if (!r.ok) throw new Error(url + " answered " + r.status);
    return r.json();
  }

  /** One plotly chart of one or more series (a series = a metric name and a domain). */
  class Chart {
    constructor(el, def, opts) {
      this.el = el;
      this.def = def;
      this.opts = opts;            // {runId, label(name, domain), smoothing(), paused(), names: [...]}
      this.series = new Map();     // key -> {name, domain, x: [], y: [], label}
      this.loadedSeq = -1;         // points with seq <= loadedSeq are in the loaded data
      this.loading = null;         // while a load runs, live points wait here
      this.dirty = false;
      this.timer = null;
      this.drawn = false;
      this.maxSeq = 0;
      this.window = null;          // [lo, hi] steps when zoomed
      this.onDrawn = opts.onDrawn || (() => {});
    }

    matches(name) {
      const d = this.def;
      if (d.names.includes(name)) return true;
      if ((d.prefixes || []).some(p => name.startsWith(p))) return true;
      return Boolean(d.other && this.opts.isOther(name));
    }

    wantedNames() {
      const d = this.def;
      const known = this.opts.names.filter(n => this.matches(n));
      return Array.from(new Set(d.names.concat(known)));
    }

    key(name, domain) { return name + "|" + (domain === null || domain === undefined ? "" : domain); }

    ensure(name, domain) {
      const k = this.key(name, domain);
      let s = this.series.get(k);
      if (!s) {
        s = {name: name, domain: domain, x: [], y: [], label: this.opts.label(name, domain)};
        this.series.set(k, s);
      }
      return s;
    }

    /** Load (or reload, after a zoom) this chart's series from the server. */
    async load(range) {
      const names = this.wantedNames();
      if (!names.length) { this.loadedSeq = Math.max(this.loadedSeq, 0); return; }
      this.loading = [];
      const extra = {max_points: MAX_POINTS};
      if (this.opts.overall) extra.overall = "true";  // many domains: per-domain series go to the heatmap
      if (range) { extra.step_min = Math.floor(range[0]); extra.step_max = Math.ceil(range[1]); }
      let data;
      try {
        data = await getJSON(metricsUrl(this.opts.runId, names, extra));
      } catch (err) {
        this.loading = null;
        throw err;
      }
      const waiting = this.loading;
      this.loading = null;
      for (const s of data.series) {
        const series = this.ensure(s.name, s.domain);
        const xs = s.points.map(p => p[0]), ys = s.points.map(p => p[1]);
        if (range) {
          // replace the window, keep what lies outside it
          const keepX = [], keepY = [];
          series.x.forEach((x, i) => { if (x < extra.step_min || x > extra.step_max) { keepX.push(x); keepY.push(series.y[i]); } });
          const merged = keepX.map((x, i) => [x, keepY[i]]).concat(xs.map((x, i) => [x, ys[i]])).sort((a, b) => a[0] - b[0]);
          series.x = merged.map(p => p[0]);
          series.y = merged.map(p => p[1]);
        } else {
          series.x = xs;
          series.y = ys;
        }
        s.points.forEach(p => { if (p[2] > this.maxSeq) this.maxSeq = p[2]; });
      }
      this.loadedSeq = Math.max(this.loadedSeq, data.last_seq);
      for (const p of waiting) this.add(p);
      this.touch();
      return data.last_seq;
    }

    /** A live point [name, domain, step, value, seq]. */
    add(p) {
      if (this.opts.overall && p[1] !== null && p[1] !== undefined) return;
      if (this.loading) { this.loading.push(p); return; }
      if (p[4] <= this.loadedSeq) return;
      const s = this.ensure(p[0], p[1]);
      const step = p[2], value = p[3];
      const n = s.x.length;
      if (n === 0 || s.x[n - 1] <= step) { s.x.push(step); s.y.push(value); }
      else {  // out of order: insert where it belongs
        let lo = 0, hi = n;
        while (lo < hi) { const mid = (lo + hi) >> 1; if (s.x[mid] <= step) lo = mid + 1; else hi = mid; }
        s.x.splice(lo, 0, step); s.y.splice(lo, 0, value);
      }
      if (p[4] > this.maxSeq) this.maxSeq = p[4];
      this.touch();
    }

    touch() {
      this.dirty = true;
      if (this.timer || this.opts.paused()) return;
      const shown = this.drawn || this.el.dataset.preview === "1";  // the first draw at once, then batched
      this.timer = setTimeout(() => { this.timer = null; this.draw(); }, shown ? REDRAW_MS : 0);
    }

    points() { let n = 0; this.series.forEach(s => { n += s.x.length; }); return n; }

    draw() {
      if (!this.dirty || this.opts.paused()) return;
      this.dirty = false;
      const alpha = this.opts.smoothing();
      const traces = [];
      let i = 0;
      const keys = Array.from(this.series.keys()).sort();
      for (const k of keys) {
        const s = this.series.get(k);
        traces.push({
          type: "scatter", mode: s.x.length > 200 ? "lines" : "lines+markers", name: s.label,
          x: s.x, y: ema(s.y, alpha), line: {width: 1.6, color: COLORS[i % COLORS.length]},
          marker: {size: 3}, hovertemplate: "step %{x}<br>%{y:.4g}<extra>" + s.label + "</extra>",
        });
        i += 1;
      }
      if (!traces.length) return;
      const d = this.def;
      const layout = {
        uirevision: "keep", height: 260, margin: {l: 48, r: 10, t: 8, b: 32},
        xaxis: {title: {text: "step"}, zeroline: false},
        yaxis: {title: {text: d.y || ""}, type: d.log ? "log" : "linear", range: d.range || undefined,
                autorange: d.range ? false : true, zeroline: false},
        legend: {orientation: "h", y: -0.25, font: {size: 10}}, showlegend: traces.length > 1,
        paper_bgcolor: "#fff", plot_bgcolor: "#fff",
      };
      const empty = this.el.querySelector(".chart-empty");
      if (empty) empty.remove();
      const card = this.el.closest(".chart-card");
      if (card) card.hidden = false;
      if (!global.Plotly) {  // plotly still loading: the same lines as SVG now, plotly's chart when it is in
        const svg = previewSvg(traces, d, this.el.clientWidth || 600, layout.height);
        if (svg) showPreview(this.el, svg);
        redrawWithPlotly(this, () => { this.dirty = true; this.draw(); }, err => { this.el.title = err.message; });
        return;
      }
      clearPreview(this.el);
      const seq = this.maxSeq;
      const first = !this.drawn;
      this.drawn = true;
      global.Plotly.react(this.el, traces, layout, {displaylogo: false, responsive: true}).then(() => {
        this.el.dataset.points = String(this.points());
        this.el.dataset.seq = String(seq);
        this.onDrawn(this, seq, first);
      });
      if (first) this.el.on("plotly_relayout", ev => this.relayout(ev));
    }

    relayout(ev) {
      if (ev["xaxis.autorange"]) { this.window = null; this.load(null).catch(console.error); return; }
      const lo = ev["xaxis.range[0]"], hi = ev["xaxis.range[1]"];
      if (lo === undefined || hi === undefined) return;
      this.window = [lo, hi];
      this.load([lo, hi]).catch(console.error);
    }
  }

  /** The run's websocket with sequence tracking, gap backfill and reconnect. */
  class LiveStream {
    constructor(runId, handlers) {
      this.runId = runId;
      this.h = handlers;           // {points(list), message(msg), state(text)}
      this.contiguous = null;      // every seq <= contiguous has been applied
      this.applied = new Set();    // applied seqs above contiguous
      this.gapTimer = null;
      this.retry = 0;
      this.closed = false;
      this.backfilling = false;
      this.lastMessage = Date.now();
    }

    start(fromSeq) { this.contiguous = fromSeq; this.connect(); }

    connect() {
      const proto = location.protocol === "https:" ? "wss" : "ws";
      const ws = new WebSocket(proto + "://" + location.host + "/ws/runs/" + this.runId + "/");
      this.ws = ws;
      ws.onopen = () => { this.retry = 0; this.h.state("live"); this.backfill(); };
      ws.onmessage = ev => {
        let msg;
        try { msg = JSON.parse(ev.data); } catch (e) { return; }
        this.lastMessage = Date.now();
        if (msg.type === "metrics") this.take(msg.points || []);
        this.h.message(msg);
      };
      ws.onclose = ev => {
        if (this.closed) return;
        if (ev.code === 4403) { this.h.state("refused"); return; }
        this.h.state("reconnecting");
        const wait = Math.min(10000, 500 * Math.pow(2, this.retry++));
        setTimeout(() => this.connect(), wait);
      };
    }

    take(points) {
      const fresh = [];
      for (const p of points) {
        const seq = p[4];
        if (seq <= this.contiguous || this.applied.has(seq)) continue;
        this.applied.add(seq);
        fresh.push(p);
      }
      while (this.applied.has(this.contiguous + 1)) { this.applied.delete(this.contiguous + 1); this.contiguous += 1; }
      if (fresh.length) this.h.points(fresh);
      if (this.applied.size && !this.gapTimer) {
        // a message was lost or is late: give it a moment, then fetch what is missing
        this.gapTimer = setTimeout(() => { this.gapTimer = null; if (this.applied.size) this.backfill(); }, 1000);
      }
    }

    async backfill() {
      if (this.backfilling || this.contiguous === null) return;
      this.backfilling = true;
      try {
        const data = await getJSON(metricsUrl(this.runId, [], {since_seq: this.contiguous}));
        const points = [];
        for (const s of data.series) for (const p of s.points) points.push([s.name, s.domain, p[0], p[1], p[2]]);
        points.sort((a, b) => a[4] - b[4]);
        this.take(points);
        if (data.last_seq > this.contiguous) {
          for (const seq of Array.from(this.applied)) if (seq <= data.last_seq) this.applied.delete(seq);
          this.contiguous = data.last_seq;
        }
      } catch (err) {
        console.warn("backfill failed", err);
      } finally {
        this.backfilling = false;
      }
    }

    stop() { this.closed = true; if (this.ws) this.ws.close(); }
  }

  global.TemperCharts = {Chart: Chart, LiveStream: LiveStream, ema: ema, getJSON: getJSON, metricsUrl: metricsUrl,
                         plotlyReady: plotlyReady, loadPlotly: loadPlotly, showPreview: showPreview,
                         clearPreview: clearPreview, redrawWithPlotly: redrawWithPlotly, COLORS: COLORS, MAX_POINTS: MAX_POINTS};
})(window);
