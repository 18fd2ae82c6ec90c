from django.apps import AppConfig


class CommonConfig(AppConfig):
    name = "webapp.common"
    label = "common"
    verbose_name = "Temper"
