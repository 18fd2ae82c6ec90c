"""``python_tests``: the completion's code, then the task's assert-style tests, in one sandbox.

``python_tests`` and ``command``. Model-written code runs only inside
``sandboxes.run``; the verdict is computed here, outside, from the harness report (a channel the code
cannot forge), never from the exit code or stdout.

``python_tests``
    The completion's code (the ```python fenced blocks when present, with any ``if __name__ ==
    "__main__":`` block removed) runs as ``__main__``; then the reference's assert-style tests run as the
    sandbox *epilogue* in the same namespace, one outcome per top-level statement. Score: all-or-nothing
    (default) or the fraction of test statements that pass. Reference: a string of test code, or
    ``{"tests": str, "entry_point": str?}`` (HumanEval style: ``check(entry_point)`` is appended when the
    tests define ``check`` and never call it; with ``scoring: fraction`` the body of ``check`` is inlined
    instead, so each of its asserts earns partial credit). Definitions (imports, functions, constant
    assignments) are not scored.

    Defences, each with a built-in hack case (``calibration.builtin_hack_cases``):

    * ``sys.exit(0)`` / ``raise SystemExit`` / ``os._exit(0)`` / ``os.kill(os.getpid(), …)``: the code or
      the epilogue did not complete, or the harness never reported → fail.
    * printing fake results ("All tests passed", fake JSON): stdout is never read for the verdict.
    * reading or rewriting the tests on disk: the tests travel only inside the trusted epilogue, which the
      harness compiles before the solution starts; they are never written to the work dir, so the
      solution cannot read the expected values from a file (a table-lookup hack) nor replace them.
    * redefining ``AssertionError``: the ``assert`` statement raises the real one regardless.
    * always-equal objects (``__eq__`` returning True, float/str subclasses, objects whose ``__sub__``
      returns 0): with ``strict_values`` (default) every call result in the tests that is not a builtin
      or a test-defined function, and every operand of a comparison other than ``is``, must be plain data
      (exact ``int float complex str bytes bool None list tuple dict set``, recursively), checked with the
      real ``type`` obtained from a literal, not from the (patchable) builtins.
    * monkeypatched builtins (``builtins.abs = lambda x: 0``) or globals shadowing builtins the tests use:
      an integrity check runs before the tests and again after them (so patching during a call is also
      caught) → fail.

    * ``sys.settrace`` line-skipping, ``gc`` object walking and ``ctypes`` writes: refused inside the
      sandbox by the harness's audit hook (``sandboxes.harness``); the attempt raises → fail.
    * a report forged by the solution (walking up the stack to the harness's ``emit`` and reporting
      "all passed" before ``os._exit``; 9 lines, see the tests): the epilogue's last statement writes a
      per-judgment random token to a file collected as an artifact and compared here, outside; a forged
      report comes without it → fail.

    What it does NOT catch:

    * attacks aimed at Temper's epilogue specifically: frame walking that also digs the token out of the
      harness's compiled epilogue and writes the proof file itself, a function under test that looks up
      and rebinds the epilogue's helper globals (their names carry a random per-process prefix), or
      ``sys.modules`` entries replaced so that the tests' own ``import`` gets a fake module. The real fix
      for the first is in the harness (refusing frame access: ``sys._getframe``, ``tb_frame``,
      ``f_back``); until then these are residual risks, as is the same frame walking used to read the
      expected values out of the compiled tests (a lookup table that then passes them honestly);
    * tests that legitimately compare non-plain values (numpy arrays, user classes, frozensets,
      generators): they fail under ``strict_values`` and need ``strict_values: false``, which drops the
      always-equal defence;
    * weak tests: a solution special-casing the visible test inputs passes; a reference whose tests
      cannot run in the sandbox (a missing module) fails every sample — calibration's good cases catch it,
      the verdict itself cannot tell that apart from a solution that broke the import;
    * wall-clock timeouts on an overloaded machine count as the solution's failure (``cpu_seconds`` and
      ``wall_seconds`` in the details tell them apart; the CPU limit is the primary one).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from workers.domains.kinds import CodeReference
from workers.verifiers.base import BaseVerifier, JudgeInput, Verdict, VerifierConfig, scored
from workers.verifiers.epilogue import Epilogue, build_epilogue
from workers.verifiers.sandbox_call import (
    CODE_FAULTS,
    TOKEN_FILE,
    LimitsConfig,
    RuntimeName,
    extract_code,
    imported_modules,
    isolation_refusal,
    missing_module,
    prepare_solution,
    run_facts,
    runtime_field,
    runtime_lacks,
    sandbox_failure,
)

if TYPE_CHECKING:
    from sandboxes import SandboxResult



@dataclass(frozen=True)
class PreparedRun:
    spec: Any  # sandboxes.SandboxSpec (imported lazily)
    epilogue: Epilogue
    token: str
    test_imports: frozenset[str] = frozenset()


class PythonTestsConfig(VerifierConfig):
    scoring: Literal["all_or_nothing", "fraction"] = Field(
        default="all_or_nothing", description="1/0 on all tests passing, or the fraction of test statements passing."
    )
    code_extraction: Literal["auto", "raw"] = Field(default="auto", description="auto: use ```python fences when present.")
    strip_main_guard: bool = Field(default=True, description='Drop `if __name__ == "__main__":` blocks (code runs as __main__).')
    strict_values: bool = Field(default=True, description="Always-equal defence; see the module docstring.")
    prepend_prompt: bool = Field(
        default=False,
        description="Completion-style tasks (HumanEval prompts): run prompt + completion when the completion "
        "has no fenced code, so a completion that only continues the function body works.",
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    runtime: RuntimeName = runtime_field()
    max_code_chars: int = Field(default=100_000, gt=0)


class PythonTestsVerifier(BaseVerifier[PythonTestsConfig]):
    kind: ClassVar[str] = "python_tests"
    Config = PythonTestsConfig

    def build_spec(self, inp: JudgeInput) -> PreparedRun | Verdict:
        """The sandbox spec for ``inp`` (or an early verdict without running anything)."""
        from sandboxes import SandboxSpec

        c = self.config
        ref = self.read_reference(inp)
        assert isinstance(ref, CodeReference)
        tests, entry_point = ref.tests, ref.entry_point
        epilogue = build_epilogue(tests, entry_point=entry_point, strict_values=c.strict_values,
                                  flatten_check=c.scoring == "fraction")
        code = extract_code(inp.completion, c.code_extraction)
        if c.prepend_prompt and "```" not in inp.completion:
            code = inp.prompt + code
        if len(code) > c.max_code_chars:
            return scored(0.0, c.pass_threshold, f"solution longer than {c.max_code_chars} characters")
        prepared, why = prepare_solution(code, c.strip_main_guard)
        if prepared is None:
            return scored(0.0, c.pass_threshold, why)
        token = secrets.token_hex(16)
        spec = SandboxSpec(
            code=prepared,
            epilogue=epilogue.chunks(token),
            artifacts=(TOKEN_FILE,),
            limits=c.limits.to_limits(),
            runtime=c.runtime,
        )
        return PreparedRun(spec, epilogue, token, frozenset(imported_modules(tests)))

    def _judge(self, inp: JudgeInput) -> Verdict:
        from sandboxes import run

        refused = isolation_refusal(self.config.limits)
        if refused is not None:
            return refused
        built = self.build_spec(inp)
        if isinstance(built, Verdict):
            return built
        return self.score_result(run(built.spec), built.epilogue, built.token, built.test_imports)

    def score_result(self, result: SandboxResult, epilogue: Epilogue, token: str | None,
                     test_imports: frozenset[str] = frozenset()) -> Verdict:
        c = self.config
        thr = c.pass_threshold
        failed = sandbox_failure(result)
        if failed is not None:
            return failed
        lacking = self._lacking_module(result, test_imports)
        if lacking is not None:
            return runtime_lacks(c.runtime, lacking, result)
        facts = run_facts(result)
        if result.status in CODE_FAULTS:
            return scored(0.0, thr, CODE_FAULTS[result.status], **facts)
        report = result.report
        if report is None:
            return scored(0.0, thr, "the harness never reported (the solution ended the interpreter)", **facts)
        if not report.code_completed:
            return scored(0.0, thr, f"solution raised before the tests: {report.code_error or 'unknown'}"[:500], **facts)
        outcomes = {s.index: s for s in report.statements}
        for i in range(epilogue.setup_count):
            s = outcomes.get(i)
            if s is None or not s.ok:
                why = s.error if s is not None else "did not run"
                return scored(0.0, thr, f"test setup failed: {why}"[:500], **facts)
        results: list[dict[str, Any]] = []
        for j, src in enumerate(epilogue.test_sources):
            s = outcomes.get(epilogue.setup_count + j)
            results.append({"source": src[:300], "ok": bool(s is not None and s.ok),
                            "error": None if s is None else (s.error or None) and s.error[:300],
                            "scored": epilogue.scored[j], "ran": s is not None})
        facts["tests"] = results
        post = outcomes.get(epilogue.postcheck_index)
        if not report.epilogue_completed or post is None:
            return scored(0.0, thr, "the tests did not run to completion (the solution exited or was killed)", **facts)
        if not post.ok:
            return scored(0.0, thr, f"integrity check after the tests failed: {post.error}"[:500], **facts)
        proof = next((a.data for a in result.artifacts if a.path == TOKEN_FILE), None)
        if token is not None and proof != token.encode():
            # A report that says "all ran" without the epilogue's token file was not written by it.
            return scored(0.0, thr, "the report claims the tests ran but the epilogue left no proof "
                          "(forged report?)", **facts)
        counted = [r for r in results if r["scored"]]
        passed = sum(1 for r in counted if r["ok"])
        facts["passed"] = passed
        facts["total"] = len(counted)
        first_failure = next((r for r in results if not r["ok"]), None)
        reason = None if first_failure is None else f"test failed: {first_failure['source'][:120]} → {first_failure['error']}"[:500]
        if c.scoring == "fraction":
            return scored(passed / len(counted), thr, reason, **facts)
        return scored(1.0 if passed == len(counted) and first_failure is None else 0.0, thr, reason, **facts)

    @staticmethod
    def _lacking_module(result: SandboxResult, test_imports: frozenset[str]) -> str | None:
        """A module the tests import that the runtime does not have: the tests' own import failed, or the
        solution's import of a module the tests also import (a missing package, not a wrong answer)."""
        report = result.report
        if report is None:
            return None
        for error in [report.code_error, *(s.error for s in report.statements)]:
            module = missing_module(error)
            if module is not None and module in test_imports:
                return module
        return None
