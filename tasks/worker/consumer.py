"""The device worker's consumer: Celery's, with a task it does not know answered as UnknownJob,
and task events sent on a short timer.

Celery stores ``NotRegistered`` for a task no worker registered, but without the message's chord:
a fan-out that names a job outside the allowlist would then wait for its collect step forever.
:class:`FleetConsumer` stores :class:`~tasks.core.errors.UnknownJob` instead, with the device's
error entry and the message's chord and group, so the chord collects it like any failed job.

Celery buffers a worker's task events and flushes the buffer on the event loop's next turn: about
one publish per event (received, started, succeeded: three per job). :class:`FleetConsumer`
flushes it :data:`EVENT_FLUSH_S` after the first event that came into an empty buffer, so a job's
events, and those of the jobs around it, go out in one ``task.multi`` publish; the buffer is
flushed once more when the consumer shuts down, so the last events are not lost.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import signals
from celery.app.task import Context
from celery.worker.consumer import Consumer

from ..core.backend import attach_entry
from ..core.defaults import EVENT_FLUSH_S
from ..core.job import TASK_PREFIX
from ..core.jobstate import hand_over
from ..core.records import Entry, ErrorInfo
from . import accounting

logger = logging.getLogger(__name__)


def _embed(message: Any) -> dict[str, Any]:
    """The callbacks, errbacks, chain and chord of a protocol 2 message body (``{}`` if none)."""
    try:
        body = message.decode()
    except Exception:
        return {}
    if isinstance(body, (list, tuple)) and len(body) == 3 and isinstance(body[2], dict):
        return body[2]
    return {}


class FleetConsumer(Consumer):  # type: ignore[misc]
    """Celery's consumer; a message for a task this worker does not run ends in UnknownJob, and
    task events go out on a timer (see the module's docstring)."""

    #: A flush of the event buffer is scheduled (set by any thread, cleared by the loop's timer).
    _event_flush_due = False

    def on_send_event_buffered(self) -> None:
        # Called by the thread that buffered an event (a pool thread, or the loop's): hub.call_soon
        # is how other threads hand work to the loop; the loop's own timer schedules the flush.
        if self.hub and not self._event_flush_due:
            self._event_flush_due = True
            self.hub.call_soon(self._schedule_event_flush)

    def _schedule_event_flush(self) -> None:
        self.hub.call_later(EVENT_FLUSH_S, self._flush_buffered_events)

    def _flush_buffered_events(self) -> None:
        # Cleared first: an event buffered during the flush schedules the next one.
        self._event_flush_due = False
        self._flush_events()

    def on_close(self) -> None:
        # The connection is going: a flush the loop's timer loses with it must not leave the
        # flag set, or no flush would be scheduled again (a second flush is harmless).
        self._event_flush_due = False
        super().on_close()

    def shutdown(self) -> None:
        self._flush_events()  # the events the timer still holds: the last jobs'
        super().shutdown()

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        device_worker = getattr(self.controller, "device_worker", None)
        headers = message.headers or {}
        task_id, name = headers.get("id"), headers.get("task")
        if device_worker is None or not isinstance(task_id, str) or not isinstance(name, str):
            super().on_unknown_task(body, message, exc)
            return
        job = name.removeprefix(TASK_PREFIX)
        failure = device_worker.jobs.unknown(job)
        logger.warning("%s: refused task %s (%s): %s", device_worker.device, name, task_id, failure)
        message.reject_log_error(logger, self.connection_errors)
        now = time.time()
        entry = Entry.make(device=device_worker.device.name, worker=device_worker.nodename, output=None,
                           error=ErrorInfo.of(failure), started=now, finished=now,
                           visibility=device_worker.seen)
        embed = _embed(message)
        request = Context(
            id=task_id, task=name, hostname=self.hostname, headers=headers,
            chord=embed.get("chord"), chain=embed.get("chain"), errbacks=embed.get("errbacks"),
            group=headers.get("group"), group_index=headers.get("group_index"),
            root_id=headers.get("root_id"), parent_id=headers.get("parent_id"),
            correlation_id=message.properties.get("correlation_id"),
            reply_to=message.properties.get("reply_to"), delivery_info=message.delivery_info,
        )
        # Counted as a failed job, with the stored failure (the request came with no message to
        # acknowledge: it is rejected above).
        hand_over(request, accounting.job_end(device_worker, self.app, request, ok=False, started=now, finished=now))
        self.app.backend.mark_as_failure(task_id, attach_entry(failure, entry), request=request)
        if self.event_dispatcher:
            self.event_dispatcher.send("task-failed", uuid=task_id, exception=repr(failure))
        signals.task_unknown.send(sender=self, message=message, exc=exc, name=name, id=task_id)
