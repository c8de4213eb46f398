"""The admin: periodic tasks (django-celery-beat) and the store's jobs (celery-exactonce)."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
