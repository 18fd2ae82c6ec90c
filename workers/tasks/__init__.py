"""Thin Celery tasks: translate ids to plain data, call plain functions, write results back.

The only Django-aware code under ``workers/``. Each task takes ids, re-reads state, claims its work and
is idempotent, so redelivery (acks_late) never does anything twice.
"""
