"""The abstract base every Temper table builds on, and ownership scoping."""

from __future__ import annotations

from typing import Any, Self, TypeVar

from django.conf import settings
from django.db import models


class TimestampedModel(models.Model):
    """Creation and update times for every row (aware datetimes, UTC)."""

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True


_M = TypeVar("_M", bound=models.Model)


class OwnedQuerySet(models.QuerySet[_M]):
    def visible_to(self, user: Any) -> Self:
        """What ``user`` may see: everything for staff, their own rows for everyone else."""
        if user.is_staff:
            return self
        return self.filter(owner=user)


class OwnedModel(TimestampedModel):
    """A row that belongs to one user; only they (and staff) see or change it.

    Each concrete subclass declares ``objects = OwnedQuerySet.as_manager()`` (so the manager is typed for it).
    """

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")

    class Meta:
        abstract = True
