"""The catalog: base models, task domains with their tasks, and verifiers with their calibration.

These are the stable assets a run is built from. Runs never change them.
"""

from __future__ import annotations

from typing import Any

from django.db import models

from webapp.common.models import OwnedModel, OwnedQuerySet, TimestampedModel
from workers.domains.kinds import KINDS
from workers.domains.prompts import render
from workers.policy.chat import task_messages


class BaseModel(OwnedModel):
    """A stable language model asset: a Hugging Face format directory (or hub id) and its tokenizer."""

    objects = OwnedQuerySet["BaseModel"].as_manager()

    name = models.CharField(max_length=200)
    path = models.CharField(max_length=1000, help_text="Hugging Face directory (absolute or under ARTIFACTS_ROOT)")
    description = models.TextField(blank=True)
    chat_template = models.TextField(blank=True, help_text="Overrides the tokenizer's chat template when set")
    parameters = models.BigIntegerField(null=True, blank=True)
    promotion_gate = models.JSONField(
        default=dict, blank=True,
        help_text="What promotion to a gated alias requires (webapp/runs/evaluation.py GateConfig): aliases, "
                  "require_no_regression, min_gain, suite. Empty: the defaults.",
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="basemodel_owner_name_unique")]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class VerifierKind(models.TextChoices):
    EXACT_MATCH = "exact_match"
    MATH = "math"
    REGEX = "regex"
    JSON_MATCH = "json_match"
    PYTHON_TESTS = "python_tests"
    COMMAND = "command"
    F1 = "f1"
    LLM_JUDGE = "llm_judge"
    GENERATOR = "generator"
    PYTHON_REWARD = "python_reward"


class CalibrationStatus(models.TextChoices):
    NONE = "none", "never calibrated"
    RUNNING = "running"
    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"


class Verifier(OwnedModel):
    """A verifier kind with a validated configuration, its calibration cases and its last report."""

    objects = OwnedQuerySet["Verifier"].as_manager()

    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=32, choices=VerifierKind.choices)
    config = models.JSONField(default=dict, blank=True)
    description = models.TextField(blank=True)
    calibration_status = models.CharField(
        max_length=16, choices=CalibrationStatus.choices, default=CalibrationStatus.NONE
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="verifier_owner_name_unique")]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.kind})"

    @property
    def calibrated(self) -> bool:
        return self.calibration_status == CalibrationStatus.PASSED


class CalibrationCase(TimestampedModel):
    """One known case for a verifier: an input and the verdict a good verifier must give."""

    class Expected(models.TextChoices):
        PASS = "pass"
        FAIL = "fail"

    class Label(models.TextChoices):
        GOOD = "good", "known-good reference"
        BAD = "bad", "known-bad answer"
        HACK = "hack", "known reward hack"

    verifier = models.ForeignKey(Verifier, on_delete=models.CASCADE, related_name="calibration_cases")
    prompt = models.TextField(blank=True)
    completion = models.TextField(blank=True)  # an empty answer is a classic hack case
    reference = models.JSONField(default=dict, blank=True)
    expected = models.CharField(max_length=4, choices=Expected.choices)
    label = models.CharField(max_length=4, choices=Label.choices, default=Label.GOOD)
    note = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["id"]


class CalibrationReport(TimestampedModel):
    """The outcome of judging every calibration case several times."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"
        ERROR = "error"

    verifier = models.ForeignKey(Verifier, on_delete=models.CASCADE, related_name="calibration_reports")
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    passed = models.BooleanField(null=True)
    summary = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]


class DomainKind(models.TextChoices):
    """What a task row of the domain looks like: one definition per kind in ``workers.domains.kinds``
    (these choices repeat its names for Django; a test holds them equal)."""

    ANSWER = "answer", KINDS["answer"].label
    CODE = "code", KINDS["code"].label
    COMMAND = "command", KINDS["command"].label
    DOCUMENT_QA = "document_qa", KINDS["document_qa"].label
    JSON = "json", KINDS["json"].label
    OPEN = "open", KINDS["open"].label
    GENERATED = "generated", KINDS["generated"].label


class TaskDomain(OwnedModel):
    """A named family of tasks with its verifier, sandbox limits, sampling defaults and held-out split."""

    objects = OwnedQuerySet["TaskDomain"].as_manager()

    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=16, choices=DomainKind.choices, default=DomainKind.ANSWER)
    description = models.TextField(blank=True)
    verifier = models.ForeignKey(
        Verifier, null=True, blank=True, on_delete=models.SET_NULL, related_name="domains"
    )
    prompt_template = models.TextField(
        blank=True, help_text="What the model sees: {prompt}, the kind's visible fields ({context}, {files}, …) and "
                              "{metadata.<key>}. Empty: the kind's default")
    system_prompt = models.TextField(blank=True, help_text="Put before every prompt of the domain")
    environment = models.CharField(
        max_length=64, default="single_turn",
        help_text="What an episode of a task is: single_turn (one completion, judged), or a multi-turn "
                  "environment such as python_tool (the model runs code in a sandbox session before it answers)")
    environment_params = models.JSONField(default=dict, blank=True,
                                          help_text="The environment's parameters (validated by it)")
    sandbox_limits = models.JSONField(default=dict, blank=True)
    sampling_defaults = models.JSONField(default=dict, blank=True)
    heldout_fraction = models.FloatField(
        default=0.1, help_text="Share of imported tasks without an explicit split that go to held-out"
    )
    # Kept up to date by the import service so lists never COUNT(*) a large task table.
    task_count = models.PositiveIntegerField(default=0)
    heldout_count = models.PositiveIntegerField(default=0)
    # A generator domain makes its tasks instead of importing them (webapp/catalog/generated.py): a fixed
    # held-out set when it is created, the train stream in batches as runs admit it.
    generator = models.CharField(max_length=100, blank=True,
                                 help_text="The seeded generator making this domain's tasks (demo.addition, "
                                           "rg.<dataset>); empty: tasks are imported")
    generator_params = models.JSONField(default=dict, blank=True,
                                        help_text="The generator's parameters (validated by it; difficulty among "
                                                  "them): new train tasks use them, the held-out set stays")
    generator_seed = models.BigIntegerField(default=0)
    generator_next = models.BigIntegerField(default=0, help_text="The next index of the train stream to make")
    pack = models.CharField(max_length=200, blank=True, db_index=True, help_text="The pack that created it")
    tags = models.JSONField(default=list, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="domain_owner_name_unique")]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def render_prompt(self, prompt: str, reference: Any, metadata: dict[str, Any] | None = None, *,
                      with_system: bool = True) -> str:
        """The text the model is given for one of this domain's tasks (``workers.domains.prompts``)."""
        return render(self.kind, self.prompt_template, self.system_prompt if with_system else "", prompt=prompt,
                      reference=reference, metadata=metadata)

    def render_messages(self, prompt: str, reference: Any, metadata: dict[str, Any] | None = None
                        ) -> list[dict[str, str]]:
        """The same as a conversation (``workers.policy.chat``): the system prompt, when there is one, as a
        message of its own, then the user's turn. A model without a chat template reads it as ``render_prompt``."""
        return task_messages(self.system_prompt, self.render_prompt(prompt, reference, metadata, with_system=False))


class Task(models.Model):
    """One prompt with its reference (answer, unit tests, expected files) and metadata."""

    class Split(models.TextChoices):
        TRAIN = "train"
        HELDOUT = "heldout"

    domain = models.ForeignKey(TaskDomain, on_delete=models.CASCADE, related_name="tasks")
    external_id = models.CharField(max_length=200, null=True, blank=True)
    prompt = models.TextField()
    reference: models.JSONField[Any, Any] = models.JSONField(default=dict, blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    split = models.CharField(max_length=8, choices=Split.choices, default=Split.TRAIN)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["domain", "split", "id"], name="task_domain_split_id")]
        constraints = [
            models.UniqueConstraint(
                fields=["domain", "external_id"], name="task_domain_external_id_unique",
                condition=models.Q(external_id__isnull=False),
            )
        ]

    def __str__(self) -> str:
        return f"{self.domain_id}:{self.external_id or self.pk}"

    def model_prompt(self) -> str:
        """This task's prompt as its domain shows it to the model."""
        return self.domain.render_prompt(self.prompt, self.reference, self.metadata)
