/* The run page: charts fed by LiveStream, status and controls, and the event log. */
(function () {
  "use strict";
  const cfg = JSON.parse(document.getElementById("page-config").textContent);
  const {Chart, LiveStream, getJSON} = window.TemperCharts;
  const runId = cfg.run;
  const smoothingInput = document.getElementById("smoothing");
  const smoothingValue = document.getElementById("smoothing-value");
  const pauseLive = document.getElementById("pause-live");
  const live = document.getElementById("live-indicator");
  const claimed = new Set();
  cfg.charts.filter(d => !d.other).forEach(d => d.names.forEach(n => claimed.add(n)));
  const prefixes = cfg.charts.flatMap(d => d.prefixes || []);
  const isOther = name => !claimed.has(name) && !prefixes.some(p => name.startsWith(p));

  // Timestamps of drawn points, for bench/streaming.py (seq -> wall-clock ms when it was on screen).
  window.temperDrawn = [];
  const label = (name, domain) =>
    domain === null || domain === undefined ? name : name + " · " + (cfg.domains[String(domain)] || "domain " + domain);
  const opts = {
    runId: runId, names: cfg.names, label: label, isOther: isOther, overall: cfg.manyDomains,
    smoothing: () => Number(smoothingInput.value), paused: () => pauseLive.checked,
    onDrawn: (chart, seq) => { window.temperDrawn.push({chart: chart.def.id, seq: seq, t: Date.now()}); },
  };
  const charts = cfg.charts.map(def => new Chart(document.getElementById("chart-" + def.id), def, opts));
  window.temperCharts = charts;

  const heatmapEl = document.getElementById("heatmap");
  const heatmap = heatmapEl ? new window.TemperHeatmap(heatmapEl, {
    api: cfg.apiRun + "heatmap/", metric: document.getElementById("heatmap-metric"),
    sort: document.getElementById("heatmap-sort"), named: document.getElementById("heatmap-named"),
    paused: () => pauseLive.checked,
    onDrawn: () => { window.temperDrawn.push({chart: "heatmap", seq: 0, t: Date.now()}); },
  }) : null;
  window.temperHeatmap = heatmap;
  const heatmapLoaded = heatmap ? heatmap.load().catch(err => { document.getElementById("chart-note").textContent = "heatmap: " + err.message; })
    : Promise.resolve();

  const stream = new LiveStream(runId, {
    points: points => {
      for (const p of points) for (const c of charts) if (c.matches(p[0])) c.add(p);
      if (heatmap && points.some(p => p[0] === heatmap.metric() && p[1] !== null)) heatmap.schedule();
    },
    message: onMessage,
    state: text => { live.textContent = (text === "live" ? "● " : "○ ") + text; live.className = "live " + text; },
  });

  // Load the charts one after another (the first draws first), then go live from the lowest loaded seq;
  // every chart ignores points it already has, so nothing is drawn twice.
  // plotly.js runs once the first chart with points and the heatmap are drawn (as SVG and canvas, charts.js
  // and heatmap.js), or once every chart is loaded: its parse is one long task that would hold their answers.
  (async function loadAll() {
    let first = null, plotlyQueued = false;
    for (const c of charts) {
      try {
        const seq = await c.load(null);
        if (first === null && seq !== undefined) first = seq;
        if (first === null) first = 0;
        if (stream.contiguous === null) stream.start(first);
        c.draw();
      } catch (err) {
        document.getElementById("chart-note").textContent = "could not load a chart: " + err.message;
      }
      if (!plotlyQueued && (c.el.dataset.preview === "1" || c.drawn)) {
        plotlyQueued = true;
        heatmapLoaded.then(() => window.TemperCharts.loadPlotly());
      }
    }
    if (!plotlyQueued) {  // no chart has points: run plotly once the heatmap is drawn (or has had 3 s)
      await Promise.race([heatmapLoaded, new Promise(resolve => setTimeout(resolve, 3000))]);
      window.TemperCharts.loadPlotly();
    }
    if (stream.contiguous === null) stream.start(0);
    window.temperLoaded = true;
  })();

  smoothingInput.addEventListener("input", () => {
    smoothingValue.textContent = smoothingInput.value;
    charts.forEach(c => { c.dirty = true; c.draw(); });
  });
  pauseLive.addEventListener("change", () => {
    document.getElementById("chart-note").textContent = pauseLive.checked ? "live updates paused: new points wait" : "";
    if (!pauseLive.checked) charts.forEach(c => c.touch());
  });

  // --- status, controls, events ---------------------------------------------------------------
  const statusEl = document.getElementById("run-status");
  const stepEl = document.getElementById("run-step");
  const reasonEl = document.getElementById("run-reason");
  const eventsEl = document.getElementById("events");
  let lastEvent = Math.max(0, ...Array.from(eventsEl.querySelectorAll("li[data-id]")).map(li => Number(li.dataset.id)));

  function showRun(run) {
    statusEl.textContent = run.status;
    statusEl.dataset.status = run.status;
    statusEl.className = "status status-" + run.status;
    stepEl.textContent = "step " + run.step + " · v" + run.latest_version;
    reasonEl.hidden = !run.status_reason;
    reasonEl.textContent = run.status_reason || "";
    document.querySelectorAll("form.control").forEach(f => {
      const allowed = cfg.allowed[f.dataset.action] || [];
      f.querySelector("button").disabled = !allowed.includes(run.status);
    });
  }

  function addEvent(e) {
    if (e.id && e.id <= lastEvent) return;
    if (e.id) lastEvent = e.id;
    const empty = eventsEl.querySelector(".empty");
    if (empty) empty.remove();
    const li = document.createElement("li");
    li.className = "ev-" + (e.level || "info");
    if (e.id) li.dataset.id = e.id;
    const t = document.createElement("time");
    t.textContent = new Date(e.created_at || Date.now()).toLocaleTimeString([], {hour12: false});
    const code = document.createElement("code");
    code.textContent = e.kind;
    li.append(t, " ", code, " ", e.message || "");
    eventsEl.append(li);
    if (eventsEl.children.length > 500) eventsEl.firstElementChild.remove();
  }

  // The websocket's payloads, as typed in webapp/runs/loop/live.py (one of three, by "type"):
  //   {"type": "metrics", "points": [[name, domain_id, step, value, seq], ...], "first_seq", "last_seq"}
  //        (charts.js takes these; a gap in seq is backfilled over /api/v1/metrics/?since_seq=)
  //   {"type": "event", "event": {"id", "kind", "level", "message", "data", "created_at"}}
  //   {"type": "run", "status", "status_reason", "step", "latest_version"}
  function onMessage(msg) {
    if (msg.type === "event" && msg.event) addEvent(msg.event);
    if (msg.type === "run" && msg.status) showRun(Object.assign({}, lastRun, msg));
  }

  let lastRun = {status: cfg.status, step: 0, latest_version: 0};
  async function refresh() {
    try {
      lastRun = await getJSON(cfg.apiRun);
      showRun(lastRun);
      // A safety net under the websocket: points the database has and the page lacks (a broadcast that
      // failed, a channel layer that is down) are fetched once no message has brought them for 3 s.
      if (stream.contiguous !== null && lastRun.metric_seq > stream.contiguous && Date.now() - stream.lastMessage > 3000) {
        stream.backfill();
      }
      const events = await getJSON(cfg.apiRun + "events/?after=" + lastEvent);
      events.forEach(addEvent);
    } catch (err) { /* the next tick tries again */ }
  }
  setInterval(refresh, 2000);

  function csrf(form) { return form.querySelector("input[name=csrfmiddlewaretoken]").value; }
  document.querySelectorAll("form.control").forEach(form => {
    form.addEventListener("submit", async ev => {
      ev.preventDefault();
      if (form.dataset.confirm && !window.confirm(form.dataset.confirm)) return;
      const body = {};
      const force = form.querySelector("input[name=force]");
      if (force) body.force = force.checked;
      const r = await fetch(cfg.apiRun + form.dataset.action + "/", {
        method: "POST", credentials: "same-origin",
        headers: {"Content-Type": "application/json", "X-CSRFToken": csrf(form), Accept: "application/json"},
        body: JSON.stringify(body),
      });
      const data = await r.json().catch(() => ({}));
      if (!r.ok) {
        addEvent({kind: "refused", level: "error", message: data.detail || ("the server answered " + r.status)});
        return;
      }
      lastRun = data;
      showRun(data);
      refresh();
    });
  });
})();
