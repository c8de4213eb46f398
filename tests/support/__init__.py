"""Helpers every layer of the tests shares (unit, contract, integration, acceptance, benchmarks).

* :mod:`~tests.support.backends`: how each store is built for a test run, and
  how one is made to lose its data;
* :mod:`~tests.support.helpers`: jobs, transitions and polling, as tests write them;
* :mod:`~tests.support.reconciling`: a reconciler scene on a store, used by the
  reconciler's unit tests (frozen clock) and contract tests (every backend);
* :mod:`~tests.support.reconciler_world`: that scene on an InMemoryStore and a
  frozen clock, with the thresholds the reconciler's unit tests read;
* :mod:`~tests.support.browser`: a headless Chromium, for the dashboard's test.

No tests here: only what tests use.
"""
