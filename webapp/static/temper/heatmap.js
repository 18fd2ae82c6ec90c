/* The run page's domains × steps heatmap: one plotly heatmap for any number of domains.
 *
 * - Loads /api/v1/runs/<id>/heatmap/?metric= (per-domain points averaged per bucket of steps, in SQL).
 * - Sorts rows by name, by last value or by gain (last − first), in the browser; names the most improved
 *   and most regressed domains (from the server's answer).
 * - Live: a websocket point of the shown metric schedules a reload, at most one every 3 s.
 * - Until plotly has run (charts.js: it runs after the first chart), the cells are drawn on a canvas.
 */
(function (global) {
  "use strict";
  const RELOAD_MS = 3000;

  class Heatmap {
    constructor(el, opts) {
      this.el = el;
      this.opts = opts;   // {api, metric: <select>, sort: <select>, named: <el>, paused(), onDrawn()}
      this.data = null;
      this.timer = null;
      this.loads = 0;
      opts.metric.addEventListener("change", () => this.load());
      opts.sort.addEventListener("change", () => this.draw());
    }

    metric() { return this.opts.metric.value; }

    async load() {
      const r = await fetch(this.opts.api + "?metric=" + encodeURIComponent(this.metric()),
                            {credentials: "same-origin", headers: {Accept: "application/json"}});
      if (!r.ok) throw new Error("heatmap answered " + r.status);
      this.data = await r.json();
      this.loads += 1;
      this.draw();
    }

    schedule() {
      if (this.timer) return;
      this.timer = setTimeout(() => {
        this.timer = null;
        if (this.opts.paused()) { this.schedule(); return; }
        this.load().catch(console.error);
      }, RELOAD_MS);
    }

    rows() {
      const rows = this.data.domains.slice();
      const by = this.opts.sort.value;
      const num = v => (v === null || v === undefined ? -Infinity : v);
      if (by === "last") rows.sort((a, b) => num(b.last) - num(a.last) || a.name.localeCompare(b.name));
      else if (by === "gain") rows.sort((a, b) => num(b.gain) - num(a.gain) || a.name.localeCompare(b.name));
      else rows.sort((a, b) => a.name.localeCompare(b.name));
      return rows;
    }

    draw() {
      if (!this.data) return;
      const rows = this.rows(), d = this.data;
      const fmt = g => (g > 0 ? "+" : "") + g.toFixed(3);
      const named = [];
      if (d.improved.length) named.push("most improved: " + d.improved.map(x => x.name + " (" + fmt(x.gain) + ")").join(", "));
      if (d.regressed.length) named.push("most regressed: " + d.regressed.map(x => x.name + " (" + fmt(x.gain) + ")").join(", "));
      this.opts.named.textContent = named.join(" · ") || (d.steps.length ? "no domain has moved yet" : "no points yet");
      const empty = this.el.querySelector(".chart-empty");
      if (!d.steps.length) return;
      if (empty) empty.remove();
      const charts = global.TemperCharts;
      if (!global.Plotly) {  // plotly has not run yet (charts.js): the same cells on a canvas until it has
        this.preview(rows);
        charts.redrawWithPlotly(this, () => this.draw(), err => { this.opts.named.textContent = err.message; });
        return;
      }
      charts.clearPreview(this.el);
      const trace = {
        type: "heatmap", z: rows.map(r => r.values), x: d.steps, y: rows.map(r => r.name),
        zmin: 0, zmax: 1, colorscale: "Viridis", hoverongaps: false, xgap: 0, ygap: 1,
        colorbar: {thickness: 10, len: 0.9},
        hovertemplate: "%{y}<br>step %{x}<br>" + d.metric + " %{z:.3f}<extra></extra>",
      };
      const layout = {
        uirevision: "keep", height: Math.max(220, 60 + 14 * rows.length), margin: {l: 10, r: 10, t: 8, b: 36},
        xaxis: {title: {text: d.metric === "heldout_reward" ? "step (evaluated versions)" : "step"},
                type: d.metric === "heldout_reward" ? "category" : "linear"},
        yaxis: {autorange: "reversed", automargin: true, tickfont: {size: 10}, type: "category"},
        paper_bgcolor: "#fff", plot_bgcolor: "#fff",
      };
      global.Plotly.react(this.el, [trace], layout, {displaylogo: false, responsive: true}).then(() => {
        this.el.dataset.rows = String(rows.length);
        this.el.dataset.order = rows.map(r => r.name).join("|");
        this.el.dataset.loads = String(this.loads);
        this.opts.onDrawn();
      });
    }
  }

  // plotly's Viridis, for the canvas preview
  const VIRIDIS = ["#440154", "#48186a", "#472d7b", "#424086", "#3b528b", "#33638d", "#2c728e", "#26828e", "#21918c",
                   "#1fa088", "#28ae80", "#3fbc73", "#5ec962", "#84d44b", "#addc30", "#d8e219", "#fde725"]
    .map(h => [1, 3, 5].map(i => parseInt(h.slice(i, i + 2), 16)));

  function viridis(z) {
    const t = Math.min(1, Math.max(0, z)) * (VIRIDIS.length - 1), i = Math.min(VIRIDIS.length - 2, Math.floor(t));
    const f = t - i, a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return "rgb(" + a.map((v, k) => Math.round(v + (b[k] - v) * f)).join(",") + ")";
  }

  /** The heatmap's cells on a canvas, names on the left, steps below: what plotly draws, without hover. */
  Heatmap.prototype.preview = function (rows) {
    const steps = this.data.steps, width = this.el.clientWidth || 800;
    const height = Math.max(220, 60 + 14 * rows.length), T = 8, B = 36, R = 10;
    const canvas = document.createElement("canvas");
    canvas.className = "chart-preview";
    const scale = global.devicePixelRatio || 1;
    canvas.width = width * scale; canvas.height = height * scale;
    canvas.style.width = width + "px"; canvas.style.height = height + "px";
    const ctx = canvas.getContext("2d");
    ctx.scale(scale, scale);
    ctx.font = "10px sans-serif";
    const L = 6 + Math.min(width / 3, Math.max(0, ...rows.map(r => ctx.measureText(r.name).width)));
    const cw = (width - L - R) / steps.length, ch = (height - T - B) / rows.length;
    ctx.fillStyle = "#444"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
    rows.forEach((r, i) => {
      ctx.fillText(r.name, L - 4, T + (i + 0.5) * ch, L - 6);
      r.values.forEach((z, j) => {
        if (z === null || z === undefined) return;
        ctx.fillStyle = viridis(z);
        ctx.fillRect(L + j * cw, T + i * ch, Math.ceil(cw), Math.max(1, ch - 1));
      });
      ctx.fillStyle = "#444";
    });
    ctx.textBaseline = "top";
    [[0, "left"], [steps.length - 1, "right"]].forEach(([j, align]) => {
      ctx.textAlign = align;
      ctx.fillText(String(steps[j]), align === "left" ? L : width - R, height - B + 4);
    });
    ctx.textAlign = "center";
    ctx.fillText("step", (L + width - R) / 2, height - B + 18);
    global.TemperCharts.showPreview(this.el, canvas);
  };

  global.TemperHeatmap = Heatmap;
})(window);
