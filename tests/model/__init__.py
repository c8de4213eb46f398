"""The project's model of its job protocol: one job's life, checked breadth-first.

``world`` (the state, rules, scenarios, bounds), ``base``, ``dispatchers``,
``workers``, ``reconcilers`` and ``model`` (the steps), ``checker`` (the
search), ``scope`` (the edges against ``celery_exactonce.core.states``, and the
named variants), ``_table`` (the one import of ``celery_exactonce``).
See docs/design/protocol.md, "What the model checks".
"""
