"""Redis Sentinel under a partition (issue 39, item 5): the primary cut off from its replicas and
sentinels while a writer on its side keeps writing, as a worker next to it would (Jepsen's
Redis analysis, 2013, lost 56% of acknowledged writes in this case).

A write counts as acknowledged by the fleet's rule on Sentinel: a replica had it within the
fleet's ``WAIT`` (:class:`tasks.core.sentinel.Replication`, one replica, its default timeout).
"""

from __future__ import annotations

import time

import pytest
import redis

from tasks.core.defaults import REDIS_WAIT_TIMEOUT_MS

from .conftest import wait_for
from .sentinel_partition import deployed_min_replicas, sentinel_partition

#: A loaded 2-core host may be this much later than min-replicas-max-lag to refuse.
REFUSE_SLACK_S = 5.0


@pytest.mark.timeout(150)
def test_a_cut_off_primary_refuses_writes_and_no_acknowledged_write_is_lost() -> None:
    max_lag = deployed_min_replicas()["min-replicas-max-lag"]
    with sentinel_partition() as cluster:
        old, replicas = cluster.nodes[0], cluster.nodes[1:]
        acked: list[int] = []  # a replica had it within WAIT: the fleet went on from it
        unacked: list[int] = []  # the old primary took it, no replica had it in time
        refused_at: float | None = None
        with cluster.client(old, timeout=REDIS_WAIT_TIMEOUT_MS / 1000 + 5) as writer:

            def write(i: int) -> None:
                writer.set(f"dfp:write:{i}", i)
                had = int(writer.execute_command("WAIT", 1, REDIS_WAIT_TIMEOUT_MS))
                (acked if had >= 1 else unacked).append(i)

            for i in range(5):
                write(i)
            assert acked == list(range(5))
            cluster.cut()
            cut_at = time.time()
            i = 5
            while refused_at is None and time.time() < cut_at + max_lag + REFUSE_SLACK_S:
                try:
                    write(i)
                except redis.ResponseError as exc:
                    assert "NOREPLICAS" in str(exc), exc
                    refused_at = time.time()
                i += 1
            promoted = wait_for(lambda: next((n for n in replicas if cluster.role(n) == "master"), None),
                                60, "a replica promoted on the majority side")
            promoted_s = time.time() - cut_at
        assert promoted is not None
        cluster.heal()
        healed_at = time.time()
        wait_for(lambda: cluster.role(old) == "slave" and cluster.synced_replicas(promoted) == 2,
                 60, "the old primary back as a replica of the new one")
        rejoined_s = time.time() - healed_at
        with cluster.client(promoted) as reader:
            lost_acked = [n for n in acked if reader.get(f"dfp:write:{n}") is None]
            lost_unacked = [n for n in unacked if reader.get(f"dfp:write:{n}") is None]
    refused_s = None if refused_at is None else refused_at - cut_at
    print(f"\nSENTINEL PARTITION primary cut off: it refused writes {refused_s and round(refused_s, 2)} s "
          f"after the cut (min-replicas-max-lag {max_lag} s); a replica promoted within {promoted_s:.1f} s; "
          f"old primary a replica again {rejoined_s:.1f} s after the heal; writes acknowledged {len(acked)}, "
          f"lost {len(lost_acked)}; taken by the cut-off primary without a replica {len(unacked)}, "
          f"lost {len(lost_unacked)}")
    assert refused_s is not None, f"the cut-off primary still took writes {max_lag + REFUSE_SLACK_S:g} s after the cut"
    assert refused_s <= max_lag + REFUSE_SLACK_S
    assert lost_acked == []
