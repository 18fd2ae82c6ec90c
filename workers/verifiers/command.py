"""``command``: terminal-style tasks judged by a test script and expected files.

``command``
    Terminal-style tasks: the completion (a shell script by default; or Python; or a JSON object mapping
    relative paths to file contents) runs in the sandbox work dir next to the reference's read-only input
    ``files``; then the reference's test script runs there as the sandbox ``command`` (passed in argv,
    never as a file the completion could read first; its exit code comes over the harness channel, and a
    wrapper writes a per-judgment token file when it exits 0, so a forged report fails) and the declared
    ``expected_files`` are collected as artifacts and compared with the reference *outside* the sandbox.
    Pass = script exit 0 (when a script is given) and every expected file matches.
    What it does NOT catch: the test script runs after the completion in the same sandbox, so a completion
    that leaves a background process behind (watching for the script to start) or, with
    ``completion_format: python``, changes the interpreter's working directory or environment can
    influence it; keep scripts self-contained with absolute paths, and prefer ``expected_files``
    (compared outside the sandbox) for the decisive facts. Expected files are never placed in the sandbox.
"""

from __future__ import annotations

import json
import secrets
import shutil
from typing import ClassVar, Literal

from pydantic import Field

from workers.domains.kinds import CommandReference
from workers.verifiers.base import BaseVerifier, InvalidReference, JudgeInput, Verdict, VerifierConfig, scored
from workers.verifiers.sandbox_call import (
    CODE_FAULTS,
    TOKEN_FILE,
    LimitsConfig,
    RuntimeName,
    extract_code,
    isolation_refusal,
    prepare_solution,
    run_facts,
    runtime_field,
    sandbox_failure,
)


class CommandConfig(VerifierConfig):
    completion_format: Literal["shell", "python", "files_json"] = Field(
        default="shell", description="How the completion produces files: a bash script, Python code, or {path: content}."
    )
    interpreter: Literal["bash", "python"] = Field(default="bash", description="Default interpreter of the test script.")
    bash_path: str = Field(default="/bin/bash", description="Absolute path of bash inside the sandbox.")
    python_path: str | None = Field(
        default=None, description="Absolute path of Python inside the sandbox; default: the runtime's interpreter "
        "(python3 of the system root for the default runtime)."
    )
    compare: Literal["exact", "strip"] = Field(default="strip", description="How expected files are compared.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    runtime: RuntimeName = runtime_field()
    max_completion_chars: int = Field(default=100_000, gt=0)


def _safe_relpath(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and all(parts)


_SHELL_RUNNER = """import subprocess
subprocess.run([{bash!r}, "-c", {script!r}], check=False)
"""

_FILES_WRITER = """import os
for _p, _c in {files!r}.items():
    _d = os.path.dirname(_p)
    if _d:
        os.makedirs(_d, exist_ok=True)
    with open(_p, "w") as _f:
        _f.write(_c)
"""


def _runtime_python(runtime: str) -> str:
    """The interpreter of a test script: the runtime image's (its packages importable), else the system's."""
    from sandboxes import runtimes

    definition = runtimes.get(runtime)
    if definition.is_default:
        return _system_python()
    return str(runtimes.image_path(definition) / "bin" / "python")  # built before the sandbox starts


def _system_python() -> str:
    # The sandbox sees the host's system root read-only, but not necessarily a virtualenv's interpreter.
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if found is None:
        raise InvalidReference("no python3 in /usr/local/bin:/usr/bin:/bin for a python test script")
    return found


class CommandVerifier(BaseVerifier[CommandConfig]):
    kind: ClassVar[str] = "command"
    Config = CommandConfig

    def _code(self, completion: str) -> str | Verdict:
        c = self.config
        thr = c.pass_threshold
        if c.completion_format == "python":
            prepared, why = prepare_solution(extract_code(completion), strip_main_guard=True)
            return prepared if prepared is not None else scored(0.0, thr, why)
        if c.completion_format == "shell":
            script = extract_code(completion, languages=("bash", "sh", "shell", "console"))
            return _SHELL_RUNNER.format(bash=c.bash_path, script=script)
        try:
            files = json.loads(extract_code(completion, languages=("json",)))
        except (ValueError, RecursionError):
            return scored(0.0, thr, "completion is not a JSON object of files")
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            return scored(0.0, thr, "completion must map paths to file contents (strings)")
        bad = [k for k in files if not _safe_relpath(k)]
        if bad:
            return scored(0.0, thr, f"completion writes outside the work dir: {bad[:3]}")
        return _FILES_WRITER.format(files=files)

    def _judge(self, inp: JudgeInput) -> Verdict:
        from sandboxes import SandboxSpec, run

        c = self.config
        thr = c.pass_threshold
        ref = self.read_reference(inp)
        assert isinstance(ref, CommandReference)
        refused = isolation_refusal(c.limits)
        if refused is not None:
            return refused
        if len(inp.completion) > c.max_completion_chars:
            return scored(0.0, thr, f"completion longer than {c.max_completion_chars} characters")
        code = self._code(inp.completion)
        if isinstance(code, Verdict):
            return code
        files: dict[str, str] = dict(ref.files)
        command: list[str] | None = None
        token = secrets.token_hex(16)
        if ref.script:
            # The script travels in argv of a process started after the completion ran — never as a file
            # the completion could read (and learn the checks from) or replace. A bash wrapper writes a
            # per-judgment token when it exits 0: a report forged by the completion (which ends the
            # interpreter before the command runs) cannot produce it.
            interp = ref.interpreter or c.interpreter
            argv = [c.bash_path, "-c", ref.script] if interp == "bash" else \
                [c.python_path or _runtime_python(c.runtime), "-c", ref.script]
            wrapper = f'"$@"; rc=$?; if [ $rc -eq 0 ]; then printf %s {token} > {TOKEN_FILE} || exit 97; fi; exit $rc'
            command = [c.bash_path, "-c", wrapper, "temper-check", *argv]
        spec = SandboxSpec(code=code, files=files, artifacts=(*ref.expected_files, TOKEN_FILE), command=command,
                           limits=c.limits.to_limits(), runtime=c.runtime)
        result = run(spec)
        failed = sandbox_failure(result)
        if failed is not None:
            return failed
        facts = run_facts(result)
        if result.status in ("timeout", "memory_limit", "output_limit", "killed"):
            return scored(0.0, thr, CODE_FAULTS[result.status], **facts)
        report = result.report
        if report is None:
            return scored(0.0, thr, "the harness never reported (the completion ended the interpreter)", **facts)
        facts["code_completed"] = report.code_completed
        facts["code_error"] = report.code_error
        problems: list[str] = []
        if command is not None:
            facts["script_exit_code"] = report.command_exit_code
            if report.command_exit_code != 0:
                problems.append(f"test script exited with {report.command_exit_code}")
        got = {a.path: a.data for a in result.artifacts}
        if command is not None and not problems and got.get(TOKEN_FILE) != token.encode():
            problems.append("the report says the script passed but the script left no proof (forged report?)")
        file_results = {}
        for path, want in ref.expected_files.items():
            data = got.get(path)
            if data is None:
                file_results[path] = "missing"
            else:
                text = data.decode("utf-8", "replace")
                same = text == want if c.compare == "exact" else text.strip() == want.strip()
                file_results[path] = "ok" if same else "differs"
        if file_results:
            facts["expected_files"] = file_results
            problems += [f"{p}: {r}" for p, r in file_results.items() if r != "ok"]
        return scored(0.0 if problems else 1.0, thr, "; ".join(problems)[:500] or None, **facts)
