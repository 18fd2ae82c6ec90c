from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "webapp.runs"
    label = "runs"
    verbose_name = "Runs: lifecycle, policy versions, trajectories, metrics"
    default_auto_field = "django.db.models.BigAutoField"
