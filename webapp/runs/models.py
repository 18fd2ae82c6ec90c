"""Runs and everything they produce: events, policy versions with aliases, trajectories, metrics.

Trajectories and metric points reach millions of rows per run: every index here serves a query the
UI or API makes, always scoped by run, and no list ever needs a full ``COUNT(*)``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models

from webapp.catalog.models import BaseModel, Task, TaskDomain
from webapp.common.models import OwnedModel, OwnedQuerySet, TimestampedModel


class RunStatus(models.TextChoices):
    DRAFT = "draft"
    QUEUED = "queued"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATUSES = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})
ACTIVE_STATUSES = frozenset({RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSING})


class Engine(models.TextChoices):
    TORCH = "torch"
    VLLM = "vllm"


class Run(OwnedModel):
    """A base model, weighted domains, an algorithm and pipeline settings, and a lifecycle."""

    objects = OwnedQuerySet["Run"].as_manager()

    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="runs")
    domains: models.ManyToManyField[TaskDomain, RunDomain] = models.ManyToManyField(
        TaskDomain, through="RunDomain", related_name="runs"
    )
    engine = models.CharField(max_length=16, choices=Engine.choices, default=Engine.TORCH)
    spec = models.JSONField(default=dict, help_text="The validated RunSpec (see webapp/runs/spec.py)")
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.DRAFT, db_index=True)
    status_reason = models.TextField(blank=True)
    forced_start = models.BooleanField(
        default=False, help_text="Started although a domain's verifier had no passing calibration"
    )
    step = models.PositiveIntegerField(default=0)
    latest_version = models.PositiveIntegerField(default=0)
    # The loop's saved position (data cursor, partial groups, pending work): what resume continues from.
    state = models.JSONField(default=dict, blank=True)
    # Groups trained so far, by domain id ("" for groups without a domain): added to by each step's record
    # (training.finish), in its transaction, so a tick counts them without reading the run's whole group table;
    # checked against the groups on every start and resume (accounting.recount_trained).
    trained_groups = models.JSONField(default=dict, blank=True)
    # Last sequence number handed to a metric point of this run (allocated under a row lock).
    metric_seq = models.BigIntegerField(default=0)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["owner", "status", "-id"], name="run_owner_status_id")]

    def __str__(self) -> str:
        return f"#{self.pk} {self.name}"


class RunDomain(models.Model):
    """A domain in a run, with its sampling weight and priority."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="run_domains")
    domain = models.ForeignKey(TaskDomain, on_delete=models.PROTECT, related_name="run_domains")
    weight = models.FloatField(default=1.0)
    priority = models.IntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "domain"], name="rundomain_unique")]
        ordering = ["id"]


class RunEvent(models.Model):
    """One line of a run's event log: every transition, alert and notable fact, append-only."""

    class Level(models.TextChoices):
        INFO = "info"
        WARNING = "warning"
        ERROR = "error"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    created_at = models.DateTimeField(auto_now_add=True)
    kind = models.CharField(max_length=64)
    level = models.CharField(max_length=8, choices=Level.choices, default=Level.INFO)
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["run", "id"], name="runevent_run_id")]


class PolicyVersion(TimestampedModel):
    """Version ``number`` of a run's policy: an adapter or weights in the artifact store."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children")
    step = models.PositiveIntegerField(default=0)
    path = models.CharField(max_length=1000, blank=True, help_text="Directory under ARTIFACTS_ROOT")
    metadata = models.JSONField(default=dict, blank=True)
    metrics = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["run", "number"]
        constraints = [models.UniqueConstraint(fields=["run", "number"], name="policyversion_run_number_unique")]

    def __str__(self) -> str:
        return f"run {self.run_id} v{self.number}"


class Alias(models.TextChoices):
    LATEST = "latest"
    CANDIDATE = "candidate"
    CANARY = "canary"
    PRODUCTION = "production"
    PREVIOUS = "previous"


class AliasEvent(models.Model):
    """Append-only history of alias moves per base model; an alias's current target is its newest row."""

    base_model = models.ForeignKey(BaseModel, on_delete=models.CASCADE, related_name="alias_events")
    alias = models.CharField(max_length=16, choices=Alias.choices)
    version = models.ForeignKey(
        PolicyVersion, null=True, blank=True, on_delete=models.PROTECT, related_name="alias_events"
    )
    previous_version = models.ForeignKey(
        PolicyVersion, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    action = models.CharField(max_length=16)  # promote | rollback
    reason = models.TextField(blank=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["base_model", "alias", "-id"], name="aliasevent_current")]


class PromptGroup(models.Model):
    """One admitted prompt of a run and the fate of its G samples: the unit the loop schedules and trains.

    Every admitted group ends ``trained`` exactly once or ``dropped`` with a reason, so the counts of a
    run always add up, whatever was killed or restarted on the way.
    """

    class Status(models.TextChoices):
        ADMITTED = "admitted"       # chosen by the scheduler, waiting for a rollout worker
        GENERATING = "generating"   # claimed by a rollout task
        VERIFYING = "verifying"     # samples written, verdicts arriving
        READY = "ready"             # every sample judged: in the ready buffer
        TRAINING = "training"       # claimed by train step ``trained_step``
        TRAINED = "trained"
        DROPPED = "dropped"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="groups", db_index=False)
    key = models.CharField(max_length=64)
    task = models.ForeignKey(Task, null=True, on_delete=models.SET_NULL, related_name="+")
    domain = models.ForeignKey(TaskDomain, null=True, on_delete=models.SET_NULL, related_name="+")
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.ADMITTED)
    admitted_version = models.PositiveIntegerField(default=0)
    generated_version = models.PositiveIntegerField(null=True, blank=True)
    n_samples = models.PositiveSmallIntegerField(default=0)
    attempt = models.PositiveSmallIntegerField(default=0)
    trained_step = models.PositiveIntegerField(null=True, blank=True)
    drop_reason = models.CharField(max_length=200, blank=True)
    invalid = models.PositiveSmallIntegerField(default=0, help_text="Samples whose verdict is invalid")
    retries = models.PositiveSmallIntegerField(default=0, help_text="Earlier admissions of this prompt that got "
                                               "an invalid verdict (0: first admission)")
    retry_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    retry_pending = models.BooleanField(default=False, help_text="Its prompt waits to be admitted again")
    generate_wait_s = models.FloatField(null=True, blank=True, help_text="From admission to a rollout task")
    generate_s = models.FloatField(null=True, blank=True, help_text="Its share of its rollout task's device time")
    verify_wait_s = models.FloatField(null=True, blank=True, help_text="From samples written to judging started")
    verify_s = models.FloatField(null=True, blank=True, help_text="Judging all its samples took this long")
    holder = models.CharField(max_length=200, blank=True,
                              help_text="The worker (Celery node) generating or judging it now: when that worker is "
                                        "known gone, the group is handed out again at once")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["id"]
        constraints = [models.UniqueConstraint(fields=["run", "key"], name="promptgroup_run_key_unique")]
        indexes = [
            models.Index(fields=["run", "status", "id"], name="group_run_status_id"),
            models.Index(fields=["run", "-id"], name="group_run_id"),  # a run's newest groups (health check)
            models.Index(fields=["run", "id"], condition=models.Q(retry_pending=True), name="group_run_retry"),
            models.Index(fields=["run", "trained_step"], name="group_run_trained_step"),  # a step's report
        ]


class WorkerHeartbeat(models.Model):
    """A Celery worker's last sign of life, written every few seconds by a thread in the worker process.

    A worker whose ``last_seen`` is older than ``TEMPER_WORKER_SILENT_SECONDS`` is flagged on the active
    runs (``alert.worker_gone``); a queue that no live worker consumes raises ``alert.no_worker``.
    """

    name = models.CharField(max_length=200, unique=True, help_text="Celery node name, e.g. gpu@host")
    queues = models.CharField(max_length=200, help_text="Comma-separated queues it consumes")
    pid = models.IntegerField()
    started_at = models.DateTimeField()
    last_seen = models.DateTimeField()
    stopped_at = models.DateTimeField(null=True, blank=True, help_text="Set by a clean shutdown")
    busy_seconds = models.FloatField(default=0.0, help_text="Seconds spent generating or training since start")
    current_task = models.CharField(max_length=200, blank=True)
    current_run = models.BigIntegerField(null=True, blank=True)
    device = models.CharField(max_length=200, blank=True,
                              help_text="Where a GPU worker runs the policy: device and dtype (TEMPER_DEVICE)")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def queue_list(self) -> list[str]:
        return [q for q in self.queues.split(",") if q]


class VerdictChoice(models.TextChoices):
    PENDING = "pending"
    PASS = "pass"
    FAIL = "fail"
    INVALID = "invalid"


class Trajectory(models.Model):
    """One sample: prompt, completion, behaviour log-probs, version stamp, verdict and training facts."""

    # db_index=False: every composite index below starts with run, so a lone run index is dead weight.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="trajectories", db_index=False)
    task = models.ForeignKey(Task, null=True, on_delete=models.SET_NULL, related_name="trajectories")
    domain = models.ForeignKey(TaskDomain, null=True, on_delete=models.SET_NULL, related_name="trajectories")
    group_key = models.CharField(max_length=64, help_text="The prompt instance this sample belongs to")
    sample_index = models.PositiveSmallIntegerField(default=0)
    version = models.PositiveIntegerField(default=0, help_text="Policy version that generated it")
    prompt = models.TextField()
    completion = models.TextField()
    prompt_token_ids: models.JSONField[Any, Any] = models.JSONField(default=list, blank=True)
    completion_token_ids: models.JSONField[Any, Any] = models.JSONField(default=list, blank=True)
    behaviour_logprobs: models.JSONField[Any, Any] = models.JSONField(default=list, blank=True)
    finish_reason = models.CharField(max_length=16, blank=True)
    turns: models.JSONField[Any, Any] = models.JSONField(
        default=list, blank=True,
        help_text="A multi-turn episode's turns (role, text, token span, status, latency, tool, arguments, "
                  "version), tiling completion_token_ids; empty for a single turn")
    stop_reason = models.CharField(max_length=16, blank=True,
                                   help_text="Why an episode stopped: done, max_turns, context, timeout, env_error, "
                                             "session_error")
    turn_count = models.PositiveSmallIntegerField(default=0, help_text="An episode's model turns (0: single turn)")
    tool_errors = models.PositiveSmallIntegerField(
        default=0, help_text="An episode's observations that were a tool error, a timeout or a parse error")
    verdict = models.CharField(max_length=8, choices=VerdictChoice.choices, default=VerdictChoice.PENDING)
    reward = models.FloatField(null=True, blank=True)
    verdict_reason = models.TextField(blank=True)
    verifier_details = models.JSONField(default=dict, blank=True)
    sandbox = models.JSONField(default=dict, blank=True, help_text="Sandbox logs, tier and artifacts")
    verify_latency_ms = models.FloatField(null=True, blank=True)
    advantage = models.FloatField(null=True, blank=True)
    clipped = models.BooleanField(null=True, blank=True)
    trained_step = models.PositiveIntegerField(null=True, blank=True)
    is_eval = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["run", "group_key", "sample_index"], name="trajectory_sample_unique")
        ]
        indexes = [
            models.Index(fields=["run", "-id"], name="traj_run_id"),
            models.Index(fields=["run", "version", "-id"], name="traj_run_version_id"),
            models.Index(fields=["run", "domain", "-id"], name="traj_run_domain_id"),
            models.Index(fields=["run", "verdict", "-id"], name="traj_run_verdict_id"),
            models.Index(fields=["run", "reward"], name="traj_run_reward"),
            # each train step's report reads its own samples: without this index it walked the whole run
            models.Index(fields=["run", "trained_step"], name="traj_run_trained_step"),
        ]


class MetricPoint(models.Model):
    """One point of one time series of a run: (name, domain, step, value, time, sequence number)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metric_points", db_index=False)
    name = models.CharField(max_length=128)
    domain = models.ForeignKey(
        TaskDomain, null=True, blank=True, on_delete=models.CASCADE, related_name="+", db_index=False
    )
    step = models.BigIntegerField()
    value = models.FloatField()
    time = models.DateTimeField()
    seq = models.BigIntegerField()

    class Meta:
        ordering = ["run", "seq"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="metricpoint_run_seq_unique")]
        indexes = [models.Index(fields=["run", "name", "domain", "step"], name="metric_run_name_step")]


class Evaluation(TimestampedModel):
    """A suite of held-out tasks of one domain run on one policy version, with its results."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"
        ERROR = "error"

    version = models.ForeignKey(PolicyVersion, on_delete=models.CASCADE, related_name="evaluations")
    domain = models.ForeignKey(TaskDomain, on_delete=models.CASCADE, related_name="evaluations")
    suite = models.CharField(max_length=64, default="heldout")
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    n_tasks = models.PositiveIntegerField(default=0)
    n_samples = models.PositiveIntegerField(default=1)
    score = models.FloatField(null=True, blank=True)
    pass_rate = models.FloatField(null=True, blank=True)
    invalid_count = models.PositiveIntegerField(default=0)
    results = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["version", "domain", "suite"], name="evaluation_version_domain")]


class MetricRollup(models.Model):
    """One bucket of one metric series at a fixed step width: its first and last step, min, max and count.

    Kept up to date by ``metrics.record_points`` in the same transaction as the points, at three widths
    (``metrics.ROLLUP_WIDTHS``). A chart of a long series reads a few thousand of these instead of
    aggregating every raw point, so a run with 100 series of 100,000 points draws in about a second.
    ``domain_key`` is the domain's id, 0 for a run-wide series (a NULL would defeat the unique key).
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+", db_index=False)
    name = models.CharField(max_length=128)
    domain_key = models.BigIntegerField(default=0)
    level = models.PositiveSmallIntegerField()
    bucket = models.BigIntegerField()
    step_lo = models.BigIntegerField()
    step_hi = models.BigIntegerField()
    v_min = models.FloatField()
    v_max = models.FloatField()
    n = models.PositiveIntegerField()
    seq_max = models.BigIntegerField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "name", "domain_key", "level", "bucket"], name="metricrollup_key")
        ]
