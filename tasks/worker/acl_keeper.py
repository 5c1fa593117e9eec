"""Keeps the fleet users' Redis ACL users where their producers log in (issue 49).

A Redis restarted from its data keeps the fleet's keys but not its ACL users, and the workers
reconnect by themselves: without this, every user's credentials were refused after a restart of
Redis (on Sentinel: of a replica later promoted, or of a sentinel) until some worker restarted
and made them again as it joined. Each worker checks every
:data:`~tasks.core.defaults.ACL_USERS_CHECK_S` and makes again the users a node lacks, with the
same passwords (:func:`tasks.core.users.restore_acl_users`, ``missing_only``): one ``ACL USERS``
a node a tick, and one read of the users' hash; nothing on a fleet with no users.
"""

from __future__ import annotations

import logging

import redis

from ..core.periodic import PeriodicThread
from ..core.users import restore_acl_users

logger = logging.getLogger(__name__)


class AclUsersKeeper(PeriodicThread):
    """Every ``interval_s``, the users' ACL users made again where a node lost them."""

    name = "devicefleet-acl-users"

    def __init__(self, client: redis.Redis, url: str, interval_s: float) -> None:
        super().__init__(interval_s)
        self.client, self.url = client, url

    def tick(self) -> None:
        made = restore_acl_users(self.client, self.url, missing_only=True)
        if made:
            logger.warning("made again the Redis ACL users of %s (Redis restarted)", ", ".join(made))
