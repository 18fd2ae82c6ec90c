"""Generation (the GPU worker): claim a batch of admitted groups, sample G completions for each under the
run's newest version, write them, and hand the batch to verification.

Prompts are rendered by their domain (``TaskDomain.render_prompt``: the template, the system prompt, the
kind's visible fields); the trajectory stores the rendered text and the exact token ids. Writing is
idempotent on ``(run, group_key, sample_index)``, and the groups move to verifying in one statement per
sample count, so a redelivered task writes nothing twice.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from django.db import transaction
from django.utils import timezone

from webapp.common.bulk import insert_ignoring_conflicts
from webapp.runs.loop import live, paths, recovery, tick, training
from webapp.runs.loop.admission import UNFIT
from webapp.runs.loop.tick import wake_deferred
from webapp.runs.loop.verification import judged_inline, next_step, outcome, verdict_fields
from webapp.runs.models import TERMINAL_STATUSES, PromptGroup, Run, Trajectory
from workers import messages
from workers.pipeline.spec import RunSpec
from workers.policy import resident
from workers.policy.chat import prompt_text, task_messages

log = logging.getLogger(__name__)
G = PromptGroup.Status
ENDED = TERMINAL_STATUSES


def sampling(spec: RunSpec, n: int, greedy: bool = False) -> Any:
    """The engine's sampling parameters for ``n`` samples per prompt (greedy for evaluation)."""
    from workers.policy.engines import SamplingParams

    s = spec.sampling
    return SamplingParams(n=n, temperature=0.0 if greedy else s.temperature, top_p=1.0 if greedy else s.top_p,
                          max_tokens=s.max_tokens, stop=tuple(s.stop))


def claim(group_ids: list[int], holder: str) -> list[PromptGroup]:
    """admitted → generating, held by ``holder`` (a redelivered task finds nothing left to claim)."""
    PromptGroup.objects.filter(pk__in=group_ids, status=G.ADMITTED).update(
        status=G.GENERATING, holder=holder, updated_at=timezone.now())
    return list(PromptGroup.objects.filter(pk__in=group_ids, status=G.GENERATING)
                .select_related("task", "domain__verifier"))


@dataclass(frozen=True)
class SampleRow:
    group_id: int
    index: int
    prompt: str
    completion: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    turns: tuple[dict[str, Any], ...] = ()
    """A multi-turn episode's turns (tiling completion_token_ids); empty for a single turn."""
    stop_reason: str = ""
    sandbox: dict[str, Any] = field(default_factory=dict)
    """An episode's session: its start latency and kept artifacts (``session_record``)."""


def write_samples(run_id: int, groups: dict[int, PromptGroup], rows: list[SampleRow], *,
                  generate_s: float | None = None, wait_s: float | None = None,
                  judged: dict[int, tuple[list[Any], float]] | None = None, max_retries: int = 0) -> list[str]:
    """Write trajectories (idempotent on (run, group, index)) and move their groups to verifying; a group in
    ``judged`` (its samples' verdicts in index order, and the seconds judging took) is written with its
    verdicts and finished at once (``verification.outcome``: ready, or dropped when no verdict is usable).
    Only groups still generating are written, so a redelivered task writes nothing twice. Returns the new
    statuses of the groups finished.

    ``generate_s`` (the task's device seconds) is shared out over the groups and ``wait_s`` (their mean
    wait for a rollout task) stored on each: the train step reports both, so generation sends no message.
    """
    judged = judged or {}
    with transaction.atomic():  # IMMEDIATE on SQLite: the write lock from here on
        held = set(PromptGroup.objects.filter(pk__in=list(groups), status=G.GENERATING).values_list("pk", flat=True))
        rows = [r for r in rows if r.group_id in held]
        insert_ignoring_conflicts(Trajectory, [
            dict(run_id=run_id, task_id=groups[r.group_id].task_id, domain_id=groups[r.group_id].domain_id,
                 group_key=groups[r.group_id].key, sample_index=r.index, version=r.version, prompt=r.prompt,
                 completion=r.completion, prompt_token_ids=r.prompt_token_ids,
                 completion_token_ids=r.completion_token_ids, behaviour_logprobs=r.logprobs,
                 finish_reason=r.finish_reason, turns=list(r.turns), stop_reason=r.stop_reason, sandbox=r.sandbox,
                 **counts(r.turns), **(verdict_fields(judged[r.group_id][0][r.index]) if r.group_id in judged else {}))
            for r in rows
        ])
        per_group: dict[int, int] = {}
        for r in rows:
            per_group[r.group_id] = per_group.get(r.group_id, 0) + 1
        # a group's version is its oldest token's (an episode may span versions): staleness is bounded by it
        oldest: dict[int, int] = {}
        for r in rows:
            oldest[r.group_id] = min(oldest.get(r.group_id, r.version), r.version)
        share = None if generate_s is None else generate_s / max(1, len(per_group))
        finished: dict[int, str] = {}
        # one statement per distinct set of new fields: a batch's groups mostly share one
        same: dict[tuple[tuple[str, Any], ...], list[int]] = {}
        for g in per_group:
            fields: dict[str, Any] = {"status": G.VERIFYING, "n_samples": per_group[g], "generated_version": oldest[g]}
            if g in judged:
                verdicts, seconds = judged[g]
                done = outcome(groups[g], max_retries, [(v.status, v.reason or "") for v in verdicts])
                if done is not None:
                    fields.update(done, verify_wait_s=0.0, verify_s=round(seconds, 6))
                    finished[g] = done["status"]
            same.setdefault(tuple(sorted(fields.items())), []).append(g)
        now = timezone.now()
        for fields_key, pks in same.items():
            PromptGroup.objects.filter(pk__in=pks, status=G.GENERATING).update(
                **{"holder": "", **dict(fields_key)}, generate_s=share, generate_wait_s=wait_s, updated_at=now)
    return list(finished.values())


def counts(turns: Any) -> dict[str, int]:
    """The episode's turn and error counts, stored beside its turns so the trajectory list filters on them."""
    from workers.environments.episodes import episode_counts

    turn_count, tool_errors = episode_counts(turns)
    return {"turn_count": turn_count, "tool_errors": tool_errors}


def load_engine(run: Run, spec: RunSpec) -> Any:
    """The run's resident engine, loaded on the device on first use. The load is charged to no run: it
    is a one-off of the worker, and would otherwise count against a run's fair share."""
    with resident.holding_device():
        return resident.engine_for(run.engine, paths.resolve_model_path(run.base_model), seed=spec.seed,
                                   chat_template=run.base_model.chat_template)


def generate(run_id: int, group_ids: list[int], holder: str) -> int:
    """Sample G completions for each claimed group, write them, and hand the batch to verification."""
    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None:
        return 0
    if run.status in ENDED:
        PromptGroup.objects.filter(pk__in=group_ids, status=G.ADMITTED).update(
            status=G.DROPPED, drop_reason=f"run {run.status} before generation")
        return 0
    groups = claim(group_ids, holder)
    if not groups:
        return 0
    claimed_at = timezone.now()
    spec = RunSpec.model_validate(run.spec)
    group_size = spec.pipeline.group_size
    single = [g for g in groups if not g.domain or g.domain.environment == "single_turn"]
    episodic = [g for g in groups if g.domain and g.domain.environment != "single_turn"]
    engine = load_engine(run, spec)
    rows: list[SampleRow] = []
    judged: dict[int, tuple[list[Any], float]] = {}
    device_s = 0.0
    ahead: training.Ahead | None = None
    trained: resident.TrainStep | None = None
    eligible = False
    try:
        if single:
            prompts = [g.domain.render_messages(g.task.prompt, g.task.reference, g.task.metadata)
                       if g.task and g.domain else "" for g in single]
            judges = [inline_judge(g) for g in single]
            trained = resident.after_training(run_id)
            ahead = training.plan_ahead(run, spec, single, trained)
            try:
                with live.on_device(run_id) as timer:  # switching to the newest version is device work too
                    if ahead is not None:  # its train step queued right behind it
                        future = resident.rollout_async(engine, prompts, sampling(spec, group_size),
                                                        serve=ahead.base, judges=judges, keep=ahead.token)
                        training.queue_ahead(run, spec, ahead)
                        out = resident.wait(future)
                    else:
                        out = resident.rollout(engine, prompts, sampling(spec, group_size),
                                               serve=newest(run, trained), judges=judges)
            except Exception:
                # Queued behind a confirmed step that then failed on the device, the rollout asked for a version
                # that was never saved: its groups are generated again, not counted as this task's failure.
                if trained is None or not given_up(run_id, group_ids, groups, trained, ahead):
                    raise
                return 0
            device_s += timer.seconds
            for i, tokens in out.too_long.items():
                PromptGroup.objects.filter(pk=single[i].pk, status=G.GENERATING).update(
                    status=G.DROPPED, drop_reason=refusal(tokens, out.context, spec.sampling.max_tokens), holder="",
                    updated_at=timezone.now())
            rows += [SampleRow(group_id=single[out.kept[n // group_size]].pk, index=n % group_size,
                               prompt=prompt_text(prompts[out.kept[n // group_size]]), completion=s.text,
                               prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids,
                               logprobs=s.logprobs, finish_reason=s.finish_reason, version=s.version)
                     for n, s in enumerate(out.samples)]
            judged = {single[i].pk: j for i, j in zip(out.kept, out.judged or [], strict=False) if j is not None}
            eligible = ahead is not None and not out.too_long and len(judged) == len(single) and all(
                v.is_valid for verdicts, _ in judged.values() for v in verdicts)
            groups = [single[i] for i in out.kept] + episodic
        if episodic:
            episode_rows, seconds = run_group_episodes(run, spec, engine, episodic)
            rows += episode_rows
            device_s += seconds
        if not groups:  # every prompt refused
            messages.advance_run(run_id)
            if ahead is not None:
                training.give_up(run_id, ahead)
            return 0
        waits = [(claimed_at - g.created_at).total_seconds() for g in groups]
        # Samples of a version trained ahead (``trained``) are written once that version is recorded; a batch
        # whose own step is queued ahead waits for the run's step under way, if any, to be recorded first.
        if trained is None:
            if ahead is not None:
                resident.recorded(run_id)
        elif given_up(run_id, group_ids, groups, trained, ahead):
            return 0
        write = partial(write_samples, run_id, {g.pk: g for g in groups}, rows, generate_s=device_s,
                        wait_s=sum(waits) / len(waits), judged=judged, max_retries=spec.pipeline.invalid_retries)
        if ahead is None:
            finished = write()
        else:
            ahead.enter()  # the run's next rollout waits for this step
            # The rows and the scheduler's decision commit together: a tick taken between them elsewhere (the
            # beat's) would claim the step and send it to the train queue, where it would be trained anew.
            with transaction.atomic():
                Run.objects.select_for_update().filter(pk=run_id).first()
                finished = write()
                claimed = tick.advance_holding_train(run_id, holder)
    except BaseException:
        if ahead is not None:
            with contextlib.suppress(Exception):
                training.give_up(run_id, ahead)
            ahead.leave.close()
        raise
    # One message hands the rest of the batch to the verify queue, which fans it out: the GPU worker goes
    # back to the device at once, and every group is judged as soon as a verify worker is free.
    rest = [g for g in groups if g.pk not in judged]
    if rest:
        messages.verify_batch(run_id, [g.pk for g in rest], [g.attempt for g in rest])
    if ahead is not None:
        training.conclude_ahead(run_id, ahead, claimed, eligible, holder)
    elif not next_step(run_id, spec, finished):
        messages.advance_run(run_id)
    wake_deferred(except_run=run_id)
    return len(rows)


def given_up(run_id: int, group_ids: list[int], groups: list[PromptGroup], trained: resident.TrainStep,
             ahead: training.Ahead | None) -> bool:
    """Whether the confirmed step this rollout sampled from (``trained``) was given up after it was confirmed
    (it failed on the device, its record failed, or it outlasted the wait): its samples are then of no
    recorded version. None is written, and the groups are generated again."""
    if trained.recorded.wait(120.0) and trained.ok:
        return False
    if ahead is not None:
        training.give_up(run_id, ahead)
        ahead.leave.close()
    attempt = recovery.release_generation(group_ids)
    if attempt is not None:
        messages.generate(run_id, group_ids, attempt)
    log.warning("run %s: version %s, which this rollout sampled, was not recorded; its %d groups are "
                "generated again", run_id, trained.version[0] if trained.version else "?", len(groups))
    return True


def inline_judge(group: PromptGroup) -> Any:
    """How the device judges the group's samples as it generates them (``verification.INLINE_KINDS``), or
    None when the verify queue judges them."""
    if not judged_inline(group):
        return None
    assert group.domain is not None and group.domain.verifier is not None
    verifier = group.domain.verifier
    return resident.Judge(kind=verifier.kind, config=dict(verifier.config or {}),
                 reference=group.task.reference if group.task else {}, domain_kind=group.domain.kind)


def refusal(tokens: int, context: int, max_tokens: int) -> str:
    """Why a prompt of ``tokens`` tokens is not sampled: it leaves no room in the model's context for
    ``max_tokens`` more. Sampling past the context is undefined for the model, and one long prompt pads a
    whole batch to its length (a reasoning-gym pack on the demo model's 64 positions grew the GPU worker to
    21 GB)."""
    return (f"{UNFIT} {tokens} tokens: the model's context of {context} leaves no room for {max_tokens} more "
            "(sampling.max_tokens)")


def newest(run: Run, trained: Any = None) -> tuple[int, int, Path | None]:
    """The run's newest version, read now that the caller is about to sample (a train step may just have
    finished), or ``trained``'s: a step trained ahead, confirmed and not yet recorded
    (``resident.after_training``), whose version the device process saves before it samples."""
    if trained is not None:
        number, version_dir = trained.version
        return run.pk, number, version_dir
    latest = Run.objects.filter(pk=run.pk).values_list("latest_version", flat=True).get()
    return run.pk, latest, paths.version_dir(run.pk, latest)


def run_group_episodes(run: Run, spec: RunSpec, engine: Any, groups: list[PromptGroup]) -> tuple[list[SampleRow], float]:
    """G episodes per group in the domain's environment, all turns batched (see ``play_episodes``)."""
    group_size = spec.pipeline.group_size
    items = []
    for g in groups:
        assert g.domain is not None and g.task is not None
        items += [(g.domain, g.task, spec.seed + i) for i in range(group_size)]
    played, device_s = play_episodes(run, spec, engine, items, spec.sampling.temperature, spec.sampling.top_p)
    episodes = [(groups[n // group_size], n % group_size, ep) for n, ep in enumerate(played)]
    rows = []
    for g, i, ep in episodes:
        record = episode_record(ep)
        rows.append(SampleRow(group_id=g.pk, index=i, logprobs=ep.logprobs, version=min(ep.versions or [run.latest_version]),
                              **{**record, "turns": tuple(record["turns"])}))
    return rows, device_s


def episode_record(ep: Any) -> dict[str, Any]:
    """What a trajectory stores of a played episode (training and evaluation alike)."""
    return {"prompt": prompt_text(task_messages(ep.task.system, ep.task.prompt)),
            "completion": ep.transcript.final_text, "prompt_token_ids": ep.prompt_ids,
            "completion_token_ids": ep.completion_ids,
            "finish_reason": "length" if ep.stop_reason in ("max_turns", "context") else "stop",
            "turns": [t.to_dict() for t in ep.turns], "stop_reason": ep.stop_reason or "done",
            "sandbox": session_record(ep.session)}


MAX_LIVE_EPISODES = 128
"""Episodes played at once by one task (each may hold a sandbox session: a process)."""


class LazySession:
    """A sandbox session opened on the episode's first call: an episode that answers without a tool costs
    no process. Its deadline runs from that call; the episode's own deadline still bounds the whole.
    ``start_s`` is how long opening it took (None while unopened); ``artifacts`` what closing it collected."""

    def __init__(self, pool: Any, spec: Any) -> None:
        self.pool, self.spec = pool, spec
        self.session: Any = None
        self.start_s: float | None = None
        self.artifacts: list[Any] = []

    def run(self, code: str, wall_seconds: float | None = None) -> Any:
        if self.session is None:
            started = time.monotonic()
            self.session = self.pool.open(self.spec)
            self.start_s = time.monotonic() - started
        return self.session.run(code, wall_seconds)

    def close(self) -> list[Any]:
        if self.session is not None:
            self.artifacts = self.session.close()
        return self.artifacts


def session_spec(env: Any, limits: Any) -> Any:
    """The sandbox session of one episode: the run's tool time and deadline, and the files the environment
    keeps and the runtime it runs in (``artifacts`` and ``runtime`` among its parameters, as ``python_tool``
    has)."""
    from sandboxes.session import SessionLimits, SessionSpec

    params = getattr(env, "params", None)
    return SessionSpec(artifacts=tuple(getattr(params, "artifacts", ()) or ()),
                       runtime=str(getattr(params, "runtime", "python") or "python"),
                       limits=SessionLimits(cell_wall_seconds=limits.tool_seconds,
                                            deadline_seconds=limits.deadline_seconds + 5.0))


PREVIEW_BYTES = 4096
"""Of each kept artifact, the episode stores at most this much text (people read it; nothing scores it)."""
MAX_KEPT_ARTIFACTS = 16


def session_record(session: Any) -> dict[str, Any]:
    """What a trajectory keeps of an episode's session (``Trajectory.sandbox``): how long it took to open and
    its artifacts — path, size, sha256 and the start of the text (none for a binary file or one the sandbox
    did not read back, being over its size cap). Bounded: 16 artifacts of 4 KB of preview at most."""
    if not isinstance(session, LazySession) or session.start_s is None:
        return {}
    artifacts = []
    for a in session.artifacts[:MAX_KEPT_ARTIFACTS]:
        data = a.data[:PREVIEW_BYTES] if a.data is not None else None
        binary = data is not None and b"\0" in data
        artifacts.append({"path": a.path, "size": a.size, "sha256": a.sha256,
                          "preview": None if data is None or binary else data.decode("utf-8", "replace"),
                          "truncated": a.data is None or len(a.data) > PREVIEW_BYTES, "binary": binary})
    record: dict[str, Any] = {"session_start_s": round(session.start_s, 6)}
    if artifacts:
        record["artifacts"] = artifacts
    return record


def play_episodes(run: Run, spec: RunSpec, engine: Any, items: list[tuple[Any, Any, int]], temperature: float,
                  top_p: float, version: int | None = None) -> tuple[list[Any], float]:
    """One episode per (domain, task, seed) in its domain's environment, each in a sandbox session of its
    own when the environment needs one, all turns batched; returns the episodes and the device seconds.
    The device is held only while a turn is generated (while episodes act in their sandbox sessions, the
    worker's other task thread uses it), and each turn is sampled under the newest version (an episode may
    span versions), or under ``version`` when one is given (held-out evaluation). Every session is closed,
    whatever happens."""
    from sandboxes.session import default_pool as session_pool
    from workers.environments.base import EnvTask, make_environment
    from workers.environments.episodes import Episode, EpisodeLimits, engine_io, run_episodes
    from workers.verifiers.base import invalid

    e = spec.episode
    io = engine_io(engine, temperature, top_p)
    device_s = [0.0]

    def generate(contexts: list[list[int]], max_tokens: int, stop: tuple[str, ...]) -> Any:
        with live.on_device(run.pk) as timer:
            if version is None:
                resident.serve(engine, *newest(run))
            else:
                resident.serve(engine, run.pk, version, paths.version_dir(run.pk, version))
            out = io.generate(contexts, max_tokens, (*stop, *spec.sampling.stop))
        device_s[0] += timer.seconds
        return out

    context = e.context_tokens or resident.context_tokens(engine) or 4096
    limits = EpisodeLimits(max_turns=e.max_turns, max_tokens_per_turn=e.max_tokens_per_turn or spec.sampling.max_tokens,
                           context_tokens=context, deadline_s=e.deadline_seconds)
    episodes: list[Episode] = []
    pool = None
    try:
        for domain, task_row, seed in items:
            task = EnvTask(prompt=domain.render_prompt(task_row.prompt, task_row.reference, task_row.metadata,
                                                      with_system=False),
                           reference=task_row.reference, metadata=task_row.metadata, kind=domain.kind,
                           system=domain.system_prompt)
            env = make_environment(domain.environment, domain.environment_params,
                                   judge=lambda task, text: invalid("scored on the verify queue"))
            session = None
            if env.needs_session:
                pool = pool or session_pool()
                session = LazySession(pool, session_spec(env, e))
            episodes.append(Episode(env=env, task=task, seed=seed, session=session))
        for start in range(0, len(episodes), MAX_LIVE_EPISODES):
            chunk = episodes[start:start + MAX_LIVE_EPISODES]
            try:
                run_episodes(chunk, replace(io, generate=generate), limits)
            finally:
                close_sessions(chunk)
    finally:
        close_sessions(episodes)
    return episodes, device_s[0]


def close_sessions(episodes: list[Any]) -> None:
    for ep in episodes:
        if ep.session is not None:
            with contextlib.suppress(Exception):  # one session that fails to close must not keep the others
                ep.session.close()
