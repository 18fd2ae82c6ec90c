/* The run page's domains × steps heatmap: one plotly heatmap for any number of domains.
 *
 * - Loads /api/v1/runs/<id>/heatmap/?metric= (per-domain points averaged per bucket of steps, in SQL).
 * - Sorts rows by name, by last value or by gain (last − first), in the browser; names the most improved
 *   and most regressed domains (from the server's answer).
 * - Live: a websocket point of the shown metric schedules a reload, at most one every 3 s.
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

  global.TemperHeatmap = Heatmap;
})(window);
