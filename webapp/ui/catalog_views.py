"""Pages of the catalog: domains (with JSONL upload), verifiers (calibration, dry run), base models."""

from __future__ import annotations

import json
from typing import Any, cast

from django.contrib import messages
from django.db import IntegrityError, transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from webapp.catalog import services as catalog_services
from webapp.catalog.models import BaseModel, CalibrationCase, CalibrationStatus, Task, TaskDomain, Verifier
from webapp.catalog.runtimes import domain_runtimes
from webapp.catalog.task_import import ImportFailed
from webapp.common.errors import TemperError
from webapp.runs.models import Run
from webapp.ui.forms import DomainForm, UploadForm, VerifierForm
from workers.domains.kinds import KINDS, ShapeError, row_fields
from workers.domains.prompts import allowed_fields


def _owner(request: HttpRequest) -> Any:
    return request.user  # LoginRequiredMiddleware: always a real user here


def domains_list(request: HttpRequest) -> HttpResponse:
    domains = TaskDomain.objects.visible_to(request.user).select_related("verifier").order_by("name")
    if q := request.GET.get("q", "").strip():
        domains = domains.filter(name__icontains=q)
    return render(request, "ui/domains.html", {"domains": domains[:1000], "q": q})


def domain_new(request: HttpRequest) -> HttpResponse:
    form = DomainForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            domain = TaskDomain.objects.create(
                owner=_owner(request), name=data["name"], kind=data["kind"], description=data["description"],
                verifier=data["verifier"], heldout_fraction=data["heldout_fraction"],
                prompt_template=data["prompt_template"], system_prompt=data["system_prompt"],
                environment=data["environment"], environment_params=data["environment_params"],
            )
        except IntegrityError:
            form.add_error("name", "a domain with this name already exists")
        else:
            messages.success(request, f"Domain {domain.name!r} created: now upload its tasks.")
            return redirect("domain", domain_id=domain.pk)
    return render(request, "ui/domain_new.html", {"form": form})


def domain_detail(request: HttpRequest, domain_id: int) -> HttpResponse:
    """A domain: its settings (editable), what the model sees (a preview of the prompt template on real
    tasks), its newest tasks, and a JSONL upload that lists every bad row when it refuses a file."""
    domain = get_object_or_404(TaskDomain.objects.visible_to(request.user).select_related("verifier"), pk=domain_id)
    generator_errors = (_save_generator_params(request, domain)
                        if request.method == "POST" and "generator_params" in request.POST else None)
    if generator_errors == []:
        return redirect("domain", domain_id=domain.pk)
    editing = request.method == "POST" and "settings" in request.POST
    uploading = request.method == "POST" and not editing and generator_errors is None  # else a POST is an upload
    upload = UploadForm(request.POST, request.FILES or None) if uploading else UploadForm()
    settings_form = DomainForm(request.POST if editing else None, user=request.user, instance=domain)
    import_errors: dict[str, Any] | None = None
    if editing and settings_form.is_valid():
        data = settings_form.cleaned_data
        for name, value in data.items():
            setattr(domain, name, value)
        domain.save(update_fields=[*data, "updated_at"])
        messages.success(request, "Domain settings saved.")
        return redirect("domain", domain_id=domain.pk)
    if uploading and upload.is_valid():
        try:
            result = catalog_services.do_import_tasks(domain, upload.cleaned_data["file"])
        except ImportFailed as exc:
            import_errors = {"message": exc.message, **exc.result.to_dict()}
        else:
            messages.success(request, f"Imported {result.imported} tasks ({result.heldout} held out).")
            return redirect("domain", domain_id=domain.pk)
    spec = KINDS[domain.kind]
    tasks = list(domain.tasks.order_by("-id")[:20])
    previews = []
    shown: list[Task | None] = [*tasks[:3]] or [None]
    for task in shown:
        if task is None:  # no tasks yet: preview the kind's example row
            row = spec.examples[0]
            rest = {k: v for k, v in row.items() if k not in ("id", "prompt", "split", "metadata")}
            try:
                reference = spec.reference.model_validate(rest).stored()
            except (ShapeError, ValueError):
                reference = {}
            previews.append({"source": "example row", "text": domain.render_prompt(row["prompt"], reference)})
        else:
            task.domain = domain
            previews.append({"source": f"task {task.external_id or task.pk}", "text": task.model_prompt()})
    return render(request, "ui/domain.html", {
        "domain": domain, "upload": upload, "import_errors": import_errors, "settings_form": settings_form,
        "tasks": tasks, "row_fields": row_fields(domain.kind).split(", "),
        "example": json.dumps(spec.examples[0]) if spec.examples else "",
        "example_files": ("addition", "multiplication") if domain.kind == "answer" else (),
        "kind_example_file": f"examples/{domain.kind}.jsonl",
        "template_fields": [*allowed_fields(domain.kind), "metadata.<key>"],
        "default_template": spec.default_template, "previews": previews,
        "verifier_kinds": spec.verifiers, "runtimes": domain_runtimes(domain),
        "runs": Run.objects.visible_to(request.user).filter(domains=domain).order_by("-id")[:20],
        "generator": _generator_view(domain, request.POST.get("generator_params") if generator_errors else None,
                                     generator_errors or []),
    })


def _generator_view(domain: TaskDomain, text: str | None, errors: list[str]) -> dict[str, Any] | None:
    """A generator domain's parameters as the page shows them: the values, what each means, the errors."""
    if not domain.generator:
        return None
    from workers.domains.generators import GeneratorError, params_schema

    try:
        schema = params_schema(domain.generator)
    except GeneratorError as exc:  # e.g. the reasoning-gym extra is not installed in this process
        schema = {"properties": {}}
        errors = [*errors, str(exc)]
    fields = [{"name": name, "value": domain.generator_params.get(name), "default": spec.get("default"),
               "help": spec.get("description", "")} for name, spec in schema.get("properties", {}).items()]
    return {"name": domain.generator, "seed": domain.generator_seed, "next": domain.generator_next,
            "fields": fields, "errors": errors,
            "json": text if text is not None else json.dumps(domain.generator_params, indent=1, sort_keys=True)}


def _save_generator_params(request: HttpRequest, domain: TaskDomain) -> list[str]:
    """Check and store a generator domain's parameters; the problems, or [] when they were saved."""
    from webapp.catalog.generated import check_generator_domain

    if not domain.generator:
        return ["this domain has no generator"]
    try:
        value = json.loads(request.POST.get("generator_params") or "{}")
    except json.JSONDecodeError as exc:
        return [f"not JSON: {exc.msg} at column {exc.colno}"]
    model, problems = check_generator_domain(domain.generator, value if isinstance(value, dict) else None)
    if problems:
        return [m for ms in problems.values() for m in ms]
    domain.generator_params = model.model_dump(mode="json")
    domain.save(update_fields=["generator_params", "updated_at"])
    messages.success(request, "Generator parameters saved: new train tasks use them; the held-out set stays.")
    return []


def domain_packs(request: HttpRequest) -> HttpResponse:
    """Create a pack of generator domains (a built-in one, or a list of generators), each calibrated."""
    from webapp.catalog.packs import PACKS, PackItem, do_create_pack
    from workers.domains import reasoning_gym

    result, error = None, ""
    if request.method == "POST":
        pack = request.POST.get("pack", "")
        lines = [line.strip() for line in request.POST.get("generators", "").splitlines() if line.strip()]
        try:
            heldout = int(request.POST.get("heldout_size") or 100)
            items = None
            if lines:
                items = [PackItem(line.split()[0], json.loads(line.split(None, 1)[1]) if " " in line else {})
                         for line in lines]
            result = do_create_pack(_owner(request), pack, items, prefix=request.POST.get("prefix") or None,
                                    heldout_size=heldout, seed=int(request.POST.get("seed") or 0),
                                    tags=[t for t in request.POST.get("tags", "").replace(",", " ").split() if t])
        except TemperError as exc:
            error = exc.message
        except (ValueError, TypeError) as exc:
            error = f"the form is invalid: {exc}"
    return render(request, "ui/domain_packs.html", {
        "packs": [(n, d) for n, (d, _) in PACKS.items()], "result": result, "error": error,
        "reasoning_gym": reasoning_gym.available(), "posted": request.POST})


def example_tasks(request: HttpRequest, name: str) -> HttpResponse:
    """The demo domains' tasks as JSONL (train and held-out rows, split marked), or a kind's example rows,
    for a first upload."""
    from workers.domains.kinds import example_jsonl
    from workers.policy.demo_tasks import DOMAINS, _split_pool

    if name in KINDS:  # a kind's example rows (the same text as assets/examples/<kind>.jsonl)
        response = HttpResponse(example_jsonl(name), content_type="application/x-ndjson")
        response["Content-Disposition"] = f'attachment; filename="{name}.jsonl"'
        return response
    if name not in DOMAINS:
        raise Http404(f"no example domain {name!r}; there are {', '.join(DOMAINS)}")
    rows = [json.dumps({"id": f"{name[:3]}-{split}-{i}", "prompt": p, "answer": a, "split": split})
            for split in ("train", "heldout") for i, (p, a) in enumerate(_split_pool(name, cast(Any, split)))]
    response = HttpResponse("\n".join(rows) + "\n", content_type="application/x-ndjson")
    response["Content-Disposition"] = f'attachment; filename="{name}.jsonl"'
    return response


def verifiers_list(request: HttpRequest) -> HttpResponse:
    verifiers = Verifier.objects.visible_to(request.user).order_by("name")
    return render(request, "ui/verifiers.html", {"verifiers": verifiers[:1000]})


def verifier_new(request: HttpRequest) -> HttpResponse:
    from workers.verifiers.base import VerifierConfigError, build_verifier

    form = VerifierForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            build_verifier(data["kind"], data["config"])
        except VerifierConfigError as exc:
            form.add_error("config", str(exc))
        else:
            if Verifier.objects.filter(owner=_owner(request), name=data["name"]).exists():
                form.add_error("name", f"you already have a verifier named {data['name']!r}")
            else:
                with transaction.atomic():
                    verifier = Verifier.objects.create(owner=_owner(request), name=data["name"], kind=data["kind"],
                                                       config=data["config"], description=data["description"])
                    CalibrationCase.objects.bulk_create(
                        [CalibrationCase(verifier=verifier, **case) for case in data["calibration_cases"]])
                if data["calibration_cases"]:
                    catalog_services.do_request_calibration(verifier, request.user)
                    messages.success(request, f"Verifier created with {len(data['calibration_cases'])} calibration "
                                              "cases; calibration is running on the verify workers.")
                return redirect("verifier", verifier_id=verifier.pk)
    return render(request, "ui/verifier_new.html", {"form": form})


def verifier_detail(request: HttpRequest, verifier_id: int) -> HttpResponse:
    """Configuration, calibration cases and the latest reports (rates with intervals, latency), a dry-run box."""
    verifier = get_object_or_404(Verifier.objects.visible_to(request.user), pk=verifier_id)
    reports = list(verifier.calibration_reports.order_by("-id")[:5])
    latest = reports[0] if reports else None
    cases = list(verifier.calibration_cases.all()[:200])
    example = "\n".join(json.dumps({"prompt": c.prompt, "completion": c.completion, "reference": c.reference})
                        for c in cases[:3])
    return render(request, "ui/verifier.html", {
        "verifier": verifier, "reward_code": (verifier.config or {}).get("code") if verifier.kind == "python_reward" else None,
        "config_json": json.dumps({k: v for k, v in (verifier.config or {}).items()
                                   if not (k == "code" and verifier.kind == "python_reward")}, indent=2, sort_keys=True),
        "cases": cases, "reports": reports, "latest": latest, "dry_run_example": example,
        "summary": (latest.summary if latest else {}) or {},
        "domains": verifier.domains.all()[:50],
        "calibrated": verifier.calibration_status == CalibrationStatus.PASSED,
    })


@require_POST
def verifier_calibrate(request: HttpRequest, verifier_id: int) -> HttpResponse:
    verifier = get_object_or_404(Verifier.objects.visible_to(request.user), pk=verifier_id)
    try:
        catalog_services.do_request_calibration(verifier, request.user)
        messages.success(request, "Calibration queued on the verify workers; this page shows the report when done.")
    except TemperError as exc:
        messages.error(request, exc.message)
    return redirect("verifier", verifier_id=verifier.pk)


def base_models(request: HttpRequest) -> HttpResponse:
    models = BaseModel.objects.visible_to(request.user).order_by("name")
    return render(request, "ui/base_models.html", {"base_models": models})
