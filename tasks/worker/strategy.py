"""The task strategy of job tasks: Celery's default, behind a check of the message body's shape."""

from __future__ import annotations

import logging
from typing import Any

from ..core.transport import body_problem

logger = logging.getLogger(__name__)


def guarded_strategy(task: Any, app: Any, consumer: Any, **options: Any) -> Any:
    """Celery's default task strategy behind a check of the message body's shape.

    A message whose body does not unpack is rejected (removed from the queue and from the
    transport's unacked set) and, where it names a task id, a failure is stored so that a
    producer waiting on it gets a clear error.
    """
    from celery.exceptions import InvalidTaskError
    from celery.worker.strategy import default

    handler = default(task, app, consumer, **options)

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any) -> Any:
        try:
            decoded = body if body is not None else message.decode()
        except Exception as exc:  # undecodable: let the consumer's own error path say so
            return consumer.on_decode_error(message, exc)
        problem = body_problem(decoded)
        if problem is None:
            return handler(message, body, ack, reject, callbacks, **kw)
        task_id = (message.headers or {}).get("id")
        logger.error("rejected a malformed %s message %s: %s", task.name, task_id, problem)
        message.reject_log_error(logger, consumer.connection_errors)
        if isinstance(task_id, str):
            try:
                app.backend.mark_as_failure(
                    task_id, InvalidTaskError(f"malformed {task.name} message: {problem}"))
            except Exception as exc:  # the rejection stands; the producer will time out
                logger.warning("could not store the failure of %s: %s", task_id, exc)
        return None

    return on_message
