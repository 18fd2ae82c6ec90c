"""``single_turn``: today's tasks as the degenerate environment — the prompt is the first observation, the
model's first turn ends the episode, and the domain's verifier judges it. One code path serves both."""

from __future__ import annotations

from typing import Any, ClassVar

from workers.environments.base import EnvParams, EnvTask, Judge, Observation, Transcript
from workers.verifiers.base import Verdict


class SingleTurn:
    name: ClassVar[str] = "single_turn"
    needs_session: ClassVar[bool] = False
    stop: ClassVar[tuple[str, ...]] = ()

    class Params(EnvParams):
        pass

    def __init__(self, params: EnvParams, judge: Judge) -> None:
        self.judge = judge
        self.task: EnvTask | None = None

    def start(self, task: EnvTask, seed: int, session: Any | None) -> Observation:
        self.task = task
        return Observation(task.prompt)

    def step(self, action: str) -> Observation:
        return Observation("", done=True, status="done")

    def score(self, transcript: Transcript) -> Verdict:
        return self.judge(transcript.task, transcript.final_text)

    def close(self) -> None:
        self.task = None
