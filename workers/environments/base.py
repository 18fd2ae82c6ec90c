"""The environment protocol: one object per episode, text in and text out.

    env = make_environment("python_tool", params, judge=verifier_judge)
    first = env.start(task, seed, session)          # the first observation: what the model is shown
    obs = env.step(model_text)                      # (text, done, status, info) after each model turn
    env.close()                                     # always (the runner guarantees it); then
    verdict = env.score(transcript)                 # no session needed: the transcript holds the task

An environment object lives for one episode and is discarded after it (shared objects leaked state from
one episode into the next elsewhere: verifiers PR #1067). ``score`` is computed outside the session, from
the transcript and the task the environment holds — never from a file the model could write in the
session (OpenEnv #1199). A malformed action is an observation with status ``parse_error``, counted, never
an exception; a tool that fails is ``tool_error``; a tool that runs past its limit is ``timeout``.

Registered by name in ``ENVIRONMENTS`` (a literal name → dotted path table) and imported lazily; a deployment
adds its own with ``TEMPER_ENVIRONMENTS="name=package.module:Class,…"`` (``bench/envs.py`` is one). Each
declares its parameters as a pydantic ``Params`` model, validated when a domain names the environment and
shown on the domain page.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from workers.verifiers.base import Verdict, format_validation_error, invalid

ObservationStatus = Literal["ok", "done", "tool_error", "parse_error", "timeout", "env_error"]
StopReason = Literal["done", "max_turns", "context", "timeout", "env_error", "session_error"]
STOP_REASONS: tuple[StopReason, ...] = ("done", "max_turns", "context", "timeout", "env_error", "session_error")


@dataclass(frozen=True)
class EnvTask:
    """The task an episode acts on (what the domain stores)."""

    prompt: str
    """The rendered prompt (the domain's template applied): the user's first message."""
    reference: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    kind: str | None = None
    system: str = ""
    """The domain's system prompt: a message of its own for a chat model, put before the prompt otherwise."""


@dataclass(frozen=True)
class Observation:
    text: str
    done: bool = False
    status: ObservationStatus = "ok"
    info: Mapping[str, Any] = field(default_factory=dict)
    """What a transcript records of the step: the tool's name, its arguments, its result, its latency."""
    role: Literal["tool", "user"] = "tool"
    """Who speaks in a chat model's transcript: a tool's result, or the user's (the environment's) reply.
    A model without a chat template is shown ``text`` as it is, whatever the role."""


@dataclass
class Turn:
    """One turn of an episode: the model's or the environment's, with its token span [start, end) in the
    episode's completion ids (after the prompt)."""

    role: Literal["model", "env"]
    text: str
    start: int
    end: int
    status: str = "ok"
    latency_s: float = 0.0
    tool: str | None = None
    args: str | None = None
    version: int | None = None
    """The policy version that sampled a model turn (an episode may span versions)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "text": self.text, "start": self.start, "end": self.end,
                               "status": self.status, "latency_s": round(self.latency_s, 6)}
        for name in ("tool", "args", "version"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Turn:
        return cls(role=data["role"], text=data["text"], start=int(data["start"]), end=int(data["end"]),
                   status=str(data.get("status", "ok")), latency_s=float(data.get("latency_s", 0.0)),
                   tool=data.get("tool"), args=data.get("args"), version=data.get("version"))


@dataclass
class Transcript:
    """An episode as scoring needs it: the task it acted on, its turns and why it stopped. ``score`` needs
    nothing else, so an episode can be scored on another worker than the one that ran it."""

    task: EnvTask
    turns: list[Turn]
    stop_reason: StopReason

    @property
    def model_texts(self) -> list[str]:
        return [t.text for t in self.turns if t.role == "model"]

    @property
    def final_text(self) -> str:
        """The model's last turn (what a single-turn verifier judges)."""
        texts = self.model_texts
        return texts[-1] if texts else ""


class Environment(Protocol):
    name: ClassVar[str]
    needs_session: ClassVar[bool]
    stop: ClassVar[tuple[str, ...]]
    """Strings that end a model turn (a tool call's closing tag), besides the end-of-sequence token."""

    def start(self, task: EnvTask, seed: int, session: Any | None) -> Observation: ...

    def step(self, action: str) -> Observation: ...

    def score(self, transcript: Transcript) -> Verdict: ...

    def close(self) -> None: ...


Judge = Callable[[EnvTask, str], Verdict]
"""(task, completion) -> verdict: the domain's verifier on the task's reference."""


def judge_final_answer(judge: Judge, transcript: Transcript) -> Verdict:
    """The usual ``score``: the domain's verifier on the model's last turn, or invalid when the episode
    ended because the environment or its session broke (no fault of the model's, so no reward either way)."""
    if transcript.stop_reason in ("env_error", "session_error"):
        return invalid(f"the episode ended on {transcript.stop_reason}")
    return judge(transcript.task, transcript.final_text)


class EnvParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EnvironmentError_(ValueError):
    """An environment name or its parameters are wrong; ``problems`` holds "field: reason" lines."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "single_turn": "workers.environments.single_turn:SingleTurn",
    "python_tool": "workers.environments.python_tool:PythonTool",
    "guess_number": "workers.environments.guess_number:GuessNumber",
}

_NAME = re.compile(r"[a-z][a-z0-9_]*")
_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def parse_environments(text: str, source: str = "TEMPER_ENVIRONMENTS") -> dict[str, str]:
    """A deployment's own environments, ``"name=module:Class,name2=module:Class2"`` (as ``TEMPER_ENVIRONMENTS``
    holds them), checked for form only: the class is imported when an episode needs it, like the built-in ones.
    A malformed entry, a repeated name or one that would replace a built-in environment is a ``ValueError``
    naming the entry."""
    out: dict[str, str] = {}
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, target = (part.strip() for part in entry.partition("="))
        if not sep or not _NAME.fullmatch(name) or not _TARGET.fullmatch(target):
            raise ValueError(f"{source}: malformed entry {entry!r}; write name=package.module:Class "
                             f"(a lower-case name), entries separated by commas")
        if name in BUILTIN_ENVIRONMENTS:
            raise ValueError(f"{source}: entry {entry!r} would replace the built-in environment {name!r}")
        if name in out:
            raise ValueError(f"{source}: entry {entry!r} names {name!r} a second time")
        out[name] = target
    return out


ENVIRONMENTS: dict[str, str] = {**BUILTIN_ENVIRONMENTS, **parse_environments(os.environ.get("TEMPER_ENVIRONMENTS", ""))}
"""Every environment by name: the built-in ones and those the deployment registers in ``TEMPER_ENVIRONMENTS``
(read once, when this module is imported; every process that makes or scores episodes needs the same value)."""


def environment_class(name: str) -> type[Any]:
    if name not in ENVIRONMENTS:
        raise EnvironmentError_([f"environment: unknown environment {name!r}; known: {', '.join(ENVIRONMENTS)}"])
    module, _, attr = ENVIRONMENTS[name].partition(":")
    try:
        cls: type[Any] = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:  # a deployment's entry naming what is not there
        raise EnvironmentError_([f"environment: {name!r} is registered as {ENVIRONMENTS[name]!r}, which cannot "
                                 f"be imported: {type(exc).__name__}: {exc}"]) from None
    return cls


def validate_params(name: str, params: Mapping[str, Any] | None) -> EnvParams:
    cls = environment_class(name)
    try:
        validated: EnvParams = cls.Params.model_validate(dict(params or {}))
    except ValidationError as exc:
        raise EnvironmentError_([f"environment_params.{line}" for line in format_validation_error(exc)]) from None
    return validated


def params_schema(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = environment_class(name).Params.model_json_schema()
    return schema


def make_environment(name: str, params: Mapping[str, Any] | None, judge: Judge) -> Environment:
    """A new environment object for one episode."""
    cls = environment_class(name)
    env: Environment = cls(validate_params(name, params), judge)
    return env
