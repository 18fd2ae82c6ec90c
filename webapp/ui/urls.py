from django.urls import path

from webapp.ui import views

urlpatterns = [
    path("", views.home, name="home"),
]
