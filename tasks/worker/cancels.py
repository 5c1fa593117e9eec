"""A worker's cancel relay: the users' own cancels, sent on as Celery's revoke (issue 49).

Celery's cancel (``revoke``) is a broadcast on its control channel that every worker obeys,
whoever sent it, so a user's credentials are denied that channel (:mod:`tasks.core.users`). A
user asks instead: a signed :class:`~tasks.core.users.CancelRequest` pushed to
:data:`~tasks.core.keys.CANCEL_REQUESTS`, the one list they may push to and not read. This
thread, on every worker of a fleet with users, pops the requests, keeps those signed by the user
whose job they name (the job's task id ends in ``~<user>``), and sends the revoke with the
fleet's own credentials; a refused request is logged and dropped. On a fleet with no users it
does nothing but read, every :data:`~tasks.core.defaults.USER_KEYS_REFRESH_S`, that there are none.

A user's sweep or study (:mod:`tasks.producer.trials`) asks the same way for what its producer
does with Celery's control channel for the fleet's admin: its unsent trials stored ``REVOKED``
(``store``: a user writes no result key), and the workers it chose asked to consume its own queue
(``attach``) and let it go (``detach``), only a queue whose id ends in the user's mark
(:func:`tasks.core.users.owner_suffix`): no user moves workers onto another's queue. The workers
that answer an attach are kept where her producer reads them (``keys.sweep_attached``), so it
warns of a silent one as the admin's does.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, states
from pydantic import ValidationError

from ..core import keys
from ..core.defaults import CANCEL_RELAY_BATCH, SWEEP_ATTACH_TIMEOUT_S, SWEEP_ATTACHED_TTL_S
from ..core.job import PROGRESS_STATE
from ..core.periodic import PeriodicThread
from ..core.queue_lists import split_level
from ..core.queues import SWEEP_QUEUE_PREFIX
from ..core.users import CancelRequest, UserKeys

logger = logging.getLogger(__name__)


class CancelRelay(PeriodicThread):
    """Every ``interval_s``, the users' cancel requests waiting, checked and sent on."""

    name = "devicefleet-cancel-relay"

    def __init__(self, client: Any, app: Celery, interval_s: float) -> None:
        super().__init__(interval_s)
        self._client = client
        self._app = app
        self._keys = UserKeys()

    def tick(self) -> None:
        if not self._keys.any(self._client):
            return
        raw = self._client.rpop(keys.CANCEL_REQUESTS, CANCEL_RELAY_BATCH)
        if raw:
            self.relay(raw)

    def relay(self, raw: list[Any]) -> list[str]:
        """Act on the requests ``raw`` that their users may make; the task ids revoked."""
        revoke: list[str] = []
        store: list[str] = []
        for item in raw:
            try:
                request = CancelRequest.model_validate_json(item)
            except ValidationError:
                logger.warning("dropped a malformed cancel request: %.200r", item)
                continue
            problem = self._keys.check_cancel(self._client, request)
            if problem is not None:
                logger.warning("refused %s's %s of %s: %s", request.user, request.action, request.task_id, problem)
                continue
            if request.action == "cancel":
                revoke.append(request.task_id)
                if request.store:
                    store.append(request.task_id)
            else:
                self._consume(request)
        if revoke:
            self._app.control.revoke(revoke)
            logger.info("cancelled for their users: %s", ", ".join(revoke))
        if store:
            self._store_revoked(store)
        return revoke

    def _consume(self, request: CancelRequest) -> None:
        """Ask ``request.workers`` to consume (``attach``) or let go (``detach``) its queue list.
        An attach waits for their replies (at most :data:`SWEEP_ATTACH_TIMEOUT_S`) and keeps the
        workers that answered where the user's producer reads them (``keys.sweep_attached``)."""
        control = self._app.control
        workers = list(request.workers)
        logger.info("%s %s for %s: %s", request.action, request.task_id, request.user, ", ".join(workers))
        if request.action == "detach":
            control.cancel_consumer(request.task_id, destination=workers, reply=False)
            return
        replies = control.add_consumer(request.task_id, destination=workers, reply=True, timeout=SWEEP_ATTACH_TIMEOUT_S)
        answered = sorted({name for reply in replies or [] for name in reply})
        if answered:
            key = keys.sweep_attached(split_level(request.task_id)[0].removeprefix(SWEEP_QUEUE_PREFIX))
            with self._client.pipeline(transaction=False) as pipe:
                pipe.sadd(key, *answered)
                pipe.expire(key, SWEEP_ATTACHED_TTL_S)
                pipe.execute()

    def _store_revoked(self, task_ids: list[str]) -> None:
        """Store ``REVOKED`` for each of ``task_ids`` that has no result yet and does not run, as a
        sweep's producer does for its own trials with the fleet's credentials (a worker that takes
        one later drops it: it is revoked)."""
        backend = self._app.backend
        for task_id in task_ids:
            state = backend.get_task_meta(task_id).get("status")
            if state not in states.READY_STATES and state not in (states.STARTED, PROGRESS_STATE):
                backend.mark_as_revoked(task_id, reason=f"cancelled by its user ({task_id})")
