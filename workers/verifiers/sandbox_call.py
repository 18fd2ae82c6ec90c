"""The sandbox call of the code-running verifiers: limits per judgment, the isolation refusal, what a
sandbox result says about itself (its own failure, the code's fault) and the code extraction they share.

Model-written code runs only inside ``sandboxes.run``; the verdict is computed outside, from the harness
report (a channel the code cannot forge), never from the exit code or stdout alone. The kinds are
``workers.verifiers.python_tests`` and ``workers.verifiers.command``; the trusted test epilogue is
``workers.verifiers.epilogue``.
"""

from __future__ import annotations

import ast
import re
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from workers.verifiers.base import Verdict, invalid

if TYPE_CHECKING:  # the sandbox package is imported lazily, when a judgment actually runs code
    from sandboxes import Limits, SandboxResult

PREFIX = f"_t{secrets.token_hex(3)}"
"""A random per-process prefix of the epilogue's helper names (the code under test cannot guess them)."""
TOKEN_FILE = f"{PREFIX}.ok"
"""The proof file a trusted epilogue or test script writes when it completes (compared here, outside)."""


class LimitsConfig(BaseModel):
    """Sandbox limits per judgment (mapped onto ``sandboxes.Limits``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_seconds: float = Field(default=5.0, gt=0, le=600)
    wall_seconds: float = Field(default=10.0, gt=0, le=1200)
    memory_mb: int = Field(default=512, ge=16, le=65536)
    max_processes: int = Field(default=32, ge=1, le=4096)
    max_file_mb: int = Field(default=16, ge=1, le=4096)
    max_open_files: int = Field(default=64, ge=8, le=65536)
    max_output_kb: int = Field(default=1024, ge=1, le=1 << 20)
    require_isolation: bool = Field(
        default=True,
        description="Refuse (invalid) to run model code when the sandbox has no namespace isolation "
        "(tier 'rlimits-only', e.g. a machine without root or user namespaces).",
    )

    def to_limits(self) -> Limits:
        from sandboxes import Limits

        return Limits(
            cpu_seconds=self.cpu_seconds,
            wall_seconds=self.wall_seconds,
            memory_bytes=self.memory_mb << 20,
            max_processes=self.max_processes,
            max_file_bytes=self.max_file_mb << 20,
            max_open_files=self.max_open_files,
            max_output_bytes=self.max_output_kb << 10,
        )



def _defined_runtime(name: str) -> str:
    from sandboxes.runtimes import check_name

    return check_name(name)  # "unknown sandbox runtime 'x'; defined: numpy, python (add runtimes/x.toml)"


RuntimeName = Annotated[str, AfterValidator(_defined_runtime)]
"""A defined sandbox runtime's name (``sandboxes.runtimes``: ``runtimes/*.toml``, or ``python``)."""


def runtime_field() -> Any:
    return Field(default="python", description="The sandbox runtime the code runs in: python (the host's "
                 "interpreter, standard library only) or a runtime defined in runtimes/*.toml, such as numpy "
                 "(its packages in a read-only image, its heavy modules preloaded)")


# ---------------------------------------------------------------- code extraction

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str, policy: Literal["auto", "raw"] = "auto", languages: Sequence[str] = ("python", "py")) -> str:
    """The code in a completion: every fenced block tagged with one of ``languages`` (or untagged), joined;
    the whole text when there are no such fences (or ``policy="raw"``)."""
    if policy == "raw" or "```" not in text:
        return text
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in (*languages, "")]
    return "\n\n".join(blocks) if blocks else text


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If):
        return False
    t = node.test
    return (
        isinstance(t, ast.Compare)
        and len(t.ops) == 1
        and isinstance(t.ops[0], ast.Eq)
        and {ast.unparse(t.left), ast.unparse(t.comparators[0])} in ({"__name__", "'__main__'"}, {"__name__", '"__main__"'})
    )


def prepare_solution(code: str, strip_main_guard: bool) -> tuple[str | None, str | None]:
    """(code to run, reason it cannot run). Parsing is done here so a syntax error costs no sandbox."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        where = f" (line {exc.lineno})" if isinstance(exc, SyntaxError) and exc.lineno else ""
        return None, f"solution does not parse: {type(exc).__name__}{where}"
    if strip_main_guard and any(_is_main_guard(n) for n in tree.body):
        tree.body = [n for n in tree.body if not _is_main_guard(n)]
        return ast.unparse(tree), None
    return code, None



# ---------------------------------------------------------------- what a result says


def isolation_refusal(limits: LimitsConfig) -> Verdict | None:
    import sandboxes

    tier = sandboxes.probe_tier()
    if limits.require_isolation and tier == "rlimits-only":
        return invalid("refusing to run model code: the sandbox tier here is 'rlimits-only' (no namespaces); "
                       "run the verify worker as root or set limits.require_isolation=false", tier=tier)
    return None


def sandbox_failure(result: SandboxResult) -> Verdict | None:
    """An invalid verdict when the sandbox itself failed (not the code under test): a sandbox that could not
    start, an image that could not be built (the package and pip's reason are in the error), after the
    pool's retries on fresh zygotes."""
    if result.status == "sandbox_error":
        return invalid(f"sandbox error: {result.error or 'unknown'}"[:500], **sandbox_facts(result))
    return None


_NO_MODULE = re.compile(r"^ModuleNotFoundError: No module named '([^']+)'")


def missing_module(error: str | None) -> str | None:
    """The top-level module an error says is not installed (``ModuleNotFoundError: No module named 'x.y'``)."""
    match = _NO_MODULE.match(error or "")
    return match.group(1).split(".")[0] if match else None


def imported_modules(source: str) -> set[str]:
    """The top-level modules a (trusted) test text imports."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def runtime_lacks(runtime: str, module: str, result: SandboxResult) -> Verdict:
    """Invalid: the runtime has no module the task's tests need — the domain's setup, not the model's fault."""
    hint = ("the default runtime is the standard library only: name a runtime that has it (runtimes/*.toml) "
            "in the verifier's config" if runtime == "python" else
            f"add the package that provides it to runtimes/{runtime}.toml")
    return invalid(f"the sandbox runtime {runtime!r} has no module {module!r}, which the tests import; {hint}",
                   missing_module=module, **sandbox_facts(result))


def sandbox_facts(result: SandboxResult) -> dict[str, Any]:
    """Where it ran: the runtime, a warm or cold start, the zygotes tried, the image build waited for."""
    return {"tier": result.tier, "runtime": result.runtime,
            "sandbox_start": None if result.warm is None else ("warm" if result.warm else "cold"),
            "sandbox_attempts": result.attempts, "image_build_s": round(result.build_seconds, 3)}


CODE_FAULTS = {
    "timeout": "solution exceeded the time limit",
    "memory_limit": "solution exceeded the memory limit",
    "output_limit": "solution exceeded the output limit",
    "killed": "solution was killed",
}


def run_facts(result: SandboxResult) -> dict[str, Any]:
    return {
        **sandbox_facts(result),
        "sandbox_status": result.status,
        "exit_code": result.exit_code,
        "signal": result.signal,
        "cpu_seconds": round(result.cpu_seconds or 0.0, 4),
        "wall_seconds": round(result.wall_seconds or 0.0, 4),
        "peak_memory_bytes": result.peak_memory_bytes,
        "stdout_tail": result.stdout[-400:].decode("utf-8", "replace"),
        "stderr_tail": result.stderr[-800:].decode("utf-8", "replace"),
    }
