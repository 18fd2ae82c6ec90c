"""Domain packs: many generator domains created in one action, each with its own calibrated verifier.

``do_create_pack`` takes a list of ``PackItem`` (a generator and its parameters) — a built-in pack's
(``PACKS``: ``demo``, and ``reasoning-gym`` with the extra installed, one domain per dataset) or the
caller's — and for each one, in a savepoint of its own: checks the parameters, measures the generator's
cost per task, builds calibration cases (the generator's own answers as known-good, perturbed and other
tasks' answers as known-bad, on tasks neither trained on nor held out), creates a ``generator`` verifier
with them and calibrates it in this process through the same ``do_run_calibration`` a person's
calibration runs; only when that passes is the domain created (held-out set and a first train batch).
A domain that fails any of it is named with the reason and left out; the rest are created. The API, the
domains page and ``manage.py create_pack`` (with a progress bar) all call this one function.

What it does NOT do: it does not retry, and calibration runs in the calling process (the web process, for
the browser and the API: ~0.1-1 s a domain for the demo and most reasoning-gym datasets), not on the
verify queue; training-time judging does run on the verify workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction

from webapp.catalog import generated
from webapp.catalog.models import CalibrationCase, CalibrationReport, TaskDomain, Verifier
from webapp.catalog.services import do_run_calibration
from webapp.common.errors import ValidationFailed
from workers.domains import generators as gen


@dataclass(frozen=True)
class PackItem:
    generator: str
    params: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    """The domain's name within the pack; default: the generator's name without its prefix (and -d<level>)."""

    def short_name(self) -> str:
        if self.name:
            return self.name
        base = self.generator.split(".", 1)[-1]
        return f"{base}-d{self.params['difficulty']}" if self.params.get("difficulty") else base


def _demo_items() -> list[PackItem]:
    return [PackItem(name, {"difficulty": d}) for name in gen.BUILTIN for d in (2, 3, 4)]


def _reasoning_gym_items() -> list[PackItem]:
    from workers.domains import reasoning_gym

    if not reasoning_gym.available():
        raise ValidationFailed("the reasoning-gym pack needs the optional extra: pip install -r requirements-extras.txt",
                               details={"pack": ["reasoning-gym is not installed"]})
    return [PackItem(f"rg.{name}") for name in reasoning_gym.dataset_names()]


PACKS: dict[str, tuple[str, Callable[[], list[PackItem]]]] = {
    "demo": ("the demo generators (sums and products) at difficulties 2-4", _demo_items),
    "reasoning-gym": ("one domain per reasoning-gym dataset (the optional extra)", _reasoning_gym_items),
}


def pack_items(pack: str) -> list[PackItem]:
    if pack not in PACKS:
        raise ValidationFailed(f"no pack {pack!r}; there are {', '.join(PACKS)}", details={"pack": ["unknown pack"]})
    return PACKS[pack][1]()


@dataclass
class PackResult:
    pack: str
    created: list[TaskDomain] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    """(domain name, reason) for every domain left out."""

    def to_dict(self) -> dict[str, Any]:
        return {"pack": self.pack, "created": [{"id": d.pk, "name": d.name, "generator": d.generator,
                                                "tasks": d.task_count, "heldout": d.heldout_count}
                                               for d in self.created],
                "failed": [{"name": n, "reason": r} for n, r in self.failed]}


class _Refused(Exception):
    """One domain of a pack cannot be made; the message is the reason shown to a person."""


def _cases(item: PackItem, params: gen.GeneratorParams, seed: int) -> list[CalibrationCase]:
    items = gen.calibration_items(item.generator, params, seed)
    if why := gen.first_disagreement(item.generator, items):
        raise _Refused(f"its score disagrees with calibration: {why}")
    return [CalibrationCase(prompt=c.task.prompt, completion=c.completion, expected=c.expected, label=c.label,
                            note=c.note, reference={"generator": item.generator, "answer": c.task.answer,
                                                    "entry": c.task.entry}) for c in items]


def _create_one(owner: Any, pack: str, name: str, item: PackItem, *, seed: int, heldout_size: int,
                tags: Sequence[str]) -> TaskDomain:
    model, problems = generated.check_generator_domain(item.generator, item.params)
    if problems:
        raise _Refused("; ".join(f"{k}: {m}" for k, ms in problems.items() for m in ms))
    if TaskDomain.objects.filter(owner=owner, name=name).exists():
        raise _Refused("a domain with this name already exists")
    cost = generated.ms_per_task(item.generator, model, seed)
    if cost > generated.MAX_MS_PER_TASK:
        raise _Refused(f"too slow for the loop: {cost:.0f} ms to make a task (the limit is "
                       f"{generated.MAX_MS_PER_TASK:.0f} ms, as runs make tasks while they admit them)")
    cases = _cases(item, model, seed)
    verifier = Verifier.objects.filter(owner=owner, name=f"{name} score").first()
    if verifier is not None:
        raise _Refused(f"a verifier named {verifier.name!r} already exists")
    verifier = Verifier.objects.create(owner=owner, name=f"{name} score", kind="generator", config={},
                                       description=f"{item.generator}'s own score (made by pack {pack})")
    for case in cases:
        case.verifier = verifier
    CalibrationCase.objects.bulk_create(cases)
    report = do_run_calibration(CalibrationReport.objects.create(verifier=verifier,
                                                                 status=CalibrationReport.Status.RUNNING))
    if not report.passed:
        failures = report.summary.get("failures") or [report.error or "calibration did not pass"]
        raise _Refused("calibration failed: " + "; ".join(str(f) for f in failures)[:400])
    generator_tags = getattr(gen.get_generator(item.generator), "tags", ())
    return generated.do_create_generator_domain(
        owner, name=name, generator=item.generator, params=item.params, seed=seed, heldout_size=heldout_size,
        verifier=verifier, pack=pack, tags=list(dict.fromkeys([*generator_tags, *tags])))


def do_create_pack(owner: Any, pack: str, items: Sequence[PackItem] | None = None, *, prefix: str | None = None,
                   seed: int = 0, heldout_size: int = generated.HELDOUT_SIZE, tags: Sequence[str] = (),
                   progress: Callable[[str, str | None], None] | None = None) -> PackResult:
    """Create a pack's domains (``items``, default: the built-in pack's), each with its calibrated verifier;
    the ones that cannot be made are named with the reason in ``PackResult.failed``. ``progress`` is called
    after each domain with its name and None, or the reason it was left out."""
    chosen = list(items) if items is not None else pack_items(pack)
    if not chosen:
        raise ValidationFailed("the pack holds no domains", details={"items": ["empty"]})
    result = PackResult(pack=prefix or pack)
    for item in chosen:
        name = f"{prefix or pack}/{item.short_name()}"
        reason: str | None = None
        try:
            with transaction.atomic():
                result.created.append(_create_one(owner, prefix or pack, name, item, seed=seed,
                                                  heldout_size=heldout_size, tags=tags))
        except _Refused as exc:
            reason = str(exc)
        except ValidationFailed as exc:
            reason = "; ".join(f"{k}: {m}" for k, ms in (exc.details or {}).items() for m in ms) or exc.message
        except Exception as exc:  # a generator that crashes is named, and the pack goes on
            reason = f"{type(exc).__name__}: {exc}"[:400]
        if reason is not None:
            result.failed.append((name, reason))
        if progress is not None:
            progress(name, reason)
    return result
