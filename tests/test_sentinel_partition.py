"""Redis Sentinel under a partition (issue 39, item 5): the primary cut off from its replicas and
sentinels while a writer on its side keeps writing, as a worker next to it would (Jepsen's
Redis analysis, 2013, lost 56% of acknowledged writes in this case).

A write counts as acknowledged by the fleet's rule on Sentinel: a replica had it within the
fleet's ``WAIT`` (:class:`tasks.core.sentinel.Replication`, one replica, its default timeout).
The worker on the primary's side is the fleet's own code on the test's connection to the old
primary: its :class:`~tasks.worker.lease.LeaseKeeper` (takes, renewals, self-fencing) and the
result backend's store (:meth:`~tasks.core.jobstate.JobState.finish` then ``WAIT``, as
:class:`tasks.core.backend.FleetBackend` does); the worker on the majority side is the same on
the promoted replica, taking a job only once its lease there has expired (the reaper's rule).
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import redis

from tasks.core import keys
from tasks.core.defaults import REDIS_WAIT_TIMEOUT_MS
from tasks.core.jobstate import Attempt, JobEnd, JobState, MessageAck, StateMeta, Stored
from tasks.core.sentinel import Replication
from tasks.worker.lease import LeaseKeeper, Take

from .conftest import wait_for
from .partition_rig import LEASE_TTL_S
from .sentinel_partition import RedisNode, SentinelPartition, deployed_min_replicas, sentinel_partition

# A real system rig (root, network namespaces: Sentinel over a partition): its own step in .ci/run, `python3 -m pytest -m system`.
pytestmark = pytest.mark.system

#: A loaded 2-core host may be this much later than min-replicas-max-lag to refuse.
REFUSE_SLACK_S = 5.0
#: kombu's unacked hash and index (the fleet's transport: tasks.core.transport.stored_ack_keys).
UNACKED, UNACKED_INDEX = "unacked", "unacked_index"
#: The majority side's WAIT: the fleet's rule, with room for a loaded host (its replica just
#: followed the promoted primary).
MAJORITY_WAIT = Replication(replicas=1, timeout_ms=5000)


def _delivered(client: redis.Redis, task_id: str) -> str:
    """A job's message as kombu leaves it once delivered to a worker: in the unacked hash and
    index (before the cut, replicated). Returns its delivery tag."""
    tag = f"tag-{task_id}"
    client.hset(UNACKED, tag, json.dumps([{"id": task_id}, "", "cpu0"]))
    client.zadd(UNACKED_INDEX, {tag: time.time()})
    return tag


def _store(client: redis.Redis, replication: Replication, attempt: Attempt, tag: str, who: str) -> bool:
    """The result backend's store of a job's end (FleetBackend._store): the script, which also
    releases the lease and acknowledges the message, then WAIT. Whether it is done."""
    task_id = attempt.task_id
    meta = StateMeta(key=f"celery-task-meta-{task_id}",
                     value=json.dumps({"status": "SUCCESS", "result": {"by": who}, "task_id": task_id}), expires_s=0)
    end = JobEnd(attempt=attempt, ack=MessageAck(unacked_key=UNACKED, unacked_index_key=UNACKED_INDEX,
                                                 delivery_tag=tag))
    assert JobState(client).finish(task_id, meta, end, final=True) is Stored.STORED
    return replication.wait(client, f"state of task {task_id}")


def _result_by(client: redis.Redis, task_id: str) -> str | None:
    raw = client.get(f"celery-task-meta-{task_id}")
    return None if raw is None else str(json.loads(raw)["result"]["by"])


def _lease_expiry(cluster: SentinelPartition, nodes: list[RedisNode], task_id: str) -> float:
    """The earliest wall time a replica's copy of ``task_id``'s lease can expire (its TTL read
    right after the cut, from the time the read was sent)."""
    expiries = []
    for node in nodes:
        with cluster.client(node) as client:
            sent = time.time()
            pttl = int(client.pttl(keys.lease(task_id)))
        assert pttl > 0, f"{node.name} has no live lease of the running job ({pttl})"
        expiries.append(sent + pttl / 1000)
    return min(expiries)


def _rerun(cluster: SentinelPartition, promoted: RedisNode, task_id: str, tag: str) -> tuple[float, bool]:
    """The majority side's worker runs ``task_id`` again: once its lease on the promoted primary
    has expired, it takes it (the old owner counts as dead: the rig has no registry) and stores
    its end. Returns when it started, and whether its store was done (a replica had it)."""
    with cluster.client(promoted, timeout=10) as client:
        wait_for(lambda: client.exists(keys.lease(task_id)) == 0, 30, f"job {task_id}'s lease to expire")
        assert client.hexists(UNACKED, tag), "the message is no longer in the promoted primary's unacked hash"
        keeper = LeaseKeeper(client, "cpu0", "cpu0@hostb", LEASE_TTL_S, MAJORITY_WAIT)
        started = time.time()
        taken = keeper.take(task_id, tag)
        assert taken.outcome is Take.TAKEN and taken.attempt is not None, taken
        done = _store(client, MAJORITY_WAIT, taken.attempt, tag, "majority")
        keeper.forget(task_id)
        return started, done


@pytest.mark.timeout(150)
def test_a_cut_off_primary_refuses_writes_and_no_acknowledged_write_is_lost() -> None:
    max_lag = deployed_min_replicas()["min-replicas-max-lag"]
    fleet_wait = Replication(replicas=1)  # the fleet's own on Sentinel
    with sentinel_partition() as cluster:
        old, replicas = cluster.nodes[0], cluster.nodes[1:]
        acked: list[int] = []  # a replica had it within WAIT: the fleet went on from it
        unacked: list[int] = []  # the old primary took it, no replica had it in time
        refused_at: float | None = None
        done_id, stored_in_cut, running = (str(uuid.uuid4()) for _ in range(3))
        with cluster.client(old, timeout=REDIS_WAIT_TIMEOUT_MS / 1000 + 5) as writer, \
                cluster.client(old, timeout=REDIS_WAIT_TIMEOUT_MS / 1000 + 5) as keeper_client:
            # The worker on the old primary's side: a job done before the cut, one that ends
            # just after it, one that runs through it.
            keeper = LeaseKeeper(keeper_client, "cpu0", "cpu0@hosta", LEASE_TTL_S, fleet_wait)
            tags = {task_id: _delivered(writer, task_id) for task_id in (done_id, stored_in_cut, running)}
            attempts = {task_id: keeper.take(task_id, tag) for task_id, tag in tags.items()}
            assert all(taken.outcome is Take.TAKEN for taken in attempts.values()), attempts
            done_attempt = attempts[done_id].attempt
            assert done_attempt is not None
            assert _store(writer, fleet_wait, done_attempt, tags[done_id], "minority")
            keeper.forget(done_id)
            keeper.start()

            def write(i: int) -> None:
                writer.set(f"dfp:write:{i}", i)
                had = int(writer.execute_command("WAIT", 1, REDIS_WAIT_TIMEOUT_MS))
                (acked if had >= 1 else unacked).append(i)

            for i in range(5):
                write(i)
            assert acked == list(range(5))
            # (when the watch saw it, when the keeper's rule said it: the last renewal a replica
            # had plus fence_after_s, from the keeper's monotonic clock to the wall clock)
            fenced: list[tuple[float, float]] = []
            stop = threading.Event()

            def watch() -> None:  # the job's watch asks the keeper, as a device worker's does
                while not stop.wait(0.02):
                    if keeper.must_stop(running) is not None:
                        deadline = keeper.fence.deadline(running)
                        now = time.time()
                        assert deadline is not None
                        fenced.append((now, now - (time.monotonic() - deadline)))
                        keeper.fenced(running, keep_s=0)
                        return

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            cluster.cut()
            cut_at = time.time()
            copy_expires = _lease_expiry(cluster, replicas, running)
            # The job that ends just after the cut: the primary takes its store, no replica has it.
            stored_attempt = attempts[stored_in_cut].attempt
            assert stored_attempt is not None
            store_done = _store(writer, fleet_wait, stored_attempt, tags[stored_in_cut], "minority")
            keeper.forget(stored_in_cut)
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
            watcher.join(10)
            stop.set()
            keeper.stop()
        assert promoted is not None
        assert fenced, "the worker on the cut-off side never stopped the job it ran"
        wait_for(lambda: cluster.synced_replicas(promoted) >= 1, 60, "a replica following the promoted primary")
        # The majority side runs both jobs whose last writes no replica had, as its reaper would.
        reruns = {task_id: _rerun(cluster, promoted, task_id, tags[task_id]) for task_id in (stored_in_cut, running)}
        cluster.heal()
        healed_at = time.time()
        wait_for(lambda: cluster.role(old) == "slave" and cluster.synced_replicas(promoted) == 2,
                 60, "the old primary back as a replica of the new one")
        rejoined_s = time.time() - healed_at
        with cluster.client(promoted) as reader:
            lost_acked = [n for n in acked if reader.get(f"dfp:write:{n}") is None]
            lost_unacked = [n for n in unacked if reader.get(f"dfp:write:{n}") is None]
            results = {task_id: _result_by(reader, task_id) for task_id in (done_id, stored_in_cut, running)}
            left_unacked = [task_id for task_id, tag in tags.items() if reader.hexists(UNACKED, tag)]
    refused_s = None if refused_at is None else refused_at - cut_at
    # The cut-off run is ended within the stop's grace of its fence; the rerun starts no earlier
    # than the promoted copy of the lease expires (the reaper's rule; here, when it took it).
    seen_at, due_at = fenced[0]
    cut_run_ends = seen_at + keeper.fence_grace_s
    overlap_s = max(0.0, cut_run_ends - reruns[running][0])
    margin_s = copy_expires - (due_at + keeper.fence_grace_s)
    print(f"\nSENTINEL PARTITION primary cut off: it refused writes {refused_s and round(refused_s, 2)} s "
          f"after the cut (min-replicas-max-lag {max_lag} s); a replica promoted within {promoted_s:.1f} s; "
          f"old primary a replica again {rejoined_s:.1f} s after the heal; writes acknowledged {len(acked)}, "
          f"lost {len(lost_acked)}; taken by the cut-off primary without a replica {len(unacked)}, "
          f"lost {len(lost_unacked)}"
          f"\nSENTINEL PARTITION jobs: result store unconfirmed on the cut-off side {int(not store_done)} "
          f"(lost with the failover, ran again on the majority side: {results[stored_in_cut]!r}); running job "
          f"fenced {seen_at - cut_at:.1f} s after the cut (due at {due_at - cut_at:.1f} s), ended by "
          f"{cut_run_ends - cut_at:.1f} s; its lease's copy on the replicas expired {copy_expires - cut_at:.1f} s "
          f"after the cut (margin {margin_s:.1f} s); rerun at {reruns[running][0] - cut_at:.1f} s: overlap "
          f"{overlap_s:.2f} s; reruns "
          f"{len(reruns)}, all done {all(done for _, done in reruns.values())}; acknowledged results lost "
          f"{int(results[done_id] is None)}")
    assert refused_s is not None, f"the cut-off primary still took writes {max_lag + REFUSE_SLACK_S:g} s after the cut"
    assert refused_s <= max_lag + REFUSE_SLACK_S
    assert lost_acked == []
    # The fleet's rule: what a replica had is kept; what none had was not taken as done.
    assert store_done is False
    assert results == {done_id: "minority", stored_in_cut: "majority", running: "majority"}
    assert all(done for _, done in reruns.values())
    assert left_unacked == []  # every message acknowledged, once, by the store that was kept
    # No job ran twice at once: the keeper's rule stops the cut-off side's job, its grace
    # included, before the majority side's copy of its lease (its last replicated renewal) can
    # expire; and the rerun came after the cut-off run had ended.
    assert margin_s > 0, (due_at - cut_at, copy_expires - cut_at)
    assert overlap_s == 0.0
