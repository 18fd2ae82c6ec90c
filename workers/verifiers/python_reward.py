"""``python_reward``: a reward written by the user as a plain Python function, run in the sandbox.

The user writes ``score(prompt, completion, reference) -> float | None`` (TRL's ``reward_funcs`` and verl's
``compute_score`` in per-sample form). ``reference`` is the task's stored reference, a dict in its domain
kind's shape (``{"answer": "5"}`` for an ``answer`` task; see ``workers.domains.kinds``). ``None`` means
"cannot judge": the verdict is invalid, left out of training and counted, as for every kind.

How a group is judged: ONE sandbox execution per group (``judge_group``), never one per sample. The user's
code runs as the sandbox's ``code`` (it defines ``score``); the trusted epilogue then calls ``score`` once
per sample, each call in its own statement that catches everything the call raises, so one bad sample is
invalid with the last line of its traceback in the user's code, and the others are judged. The verifier's
limits (``limits``: CPU, wall, memory, processes, output) apply to the whole group's execution; a sample
that exceeds them is invalid with the limit named, the samples judged before it keep their verdicts, the
ones after it are invalid ("not judged").

Where the number comes from: each sample's statement ends by raising the epilogue's own exception whose
text carries a per-call random nonce, the sample's index and ``repr(float(value))``; the harness reports
it over its HMAC-signed report channel (``sandboxes.harness``). Outside the sandbox, here, a sample's
result is believed only when its frame carries that nonce and index, and the value is then checked: it
must be a finite number in the declared ``[min_score, max_score]`` (nothing is clamped: out of range,
NaN, infinity, a string or any other type is invalid with the reason), and is mapped linearly onto the
verdict's [0, 1] (the raw value is kept in ``details["raw_score"]``). So printing a fake result (stdout is
never read), writing one to a file (none is read), raising an exception that imitates one (no nonce),
or writing to the report pipe (the MACs break: the whole call is discarded, every sample invalid) gains
nothing.

Validated when saved (``check_reward_code`` on the config: the code parses and binds a ``score`` that can
take three positional arguments; ``dry_run`` on the calibration cases, from ``webapp.catalog.services``).

What it does NOT do:

* It cannot make a reward correct: the user's ``score`` IS the reward, and calibration (the gate every
  kind goes through) is what says whether it agrees with known good, bad and hack cases.
* A ``score`` that executes the completion (``exec(completion)``) hands the model the reward: model code
  running inside ``score`` can patch it or walk stack frames to forge its result (the harness's residual
  risk, ``sandboxes.harness``). Use ``python_tests`` for code tasks; it has the defences.
* ``score`` keeps module state between the samples of one group (they share one interpreter); nothing
  carries over to the next group (a fresh sandbox per execution).
* Packages: the code runs in its ``runtime`` (``python``: the standard library only; ``numpy`` or another
  image of ``runtimes/*.toml``); an import the runtime lacks fails when the code is loaded, and the
  dry run on save says so.
* No per-sample time limit: the limits are per group (an in-process alarm is outlived by code that
  catches ``BaseException``); size ``limits`` for G samples.
"""

from __future__ import annotations

import ast
import math
import re
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field, field_validator, model_validator

from workers.verifiers.base import (
    BaseVerifier,
    InvalidReference,
    JudgeInput,
    Verdict,
    VerifierConfig,
    invalid,
    scored,
)
from workers.verifiers.sandbox_call import (
    PREFIX,
    LimitsConfig,
    RuntimeName,
    isolation_refusal,
    run_facts,
    runtime_field,
    sandbox_failure,
)

if TYPE_CHECKING:
    from sandboxes import SandboxResult

EXAMPLE = '''def score(prompt, completion, reference):
    """1.0 when the completion is one of the task's answers, 0.0 when not."""
    answers = reference["answer"]  # an answer task stores {"answer": "5"} or {"answer": ["0.5", ".5"]}
    if isinstance(answers, str):
        answers = [answers]
    return 1.0 if completion.strip() in answers else 0.0
'''
"""The example shown on the new-verifier page and in the README."""

MAX_CODE_CHARS = 200_000

# The trusted helpers, run as the epilogue's first statements (after the user's code, in its namespace).
# ``{p}r`` calls score() for one sample, catching everything it raises, and ends by raising ``{p}R`` whose
# text is the sample's outcome: "<nonce> <i> ok <repr(float)>" | "none" | "type <name>" |
# "err <line> <function> <Exception: message>". The harness reports it in the statement's frame.
_SETUP = f'''
class {PREFIX}R(BaseException):
    pass
def {PREFIX}w(e, path):
    line, where, tb = 0, '?', e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line, where = tb.tb_lineno, tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    try:
        text = str(e)
    except BaseException:
        text = '<unprintable>'
    name = type(e).__name__
    return (str(line) + ' ' + where + ' ' + name + (': ' + text if text else ''))[:400]
def {PREFIX}r(nonce, i, prompt, completion, reference, path=__file__):
    head = nonce + ' ' + str(i) + ' '
    fn = {PREFIX}r.__globals__.get('score')
    if fn is None or not callable(fn):
        raise {PREFIX}R(head + 'err 0 ? NameError: the code defines no callable score')
    try:
        v = fn(prompt, completion, reference)
    except BaseException as e:
        raise {PREFIX}R(head + 'err ' + {PREFIX}w(e, path)) from None
    if v is None:
        raise {PREFIX}R(head + 'none')
    t = type(v)
    if t is str or t is bytes or getattr(t, '__float__', None) is None:
        raise {PREFIX}R(head + 'type ' + str(t.__qualname__)[:100])
    try:
        f = float(v)
    except BaseException as e:
        raise {PREFIX}R(head + 'type ' + str(t.__qualname__)[:100] + ' (float() raised ' + type(e).__name__ + ')') from None
    raise {PREFIX}R(head + 'ok ' + float.__repr__(f))
'''
SETUP_STATEMENTS = len(ast.parse(_SETUP).body)
_RESULT = re.compile(r"(\d+) (ok|none|type|err)(?: (.*))?\Z", re.DOTALL)
_LINE_IN_TRACEBACK = re.compile(r'File "[^"]*main\.py", line (\d+)')


def _score_binding(node: ast.stmt) -> ast.stmt | None:
    """The top-level statement binding ``score`` (a def, an assignment or an import), if ``node`` is one."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == "score":
        return node
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "score" for t in node.targets):
        return node
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "score":
        return node
    if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == "score" for a in node.names):
        return node
    return None


def check_reward_code(code: str) -> str | None:
    """Why ``code`` cannot be a reward (with its line), or None: it must parse and bind, at top level, a
    ``score`` that takes (prompt, completion, reference). Nothing is run."""
    try:
        tree = ast.parse(code, "<reward>")
    except SyntaxError as exc:
        return f"line {exc.lineno}: {exc.msg}" + (f": {exc.text.strip()}" if exc.text and exc.text.strip() else "")
    except (ValueError, RecursionError, MemoryError) as exc:
        return f"the code does not parse: {type(exc).__name__}: {exc}"[:300]
    bindings = [b for b in map(_score_binding, tree.body) if b is not None]
    if not bindings:
        return "the code defines no top-level score(prompt, completion, reference)"
    node = bindings[-1]
    if isinstance(node, ast.AsyncFunctionDef):
        return f"line {node.lineno}: score must be a plain function, not async"
    if isinstance(node, ast.FunctionDef):
        a = node.args
        positional = [*a.posonlyargs, *a.args]
        required = len(positional) - len(a.defaults)
        if (len(positional) < 3 and a.vararg is None) or required > 3 or any(
                d is None for d in a.kw_defaults):
            names = ", ".join(p.arg for p in positional)
            return (f"line {node.lineno}: score({names}) cannot be called as score(prompt, completion, reference)")
    return None


class PythonRewardConfig(VerifierConfig):
    code: str = Field(
        min_length=1, max_length=MAX_CODE_CHARS,
        description="Python source defining score(prompt, completion, reference) -> float | None "
                    "(None: invalid, left out of training). reference is the task's stored reference, "
                    "e.g. {\"answer\": \"5\"}. Runs in the sandbox, one execution per group.")
    min_score: float = Field(default=0.0, description="The lowest score() may return; below it is invalid.")
    max_score: float = Field(default=1.0, description="The highest score() may return; above it is invalid. "
                             "[min_score, max_score] is mapped onto the verdict's [0, 1].")
    limits: LimitsConfig = Field(default_factory=LimitsConfig,
                                 description="Sandbox limits of one group's execution (all its samples).")
    runtime: RuntimeName = runtime_field()

    @field_validator("code")
    @classmethod
    def _code_defines_score(cls, code: str) -> str:
        problem = check_reward_code(code)
        if problem is not None:
            raise ValueError(problem)
        return code

    @model_validator(mode="after")
    def _range(self) -> PythonRewardConfig:
        if not (math.isfinite(self.min_score) and math.isfinite(self.max_score)):
            raise ValueError("min_score and max_score must be finite numbers")
        if not self.min_score < self.max_score:
            raise ValueError(f"min_score ({self.min_score}) must be below max_score ({self.max_score})")
        return self


class PythonRewardVerifier(BaseVerifier[PythonRewardConfig]):
    kind: ClassVar[str] = "python_reward"
    Config = PythonRewardConfig

    def _judge(self, inp: JudgeInput) -> Verdict:
        return self._judge_group([inp])[0]

    def judge_group(self, inputs: Sequence[JudgeInput]) -> list[Verdict]:
        """Every sample of ``inputs`` in one sandbox execution; each verdict's latency is its share."""
        if not inputs:
            return []
        start = time.perf_counter()
        try:
            verdicts = self._judge_group(inputs)
        except Exception as exc:
            verdicts = [invalid(f"verifier error: {type(exc).__name__}: {exc}"[:500])] * len(inputs)
        share = (time.perf_counter() - start) * 1000.0 / len(inputs)
        return [v.with_latency(share) for v in verdicts]

    def dry_run(self, inputs: Sequence[JudgeInput]) -> str | None:
        """The first sample the code fails on (an exception with its line, a limit, a non-numeric or
        out-of-range return), or None. A ``None`` return is the code's own "cannot judge", not a failure."""
        for n, v in enumerate(self.judge_group(inputs), start=1):
            if v.status == "invalid" and v.details.get("reward_status") != "none":
                return f"case {n}: {v.reason}"
        return None

    # ---------------------------------------------------------------- the execution

    def _references(self, inputs: Sequence[JudgeInput]) -> list[Any]:
        """Each sample's reference as its kind stores it (a bare "5" becomes {"answer": "5"}), or the
        reason it cannot be used."""
        out: list[Any] = []
        for inp in inputs:
            try:
                out.append(self.read_reference(inp).stored())
            except InvalidReference as exc:
                out.append(InvalidReference(str(exc)))
        return out

    def _judge_group(self, inputs: Sequence[JudgeInput]) -> list[Verdict]:
        from sandboxes import SandboxSpec, run

        c = self.config
        refused = isolation_refusal(c.limits)
        if refused is not None:
            return [refused] * len(inputs)
        references = self._references(inputs)
        nonce = secrets.token_hex(16)
        calls = [i for i, ref in enumerate(references) if not isinstance(ref, InvalidReference)]
        statements = "".join(f"{PREFIX}r({nonce!r}, {i}, {inputs[i].prompt!r}, {inputs[i].completion!r}, "
                             f"{references[i]!r})\n" for i in calls)
        epilogue = [_SETUP, statements] if statements else [_SETUP]
        result = run(SandboxSpec(code=c.code, epilogue=epilogue, limits=c.limits.to_limits(), runtime=c.runtime))
        judged = self._read_result(result, nonce, calls)
        verdicts: list[Verdict] = []
        for i, ref in enumerate(references):
            verdicts.append(invalid(f"unusable reference: {ref}") if isinstance(ref, InvalidReference) else judged[i])
        return verdicts

    def _read_result(self, result: SandboxResult, nonce: str, calls: list[int]) -> dict[int, Verdict]:
        """The verdict of each sample index in ``calls``, from the authenticated report only."""
        facts = run_facts(result)
        failed = sandbox_failure(result)
        if failed is not None:
            return dict.fromkeys(calls, failed)
        report = result.report
        if report is None:
            why = result.error or "the sandbox ended before the harness reported"
            if "tampered" in why:
                why = f"the report channel was tampered with, nothing from this execution is trusted ({why})"
            return dict.fromkeys(calls, invalid(f"reward code: {why}"[:500], reward_status="harness", **facts))
        if not report.code_completed:
            line = _LINE_IN_TRACEBACK.findall(result.stderr.decode("utf-8", "replace"))
            where = self._where(int(line[-1])) if line else ""
            return dict.fromkeys(calls, invalid(
                f"the reward code failed when loaded{where}: {report.code_error or 'unknown'}"[:500],
                reward_status="load", **facts))
        setup = report.statements[:SETUP_STATEMENTS]
        broken = next((s for s in setup if not s.ok), None)
        if broken is not None:
            return dict.fromkeys(calls, invalid(f"the reward harness could not start: {broken.error}"[:500],
                                                reward_status="harness", **facts))
        limit = _limit_reason(result, self.config.limits)
        outcomes = report.statements[SETUP_STATEMENTS:]
        verdicts: dict[int, Verdict] = {}
        culprit_named = False
        for i, outcome in zip(calls, outcomes, strict=True):
            prefix = f"{PREFIX}R: {nonce} "
            text = outcome.error or ""
            if text.startswith(prefix) and (m := _RESULT.match(text[len(prefix):])) and int(m.group(1)) == i:
                verdicts[i] = self._verdict(m.group(2), m.group(3) or "", facts)
            elif limit is not None and text.startswith("not run"):
                reason = limit if not culprit_named else f"not judged: an earlier sample of the group hit a limit ({limit})"
                culprit_named = True
                verdicts[i] = invalid(reason[:500], reward_status="limit", **facts)
            elif text.startswith("not run"):
                reason = ("the reward code ended the sandbox (os._exit, a signal) before this sample was judged"
                          if not culprit_named else "not judged: the sandbox ended on an earlier sample")
                culprit_named = True
                verdicts[i] = invalid(reason, reward_status="ended", **facts)
            else:
                # Not the helper's report: the code replaced or bypassed it (no nonce); nothing to believe.
                verdicts[i] = invalid(f"the reward harness did not report this sample (got {text[:200]!r})",
                                      reward_status="harness", **facts)
        return verdicts

    def _verdict(self, what: str, payload: str, facts: dict[str, Any]) -> Verdict:
        c = self.config
        if what == "none":
            return invalid("score() returned None (cannot judge: left out of training)", reward_status="none")
        if what == "type":
            return invalid(f"score() returned {payload}, not a number", reward_status="not_numeric")
        if what == "err":
            line, _, rest = payload.partition(" ")
            function, _, error = rest.partition(" ")
            where = self._where(int(line)) if line.isdigit() and int(line) else ""
            in_function = f" in {function}()" if function not in ("?", "") else ""
            return invalid(f"score() raised{where}{in_function}: {error}"[:500], reward_status="error",
                           stderr_tail=facts.get("stderr_tail", ""))
        value = float(payload)
        if not math.isfinite(value):
            return invalid(f"score() returned {payload}, not a finite number", reward_status="non_finite",
                           raw_score=payload)
        if not c.min_score <= value <= c.max_score:
            return invalid(f"score() returned {value!r}, outside the declared range [{c.min_score}, {c.max_score}]",
                           reward_status="out_of_range", raw_score=value)
        mapped = (value - c.min_score) / (c.max_score - c.min_score)
        return scored(mapped, c.pass_threshold, None, raw_score=value, reward_status="ok")

    def _where(self, line: int) -> str:
        """ " at line N (`source`)" for a line of the user's code."""
        lines = self.config.code.splitlines()
        text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        return f" at line {line}" + (f" (`{text[:120]}`)" if text else "")


def _limit_reason(result: SandboxResult, limits: LimitsConfig) -> str | None:
    if result.status == "timeout":
        return (f"the reward code exceeded the time limit on this sample (the group's execution: "
                f"limits.cpu_seconds={limits.cpu_seconds}, limits.wall_seconds={limits.wall_seconds})")
    if result.status == "memory_limit":
        return f"the reward code exceeded the memory limit (limits.memory_mb={limits.memory_mb})"
    if result.status == "output_limit":
        return f"the reward code printed more than limits.max_output_kb={limits.max_output_kb} KB"
    if result.status == "killed":
        return f"the reward code was killed ({result.error or 'a signal'})"
    return None
