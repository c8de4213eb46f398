"""The dispatch path: write ``DISPATCHED``, then publish, then settle what failed.

The dispatcher (``dispatcher``) and its failures (``failures``), the one-step
enqueue of record and message (``one_step``), background retries
(``retrier``), what a dispatch did (``outcomes``), the publish through
Celery (``publisher``, with ``capture``), and the message format: our headers
and what a message says of its job (``messages``).
"""
