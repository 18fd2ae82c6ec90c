"""Environments for the benchmarks, registered the way a deployment registers its own (``TEMPER_ENVIRONMENTS``):

    TEMPER_ENVIRONMENTS=bench_slow_tool=bench.envs:SlowTool

``bench/pipeline.py --episodes`` sets it for the workers it starts.

``SlowTool`` (``bench_slow_tool``): a heavy-tailed tool, the multi-turn counterpart of the pipeline bench's
slow judge. Each of the first ``tool_turns`` model turns is a tool call, whatever its text (the demo model
never writes tool syntax, so any text is the action): a cell run in the episode's real sandbox session that
sleeps a delay drawn from a lognormal (median ``median_ms``, sigma ``sigma``, capped at ``cap_s``) and
prints a short line. Delays are drawn per call from the episode's seed and its task, so a rerun sees the
same ones. The observation is that line and the task's prompt again (``"\\nok 1\\n37+48="``: a few tokens,
so three turns fit the demo model's 64-token context). The model turn after the last tool call is the final
answer, judged by the domain's verifier, as ``python_tool`` judges its answer.

What it does not model: a tool whose result the model needs (the demo model cannot use one; it answers
after a restated prompt at ~0% exact match, against ~35% on the bare prompt, having only ever seen one
line per sequence), or a tool that burns CPU: the cell sleeps, as a tool waiting on a network or a
subprocess does.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any, ClassVar

from pydantic import Field

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


class SlowTool:
    name: ClassVar[str] = "bench_slow_tool"
    needs_session: ClassVar[bool] = True
    stop: ClassVar[tuple[str, ...]] = ()

    class Params(EnvParams):
        tool_turns: int = Field(2, ge=0, le=64, description="Tool calls before the final answer")
        median_ms: float = Field(100.0, gt=0, le=60_000, description="Median delay of one tool call")
        sigma: float = Field(1.0, ge=0, le=4, description="Lognormal sigma of the delay (1: p99 ~10x median)")
        cap_s: float = Field(2.0, gt=0, le=600, description="Longest delay of one call")

    def __init__(self, params: EnvParams, judge: Judge) -> None:
        assert isinstance(params, SlowTool.Params)
        self.params, self.judge = params, judge
        self.task: EnvTask | None = None
        self.session: Any = None
        self.rng = random.Random(0)
        self.calls = 0

    def start(self, task: EnvTask, seed: int, session: Any | None) -> Observation:
        if session is None:
            raise ValueError("bench_slow_tool needs a sandbox session")
        self.task, self.session, self.calls = task, session, 0
        # the same episode (task, seed) draws the same delays; a group's G episodes differ by their seeds
        self.rng = random.Random(f"{seed}:{task.prompt}")
        return Observation(task.prompt)

    def delay(self) -> float:
        p = self.params
        return min(p.cap_s, p.median_ms / 1000.0 * math.exp(self.rng.gauss(0.0, p.sigma)))

    def step(self, action: str) -> Observation:
        assert self.task is not None
        self.calls += 1
        if self.calls > self.params.tool_turns:
            return Observation("", done=True, status="done")  # the final answer
        delay = self.delay()
        code = f"import time\ntime.sleep({delay:.4f})\nprint('ok {self.calls}')"
        started = time.monotonic()
        result = self.session.run(code)
        latency = time.monotonic() - started
        info: dict[str, Any] = {"tool": "sleep", "args": f"{delay:.4f}", "latency_s": latency}
        if result.status == "session_error":
            return Observation("", done=True, status="env_error", info={**info, "error": result.error})
        status: ObservationStatus
        if result.status == "ok":
            shown, status = result.stdout.strip()[:16] or "(no output)", "ok"
        elif result.status == "timeout":
            shown, status = "timeout", "timeout"
        else:
            shown, status = "error", "tool_error"
        return Observation(f"\n{shown}\n{self.task.prompt}", status=status, info={**info, "result": shown})

    def score(self, transcript: Transcript) -> Verdict:
        return judge_final_answer(self.judge, transcript)

    def close(self) -> None:
        self.task, self.session = None, None
