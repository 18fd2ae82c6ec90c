"""Server-rendered pages."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from webapp.catalog.models import TaskDomain, Verifier
from webapp.runs.models import Run


def home(request: HttpRequest) -> HttpResponse:
    runs = Run.objects.visible_to(request.user).select_related("base_model")[:50]
    return render(request, "ui/home.html", {
        "runs": runs,
        "domains": TaskDomain.objects.visible_to(request.user)[:50],
        "verifiers": Verifier.objects.visible_to(request.user)[:50],
    })
