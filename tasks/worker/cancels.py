"""A worker's cancel relay: the users' own cancels, sent on as Celery's revoke (issue 49).

Celery's cancel (``revoke``) is a broadcast on its control channel that every worker obeys,
whoever sent it, so a user's credentials are denied that channel (:mod:`tasks.core.users`). A
user asks instead: a signed :class:`~tasks.core.users.CancelRequest` pushed to
:data:`~tasks.core.keys.CANCEL_REQUESTS`, the one list they may push to and not read. This
thread, on every worker of a fleet with users, pops the requests, keeps those signed by the user
whose job they name (the job's task id ends in ``~<user>``), and sends the revoke with the
fleet's own credentials; a refused request is logged and dropped. On a fleet with no users it
does nothing but read, every :data:`~tasks.core.defaults.USER_KEYS_REFRESH_S`, that there are none.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from pydantic import ValidationError

from ..core import keys
from ..core.defaults import CANCEL_RELAY_BATCH
from ..core.periodic import PeriodicThread
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
        """Revoke the jobs that the requests ``raw`` may cancel; the task ids revoked."""
        revoke = []
        for item in raw:
            try:
                request = CancelRequest.model_validate_json(item)
            except ValidationError:
                logger.warning("dropped a malformed cancel request: %.200r", item)
                continue
            problem = self._keys.check_cancel(self._client, request)
            if problem is not None:
                logger.warning("refused %s's cancel of job %s: %s", request.user, request.task_id, problem)
                continue
            revoke.append(request.task_id)
        if revoke:
            self._app.control.revoke(revoke)
            logger.info("cancelled for their users: %s", ", ".join(revoke))
        return revoke
