"""``guess_number``: guess a secret number in [low, high] with higher/lower feedback — a reward that comes from
multi-step feedback rather than a tool.

Each model turn is one guess (a turn ends at ``"\\n"``); the environment answers as the user would:
``higher`` (the secret is above the guess) or ``lower``; a right guess ends the episode. A turn that is not a
number in range is a ``parse_error`` observation: counted, and it uses up the guess. After ``max_guesses``
turns the episode ends. The task's reference is the secret (an ``answer`` domain's row
``{"prompt": "Guess a number 1-15:\\n", "answer": "11"}``); the prompt is the same for every secret
and must never name it, or the game is a lookup.

How hard it is, measured through this environment over every secret of 1-15 with four guesses
(``tests/test_guess_number.py``): a player who ignores the feedback (distinct random guesses) solves 4/15 =
27 %; one who guesses at random inside the interval the feedback leaves, ~61 %; binary search, all of them.

``score`` reads the transcript only: solved (1.0) when one of the first ``max_guesses`` model turns parses to
the secret, else 0.0 — parsed by the same rule as ``step``, so a turn that was a parse error in the episode
cannot count at scoring. The environment's own turns are never read, so nothing the model writes (a
"correct" of its own, a number inside other text) reaches the reward. Needs no sandbox session.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from pydantic import Field, model_validator

from workers.domains.kinds import parse_reference
from workers.environments.base import EnvParams, EnvTask, Judge, Observation, Transcript
from workers.verifiers.base import Verdict, invalid, scored

_GUESS = re.compile(r"\s*(-?\d{1,9})\s*")


class GuessNumber:
    name: ClassVar[str] = "guess_number"
    needs_session: ClassVar[bool] = False
    stop: ClassVar[tuple[str, ...]] = ("\n",)

    class Params(EnvParams):
        low: int = Field(1, ge=-1_000_000, le=1_000_000, description="The smallest number the secret may be")
        high: int = Field(15, ge=-1_000_000, le=1_000_000, description="The largest number the secret may be")
        max_guesses: int = Field(4, ge=1, le=64, description="Guesses (model turns) before the episode ends "
                                                            "unsolved; set the run's episode.max_turns to match")

        @model_validator(mode="after")
        def _check(self) -> GuessNumber.Params:
            if self.high <= self.low:
                raise ValueError("high must be greater than low")
            return self

    def __init__(self, params: EnvParams, judge: Judge) -> None:
        assert isinstance(params, GuessNumber.Params)
        self.params = params
        del judge  # the reward is the game's own rule, not a verifier's
        self.secret: int | None = None
        self.guesses = 0

    def start(self, task: EnvTask, seed: int, session: Any | None) -> Observation:
        self.secret, self.guesses = self.secret_of(task), 0
        return Observation(task.prompt)

    def step(self, action: str) -> Observation:
        if self.secret is None:
            raise RuntimeError("step before start")
        self.guesses += 1
        last = self.guesses >= self.params.max_guesses
        guess = self.parse(action)
        if guess is None:
            return Observation(f"say a number from {self.params.low} to {self.params.high}\n", done=last,
                               status="parse_error", role="user", info={"args": action[-40:]})
        if guess == self.secret:
            return Observation("correct\n", done=True, status="done", role="user", info={"args": str(guess)})
        feedback = "higher\n" if self.secret > guess else "lower\n"
        return Observation(feedback, done=last, role="user", info={"args": str(guess)})

    def score(self, transcript: Transcript) -> Verdict:
        if transcript.stop_reason in ("env_error", "session_error"):
            return invalid(f"the episode ended on {transcript.stop_reason}")
        secret = self.secret_of(transcript.task)
        guesses = [self.parse(text) for text in transcript.model_texts[: self.params.max_guesses]]
        solved = secret in guesses
        return scored(1.0 if solved else 0.0, 1.0, "solved" if solved else "not solved",
                      guesses=len(guesses) if not solved else guesses.index(secret) + 1,
                      parse_errors=sum(g is None for g in guesses))

    def close(self) -> None:
        self.secret = None

    def parse(self, text: str) -> int | None:
        """A turn's guess: the whole turn is one integer in [low, high] (surrounding whitespace aside)."""
        match = _GUESS.fullmatch(text)
        if match is None:
            return None
        value = int(match.group(1))
        return value if self.params.low <= value <= self.params.high else None

    def secret_of(self, task: EnvTask) -> int:
        """The task's secret: its reference's one answer, an integer in [low, high] (else a ``ValueError``,
        which ends the episode on ``env_error`` and scores it invalid: a broken task is not the model's fault)."""
        answers = parse_reference(task.reference, [task.kind or "answer"]).answers()
        if len(answers) != 1 or not re.fullmatch(r"-?\d{1,9}", answers[0].strip()):
            raise ValueError(f"a guess_number task's answer must be one integer, got {answers!r}")
        secret = int(answers[0])
        if not self.params.low <= secret <= self.params.high:
            raise ValueError(f"the secret {secret} is outside [{self.params.low}, {self.params.high}]")
        return secret


def prompt(params: GuessNumber.Params) -> str:
    """The game's prompt for a domain's rows (the same for every secret: it must never name one)."""
    return f"Guess a number {params.low}-{params.high}:\n"


def demo_rows(params: GuessNumber.Params, copies: int = 8, seed: int = 0) -> list[dict[str, str]]:
    """A domain's rows: every secret once held out (so greedy held-out evaluation is the policy's exact solve
    rate over the game) and ``copies`` times for training, in a fixed shuffled order (the loop admits train
    tasks in id order). The prompt never names the secret, so a held-out secret is not a seen answer: every
    task shows the policy the same prompt, and only the feedback tells them apart."""
    secrets = [str(n) for n in range(params.low, params.high + 1)]
    train = secrets * copies
    random.Random(seed).shuffle(train)
    text = prompt(params)
    return ([{"prompt": text, "answer": s, "split": "train"} for s in train]
            + [{"prompt": text, "answer": s, "split": "heldout"} for s in secrets])
