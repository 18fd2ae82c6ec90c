"""Trajectory listing cost per page: page 1 vs page 10,000 of a run with 1,000,000 trajectories.

Ours: cursor pagination over the (run, -id) index — every page is one index range scan.
Naive baseline, measured in the same run: LIMIT/OFFSET paging, which walks past every skipped row.
The rows are inserted in one transaction that is rolled back at the end, so the database is left as it was.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/api.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

import django

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from rest_framework.test import APIClient  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench import timed  # noqa: E402
from webapp.catalog.models import BaseModel, TaskDomain  # noqa: E402
from webapp.runs.models import Run, Trajectory  # noqa: E402

PAGE = 100


class Rollback(Exception):
    pass


def insert_rows(run: Run, domain: TaskDomain, rows: int) -> None:
    table = Trajectory._meta.db_table
    chunk = 100_000
    with tqdm(total=rows, unit="rows", desc="insert trajectories") as bar, connection.cursor() as cur:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            if connection.vendor == "postgresql":
                series = f"generate_series({start}, {start + n - 1}) AS s(i)"
                cur.execute(
                    f"""INSERT INTO {table} (run_id, domain_id, group_key, sample_index, version, prompt, completion,
                        prompt_token_ids, completion_token_ids, behaviour_logprobs, finish_reason, verdict, reward,
                        verdict_reason, verifier_details, sandbox, is_eval, created_at)
                        SELECT %s, %s, 'g' || (i / 8), i %% 8, i / 1024, 'What is ' || i || '+1?', (i + 1)::text,
                        '[]', '[]', '[]', 'stop', CASE WHEN i %% 3 = 0 THEN 'pass' ELSE 'fail' END,
                        (i %% 3 = 0)::int, '', '{{}}', '{{}}', false, now() FROM {series}""",
                    [run.pk, domain.pk],
                )
            else:
                cur.execute(
                    f"""WITH RECURSIVE s(i) AS (SELECT {start} UNION ALL SELECT i + 1 FROM s WHERE i < {start + n - 1})
                        INSERT INTO {table} (run_id, domain_id, group_key, sample_index, version, prompt, completion,
                        prompt_token_ids, completion_token_ids, behaviour_logprobs, finish_reason, verdict, reward,
                        verdict_reason, verifier_details, sandbox, is_eval, created_at)
                        SELECT %s, %s, 'g' || (i / 8), i %% 8, i / 1024, 'What is ' || i || '+1?', CAST(i + 1 AS TEXT),
                        '[]', '[]', '[]', 'stop', CASE WHEN i %% 3 = 0 THEN 'pass' ELSE 'fail' END,
                        (i %% 3 = 0), '', '{{}}', '{{}}', 0, datetime('now') FROM s""",
                    [run.pk, domain.pk],
                )
            bar.update(n)
        if connection.vendor == "postgresql":
            cur.execute(f"ANALYZE {table}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    far_page = args.rows // PAGE  # the last page: page 10,000 of 1,000,000 rows

    try:
        with transaction.atomic():
            user = get_user_model().objects.create_user(f"bench-{time.time_ns()}")
            bm = BaseModel.objects.create(owner=user, name="bench", path="/none")
            domain = TaskDomain.objects.create(owner=user, name="bench")
            run = Run.objects.create(owner=user, name="bench", base_model=bm)
            insert_rows(run, domain, args.rows)
            client = APIClient()
            client.force_authenticate(user)
            ids = Trajectory.objects.filter(run=run).order_by("-id").values_list("id", flat=True)
            position = ids[(far_page - 1) * PAGE - 1]  # the last id of the page before the far page
            cursor = base64.b64encode(urlencode({"p": position}).encode()).decode()
            base = f"/api/v1/trajectories/?run={run.pk}&page_size={PAGE}"

            def api_page(url: str) -> None:
                response = client.get(url)
                assert response.status_code == 200 and len(response.json()["results"]) == PAGE, response.content[:300]

            def check_far() -> None:
                results = client.get(f"{base}&cursor={cursor}").json()["results"]
                assert results[0]["id"] == ids[(far_page - 1) * PAGE], "far cursor page is not page N"

            check_far()
            qs = Trajectory.objects.filter(run=run).order_by("-id")

            def offset_page(page: int) -> None:
                assert len(list(qs[(page - 1) * PAGE: page * PAGE].values_list("id", "prompt"))) == PAGE

            def cursor_db_page(after: int | None) -> None:
                q = qs if after is None else qs.filter(id__lt=after)
                assert len(list(q[:PAGE].values_list("id", "prompt"))) == PAGE

            results = {
                "api_cursor_p1": timed(lambda: api_page(base), args.repeats),
                "api_cursor_pN": timed(lambda: api_page(f"{base}&cursor={cursor}"), args.repeats),
                "db_cursor_p1": timed(lambda: cursor_db_page(None), args.repeats),
                "db_cursor_pN": timed(lambda: cursor_db_page(position), args.repeats),
                "db_offset_p1": timed(lambda: offset_page(1), args.repeats),
                "db_offset_pN": timed(lambda: offset_page(far_page), max(3, args.repeats // 5)),
            }
            raise Rollback
    except Rollback:
        pass

    r = results
    print(f"\n{args.rows:,} trajectories in one run, {PAGE} per page, {connection.vendor}; median ms of "
          f"{args.repeats} requests\n")
    print(f"{'pagination':<34}{'page 1':>10}{f'page {far_page:,}':>14}{'ratio':>9}")
    rows = [
        ("ours: API, cursor (full request)", r["api_cursor_p1"], r["api_cursor_pN"]),
        ("ours: query, cursor (id < last)", r["db_cursor_p1"], r["db_cursor_pN"]),
        ("naive: query, LIMIT/OFFSET", r["db_offset_p1"], r["db_offset_pN"]),
    ]
    for name, p1, pn in rows:
        print(f"{name:<34}{p1:>10.2f}{pn:>14.2f}{pn / p1:>8.2f}x")
    print(f"\nresult: rows={args.rows} db={connection.vendor} api_p1_ms={r['api_cursor_p1']:.2f} "
          f"api_p{far_page}_ms={r['api_cursor_pN']:.2f} api_ratio={r['api_cursor_pN'] / r['api_cursor_p1']:.2f} "
          f"offset_ratio={r['db_offset_pN'] / r['db_offset_p1']:.1f}")


if __name__ == "__main__":
    main()
