"""The GPU worker's hand-off between a train step and a waiting rollout task (workers/tasks/resident.py)."""

from __future__ import annotations

import threading
import time

import pytest

from workers.tasks import resident

RUN = 987_654  # a run id no other test uses: the registry is per process


def test_a_rollout_task_goes_on_once_the_version_is_saved_not_when_the_step_ends() -> None:
    seen: list[int | None] = []
    waited = threading.Event()

    def rollout() -> None:
        seen.append(resident.after_training(RUN, timeout=10))
        waited.set()

    with resident.training(RUN):
        worker = threading.Thread(target=rollout)
        worker.start()
        time.sleep(0.05)
        assert not waited.is_set()  # still training: the rollout task waits
        resident.version_saved(RUN, 8)
        assert waited.wait(5)  # it went on before the step's bookkeeping below ended
        assert seen == [8]  # ... under the version just saved, which the database has not recorded yet
        assert resident.after_training(RUN, timeout=0) == 8
    worker.join(5)
    # the step is over (recorded): the database's latest version is current again
    assert resident.after_training(RUN, timeout=0) is None


def test_a_step_that_fails_after_saving_does_not_hand_out_its_version() -> None:
    with pytest.raises(RuntimeError), resident.training(RUN):
        resident.version_saved(RUN, 9)
        raise RuntimeError("recording the step failed")
    assert resident.after_training(RUN, timeout=0) is None


def test_without_a_step_under_way_nothing_waits() -> None:
    started = time.monotonic()
    assert resident.after_training(RUN + 1, timeout=10) is None
    assert time.monotonic() - started < 1.0
