"""Admission, the database half: turning the scheduler's "admit n of domain d" into prompt groups.

New prompts are read through a per-domain keyset cursor in ``Run.state["cursor"]`` (the next train tasks
after the last admitted one, wrapping into the next epoch). A generator domain's train stream is endless:
when the cursor nears the end of the tasks made so far, the next batch is made first
(``catalog.generated.extend_train``), so its tasks are never repeated. Retries come first: each is a new
group for the prompt of an earlier group that got an invalid verdict. A domain none of whose prompts has
fitted the model's context is set aside for the run (``set_aside_unfit``). Called under the caller's lock on
the run.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from django.db.models import Count

from webapp.catalog.generated import TRAIN_BATCH, extend_train
from webapp.catalog.models import Task, TaskDomain
from webapp.runs import services
from webapp.runs.models import PromptGroup, Run

UNFIT = "the prompt is"
"""How the drop reason of a prompt longer than the model's context starts (``generation.refusal``)."""

UNFIT_LIMIT = 8
"""A domain whose first this many groups in a run were all dropped for prompts longer than the model's
context, and none generated, is set aside: admitted by weighted deficit, its groups would be dropped for
ever (reasoning-gym's modulo_grid on demo-long: 3,114 of a 77-domain run's first 4,377 groups)."""


def next_tasks(run: Run, domain_id: int, n: int, *, generated: bool = False) -> list[Task]:
    """The next ``n`` train tasks of a domain after the run's data cursor, wrapping around (epochs); a
    generator domain makes more instead of wrapping (it wraps only if its generator stops making new ones)."""
    cursor: dict[str, int] = run.state.setdefault("cursor", {})
    after = cursor.get(str(domain_id), 0)
    base = Task.objects.filter(domain_id=domain_id, split=Task.Split.TRAIN).order_by("id")
    tasks = list(base.filter(id__gt=after)[:n])
    if generated and len(tasks) < n and extend_train(domain_id, max(TRAIN_BATCH, 2 * n)):
        tasks = list(base.filter(id__gt=after)[:n])
    if len(tasks) < n:
        tasks += list(base[: n - len(tasks)])  # next epoch
    if tasks:
        cursor[str(domain_id)] = tasks[-1].pk
    return tasks


def set_aside_unfit(run: Run, admitting: Iterable[int] = ()) -> set[int]:
    """The run's domains set aside because no prompt of theirs fits the model (``Run.state["set_aside"]``:
    domain id -> why), its own and those of ``admitting``; each newly set aside gets an event."""
    aside: dict[str, str] = run.state.setdefault("set_aside", {})
    # A domain one of whose groups was generated fits: it is never set aside, and is not looked at again
    # (``Run.state["fitted"]``), so a run whose domains all fit reads nothing here (counting the run's dropped
    # groups at every admission took 14 ms at 25,000 of them on SQLite: bench/longrun.py)
    fitted: list[int] = run.state.setdefault("fitted", [])
    unknown = ({*run.run_domains.values_list("domain_id", flat=True), *admitting}
               - {int(k) for k in aside} - set(fitted))
    if unknown:
        fitted += sorted(set(PromptGroup.objects.filter(run=run, domain_id__in=unknown, generated_version__isnull=False)
                             .order_by().values_list("domain_id", flat=True).distinct()))
        unknown -= set(fitted)
    if not unknown:
        return {int(k) for k in aside}
    unfit = dict(PromptGroup.objects.filter(run=run, status=PromptGroup.Status.DROPPED, drop_reason__startswith=UNFIT,
                                            domain_id__in=unknown).values_list("domain_id").annotate(n=Count("id"))
                 .order_by())
    candidates = [d for d, n in unfit.items() if d is not None and n >= UNFIT_LIMIT]
    if candidates:
        for domain_id in sorted(candidates):
            last = (PromptGroup.objects.filter(run=run, domain_id=domain_id, drop_reason__startswith=UNFIT)
                    .select_related("domain").order_by("-id").first())
            assert last is not None and last.domain is not None
            why = f"none of its {unfit[domain_id]} prompts so far fits the model: {last.drop_reason}"
            aside[str(domain_id)] = why
            services.record_event(run, "domain.set_aside", f"domain {last.domain.name} set aside: {why}",
                                  level="warning", data={"domain": domain_id, "dropped": unfit[domain_id]})
    return {int(k) for k in aside}


def admit(run: Run, admit: dict[int, int], retry: dict[int, int]) -> list[int]:
    """Create the admitted groups and return their ids (retries first)."""
    aside = set_aside_unfit(run, admit)
    admit = {d: n for d, n in admit.items() if d not in aside}
    groups = []
    for domain_id, n in retry.items():
        earlier = list(PromptGroup.objects.filter(run=run, retry_pending=True, domain_id=domain_id).order_by("id")[:n])
        PromptGroup.objects.filter(pk__in=[g.pk for g in earlier]).update(retry_pending=False)
        groups += [PromptGroup(run=run, key=uuid.uuid4().hex, task_id=g.task_id, domain_id=domain_id,
                               admitted_version=run.latest_version, retries=g.retries + 1, retry_of=g)
                   for g in earlier]
    exhausted = set(run.state.get("exhausted", []))
    generators = set(TaskDomain.objects.filter(pk__in=list(admit)).exclude(generator="").values_list("pk", flat=True))
    for domain_id, n in admit.items():
        tasks = next_tasks(run, domain_id, n, generated=domain_id in generators)
        if not tasks:
            exhausted.add(domain_id)
        groups += [PromptGroup(run=run, key=uuid.uuid4().hex, task=task, domain_id=domain_id,
                               admitted_version=run.latest_version) for task in tasks]
    run.state["exhausted"] = sorted(exhausted)
    PromptGroup.objects.bulk_create(groups)
    Run.objects.filter(pk=run.pk).update(state=run.state)
    if aside and not groups and set(run.run_domains.values_list("domain_id", flat=True)) <= aside | exhausted:
        services.do_fail_run(run, f"no domain is left to admit from: {len(aside)} set aside, as none of their "
                                  f"prompts fits the model ({next(iter(run.state['set_aside'].values()))})")
    return [g.pk for g in groups]
