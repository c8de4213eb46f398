"""The task: :class:`~celery_exactonce.task.base.ExactOnceTask` and its parts.

What Celery calls on a gated task (``base``: the submit and the worker's
call), the delivery at the gate and its outcome (``gate``), the running jobs'
heartbeats (``heartbeats``), an ``apply_async`` call's options
(``call_options``), the record a submit writes (``submit``), eager mode
(``eager``), and what a body asks of the job's future: a retry or a
replacement inside its transaction (``later``), a requeue (``requeues``).
"""
