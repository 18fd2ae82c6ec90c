"""reasoning-gym datasets as generators (the optional extra: ``pip install -r requirements-extras.txt``).

One generator per registered dataset, named ``rg.<dataset>``. Task ``i`` of a stream with seed ``s`` is
item ``i % BLOCK`` of ``create_dataset(name, seed=s + (i // BLOCK) * BLOCK, size=BLOCK, **config)``;
reasoning-gym's items draw from ``Random(dataset.seed + idx)``, so a stream is the dataset's own seeded
sequence, cut into blocks so that no dataset is asked for a virtual size it precomputes. Scoring is the
dataset's own ``score_answer(answer, entry)``, with the entry rebuilt from what the task stores (question,
answer, metadata) — the metadata after a JSON round trip, as the database holds it; calibration checks it
on stored cases, so a dataset whose scoring needs what JSON cannot keep is named when its pack is made.

Parameters: ``difficulty`` (1-5) sets the dataset's curriculum to global level ``difficulty - 1`` when it
has one (``None``: the dataset's default configuration), and ``config`` overrides fields of the
dataset's config dataclass; both are checked by building the dataset once (its own ``validate``).

What this module does NOT do: it does not sandbox reasoning-gym (trusted library code, in-process), and
it does not extract answers beyond the completion's text (``<answer>…</answer>`` when present, else the
stripped completion).

Importing it imports ``reasoning_gym`` (which imports all of its ~100 dataset modules, ~2 s): only the
processes that generate or score such a domain do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, ClassVar

from pydantic import Field

from workers.domains.generators import Generated, GeneratorError, GeneratorParams

try:
    import reasoning_gym
    from reasoning_gym.factory import CURRICULA, DATASETS, create_curriculum
except ImportError:  # pragma: no cover - exercised where the extra is absent
    reasoning_gym = None
    DATASETS, CURRICULA = {}, {}

BLOCK = 256
UNSUPPORTED = {"composite": "a composite of other datasets, not a dataset of its own"}


class RGParams(GeneratorParams):
    difficulty: int | None = Field(  # type: ignore[assignment]
        None, ge=1, le=5, description="The dataset's curriculum level + 1 (None: its default configuration)")
    config: dict[str, Any] = Field(default_factory=dict,
                                   description="Fields of the dataset's config dataclass (e.g. min_terms)")


def available() -> bool:
    return reasoning_gym is not None


def dataset_names() -> list[str]:
    """Every dataset this reasoning-gym registers that can be a domain, sorted."""
    return sorted(n for n in DATASETS if n not in UNSUPPORTED)


def _require() -> None:
    if reasoning_gym is None:
        raise GeneratorError([("generator", "reasoning-gym is not installed: pip install -r requirements-extras.txt "
                                            "(an optional extra)")])


class RGGenerator:
    Params: ClassVar[type[GeneratorParams]] = RGParams

    def __init__(self, dataset: str) -> None:
        self.dataset = dataset
        self.name = f"rg.{dataset}"
        cls = DATASETS[dataset][0]
        self.label = (cls.__doc__ or dataset).strip().splitlines()[0][:120]
        self.tags: tuple[str, ...] = ("reasoning-gym", cls.__module__.split(".")[1] if cls.__module__.count(".") >= 2 else "other")

    def _config_args(self, params: RGParams) -> dict[str, Any]:
        args: dict[str, Any] = {}
        if params.difficulty is not None and self.dataset in CURRICULA:
            curriculum = create_curriculum(self.dataset)
            curriculum.set_global_level(params.difficulty - 1)
            config = curriculum.generate_configuration()
            args = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        args.update(params.config)
        args.pop("seed", None)
        args.pop("size", None)
        return args

    def check(self, params: GeneratorParams) -> None:
        assert isinstance(params, RGParams)
        try:
            self._dataset(json.dumps(self._config_args(params), sort_keys=True, default=list), 0)
        except (TypeError, ValueError, AssertionError) as exc:
            raise GeneratorError([("generator_params.config", f"{self.dataset}: {type(exc).__name__}: {exc}"[:300])]
                                 ) from None

    @functools.lru_cache(maxsize=64)  # noqa: B019 - generators live as long as the process, by design
    def _dataset(self, config_json: str, seed: int) -> Any:
        return reasoning_gym.create_dataset(self.dataset, seed=seed, size=BLOCK, **json.loads(config_json))

    def generate(self, params: GeneratorParams, seed: int, index: int) -> Generated:
        assert isinstance(params, RGParams)
        config_json = json.dumps(self._config_args(params), sort_keys=True, default=list)
        block, offset = divmod(index, BLOCK)
        item = self._dataset(config_json, (seed + block * BLOCK) % 2**32)[offset]
        metadata = json.loads(json.dumps(item.get("metadata") or {}, default=_jsonable))
        return Generated(str(item["question"]), str(item["answer"]), {"metadata": metadata})

    def score(self, answer: str, task: Generated) -> float:
        entry = {"question": task.prompt, "answer": task.answer, "metadata": task.entry.get("metadata", {})}
        return float(_score_fn(self.dataset)(extract(answer), entry))


@functools.cache
def _score_fn(dataset: str) -> Any:
    return reasoning_gym.get_score_answer_fn(dataset)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return repr(value)


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract(completion: str) -> str:
    """The answer in a completion: the last ``<answer>…</answer>``, else the stripped text."""
    found = _ANSWER.findall(completion)
    return (found[-1] if found else completion).strip()


@functools.cache
def generator(dataset: str) -> RGGenerator:
    _require()
    if dataset in UNSUPPORTED:
        raise GeneratorError([("generator", f"rg.{dataset}: {UNSUPPORTED[dataset]}")])
    if dataset not in DATASETS:
        raise GeneratorError([("generator", f"reasoning-gym has no dataset {dataset!r} (it has {len(DATASETS)}; "
                                            f"e.g. {', '.join(dataset_names()[:5])})")])
    return RGGenerator(dataset)
