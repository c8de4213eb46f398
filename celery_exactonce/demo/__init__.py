"""The demo, ``python -m celery_exactonce demo``: the tool, kept apart from the library.

* :mod:`~celery_exactonce.demo.run` starts two beat nodes and a worker on this
  machine (no servers), SIGKILLs one beat half-way through and gathers what
  happened;
* :mod:`~celery_exactonce.demo.processes` starts one of those processes in its
  own session, watches it and stops it;
* :mod:`~celery_exactonce.demo.app` is the Celery app those processes run
  (``celery -A celery_exactonce.demo.app``), configured from the environment;
* :mod:`~celery_exactonce.demo.report` turns a run into the report (text or JSON).

Nothing in the library imports this package; it uses only the library's
public surface and its store.
"""
