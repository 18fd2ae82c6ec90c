"""The device process (``workers.policy.device_process``): a real child process that owns the engines and
trainers. It must sample, judge and train exactly as the same work done in this process; queue a step right
behind the rollout that kept its batch; say what went wrong in it, where; and never outlive its worker."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.policy.conftest import DEMO_DIR, REPO
from workers.policy import device_process, resident
from workers.policy.demo_model import _split_pool
from workers.policy.engines import SamplingParams
from workers.policy.steps import TrainerConfig

pytestmark = pytest.mark.slow

PROMPTS = [q for q, _ in _split_pool("addition", "train")[:4]]
ANSWERS = [a for _, a in _split_pool("addition", "train")[:4]]
CONFIG = TrainerConfig(lr=1e-4, lora_rank=0, num_minibatches=2, micro_batch_size=64, seed=0)
SAMPLING = SamplingParams(n=4, temperature=1.0, max_tokens=6)


def judges() -> list[resident.Judge | None]:
    return [resident.Judge(kind="exact_match", config={}, reference={"answer": a}, domain_kind="answer")
            for a in ANSWERS]


@pytest.fixture
def client() -> Iterator[device_process.DeviceClient]:
    client = device_process.DeviceClient()
    client.start()
    resident.use_remote(client)
    try:
        yield client
    finally:
        resident.use_remote(None)
        client.close()


@pytest.fixture
def local() -> Iterator[None]:
    resident.use_remote(None)
    resident._ENGINES.clear()
    resident._TRAINERS.clear()
    yield
    resident._ENGINES.clear()
    resident._TRAINERS.clear()


def weights(version_dir: Path) -> str:
    return hashlib.sha256((version_dir / "model.safetensors").read_bytes()).hexdigest()


def one_step(tmp: Path, *, queued: bool) -> tuple[resident.Rollout, object, str]:
    """A rollout of the four prompts, judged as they are generated, then one train step on it from the base
    model: queued right behind the rollout on what it kept, or sent with the batch assembled here."""
    engine = resident.engine_for("torch", DEMO_DIR, seed=0)
    base = (1, 0, None)
    if queued:
        rollout_f = resident.rollout_async(engine, PROMPTS, SAMPLING, serve=base, judges=judges(), keep="t1")
        train_f = resident.train_async(1, DEMO_DIR, CONFIG, base, 0, ("t1", [0, 1, 2, 3]), tmp / "v1", None)
        out = resident.wait(rollout_f)
        result = resident.result(train_f)[0]
    else:
        out = resident.rollout(engine, PROMPTS, SAMPLING, serve=base, judges=judges())
        assert out.judged is not None
        batch = [(out.samples[i * 4:(i + 1) * 4], [v.score for v in out.judged[i][0]]) for i in range(4)]
        result = resident.train(1, DEMO_DIR, CONFIG, base, 0, batch, tmp / "v1", None)
    return out, result, weights(tmp / "v1")


def test_the_device_process_samples_judges_and_trains_as_this_process_does(client, tmp_path: Path):
    remote_out, remote_step, remote_weights = one_step(tmp_path / "remote", queued=True)
    resident.use_remote(None)
    resident._ENGINES.clear()
    resident._TRAINERS.clear()
    try:
        local_out, local_step, local_weights = one_step(tmp_path / "local", queued=False)
    finally:
        resident._ENGINES.clear()
        resident._TRAINERS.clear()
    assert [s.completion_token_ids for s in remote_out.samples] == [s.completion_token_ids for s in local_out.samples]
    assert [s.logprobs for s in remote_out.samples] == [s.logprobs for s in local_out.samples]
    assert remote_out.judged is not None and local_out.judged is not None
    assert [[v.status for v in j[0]] for j in remote_out.judged if j] == [[v.status for v in j[0]]
                                                                          for j in local_out.judged if j]
    assert remote_step.version == local_step.version == 1
    assert remote_step.advantages == local_step.advantages
    assert remote_step.metrics.loss == local_step.metrics.loss
    assert remote_weights == local_weights  # the very same step, bit for bit


def test_a_queued_step_trains_nothing_when_its_rollout_has_an_invalid_verdict(client, tmp_path: Path):
    engine = resident.engine_for("torch", DEMO_DIR, seed=0)
    broken = judges()
    broken[2] = resident.Judge(kind="exact_match", config={}, reference={"no": "answer field"}, domain_kind="answer")
    rollout_f = resident.rollout_async(engine, PROMPTS, SAMPLING, serve=(1, 0, None), judges=broken, keep="t2")
    train_f = resident.train_async(1, DEMO_DIR, CONFIG, (1, 0, None), 0, ("t2", [0, 1, 2, 3]), tmp_path / "v1", None)
    out = resident.wait(rollout_f)
    assert out.judged is not None and not all(v.is_valid for v in out.judged[2][0])
    assert resident.result(train_f)[0] is None
    assert not (tmp_path / "v1").exists()
    assert resident.snapshot()["trainers"] == []  # no trainer was even built


def test_a_prompt_longer_than_the_context_is_left_out_with_its_length(client):
    engine = resident.engine_for("torch", DEMO_DIR, seed=0)
    out = resident.rollout(engine, [PROMPTS[0], "1+1=" * 40, PROMPTS[1]], SAMPLING, serve=(1, 0, None))
    assert out.kept == [0, 2] and set(out.too_long) == {1} and out.too_long[1] + SAMPLING.max_tokens > out.context
    assert len(out.samples) == 2 * SAMPLING.n


def test_an_error_in_the_device_process_is_raised_here_with_its_type_and_where(client, tmp_path: Path):
    with pytest.raises(Exception) as caught:
        resident.train(1, tmp_path / "no-such-model", CONFIG, (1, 0, None), 0, [], tmp_path / "v1", None)
    assert any("in the device process" in note for note in getattr(caught.value, "__notes__", []))
    assert client.call("ping") == client.pid  # the process lives on


def test_a_device_process_killed_mid_request_fails_it_and_the_next_request_starts_another(client):
    engine = resident.engine_for("torch", DEMO_DIR, seed=0)
    first = client.pid
    assert first is not None
    future = resident.rollout_async(engine, PROMPTS * 16, SAMPLING, serve=(1, 0, None), judges=None, keep="t3")
    os.kill(first, signal.SIGKILL)
    with pytest.raises(device_process.DeviceProcessLost):
        resident.wait(future)
    again = resident.rollout(engine, PROMPTS, SAMPLING, serve=(1, 0, None))  # the engine loads again
    assert len(again.samples) == 4 * SAMPLING.n and client.pid not in (None, first) and client.starts == 2


def test_a_request_that_does_not_pickle_fails_alone(client):
    """Arguments that cannot be sent fail their own request, here, and leave nothing pending; the child
    goes on serving."""
    future = client.submit("ping", lambda: None)
    with pytest.raises(Exception, match="pickle"):
        future.result(timeout=5)
    assert future not in client._link.pending.values()
    assert client.call("ping") == client.pid


def test_a_request_sent_as_the_child_exits_is_failed_once():
    """The reader thread fails every pending request when the child exits; a send failing at the same moment
    must not fail its request a second time (``InvalidStateError``)."""
    client = device_process.DeviceClient()
    link = client._ensure()

    class Dying:
        def send(self, message: object) -> None:  # the child exits mid-send: the reader takes the pending ones
            with link.lock:
                lost, link.pending = link.pending, {}
            for f in lost.values():
                f.set_exception(device_process.DeviceProcessLost("the device process exited (-9) during the request"))
            raise BrokenPipeError("broken pipe")

    real, link.conn = link.conn, Dying()
    try:
        future = client._send(link, "ping", ())
        with pytest.raises(device_process.DeviceProcessLost, match="exited"):
            future.result(timeout=5)
        assert not link.pending
    finally:
        link.conn = real
        client.close()


def test_two_threads_serving_different_versions_do_not_mix(client):
    engine = client.engine_for("torch", DEMO_DIR)
    seen: dict[str, object] = {}

    def serve(name: str, version: int) -> None:
        resident.serve(engine, 1, version, None)
        time.sleep(0.05)  # the other thread sets its own meanwhile
        seen[name] = engine.serving

    threads = [threading.Thread(target=serve, args=(n, v)) for n, v in (("a", 3), ("b", 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": (1, 3, None), "b": (1, 5, None)}


def test_the_device_process_exits_with_its_worker(tmp_path: Path):
    """The worker SIGKILLed (no chance to stop it): the child sees its socket close, or its parent change."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from workers.policy.device_process import DeviceClient
        client = DeviceClient()
        client.start()
        print(client.pid, flush=True)
        client.call("ping")
        time.sleep(600)
    """)
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert worker.stdout is not None
        child = int(worker.stdout.readline())
        assert Path(f"/proc/{child}").exists()
        time.sleep(1.0)
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 20
    while _alive(child):
        assert time.monotonic() < deadline, "the device process outlived its worker"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_device_is_pinned_to_cpus_of_its_own_when_asked():
    code = ("import os; from workers.policy import resident; "
            "print(sorted(resident.pin_device_cpus() or []), sorted(os.sched_getaffinity(0)))")
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True,
                         env={**os.environ, "TEMPER_DEVICE_CPUS": str(cpu), "TEMPER_DEVICE": "cpu"}).stdout
    assert out.split("] ")[0] + "]" == f"[{cpu}]" and out.strip().endswith(f"[{cpu}]")
    none = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True,
                          env={**os.environ, "TEMPER_DEVICE_CPUS": "none"}).stdout
    assert none.startswith("[] ")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_device_process_started_again_keeps_the_device_cpus():
    """The worker moves its threads off the device's CPUs once the child has them; a child started again
    later (the first one died) is started from such a thread and must still be pinned to them."""
    before = os.sched_getaffinity(0)
    env = {k: v for k, v in os.environ.items() if k != "TEMPER_DEVICE_CPUS"}
    client = device_process.DeviceClient(env={**env, "TEMPER_DEVICE": "cpu", "TEMPER_TORCH_THREADS": "1"})
    try:
        device = {max(before)}
        client.start()
        assert client.call("ping") == client.pid  # it answers once pinned and warmed up
        assert os.sched_getaffinity(client.pid) == device
        os.sched_setaffinity(0, before - device)  # as keep_off_device_cpus leaves this thread
        first = client.pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:  # requests fail until the worker has seen the child exit; the next one starts another
            try:
                pid = client.call("ping")
                break
            except device_process.DeviceProcessLost:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert pid == client.pid != first
        assert os.sched_getaffinity(client.pid) == device
    finally:
        os.sched_setaffinity(0, before)
        client.close()
