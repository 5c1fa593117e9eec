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
