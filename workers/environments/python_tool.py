"""``python_tool``: the model may run Python in the episode's sandbox session before it answers.

A model turn that holds ``<py>code</py>`` is a tool call: the code runs in the session (its variables and
files live on across the episode's calls) and the next observation is ``<out>…</out>`` with what it printed,
or the error it raised. A turn without a tool call is the final answer, judged by the domain's verifier. A
call whose closing tag never came (the turn hit its token limit) is a ``parse_error`` observation; a call
that runs past its time limit is a ``timeout`` observation and the episode goes on.

The reward is the verifier's verdict on the final answer: nothing the code does in the session (a file
named ``reward``, a printed "correct") reaches it. Files the domain names in ``artifacts`` are kept with the
episode when its session closes (name, size, digest, a text preview), for people to read; scoring never
sees them.

A call's latency is the cell's wall time in the session; opening the session (on the episode's first call,
when the loop opens sessions lazily) is the session's start latency, recorded apart.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import Field, field_validator

from sandboxes.api import check_relative_path
from workers.environments.base import (
    EnvParams,
    EnvTask,
    Judge,
    Observation,
    ObservationStatus,
    Transcript,
    judge_final_answer,
)
from workers.verifiers.base import Verdict

_CALL = re.compile(r"<py>(.*?)</py>", re.DOTALL)
MAX_ARTIFACT_PATTERNS = 8


class PythonTool:
    name: ClassVar[str] = "python_tool"
    needs_session: ClassVar[bool] = True
    stop: ClassVar[tuple[str, ...]] = ("</py>",)

    class Params(EnvParams):
        max_output_chars: int = Field(200, ge=16, le=100_000, description="Tool output shown to the model")
        setup: str = Field("", description="Python run in the session before the first turn (helpers, data)")
        artifacts: tuple[str, ...] = Field(
            (), max_length=MAX_ARTIFACT_PATTERNS,
            description="Files of the session to keep with the episode when it ends (paths or glob patterns "
                        "relative to its work directory, e.g. out.txt or *.csv); shown on the episode's page, "
                        "never scored")
        runtime: str = Field("python", description="The sandbox runtime the session runs in (runtimes/*.toml; "
                                                   "python: the standard library only)")

        @field_validator("runtime")
        @classmethod
        def _defined_runtime(cls, name: str) -> str:
            from sandboxes.runtimes import check_name

            return check_name(name)

        @field_validator("artifacts")
        @classmethod
        def _relative_paths(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
            for pattern in patterns:
                if len(pattern) > 200:
                    raise ValueError(f"{pattern[:40]!r}…: at most 200 characters")
                check_relative_path(pattern, "artifacts")
            return patterns

    def __init__(self, params: EnvParams, judge: Judge) -> None:
        assert isinstance(params, PythonTool.Params)
        self.params, self.judge = params, judge
        self.task: EnvTask | None = None
        self.session: Any = None

    def start(self, task: EnvTask, seed: int, session: Any | None) -> Observation:
        if session is None:
            raise ValueError("python_tool needs a sandbox session")
        self.task, self.session = task, session
        if self.params.setup:
            result = session.run(self.params.setup)
            if result.status != "ok":
                return Observation(task.prompt, done=True, status="env_error",
                                   info={"error": f"the environment's setup failed: {result.error}"})
        return Observation(task.prompt)

    def step(self, action: str) -> Observation:
        if "<py>" not in action:
            return Observation("", done=True, status="done")  # no tool call: the final answer
        match = _CALL.search(action)
        if match is None:
            return Observation("<out>error: the tool call was not closed; write <py>code</py></out>\n",
                               status="parse_error", info={"tool": "python", "args": action[-200:]})
        code = match.group(1).strip()
        result = self.session.run(code)
        latency = result.wall_seconds  # the cell's own time: not the session's start, when this call opened it
        limit = self.params.max_output_chars
        if result.status == "session_error":
            return Observation("", done=True, status="env_error",
                               info={"tool": "python", "args": code, "error": result.error, "latency_s": latency})
        status: ObservationStatus
        if result.status == "ok":
            shown, status = result.stdout.strip() or "(no output)", "ok"
        elif result.status == "timeout":
            shown, status = "error: timed out", "timeout"
        else:
            shown, status = f"error: {result.error or result.status}", "tool_error"
        if len(shown) > limit:
            shown = shown[:limit] + "…"
        return Observation(f"<out>{shown}</out>\n", status=status,
                           info={"tool": "python", "args": code, "result": shown, "latency_s": latency})

    def score(self, transcript: Transcript) -> Verdict:
        return judge_final_answer(self.judge, transcript)

    def close(self) -> None:
        self.task, self.session = None, None
