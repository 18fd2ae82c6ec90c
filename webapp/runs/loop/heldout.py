"""Held-out evaluation of a run's version, in two halves so a slow verifier never holds the GPU worker.

``sample`` (GPU worker): every domain's held-out tasks — greedy, or ``n_samples`` completions per task
when an evaluation was requested that way (pass@k) — stored as evaluation samples (``Trajectory.is_eval``).
An evaluation of up to 1,024 sequences is one batch; a larger one runs in chunks of about one generation
task's size (``chunk_tasks``; ``pipeline.eval_chunk`` sets it), each its own message queued behind the work
already waiting, so a large evaluation (a pack of 77 domains x 50 tasks is 3,850 generations) takes turns
with training instead of holding the device for minutes. The first chunk fixes the evaluation's k and
names its chain; each later chunk carries both, and a chunk delivered twice (its worker died before the
ack) does not send its successor twice (``_claim``).

``score`` (verify queue): judge them; a task's score is its sample's reward (greedy), or 1 when any of its
completions passes (pass@k); invalid verdicts are left out and counted. Each domain's ``Evaluation`` gets
the per-task scores (``results["tasks"]``, what comparisons pair on); greedy scores become
``heldout_reward`` points, and a greedy overall score at the run's target completes it. Version 0 is the
base model: a ``PolicyVersion`` row of its own, so it can be compared with.
"""

from __future__ import annotations

import contextlib
import statistics
from collections import defaultdict

from django.db import transaction

from webapp.catalog.models import Task
from webapp.runs import services
from webapp.runs.loop import live, paths
from webapp.runs.loop.generation import (
    counts,
    episode_record,
    load_engine,
    play_episodes,
    refusal,
    sampling,
)
from webapp.runs.loop.verification import judge, record_verdicts, score_episode
from webapp.runs.metrics import Point
from webapp.runs.models import Evaluation, PolicyVersion, Run, RunStatus, Trajectory, VerdictChoice
from workers import messages
from workers.pipeline.spec import RunSpec
from workers.policy import resident
from workers.policy.chat import prompt_text

EVAL_ONE_BATCH_SEQUENCES = 1024
"""An evaluation of up to this many sequences (tasks x k) is sampled in one batch, as a small one always
was; a larger one goes in chunks (unless ``pipeline.eval_chunk`` says otherwise)."""
EVAL_CHUNK_MIN_SEQUENCES = 64
"""A chunk holds at least this many sequences, so a small rollout batch does not split an evaluation
into many messages of a few generations each."""
EVAL_CHUNK_MIN_TASKS = 8
"""And at least this many tasks, so pass@64 does not send a message per task or two."""


def chunk_tasks(spec: RunSpec, samples: int, n_tasks: int) -> int:
    """Held-out tasks per ``sample`` chunk of an evaluation of ``n_tasks`` tasks x ``samples``: the run's
    ``pipeline.eval_chunk`` sequences when it sets one; else all of them up to ``EVAL_ONE_BATCH_SEQUENCES``,
    and beyond that about one generation task's sequences (rollout prompts x G, at least 64)."""
    k = max(1, samples)
    if spec.pipeline.eval_chunk is not None:
        return max(1, spec.pipeline.eval_chunk // k)
    if n_tasks * k <= EVAL_ONE_BATCH_SEQUENCES:
        return max(1, n_tasks)
    sequences = max(EVAL_CHUNK_MIN_SEQUENCES, spec.pipeline.rollout_batch_prompts * spec.pipeline.group_size)
    return max(EVAL_CHUNK_MIN_TASKS, sequences // k)


def _claim(chain: str, step: str) -> bool:
    """True the first time ``step`` of ``chain`` is claimed (Redis SET NX, kept a day); True where Redis
    cannot answer (the chain goes on: its rows are idempotent, a second scoring rewrites the same)."""
    try:
        return bool(live._redis().set(f"temper:eval-chain:{chain}:{step}", 1, nx=True, ex=86400))
    except Exception:
        return True


ACTIVE_TTL_S = 1800
"""How long a chunked evaluation counts as sampling after its latest chunk (a chain whose message was lost
with the broker's data stops holding back the run's periodic evaluations after this)."""


def _active_key(run_id: int) -> str:
    return f"temper:eval-active:{run_id}"


def _mark_sampling(run_id: int, chain: str, version: int, done: int, total: int) -> None:
    """Record that ``chain`` (version ``version``) has sampled ``done`` of its ``total`` tasks and goes on."""
    with contextlib.suppress(Exception):  # it only holds back periodic evaluations: without Redis they run
        client = live._redis()
        client.hset(_active_key(run_id), chain, f"{version}:{done}:{total}")
        client.expire(_active_key(run_id), ACTIVE_TTL_S)


def _mark_sampled(run_id: int, chain: str) -> None:
    with contextlib.suppress(Exception):
        live._redis().hdel(_active_key(run_id), chain)


def sampling_now(run_id: int) -> tuple[int, int, int] | None:
    """The chunked evaluation of this run still sampling, as (version, tasks done, tasks), or None. A
    periodic evaluation due meanwhile is skipped (``reporting.report_step``): chunks take turns with
    training, so a pack's evaluation can outlast ``eval_every`` steps, and chains started every
    ``eval_every`` versions would pile up until evaluation held the device again."""
    try:
        chains = live._redis().hvals(_active_key(run_id))
    except Exception:
        return None
    if not chains:
        return None
    version, done, total = min(tuple(int(x) for x in c.decode().split(":")) for c in chains)
    return version, done, total


def sample(run_id: int, version: int, offset: int = 0, samples: int | None = None, chain: str = "") -> int:
    """The device half: sample the held-out tasks of chunk ``offset`` (an index into every domain's tasks,
    single-turn domains first) under ``version``; queue the next chunk behind the waiting work, or after
    the last one, their scoring. The first chunk (``samples`` None) reads k from the pending request; the
    later ones are sent it. ``chain`` names the evaluation (the first message's task id, which a
    redelivery keeps)."""
    import uuid

    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None or run.status in (RunStatus.CANCELLED, RunStatus.FAILED):
        return 0
    if version == 0:
        version_row, _ = PolicyVersion.objects.get_or_create(run=run, number=0, defaults={"step": 0})
    elif (found := PolicyVersion.objects.filter(run=run, number=version).first()) is not None:
        version_row = found
    else:
        return 0
    spec = RunSpec.model_validate(run.spec)
    if samples is None:
        k = max(Evaluation.objects.filter(version=version_row, suite="heldout", status=Evaluation.Status.PENDING)
                .values_list("n_samples", flat=True), default=1)
        chain = chain or uuid.uuid4().hex
    else:
        k = samples
    per_domain = []
    for rd in run.run_domains.select_related("domain"):
        tasks = list(Task.objects.filter(domain=rd.domain, split=Task.Split.HELDOUT).order_by("id")[: spec.eval_tasks])
        if tasks:
            per_domain.append((rd, tasks))
    single = [(rd.domain, t) for rd, ts in per_domain if rd.domain.environment == "single_turn" for t in ts]
    episodic = [(rd.domain, t) for rd, ts in per_domain if rd.domain.environment != "single_turn" for t in ts]
    total = len(single) + len(episodic)
    end = offset + chunk_tasks(spec, k, total)
    chunk = (single + episodic)[offset:end]
    single_chunk = [(d, t) for d, t in chunk if d.environment == "single_turn"]
    tasks = [t for _, t in single_chunk]
    prompts = [d.render_messages(t.prompt, t.reference, t.metadata) for d, t in single_chunk]
    engine = load_engine(run, spec)
    with live.on_device(run_id):  # the chunk's single-turn prompts in one batch
        out = resident.rollout(engine, prompts, sampling(spec, k, greedy=k == 1),
                               serve=(run_id, version, paths.version_dir(run.pk, version)))
    kept, outputs = out.kept, out.samples
    refused = {i: refusal(n, out.context, spec.sampling.max_tokens) for i, n in out.too_long.items()}
    rows = [
        Trajectory(run=run, task=tasks[kept[n // k]], domain_id=tasks[kept[n // k]].domain_id,
                   group_key=messages.eval_key(version, k, tasks[kept[n // k]].pk), sample_index=n % k,
                   version=version, prompt=prompt_text(prompts[kept[n // k]]), completion=s.text,
                   prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids,
                   finish_reason=s.finish_reason, is_eval=True)
        for n, s in enumerate(outputs)
    ]
    # a task whose prompt does not fit the model counts as invalid, with the reason, not as a failure
    rows += [Trajectory(run=run, task=tasks[i], domain_id=tasks[i].domain_id, sample_index=j, version=version,
                        group_key=messages.eval_key(version, k, tasks[i].pk), prompt=prompt_text(prompts[i]),
                        completion="", is_eval=True, verdict=VerdictChoice.INVALID, verdict_reason=reason)
             for i, reason in refused.items() for j in range(k)]
    if episodic_chunk := [(d, t) for d, t in chunk if d.environment != "single_turn"]:
        # multi-turn domains are evaluated as they are trained: whole episodes, greedy turns
        items = [(d, t, spec.seed + i) for d, t in episodic_chunk for i in range(k)]
        params = sampling(spec, k, greedy=k == 1)
        played, _ = play_episodes(run, spec, engine, items, params.temperature, params.top_p, version=version)
        for n, ((_, t, _), ep) in enumerate(zip(items, played, strict=True)):
            record = episode_record(ep)
            rows.append(Trajectory(run=run, task=t, domain_id=t.domain_id, group_key=messages.eval_key(version, k, t.pk),
                                   sample_index=n % k, version=version, is_eval=True, **record,
                                   **counts(record["turns"])))
    Trajectory.objects.bulk_create(rows, ignore_conflicts=True)
    if end < total:  # behind the generation and training already queued
        if _claim(chain, str(end)):
            _mark_sampling(run_id, chain, version, end, total)
            messages.evaluate(run_id, version, end, k, chain)
        return len(rows)
    if offset:
        _mark_sampled(run_id, chain)
    if not _claim(chain, "score"):
        return len(rows)
    for rd, domain_tasks in per_domain:
        Evaluation.objects.update_or_create(version=version_row, domain=rd.domain, suite="heldout", defaults={
            "status": Evaluation.Status.RUNNING, "n_tasks": len(domain_tasks), "n_samples": k})
    messages.score_evaluation(run_id, version, k)
    return len(rows)


def score(run_id: int, version: int, samples: int) -> dict[str, float]:
    """The judging half: score the samples ``sample`` wrote, per domain."""
    run = Run.objects.filter(pk=run_id).first()
    version_row = PolicyVersion.objects.filter(run_id=run_id, number=version).first()
    if run is None or version_row is None:
        return {}
    spec = RunSpec.model_validate(run.spec)
    scores: dict[str, float] = {}
    weighted: list[tuple[float, float]] = []
    name = "heldout_reward" if samples == 1 else f"heldout_pass_at_{samples}"
    points = []
    prefix = messages.eval_key(version, samples, 0)[:-1]
    for rd in run.run_domains.select_related("domain__verifier"):
        rows = list(Trajectory.objects.filter(run=run, is_eval=True, domain=rd.domain, group_key__startswith=prefix)
                    .select_related("task").only("id", "prompt", "completion", "verdict", "reward", "turns",
                                                 "stop_reason", "task__reference", "task__metadata"))
        if not rows:
            continue
        if rd.domain.environment != "single_turn":  # scored from the stored transcript, as in training
            judged = [(t, score_episode(rd.domain, rd.domain.verifier, t, t.task))
                      for t in rows if t.verdict == VerdictChoice.PENDING]
        else:
            judged = [(t, judge(rd.domain.verifier, t.prompt, t.completion, t.task.reference if t.task else {},
                                rd.domain.kind))
                      for t in rows if t.verdict == VerdictChoice.PENDING]
        with transaction.atomic():
            record_verdicts(judged)
        for t, v in judged:
            t.verdict, t.reward = v.status, v.score
        per_task: defaultdict[int, list[tuple[str, float | None]]] = defaultdict(list)
        for t in rows:
            per_task[t.task_id or 0].append((t.verdict, t.reward))
        results, passed, invalid = [], 0, 0
        for task_id, outcomes in per_task.items():
            valid = [(v, r) for v, r in outcomes if v != VerdictChoice.INVALID]
            invalid += len(outcomes) - len(valid)
            if not valid:
                continue
            ok = any(v == VerdictChoice.PASS for v, _ in valid)
            passed += ok
            results.append([task_id, float(ok) if samples > 1 else float(valid[0][1] or 0.0)])
        value = statistics.fmean(s for _, s in results) if results else 0.0
        Evaluation.objects.update_or_create(version=version_row, domain=rd.domain, suite="heldout", defaults={
            "status": Evaluation.Status.DONE, "n_tasks": len(per_task), "n_samples": samples, "score": value,
            "pass_rate": passed / max(1, len(results)), "invalid_count": invalid,
            "results": {"greedy": samples == 1, "samples": samples, "tasks": results}})
        scores[rd.domain.name] = value
        weighted.append((value, rd.weight))
        points.append(Point(name, version_row.step, value, domain_id=rd.domain_id))
    if not weighted:
        return scores
    overall = sum(s * w for s, w in weighted) / sum(w for _, w in weighted)
    scores["overall"] = overall
    points.append(Point(name, version_row.step, overall))
    live.emit(run_id, points)
    key = "heldout" if samples == 1 else f"heldout_pass_at_{samples}"
    PolicyVersion.objects.filter(pk=version_row.pk).update(metrics={**version_row.metrics, key: scores})
    if (samples == 1 and spec.target_reward is not None and version > 0 and overall >= spec.target_reward
            and run.status == RunStatus.RUNNING):
        services.do_complete_run(run, f"held-out reward {overall:.3f} reached the target {spec.target_reward}")
        messages.advance_run(run_id)  # drops what the completed run still had in flight, with the reason
    return scores
