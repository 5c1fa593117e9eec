"""A rank of a distributed job (:func:`tasks.worker.gang.run_rank`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from ...core.errors import DeviceMismatch
from ...core.records import GangSpec, JobOptions
from .. import gang
from ..launch import Launch
from ..supervisor import Ended
from .base import RunMode
from .plain import Plain

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gang(RunMode):
    """A rank of a distributed job: its gang joins, assembles and runs it again as a whole."""

    plain: Plain
    client: redis.Redis
    device: str
    #: Where the gang's other ranks reach this worker (rank 0's store).
    address: str
    #: How long the gang's hash lives.
    expires_s: int
    #: A rank's grace when its gang is preempted.
    preempt_grace_s: float

    def admit(self, options: JobOptions, mismatch: DeviceMismatch | None) -> DeviceMismatch | None:
        if mismatch is not None and options.gang is not None:
            # its peers end now, naming it, not after their join timeout
            self.refuse(options.gang, str(mismatch))
        return super().admit(options, mismatch)

    def run(self, launch: Launch) -> Ended:
        spec = launch.options.gang
        assert spec is not None, "a gang's run needs the job's gang"
        return gang.run_rank(self.client, spec, self.device, self.address, self.expires_s, launch.message,
                             launch.watch, lambda rank, watch: self.plain.in_process(rank, watch, launch.slot),
                             token=launch.token, level=launch.options.priority,
                             preempt_grace_s=self.preempt_grace_s)

    def refuse(self, spec: GangSpec, why: str) -> None:
        """This worker will not run its rank of ``spec`` (:func:`tasks.worker.gang.refuse_rank`)."""
        try:
            gang.refuse_rank(self.client, spec, self.device, why, self.expires_s)
        except redis.RedisError as exc:  # its peers end at their join timeout instead
            logger.warning("%s: could not fail gang %s for its refused rank: %s", self.device, spec.id, exc)
