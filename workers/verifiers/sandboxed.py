"""Code-running verifiers: ``python_tests`` and ``command``. Model-written code runs only inside
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

import ast
import builtins
import functools
import json
import re
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from workers.domains.kinds import CodeReference, CommandReference
from workers.verifiers.base import (
    BaseVerifier,
    InvalidReference,
    JudgeInput,
    Verdict,
    VerifierConfig,
    invalid,
    scored,
)

if TYPE_CHECKING:  # the sandbox package is imported lazily, when a judgment actually runs code
    from sandboxes import Limits, SandboxResult


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


# ---------------------------------------------------------------- the trusted epilogue

_BUILTIN_NAMES = frozenset(dir(builtins))
# Literal-derived builtin types (the integrity check compares builtins' bindings with these).
_LITERAL_TYPES = {"int": "0", "float": "0.0", "complex": "0j", "str": "''", "bytes": "b''", "bool": "True",
                  "list": "[]", "tuple": "()", "dict": "{}", "set": "{0}", "type": "type"}

# The epilogue's trusted helpers. Everything they rely on is taken from literals (``().__class__.__class__``
# is the real ``type``) or bound as default arguments, never looked up in the patchable builtins.
_SETUP_TEMPLATE = '''
def {p}p(v, d=0, T=().__class__.__class__, P=({plain_types})):
    t = T(v)
    if d > 60:
        raise AssertionError('temper: value nested too deeply to check')
    if t is P[7] or t is P[8] or t is P[10]:
        for x in v:
            {p}p(x, d + 1)
        return v
    if t is P[9]:
        for k, x in v.items():
            {p}p(k, d + 1)
            {p}p(x, d + 1)
        return v
    for u in P:
        if t is u:
            return v
    raise AssertionError('temper: non-plain value of type ' + t.__qualname__ + ' in a test')
def {p}i(names, own, token=None, T=().__class__.__class__, F=().__class__.__class__.__dict__['__flags__'],
         B=().__class__.__class__(''.join), L={{{literal_map}}}):
    g = {p}i.__globals__
    b = g.get('__builtins__')
    bd = b if T(b) is T({{}}) else b.__dict__
    if T(bd) is not T({{}}):
        raise AssertionError('temper: __builtins__ replaced')
    bad = []
    for n in names:
        x = bd.get(n)
        if n in g and n not in own:
            bad.append(n + ' (shadowed by a global)')
        elif not (x is L[n] if n in L else x.__name__ == n if T(x) is B else
                  not F.__get__(x) & 512 and x.__name__ == n if T(x) is T else
                  x is None or x is True or x is False or x is Ellipsis or x is NotImplemented):
            bad.append(n)
    if bad:
        raise AssertionError('temper: builtins tampered with: ' + ', '.join(bad))
    if token is not None:
        f = open('{p}.ok', 'w')
        f.write(token)
        f.close()
'''


class _TestRewriter(ast.NodeTransformer):
    """Route comparisons and non-builtin call results through the epilogue's plain-value checks."""

    def __init__(self, prefix: str, exempt_calls: frozenset[str], modules: frozenset[str]) -> None:
        self.p = prefix
        self.exempt = exempt_calls | modules
        self.modules = modules

    def _plain(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Constant) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == f"{self.p}p"
        ):
            return node  # a literal, or already checked
        return ast.copy_location(ast.Call(ast.Name(f"{self.p}p", ast.Load()), [node], []), node)

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        # ``a == b < c`` → ``p(a) == p(b) < p(c)``: chaining and short-circuiting are kept; identity
        # comparisons (``is``/``is not``) cannot be faked, so their operands are left alone.
        self.generic_visit(node)
        operands = [node.left, *node.comparators]
        identity = [isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops]
        checked = []
        for k, operand in enumerate(operands):
            neighbours = identity[max(0, k - 1) : k + 1]
            checked.append(operand if all(neighbours) else self._plain(operand))
        node.left, node.comparators = checked[0], checked[1:]
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        root = node.func
        while isinstance(root, ast.Attribute):
            root = root.value
        # builtins, functions the tests define, and the tests' own imports (``random.Random(42)``,
        # ``math.isclose``) are trusted; anything else may be the solution's and must return plain data.
        if isinstance(root, ast.Name) and root.id in self.exempt and (root is node.func or root.id in self.modules):
            return node
        return self._plain(node)


_DEFINITION_NODES = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                     ast.Assign, ast.AnnAssign, ast.AugAssign)


@dataclass(frozen=True)
class Epilogue:
    """The trusted epilogue for one task's tests; ``source(token)`` is the text for one judgment."""

    body: str  # the pre-check, the leading definitions and the test statements (after the helpers)
    postcheck: str  # the integrity post-check call, without its closing ``token)``
    setup_count: int  # statements [0, setup_count): the trusted setup, pre-check and leading definitions
    test_sources: list[str]  # one per test statement, original text
    scored: list[bool]  # whether each test statement counts towards the score
    postcheck_index: int  # the index of the integrity post-check statement

    def source(self, token: str | None = None) -> str:
        """The post-check writes ``token`` to ``TOKEN_FILE`` (collected as an artifact, compared outside):
        proof that the real epilogue ran to its end, which a forged report cannot give without also
        finding the token."""
        return "\n".join(self.chunks(token))

    def chunks(self, token: str | None = None) -> tuple[str, str, str]:
        """``source(token)`` as the sandbox's epilogue chunks, each compiled once per process by the
        sandbox: the helpers (the same for all tests), the body (the same for every judgment of these
        tests) and the one-line post-check carrying this judgment's token."""
        return _setup_block(), self.body, f"{self.postcheck}, {token!r})\n"


def build_epilogue(tests: str, *, entry_point: str | None, strict_values: bool, flatten_check: bool = False) -> Epilogue:
    """The trusted epilogue for ``tests``; raises InvalidReference when the tests do not parse.

    Cached per process: one task's tests are judged many times (G samples per prompt). The cached
    epilogue keeps its random helper prefix, which the solution never sees before it runs.
    """
    return _build_epilogue(tests, entry_point, strict_values, flatten_check)


# One random prefix per process for the helpers' global names: the solution never sees the epilogue
# before it runs, so it cannot know them; a fixed prefix would let a hack target them by name.
_PREFIX = f"_t{secrets.token_hex(3)}"
TOKEN_FILE = f"{_PREFIX}.ok"
_IGNORED_NAMES = frozenset({"__name__", "__doc__", "__builtins__", "__file__", "__spec__", "__loader__",
                            "__package__", "__build_class__", "__debug__", "__import__"})


@functools.cache
def _setup_source() -> str:
    return _SETUP_TEMPLATE.format(
        p=_PREFIX,
        plain_types="0 .__class__, 0.0 .__class__, 0j .__class__, ''.__class__, b''.__class__, True.__class__, "
        "None.__class__, [].__class__, ().__class__, {}.__class__, {0}.__class__",
        literal_map=", ".join(f"{k!r}: ({v}).__class__" if k != "type" else f"{k!r}: ().__class__.__class__"
                              for k, v in _LITERAL_TYPES.items()),
    )


@functools.lru_cache(maxsize=512)
def _flattened_check(tree: ast.Module, entry_point: str) -> list[ast.stmt] | None:
    """``def check(candidate): <body>`` as top-level ``candidate = entry_point`` + body, so that each of
    its asserts is its own statement (partial credit); None when the body cannot run at top level."""
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if fn is None or len(fn.args.args) != 1 or fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs:
        return None
    if any(isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom, ast.Global, ast.Nonlocal, ast.Await))
           for n in ast.walk(fn)):
        return None
    return [*ast.parse(f"{fn.args.args[0].arg} = {entry_point}").body, *fn.body]


@functools.lru_cache(maxsize=512)
def _build_epilogue(tests: str, entry_point: str | None, strict_values: bool, flatten_check: bool) -> Epilogue:
    try:
        tree = ast.parse(tests)
    except SyntaxError as exc:
        raise InvalidReference(f"test code does not parse: {exc.msg} (line {exc.lineno})") from None
    defined: set[str] = set()
    imported: set[str] = set()
    stored: set[str] = set()
    loaded_builtins: set[str] = set()
    calls_check = has_import = has_fstring = False
    checked: list[ast.Call | ast.Compare] = []  # where _TestRewriter may wrap values (see _spliced)
    for n in ast.walk(tree):  # one pass: what the tests define, import, bind and use
        if isinstance(n, ast.Name):
            if isinstance(n.ctx, ast.Store):
                stored.add(n.id)
            elif n.id in _BUILTIN_NAMES:
                loaded_builtins.add(n.id)
        elif isinstance(n, ast.Call):
            calls_check = calls_check or (isinstance(n.func, ast.Name) and n.func.id == "check")
            checked.append(n)
        elif isinstance(n, ast.Compare):
            checked.append(n)
        elif isinstance(n, ast.JoinedStr):
            has_fstring = True
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            has_import = True
            imported.update((a.asname or a.name).split(".")[0] for a in n.names)
    body = list(tree.body)
    appended: str | None = None  # the check call, appended to the text
    text_path = True  # False: the statements exist only as trees (a flattened check), unparse them
    if entry_point is not None:
        if not entry_point.isidentifier():
            raise InvalidReference(f"entry_point {entry_point!r} is not an identifier")
        if "check" in defined and not calls_check:
            flat = _flattened_check(tree, entry_point) if flatten_check else None
            if flat is not None:
                body.extend(flat)
                text_path = False
                stored.update(t.id for t in ast.walk(ast.Module(flat, [])) if isinstance(t, ast.Name)
                              and isinstance(t.ctx, ast.Store))
            else:
                body.append(ast.Expr(ast.Call(ast.Name("check", ast.Load()), [ast.Name(entry_point, ast.Load())], [])))
                appended = f"check({entry_point})\n"
    if all(isinstance(n, _DEFINITION_NODES) for n in body):
        raise InvalidReference("the tests contain no test statements (only definitions)")
    # Leading definitions (imports, helpers, ``def check``) are setup statements: never scored.
    n_leading = next(i for i, n in enumerate(body) if not isinstance(n, _DEFINITION_NODES))
    leading, body = body[:n_leading], body[n_leading:]
    lines = tests.split("\n")  # as the tokenizer counts lines (splitlines also splits at \x0c, \u2028, ...)
    test_sources = [_segment(lines, n) or ast.unparse(n) for n in body]
    scored_flags = [not isinstance(n, _DEFINITION_NODES) for n in body]

    # Every name the tests bind themselves (defs, imports, assignments, loop targets): the tests may
    # shadow a builtin on purpose; only the solution must not.
    bound = defined | imported | stored
    used_builtins = sorted(loaded_builtins - bound - _IGNORED_NAMES)
    if has_import:
        used_builtins.append("__import__")  # a patched __import__ could hand the tests fake modules
    check_call = f"{_PREFIX}i({used_builtins!r}, {sorted(bound)!r})"
    # Statements: the helpers (one ``if True:`` block, a chunk of its own), the pre-check, the leading
    # definitions, the tests, then the post-check (also a chunk of its own, see ``Epilogue.chunks``).
    setup = f"{check_call}\n"
    exempt, modules = frozenset(_BUILTIN_NAMES | defined | imported), frozenset(imported)
    text = None
    if text_path and not has_fstring and "\r" not in tests:
        # The common case: the tests' own text with the checks spliced in (no unparse: the slow part).
        text = _spliced(tests, checked, exempt, modules) if strict_values else tests
        if text is not None:
            text = setup + text + ("" if text.endswith("\n") else "\n") + ("" if appended is None else appended)
            try:  # the sandbox's own compilation, cached there: the runner finds it done
                from sandboxes.harness import prepare_epilogue

                prepare_epilogue((_setup_block(), text))
            except (SyntaxError, ValueError):
                text = None
    if text is None:
        if strict_values:
            rewriter = _TestRewriter(_PREFIX, exempt, modules)
            leading = [rewriter.visit(n) for n in leading]
            body = [rewriter.visit(n) for n in body]
        text = setup + ast.unparse(ast.Module([*leading, *body], []))  # only unparsed: no locations needed
    setup_count = 2 + len(leading)
    return Epilogue(text, check_call[:-1], setup_count, test_sources, scored_flags, setup_count + len(body))


def _segment(lines: list[str], node: ast.stmt) -> str | None:
    """The source text of a parsed top-level statement (None for one built here)."""
    end_line, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
    if end_line is None or end_col is None or not hasattr(node, "lineno"):
        return None
    raw = [line.encode() for line in lines[node.lineno - 1 : end_line]]
    if len(raw) == 1:
        return raw[0][node.col_offset : end_col].decode()
    return b"\n".join([raw[0][node.col_offset :], *raw[1:-1], raw[-1][:end_col]]).decode()


@functools.cache
def _setup_block() -> str:
    """The helpers as one statement (an ``if True:`` block still binds module globals)."""
    return "if True:\n" + "".join(f"    {line}" if line.strip() else line
                                   for line in _setup_source().splitlines(keepends=True))


def _exempt_call(node: ast.Call, exempt: frozenset[str], modules: frozenset[str]) -> bool:
    """``_TestRewriter.visit_Call``'s rule: builtins, functions the tests define and the tests' imports."""
    root = node.func
    while isinstance(root, ast.Attribute):
        root = root.value
    return isinstance(root, ast.Name) and root.id in exempt and (root is node.func or root.id in modules)


def _spliced(tests: str, checked: list[ast.Call | ast.Compare], exempt: frozenset[str], modules: frozenset[str]
             ) -> str | None:
    """``tests`` with ``<prefix>p(...)`` around exactly the values ``_TestRewriter`` wraps, spliced into the
    original text by node offsets (``checked``: every Call and Compare node of the tests). Not for tests
    with f-strings (positions inside them are unreliable before Python 3.12) or ``\\r`` line ends.

    The same wraps as the rewriter: every call that is not exempt, and every comparison operand (unless
    between identity comparisons) that is neither a literal nor such a call. Tested against it.
    """
    wraps: list[ast.expr] = []
    for node in checked:
        if isinstance(node, ast.Call):
            if not _exempt_call(node, exempt, modules):
                wraps.append(node)
        elif isinstance(node, ast.Compare):
            identity = [isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops]
            for k, operand in enumerate([node.left, *node.comparators]):
                if all(identity[max(0, k - 1) : k + 1]) or isinstance(operand, ast.Constant):
                    continue
                if isinstance(operand, ast.Call) and not _exempt_call(operand, exempt, modules):
                    continue  # wrapped as a call already
                wraps.append(operand)
    if not wraps:
        return tests
    data = tests.encode()
    starts = [0]  # byte offset of each line, split at \n only, as the tokenizer counts lines
    newline = data.find(b"\n")
    while newline >= 0:
        starts.append(newline + 1)
        newline = data.find(b"\n", newline + 1)
    inserts: list[tuple[int, int]] = []  # (byte offset, 0 = close / 1 = open): closes first at one offset
    for value in wraps:
        if value.end_lineno is None or value.end_col_offset is None:
            return None
        inserts.append((starts[value.lineno - 1] + value.col_offset, 1))
        inserts.append((starts[value.end_lineno - 1] + value.end_col_offset, 0))
    inserts.sort()
    opening, closing = f"{_PREFIX}p(".encode(), b")"
    out, last = [], 0
    for offset, kind in inserts:
        out += [data[last:offset], opening if kind else closing]
        last = offset
    out.append(data[last:])
    return b"".join(out).decode()


# ---------------------------------------------------------------- python_tests


@dataclass(frozen=True)
class PreparedRun:
    spec: Any  # sandboxes.SandboxSpec (imported lazily)
    epilogue: Epilogue
    token: str


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
    max_code_chars: int = Field(default=100_000, gt=0)


def _limits(cfg: LimitsConfig) -> Limits:
    return cfg.to_limits()


def _isolation_refusal(limits: LimitsConfig) -> Verdict | None:
    import sandboxes

    tier = sandboxes.probe_tier()
    if limits.require_isolation and tier == "rlimits-only":
        return invalid("refusing to run model code: the sandbox tier here is 'rlimits-only' (no namespaces); "
                       "run the verify worker as root or set limits.require_isolation=false", tier=tier)
    return None


def _sandbox_failure(result: SandboxResult) -> Verdict | None:
    """An invalid verdict when the sandbox itself failed (not the code under test)."""
    if result.status == "sandbox_error":
        return invalid(f"sandbox error: {result.error or 'unknown'}"[:500], tier=result.tier)
    return None


_CODE_FAULTS = {
    "timeout": "solution exceeded the time limit",
    "memory_limit": "solution exceeded the memory limit",
    "output_limit": "solution exceeded the output limit",
    "killed": "solution was killed",
}


def _run_facts(result: SandboxResult) -> dict[str, Any]:
    return {
        "sandbox_status": result.status,
        "exit_code": result.exit_code,
        "signal": result.signal,
        "cpu_seconds": round(result.cpu_seconds or 0.0, 4),
        "wall_seconds": round(result.wall_seconds or 0.0, 4),
        "peak_memory_bytes": result.peak_memory_bytes,
        "tier": result.tier,
        "stdout_tail": result.stdout[-400:].decode("utf-8", "replace"),
        "stderr_tail": result.stderr[-800:].decode("utf-8", "replace"),
    }


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
            limits=_limits(c.limits),
        )
        return PreparedRun(spec, epilogue, token)

    def _judge(self, inp: JudgeInput) -> Verdict:
        from sandboxes import run

        refused = _isolation_refusal(self.config.limits)
        if refused is not None:
            return refused
        built = self.build_spec(inp)
        if isinstance(built, Verdict):
            return built
        return self.score_result(run(built.spec), built.epilogue, built.token)

    def score_result(self, result: SandboxResult, epilogue: Epilogue, token: str | None) -> Verdict:
        c = self.config
        thr = c.pass_threshold
        failed = _sandbox_failure(result)
        if failed is not None:
            return failed
        facts = _run_facts(result)
        if result.status in _CODE_FAULTS:
            return scored(0.0, thr, _CODE_FAULTS[result.status], **facts)
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


# ---------------------------------------------------------------- command


class CommandConfig(VerifierConfig):
    completion_format: Literal["shell", "python", "files_json"] = Field(
        default="shell", description="How the completion produces files: a bash script, Python code, or {path: content}."
    )
    interpreter: Literal["bash", "python"] = Field(default="bash", description="Default interpreter of the test script.")
    bash_path: str = Field(default="/bin/bash", description="Absolute path of bash inside the sandbox.")
    python_path: str | None = Field(
        default=None, description="Absolute path of Python inside the sandbox; default: python3 of the system root."
    )
    compare: Literal["exact", "strip"] = Field(default="strip", description="How expected files are compared.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
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
        refused = _isolation_refusal(c.limits)
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
                [c.python_path or _system_python(), "-c", ref.script]
            wrapper = f'"$@"; rc=$?; if [ $rc -eq 0 ]; then printf %s {token} > {TOKEN_FILE} || exit 97; fi; exit $rc'
            command = [c.bash_path, "-c", wrapper, "temper-check", *argv]
        spec = SandboxSpec(code=code, files=files, artifacts=(*ref.expected_files, TOKEN_FILE), command=command,
                           limits=c.limits.to_limits())
        result = run(spec)
        failed = _sandbox_failure(result)
        if failed is not None:
            return failed
        facts = _run_facts(result)
        if result.status in ("timeout", "memory_limit", "output_limit", "killed"):
            return scored(0.0, thr, _CODE_FAULTS[result.status], **facts)
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
