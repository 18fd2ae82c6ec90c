"""Generator domains, the database half: their tasks materialized into ordinary ``Task`` rows.

``do_create_generator_domain`` checks the generator and its parameters, creates the domain (kind
``generated``) and writes its fixed held-out set (``heldout-<j>``, task j of the held-out seed space) and a
first train batch. ``extend_train`` writes the next train tasks (``train-<i>`` = generator(seed, i),
skipping any whose content hash a held-out task has), under the domain's row lock so two runs admitting at
once never make the same index twice; admission calls it when a run's cursor nears the end of what exists.
So groups, trajectories, evaluation and every page keep working on Task rows, and the loop's hot path
reads rows as for an imported domain; the generation itself costs ~µs a task for the demo generators and
1-20 ms for most reasoning-gym datasets (``MAX_MS_PER_TASK`` refuses slower ones when a pack is made).

The held-out set is never regenerated: changing the parameters (difficulty) changes the train tasks made
from then on (each records its parameters in its metadata), so evaluations stay comparable across versions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from django.db import transaction
from django.db.models import F

from webapp.catalog.models import Task, TaskDomain, Verifier
from webapp.common.errors import ValidationFailed
from workers.domains import generators as gen

TRAIN_BATCH = 64
HELDOUT_SIZE = 100
MAX_MS_PER_TASK = 50.0
"""A generator slower than this per task would hold a run's admission (under its lock) too long."""


def check_generator_domain(generator: str, params: dict[str, Any] | None) -> tuple[gen.GeneratorParams, dict[str, list[str]]]:
    """The validated parameters and the problems by field (``generator``, ``generator_params``)."""
    try:
        model = gen.check_params(generator, params)
    except gen.GeneratorError as exc:
        problems: dict[str, list[str]] = {}
        for field, reason in exc.problems:
            key = "generator" if field == "generator" else "generator_params"
            problems.setdefault(key, []).append(reason if key == "generator" else f"{field.split('.', 1)[-1]}: {reason}")
        return gen.GeneratorParams.model_validate({}), problems
    return model, {}


def _row(domain: TaskDomain, split: str, index: int, task: gen.Generated, params: dict[str, Any]) -> Task:
    reference = {"generator": domain.generator, "answer": task.answer, "entry": task.entry}
    return Task(domain=domain, external_id=f"{split}-{index}", prompt=task.prompt, reference=reference,
                metadata={"generator": domain.generator, "index": index, "params": params,
                          "hash": gen.content_hash(task.prompt)}, split=split)


def do_create_generator_domain(
    owner: Any, *, name: str, generator: str, params: dict[str, Any] | None = None, seed: int = 0,
    heldout_size: int = HELDOUT_SIZE, verifier: Verifier | None = None, description: str = "", pack: str = "",
    tags: Sequence[str] = (), system_prompt: str = "",
) -> TaskDomain:
    """Create a generator domain with its held-out set and a first train batch, in one transaction."""
    model, problems = check_generator_domain(generator, params)
    if TaskDomain.objects.filter(owner=owner, name=name).exists():
        problems.setdefault("name", []).append(f"a domain named {name!r} already exists")
    if not 1 <= heldout_size <= 10_000:
        problems.setdefault("heldout_size", []).append("must be between 1 and 10000")
    if problems:
        raise ValidationFailed(f"the generator domain {name!r} is invalid", details=problems)
    stored = model.model_dump(mode="json")
    with transaction.atomic():
        domain = TaskDomain.objects.create(
            owner=owner, name=name, kind="generated", generator=generator, generator_params=stored,
            generator_seed=seed, verifier=verifier, description=description or gen.get_generator(generator).label,
            pack=pack, tags=list(tags), system_prompt=system_prompt, heldout_fraction=0.0)
        held = gen.heldout_set(generator, model, seed, heldout_size)
        Task.objects.bulk_create([_row(domain, "heldout", j, t, stored) for j, t in held])
        TaskDomain.objects.filter(pk=domain.pk).update(task_count=len(held), heldout_count=len(held))
        if not extend_train(domain.pk, TRAIN_BATCH):  # rolls the domain back
            raise ValidationFailed(
                f"the generator domain {name!r} has nothing left to train on: its problem space is no larger "
                f"than its held-out set ({len(held)} tasks); make it harder or hold out fewer",
                details={"heldout_size": [f"the held-out set takes every task ({len(held)})"]})
    domain.refresh_from_db()
    return domain


def extend_train(domain_id: int, count: int) -> int:
    """Make the next ``count`` train tasks of a generator domain (idempotent per index); returns how many."""
    with transaction.atomic():
        domain = TaskDomain.objects.select_for_update().filter(pk=domain_id).exclude(generator="").first()
        if domain is None:
            return 0
        params = gen.check_params(domain.generator, domain.generator_params)
        held = {h for h in Task.objects.filter(domain=domain, split=Task.Split.HELDOUT)
                .values_list("metadata__hash", flat=True) if h}
        made, after = gen.train_batch(domain.generator, params, domain.generator_seed, domain.generator_next,
                                      count, held)
        stored = params.model_dump(mode="json")
        Task.objects.bulk_create([_row(domain, "train", i, t, stored) for i, t in made], ignore_conflicts=True)
        TaskDomain.objects.filter(pk=domain.pk).update(generator_next=after, task_count=F("task_count") + len(made))
    return len(made)


def ms_per_task(generator: str, params: gen.GeneratorParams, seed: int, n: int = 8) -> float:
    """The generator's cost per task, measured on ``n`` calibration-space tasks (a pack refuses slow ones)."""
    start = time.perf_counter()
    for i in range(n):
        gen.generate(generator, params, seed, "calibration", 1000 + i)
    return (time.perf_counter() - start) * 1000.0 / n
