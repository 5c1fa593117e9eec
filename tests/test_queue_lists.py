"""A queue's Redis lists (tasks.core.queue_lists): their names and order (pure), and their count
on a real Redis in one round trip."""

from __future__ import annotations

import pytest

from tasks.core import keys
from tasks.core.priority import Level
from tasks.core.queue_lists import (
    KOMBU_STEP_SEPARATOR,
    QueueLists,
    brpop_keys,
    insert_in_level,
    leveled,
    split_level,
    split_user,
)

pytestmark = pytest.mark.timeout(60)
STEP = KOMBU_STEP_SEPARATOR


def test_a_queue_has_a_list_per_level_a_list_per_user_beside_each_and_kombus_step_lists():
    lists = QueueLists("cpu", ("ben", "ann"))
    assert lists.of_level(Level.URGENT) == ["cpu:urgent", "cpu:urgent~ben", "cpu:urgent~ann"]
    assert lists.of_level(Level.NORMAL) == ["cpu", "cpu~ben", "cpu~ann"]
    assert lists.of_level(Level.BATCH, steps=True) == [
        "cpu:batch", "cpu:batch~ben", "cpu:batch~ann", f"cpu:batch{STEP}3", f"cpu:batch{STEP}6", f"cpu:batch{STEP}9"]
    assert lists.push_list(Level.BATCH, "ann") == "cpu:batch~ann"
    assert lists.push_list(Level.NORMAL, None) == "cpu"
    # Every name parses back to its queue, level and user.
    for level in Level:
        for name in lists.of_level(level):
            assert split_level(name) == ("cpu", level)
    assert split_user("sweep.s1:batch~ann") == ("sweep.s1:batch", "ann")


def test_a_queues_consumption_order_is_levels_first_then_users_in_order_then_kombus_steps():
    order = QueueLists("sweep.s1", ("ben", "ann"), steps=(0, 5)).consumption_order()
    assert order == [
        "sweep.s1:urgent", "sweep.s1:urgent~ben", "sweep.s1:urgent~ann",
        "sweep.s1", "sweep.s1~ben", "sweep.s1~ann",
        "sweep.s1:batch", "sweep.s1:batch~ben", "sweep.s1:batch~ann",
        f"sweep.s1:urgent{STEP}5", f"sweep.s1{STEP}5", f"sweep.s1:batch{STEP}5",
    ]
    # What a worker consuming only this queue names in its BRPOP, in the same order.
    assert order == [key for key, _ in brpop_keys(leveled(["sweep.s1"]), ["ben", "ann"], (0, 5))]
    assert QueueLists("sweep.s1", ("ben", "ann"), steps=(0, 5)).all() == order


def test_a_list_added_or_used_goes_last_among_its_levels_lists():
    order = ["cpu:urgent", "cpu", "fleet", "cpu:batch"]
    insert_in_level(order, "sweep.s1")
    insert_in_level(order, "sweep.s1:urgent")
    insert_in_level(order, "sweep.s1:batch")
    assert order == ["cpu:urgent", "sweep.s1:urgent", "cpu", "fleet", "sweep.s1", "cpu:batch", "sweep.s1:batch"]


def test_a_queues_waiting_messages_are_counted_over_its_users_and_step_lists(client):
    client.hset(keys.USERS, mapping={"ann": "1", "ben": "1"})
    client.lpush("cpu", "m1")
    client.lpush("cpu~ann", "m2", "m3")
    client.lpush("cpu:batch~ben", "m4")
    client.lpush(f"cpu:batch{STEP}3", "m5")
    client.lpush("cpu:batchx", "not a list of the queue")
    lists = QueueLists.read(client, "cpu")
    assert lists.users == ("ann", "ben")
    assert lists.count(client, Level.NORMAL) == 3
    assert lists.count(client, Level.BATCH) == 2
    assert lists.count(client, Level.BATCH, steps=False) == 1
    assert lists.count(client) == 5


# -- the users a worker polls: those waiting, not every user ever seen (issue 63) ---------------------


def test_a_list_keeps_its_waiting_users_until_their_list_is_found_empty_and_a_new_one_leaves_a_wake_mark(client):
    from tasks.core.defaults import WAKE_KEEP, WAKE_WINDOW_S
    from tasks.core.fairshare import PUBLISH, UserOrder

    publish = client.register_script(PUBLISH)

    def send(user: str, message: str, window_s: float = WAKE_WINDOW_S) -> None:
        publish(keys=[f"cpu~{user}", keys.USERS, keys.waiting_users("cpu"), keys.wake("cpu")],
                args=[user, message, window_s, WAKE_KEEP])

    send("ann", "m1")
    send("ben", "m2")
    assert client.lrange(keys.wake("cpu"), 0, -1) == ["cpu~ben", "cpu~ann"]  # both new: a worker may not name them
    order = UserOrder(refresh_s=0.0)
    assert order.read(client, ["cpu", "cpu:batch"]).beside == {"cpu": {"ann", "ben"}, "cpu:batch": frozenset()}
    client.rpop("cpu~ann")  # ann's job is taken: the next read takes her out of the poll
    waiting = order.read(client, ["cpu", "cpu:batch"])
    assert waiting.beside["cpu"] == {"ben"} and waiting.order == ("ben",)
    assert client.zrange(keys.waiting_users("cpu"), 0, -1) == ["ben"]
    assert client.hkeys(keys.USERS) == ["ann", "ben"]  # ever seen: kept, read by no poll
    send("ann", "m3", window_s=0.0)  # she comes back: waiting again (no mark past the window)
    assert order.read(client, ["cpu"]).beside["cpu"] == {"ann", "ben"}
    assert client.llen(keys.wake("cpu")) == 2
    assert QueueLists.waiting(client, "cpu").users == ("ann", "ben")


def test_messages_in_a_users_list_no_waiting_set_names_are_adopted_at_a_workers_first_read(client):
    """A user's list that holds messages but is in no waiting set (published before the waiting
    sets existed: an upgrade) is added to its level list's waiting users at a worker's first read
    of that list, so its messages are polled; once a fleet for each list, not per read or worker."""
    from tasks.core.fairshare import UserOrder

    client.hset(keys.USERS, mapping={"old": "1.0", "gone": "1.0"})  # both sent jobs once
    client.lpush("cpu~old", "queued before the upgrade")  # no waiting set names it
    order = UserOrder(refresh_s=0.0)
    assert order.read(client, ["cpu"]).beside == {"cpu": {"old"}}  # "gone" has nothing waiting
    assert client.zrange(keys.waiting_users("cpu"), 0, -1) == ["old"]
    client.rpop("cpu~old")
    client.lpush("cpu~gone", "pushed by hand, after this worker's first read")
    assert order.read(client, ["cpu"]).beside == {"cpu": frozenset()}  # adopted once: not again
    assert UserOrder(refresh_s=0.0).read(client, ["cpu"]).beside == {"cpu": frozenset()}  # nor by the next worker
    assert UserOrder(refresh_s=0.0).read(client, ["cpu", "gpu"]).beside == {"cpu": frozenset(), "gpu": frozenset()}
    assert client.smembers(keys.WAITING_ADOPTED) == {"cpu", "gpu"}


def _polled_keys(client, seconds: float = 2.5) -> set[str]:  # type: ignore[no-untyped-def]
    """Every key the fleet's workers named in a BRPOP over ``seconds`` (MONITOR)."""
    import time

    found: set[str] = set()
    with client.monitor() as monitor:
        deadline = time.monotonic() + seconds
        for event in monitor.listen():
            parts = event["command"].split(" ")
            if parts[0].upper() == "BRPOP":
                found.update(part.strip('"') for part in parts[1:-1])
            if time.monotonic() > deadline:
                return found
    return found


@pytest.mark.timeout(180)
def test_a_workers_poll_names_no_idle_user_and_a_new_users_job_is_taken_at_once(app, fleet):  # type: ignore[no-untyped-def]
    import statistics
    import time

    from tasks import fan_out
    from tasks.core.queues import device_queue
    from tasks.core.registry import connect
    from tasks.producer.fanout import JobSpec, prioritized

    client = connect(fleet.redis_url)
    fan_out("noop", ["cpu0", "cpu1"], app=app).get(timeout=60)
    time.sleep(2.5)  # every worker has read its users again since: this user's lists are empty
    before = _polled_keys(client)
    noop = JobSpec.of("noop")

    def send(user: str, device: str) -> None:  # through the fleet's publish; taken and dropped (expired)
        prioritized(noop, user=user).signature(app, device_queue(device)).apply_async(expires=1e-3)

    def taken(device: str) -> bool:
        return not QueueLists.waiting(client, device_queue(device)).count(client)

    for i in range(300):
        send(f"idle{i}", ("cpu0", "cpu1")[i % 2])
    deadline = time.monotonic() + 60
    while not (taken("cpu0") and taken("cpu1")):
        assert time.monotonic() < deadline, "300 users' jobs still wait"
        time.sleep(0.1)
    time.sleep(2.5)
    after = _polled_keys(client)
    assert before and after == before, sorted(after ^ before)[:10]  # 300 idle users: not one key more
    assert not any("~idle" in key for key in after)
    # A new user's first job is taken within a few round trips, not at the workers' next read.
    waits = []
    for i in range(5):
        time.sleep(1.7)  # the worker's poll is under way, its read made before this user existed
        t0 = time.monotonic()
        send(f"fresh{i}", "cpu0")
        while not taken("cpu0"):
            assert time.monotonic() - t0 < 10, "a new user's job was not taken"
            time.sleep(0.005)
        waits.append(time.monotonic() - t0)
    assert statistics.median(waits) < 0.15, waits  # without the wake marks: 0.31 to 0.39 s here
