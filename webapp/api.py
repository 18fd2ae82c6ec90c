"""The REST API's shared parts: the router, the error handler and ownership-scoped viewsets."""

from __future__ import annotations

from typing import Any

from django.db.models import ProtectedError, QuerySet
from rest_framework import viewsets
from rest_framework.response import Response
from rest_framework.routers import DefaultRouter
from rest_framework.views import exception_handler as drf_exception_handler

from webapp.common.errors import TemperError


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Service errors become ``{"detail": message, "errors": details}`` with their status code."""
    if isinstance(exc, ProtectedError):
        users = sorted({f"{type(o)._meta.verbose_name} {o.pk}" for o in list(exc.protected_objects)[:5]})
        return Response({"detail": f"still in use by {', '.join(users)}: remove those first"}, status=409)
    if isinstance(exc, TemperError):
        body: dict[str, Any] = {"detail": exc.message}
        if exc.details is not None:
            body["errors"] = exc.details
        return Response(body, status=exc.status_code)
    return drf_exception_handler(exc, context)


class OwnedViewSet(viewsets.ModelViewSet):
    """A viewset over an owned model: users see and change their own rows; staff see all."""

    def get_queryset(self) -> QuerySet[Any]:
        return self.queryset.visible_to(self.request.user)  # type: ignore[union-attr]

    def perform_create(self, serializer: Any) -> None:
        serializer.save(owner=self.request.user)


router = DefaultRouter()
