"""Fair share between users within a level (tasks.core.fairshare): the decay and the order as pure
logic, then two users' sweeps at one level on the session fleet."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pytest

from tasks import fair_share, fan_out, sweep
from tasks.core.fairshare import UserOrder, decayed, order_users, parse_usage, wait_bucket
from tasks.core.queue_lists import brpop_keys
from tasks.ops.exporter import FleetCollector
from tests.conftest import wait_for

# -- the decay and the order: pure logic -----------------------------------------------------------


def test_usage_halves_every_half_life_and_a_future_stamp_counts_as_now():
    assert decayed(100.0, stamp=1000.0, now=1000.0, half_life_s=60.0) == 100.0
    assert decayed(100.0, stamp=1000.0, now=1060.0, half_life_s=60.0) == pytest.approx(50.0)
    assert decayed(100.0, stamp=1000.0, now=1180.0, half_life_s=60.0) == pytest.approx(12.5)
    assert decayed(100.0, stamp=1010.0, now=1000.0, half_life_s=60.0) == 100.0  # another host's clock ahead
    # keys.USAGE's fields as Redis returns them; one that does not parse is left out.
    usage = parse_usage({b"ann": b"40 1000.0", "ben": "10 1060.0", "bad": "x"}, now=1060.0, half_life_s=60.0)
    assert usage == pytest.approx({"ann": 20.0, "ben": 10.0})


def test_users_are_served_least_usage_first_then_by_name():
    assert order_users(["ann", "ben", "cy", "dee"], {"ann": 20.0, "ben": 10.0, "dee": 10.0}) == ["cy", "ben", "dee", "ann"]


def test_a_workers_read_names_each_level_queue_lists_then_its_users_lists():
    queues = ["device.cpu0:urgent", "cpu:urgent", "device.cpu0", "cpu", "fleet", "device.cpu0:batch"]
    keys = brpop_keys(queues, ["ben", "ann"])
    assert [key for key, _ in keys] == [
        "device.cpu0:urgent", "cpu:urgent",
        "device.cpu0:urgent~ben", "cpu:urgent~ben", "device.cpu0:urgent~ann", "cpu:urgent~ann",
        "device.cpu0", "cpu", "fleet",
        "device.cpu0~ben", "cpu~ben", "fleet~ben", "device.cpu0~ann", "cpu~ann", "fleet~ann",
        "device.cpu0:batch", "device.cpu0:batch~ben", "device.cpu0:batch~ann",
    ]
    # A popped user's list is delivered as its queue list's message.
    assert dict(keys)["cpu:urgent~ann"] == "cpu:urgent" and dict(keys)["fleet"] == "fleet"


class _Redis:
    """Just enough of a Redis client for UserOrder (its read, tasks.core.fairshare.WAITING_READ):
    counts its reads."""

    def __init__(self) -> None:
        self.reads = 0
        self.usage = {b"ann": b"5 9999999999"}  # stamped ahead: not decayed

    def register_script(self, source: str) -> Any:
        def read(keys: list[str], args: list[str], client: object = None) -> list[object]:
            self.reads += 1
            return [[], [b"ann", b"ben"], [self.usage.get(b"ann"), self.usage.get(b"ben")]]

        return read


def test_a_worker_reads_the_order_again_at_most_once_per_refresh_period():
    now = [0.0]
    order, client = UserOrder(refresh_s=0.5, clock=lambda: now[0]), _Redis()
    assert order.users(client) == ["ben", "ann"]  # type: ignore[arg-type]
    client.usage = {b"ben": b"9 9999999999"}
    now[0] = 0.4
    assert order.users(client) == ["ben", "ann"] and client.reads == 1  # type: ignore[arg-type]
    now[0] = 0.5
    assert order.users(client) == ["ann", "ben"] and client.reads == 2  # type: ignore[arg-type]


def test_waits_fall_in_the_first_bucket_that_holds_them():
    assert [wait_bucket(s) for s in (0.0, 0.01, 0.02, 4.9, 1e6)] == ["le:0.01", "le:0.01", "le:0.05", "le:5", "le:+Inf"]


# -- on the session fleet ------------------------------------------------------------------------------

#: Trials each user sends, and how long each runs (the issue's 0.3 s; fewer trials than its 100,
#: so that the test stays near 20 s). The second user sends once the first's 12th trial started
#: (about 2 s alone on 2 devices), and is served first until her usage catches up with that
#: lead: with fewer trials the lead is a larger part of the first's work, so her share while both
#: wait rises (about 55% here). The lead is counted in trials, not waited for by the clock: on a
#: loaded machine the first's sends alone took seconds, the lead grew with them, and so did her
#: share (0.67 once, under a second pytest worker).
TRIALS = 70
TRIAL_S = 0.3
LEAD_TRIALS = 12


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _served(entries: dict[str, list[dict[str, Any]]], since: float, shares: dict[str, float]) -> str:
    """What a miss needs to be understood: whom each device served, in order, from the second
    user's send (a letter a trial), when her first trial started, and the first's lead then."""
    first_of = {user: min(_ts(e["started_at"]) for e in got) for user, got in entries.items()}
    second = max(first_of, key=first_of.__getitem__)
    lead = {user: sum(max(0.0, min(_ts(e["finished_at"]), first_of[second]) - _ts(e["started_at"]))
                      for e in got) for user, got in entries.items()}
    runs = sorted((_ts(e["started_at"]), e.get("device"), user) for user, got in entries.items() for e in got)
    lines = [f"shares {shares}; {second}'s first trial started {first_of[second] - since:.2f} s after her send; "
             f"device-s by then: " + ", ".join(f"{u} {s:.1f}" for u, s in lead.items())]
    for device in sorted({str(d) for _, d, _ in runs}):
        lines.append(f"{device}: " + "".join(u[3].upper() for t, d, u in runs if str(d) == device and t >= since))
    return "\n".join(lines)


@pytest.mark.alone  # under a second pytest worker's load it missed both ways (0.33 and 0.71): not understood yet
@pytest.mark.timeout(180)
def test_two_users_at_one_level_each_get_40_to_60_percent_of_the_device_seconds(fleet, app, tmp_path):
    users = ("fs-ann", "fs-ben")
    # Each user's first job: a worker's read names a user's lists from its next refresh on, so a
    # user's first jobs wait for it; once a job of each has run on both devices, both know them.
    for handle in [fan_out("noop", ["cpu0", "cpu1"], priority="batch", user=user, app=app) for user in users]:
        assert {entry["status"] for entry in handle.get(timeout=60).values()} == {"ok"}
    kwargs = {"marker": str(tmp_path), "seconds": TRIAL_S}
    trials = [{"score": float(i)} for i in range(TRIALS)]
    first = sweep("counted", trials, devices=["cpu0", "cpu1"], kwargs=kwargs, priority="batch", user=users[0], app=app)
    # The scenario: the second user comes later (only the first's trials leave markers so far).
    wait_for(lambda: len(list(tmp_path.iterdir())) >= LEAD_TRIALS, 60, f"the first user's {LEAD_TRIALS} trials to start")
    second_sent = time.time()
    second = sweep("counted", trials, devices=["cpu0", "cpu1"], kwargs=kwargs, priority="batch", user=users[1], app=app)
    entries = {user: handle.get(timeout=120) for user, handle in zip(users, (first, second), strict=True)}
    runs = {user: [(_ts(e["started_at"]), _ts(e["finished_at"])) for e in got] for user, got in entries.items()}
    assert all(len(spans) == TRIALS for spans in runs.values())
    # Both have work waiting from the second's send until one's last trial starts.
    until = min(max(start for start, _ in spans) for spans in runs.values())
    used = {user: sum(max(0.0, min(end, until) - max(start, second_sent)) for start, end in spans)
            for user, spans in runs.items()}
    shares = {user: seconds / sum(used.values()) for user, seconds in used.items()}
    print(f"fair share over {until - second_sent:.1f} s with both waiting: "
          + ", ".join(f"{user} {shares[user]:.0%} ({used[user]:.1f} device-s)" for user in users))
    served = _served(entries, second_sent, shares)
    print(served)
    assert all(0.40 <= share <= 0.60 for share in shares.values()), served
    # The fleet says each one's usage, least first.
    share_now = fair_share(app=app)
    assert set(users) <= set(share_now)
    assert all(share_now[user]["usage_s"] >= TRIALS * TRIAL_S for user in users)
    # Prometheus: device-seconds per user and level, and the level's waits (send to start).
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for metric in FleetCollector(fleet.redis_url).collect() for s in metric.samples}
    for user in users:
        assert samples[("devicefleet_user_device_seconds_total", (("level", "batch"), ("user", user)))] >= TRIALS * TRIAL_S
    assert samples[("devicefleet_wait_seconds_count", (("level", "batch"),))] >= 2 * TRIALS
