"""The Redis transport, hardened: a malformed message in a queue is dropped, never fatal.

kombu's Redis channel decodes each popped item and hands it to Celery inside the worker's
event loop; an item that is not a kombu envelope (bytes pushed straight into the list), or a
task body Celery cannot unpack (``"a string"`` instead of ``[args, kwargs, embed]``), raises
out of that loop and stops the whole worker. This transport catches those errors for one
message, logs them, and keeps consuming. Celery uses it through ``broker_transport``.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis

logger = logging.getLogger(__name__)

#: What a malformed message raises while being decoded or unpacked.
MALFORMED = (ValueError, KeyError, TypeError, AttributeError, IndexError)


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, dropping a malformed message instead of raising."""

    def _brpop_read(self, **options: Any) -> bool:
        try:
            return bool(super()._brpop_read(**options))
        except self.connection_errors:
            raise
        except MALFORMED as exc:
            logger.error("dropped a malformed message from Redis (%s: %s); the worker goes on",
                         type(exc).__name__, exc)
            return True


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


def body_problem(body: Any) -> str | None:
    """What is wrong with a task message body of protocol 2, or None if it has the right shape."""
    if not isinstance(body, (list, tuple)) or len(body) != 3:
        return f"the body must be [args, kwargs, embed], got {type(body).__name__} {body!r:.80}"
    args, kwargs, embed = body
    if not isinstance(args, (list, tuple)):
        return f"args must be a list, got {type(args).__name__}"
    if not isinstance(kwargs, dict):
        return f"kwargs must be an object, got {type(kwargs).__name__}"
    if embed is not None and not isinstance(embed, dict):
        return f"embed must be an object, got {type(embed).__name__}"
    return None


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
