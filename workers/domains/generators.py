"""Generator domains, the pure half: seeded procedural task generators, their parameters and their scores.

A generator domain has no file of tasks: task ``i`` of its train stream is ``generate(params, seed_t, i)``
and task ``j`` of its held-out set is ``generate(params, seed_h, j)``, where ``seed_t`` and ``seed_h`` are
derived from the domain's seed and the split's name (``stream_seed``), so the two are different seed
spaces and the same domain always yields the same tasks. The database half
(``webapp.catalog.generated``) materializes them into ordinary ``Task`` rows: the held-out set once, when
the domain is created, and the train stream lazily in batches as runs admit it. A generated train task
whose content hash (``content_hash`` of its prompt) equals a held-out task's is skipped, so held-out tasks
are never trained on even where a small problem space makes the two seed spaces collide.

A generator declares a pydantic ``Params`` model (``difficulty`` among its fields, so a domain can be made
harder later: train tasks materialized after a change use the new parameters and record them in their
metadata; the held-out set stays as it was made) and a ``score(answer, entry)`` in [0, 1]. Built in: the
demo generators (``demo.addition``, ``demo.multiplication``, ``demo.product``). With the optional
reasoning-gym extra installed, ``rg.<dataset>`` is one generator per reasoning-gym dataset
(``workers.domains.reasoning_gym``), scored by that dataset's own ``score_answer``.

Calibration material comes from a third seed space: known-good answers (the generator's own) and
known-bad ones (``perturbations`` of them), so a domain's verifier is calibrated on tasks that are neither
trained on nor evaluated.

What this module does NOT do: it never touches the database, and it does not sandbox a generator —
generators are trusted library code run in-process (the verify workers score with them).

Pure: pydantic only; no Django.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SPLITS = ("train", "heldout", "calibration")


class GeneratorError(ValueError):
    """A generator name or its parameters are wrong; ``problems`` holds (field, reason) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{f}: {r}" for f, r in problems))


class GeneratorParams(BaseModel):
    """Parameters every generator takes; a generator's own ``Params`` adds its fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    difficulty: int = Field(2, ge=1, le=5, description="How hard the tasks are (1 easiest); raise it as the "
                                                       "model improves: new train tasks use it")


@dataclass(frozen=True)
class Generated:
    """One generated task: what the model is asked, the generator's answer, what scoring needs."""

    prompt: str
    answer: str
    entry: dict[str, Any] = field(default_factory=dict)
    """What ``score`` reads besides the answer (reasoning-gym's entry metadata); stored with the task."""


class Generator(Protocol):
    name: str
    label: str
    Params: ClassVar[type[GeneratorParams]]
    tags: tuple[str, ...]

    def generate(self, params: GeneratorParams, seed: int, index: int) -> Generated: ...

    def score(self, answer: str, task: Generated) -> float: ...


def stream_seed(seed: int, split: str) -> int:
    """The seed of one split's stream: distinct splits are unrelated seed spaces. 31 bits, so that
    ``seed + index`` stays within what libraries take for a seed (some refuse 2**32 and above)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    digest = hashlib.blake2b(f"temper-generator:{seed}:{split}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF


def content_hash(prompt: str) -> str:
    """What train and held-out tasks are compared by (whitespace at the ends ignored)."""
    return hashlib.blake2b(prompt.strip().encode(), digest_size=12).hexdigest()


# ---------------------------------------------------------------- the demo generators


def exact_score(answer: str, task: Generated) -> float:
    """1.0 when the answer's first line equals the task's answer (whitespace at the ends ignored)."""
    lines = answer.strip().splitlines()
    return float(bool(lines) and lines[0].strip() == task.answer.strip())


class DemoArithmetic:
    """The demo model's arithmetic: ``difficulty`` is the number of digits of each operand (the demo domains
    are difficulty 2: two-digit sums, two digits times one, two digits times two)."""

    Params: ClassVar[type[GeneratorParams]] = GeneratorParams
    tags: tuple[str, ...] = ("demo", "arithmetic")

    def __init__(self, name: str, label: str, op: str, second_digits: int | None) -> None:
        self.name, self.label, self.op, self.second_digits = name, label, op, second_digits

    def generate(self, params: GeneratorParams, seed: int, index: int) -> Generated:
        rng = random.Random(seed * 1_000_003 + index)
        digits = params.difficulty
        a = rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)
        second = self.second_digits or digits
        b = rng.randrange(2 if second == 1 else 10 ** (second - 1), 10**second)
        value = a + b if self.op == "+" else a * b
        return Generated(f"{a}{self.op}{b}=", str(value), {"a": a, "b": b, "difficulty": digits})

    def score(self, answer: str, task: Generated) -> float:
        return exact_score(answer, task)


BUILTIN: dict[str, Generator] = {
    g.name: g for g in (
        DemoArithmetic("demo.addition", "a + b (difficulty = digits per operand)", "+", None),
        DemoArithmetic("demo.multiplication", "a x one digit (difficulty = digits of a)", "*", 1),
        DemoArithmetic("demo.product", "a x b (difficulty = digits per operand)", "*", None),
    )
}
EXTRA_PREFIX = "rg."
"""Generators named ``rg.<dataset>`` come from the optional reasoning-gym extra."""


def get_generator(name: str) -> Generator:
    """The generator called ``name``; raises ``GeneratorError`` naming the known ones or the missing extra."""
    if name in BUILTIN:
        return BUILTIN[name]
    if name.startswith(EXTRA_PREFIX):
        from workers.domains import reasoning_gym  # the optional extra, imported only when asked for

        return reasoning_gym.generator(name.removeprefix(EXTRA_PREFIX))
    raise GeneratorError([("generator", f"unknown generator {name!r}; built in: {', '.join(BUILTIN)}, "
                                        f"or {EXTRA_PREFIX}<dataset> with the reasoning-gym extra")])


def check_params(name: str, params: Mapping[str, Any] | None) -> GeneratorParams:
    """``params`` validated by the generator's model; raises ``GeneratorError`` with (field, reason) pairs."""
    gen = get_generator(name)
    if params is not None and not isinstance(params, Mapping):
        raise GeneratorError([("generator_params", f"expected a JSON object, got {type(params).__name__}")])
    try:
        model = gen.Params.model_validate(dict(params or {}))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(params)"
            msg = "unknown parameter" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
            problems.append((f"generator_params.{loc}", msg))
        raise GeneratorError(problems) from None
    if (check := getattr(gen, "check", None)) is not None:  # one that can only tell by trying (reasoning-gym)
        check(model)
    return model


def params_schema(name: str) -> dict[str, Any]:
    """JSON Schema of a generator's parameters (what the domain page shows)."""
    return get_generator(name).Params.model_json_schema()


def generate(name: str, params: GeneratorParams, seed: int, split: str, index: int) -> Generated:
    return get_generator(name).generate(params, stream_seed(seed, split), index)


def heldout_set(name: str, params: GeneratorParams, seed: int, size: int, *, max_tries: int = 20
                ) -> list[tuple[int, Generated]]:
    """The domain's fixed held-out set: (index, task) for the first ``size`` distinct tasks of its seed space."""
    gen, base = get_generator(name), stream_seed(seed, "heldout")
    out: list[tuple[int, Generated]] = []
    seen: set[str] = set()
    for index in range(size * max_tries):
        if len(out) >= size:
            break
        task = gen.generate(params, base, index)
        if (h := content_hash(task.prompt)) not in seen:
            seen.add(h)
            out.append((index, task))
    return out


def train_batch(name: str, params: GeneratorParams, seed: int, start: int, count: int, exclude: set[str], *,
                max_tries: int = 20) -> tuple[list[tuple[int, Generated]], int]:
    """Train tasks from stream index ``start``: (index, task) pairs, skipping any whose content hash is in
    ``exclude`` (the held-out set's), and the next index to read. Fewer than ``count`` come back only when
    ``count * max_tries`` indexes in a row were held out (a problem space smaller than the held-out set)."""
    gen, base = get_generator(name), stream_seed(seed, "train")
    out: list[tuple[int, Generated]] = []
    index = start
    while len(out) < count and index < start + count * max_tries:
        task = gen.generate(params, base, index)
        if content_hash(task.prompt) not in exclude:
            out.append((index, task))
        index += 1
    return out, index


def score(name: str, answer: str, task: Generated) -> float:
    """The generator's own score of ``answer`` for ``task``, clamped to [0, 1]."""
    return min(1.0, max(0.0, float(get_generator(name).score(answer, task))))


# ---------------------------------------------------------------- calibration material


def perturbations(answer: str, others: Sequence[str] = ()) -> list[str]:
    """Known-bad answers made from a right one: empty, off by one and negated (numbers), reversed (text), and
    the answers of other tasks. Only those that differ from the answer (after stripping) are kept."""
    a = answer.strip()
    out: list[str] = [""]
    if re.fullmatch(r"-?\d+", a):
        out += [str(int(a) + 1), str(-int(a)) if int(a) else "1"]
    elif re.fullmatch(r"-?\d+\.\d+", a):
        decimals = len(a.split(".")[1])
        out += [f"{float(a) * 2 + 1:.{decimals}f}", f"{-float(a) or 1.0:.{decimals}f}"]
    else:
        out.append(a[::-1])
    out += [o.strip() for o in others]
    kept: list[str] = []
    for bad in out:
        if bad.strip() != a and bad not in kept:
            kept.append(bad)
    return kept[:5]


@dataclass(frozen=True)
class CalibrationItem:
    task: Generated
    completion: str
    expected: str  # "pass" or "fail"
    label: str  # "good" or "bad"
    note: str = ""


def calibration_items(name: str, params: GeneratorParams, seed: int, n_tasks: int = 4) -> list[CalibrationItem]:
    """Known-good (the generator's own answer) and known-bad answers (``perturbations``, other tasks' answers)
    on calibration-space tasks, which are neither trained on nor held out."""
    gen, base = get_generator(name), stream_seed(seed, "calibration")
    tasks = [gen.generate(params, base, index) for index in range(n_tasks)]
    items: list[CalibrationItem] = []
    for n, task in enumerate(tasks):
        items.append(CalibrationItem(task, task.answer, "pass", "good", "the generator's own answer"))
        others = [t.answer for i, t in enumerate(tasks) if i != n][:2]
        items += [CalibrationItem(task, bad, "fail", "bad", "a perturbed answer, or another task's")
                  for bad in perturbations(task.answer, others)]
    return items


def first_disagreement(name: str, items: Sequence[CalibrationItem]) -> str | None:
    """Why a generator's own score disagrees with its calibration items (None when it agrees with all): the
    quick check a pack runs before building a verifier."""
    for item in items:
        try:
            value = score(name, item.completion, item.task)
        except Exception as exc:  # a generator's score that crashes cannot judge anything
            return f"score_answer raised {type(exc).__name__}: {exc}"[:300]
        if (value >= 1.0) != (item.expected == "pass"):
            what = "gave its own answer" if item.expected == "pass" else "accepted a known-bad answer"
            return (f"score {what} {item.completion!r} a {value:.2f} (task {item.task.prompt[:80]!r}, answer "
                    f"{item.task.answer[:80]!r})")
    return None
