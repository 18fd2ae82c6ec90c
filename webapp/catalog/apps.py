from django.apps import AppConfig


class CatalogConfig(AppConfig):
    name = "webapp.catalog"
    label = "catalog"
    verbose_name = "Catalog: base models, domains, tasks, verifiers"
    default_auto_field = "django.db.models.BigAutoField"
