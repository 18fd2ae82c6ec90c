"""Verification (the verify workers): judge every pending sample of a group, store the verdicts together,
and move the group to the ready buffer — or drop it when no verdict is usable.

A verdict is three-valued: a score in [0, 1], or invalid with the reason. Invalid verdicts are stored
without a score, counted on the group and left out of the loss; a group with any is queued for another
admission ahead of new prompts (``pipeline.invalid_retries``). A redelivered judgment writes nothing twice
(``record_verdict`` only fills a pending verdict).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from webapp.runs.loop import tick
from webapp.runs.models import PromptGroup, Run, RunStatus, Trajectory, VerdictChoice
from workers import messages
from workers.pipeline.spec import RunSpec

G = PromptGroup.Status
log = logging.getLogger(__name__)


def remote_judge(verifier_row: Any) -> bool:
    """An ``llm_judge`` verifier with an HTTP endpoint: it waits on the network, so judging is I/O-bound."""
    return bool(verifier_row is not None and verifier_row.kind == "llm_judge"
                and (verifier_row.config or {}).get("endpoint"))


def judge(verifier_row: Any, prompt: str, completion: str, reference: Any, kind: str | None = None) -> Any:
    """One verdict; ``kind`` is the task's domain kind (its reference is read as that kind's). A verifier
    that crashes gives ``invalid`` with the reason, never a score of 0."""
    from workers.verifiers.base import JudgeInput, get_verifier, invalid

    if verifier_row is None:
        return invalid("the domain has no verifier")
    started = time.monotonic()
    try:
        return get_verifier(verifier_row.kind, verifier_row.config).judge(
            JudgeInput(prompt=prompt, completion=completion, reference=reference, kind=kind))
    except Exception as exc:
        return invalid(f"verifier crashed: {type(exc).__name__}: {exc}").with_latency(
            (time.monotonic() - started) * 1000)


def judge_group(verifier_row: Any, samples: list[tuple[str, str]], reference: Any, kind: str | None = None) -> list[Any]:
    """The verdicts of one group's (prompt, completion) samples, which share the task's reference: judged
    together where the kind can (``python_reward``: one sandbox execution for the group), else one by one."""
    from workers.verifiers.base import JudgeInput, judge_all

    return judge_all(verifier_row.kind if verifier_row is not None else None,
                     verifier_row.config if verifier_row is not None else None,
                     [JudgeInput(prompt=p, completion=c, reference=reference, kind=kind) for p, c in samples])


def score_episode(domain: Any, verifier_row: Any, trajectory: Trajectory, task: Any) -> Any:
    """A multi-turn episode's verdict: its environment scores the stored transcript (its task and turns),
    from what the environment holds — the domain's verifier on the final answer, or its own rule."""
    from workers.environments.base import EnvTask, Transcript, Turn, make_environment
    from workers.verifiers.base import invalid

    started = time.monotonic()
    reference = task.reference if task is not None else {}
    env_task = EnvTask(prompt=trajectory.prompt, reference=reference,
                       metadata=task.metadata if task is not None else {}, kind=domain.kind)
    try:
        env = make_environment(domain.environment, domain.environment_params,
                               judge=lambda t, text: judge(verifier_row, t.prompt, text, t.reference, t.kind))
        transcript = Transcript(env_task, [Turn.from_dict(d) for d in trajectory.turns],
                                trajectory.stop_reason or "done")  # type: ignore[arg-type]
        verdict = env.score(transcript)
    except Exception as exc:
        return invalid(f"the environment could not score the episode: {type(exc).__name__}: {exc}"[:500])
    return verdict.with_latency((time.monotonic() - started) * 1000)


def record_verdict(trajectory_id: int, *, status: str, score: float | None, reason: str, details: dict[str, Any],
                   latency_ms: float) -> bool:
    """Store one verdict unless one is already there (a redelivered verification does nothing)."""
    return bool(Trajectory.objects.filter(pk=trajectory_id, verdict=VerdictChoice.PENDING).update(
        verdict=status, reward=score, verdict_reason=reason or "", verifier_details=details,
        verify_latency_ms=latency_ms))


def record_verdicts(verdicts: list[tuple[Trajectory, Any]]) -> None:
    """``record_verdict`` for many samples: one prepared statement run for every row (``executemany``)."""
    if not verdicts:
        return
    details = Trajectory._meta.get_field("verifier_details")
    table = connection.ops.quote_name(Trajectory._meta.db_table)
    columns = ("verdict", "reward", "verdict_reason", "verifier_details", "verify_latency_ms")
    rows = []
    for t, v in verdicts:
        fields = verdict_fields(v)
        fields["verifier_details"] = details.get_db_prep_save(fields["verifier_details"], connection)
        rows.append((*(fields[c] for c in columns), t.pk, VerdictChoice.PENDING))
    with connection.cursor() as cursor:
        cursor.executemany(f"UPDATE {table} SET {', '.join(f'{c} = %s' for c in columns)} WHERE id = %s AND verdict = %s",
                           rows)


def outcome(group: PromptGroup, max_retries: int, verdicts: list[tuple[str, str]]) -> dict[str, Any] | None:
    """What a group becomes once every sample has a verdict (its samples' (verdict, reason)): the ready
    buffer, or dropped when no verdict is usable; its row's new fields, or None while verdicts are missing."""
    if not verdicts or any(v == VerdictChoice.PENDING for v, _ in verdicts):
        return None
    invalid = [reason for v, reason in verdicts if v == VerdictChoice.INVALID]
    retry = bool(invalid) and group.retries < max_retries
    fields: dict[str, Any] = {"status": G.READY, "invalid": len(invalid), "retry_pending": retry, "holder": ""}
    if len(invalid) == len(verdicts):
        fields["status"] = G.DROPPED
        fields["drop_reason"] = (f"every verdict invalid ({invalid[0][:80]})"
                                 + ("; prompt queued again" if retry else f"; no retry left after {group.retries}"))[:200]
    return fields


def finish(groups: list[tuple[PromptGroup, list[tuple[str, str]]]], max_retries: int) -> dict[int, str]:
    """Finish the groups whose samples all have a verdict (``outcome``), in one statement per distinct
    outcome (a batch's groups mostly share one: ready, none invalid). Returns the new status of each group
    this call finished; one another delivery finished first is left out, as is one still missing verdicts."""
    outcomes = {g.pk: o for g, verdicts in groups if (o := outcome(g, max_retries, verdicts)) is not None}
    if not outcomes:
        return {}
    with transaction.atomic():
        # locked where the database can (PostgreSQL): a concurrent delivery waits here, then reads them finished
        verifying = set(PromptGroup.objects.select_for_update().filter(pk__in=list(outcomes), status=G.VERIFYING)
                        .values_list("pk", flat=True))
        same: dict[tuple[tuple[str, Any], ...], list[int]] = {}
        for pk in verifying:
            same.setdefault(tuple(sorted(outcomes[pk].items())), []).append(pk)
        now = timezone.now()
        for fields, pks in same.items():
            PromptGroup.objects.filter(pk__in=pks, status=G.VERIFYING).update(**dict(fields), updated_at=now)
    return {pk: outcomes[pk]["status"] for pk in verifying}


INLINE_KINDS = frozenset({"exact_match", "json_match"})
"""Verifier kinds the GPU worker judges as it writes a rollout batch (``generation.write_samples``): string
comparisons bounded by the completion's length, microseconds a sample, with no sandbox, no network and no
signal (``math`` bounds itself with ``signal.alarm``, which only a main thread has: it stays on the verify
queue). On the demo run (on-policy) the device waited ~25 ms a step for a verify task to read the batch back,
judge it, write the verdicts and finish the groups; written with the samples, the batch is ready to train as
its rollout task ends."""


def judged_inline(group: PromptGroup) -> bool:
    domain = group.domain
    return bool(domain is not None and domain.environment == "single_turn" and domain.verifier is not None
                and domain.verifier.kind in INLINE_KINDS)


def verdict_fields(verdict: Any) -> dict[str, Any]:
    """A verdict as its trajectory row stores it: the columns ``record_verdicts`` updates and
    ``generation.write_samples`` inserts."""
    return {"verdict": verdict.status, "reward": verdict.score, "verdict_reason": verdict.reason or "",
            "verifier_details": verdict.to_dict().get("details", {}), "verify_latency_ms": verdict.latency_ms}


def next_step(run_id: int, spec: RunSpec, finished: list[str]) -> bool:
    """After groups were finished (``finished``: their new statuses), take the run's next step here if that
    changes what it would be: a batch is ready to train, a group was dropped (it frees admission room), or
    the run is pausing or ended. Returns whether it was taken (or handed to the control queue)."""
    if not finished:
        return False
    run_status, state = Run.objects.filter(pk=run_id).values_list("status", "state").get()
    if not (G.DROPPED in finished or run_status != RunStatus.RUNNING or (
            not state.get("train_claim")
            and PromptGroup.objects.filter(run_id=run_id, status=G.READY).count() >= spec.pipeline.batch_prompts)):
        return False
    # Taken here rather than through the control queue, as a train step takes its next one: the train
    # message is queued as the batch becomes ready, a broker round trip and a control task sooner (the
    # device waits on exactly this when generation waits for the newest version, bench/demo.py). The
    # verdicts are stored by now, so a redelivery of the caller's task would skip the groups: if the decision
    # fails here, the control worker takes it (with its own retries).
    try:
        tick.advance(run_id)
    except Exception:
        log.warning("advance(%s) after verification failed; handed to the control queue", run_id, exc_info=True)
        messages.advance_run(run_id)
    return True


IN_PROCESS_KINDS = frozenset({"exact_match", "json_match", "math"})
"""Verifier kinds that judge in this process in microseconds: a rollout batch of their groups is judged in
one task (``verify_groups``), where a task per group cost ~30 ms of Celery and queries each — half a CPU core
at the demo's pace, on a machine whose other core is the "GPU" (``bench/demo.py``)."""


def batched_groups(group_ids: list[int]) -> list[int]:
    """Those of ``group_ids`` judged with the rest of their rollout batch: single-turn, with an in-process kind
    or a remote judge (``verify_groups`` asks it about every sample at once)."""
    rows = PromptGroup.objects.filter(pk__in=group_ids, domain__environment="single_turn").values_list(
        "pk", "domain__verifier__kind", "domain__verifier__config")
    return [pk for pk, kind, config in rows
            if kind in IN_PROCESS_KINDS or (kind == "llm_judge" and bool((config or {}).get("endpoint")))]


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:  # a forked child has none of its parent's threads: it makes a pool of its own
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def judge_pool() -> ThreadPoolExecutor:
    """The threads this process asks remote judges on, made once and kept: starting a group's eight threads
    anew cost 6 ms of CPU a group, a fifth of judging it (``bench/pipeline.py``'s slow judge). Threads are
    started as they are needed, up to 64 (a threads-pool worker's tasks share them)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="temper-judge")
        return _pool


def judge_samples(group: PromptGroup, rows: list[Trajectory]) -> list[Any]:
    """The verdicts of a group's pending samples: an episode scored by its environment from its transcript;
    a remote judge asked about every sample at once; any other verifier in this thread (some use signals,
    main thread only), the group together where its kind can."""
    reference = group.task.reference if group.task else {}
    verifier = group.domain.verifier if group.domain else None
    kind = group.domain.kind if group.domain else None
    if group.domain is not None and group.domain.environment != "single_turn":
        return [score_episode(group.domain, verifier, t, group.task) for t in rows]
    if remote_judge(verifier) and len(rows) > 1:  # it spends its time waiting on the network
        return list(judge_pool().map(lambda t: judge(verifier, t.prompt, t.completion, reference, kind), rows))
    return judge_group(verifier, [(t.prompt, t.completion) for t in rows], reference, kind)


def verify_group(group_id: int, holder: str) -> str:
    """Judge every pending sample of a group; when all are judged, the group joins the ready buffer."""
    return verify_groups([group_id], holder)[0]


def verify_groups(group_ids: list[int], holder: str) -> list[str]:
    """Judge every pending sample of these groups (of one run); each group whose samples are all judged
    joins the ready buffer (or is dropped). Their rows are read in one query; verdicts are written and groups
    finished in a few statements for all the groups judged by then, and the run's next step is taken at most
    once a time (``tick.advance``, in this process).

    A remote judge's samples are all sent at once, on this process's judge threads (``judge_pool``), while
    the other groups are judged in this thread. Then its groups are finished in waves, each as soon as its
    last verdict is in: a group's slow sample (the judge's heavy tail) holds back no other group. One task
    for a rollout batch of judged-remotely groups, where a task per group cost ~30 ms of CPU in Celery and
    queries: most of a verify worker's CPU at ``bench/pipeline.py``'s pace, on the cores the "GPU" shares.

    Timings go on the group (``verify_wait_s``, ``verify_s``); the train step reports them per domain, so
    verification sends no websocket message of its own.
    """
    found = {g.pk: g for g in PromptGroup.objects.select_related("domain__verifier", "task", "run")
             .filter(pk__in=group_ids)}
    groups = [found[gid] for gid in group_ids if gid in found and found[gid].status == G.VERIFYING]
    out = {gid: "skipped" for gid in group_ids}
    if not groups:
        return [out[gid] for gid in group_ids]
    run = groups[0].run
    assert all(g.run_id == run.pk for g in groups), "verify_groups takes the groups of one run"
    now = timezone.now()
    started = time.monotonic()
    # held from now on by this worker: if it dies mid-judgment, the recovery tick hands the groups out again
    PromptGroup.objects.filter(pk__in=[g.pk for g in groups], status=G.VERIFYING).update(holder=holder,
                                                                                       updated_at=now)
    pending: dict[str, list[Trajectory]] = {g.key: [] for g in groups}
    for t in (Trajectory.objects.filter(run_id=run.pk, group_key__in=list(pending), verdict=VerdictChoice.PENDING)
              .only("id", "group_key", "prompt", "completion", "turns", "stop_reason").order_by("sample_index")):
        pending[t.group_key].append(t)
    spec = RunSpec.model_validate(run.spec)
    remote = {g.pk: submit_remote(g, pending[g.key]) for g in groups if judged_remotely(g)}
    judged: list[tuple[PromptGroup, list[tuple[Trajectory, Any]], float]] = []
    for group in groups:
        if group.pk not in remote:
            group_started = time.monotonic()
            rows = pending[group.key]
            judged.append((group, list(zip(rows, judge_samples(group, rows), strict=True)),
                           time.monotonic() - group_started))
    if judged:
        conclude(run, spec, judged, now, out)
    waiting = {g.pk: g for g in groups if g.pk in remote}
    finished: queue.SimpleQueue[int] = queue.SimpleQueue()
    for gid in waiting:
        when_all_done(remote[gid], lambda gid=gid: finished.put(gid))  # type: ignore[misc]
    while waiting:
        done = [finished.get()]
        while not finished.empty():  # and every other group finished meanwhile: written together
            done.append(finished.get())
        seconds = time.monotonic() - started
        conclude(run, spec, [(waiting[gid], list(zip(pending[waiting[gid].key], (f.result() for f in remote[gid]),
                                                      strict=True)), seconds) for gid in done], now, out)
        for gid in done:
            del waiting[gid]
    return [out[gid] for gid in group_ids]


def when_all_done(futures: list[Future[Any]], then: Callable[[], None]) -> None:
    """Call ``then`` (on the thread that finishes it) once every one of ``futures`` is done. *Why:* waiting
    with ``concurrent.futures.wait(FIRST_COMPLETED)`` on a rollout batch's samples woke once a sample and
    installed a waiter on every future still open each time: ~30 ms of the verify worker's CPU a batch of
    128 against ~8 ms with a count per group (a microbenchmark of the two loops, 64 threads, lognormal waits),
    on the core the device's bookkeeping shares."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    if not futures:
        then()
    for future in futures:
        future.add_done_callback(one_done)


def judged_remotely(group: PromptGroup) -> bool:
    """A single-turn group whose verifier is a remote judge: its samples wait on the network, all at once."""
    return bool(group.domain is not None and group.domain.environment == "single_turn"
                and remote_judge(group.domain.verifier))


def submit_remote(group: PromptGroup, rows: list[Trajectory]) -> list[Future[Any]]:
    """Ask the remote judge about every sample of the group at once, on the judge threads."""
    reference = group.task.reference if group.task else {}
    assert group.domain is not None
    verifier, kind = group.domain.verifier, group.domain.kind
    return [judge_pool().submit(judge, verifier, t.prompt, t.completion, reference, kind) for t in rows]


def conclude(run: Run, spec: RunSpec, judged: list[tuple[PromptGroup, list[tuple[Trajectory, Any]], float]],
             now: Any, out: dict[int, str]) -> None:
    """Write the verdicts of these judged groups (with how long they waited and took), finish each whose
    samples are all judged, and take the run's next step if that changes what it would be."""
    table = connection.ops.quote_name(PromptGroup._meta.db_table)
    with transaction.atomic():
        record_verdicts([v for _, verdicts, _ in judged for v in verdicts])
        with connection.cursor() as cursor:  # one prepared statement for every group, as record_verdicts
            cursor.executemany(f"UPDATE {table} SET verify_wait_s = %s, verify_s = %s WHERE id = %s AND verify_s IS NULL",
                               [((now - group.updated_at).total_seconds(), seconds, group.pk)
                                for group, _, seconds in judged])
    states: dict[str, list[tuple[str, str]]] = {g.key: [] for g, _, _ in judged}
    # order_by(): the model's default order (-id) made SQLite walk the run's whole (run, -id) index, a cost
    # that grew with the run (4.7 ms a group at 11,000 samples); unordered, it reads the groups' own rows
    for key, verdict, reason in (Trajectory.objects.filter(run_id=run.pk, group_key__in=list(states)).order_by()
                                 .values_list("group_key", "verdict", "verdict_reason")):
        states[key].append((verdict, reason))
    done = finish([(group, states[group.key]) for group, _, _ in judged], spec.pipeline.invalid_retries)
    for group, _, _ in judged:
        out[group.pk] = done.get(group.pk, "pending")
    next_step(run.pk, spec, list(done.values()))
