"""What the loop's bookkeeping costs a step as a run grows: the same calls on a short run and on a long one.

    .venv/bin/python bench/longrun.py [--groups 200000] [--small 2000] [--repeat 20]
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/temper_longrun .venv/bin/python bench/longrun.py

Two runs of the demo's addition tasks (in a domain of their own, ``longrun addition``) in one database
(SQLite under ``var/bench/longrun.sqlite3`` unless ``DATABASE_URL`` is set; the rows are kept between runs,
as writing them takes a while; on PostgreSQL the tables are vacuumed and analysed first, as autovacuum
would): a short one
(``--small`` groups) and a long one (``--groups``: at the demo's 16 prompts a step, 200,000 groups are 12,500
steps, or 1,560 steps of a run over a hundred domains at 128 prompts a step). Each group has its 8 samples;
one group in 8 was dropped (``bench/pipeline.py`` drops 10-15 % too stale) and the rest trained, 16 a step,
and each run holds a pipeline's worth of open groups: a batch ready to train, more being judged and waiting
for a rollout. On each run, the median of ``--repeat`` calls of what the loop pays every step:

* tick: ``tick.advance`` (its snapshot, the scheduler's decision, a train step claimed and a chunk admitted:
  checked first), what a verify wave or a finished train step pays each time it takes the run's next step;
* step record: ``training.finish``, the GPU worker's record of a trained batch;
* step report: ``reporting.step_points``, a step's metric points;
* health: ``alerts.gather``, the health check after every step;
* run page: what a user waits for on ``/runs/<id>/`` (its group counts, its versions' first page, its events);

each in a transaction rolled back (its begin and rollback timed with it), so every repeat sees the same rows. The baseline, on the same rows: what a
tick and a report read before each run kept its trained count (``Run.trained_groups``): the group table's
trained and per-domain counts, its dropped groups for domains that do not fit, and every group's status.

The last line: ``result: tick_small_ms=… tick_large_ms=… tick_growth=… before_large_ms=… record_growth=…``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import timed  # noqa: E402

B, G = 16, 8
"""Groups a step, samples a group: the demo run's."""
OPEN = {"ready": B, "verifying": 2 * B, "admitted": B}
"""The open groups each run holds while it is timed: a batch to claim, two being judged, one waiting."""


def build(name: str, n: int, domain: Any, owner: Any, base_model: Any) -> Any:
    """A running run of ``n`` groups (1 in 8 dropped, the rest trained B a step) plus ``OPEN``, made once."""
    from django.db import transaction
    from tqdm import tqdm

    from bench.pipeline import spec_for
    from webapp.runs.models import PolicyVersion, PromptGroup, Run, RunStatus, Trajectory
    from webapp.runs.services import DomainWeight, do_create_run

    found = Run.objects.filter(name=name, state__bench_built=True).first()
    if found is not None:
        return found
    Run.objects.filter(name=name).delete()
    args = argparse.Namespace(staleness=3, batch=B, rollout_batch=None, group=G, episodes=False)
    run = do_create_run(owner, name=name, base_model=base_model, domains=[DomainWeight(domain)],
                        spec=spec_for("async", args))
    tasks = list(domain.tasks.filter(split="train").values_list("pk", "prompt"))
    trained = 0
    chunk = 2_000
    with tqdm(total=n, desc=f"writing {name}", unit=" groups", file=sys.stderr) as bar:
        for start in range(0, n, chunk):
            groups, samples = [], []
            for i in range(start, min(n, start + chunk)):
                task_id, prompt = tasks[i % len(tasks)]
                dropped = i % 8 == 7
                step = None if dropped else trained // B + 1
                trained += not dropped
                key = uuid.uuid4().hex
                groups.append(PromptGroup(
                    run=run, key=key, task_id=task_id, domain=domain, status="dropped" if dropped else "trained",
                    admitted_version=max(0, (step or 1) - 2), generated_version=max(0, (step or 1) - 1),
                    n_samples=G, trained_step=step, drop_reason="staler than 3 version(s)" if dropped else ""))
                samples += [Trajectory(run=run, task_id=task_id, domain=domain, group_key=key, sample_index=s,
                                       version=max(0, (step or 1) - 1), prompt=prompt, completion="42\n",
                                       prompt_token_ids=list(range(8)), completion_token_ids=[5, 6, 7],
                                       behaviour_logprobs=[-0.5, -0.25, -0.1], finish_reason="stop",
                                       verdict="pass" if s % 2 else "fail", reward=float(s % 2),
                                       advantage=None if dropped else 0.5, trained_step=step) for s in range(G)]
            with transaction.atomic():
                PromptGroup.objects.bulk_create(groups, batch_size=500)
                Trajectory.objects.bulk_create(samples, batch_size=500)
            bar.update(len(groups))
    steps = trained // B
    PromptGroup.objects.filter(run=run, trained_step__gt=steps).update(status="dropped", trained_step=None,
                                                                       drop_reason="run paused before it was trained")
    Trajectory.objects.filter(run=run, trained_step__gt=steps).update(trained_step=None)
    PolicyVersion.objects.bulk_create([PolicyVersion(run=run, number=v, step=v, path=f"/versions/{v}",
                                                     metrics={"loss": 0.1, "reward_mean": 0.5, "reported": True})
                                       for v in range(1, steps + 1)], batch_size=2_000)
    opened = []
    for status, count in OPEN.items():
        for _ in range(count):
            task_id, _prompt = tasks[(n + len(opened)) % len(tasks)]
            opened.append(PromptGroup(run=run, key=uuid.uuid4().hex, task_id=task_id, domain=domain, status=status,
                                      admitted_version=steps, generated_version=None if status == "admitted" else steps,
                                      n_samples=0 if status == "admitted" else G))
    PromptGroup.objects.bulk_create(opened)
    Trajectory.objects.bulk_create([
        Trajectory(run=run, task_id=g.task_id, domain=domain, group_key=g.key, sample_index=s, version=steps,
                   prompt="", completion="42\n", verdict="pass" if g.status == "ready" else "pending")
        for g in opened if g.status != "admitted" for s in range(G)])
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.PAUSED, step=steps, latest_version=steps, trained_groups={str(domain.pk): steps * B},
        state={"bench_built": True, "fitted": [domain.pk], "cursor": {str(domain.pk): tasks[0][0]}})
    return Run.objects.get(pk=run.pk)


def rolled_back(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` in a transaction rolled back, so every call sees the rows as built."""
    from django.db import transaction

    def call() -> None:
        with transaction.atomic():
            fn()
            transaction.set_rollback(True)

    return call


def measure(run: Any, repeat: int) -> dict[str, float]:
    from django.db import transaction
    from django.db.models import Count
    from django.test import Client
    from django.utils import timezone

    from webapp.runs.loop import alerts, reporting, tick, training
    from webapp.runs.models import PolicyVersion, PromptGroup, Run, RunStatus
    from workers.pipeline.spec import RunSpec

    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)  # one running run: no fair share to weigh
    try:
        run = Run.objects.get(pk=run.pk)
        spec = RunSpec.model_validate(run.spec)
        version = PolicyVersion.objects.get(run=run, number=run.step)
        ready = list(PromptGroup.objects.filter(run=run, status="ready"))

        def record() -> None:
            PromptGroup.objects.filter(pk__in=[g.pk for g in ready]).update(status="training", trained_step=run.step + 1)
            training.finish(run, run.step + 1, ready, version_path=Path("/versions/next"), metrics={},
                            finished_at=time.time())

        def before() -> None:  # the reads a tick and a report made before Run.trained_groups
            groups = PromptGroup.objects.filter(run=run)
            groups.filter(status="trained").count()
            dict(groups.exclude(status="dropped").values_list("domain_id").annotate(n=Count("id")).order_by())
            dict(groups.filter(status="dropped", drop_reason__startswith="the prompt is").values_list("domain_id")
                 .annotate(n=Count("id")).order_by())
            dict(groups.values_list("status").annotate(n=Count("id")).order_by())

        with transaction.atomic():  # what the timed tick does: claims the ready batch and admits a chunk
            waiting = PromptGroup.objects.filter(run=run, status="admitted").count()
            claimed = tick.advance_holding_train(run.pk, "bench")
            admitted = PromptGroup.objects.filter(run=run, status="admitted").count() - waiting
            transaction.set_rollback(True)
        if claimed != run.step + 1 or admitted <= 0:
            raise SystemExit(f"{run.name}: the tick claimed {claimed} and admitted {admitted}; expected step "
                             f"{run.step + 1} and a chunk")
        client = Client()
        client.force_login(run.owner)

        def page() -> None:  # what a user waits for: the run page, its counts and its versions' first page
            response = client.get(f"/runs/{run.pk}/")
            if response.status_code != 200:
                raise SystemExit(f"{run.name}: the run page answered {response.status_code}")

        page()
        figures = {
            "page": timed(page, repeat),
            "tick": timed(rolled_back(lambda: tick.advance_holding_train(run.pk, "bench")), repeat),
            "record": timed(rolled_back(record), repeat),
            "report": timed(rolled_back(lambda: reporting.step_points(run, version)), repeat),
            "health": timed(rolled_back(lambda: alerts.gather(run, spec, timezone.now())), repeat),
            "before": timed(rolled_back(before), repeat),
        }
        return figures
    finally:
        Run.objects.filter(pk=run.pk).update(status=RunStatus.PAUSED)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=200_000, help="groups of the long run")
    parser.add_argument("--small", type=int, default=2_000, help="groups of the short run")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    workdir = Path(os.environ.get("TEMPER_VAR_DIR", REPO / "var")) / "bench"
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DATABASE_URL", f"sqlite:///{workdir / 'longrun.sqlite3'}")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    from bench.pipeline import ensure_postgres_database

    ensure_postgres_database(os.environ["DATABASE_URL"])
    import django

    django.setup()
    import logging

    logging.getLogger("webapp.runs.loop.live").setLevel(logging.ERROR)  # no Redis here: nobody is watching
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection

    from webapp.catalog.models import BaseModel, TaskDomain, Verifier
    from webapp.catalog.services import do_import_tasks
    from webapp.common.management.commands.seed_demo import DEMO_MODEL_DIR
    from workers.policy.demo_model import _split_pool

    call_command("migrate", verbosity=0)
    owner, _ = get_user_model().objects.get_or_create(username="bench")
    base_model, _ = BaseModel.objects.get_or_create(owner=owner, name="demo", defaults={"path": DEMO_MODEL_DIR})
    verifier, _ = Verifier.objects.get_or_create(owner=owner, name="exact", defaults={"kind": "exact_match"})
    domain, created = TaskDomain.objects.get_or_create(owner=owner, name="longrun addition",
                                                       defaults={"kind": "answer", "verifier": verifier})
    if created:
        do_import_tasks(domain, (json.dumps({"prompt": p, "answer": a, "split": "train"})
                                 for p, a in _split_pool("addition", "train")))
    runs = {"short": build(f"longrun {args.small}", args.small, domain, owner, base_model),
            "long": build(f"longrun {args.groups}", args.groups, domain, owner, base_model)}
    if connection.vendor == "postgresql":  # as autovacuum would: the planner's statistics after the bulk write,
        with connection.cursor() as cursor:  # and the dead rows of an earlier bench's rolled-back ticks gone
            cursor.execute("VACUUM ANALYZE runs_promptgroup, runs_trajectory, runs_policyversion, runs_run")
    results = {label: measure(run, args.repeat) for label, run in runs.items()}

    rows = [("tick: snapshot, decision, claim, admission", "tick"), ("step record (GPU worker)", "record"),
            ("step report", "report"), ("health check", "health"), ("run page (GET /runs/<id>/)", "page"),
            ("baseline: the counts a tick and a report read before", "before")]
    print(f"\ndatabase {connection.vendor}; median of {args.repeat} calls, ms")
    print(f"{'':54s}{'short run':>12s}{'long run':>12s}{'long/short':>12s}")
    print(f"{'groups':54s}{args.small:>12,d}{args.groups:>12,d}")
    print(f"{'steps':54s}{runs['short'].step:>12,d}{runs['long'].step:>12,d}")
    for title, key in rows:
        short, long = results["short"][key], results["long"][key]
        print(f"{title:54s}{short:12.2f}{long:12.2f}{long / short:12.2f}")
    growth = {k: results["long"][k] / results["short"][k] for k in ("tick", "record", "report", "health", "page", "before")}
    print("\nresult: " + " ".join([
        f"tick_small_ms={results['short']['tick']:.2f}", f"tick_large_ms={results['long']['tick']:.2f}",
        f"tick_growth={growth['tick']:.2f}", f"record_growth={growth['record']:.2f}",
        f"report_growth={growth['report']:.2f}", f"health_growth={growth['health']:.2f}",
        f"page_large_ms={results['long']['page']:.2f}", f"page_growth={growth['page']:.2f}",
        f"before_large_ms={results['long']['before']:.2f}", f"before_growth={growth['before']:.2f}",
        f"groups={args.groups}", f"db={connection.vendor}"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
