from __future__ import annotations

from django.contrib import admin

from webapp.common.admin_utils import NoCountPaginator
from webapp.common.errors import TemperError
from webapp.runs import services
from webapp.runs.models import (
    AliasEvent,
    Evaluation,
    MetricPoint,
    PolicyVersion,
    Run,
    RunDomain,
    RunEvent,
    Trajectory,
)


class RunDomainInline(admin.TabularInline):
    model = RunDomain
    extra = 0
    raw_id_fields = ["domain"]


class RunEventInline(admin.TabularInline):
    model = RunEvent
    extra = 0
    fields = ("created_at", "level", "kind", "message")
    readonly_fields = ("created_at", "level", "kind", "message")
    can_delete = False
    ordering = ["-id"]

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


def _lifecycle_action(name: str, fn, description: str):  # type: ignore[no-untyped-def]
    def action(modeladmin, request, queryset):  # type: ignore[no-untyped-def]
        for run in queryset:
            try:
                fn(run, actor=request.user)
                modeladmin.message_user(request, f"run {run.pk}: {name} done")
            except TemperError as exc:
                modeladmin.message_user(request, f"run {run.pk}: {exc.message}", level="error")

    action.__name__ = f"{name}_runs"
    return admin.action(description=description)(action)


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "status", "base_model", "engine", "step", "latest_version", "owner", "created_at"]
    list_filter = ["status", "engine", "forced_start"]
    list_select_related = ["base_model", "owner"]
    search_fields = ["name", "description"]
    readonly_fields = ["status", "status_reason", "forced_start", "step", "latest_version", "metric_seq",
                       "started_at", "finished_at", "state", "trained_groups"]
    inlines = [RunDomainInline, RunEventInline]
    actions = [
        _lifecycle_action("start", services.do_start_run, "Start the selected draft runs"),
        _lifecycle_action("pause", services.do_pause_run, "Pause the selected runs"),
        _lifecycle_action("resume", services.do_resume_run, "Resume the selected runs"),
        _lifecycle_action("cancel", services.do_cancel_run, "Cancel the selected runs"),
    ]

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        """A change writes only the fields its form changed: the loop writes the run's step, state and trained
        count meanwhile, and a whole-row save would put back what they were when the request read the row."""
        if not change:
            super().save_model(request, obj, form, change)
        elif form.changed_data:
            obj.save(update_fields=form.changed_data)


@admin.register(RunEvent)
class RunEventAdmin(admin.ModelAdmin):
    list_display = ["id", "run", "created_at", "level", "kind", "message"]
    list_filter = ["level", "kind"]
    raw_id_fields = ["run", "actor"]
    show_full_result_count = False


@admin.register(PolicyVersion)
class PolicyVersionAdmin(admin.ModelAdmin):
    list_display = ["id", "run", "number", "step", "parent", "created_at"]
    list_select_related = ["run", "parent"]
    raw_id_fields = ["run", "parent"]
    search_fields = ["run__name"]


@admin.register(AliasEvent)
class AliasEventAdmin(admin.ModelAdmin):
    """Append-only: rows are added by promote/rollback, never edited here."""

    list_display = ["id", "base_model", "alias", "version", "previous_version", "action", "actor", "created_at"]
    list_filter = ["alias", "action"]
    list_select_related = ["base_model", "version", "previous_version", "actor"]

    def has_change_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False

    def has_delete_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


@admin.register(Trajectory)
class TrajectoryAdmin(admin.ModelAdmin):
    list_display = ["id", "run", "domain", "version", "verdict", "reward", "finish_reason", "created_at"]
    list_filter = ["verdict", "finish_reason", "is_eval"]
    raw_id_fields = ["run", "task", "domain"]
    paginator = NoCountPaginator
    show_full_result_count = False
    search_fields = ["=group_key"]


@admin.register(MetricPoint)
class MetricPointAdmin(admin.ModelAdmin):
    list_display = ["id", "run", "name", "domain", "step", "value", "seq", "time"]
    raw_id_fields = ["run", "domain"]
    paginator = NoCountPaginator
    show_full_result_count = False
    search_fields = ["=name"]


@admin.register(Evaluation)
class EvaluationAdmin(admin.ModelAdmin):
    list_display = ["id", "version", "domain", "suite", "status", "score", "pass_rate", "n_tasks", "created_at"]
    list_filter = ["status", "suite"]
    list_select_related = ["version", "domain"]
    raw_id_fields = ["version", "domain"]
