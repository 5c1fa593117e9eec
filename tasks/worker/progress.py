"""Job progress: throttled on the worker, published three ways, shown live by the CLI.

A job calls ``ctx.progress(epoch=3, epochs=15, loss=0.21)`` as often as it likes. The job's
:class:`ProgressPublisher` keeps the latest report and publishes at most
:data:`MIN_INTERVAL_S` apart (the first report at once); a report that came too soon goes out
when the interval has passed, or when the job ends, so the finished bar shows ``10/10`` and the
loss the result has. A call in between costs a dict copy, no Redis round trip.

Publishing a report:

- stores it in the result backend as state ``PROGRESS`` with the fields as meta, and under
  :func:`tasks.core.keys.progress` (which outlives the job, so producers read each device's
  latest report through :meth:`tasks.producer.fanout.FanOut.progress` after it finished too);
- sends a ``task-progress`` task event. Flower keeps task state from events
  (``celery.events.state.Task.event``): an event type it does not know becomes the state of the
  same name upper-cased, so the task shows as ``PROGRESS``; the fields also travel as the
  event's ``result``, the field Flower's task page and task list show, so the epoch and loss
  are visible there while the job runs. ``SUCCESS`` ranks above ``PROGRESS``: a late report
  never overwrites the real result;
- puts it in the worker's registry record (``progress``), for ``devicefleet status``.

A report with ``step`` and ``value`` (a sweep trial's intermediate value, e.g.
``ctx.progress(step=epoch, value=accuracy)``) is also kept in a list of the last
:data:`VALUES_KEPT` pairs that every published report carries as ``values``: a report folded
into a later one loses its fields, not its value, so ``tasks.optimize`` hands Optuna's pruner
every step.

:mod:`tasks.ops.progress_view` draws the reports as live bars.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Any, TypeGuard

from ..core import keys
from ..core.job import PROGRESS_EVENT, PROGRESS_STATE
from .heartbeat import COALESCE_S

logger = logging.getLogger(__name__)

#: Reports closer together than this are folded into the next one (a few updates per second).
MIN_INTERVAL_S = 0.25
#: ``[step, value]`` pairs every published report carries (the latest ones).
VALUES_KEPT = 256


def summary(fields: dict[str, Any]) -> str:
    """``progress: epoch=3 epochs=15 loss=0.21``: the report as Flower shows it."""
    return "progress: " + " ".join(
        f"{key}={value}" for key, value in fields.items() if key not in ("device", "values"))


class ProgressPublisher:
    """One running job's progress: the latest report, published at most every
    :data:`MIN_INTERVAL_S` seconds. A report that came too soon goes out when the interval
    has passed (a timer), or at :meth:`flush` when the job ends, whichever is first: the
    latest report is never left unpublished."""

    def __init__(self, task: Any, device: str, heartbeat: Any = None, client: Any = None,
                 expires_s: float = 86_400.0, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.task = task
        # Celery's task.request is per thread: keep this job's, for the timer's publishes.
        self.request = task.request
        self.device = device
        self.heartbeat = heartbeat
        self.client = client
        self.expires_s = max(1, int(expires_s))
        self.min_interval_s = min_interval_s
        self.published = 0
        self._latest: dict[str, Any] | None = None
        self._values: deque[list[float]] = deque(maxlen=VALUES_KEPT)
        self._last_sent = float("-inf")
        self._timer: threading.Timer | None = None
        # Held while a report is taken and published, so two publishes never cross (the
        # timer's and the job's): the last one out is always the latest report.
        self._lock = threading.Lock()

    def report(self, fields: dict[str, Any]) -> None:
        """Keep ``fields`` as the latest report; publish it now if the last one is old enough,
        else when the interval has passed."""
        with self._lock:
            self._latest = {"device": self.device, **fields}
            step, value = fields.get("step"), fields.get("value")
            if _number(step) and _number(value):
                self._values.append([step, value])
            wait = self.min_interval_s - (time.monotonic() - self._last_sent)
            if wait <= 0:
                self._publish()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self._trailing)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Publish the latest report if it has not gone out yet (at the job's end)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._publish()

    def _trailing(self) -> None:
        with self._lock:
            self._timer = None
            self._publish()

    def _publish(self) -> None:
        meta, self._latest = self._latest, None
        if meta is None:
            return
        self._last_sent = time.monotonic()
        self.published += 1
        if self._values:
            meta["values"] = list(self._values)
        publish(self.task, self.request, meta, self.heartbeat, self.client, self.expires_s)


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def publish(task: Any, request: Any, meta: dict[str, Any], heartbeat: Any = None, client: Any = None,
            expires_s: int = 86_400) -> None:
    """Publish one report ``meta`` of the job ``task`` whose request is ``request`` (from any
    thread: nothing here reads Celery's per-thread ``task.request``); never raises."""
    task_id = getattr(request, "id", None)
    if not task_id:
        return
    try:
        task.backend.store_result(task_id, meta, PROGRESS_STATE, request=request)
    except Exception as exc:  # noqa: BLE001  (progress is best effort; the job goes on)
        logger.debug("progress to the result backend failed: %s", exc)
    if client is not None:
        try:
            client.set(keys.progress(task_id), json.dumps(meta), ex=expires_s)
        except Exception as exc:  # noqa: BLE001  (progress is best effort; the job goes on)
            logger.debug("progress to its key failed: %s", exc)
    try:
        # What Task.send_event does, with this job's request instead of the thread's.
        with task.app.events.default_dispatcher(hostname=getattr(request, "hostname", None)) as events:
            events.send(PROGRESS_EVENT, uuid=task_id, retry=True,
                        retry_policy=task.app.conf.task_publish_retry_policy,
                        progress=meta, result=summary(meta))
    except Exception as exc:  # noqa: BLE001  (progress is best effort; the job goes on)
        logger.debug("progress event failed: %s", exc)
    if heartbeat is not None:
        try:
            heartbeat.update(progress=meta, after_s=COALESCE_S)
        except Exception as exc:  # noqa: BLE001  (progress is best effort; the job goes on)
            logger.debug("progress to the registry failed: %s", exc)
