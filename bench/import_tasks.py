"""Task import speed: our streamed, validated, batched import of 100,000 JSONL rows vs a naive baseline.

Naive baseline, measured in the same run: ``json.loads`` + one ``Task.objects.create`` per row in one
transaction (what a quick script does). Everything runs inside a transaction that is rolled back.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/import_tasks.py [--rows 100000]
"""

from __future__ import annotations

import argparse
import json
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
from tqdm import tqdm  # noqa: E402

from webapp.catalog.models import Task, TaskDomain  # noqa: E402
from webapp.catalog.task_import import import_tasks  # noqa: E402


class Rollback(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--naive-rows", type=int, default=10_000, help="rows for the (slow) naive baseline")
    args = parser.parse_args()
    lines = [json.dumps({"id": f"t{i}", "prompt": f"What is {i} + {i}?", "answer": 2 * i}).encode() + b"\n"
             for i in range(args.rows)]
    try:
        with transaction.atomic():
            user = get_user_model().objects.create_user(f"bench-{time.time_ns()}")
            ours_domain = TaskDomain.objects.create(owner=user, name="ours")
            naive_domain = TaskDomain.objects.create(owner=user, name="naive")
            with tqdm(total=args.rows, unit="rows", desc="ours") as bar:
                t0 = time.perf_counter()
                result = import_tasks(ours_domain, lines, progress=lambda n: bar.update(n - bar.n))
                ours_s = time.perf_counter() - t0
                bar.update(args.rows - bar.n)
            assert result.imported == args.rows
            t0 = time.perf_counter()
            for line in tqdm(lines[: args.naive_rows], unit="rows", desc="naive"):
                row = json.loads(line)
                Task.objects.create(domain=naive_domain, external_id=row["id"], prompt=row["prompt"],
                                    reference={"answer": str(row["answer"])})
            naive_s = time.perf_counter() - t0
            raise Rollback
    except Rollback:
        pass
    ours_rate, naive_rate = args.rows / ours_s, args.naive_rows / naive_s
    print(f"\ntask import on {connection.vendor}\n")
    print(f"{'importer':<44}{'rows':>9}{'seconds':>10}{'rows/s':>10}")
    print(f"{'ours: streamed, validated, batched, atomic':<44}{args.rows:>9}{ours_s:>10.2f}{ours_rate:>10.0f}")
    print(f"{'naive: json.loads + create() per row':<44}{args.naive_rows:>9}{naive_s:>10.2f}{naive_rate:>10.0f}")
    print(f"\nresult: db={connection.vendor} rows={args.rows} ours_s={ours_s:.2f} ours_rows_per_s={ours_rate:.0f} "
          f"naive_rows_per_s={naive_rate:.0f} speedup={ours_rate / naive_rate:.1f}")


if __name__ == "__main__":
    main()
