"""REST resources of runs: runs with lifecycle actions, policy versions with aliases, trajectories, metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from django.db.models import QuerySet
from django.http import FileResponse
from django_filters import rest_framework as filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from webapp.api import router
from webapp.catalog.api import IdCursorPagination, JSONObjectField
from webapp.catalog.models import BaseModel, TaskDomain
from webapp.common.errors import ValidationFailed
from webapp.runs import metrics as metric_store
from webapp.runs import services
from webapp.runs.evaluation import resolve_baseline
from webapp.runs.models import Alias, AliasEvent, PolicyVersion, Run, RunDomain, RunEvent, Trajectory


class RunDomainSerializer(serializers.ModelSerializer):
    domain = serializers.PrimaryKeyRelatedField(queryset=TaskDomain.objects.all())
    domain_name = serializers.CharField(source="domain.name", read_only=True)

    class Meta:
        model = RunDomain
        fields = ["domain", "domain_name", "weight", "priority"]


class RunSerializer(serializers.ModelSerializer):
    domains = RunDomainSerializer(source="run_domains", many=True)
    base_model = serializers.PrimaryKeyRelatedField(queryset=BaseModel.objects.all())
    spec = JSONObjectField(required=False, help_text="RunSpec: algorithm, pipeline, sampling, max_steps, …")

    class Meta:
        model = Run
        fields = ["id", "name", "description", "base_model", "engine", "spec", "domains", "status", "status_reason",
                  "forced_start", "step", "latest_version", "metric_seq", "created_at", "started_at", "finished_at"]
        read_only_fields = ["status", "status_reason", "forced_start", "step", "latest_version", "metric_seq",
                            "started_at", "finished_at"]

    def get_fields(self) -> dict[str, Any]:
        fields = super().get_fields()
        request = self.context.get("request")
        if request is not None and request.user.is_authenticated:
            cast(Any, fields["base_model"]).queryset = BaseModel.objects.visible_to(request.user)
            cast(Any, fields["domains"]).child.fields["domain"].queryset = TaskDomain.objects.visible_to(request.user)
        return fields

    def create(self, validated_data: dict[str, Any]) -> Run:
        domains = [
            services.DomainWeight(d["domain"], d.get("weight", 1.0), d.get("priority", 0))
            for d in validated_data.pop("run_domains")
        ]
        return services.do_create_run(
            self.context["request"].user, name=validated_data["name"], base_model=validated_data["base_model"],
            domains=domains, engine=validated_data.get("engine", "torch"), spec=validated_data.get("spec"),
            description=validated_data.get("description", ""),
        )

    def update(self, instance: Run, validated_data: dict[str, Any]) -> Run:
        if instance.status != "draft":
            raise ValidationFailed(f"run {instance.pk} is {instance.status}: only a draft run can be edited")
        raise ValidationFailed("editing a run is not supported yet: create a new run")


class RunEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = RunEvent
        fields = ["id", "created_at", "kind", "level", "message", "data"]


class StartSerializer(serializers.Serializer):
    force = serializers.BooleanField(default=False, help_text="Start although a verifier is not calibrated")


class RunViewSet(mixins.CreateModelMixin, mixins.RetrieveModelMixin, mixins.ListModelMixin,
                 mixins.DestroyModelMixin, viewsets.GenericViewSet):
    queryset = Run.objects.all()
    serializer_class = RunSerializer
    filterset_fields = ["status", "engine", "base_model"]

    def get_queryset(self) -> QuerySet[Any]:
        return Run.objects.visible_to(self.request.user).prefetch_related("run_domains__domain")

    def _answer(self, run: Run) -> Response:
        run = self.get_queryset().get(pk=run.pk)
        return Response(RunSerializer(run, context=self.get_serializer_context()).data)

    @extend_schema(request=StartSerializer, responses={200: RunSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def start(self, request: Request, pk: str | None = None) -> Response:
        body = StartSerializer(data=request.data if isinstance(request.data, dict) else {})
        body.is_valid(raise_exception=True)
        return self._answer(services.do_start_run(self.get_object(), actor=request.user,
                                                  force=body.validated_data["force"]))

    @extend_schema(request=None, responses={200: RunSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def pause(self, request: Request, pk: str | None = None) -> Response:
        return self._answer(services.do_pause_run(self.get_object(), actor=request.user))

    @extend_schema(request=None, responses={200: RunSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: str | None = None) -> Response:
        return self._answer(services.do_resume_run(self.get_object(), actor=request.user))

    @extend_schema(request=None, responses={200: RunSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        return self._answer(services.do_cancel_run(self.get_object(), actor=request.user))

    @extend_schema(responses={200: RunEventSerializer(many=True)})
    @action(detail=True, methods=["get"], pagination_class=None, filterset_fields=[])
    def events(self, request: Request, pk: str | None = None) -> Response:
        """The run's event log, oldest first (``?after=<id>`` for newer ones)."""
        qs = self.get_object().events.all()
        if after := request.query_params.get("after"):
            qs = qs.filter(id__gt=int(after)) if after.isdigit() else qs
        return Response(RunEventSerializer(qs[:1000], many=True).data)

    @extend_schema(parameters=[OpenApiParameter("metric", str, enum=["reward", "pass_rate", "heldout_reward"]),
                               OpenApiParameter("columns", int, description="Buckets of steps (default 60)")],
                   responses={200: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["get"], pagination_class=None, filterset_fields=[])
    def heatmap(self, request: Request, pk: str | None = None) -> Response:
        """Domains x steps of one per-domain metric, averaged per bucket of steps, with each domain's gain and
        the most-improved and most-regressed domains named."""
        from webapp.runs.heatmap import METRICS, heatmap

        metric = request.query_params.get("metric", "reward")
        if metric not in METRICS:
            raise ValidationFailed(f"metric must be one of {', '.join(METRICS)}", details={"metric": ["unknown"]})
        columns = request.query_params.get("columns", "60")
        return Response(heatmap(self.get_object(), metric, max(2, min(400, int(columns) if columns.isdigit() else 60))))

    def perform_destroy(self, instance: Run) -> None:
        if instance.status in ("queued", "running", "pausing"):
            raise ValidationFailed(f"run {instance.pk} is {instance.status}: cancel it before deleting it")
        instance.delete()


class PolicyVersionSerializer(serializers.ModelSerializer):
    aliases = serializers.SerializerMethodField()

    class Meta:
        model = PolicyVersion
        fields = ["id", "run", "number", "parent", "step", "path", "metadata", "metrics", "aliases", "created_at"]

    def get_aliases(self, obj: PolicyVersion) -> list[str]:
        current: dict[int, list[str]] = self.context.get("current_aliases", {})
        return current.get(obj.pk, [])


class PromoteSerializer(serializers.Serializer):
    alias = serializers.ChoiceField(choices=[a for a in Alias.values if a != Alias.PREVIOUS], default=Alias.PRODUCTION)
    reason = serializers.CharField(required=False, allow_blank=True, default="")
    force = serializers.BooleanField(default=False, help_text="Move the alias even if the promotion gate refuses; "
                                                              "the overridden reasons are recorded")


class RollbackSerializer(serializers.Serializer):
    base_model = serializers.IntegerField()
    alias = serializers.ChoiceField(choices=Alias.values, default=Alias.PRODUCTION)
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class AliasEventSerializer(serializers.ModelSerializer):
    version_number = serializers.IntegerField(source="version.number", allow_null=True, read_only=True)
    run = serializers.IntegerField(source="version.run_id", allow_null=True, read_only=True)

    class Meta:
        model = AliasEvent
        fields = ["id", "base_model", "alias", "version", "version_number", "run", "previous_version", "action",
                  "reason", "created_at"]


class PolicyVersionViewSet(viewsets.ReadOnlyModelViewSet):
    queryset = PolicyVersion.objects.all()
    serializer_class = PolicyVersionSerializer
    filterset_fields = ["run", "number"]

    def get_queryset(self) -> QuerySet[Any]:
        qs = PolicyVersion.objects.select_related("run")
        return qs if self.request.user.is_staff else qs.filter(run__owner_id=self.request.user.pk)

    def get_serializer_context(self) -> dict[str, Any]:
        context = super().get_serializer_context()
        current: dict[int, list[str]] = {}
        # the newest event per (base model, alias) names the alias's current version
        seen: set[tuple[int, str]] = set()
        events = AliasEvent.objects.order_by("-id").values_list("base_model_id", "alias", "version_id")
        if not self.request.user.is_staff:
            events = events.filter(base_model__owner_id=self.request.user.pk)
        for base_model_id, alias, version_id in events[:10000]:
            if (base_model_id, alias) in seen:
                continue
            seen.add((base_model_id, alias))
            if version_id is not None:
                current.setdefault(version_id, []).append(alias)
        context["current_aliases"] = current
        return context

    @extend_schema(request=PromoteSerializer, responses={200: AliasEventSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def promote(self, request: Request, pk: str | None = None) -> Response:
        body = PromoteSerializer(data=request.data if isinstance(request.data, dict) else {})
        body.is_valid(raise_exception=True)
        event = services.do_promote_version(self.get_object(), body.validated_data["alias"], actor=request.user,
                                            reason=body.validated_data["reason"], force=body.validated_data["force"])
        return Response(AliasEventSerializer(event).data)

    @extend_schema(
        parameters=[
            OpenApiParameter("against", str, description="parent (default), base (version 0 of the run), an alias "
                                                          "of the base model (e.g. production), or a version id"),
            OpenApiParameter("suite", str, description="evaluation suite (default heldout)"),
        ],
        responses={200: OpenApiTypes.OBJECT},
    )
    @action(detail=True, methods=["get"])
    def compare(self, request: Request, pk: str | None = None) -> Response:
        """Per-domain scores against another version, paired on common tasks, with 95% intervals and
        regression flags; and what the promotion gate would say for each gated alias."""
        from webapp.runs.evaluation import check_gate, compare, gate_config

        version = self.get_object()
        against = request.query_params.get("against", "parent")
        baseline = resolve_baseline(version, against, self.get_queryset())
        suite = request.query_params.get("suite", "heldout")
        config = gate_config(version.run.base_model.promotion_gate)
        gate = {alias: check_gate(version, alias, services.current_alias(version.run.base_model, alias), config)
                for alias in config.aliases}
        return Response({**compare(version, baseline, suite).to_dict(), "against": against, "gate": gate})

    @extend_schema(request=inline_serializer("EvaluateRequest", {
        "samples": serializers.IntegerField(required=False, help_text="k for pass@k (1: greedy)")}),
        responses={202: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def evaluate(self, request: Request, pk: str | None = None) -> Response:
        """Evaluate the version on every domain's held-out tasks now (queue ``rollout``); poll evaluations/."""
        version = self.get_object()
        samples = request.data.get("samples", 1) if isinstance(request.data, dict) else 1
        if not isinstance(samples, int) or not 1 <= samples <= 64:
            raise ValidationFailed("samples must be an integer from 1 to 64", details={"samples": ["1..64"]})
        from webapp.runs.evaluation import do_request_evaluation

        return Response(do_request_evaluation(version, samples=samples, actor=request.user),
                        status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=inline_serializer("ExportRequest", {"kind": serializers.ChoiceField(["adapter", "merged"])}),
                   parameters=[OpenApiParameter("kind", str, enum=["adapter", "merged"], description="GET: which export")],
                   responses={202: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post", "get"])
    def export(self, request: Request, pk: str | None = None) -> Response | FileResponse:
        """POST ``{"kind": "adapter"|"merged"}`` builds the zip on the train queue; GET ``?kind=`` downloads it
        once done (409 with the status before). (``format`` is DRF's own query parameter, hence ``kind``.)"""
        from webapp.runs.exports import do_request_export, export_status

        version = self.get_object()
        if request.method == "POST":
            fmt = request.data.get("kind", "merged") if isinstance(request.data, dict) else "merged"
            return Response(do_request_export(version, str(fmt)), status=status.HTTP_202_ACCEPTED)
        fmt = request.query_params.get("kind", "merged")
        current = export_status(version, fmt)
        if not current or current.get("status") != "done" or not Path(current["path"]).exists():
            return Response({"detail": f"no finished {fmt} export of v{version.number}: POST to build one",
                             "export": current}, status=status.HTTP_409_CONFLICT)
        return FileResponse(open(current["path"], "rb"), as_attachment=True,
                            filename=Path(current["path"]).name, content_type="application/zip")

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["get"])
    def evaluations(self, request: Request, pk: str | None = None) -> Response:
        """The version's evaluations, newest first: per domain and suite, score, pass rate, invalid count."""
        rows = self.get_object().evaluations.select_related("domain").order_by("-id")[:200]
        return Response([{"id": e.id, "domain": e.domain_id, "domain_name": e.domain.name, "suite": e.suite,
                          "status": e.status, "n_tasks": e.n_tasks, "n_samples": e.n_samples, "score": e.score,
                          "pass_rate": e.pass_rate, "invalid_count": e.invalid_count,
                          "created_at": e.created_at} for e in rows])

    @extend_schema(request=RollbackSerializer, responses={200: AliasEventSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=False, methods=["post"])
    def rollback(self, request: Request) -> Response:
        body = RollbackSerializer(data=request.data if isinstance(request.data, dict) else {})
        body.is_valid(raise_exception=True)
        base_model = BaseModel.objects.visible_to(request.user).filter(pk=body.validated_data["base_model"]).first()
        if base_model is None:
            raise ValidationFailed("no such base model", details={"base_model": ["not found"]})
        event = services.do_rollback_alias(base_model, body.validated_data["alias"], actor=request.user,
                                           reason=body.validated_data["reason"])
        return Response(AliasEventSerializer(event).data)

    @extend_schema(parameters=[OpenApiParameter("base_model", int, required=True)],
                   responses={200: AliasEventSerializer(many=True)})
    @action(detail=False, methods=["get"], pagination_class=None, filterset_fields=[])
    def history(self, request: Request) -> Response:
        """The append-only alias history of a base model, newest first."""
        raw = request.query_params.get("base_model", "")
        if not raw.isdigit():
            raise ValidationFailed("base_model is required", details={"base_model": ["an integer id"]})
        qs = AliasEvent.objects.filter(base_model_id=int(raw)).select_related("version").order_by("-id")
        if not request.user.is_staff:
            qs = qs.filter(base_model__owner_id=request.user.pk)
        return Response(AliasEventSerializer(qs[:500], many=True).data)


class TrajectorySerializer(serializers.ModelSerializer):
    class Meta:
        model = Trajectory
        fields = ["id", "run", "task", "domain", "group_key", "sample_index", "version", "prompt", "completion",
                  "prompt_token_ids", "completion_token_ids", "behaviour_logprobs", "finish_reason", "verdict",
                  "reward", "verdict_reason", "verifier_details", "sandbox", "verify_latency_ms", "advantage",
                  "clipped", "trained_step", "is_eval", "turns", "stop_reason", "turn_count", "tool_errors",
                  "created_at"]


class TrajectoryListSerializer(TrajectorySerializer):
    class Meta(TrajectorySerializer.Meta):
        fields = ["id", "run", "task", "domain", "group_key", "sample_index", "version", "prompt", "completion",
                  "finish_reason", "verdict", "reward", "verdict_reason", "advantage", "clipped", "trained_step",
                  "stop_reason", "turn_count", "tool_errors", "created_at"]


class TrajectoryFilter(filters.FilterSet):
    reward_min = filters.NumberFilter(field_name="reward", lookup_expr="gte")
    reward_max = filters.NumberFilter(field_name="reward", lookup_expr="lte")
    turns_min = filters.NumberFilter(field_name="turn_count", lookup_expr="gte")
    has_tool_errors = filters.BooleanFilter(method="filter_tool_errors")

    class Meta:
        model = Trajectory
        fields = ["run", "domain", "version", "verdict", "group_key", "is_eval", "stop_reason"]

    def filter_tool_errors(self, queryset: QuerySet[Any], name: str, value: bool | None) -> QuerySet[Any]:
        if value is None:
            return queryset
        return queryset.filter(tool_errors__gt=0) if value else queryset.filter(tool_errors=0)


class TrajectoryViewSet(viewsets.ReadOnlyModelViewSet):
    queryset = Trajectory.objects.all()
    filterset_class = TrajectoryFilter
    pagination_class = IdCursorPagination

    def get_serializer_class(self) -> type[serializers.BaseSerializer[Any]]:
        return TrajectoryListSerializer if self.action == "list" else TrajectorySerializer

    def get_queryset(self) -> QuerySet[Any]:
        qs = Trajectory.objects.all()
        if self.action == "list":
            qs = qs.defer("prompt_token_ids", "completion_token_ids", "behaviour_logprobs", "verifier_details",
                          "sandbox")
        return qs if self.request.user.is_staff else qs.filter(run__owner_id=self.request.user.pk)


class MetricsQuery(serializers.Serializer):
    run = serializers.IntegerField()
    name = serializers.ListField(child=serializers.CharField(), required=False)
    domain = serializers.IntegerField(required=False)
    overall = serializers.BooleanField(required=False, default=False)
    since_seq = serializers.IntegerField(required=False, min_value=0)
    max_points = serializers.IntegerField(required=False, min_value=2, max_value=100_000)
    step_min = serializers.IntegerField(required=False)
    step_max = serializers.IntegerField(required=False)


class MetricsViewSet(viewsets.ViewSet):
    """Time series of a run: ``?run=ID&name=reward&name=loss&since_seq=N&max_points=1000``."""

    @extend_schema(
        parameters=[
            OpenApiParameter("run", int, required=True),
            OpenApiParameter("name", str, many=True),
            OpenApiParameter("domain", int),
            OpenApiParameter("overall", bool, description="Only the run-wide series (no per-domain ones)"),
            OpenApiParameter("since_seq", int, description="Only points with a larger sequence number (backfill)"),
            OpenApiParameter("max_points", int, description="Downsample each series to about this many points"),
            OpenApiParameter("step_min", int, description="Only steps ≥ this (a zoomed chart's window)"),
            OpenApiParameter("step_max", int, description="Only steps ≤ this"),
        ],
        responses={200: inline_serializer("MetricSeries", {
            "last_seq": serializers.IntegerField(),
            "series": serializers.ListField(child=serializers.DictField()),
        })},
    )
    def list(self, request: Request) -> Response:
        params = request.query_params
        query = MetricsQuery(data={**{k: params.get(k) for k in ("run", "domain", "overall", "since_seq", "max_points", "step_min",
                                                          "step_max")
                                      if params.get(k) not in (None, "")},
                                   "name": params.getlist("name")})
        query.is_valid(raise_exception=True)
        q = query.validated_data
        runs = Run.objects.visible_to(request.user)
        if not runs.filter(pk=q["run"]).exists():
            return Response({"detail": "No such run."}, status=status.HTTP_404_NOT_FOUND)
        return Response(metric_store.series(q["run"], names=q.get("name") or None, domain_id=q.get("domain"),
                                            overall=q.get("overall", False), since_seq=q.get("since_seq"), max_points=q.get("max_points"),
                                            step_min=q.get("step_min"), step_max=q.get("step_max")))


router.register("runs", RunViewSet)
router.register("policy-versions", PolicyVersionViewSet)
router.register("trajectories", TrajectoryViewSet)
router.register("metrics", MetricsViewSet, basename="metrics")
