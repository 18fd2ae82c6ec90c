from django.apps import AppConfig


class UiConfig(AppConfig):
    name = "webapp.ui"
    label = "ui"
    verbose_name = "Browser pages"
