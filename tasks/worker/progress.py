"""Job progress: throttled in the job process, published three ways by the worker, shown live by the CLI.

(A command's output lines take the same road: batched by its job process, appended here to its
log stream, :func:`publish_log`.)

A job calls ``ctx.progress(epoch=3, epochs=15, loss=0.21)`` as often as it likes. Its job
process keeps the latest report and sends it to the worker at most
:data:`tasks.jobproc.progress.MIN_INTERVAL_S` apart (the first report at once); a report that
came too soon goes out when the interval has passed, or when the job ends, so the finished bar
shows ``10/10`` and the loss the result has. A call in between costs a dict copy.

Publishing a report (:func:`publish`, in the worker, as each report arrives):

- stores it in the result backend as state ``PROGRESS`` with the fields as meta, and under
  :func:`tasks.core.keys.progress` (which outlives the job, so producers read each device's
  latest report through :meth:`tasks.producer.fanout.FanOut.progress` after it finished too),
  in one script call that refuses the report of an attempt older than the job's (fencing,
  :data:`tasks.core.jobscripts.PROGRESS`): a worker cut off from Redis, whose job a newer attempt
  runs now, publishes none of its late reports, anywhere (the refusal is counted as the
  device's ``writes_refused``);
- sends a ``task-progress`` task event. Flower keeps task state from events
  (``celery.events.state.Task.event``): an event type it does not know becomes the state of the
  same name upper-cased, so the task shows as ``PROGRESS``; the fields also travel as the
  event's ``result``, the field Flower's task page and task list show, so the epoch and loss
  are visible there while the job runs. ``SUCCESS`` ranks above ``PROGRESS``: a late report
  never overwrites the real result;
- puts it in the worker's registry record (``progress``), for ``devicefleet status``.

A report with ``step`` and ``value`` (a sweep trial's intermediate value, e.g.
``ctx.progress(step=epoch, value=accuracy)``) carries the last pairs as ``values``
(:class:`tasks.jobproc.progress.ProgressThrottle`): a report folded into a later one loses its
fields, not its value, so ``tasks.optimize`` hands Optuna's pruner every step.

:mod:`tasks.ops.progress_view` draws the reports as live bars.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from ..core import keys
from ..core.defaults import HEARTBEAT_COALESCE_S, RESULT_EXPIRES_S
from ..core.job import PROGRESS_EVENT, PROGRESS_STATE
from ..core.jobstate import Attempt

logger = logging.getLogger(__name__)

#: Batches a command's log stream keeps (older ones are trimmed; its log files keep everything).
STREAM_MAX_BATCHES = 5000


def summary(fields: dict[str, Any]) -> str:
    """``progress: epoch=3 epochs=15 loss=0.21``: the report as Flower shows it."""
    return "progress: " + " ".join(
        f"{key}={value}" for key, value in fields.items() if key not in ("device", "values"))


def publish(task: Any, request: Any, meta: dict[str, Any], heartbeat: Any = None, client: Any = None,
            expires_s: int = RESULT_EXPIRES_S, slot: int = 0, attempt: Attempt | None = None,
            device: str = "") -> bool:
    """Publish one report ``meta`` of the job ``task`` whose request is ``request`` (from any
    thread: nothing here reads Celery's per-thread ``task.request``), running in ``slot`` on
    ``device`` as ``attempt`` (the lease it holds; ``None``: a job run under none, whose report
    is not fenced); never raises. False if the report was refused: a newer attempt runs the job."""
    task_id = getattr(request, "id", None)
    if not task_id:
        return True
    store_progress = getattr(task.backend, "store_progress", None)
    if attempt is not None and store_progress is not None:
        try:
            if not store_progress(attempt, meta, request, expires_s, device):
                logger.warning("job %s: its progress was refused, a newer attempt runs it (token %d is older)",
                               task_id, attempt.token)
                return False
        except Exception as exc:  # noqa: BLE001  (progress is best effort; the job goes on)
            logger.debug("progress to the result backend failed: %s", exc)
    else:
        _publish_unfenced(task, request, task_id, meta, client, expires_s)
    _announce(task, request, task_id, meta, heartbeat, slot)
    return True


def _publish_unfenced(task: Any, request: Any, task_id: str, meta: dict[str, Any], client: Any,
                      expires_s: int) -> None:
    try:
        task.backend.store_result(task_id, meta, PROGRESS_STATE, request=request)
    except Exception as exc:  # noqa: BLE001  (progress is best effort; the job goes on)
        logger.debug("progress to the result backend failed: %s", exc)
    if client is not None:
        try:
            client.set(keys.progress(task_id), json.dumps(meta), ex=expires_s)
        except Exception as exc:  # noqa: BLE001  (progress is best effort; the job goes on)
            logger.debug("progress to its key failed: %s", exc)


def _announce(task: Any, request: Any, task_id: str, meta: dict[str, Any], heartbeat: Any, slot: int) -> None:
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
            heartbeat.update_slot(slot, progress=meta, after_s=HEARTBEAT_COALESCE_S)
        except Exception as exc:  # noqa: BLE001  (progress is best effort; the job goes on)
            logger.debug("progress to the registry failed: %s", exc)


def publish_log(client: Any, job_id: str, lines: Sequence[tuple[str, str]], expires_s: int) -> None:
    """Append a batch of a command's output lines to ``keys.command_log(job_id)`` (one pipelined
    round trip), which ``devicefleet run`` follows; never raises (the command matters more than
    its live view)."""
    if client is None or not lines:
        return
    key = keys.command_log(job_id)
    try:
        pipe = client.pipeline(transaction=False)
        pipe.xadd(key, {"lines": json.dumps(lines)}, maxlen=STREAM_MAX_BATCHES, approximate=True)
        pipe.expire(key, expires_s)
        pipe.execute()
    except Exception as exc:  # noqa: BLE001
        logger.warning("could not stream %d lines of %s's output: %s", len(lines), job_id, exc)
