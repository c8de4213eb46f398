"""Settings of the example shop.

Everything that differs between machines comes from the environment:
``SHOP_DATABASE`` (a SQLite file, default ``db.sqlite3`` here) and
``SHOP_BROKER_URL`` (default ``redis://localhost:6379/0``).
"""

from __future__ import annotations

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "example-only-not-secret")
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
ROOT_URLCONF = "shop.urls"
STATIC_URL = "/static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_beat",
    "celery_exactonce.contrib.django",  # the store's tables (migrate) and its admin
    "orders",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
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
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_DATABASE", str(BASE_DIR / "db.sqlite3")),
        # Several processes write (beats, workers): SQLite must take its write lock at
        # BEGIN, so a writer waits for it instead of failing (the django:// store checks).
        "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
    }
}

# Celery, read by shop/celery.py (namespace "CELERY").
CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL", "redis://localhost:6379/0")
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_BEAT_SCHEDULER = "exactonce-django"
# The job store in the project's own database: the tables are the app's migrations'.
CELERY_EXACTONCE_STORE_URL = "django://default"
CELERY_EXACTONCE_NAMESPACE = "shop"
