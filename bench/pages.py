"""The runs list with 10,000 runs, each with metric points: server time per page.

Ours: 50 runs a page, each with its reward sparkline and throughput read by index probes; filter and
search. Naive baseline, measured in the same run: one page listing every run (the home page of session 1),
with the same sparkline and throughput per run. The rows are inserted in a transaction that is rolled
back at the end, so the database is left as it was.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/pages.py [--runs 10000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

import django

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test import Client  # noqa: E402
from django.utils import timezone  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench import timed  # noqa: E402
from webapp.catalog.models import BaseModel  # noqa: E402
from webapp.runs.models import MetricPoint, Run  # noqa: E402
from webapp.ui.views import _run_summary  # noqa: E402


class Rollback(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--points", type=int, default=40, help="reward and throughput points per run")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, float] = {}
    try:
        with transaction.atomic():
            user = get_user_model().objects.create_user(f"bench-{time.time_ns()}")
            bm = BaseModel.objects.create(owner=user, name="bench", path="/none")
            now = timezone.now()
            statuses = ["running", "completed", "paused", "failed", "cancelled"]
            runs = Run.objects.bulk_create(
                [Run(owner=user, name=f"sweep lr={i % 7} seed={i}", base_model=bm, status=statuses[i % 5],
                     step=i % 500, metric_seq=2 * args.points) for i in range(args.runs)], batch_size=2000)
            with tqdm(total=len(runs), unit="run", desc="metric points") as bar:
                for start in range(0, len(runs), 500):
                    MetricPoint.objects.bulk_create(
                        [MetricPoint(run=r, name=name, step=s, value=s / args.points, time=now,
                                     seq=1 + s + (args.points if name == "trajectories_per_s" else 0))
                         for r in runs[start:start + 500] for name in ("reward_mean", "trajectories_per_s")
                         for s in range(args.points)], batch_size=5000)
                    bar.update(min(500, len(runs) - start))
            if connection.vendor == "postgresql":
                with connection.cursor() as cur:
                    cur.execute("ANALYZE")
            client = Client()
            client.force_login(user)

            def page(url: str) -> None:
                response = client.get(url)
                assert response.status_code == 200 and b'class="spark"' in response.content

            def naive() -> None:  # every run on one page, same per-run figures
                rows = [(r, _run_summary(r)) for r in Run.objects.filter(owner=user).select_related("base_model")]
                assert len(rows) == args.runs

            results["first"] = timed(lambda: page("/"), args.repeats)
            results["last"] = timed(lambda: page(f"/?page={args.runs // 50}"), args.repeats)
            results["search"] = timed(lambda: page("/?q=seed%3D99&status=running"), args.repeats)
            results["naive"] = timed(naive, 1)
            raise Rollback
    except Rollback:
        pass
    print(f"\nruns list with {args.runs:,} runs ({connection.vendor}); median server ms of {args.repeats}\n")
    print(f"{'page':<48}{'ms':>10}")
    for label, key in (("ours: first page (50 runs, sparklines)", "first"), ("ours: last page", "last"),
                       ("ours: search + status filter", "search"), ("naive: every run on one page", "naive")):
        print(f"{label:<48}{results[key]:>10.1f}")
    print(f"ratio naive/ours: {results['naive'] / results['first']:.0f}x")
    print(f"\nresult: runs={args.runs} db={connection.vendor} first_ms={results['first']:.1f} "
          f"last_ms={results['last']:.1f} search_ms={results['search']:.1f} naive_ms={results['naive']:.0f}")


if __name__ == "__main__":
    main()
