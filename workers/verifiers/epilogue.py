"""The trusted epilogue of ``python_tests``: the reference's tests, rewritten so that each top-level statement
reports its own outcome, with the defences against always-equal objects and patched builtins (see
``workers.verifiers.python_tests``), compiled by the harness before the solution starts.
"""

from __future__ import annotations

import ast
import builtins
import functools
from dataclasses import dataclass

from workers.verifiers.base import InvalidReference
from workers.verifiers.sandbox_call import PREFIX as _PREFIX

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
    """The trusted epilogue for one task's tests; ``chunks(token)`` is what the sandbox runs for one judgment."""

    body: str  # the pre-check, the leading definitions and the test statements (after the helpers)
    postcheck: str  # the integrity post-check call, without its closing ``token)``
    setup_count: int  # statements [0, setup_count): the trusted setup, pre-check and leading definitions
    test_sources: list[str]  # one per test statement, original text
    scored: list[bool]  # whether each test statement counts towards the score
    postcheck_index: int  # the index of the integrity post-check statement

    def chunks(self, token: str | None = None) -> tuple[str, str, str]:
        """The sandbox's epilogue chunks, each compiled once per process by the sandbox: the helpers (the
        same for all tests), the body (the same for every judgment of these tests) and the one-line
        post-check carrying this judgment's token. The post-check writes ``token`` to ``TOKEN_FILE``
        (collected as an artifact, compared outside): proof that the real epilogue ran to its end, which a
        forged report cannot give without also finding the token."""
        return _setup_block(), self.body, f"{self.postcheck}, {token!r})\n"


def build_epilogue(tests: str, *, entry_point: str | None, strict_values: bool, flatten_check: bool = False) -> Epilogue:
    """The trusted epilogue for ``tests``; raises InvalidReference when the tests do not parse.

    Cached per process: one task's tests are judged many times (G samples per prompt). The cached
    epilogue keeps its random helper prefix, which the solution never sees before it runs.
    """
    return _build_epilogue(tests, entry_point, strict_values, flatten_check)


# One random prefix per process for the helpers' global names: the solution never sees the epilogue
# before it runs, so it cannot know them; a fixed prefix would let a hack target them by name.
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

