"""Dead letters: the jobs that took their whole worker down ``max_attempts`` times.

Such a job ends as a :class:`~tasks.core.errors.WorkerLost` error entry instead of running (and
killing its worker) again, and the worker that refused it records a
:class:`~tasks.core.records.DeadLetter` in ``keys.DEAD_LETTERS`` (:mod:`tasks.worker.lease`)::

    import tasks
    for letter in tasks.dead_letters():
        print(letter.task_id, letter.job, letter.workers)
    tasks.forget_dead_letter(letter.task_id)   # once it is dealt with

They are kept until forgotten: ``devicefleet status`` lists them and the fleet's exporter counts
them (``devicefleet_dead_letters``, alerted on in ``deploy/prometheus/alerts.yml``).
"""

from __future__ import annotations

import logging

import redis
from celery import Celery
from pydantic import ValidationError

from ..core import keys
from ..core.records import DeadLetter, stored
from .fanout import _default_app, registry_client

logger = logging.getLogger(__name__)


def read_dead_letters(client: redis.Redis) -> list[DeadLetter]:
    """The fleet's dead letters, oldest first (one ``HGETALL``); a malformed one is skipped."""
    letters: list[DeadLetter] = []
    raw: dict[str, str] = client.hgetall(keys.DEAD_LETTERS)  # type: ignore[assignment]
    for task_id, value in raw.items():
        try:
            letters.append(stored(DeadLetter, value))
        except ValidationError:
            logger.warning("dead letter of job %s is malformed; ignoring it", task_id)
    return sorted(letters, key=lambda letter: letter.at)


def dead_letters(app: Celery | None = None) -> list[DeadLetter]:
    """The jobs that took their worker down ``max_attempts`` times and were not run again,
    oldest first."""
    return read_dead_letters(registry_client(app or _default_app()))


def forget_dead_letter(task_id: str, app: Celery | None = None) -> bool:
    """Remove ``task_id``'s dead letter, and its count of worker deaths (so that the same
    message, sent again on purpose, runs again). Returns whether there was one."""
    pipe = registry_client(app or _default_app()).pipeline()
    pipe.hdel(keys.DEAD_LETTERS, task_id)
    pipe.delete(keys.worker_deaths(task_id))
    removed, _ = pipe.execute()
    return bool(removed)
