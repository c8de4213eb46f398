"""celery-exactonce as a Django app (``"celery_exactonce.contrib.django"`` in ``INSTALLED_APPS``).

* **Migrations** make the SQL store's tables in the project's own database
  (``python manage.py migrate``), so no DDL runs when a worker or a beat
  starts.
* **The store** ``exactonce_store_url = "django://default"`` (or any alias of
  ``DATABASES``) runs on the project's configured database, inside Django's
  transactions (:mod:`celery_exactonce.contrib.django.store`).
* **A read-only admin** of the jobs (:mod:`celery_exactonce.contrib.django.admin`).

The tables' prefix is ``exactonce_``, or the ``EXACTONCE_TABLE_PREFIX``
Django setting; the ``django://`` store uses the same.
"""
