"""The pure pipeline: the run spec and the scheduler. No Django, no Celery, no torch."""
