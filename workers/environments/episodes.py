"""The episode runner: many episodes at once, token-in and token-out, ending each by its limits.

Each round generates the next model turn of every active episode in one batch (``generate`` takes token-id
contexts), then steps every episode's environment with that turn at once (threads: a step mostly waits on
its sandbox session, so a slow tool costs the round its slowest call, not the sum of them). What the model
sampled is kept exactly (its ids and behaviour log-probs, never re-encoded from text); each observation is
tokenized once and appended: as it is for a plain model, as one message through the chat template for a
chat model (``workers.policy.chat``: the template applied to that message alone, never to the history,
the template's framing of the message counted in its span). The loss mask is 1 on sampled tokens only, 0
on the prompt and on every observation, so the trainer learns from the model's own tokens and nothing else.
The turn spans tile the completion ids: model spans, then environment spans, with no gap.

Limits end episodes, never runs: ``max_turns``; ``max_tokens_per_turn``; the model's context budget (a turn
gets at most what is left; an observation that does not fit ends the episode: ``context``); the episode
deadline (``timeout``). A per-step timeout inside a tool is the environment's observation (its session's
cell limit); an environment that raises ends its episode with ``env_error``. ``close()`` is always called.

Pure: no Django, no torch — the engine comes as callables.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from workers.environments.base import Environment, EnvTask, Observation, StopReason, Transcript, Turn
from workers.policy.chat import ChatFormat, Prompt, task_messages


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    """Model turns per episode."""
    max_tokens_per_turn: int = 32
    context_tokens: int = 4096
    """The model's context: prompt, every turn and every observation together."""
    deadline_s: float = 120.0


@dataclass(frozen=True)
class Generated:
    """One model turn as the engine sampled it."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int


Generate = Callable[[list[list[int]], int, tuple[str, ...]], list[Generated]]
"""(contexts, max new tokens, stop strings) -> one turn per context."""


@dataclass(frozen=True)
class TokenIO:
    """How the runner speaks to a model in token ids (``engine_io`` makes one from an engine)."""

    generate: Generate
    prompt_ids: Callable[[Prompt], list[int]]
    """The task's first messages (system prompt, user turn) as the prompt's ids."""
    observation_ids: Callable[[str, str, list[int]], list[int]]
    """(role, text, the ids of the model turn before it) -> the ids appended for one observation."""
    decode: Callable[[list[int]], str]


@dataclass
class Episode:
    env: Environment
    task: EnvTask
    seed: int = 0
    session: Any = None
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    stop_reason: StopReason | None = None
    model_turns: int = 0
    started: float = 0.0

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def transcript(self) -> Transcript:
        return Transcript(self.task, self.turns, self.stop_reason or "done")

    @property
    def versions(self) -> list[int]:
        return sorted({t.version for t in self.turns if t.version is not None})

    def append(self, role: str, ids: list[int], text: str, *, logprobs: list[float] | None = None,
               obs: Observation | None = None, version: int | None = None, latency_s: float = 0.0) -> None:
        start = len(self.completion_ids)
        self.completion_ids += ids
        self.mask += [1 if role == "model" else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        info = dict(obs.info) if obs is not None else {}
        self.turns.append(Turn(role=role, text=text, start=start, end=len(self.completion_ids),  # type: ignore[arg-type]
                               status=obs.status if obs is not None else "ok",
                               latency_s=float(info.get("latency_s", latency_s)),
                               tool=info.get("tool"), args=info.get("args"), version=version))


def run_episodes(episodes: Sequence[Episode], io: TokenIO, limits: EpisodeLimits) -> list[Episode]:
    """Run every episode to its end; each environment is closed whatever happens."""
    try:
        for ep in episodes:
            ep.started = time.monotonic()
            try:
                first = ep.env.start(ep.task, ep.seed, ep.session)
            except Exception as exc:
                ep.stop_reason = "env_error"
                ep.turns.append(Turn("env", f"{type(exc).__name__}: {exc}"[:500], 0, 0, status="env_error"))
                continue
            ep.prompt_ids = io.prompt_ids(task_messages(ep.task.system, first.text))
            if first.done:
                ep.stop_reason = "env_error" if first.status == "env_error" else "done"
            elif len(ep.prompt_ids) >= limits.context_tokens:
                ep.stop_reason = "context"
        while True:
            active = [ep for ep in episodes if not ep.done]
            if not active:
                break
            by_budget: dict[tuple[int, tuple[str, ...]], list[Episode]] = {}
            for ep in active:
                if time.monotonic() - ep.started >= limits.deadline_s:
                    ep.stop_reason = "timeout"
                    continue
                budget = min(limits.max_tokens_per_turn, limits.context_tokens - len(ep.context))
                if budget <= 0:
                    ep.stop_reason = "context"
                    continue
                by_budget.setdefault((budget, tuple(ep.env.stop)), []).append(ep)
            for (budget, stop), group in by_budget.items():
                outs = io.generate([ep.context for ep in group], budget, stop)
                texts = [io.decode(out.ids) for out in outs]
                for ep, out, text in zip(group, outs, texts, strict=True):
                    ep.append("model", out.ids, text, logprobs=out.logprobs, version=out.version)
                    ep.model_turns += 1
                # the environments step at once: a step mostly waits on its sandbox session
                if len(group) > 1:
                    steps = list(_stepper().map(_step, [ep.env for ep in group], texts))
                else:
                    steps = [_step(group[0].env, texts[0])]
                for ep, out, result in zip(group, outs, steps, strict=True):
                    _after_step(ep, out, result, budget, io, limits)
    finally:
        for ep in episodes:
            with contextlib.suppress(Exception):  # closing must not lose the episodes
                ep.env.close()
    return list(episodes)


_STEPPER: ThreadPoolExecutor | None = None
STEP_THREADS = 32


def _stepper() -> ThreadPoolExecutor:
    global _STEPPER
    if _STEPPER is None:
        _STEPPER = ThreadPoolExecutor(max_workers=STEP_THREADS, thread_name_prefix="episode-step")
    return _STEPPER


def _step(env: Environment, text: str) -> Observation | BaseException:
    try:
        return env.step(text)
    except Exception as exc:  # an environment's own failure ends its episode, never the batch
        return exc


def _after_step(ep: Episode, out: Generated, obs: Observation | BaseException, budget: int, io: TokenIO,
                limits: EpisodeLimits) -> None:
    if isinstance(obs, BaseException):
        ep.turns[-1].status = "env_error"
        ep.stop_reason = "env_error"
        ep.turns.append(Turn("env", f"{type(obs).__name__}: {obs}"[:500], len(ep.completion_ids),
                             len(ep.completion_ids), status="env_error"))
        return
    if obs.done:
        ep.stop_reason = "env_error" if obs.status == "env_error" else "done"
        if obs.text:
            ep.append("env", io.observation_ids(obs.role, obs.text, out.ids), obs.text, obs=obs)
        return
    obs_ids = io.observation_ids(obs.role, obs.text, out.ids)
    if len(ep.context) + len(obs_ids) >= limits.context_tokens:
        ep.stop_reason = "context"  # the observation does not fit: the episode ends before it
        return
    ep.append("env", obs_ids, obs.text, obs=obs)
    if ep.model_turns >= limits.max_turns:
        ep.stop_reason = "max_turns"
    elif out.finish_reason == "length" and budget < limits.max_tokens_per_turn:
        ep.stop_reason = "context"


ERROR_STATUSES = ("tool_error", "timeout", "parse_error")


def episode_counts(turns: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(model turns, observations that were a tool error, a timeout or a parse error) of stored turns."""
    return (sum(t.get("role") == "model" for t in turns),
            sum(t.get("role") == "env" and t.get("status") in ERROR_STATUSES for t in turns))


def check_invariants(prompt_ids: list[int], completion_ids: list[int], mask: list[int], turns: Sequence[Turn],
                     decode: Callable[[list[int]], str] | None = None) -> list[str]:
    """What must hold of every stored episode (an empty list when it does): the turn spans tile the
    completion ids; the mask is 1 exactly on model spans; each model span decodes to its turn's text."""
    problems = []
    if len(mask) != len(completion_ids):
        problems.append(f"mask has {len(mask)} entries for {len(completion_ids)} tokens")
    position = 0
    for i, turn in enumerate(turns):
        if turn.start != position or turn.end < turn.start:
            problems.append(f"turn {i} spans [{turn.start}, {turn.end}) but the previous ended at {position}")
        position = turn.end
        want = 1 if turn.role == "model" else 0
        if any(m != want for m in mask[turn.start:turn.end]):
            problems.append(f"turn {i} ({turn.role}) has mask values other than {want}")
        if decode is not None and turn.role == "model" and decode(completion_ids[turn.start:turn.end]) != turn.text:
            problems.append(f"turn {i}: its tokens do not decode to its text")
    if position != len(completion_ids):
        problems.append(f"the turns cover {position} of {len(completion_ids)} tokens")
    del prompt_ids
    return problems


def engine_io(engine: Any, temperature: float = 1.0, top_p: float = 1.0) -> TokenIO:
    """An engine (``workers.policy.engines.Engine``) as the runner's ``TokenIO``: generate from token ids;
    the prompt and each observation through the tokenizer's chat template when it has one, as text otherwise
    (``workers.policy.chat.ChatFormat``); decode without special tokens."""
    from workers.policy.engines import SamplingParams

    tokenizer = engine.tokenizer
    chat = ChatFormat(tokenizer)

    def generate(contexts: list[list[int]], max_tokens: int, stop: tuple[str, ...]) -> list[Generated]:
        samples = engine.generate_ids(contexts, SamplingParams(n=1, temperature=temperature, top_p=top_p,
                                                               max_tokens=max_tokens, stop=stop))
        return [Generated(s.completion_token_ids, s.logprobs, s.finish_reason, s.version) for s in samples]

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    return TokenIO(generate, chat.prompt_ids, chat.observation_ids, decode)
