"""Sandbox runtimes: named, pinned interpreter definitions built once into read-only, content-addressed images.

    from sandboxes.runtimes import get, ensure_image
    image = ensure_image(get("numpy"), progress=print)   # builds once per machine, then a cache hit
    image.python, image.size_bytes, image.lock           # the interpreter the zygote runs; `pip freeze`

A **runtime** (`Runtime`) is a name, the Python version (``python``: the worker's own major.minor, see below),
exact package pins from the package registries (``packages = ["numpy==2.4.6"]``) and the modules its warm
interpreters import before they fork (``preload``). Definitions are TOML files, one per runtime, in
``runtimes/`` at the project root and in the directories named by ``TEMPER_RUNTIMES_DIRS`` (os.pathsep
separated): reviewed and versioned like code, readable by every process (the web page, the verify worker)
without a database. ``python`` (the default, `DEFAULT`) has no image: the host interpreter with its
standard library only — no site-packages, neither the worker's virtualenv nor the interpreter's own.

An **image** is a virtualenv built from the definition under ``TEMPER_RUNTIMES_ROOT`` (default
``var/runtimes`` of the project; ``~/.cache/temper/runtimes`` for a checkout under /tmp), in a directory named by the sha256 of what determines its content (the
interpreter's exact version and the sorted pins; not the name or the preload list, so two definitions
with the same pins share one image). The resolved ``pip freeze`` is recorded in the image as its lock,
with its own sha256. A build runs in a temporary directory beside the image and is renamed into place
when complete, under an exclusive file lock (two workers on one machine never build the same image
twice: the second waits, then finds it built). A failed build leaves a ``<key>.failed.json`` naming the
package and pip's reason; it is not retried for `FAILED_RETRY_SECONDS` (each execution would otherwise
pay a build), or until ``python -m sandboxes.runtimes build NAME`` asks again. Unused images are removed
by `collect_garbage` (``python -m sandboxes.runtimes gc``): every image no current definition names that
was last used more than a day ago.

Why a virtualenv of the worker's own interpreter: the harness's trusted code (the epilogue) is compiled
by the worker and handed to the sandbox as marshalled code objects, which only the same Python version
can load; and a virtualenv of the same interpreter costs ~0.1 s to make and nothing to run. In the
sandbox the image is read-only twice over: the whole root is mounted read-only, and its files belong to
root, which the sandbox uid is not.

What this does NOT do: install system packages (a definition may only use what the host has), pin
transitive dependencies the definition does not list (they are resolved at build time and recorded in the
lock; list them to pin them), or share images between machines (each machine builds its own, once).
Module and file: pure standard library, no Django — the verify worker and the web page both read it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFINITIONS_DIR = PROJECT_ROOT / "runtimes"
DEFAULT_NAME = "python"
FAILED_RETRY_SECONDS = 300.0
"""How long a failed build is reported as failed before the next use tries it again."""
GC_MIN_AGE_SECONDS = 86400.0
IMAGE_FILE = "temper-image.json"
_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9,._-]+\])?==([A-Za-z0-9.+!_-]+)$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

Status = Literal["default", "built", "building", "failed", "not_built"]


class RuntimeDefinitionError(ValueError):
    """A definition is wrong, or names something this host does not have."""


class BuildError(RuntimeError):
    """An image could not be built; ``package`` names the requirement pip gave up on (when it said)."""

    def __init__(self, runtime: str, reason: str, package: str | None = None) -> None:
        self.runtime, self.reason, self.package = runtime, reason, package
        where = f" (package {package})" if package else ""
        super().__init__(f"runtime {runtime!r} could not be built{where}: {reason}")


@dataclass(frozen=True)
class Runtime:
    """A named, pinned interpreter definition (one TOML file in ``runtimes/``)."""

    name: str
    python: str = f"{sys.version_info.major}.{sys.version_info.minor}"
    """major.minor of the interpreter; must be the worker's own (the harness hands over code objects)."""
    packages: tuple[str, ...] = ()
    """Exact pins from the package registries, ``name==version`` (extras allowed: ``name[extra]==version``)."""
    preload: tuple[str, ...] = ()
    """Modules the runtime's warm interpreters import before they fork (an execution pays no import)."""
    description: str = ""
    source: str = ""
    """The file the definition was read from (empty for the built-in default)."""

    def __post_init__(self) -> None:
        problems = []
        if not _NAME.match(self.name):
            problems.append(f"name: {self.name!r} must be lower-case letters, digits, '-' or '_' (at most 40)")
        if not re.match(r"^3\.\d+$", self.python):
            problems.append(f"python: {self.python!r} must be a major.minor version such as '3.11'")
        for pin in self.packages:
            if not _PIN.match(pin):
                problems.append(f"packages: {pin!r} must be an exact pin, name==version")
        names = [_canonical(_PIN.match(p).group(1)) for p in self.packages if _PIN.match(p)]  # type: ignore[union-attr]
        if len(set(names)) != len(names):
            problems.append("packages: a package is pinned twice")
        for module in self.preload:
            if not _MODULE.match(module):
                problems.append(f"preload: {module!r} is not a module name")
        if self.name == DEFAULT_NAME and self.packages:
            problems.append(f"name: {DEFAULT_NAME!r} is the built-in default runtime (the standard library only)")
        if problems:
            raise RuntimeDefinitionError(f"runtime {self.name!r}{f' ({self.source})' if self.source else ''}: "
                                + "; ".join(problems))

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT_NAME

    def key(self) -> str:
        """The image's content address: the interpreter's exact version and the sorted pins."""
        basis = {"python": _interpreter_version(), "implementation": sys.implementation.cache_tag,
                 "packages": sorted(_canonical_pin(p) for p in self.packages)}
        return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:24]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "python": self.python, "packages": list(self.packages),
                "preload": list(self.preload), "description": self.description}


DEFAULT = Runtime(name=DEFAULT_NAME, description="The host's Python with its standard library only.")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _canonical_pin(pin: str) -> str:
    match = _PIN.match(pin)
    assert match is not None
    return f"{_canonical(match.group(1))}{match.group(2) or ''}=={match.group(3)}"


def _interpreter_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


# ---------------------------------------------------------------- definitions


def definition_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("TEMPER_RUNTIMES_DIRS", "").split(os.pathsep) if p]
    return [DEFINITIONS_DIR, *extra]


def load_definition(path: Path) -> Runtime:
    """One runtime from a TOML file (``name`` defaults to the file's stem)."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RuntimeDefinitionError(f"{path}: cannot read the runtime definition: {exc}") from None
    unknown = set(data) - {"name", "python", "packages", "preload", "description"}
    if unknown:
        raise RuntimeDefinitionError(f"{path}: unknown field(s) {sorted(unknown)}; known: name, python, packages, "
                            "preload, description")
    return Runtime(name=str(data.get("name", path.stem)), python=str(data.get("python", DEFAULT.python)),
                   packages=tuple(data.get("packages", ())), preload=tuple(data.get("preload", ())),
                   description=str(data.get("description", "")), source=str(path))


_registered: dict[str, Runtime] = {}


def register(runtime: Runtime) -> Runtime:
    """Add a definition in this process only (tests and benchmarks; deployments use files)."""
    _registered[runtime.name] = runtime
    return runtime


@functools.cache
def _file_definitions(dirs: tuple[Path, ...]) -> dict[str, Runtime]:
    found: dict[str, Runtime] = {}
    for directory in dirs:
        for path in sorted(directory.glob("*.toml")) if directory.is_dir() else []:
            runtime = load_definition(path)
            if runtime.name in found:
                raise RuntimeDefinitionError(f"runtime {runtime.name!r} is defined twice: {found[runtime.name].source} "
                                    f"and {path}")
            found[runtime.name] = runtime
    return found


def registry() -> dict[str, Runtime]:
    """Every runtime by name: the default, the definition files, then those registered in-process."""
    return {DEFAULT_NAME: DEFAULT, **_file_definitions(tuple(definition_dirs())), **_registered}


def get(name: str) -> Runtime:
    runtimes = registry()
    if name not in runtimes:
        raise RuntimeDefinitionError(f"unknown sandbox runtime {name!r}; defined: {', '.join(sorted(runtimes))} "
                            f"(add runtimes/{name}.toml)")
    return runtimes[name]


def check_name(name: str) -> str:
    """``name`` when it names a defined runtime (for config validators); raises ValueError otherwise."""
    get(name)
    return name


# ---------------------------------------------------------------- images


def _under_tmp(path: Path) -> bool:
    return path == Path("/tmp") or Path("/tmp") in path.parents


def images_root() -> Path:
    """Where images are built: ``TEMPER_RUNTIMES_ROOT``, else the project's ``var/runtimes`` — or, for a
    checkout under /tmp (a fresh clone, a CI checkout), the user's cache directory
    (``$XDG_CACHE_HOME/temper/runtimes``): a sandbox's /tmp is its own tmpfs, so an image under /tmp would be
    invisible to the code it should run."""
    configured = os.environ.get("TEMPER_RUNTIMES_ROOT")
    root = Path(configured or PROJECT_ROOT / "var" / "runtimes").resolve()
    if not configured and _under_tmp(root):
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        root = (cache / "temper" / "runtimes").resolve()
    if _under_tmp(root):
        raise RuntimeDefinitionError(f"TEMPER_RUNTIMES_ROOT={root} is under /tmp, which every sandbox covers with its "
                                     "own work directory; put images elsewhere (default: var/runtimes)")
    return root


@dataclass(frozen=True)
class Image:
    """A built image: a virtualenv and what its build recorded."""

    runtime: str
    key: str
    path: Path
    lock: tuple[str, ...]
    lock_sha256: str
    size_bytes: int
    build_seconds: float
    built_at: float

    @property
    def python(self) -> str:
        return str(self.path / "bin" / "python")

    @classmethod
    def read(cls, runtime: str, path: Path) -> Image | None:
        try:
            meta = json.loads((path / IMAGE_FILE).read_text())
        except (OSError, ValueError):
            return None
        return cls(runtime, meta["key"], path, tuple(meta["lock"]), meta["lock_sha256"], int(meta["size_bytes"]),
                   float(meta["build_seconds"]), float(meta["built_at"]))


@dataclass
class ImageReport:
    """What a page shows about a runtime on this machine."""

    runtime: Runtime
    status: Status
    key: str | None = None
    size_bytes: int | None = None
    lock: list[str] = field(default_factory=list)
    build_seconds: float | None = None
    error: str | None = None
    package: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["runtime"] = self.runtime.to_dict()
        return out


def image_path(runtime: Runtime) -> Path:
    return images_root() / runtime.key()


def find_image(runtime: Runtime) -> Image | None:
    """The built image of ``runtime`` on this machine, or None (always None for the default)."""
    if runtime.is_default:
        return None
    return Image.read(runtime.name, image_path(runtime))


def report(runtime: Runtime) -> ImageReport:
    """Build status, size and lock of ``runtime``'s image here (nothing is built)."""
    if runtime.is_default:
        return ImageReport(runtime, "default")
    key = runtime.key()
    image = find_image(runtime)
    if image is not None:
        return ImageReport(runtime, "built", key, image.size_bytes, list(image.lock), image.build_seconds)
    root = images_root()
    failed = _read_failure(root, key)
    if failed is not None:
        return ImageReport(runtime, "failed", key, error=failed.get("reason"), package=failed.get("package"))
    if _build_in_progress(root, key):
        return ImageReport(runtime, "building", key)
    return ImageReport(runtime, "not_built", key)


def _read_failure(root: Path, key: str) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((root / f"{key}.failed.json").read_text())
        return data
    except (OSError, ValueError):
        return None


def _build_in_progress(root: Path, key: str) -> bool:
    try:
        fd = os.open(root / f"{key}.lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def ensure_image(runtime: Runtime, progress: Callable[[str], None] | None = None, *, force: bool = False
                 ) -> tuple[Image, bool]:
    """``(image, built_now)``: the built image, building it first when this machine has none.

    Raises `BuildError` (which package, and why) when it cannot be built; a recent failure is reported
    again without building unless ``force``.
    """
    if runtime.is_default:
        raise RuntimeDefinitionError("the default runtime has no image")
    if runtime.python != DEFAULT.python:
        raise BuildError(runtime.name, f"python {runtime.python} is not this worker's Python ({DEFAULT.python}); "
                         "the harness hands the sandbox code objects only the same version can load")
    image = find_image(runtime)
    if image is not None:
        _touch(image.path)
        return image, False
    root = images_root()
    root.mkdir(parents=True, exist_ok=True)
    key = runtime.key()
    with _locked(root / f"{key}.lock"):
        image = find_image(runtime)  # built by another worker while we waited for the lock
        if image is not None:
            _touch(image.path)
            return image, False
        failed = _read_failure(root, key)
        if failed is not None and not force and time.time() - float(failed.get("at", 0)) < FAILED_RETRY_SECONDS:
            raise BuildError(runtime.name, str(failed.get("reason")), failed.get("package"))
        try:
            image = _build(runtime, root, key, progress or (lambda line: None))
        except BuildError as exc:
            (root / f"{key}.failed.json").write_text(json.dumps(
                {"runtime": runtime.name, "reason": exc.reason, "package": exc.package, "at": time.time()}))
            raise
        (root / f"{key}.failed.json").unlink(missing_ok=True)
        return image, True


@contextlib.contextmanager
def _locked(path: Path) -> Any:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path / IMAGE_FILE)  # "last used", for the garbage collector


def _base_interpreter() -> str:
    """The worker's own interpreter outside any virtualenv (an image is a virtualenv of it)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _build(runtime: Runtime, root: Path, key: str, progress: Callable[[str], None]) -> Image:
    started = time.monotonic()
    work = root / f".build-{key}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    progress(f"runtime {runtime.name}: building image {key} ({', '.join(runtime.packages) or 'no packages'})")
    try:
        _run_step(runtime, [_base_interpreter(), "-m", "venv", "--without-pip", str(work)], progress,
                  "making the virtualenv")
        if runtime.packages:
            # The worker's pip installs into the image (--python): the image itself needs no pip.
            _run_step(runtime, [sys.executable, "-m", "pip", "--python", str(work / "bin" / "python"), "install",
                                "--no-input", "--disable-pip-version-check", "--progress-bar", "off",
                                *runtime.packages], progress, "pip install")
        freeze = _run_step(runtime, [str(work / "bin" / "python"), "-I", "-c", _FREEZE], progress, "reading the lock")
        lock = tuple(sorted(line for line in freeze.splitlines() if line.strip()))
        for module in runtime.preload:
            _run_step(runtime, [str(work / "bin" / "python"), "-I", "-c", f"import {module}"], progress,
                      f"importing preload module {module}")
        _readonly_for_others(work)
        size = _tree_size(work)
        meta = {"key": key, "runtime": runtime.to_dict(), "python": _interpreter_version(), "lock": list(lock),
                "lock_sha256": hashlib.sha256("\n".join(lock).encode()).hexdigest(), "size_bytes": size,
                "build_seconds": round(time.monotonic() - started, 3), "built_at": time.time()}
        (work / IMAGE_FILE).write_text(json.dumps(meta, indent=1))
        os.chmod(work / IMAGE_FILE, 0o644)
        os.rename(work, root / key)  # atomic: an image is either absent or complete
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    progress(f"runtime {runtime.name}: image {key} built in {meta['build_seconds']:.1f} s, "
             f"{size / 1e6:.1f} MB, lock {len(lock)} package(s)")
    image = Image.read(runtime.name, root / key)
    assert image is not None
    return image


_FREEZE = ("import importlib.metadata as m\n"
           "for d in m.distributions():\n"
           "    print(f\"{d.metadata['Name']}=={d.version}\")\n")


def _run_step(runtime: Runtime, argv: list[str], progress: Callable[[str], None], what: str) -> str:
    """Run one build step, streaming its output lines to ``progress``; BuildError with pip's reason."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               stdin=subprocess.DEVNULL)
    lines = []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if what != "reading the lock":
            progress(f"  {line.rstrip()}")
    if process.wait() != 0:
        errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")] or lines[-5:]
        reason = "; ".join(_shorten(e) for e in errors if not e.startswith("Ignored the following versions"))
        raise BuildError(runtime.name, f"{what} failed: {reason or f'exit status {process.returncode}'}",
                         _failed_package(runtime, lines, what))
    return "\n".join(lines)


def _shorten(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _failed_package(runtime: Runtime, lines: list[str], what: str) -> str | None:
    if what.startswith("importing preload module"):
        return what.rsplit(" ", 1)[1]
    text = "\n".join(lines).lower()
    for pin in runtime.packages:
        name = _canonical(_PIN.match(pin).group(1))  # type: ignore[union-attr]
        if any(f"for {form}" in text or f"requirement {form}" in text or f"building wheel for {form}" in text
               for form in {pin.lower(), name, name.replace("-", "_")}):
            return pin
    return None


def _readonly_for_others(path: Path) -> None:
    """World-readable (the sandbox uid runs it), writable by its owner only."""
    for directory, _dirs, files in os.walk(path):
        os.chmod(directory, 0o755)
        for name in files:
            full = os.path.join(directory, name)
            if not os.path.islink(full):
                os.chmod(full, os.stat(full).st_mode & 0o755 | 0o444)


def _tree_size(path: Path) -> int:
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


def quarantine(image: Image, why: str) -> None:
    """Move a broken image aside (the next use rebuilds it); kept as ``.broken-<key>-<time>`` for people."""
    with contextlib.suppress(OSError):
        os.rename(image.path, image.path.parent / f".broken-{image.key}-{int(time.time())}")
        (image.path.parent / f".broken-{image.key}.why").write_text(why)


def collect_garbage(keep: Iterable[str] = (), min_age_seconds: float = GC_MIN_AGE_SECONDS,
                    now: float | None = None) -> list[Path]:
    """Remove images no definition names (besides ``keep``, keys) unused for ``min_age_seconds``, and leftovers
    of interrupted builds and quarantined images; the paths removed."""
    root = images_root()
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    wanted = set(keep)
    for runtime in registry().values():
        if not runtime.is_default:
            wanted.add(runtime.key())
    removed = []
    for entry in root.iterdir():
        name = entry.name
        stale = False
        if entry.is_dir() and name.startswith(".build-"):
            pid = name.rsplit("-", 1)[-1]
            stale = not (pid.isdigit() and Path(f"/proc/{pid}").exists())
        elif entry.is_dir() and name.startswith(".broken-"):
            stale = True
        elif entry.is_dir() and name not in wanted:
            try:
                last_used = (entry / IMAGE_FILE).stat().st_mtime
            except OSError:
                last_used = entry.stat().st_mtime
            stale = now - last_used >= min_age_seconds
        if stale:
            with _locked(root / f"{name}.lock") if not name.startswith(".") else contextlib.nullcontext():
                shutil.rmtree(entry, ignore_errors=True)
            for suffix in (".lock", ".failed.json"):
                (root / f"{name}{suffix}").unlink(missing_ok=True)
            removed.append(entry)
    return removed


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandboxes.runtimes",
                                     description="List, build and garbage-collect sandbox runtime images.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every runtime, its status, size and packages on this machine")
    build = sub.add_parser("build", help="build the images of these runtimes (all when none is named)")
    build.add_argument("names", nargs="*")
    build.add_argument("--force", action="store_true", help="try again even after a recent failure")
    gc = sub.add_parser("gc", help="remove images no definition names, unused for --min-age-hours")
    gc.add_argument("--min-age-hours", type=float, default=GC_MIN_AGE_SECONDS / 3600)
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            for runtime in registry().values():
                r = report(runtime)
                size = f"{r.size_bytes / 1e6:.1f} MB" if r.size_bytes else "-"
                print(f"{runtime.name:<16} {r.status:<10} {size:>9}  {' '.join(runtime.packages) or '(stdlib)'}"
                      + (f"\n{'':<16} {r.error}" if r.error else ""))
            return 0
        if args.command == "gc":
            for path in collect_garbage(min_age_seconds=args.min_age_hours * 3600):
                print(f"removed {path}")
            return 0
        failed = 0
        for name in args.names or [n for n, r in registry().items() if not r.is_default]:
            runtime = get(name)
            if runtime.is_default:
                print(f"{name}: the default runtime has no image")
                continue
            try:
                image, built = ensure_image(runtime, progress=lambda line: print(line, flush=True), force=args.force)
            except BuildError as exc:
                print(f"error: {exc}", file=sys.stderr)
                failed += 1
                continue
            print(f"{name}: {'built' if built else 'already built'} — {image.path} ({image.size_bytes / 1e6:.1f} MB)")
        return 1 if failed else 0
    except RuntimeDefinitionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
