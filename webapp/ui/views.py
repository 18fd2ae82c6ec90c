"""Server-rendered pages: runs (list, new, live page, comparison), trajectories, and the catalog.

Every page is a thin reader over the models and the same services the API calls; state changes go
through those services (never a direct ``save()``), so a page and an API call behave alike. Charts get
their data from ``/api/v1/metrics/`` and the run's websocket (``static/temper/charts.js``).
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.core.paginator import Paginator
from django.db.models import Count, Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from webapp.catalog.models import BaseModel, TaskDomain
from webapp.common.errors import TemperError, ValidationFailed
from webapp.runs import evaluation, services
from webapp.runs import metrics as metric_store
from webapp.runs.loop.training import loss_mask
from webapp.runs.models import (
    Alias,
    AliasEvent,
    Evaluation,
    MetricPoint,
    PolicyVersion,
    PromptGroup,
    Run,
    RunStatus,
    Trajectory,
    VerdictChoice,
    WorkerHeartbeat,
)
from webapp.ui.charts import CHARTS, COMPARE_METRICS, sparkline_svg
from webapp.ui.forms import RunForm
from workers.environments.base import STOP_REASONS

RUNS_PER_PAGE = 50
TRAJECTORIES_PER_PAGE = 50
VERSIONS_PER_PAGE = 20
MAX_DOMAIN_LINES = 12
DOMAINS_PER_PAGE = 50
DOMAIN_SORTS = {"domain": ("domain", False), "score": ("score", True), "pass_rate": ("pass_rate", True),
                "delta": ("delta", True), "-delta": ("delta", False)}
CONTROLS = (("start", "Start"), ("pause", "Pause"), ("resume", "Resume"), ("cancel", "Cancel"))
SORTS = {"newest": "-id", "oldest": "id", "name": "name", "step": "-step", "status": "status"}


def _visible_runs(request: HttpRequest) -> QuerySet[Run]:
    return Run.objects.visible_to(request.user)


def _run_or_404(request: HttpRequest, run_id: int) -> Run:
    return get_object_or_404(_visible_runs(request).select_related("base_model"), pk=run_id)


# --- runs -------------------------------------------------------------------------------------


def runs_list(request: HttpRequest) -> HttpResponse:
    """Runs with status, step, a reward sparkline and throughput; filter by status, search by name, sort."""
    qs = _visible_runs(request).select_related("base_model")
    status = request.GET.get("status", "")
    if status in RunStatus.values:
        qs = qs.filter(status=status)
    if q := request.GET.get("q", "").strip():
        qs = qs.filter(Q(name__icontains=q) | Q(description__icontains=q) | Q(pk=int(q)) if q.isdigit()
                       else Q(name__icontains=q) | Q(description__icontains=q))
    sort = request.GET.get("sort", "newest")
    qs = qs.order_by(SORTS.get(sort, "-id"), "-id")
    page = Paginator(qs, RUNS_PER_PAGE).get_page(request.GET.get("page"))
    runs = list(page.object_list)
    rows = [{"run": run, **_run_summary(run)} for run in runs]
    return render(request, "ui/runs_list.html", {
        "page": page, "rows": rows, "status": status, "q": q, "sort": sort,
        "statuses": RunStatus.values, "sorts": list(SORTS),
    })


def _run_summary(run: Run) -> dict[str, Any]:
    """The list's per-run figures: the last 40 points of overall reward and the latest throughput.

    Each is one probe of the (run, name, domain, step) index, so a page costs ~100 small queries at most,
    whatever the number of runs or points.
    """
    if run.metric_seq == 0:
        return {"spark": "", "reward": None, "throughput": None}
    rewards = list(
        MetricPoint.objects.filter(run=run, name="reward_mean", domain__isnull=True)
        .order_by("-step").values_list("value", flat=True)[:40]
    )[::-1]
    throughput = (
        MetricPoint.objects.filter(run=run, name="trajectories_per_s", domain__isnull=True)
        .order_by("-step").values_list("value", flat=True).first()
    )
    return {"spark": sparkline_svg(rewards), "reward": rewards[-1] if rewards else None, "throughput": throughput}


def run_new(request: HttpRequest) -> HttpResponse:
    """Create (and by default start) a run: base model, weighted domains, and every RunSpec setting."""
    domains = list(TaskDomain.objects.visible_to(request.user).select_related("verifier").order_by("name"))
    chosen: dict[int, dict[str, str]] = {}
    domain_error = ""
    form = RunForm(request.POST or None, user=request.user)
    if request.method == "POST":
        for d in domains:
            if request.POST.get(f"domain_{d.pk}"):
                chosen[d.pk] = {"weight": request.POST.get(f"weight_{d.pk}", "1") or "1",
                                "priority": request.POST.get(f"priority_{d.pk}", "0") or "0"}
        if not chosen:
            domain_error = "a run needs at least one domain: tick one or more below"
        if form.is_valid():
            try:
                services.check_run_spec(form.spec())  # every spec error at once, beside the domains' errors
            except ValidationFailed as exc:
                form.add_spec_errors({k: v for k, v in (exc.details or {}).items() if isinstance(v, list)})
        if form.is_valid() and not domain_error:
            try:
                weights = _domain_weights(domains, chosen)
                run = services.do_create_run(
                    request.user, name=form.cleaned_data["name"], base_model=form.cleaned_data["base_model"],
                    domains=weights, engine=form.cleaned_data["engine"], spec=form.spec(),
                    description=form.cleaned_data["description"],
                )
            except ValidationFailed as exc:
                details = dict(exc.details or {})
                domain_error = "; ".join(details.pop("domains", [])) or ("" if details else exc.message)
                form.add_spec_errors({k: v for k, v in details.items() if isinstance(v, list)})
            else:
                if form.cleaned_data["start_now"]:
                    try:
                        services.do_start_run(run, actor=request.user, force=form.cleaned_data["force"])
                    except TemperError as exc:
                        messages.error(request, f"The run was created but not started: {exc.message}")
                return redirect("run", run_id=run.pk)
    rows = [{"domain": d, "checked": d.pk in chosen, "weight": chosen.get(d.pk, {}).get("weight", "1"),
             "priority": chosen.get(d.pk, {}).get("priority", "0")} for d in domains]
    packs = sorted({d.pack for d in domains if d.pack})
    tags = sorted({t for d in domains for t in (d.tags or []) if isinstance(t, str)})
    return render(request, "ui/run_new.html", {"form": form, "rows": rows, "domain_error": domain_error,
                                               "packs": packs, "tags": tags})


def _domain_weights(domains: list[TaskDomain], chosen: dict[int, dict[str, str]]) -> list[services.DomainWeight]:
    by_id = {d.pk: d for d in domains}
    out, problems = [], []
    for pk, raw in chosen.items():
        try:
            out.append(services.DomainWeight(by_id[pk], float(raw["weight"]), int(raw["priority"])))
        except ValueError:
            problems.append(f"domain {by_id[pk].name!r}: weight must be a number and priority an integer")
    if problems:
        raise ValidationFailed("the domains are invalid", details={"domains": problems})
    return out


@never_cache  # the back button must not show a stale status or event log
def run_detail(request: HttpRequest, run_id: int) -> HttpResponse:
    run = _run_or_404(request, run_id)
    run_domains = list(run.run_domains.select_related("domain__verifier"))
    # the versions list pages (a long run has thousands); newest first. With the run's key among the fields:
    # the related manager hands each row its run by that key, and a deferred key was read a query a row
    versions_page = Paginator(run.versions.order_by("-number").only("id", "run_id", "number", "step", "created_at"),
                              VERSIONS_PER_PAGE).get_page(request.GET.get("versions_page"))
    versions = list(versions_page)
    aliases = _current_aliases(run.base_model)
    last = run.versions.filter(number__gt=0).order_by("-number").values_list("metrics", flat=True).first() or {}
    trained_on = " ".join(str(last[k]) for k in ("device", "dtype") if last.get(k))
    gpu_workers = [(w.name, w.device) for w in WorkerHeartbeat.objects.filter(
        stopped_at__isnull=True, queues__contains="rollout").exclude(device="").only("name", "device")[:8]]
    groups = _group_counts(run)
    # a run without an environment domain has no episodes: their charts would only be empty boxes
    episodic = any(rd.domain.environment != "single_turn" for rd in run_domains)
    names = metric_store.series_names(run.pk) if run.metric_seq else []
    # the sandbox chart once a sandboxed verdict was reported (a run of text verifiers never has one)
    sandboxed = any(n.startswith("sandbox_") for n in names)
    page_config = {
        "run": run.pk,
        "status": run.status,
        "allowed": {action: sorted(services.TRANSITIONS[action][0]) for action, _ in CONTROLS},
        "charts": [c for c in CHARTS if (episodic or not c.get("episodes")) and (sandboxed or not c.get("sandbox"))],
        "domains": {str(rd.domain_id): rd.domain.name for rd in run_domains},
        # more domains than a line chart has colours: per-domain series are drawn as the heatmap's rows
        "manyDomains": len(run_domains) > MAX_DOMAIN_LINES,
        "names": names,
        "apiRun": f"/api/v1/runs/{run.pk}/",
    }
    return render(request, "ui/run_detail.html", {
        "run": run, "run_domains": run_domains, "versions": [(v, aliases.get(v.pk, [])) for v in versions],
        "versions_page": versions_page, "trained_on": trained_on, "gpu_workers": gpu_workers,
        "controls": [(action, label, run.status in services.TRANSITIONS[action][0]) for action, label in CONTROLS],
        "events": list(run.events.order_by("-id")[:200])[::-1], "groups": groups,
        "spec_json": json.dumps(run.spec, indent=2, sort_keys=True), "page_config": page_config,
        "episodic": episodic,
    })


def _current_aliases(base_model: BaseModel) -> dict[int, list[str]]:
    """version id → the aliases that point at it now (the newest history row of each alias wins)."""
    out: dict[int, list[str]] = {}
    for alias in Alias.values:
        version = services.current_alias(base_model, alias)
        if version is not None:
            out.setdefault(version.pk, []).append(alias)
    return out


def _group_counts(run: Run) -> dict[str, int]:
    """A run's groups by status, in the pipeline's order: the trained ones from the run's own count
    (``Run.trained_groups``, kept by each step's record), the others from the group table's (run, status)
    index. Counting the trained rows too took 35 ms at 200,000 groups on SQLite (``bench/longrun.py``)."""
    G = PromptGroup.Status
    counts = dict(run.groups.filter(status__in=[s for s in G.values if s != G.TRAINED]).values_list("status")
                  .annotate(n=Count("id")).order_by())
    counts[G.TRAINED] = sum(run.trained_groups.values())
    return {status: counts[status] for status in G.values if counts.get(status)}


@require_POST
def run_action(request: HttpRequest, run_id: str, action: str) -> HttpResponse:
    """start / pause / resume / cancel from a plain form (the page's buttons work without JavaScript)."""
    run = _run_or_404(request, int(run_id))
    actions = {
        "start": lambda: services.do_start_run(run, actor=request.user, force=bool(request.POST.get("force"))),
        "pause": lambda: services.do_pause_run(run, actor=request.user),
        "resume": lambda: services.do_resume_run(run, actor=request.user),
        "cancel": lambda: services.do_cancel_run(run, actor=request.user),
    }
    if action not in actions:
        raise Http404(f"no action {action!r}")
    try:
        actions[action]()
    except TemperError as exc:
        messages.error(request, exc.message)
    return redirect("run", run_id=run.pk)


def compare(request: HttpRequest) -> HttpResponse:
    """Overlay runs on the same charts: pick runs (any number; 20+ stay readable) and metrics."""
    visible = _visible_runs(request).select_related("base_model")
    ids = [int(x) for x in request.GET.getlist("run") if x.isdigit()]
    selected = list(visible.filter(pk__in=ids).order_by("id")) if ids else []
    candidates = list(visible.order_by("-id")[:200])
    metrics = [m for m in request.GET.getlist("metric") if m] or list(COMPARE_METRICS[:4])
    return render(request, "ui/compare.html", {
        "selected": selected, "candidates": candidates, "metrics": metrics, "all_metrics": COMPARE_METRICS,
        "page_config": {"runs": [{"id": r.pk, "name": r.name} for r in selected], "metrics": metrics},
        "evaluations": [_run_evaluation(r) for r in selected],
    })


def _run_evaluation(run: Run) -> dict[str, Any]:
    """A run's newest evaluated version against its base model (v0), per domain and per layer (capability
    items, end-to-end episodes), as the version page shows it; the suite is the gate's."""
    suite = evaluation.gate_config(run.base_model.promotion_gate).suite
    version = (PolicyVersion.objects.filter(run=run, evaluations__suite=suite,
                                            evaluations__status=Evaluation.Status.DONE)
               .order_by("-number").first())
    if version is None:
        return {"run": run, "version": None, "baseline": None, "comparison": None, "layers": {}}
    baseline = evaluation.base_version(version) if version.number > 0 else None
    comparison = evaluation.compare(version, baseline, suite)
    return {"run": run, "version": version, "baseline": baseline, "comparison": comparison,
            "layers": comparison.layers()}


# --- trajectories -----------------------------------------------------------------------------


def trajectories(request: HttpRequest, run_id: int) -> HttpResponse:
    """A run's trajectories, newest first, keyset-paginated by id, filtered by domain, verdict, reward, version,
    and for episodes by stop reason, tool errors and turn count."""
    run = _run_or_404(request, run_id)
    qs = Trajectory.objects.filter(run=run).defer(
        "prompt_token_ids", "completion_token_ids", "behaviour_logprobs", "verifier_details", "sandbox"
    ).select_related("domain")
    f = request.GET
    if (domain := f.get("domain", "")).isdigit():
        qs = qs.filter(domain_id=int(domain))
    if (verdict := f.get("verdict", "")) in VerdictChoice.values:
        qs = qs.filter(verdict=verdict)
    if (version := f.get("version", "")).isdigit():
        qs = qs.filter(version=int(version))
    if (stop := f.get("stop", "")) in STOP_REASONS:
        qs = qs.filter(stop_reason=stop)
    if f.get("tool_errors") == "1":
        qs = qs.filter(tool_errors__gt=0)
    if (turns_min := f.get("turns_min", "")).isdigit():
        qs = qs.filter(turn_count__gte=int(turns_min))
    for key, lookup in (("reward_min", "reward__gte"), ("reward_max", "reward__lte")):
        try:
            if f.get(key, "") != "":
                qs = qs.filter(**{lookup: float(f[key])})
        except ValueError:
            messages.error(request, f"{key.replace('_', ' ')} must be a number")
    if (before := f.get("before", "")).isdigit():
        qs = qs.filter(id__lt=int(before))
    rows = list(qs.order_by("-id")[: TRAJECTORIES_PER_PAGE + 1])
    more = len(rows) > TRAJECTORIES_PER_PAGE
    rows = rows[:TRAJECTORIES_PER_PAGE]
    query = f.copy()
    query.pop("before", None)
    return render(request, "ui/trajectories.html", {
        "run": run, "rows": rows, "more": more, "next_before": rows[-1].pk if rows else None,
        "filters": f, "base_query": query.urlencode(),
        "domains": list(run.run_domains.select_related("domain")), "verdicts": VerdictChoice.values,
        "stop_reasons": STOP_REASONS, "episodic": any(rd.domain.environment != "single_turn"
                                                      for rd in run.run_domains.select_related("domain")),
    })


def group_detail(request: HttpRequest, run_id: int, key: str) -> HttpResponse:
    """A prompt's group side by side: every sample, its verdict, reward and advantage; for an episode, its turns
    (the model's and the environment's told apart) and why it stopped."""
    run = _run_or_404(request, run_id)
    samples = list(Trajectory.objects.filter(run=run, group_key=key).defer(
        "prompt_token_ids", "completion_token_ids", "behaviour_logprobs").order_by("sample_index"))
    if not samples:
        raise Http404("no such group")
    group = PromptGroup.objects.filter(run=run, key=key).first()
    return render(request, "ui/group.html", {"run": run, "samples": samples, "group": group, "key": key,
                                             "prompt": samples[0].prompt,
                                             "episodic": any(t.turns for t in samples)})


def trajectory_detail(request: HttpRequest, trajectory_id: int) -> HttpResponse:
    trajectory = get_object_or_404(
        Trajectory.objects.select_related("run", "domain", "task"), pk=trajectory_id,
        run__in=_visible_runs(request),
    )
    siblings = list(
        Trajectory.objects.filter(run=trajectory.run, group_key=trajectory.group_key)
        .exclude(pk=trajectory.pk).order_by("sample_index").values("id", "sample_index", "verdict", "reward")
    )
    mask = loss_mask(trajectory.turns, len(trajectory.completion_token_ids)) or []  # what the trainer used
    return render(request, "ui/trajectory.html", {
        "t": trajectory, "run": trajectory.run, "siblings": siblings,
        "mask": "".join("█" if m else "·" for m in mask), "model_tokens": sum(mask),
        "env_tokens": len(mask) - sum(mask),
        "versions": sorted({t["version"] for t in trajectory.turns or [] if t.get("version") is not None}),
        "details_json": json.dumps(trajectory.verifier_details, indent=2, sort_keys=True, default=str),
        "sandbox": trajectory.sandbox or {},
        "reference_json": json.dumps(trajectory.task.reference if trajectory.task else None, indent=2, default=str),
    })


def _next(request: HttpRequest) -> str:
    target = request.POST.get("next", "")
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        return target
    return reverse("versions")


# --- policy versions --------------------------------------------------------------------------


def versions(request: HttpRequest) -> HttpResponse:
    """Policy versions per base model, with their aliases, the alias history, promote and roll back."""
    base_models = list(BaseModel.objects.visible_to(request.user).order_by("name"))
    sections = []
    for bm in base_models:
        history = list(AliasEvent.objects.filter(base_model=bm).select_related("version__run", "previous_version", "actor").order_by("-id")[:100])
        current = {alias: services.current_alias(bm, alias) for alias in Alias.values}
        # newest first by id, the order they were made in: sorted by created_at, which no index holds, the 100
        # newest of 11,000 versions took 38 ms on SQLite (5 ms by id)
        vs = list(PolicyVersion.objects.filter(run__base_model=bm, run__in=_visible_runs(request))
                  .select_related("run").order_by("-id")[:100])
        by_version: dict[int, list[str]] = {}
        for alias, v in current.items():
            if v is not None:
                by_version.setdefault(v.pk, []).append(alias)
        sections.append({"base_model": bm, "current": current, "history": history,
                         "versions": [(v, by_version.get(v.pk, [])) for v in vs]})
    return render(request, "ui/versions.html", {"sections": sections,
                                                 "aliases": [a for a in Alias.values if a != Alias.PREVIOUS]})


def version_detail(request: HttpRequest, version_id: int) -> HttpResponse:
    """A version: lineage, evaluations per domain, comparison with a baseline, the gate, promote, export."""
    from webapp.runs.evaluation import check_gate, compare, ensure_base_version, gate_config, resolve_baseline
    from webapp.runs.exports import FORMATS, export_status

    visible = PolicyVersion.objects.filter(run__in=_visible_runs(request)).select_related("run__base_model", "parent")
    version = get_object_or_404(visible, pk=version_id)
    ensure_base_version(version.run_id)  # the base model is always there to evaluate and compare with
    against = request.GET.get("against", "parent")
    try:
        baseline = resolve_baseline(version, against, visible)
    except ValidationFailed as exc:
        messages.error(request, exc.message)
        baseline, against = resolve_baseline(version, "parent", visible), "parent"
    config = gate_config(version.run.base_model.promotion_gate)
    comparison = compare(version, baseline, config.suite)
    lineage: list[PolicyVersion] = []
    node: PolicyVersion | None = version
    while node is not None and len(lineage) < 200:
        lineage.append(node)
        node = node.parent
    gate = {alias: check_gate(version, alias, services.current_alias(version.run.base_model, alias), config)
            for alias in config.aliases}
    evaluations = list(version.evaluations.select_related("domain").order_by("domain__name", "suite"))
    # hundreds of domains: both per-domain tables sort (by name, score or change) and page
    sort = request.GET.get("sort", "domain")
    sort = sort if sort in DOMAIN_SORTS else "domain"
    key, reverse = DOMAIN_SORTS[sort]
    eval_rows = _sorted(evaluations, lambda e: e.domain.name if key == "domain" else
                        getattr(e, "score" if key == "delta" else key), reverse)
    cmp_rows = _sorted(comparison.domains, lambda d: getattr(d, key, d.score), reverse)
    page_number = request.GET.get("page")
    eval_page = Paginator(eval_rows, DOMAINS_PER_PAGE).get_page(page_number)
    cmp_page = Paginator(cmp_rows, DOMAINS_PER_PAGE).get_page(page_number)
    chart = {"domains": [d.domain for d in comparison.domains],
             "score": [d.score for d in comparison.domains], "baseline": [d.baseline for d in comparison.domains],
             "delta": [d.delta for d in comparison.domains],
             "lo": [d.ci95[0] if d.ci95 else None for d in comparison.domains],
             "hi": [d.ci95[1] if d.ci95 else None for d in comparison.domains],
             "regression": [d.regression for d in comparison.domains],
             "version": f"v{version.number}", "baselineLabel": f"v{baseline.number}" if baseline else "none",
             "api": f"/api/v1/policy-versions/{version.pk}/"}
    return render(request, "ui/version.html", {
        "v": version, "run": version.run, "baseline": baseline, "against": against, "comparison": comparison,
        "layers": comparison.layers(), "gate": gate, "config": config, "lineage": lineage, "evaluations": evaluations,
        "children": version.children.order_by("number")[:20], "aliases": _current_aliases(version.run.base_model)
        .get(version.pk, []), "alias_choices": [a for a in Alias.values if a != Alias.PREVIOUS],
        "siblings": visible.filter(run=version.run).order_by("-number")[:200],
        "exports": {fmt: export_status(version, fmt) for fmt in FORMATS}, "chart": chart,
        "pending": any(e.status in ("pending", "running") for e in evaluations),
        "eval_page": eval_page, "cmp_page": cmp_page, "sort": sort, "sorts": list(DOMAIN_SORTS),
        "pages": max(eval_page.paginator.num_pages, cmp_page.paginator.num_pages),
    })


def _sorted(rows: list[Any], key: Any, reverse: bool) -> list[Any]:
    """``rows`` sorted by ``key``, the rows without a value last whichever way the table sorts."""
    known = [r for r in rows if key(r) is not None]
    return sorted(known, key=key, reverse=reverse) + [r for r in rows if key(r) is None]


@require_POST
def version_promote(request: HttpRequest, version_id: int) -> HttpResponse:
    version = get_object_or_404(PolicyVersion.objects.select_related("run__base_model"), pk=version_id,
                                run__in=_visible_runs(request))
    try:
        services.do_promote_version(version, request.POST.get("alias", Alias.PRODUCTION), actor=request.user,
                                    reason=request.POST.get("reason", ""), force=bool(request.POST.get("force")))
        messages.success(request, f"{request.POST.get('alias', 'production')} → {version}")
    except TemperError as exc:
        messages.error(request, exc.message)
    return redirect(_next(request))


@require_POST
def alias_rollback(request: HttpRequest, base_model_id: int) -> HttpResponse:
    bm = get_object_or_404(BaseModel.objects.visible_to(request.user), pk=base_model_id)
    try:
        event = services.do_rollback_alias(bm, request.POST.get("alias", Alias.PRODUCTION), actor=request.user,
                                           reason=request.POST.get("reason", ""))
        messages.success(request, f"{event.alias} rolled back to {event.version}")
    except TemperError as exc:
        messages.error(request, exc.message)
    return redirect(_next(request))
