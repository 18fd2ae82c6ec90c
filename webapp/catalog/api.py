"""REST resources of the catalog: base models, domains (with tasks and JSONL import), verifiers, domain packs."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any, cast

from django.db import models
from django.db.models import Prefetch, QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.pagination import CursorPagination
from rest_framework.parsers import BaseParser, FormParser, JSONParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.viewsets import ViewSet

from webapp.api import OwnedViewSet, router
from webapp.catalog import generated, packs
from webapp.catalog.models import BaseModel, CalibrationCase, CalibrationReport, Task, TaskDomain, Verifier
from webapp.catalog.services import (
    ImportFailed,
    check_domain,
    check_verifier,
    do_import_tasks,
    do_request_calibration,
)
from webapp.common.errors import ValidationFailed


class NonNullJSONField(serializers.JSONField):
    """A JSON value that may be anything but null (the columns are NOT NULL; multipart sends "null")."""

    def to_internal_value(self, data: Any) -> Any:
        value = super().to_internal_value(data)
        if value is None:
            raise serializers.ValidationError("must not be null")
        return value


class JSONObjectField(NonNullJSONField):
    def to_internal_value(self, data: Any) -> Any:
        value = super().to_internal_value(data)
        if not isinstance(value, dict):
            raise serializers.ValidationError(f"must be a JSON object, not {type(value).__name__}")
        return value


class TemperModelSerializer(serializers.ModelSerializer):
    serializer_field_mapping = {**serializers.ModelSerializer.serializer_field_mapping, models.JSONField: NonNullJSONField}


class OwnedSerializer(TemperModelSerializer):
    """Rejects references to other users' objects as if they did not exist."""

    def scoped(self, model: type[Any]) -> QuerySet[Any]:
        return model.objects.visible_to(self.context["request"].user)

    def validate_name(self, value: str) -> str:
        """Names are unique per owner (a database constraint DRF cannot see, as owner is not a field)."""
        model: Any = self.Meta.model
        owner = self.instance.owner if self.instance is not None else self.context["request"].user
        clash = model.objects.filter(owner=owner, name=value)
        if self.instance is not None:
            clash = clash.exclude(pk=self.instance.pk)
        if clash.exists():
            raise serializers.ValidationError(f"you already have a {model._meta.verbose_name} named {value!r}")
        return value


class BaseModelSerializer(OwnedSerializer):
    promotion_gate = JSONObjectField(required=False, help_text="What promotion to production/canary requires: "
                                     "{\"aliases\", \"require_no_regression\", \"min_gain\", \"suite\"}")

    class Meta:
        model = BaseModel
        fields = ["id", "name", "path", "description", "chat_template", "parameters", "promotion_gate", "created_at",
                  "updated_at"]

    def validate_promotion_gate(self, value: dict[str, Any]) -> dict[str, Any]:
        from webapp.runs.evaluation import gate_config

        try:
            return gate_config(value).model_dump()
        except ValidationFailed as exc:
            raise serializers.ValidationError([f"{k}: {'; '.join(v)}" for k, v in (exc.details or {}).items()]) from None


class CalibrationReportSerializer(serializers.ModelSerializer):
    class Meta:
        model = CalibrationReport
        fields = ["id", "status", "passed", "summary", "error", "created_at", "finished_at"]


class CalibrationCaseSerializer(TemperModelSerializer):
    class Meta:
        model = CalibrationCase
        fields = ["id", "prompt", "completion", "reference", "expected", "label", "note"]


def check_verifier_config(kind: str, config: dict[str, Any]) -> None:
    """Validate a verifier configuration with the kind's own pydantic model (field-level messages)."""
    from workers.verifiers.base import VerifierConfigError, build_verifier

    try:
        build_verifier(kind, config)
    except VerifierConfigError as exc:
        raise serializers.ValidationError({"config": str(exc).splitlines() or [str(exc)]}) from None


class VerifierSerializer(OwnedSerializer):
    calibration_cases = CalibrationCaseSerializer(many=True, required=False)
    config = JSONObjectField(required=False, help_text="The kind's configuration (validated by the kind)")
    last_calibration = serializers.SerializerMethodField()

    class Meta:
        model = Verifier
        fields = ["id", "name", "kind", "config", "description", "calibration_status", "calibration_cases",
                  "last_calibration", "created_at", "updated_at"]
        read_only_fields = ["calibration_status"]

    def get_last_calibration(self, obj: Verifier) -> dict[str, Any] | None:
        if hasattr(obj, "prefetched_reports"):
            report = obj.prefetched_reports[0] if obj.prefetched_reports else None
        else:
            report = obj.calibration_reports.first()
        return CalibrationReportSerializer(report).data if report else None

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        kind = attrs.get("kind", getattr(self.instance, "kind", None))
        config = attrs.get("config", getattr(self.instance, "config", {}))
        if kind:
            check_verifier_config(kind, config or {})
            problems = check_verifier(kind, attrs.get("calibration_cases"), self.instance, config=config or {})
            if problems:
                raise serializers.ValidationError(problems)
        return attrs

    def create(self, validated_data: dict[str, Any]) -> Verifier:
        cases = validated_data.pop("calibration_cases", [])
        verifier = Verifier.objects.create(**validated_data)
        CalibrationCase.objects.bulk_create([CalibrationCase(verifier=verifier, **c) for c in cases])
        return verifier

    def update(self, instance: Verifier, validated_data: dict[str, Any]) -> Verifier:
        cases = validated_data.pop("calibration_cases", None)
        changed_judging = any(k in validated_data for k in ("kind", "config")) or cases is not None
        for key, value in validated_data.items():
            setattr(instance, key, value)
        if changed_judging:
            instance.calibration_status = "none"  # a changed verifier must be calibrated again
        instance.save()
        if cases is not None:
            instance.calibration_cases.all().delete()
            CalibrationCase.objects.bulk_create([CalibrationCase(verifier=instance, **c) for c in cases])
        return instance


class TaskDomainSerializer(OwnedSerializer):
    verifier = serializers.PrimaryKeyRelatedField(queryset=Verifier.objects.all(), allow_null=True, required=False)
    sandbox_limits = JSONObjectField(required=False, help_text="Overrides of the sandbox limits for this domain")
    sampling_defaults = JSONObjectField(required=False, help_text="Default sampling settings for this domain")
    environment_params = JSONObjectField(required=False, help_text="The environment's parameters (validated by it)")

    class Meta:
        model = TaskDomain
        fields = ["id", "name", "kind", "description", "verifier", "prompt_template", "system_prompt",
                  "environment", "environment_params", "sandbox_limits", "sampling_defaults", "heldout_fraction", "task_count", "heldout_count",
                  "generator", "generator_params", "generator_seed", "pack", "tags", "created_at", "updated_at"]
        read_only_fields = ["task_count", "heldout_count", "generator", "generator_seed", "pack"]

    def get_fields(self) -> dict[str, Any]:
        fields = super().get_fields()
        request = self.context.get("request")
        if request is not None and request.user.is_authenticated:
            cast(Any, fields["verifier"]).queryset = Verifier.objects.visible_to(request.user)
        return fields

    def validate_heldout_fraction(self, value: float) -> float:
        if not 0.0 <= value < 1.0:
            raise serializers.ValidationError("must be in [0, 1)")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """A verifier that cannot judge the kind is refused here, when it is attached, not at judging time."""
        current = self.instance
        problems = check_domain(
            kind=attrs.get("kind", getattr(current, "kind", "answer")),
            verifier=attrs["verifier"] if "verifier" in attrs else getattr(current, "verifier", None),
            prompt_template=attrs.get("prompt_template", getattr(current, "prompt_template", "")),
            environment=attrs.get("environment", getattr(current, "environment", "single_turn")),
            environment_params=attrs.get("environment_params", getattr(current, "environment_params", {})),
            domain=current)
        if "generator_params" in attrs:  # a generator domain's parameters, checked by its generator
            if current is None or not current.generator:
                problems["generator_params"] = ["only a generator domain has generator parameters (create one "
                                                "through /api/v1/domain-packs/)"]
            else:
                model, more = generated.check_generator_domain(current.generator, attrs["generator_params"])
                problems.update(more)
                attrs["generator_params"] = model.model_dump(mode="json")
        if problems:
            raise serializers.ValidationError(problems)
        return attrs


class TaskSerializer(serializers.ModelSerializer):
    class Meta:
        model = Task
        fields = ["id", "external_id", "prompt", "reference", "metadata", "split", "created_at"]


class IdCursorPagination(CursorPagination):
    ordering = "-id"
    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = 1000


class JSONLParser(BaseParser):
    """Hands the raw request stream to the view, so a large JSONL body is read line by line."""

    media_type = "application/x-ndjson"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        return stream


class JSONLinesParser(JSONLParser):
    media_type = "application/jsonl"


class PlainTextParser(JSONLParser):
    media_type = "text/plain"


def _request_lines(request: Request) -> Iterator[bytes]:
    upload = request.FILES.get("file") if request.content_type.startswith("multipart/") else None
    if upload is not None:
        yield from upload
        return
    stream = request.data
    if isinstance(stream, (dict, list)) or stream is None:
        raise ValidationFailed(
            "send the JSONL as the request body (Content-Type: application/x-ndjson) or as a multipart "
            "field named 'file'"
        )
    yield from io.BufferedReader(stream) if not hasattr(stream, "readline") else stream


class BaseModelViewSet(OwnedViewSet):
    queryset = BaseModel.objects.all()
    serializer_class = BaseModelSerializer
    filterset_fields = ["name"]


class VerifierViewSet(OwnedViewSet):
    queryset = Verifier.objects.all()
    serializer_class = VerifierSerializer
    filterset_fields = ["kind", "name", "calibration_status"]

    def get_queryset(self) -> QuerySet[Any]:
        latest = Prefetch("calibration_reports", CalibrationReport.objects.order_by("-id")[:1], to_attr="prefetched_reports")
        return super().get_queryset().prefetch_related("calibration_cases", latest)

    @extend_schema(request=None, responses={202: CalibrationReportSerializer})
    @action(detail=True, methods=["post"])
    def calibrate(self, request: Request, pk: str | None = None) -> Response:
        """Judge every calibration case several times on the ``verify`` queue; poll the report."""
        report = do_request_calibration(self.get_object(), request.user)
        return Response(CalibrationReportSerializer(report).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        request=inline_serializer("DryRunRequest", {"items": serializers.ListField(child=serializers.DictField())}),
        responses={200: OpenApiTypes.OBJECT},
    )
    @action(detail=True, methods=["post"], url_path="dry-run")
    def dry_run(self, request: Request, pk: str | None = None) -> Response:
        """Judge the given completions now: ``{"items": [{"prompt", "completion", "reference"}]}``, or
        ``{"task": id, "completion"}`` to judge against a stored task (its reference, kind and rendered prompt)."""
        from workers.verifiers.base import build_verifier
        from workers.verifiers.batch import judge_rows

        verifier = self.get_object()
        items = request.data.get("items") if isinstance(request.data, dict) else None
        if not isinstance(items, list) or not items or len(items) > 100:
            raise ValidationFailed("send {\"items\": [...]} with 1 to 100 items", details={"items": ["required"]})
        task_ids = {i["task"] for i in items if isinstance(i, dict) and isinstance(i.get("task"), int)}
        tasks = {t.pk: t for t in Task.objects.filter(pk__in=task_ids, domain__in=TaskDomain.objects.visible_to(
            request.user)).select_related("domain")}
        problems = []
        for n, item in enumerate(items, start=1):
            if isinstance(item, dict) and "task" in item:
                task = tasks.get(item["task"]) if isinstance(item["task"], int) else None
                if task is None:
                    problems.append(f"item {n}: no task {item['task']!r} of yours")
                    continue
                item.setdefault("prompt", task.model_prompt())
                item.update(reference=task.reference, kind=task.domain.kind)
        if problems:
            raise ValidationFailed("; ".join(problems), details={"items": problems})
        judged = list(judge_rows(build_verifier(verifier.kind, verifier.config), items))
        return Response({"results": judged})


class TaskDomainViewSet(OwnedViewSet):
    queryset = TaskDomain.objects.all()
    serializer_class = TaskDomainSerializer
    filterset_fields = ["kind", "name", "verifier"]
    search_fields = ["name", "description"]

    @extend_schema(
        parameters=[OpenApiParameter("split", str, enum=["train", "heldout"])],
        responses={200: TaskSerializer(many=True)},
    )
    @action(detail=True, methods=["get"], pagination_class=IdCursorPagination, filterset_fields=[])
    def tasks(self, request: Request, pk: str | None = None) -> Response:
        """The domain's tasks, newest first, with cursor pagination."""
        qs = self.get_object().tasks.all()
        if split := request.query_params.get("split"):
            qs = qs.filter(split=split)
        page = self.paginate_queryset(qs)
        return self.get_paginated_response(TaskSerializer(page, many=True).data)

    @extend_schema(
        request={"application/x-ndjson": OpenApiTypes.STR, "multipart/form-data": OpenApiTypes.BINARY},
        responses={201: OpenApiTypes.OBJECT, 400: OpenApiTypes.OBJECT},
    )
    @action(detail=True, methods=["post"], url_path="import",
            parser_classes=[JSONLParser, JSONLinesParser, PlainTextParser, MultiPartParser, FormParser, JSONParser])
    def import_tasks(self, request: Request, pk: str | None = None) -> Response:
        """Import tasks from JSONL, all or nothing; 400 lists every bad line with its field and reason."""
        domain = self.get_object()
        try:
            result = do_import_tasks(domain, _request_lines(request))
        except ImportFailed as exc:
            return Response({"detail": exc.message, **exc.result.to_dict()}, status=status.HTTP_400_BAD_REQUEST)
        return Response({**result.to_dict(), "task_count": domain.task_count}, status=status.HTTP_201_CREATED)


class PackItemSerializer(serializers.Serializer):
    generator = serializers.CharField(help_text="demo.addition, demo.multiplication, demo.product, rg.<dataset>")
    params = serializers.DictField(required=False, default=dict, help_text="The generator's parameters")
    name = serializers.CharField(required=False, default="", help_text="The domain's name within the pack")


class PackRequestSerializer(serializers.Serializer):
    pack = serializers.CharField(help_text="A built-in pack (demo, reasoning-gym), or the name of your own with items")
    items = PackItemSerializer(many=True, required=False, help_text="Your own domains (default: the built-in pack's)")
    prefix = serializers.CharField(required=False, help_text="Domain names are <prefix>/<name> (default: the pack)")
    seed = serializers.IntegerField(required=False, default=0)
    heldout_size = serializers.IntegerField(required=False, default=generated.HELDOUT_SIZE, min_value=1,
                                            max_value=10_000)
    tags = serializers.ListField(child=serializers.CharField(), required=False, default=list)


class DomainPackViewSet(ViewSet):
    """Domain packs: many generator domains in one action, each with its verifier calibrated automatically."""

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def list(self, request: Request) -> Response:
        """The built-in packs, and the generators there are."""
        from workers.domains import generators, reasoning_gym

        return Response({"packs": [{"name": n, "description": d} for n, (d, _) in packs.PACKS.items()],
                         "generators": [*generators.BUILTIN, *(f"rg.{n}" for n in reasoning_gym.dataset_names())],
                         "reasoning_gym": reasoning_gym.available()})

    @extend_schema(request=PackRequestSerializer, responses={201: OpenApiTypes.OBJECT})
    def create(self, request: Request) -> Response:
        """Create a pack's domains now; ``failed`` names each one left out with the reason."""
        body = PackRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        items = [packs.PackItem(i["generator"], dict(i.get("params") or {}), i.get("name", ""))
                 for i in data["items"]] if data.get("items") else None
        result = packs.do_create_pack(request.user, data["pack"], items, prefix=data.get("prefix"), seed=data["seed"],
                                      heldout_size=data["heldout_size"], tags=data["tags"])
        return Response(result.to_dict(), status=status.HTTP_201_CREATED)


router.register("base-models", BaseModelViewSet)
router.register("domains", TaskDomainViewSet)
router.register("verifiers", VerifierViewSet)
router.register("domain-packs", DomainPackViewSet, basename="domain-packs")
