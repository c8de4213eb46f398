"""The reconciler on an InMemoryStore and a FrozenClock, one module per concern.

Every rule at its exact threshold, the lease, racing workers and reconcilers,
store faults and store-clock ages. The world they share (app, store, fake
broker, clocks) is :mod:`tests.support.reconciler_world`; the fixtures are in
this package's ``conftest.py``.
"""
