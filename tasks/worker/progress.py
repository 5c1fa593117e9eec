"""Job progress: published by the worker three ways, shown live by the CLI.

A job calls ``ctx.progress(epoch=3, epochs=15, loss=0.21)``; the worker then

- stores it in the result backend as state ``PROGRESS`` with the fields as meta (producers read
  it through :meth:`tasks.producer.fanout.FanOut.progress`);
- sends a ``task-progress`` task event. Flower keeps task state from events
  (``celery.events.state.Task.event``), and an event type it does not know becomes the state of
  the same name upper-cased: ``task-progress`` shows the task as ``PROGRESS`` in Flower, with the
  fields under ``progress``. ``SUCCESS`` ranks above it, so the task still ends ``SUCCESS``;
- puts it in the worker's registry record (``progress``), for ``devicefleet status``.

:mod:`tasks.ops.progress_view` draws the reports as live bars.
"""

from __future__ import annotations

import logging
from typing import Any

from ..core.job import PROGRESS_EVENT, PROGRESS_STATE

logger = logging.getLogger(__name__)


def publish(task: Any, device: str, fields: dict[str, Any], heartbeat: Any = None) -> None:
    """Report ``fields`` of the job ``task`` runs on ``device``; never raises (best effort)."""
    meta = {"device": device, **fields}
    try:
        task.update_state(state=PROGRESS_STATE, meta=meta)
    except Exception as exc:  # noqa: BLE001  (progress is best effort; the job goes on)
        logger.debug("progress to the result backend failed: %s", exc)
    try:
        task.send_event(PROGRESS_EVENT, progress=meta)
    except Exception as exc:  # noqa: BLE001  (progress is best effort; the job goes on)
        logger.debug("progress event failed: %s", exc)
    if heartbeat is not None:
        try:
            heartbeat.update(progress=meta)
        except Exception as exc:  # noqa: BLE001  (progress is best effort; the job goes on)
            logger.debug("progress to the registry failed: %s", exc)
