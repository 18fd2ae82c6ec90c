from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin

from webapp.catalog.models import BaseModel, CalibrationCase, CalibrationReport, Task, TaskDomain, Verifier
from webapp.catalog.services import check_domain, check_verifier


@admin.register(BaseModel)
class BaseModelAdmin(admin.ModelAdmin):
    list_display = ["name", "path", "parameters", "owner", "created_at"]
    search_fields = ["name", "path", "description"]
    list_filter = ["owner"]


class CalibrationCaseInline(admin.TabularInline):
    model = CalibrationCase
    extra = 0
    fields = ["label", "expected", "completion", "reference", "note"]


class CalibrationReportInline(admin.TabularInline):
    model = CalibrationReport
    extra = 0
    fields = ("status", "passed", "created_at", "finished_at", "error")
    readonly_fields = ("status", "passed", "created_at", "finished_at", "error")
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


class VerifierAdminForm(forms.ModelForm):
    """The kind's config validated by the kind (a python_reward's code: compiled, ``score`` defined, dry-run
    on the stored calibration cases), as the API and the pages do."""

    class Meta:
        model = Verifier
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        from workers.verifiers.base import VerifierConfigError, build_verifier

        data = super().clean() or {}
        kind, config = data.get("kind", self.instance.kind), data.get("config") or {}
        try:
            build_verifier(kind, config)
        except VerifierConfigError as exc:
            self.add_error("config" if "config" in self.fields else None, exc.problems)
            return data
        problems = check_verifier(kind, None, self.instance if self.instance.pk else None, config=config)
        for name, messages in problems.items():
            for message in messages:
                self.add_error(name if name in self.fields else None, message)
        return data


@admin.register(Verifier)
class VerifierAdmin(admin.ModelAdmin):
    form = VerifierAdminForm
    list_display = ["name", "kind", "calibration_status", "owner", "updated_at"]
    list_filter = ["kind", "calibration_status"]
    search_fields = ["name", "description"]
    inlines = [CalibrationCaseInline, CalibrationReportInline]
    actions = ["calibrate"]

    @admin.action(description="Calibrate the selected verifiers (verify queue)")
    def calibrate(self, request, queryset):  # type: ignore[no-untyped-def]
        from webapp.catalog.services import do_request_calibration
        from webapp.common.errors import TemperError

        for verifier in queryset:
            try:
                do_request_calibration(verifier, request.user)
                self.message_user(request, f"{verifier.name}: calibration queued")
            except TemperError as exc:
                self.message_user(request, f"{verifier.name}: {exc.message}", level="error")


@admin.register(CalibrationReport)
class CalibrationReportAdmin(admin.ModelAdmin):
    list_display = ["id", "verifier", "status", "passed", "created_at", "finished_at"]
    list_filter = ["status", "passed"]
    list_select_related = ["verifier"]
    readonly_fields = ["verifier", "status", "passed", "summary", "error", "finished_at"]


class TaskDomainAdminForm(forms.ModelForm):
    class Meta:
        model = TaskDomain
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        for name, messages in check_domain(kind=data.get("kind", self.instance.kind), verifier=data.get("verifier"),
                                           prompt_template=data.get("prompt_template", ""),
                                           environment=data.get("environment", "single_turn"),
                                           environment_params=data.get("environment_params"),
                                           domain=self.instance if self.instance.pk else None).items():
            for message in messages:
                self.add_error(name if name in self.fields else None, message)
        return data


@admin.register(TaskDomain)
class TaskDomainAdmin(admin.ModelAdmin):
    form = TaskDomainAdminForm
    list_display = ["name", "kind", "verifier", "task_count", "heldout_count", "owner", "updated_at"]
    list_filter = ["kind"]
    list_select_related = ["verifier", "owner"]
    search_fields = ["name", "description"]
    readonly_fields = ["task_count", "heldout_count"]


@admin.register(Task)
class TaskAdmin(admin.ModelAdmin):
    list_display = ["id", "domain", "external_id", "split", "short_prompt", "created_at"]
    list_filter = ["split"]
    list_select_related = ["domain"]
    search_fields = ["external_id"]
    raw_id_fields = ["domain"]
    show_full_result_count = False

    @admin.display(description="prompt")
    def short_prompt(self, obj: Task) -> str:
        return obj.prompt[:80]
