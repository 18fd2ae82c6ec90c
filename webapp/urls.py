"""HTTP routes: pages, the REST API under /api/v1/, its OpenAPI schema and docs, and the admin."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_not_required, login_required
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.authtoken.views import obtain_auth_token

import webapp.catalog.api
import webapp.runs.api  # noqa: F401  (registers its resources on the router)
from webapp.api import router

admin.site.site_header = "Temper administration"
admin.site.site_title = "Temper admin"

urlpatterns = [
    path("login/", login_not_required(auth_views.LoginView.as_view()), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("api/v1/auth/token/", obtain_auth_token, name="api-token"),
    path("api/v1/schema/", SpectacularAPIView.as_view(), name="schema"),
    # DRF views opt out of LoginRequiredMiddleware (DRF authenticates itself); a person opening the docs
    # page without a session is sent to the login page instead of seeing a bare 403.
    path("api/v1/docs/", login_required(SpectacularSwaggerView.as_view(url_name="schema")), name="api-docs"),
    path("api/v1/", include(router.urls)),
    path("", include("webapp.ui.urls")),
]
