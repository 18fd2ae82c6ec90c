"""One settings module, driven by the environment, with embedded defaults for a laptop.

Environment variables (all optional):

- ``DATABASE_URL``   default: a SQLite file ``var/temper.sqlite3``
- ``REDIS_URL``      default: ``redis://127.0.0.1:6399/0``, the embedded Redis that ``make run`` starts
- ``ARTIFACTS_ROOT`` default: ``var/artifacts``
- ``SECRET_KEY``     default: generated once into ``var/secret_key``
- ``DEBUG``          default: ``1`` (set ``0`` in production)
- ``ALLOWED_HOSTS``  default: ``127.0.0.1,localhost`` (comma separated)
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("TEMPER_VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def _secret_key() -> str:
    if key := os.environ.get("SECRET_KEY"):
        return key
    path = VAR_DIR / "secret_key"
    if not path.exists():
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = env_bool("DEBUG", True)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", "http://127.0.0.1:8000,http://localhost:8000")

EMBEDDED_REDIS_PORT = int(os.environ.get("TEMPER_EMBEDDED_REDIS_PORT", "6399"))
REDIS_URL = os.environ.get("REDIS_URL", f"redis://127.0.0.1:{EMBEDDED_REDIS_PORT}/0")
ARTIFACTS_ROOT = Path(os.environ.get("ARTIFACTS_ROOT", VAR_DIR / "artifacts"))

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's assets served from the project: the docs page works offline
    "channels",
    "webapp.common",
    "webapp.catalog",
    "webapp.runs",
    "webapp.ui",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django.contrib.auth.middleware.LoginRequiredMiddleware",
]

ROOT_URLCONF = "webapp.urls"
ASGI_APPLICATION = "webapp.asgi.application"
WSGI_APPLICATION = "webapp.wsgi.application"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "login"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "webapp" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'temper.sqlite3'}"),
        conn_max_age=int(os.environ.get("DB_CONN_MAX_AGE", "0")),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not memory, so worker processes started by the tests see the test database.
    DATABASES["default"]["TEST"] = {"NAME": os.environ.get("TEMPER_TEST_DB", str(VAR_DIR / "test.sqlite3"))}
    # WAL lets the web process read while a worker writes; the timeout rides out short write locks.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 30,
            # IMMEDIATE: a write transaction takes the lock at BEGIN and waits for it, instead of failing
            # with "database is locked" when a read lock cannot be upgraded (web + workers write at once).
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # whitenoise warns about a missing root, even in DEBUG
# plotly.js is served by the project (no CDN): its cartesian bundle, vendored in webapp/static/vendor/plotly/
STATICFILES_DIRS = [BASE_DIR / "webapp" / "static"]

# --- production hardening: on whenever DEBUG is off, so `check --deploy` is clean -------------
if not DEBUG:
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = int(os.environ.get("SECURE_HSTS_SECONDS", "31536000"))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# --- REST API --------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.TokenAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "webapp.api.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Temper API",
    "DESCRIPTION": "Task domains, verifiers, runs, policy versions, trajectories and metrics.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    "COMPONENT_SPLIT_REQUEST": True,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# --- Channels ----------------------------------------------------------------------------------
# socket_timeout=None: redis-py 8 gives every connection a 5 s read timeout, the same 5 s channels_redis
# blocks in each BZPOPMIN (its brpop_timeout), so an idle consumer's read timed out before the pop answered,
# raised TimeoutError, and the browser's websocket closed (redis-py #4091, channels_redis #422). None is redis-py 7's behaviour,
# which channels_redis is written for. A finite timeout above the pop (10 s was tried) left a refused
# consumer's cancelled pop alive past the event loop's close: tests/test_websocket.py hung at teardown.
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": None}], "capacity": 1000, "expiry": 60},
    }
}

# --- Celery (read by workers/celery.py) -----------------------------------------------------------
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", REDIS_URL)
# The control worker's recovery tick: how often it runs, and after how long in-flight work counts as lost.
TEMPER_KICK_SECONDS = float(os.environ.get("TEMPER_KICK_SECONDS", "10"))
TEMPER_STALL_SECONDS = float(os.environ.get("TEMPER_STALL_SECONDS", "90"))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
