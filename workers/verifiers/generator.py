"""The ``generator`` verifier: a generated task scored by its own generator (``workers.domains.generators``).

A generator domain's tasks store which generator made them, its answer and what its score reads besides
it (``kinds.GeneratedReference``); this kind hands the completion to that generator's ``score`` — the demo
generators' exact match of the first line, a reasoning-gym dataset's own ``score_answer``. The score is
the verdict's score; it passes at ``pass_threshold``.

What it does NOT do: it does not isolate the generator's scoring (trusted library code, run in-process on
the verify worker), and it adds no checks of its own: a lenient ``score_answer`` stays lenient, which is
what calibrating each domain on perturbed known-bad answers is for.
"""

from __future__ import annotations

from typing import ClassVar

from workers.domains.generators import Generated, GeneratorError, score
from workers.domains.kinds import GeneratedReference
from workers.verifiers.base import BaseVerifier, InvalidReference, JudgeInput, Verdict, VerifierConfig, scored


class GeneratorConfig(VerifierConfig):
    pass


class GeneratorVerifier(BaseVerifier[GeneratorConfig]):
    kind: ClassVar[str] = "generator"
    Config = GeneratorConfig

    def _judge(self, inp: JudgeInput) -> Verdict:
        ref = self.read_reference(inp)
        if not isinstance(ref, GeneratedReference):
            raise InvalidReference("not a generated task (it has no generator)")
        task = Generated(prompt=inp.prompt, answer=ref.answer, entry=dict(ref.entry))
        try:
            value = score(ref.generator, inp.completion, task)
        except GeneratorError as exc:  # e.g. the extra is not installed on this worker
            raise InvalidReference(str(exc)) from None
        return scored(value, self.config.pass_threshold, generator=ref.generator)
