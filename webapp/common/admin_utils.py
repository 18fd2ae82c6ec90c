"""Admin helpers for tables with millions of rows."""

from __future__ import annotations

from functools import cached_property

from django.core.paginator import Paginator


class NoCountPaginator(Paginator):
    """A paginator that never runs ``COUNT(*)``: it reports a large count and lets pages come back short.

    Used for trajectories and metric points, where a full count of a run's rows would take seconds.
    """

    @cached_property
    def count(self) -> int:
        return 10_000_000
