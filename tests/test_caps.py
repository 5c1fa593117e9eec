"""Caps on the devices a user or team holds at once (tasks.core.caps): the rule as pure logic, the
take script's check on a Redis of the module's own, then two capped users on the session fleet."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime

import pytest

from tasks import fan_out, sweep, waiting
from tasks.core import keys
from tasks.core.caps import (
    Cap,
    CapUse,
    blocking,
    cap_uses,
    parse_limits,
    read_audit,
    read_cap_uses,
    remove_cap,
    set_cap,
    set_team,
)
from tasks.core.defaults import PREEMPT_GRACE_S
from tasks.core.errors import CapError, ConfigError
from tasks.core.jobstate import JobState, Took
from tasks.core.records import LeaseRecord
from tasks.core.registry import connect
from tasks.ops.exporter import FleetCollector
from tasks.ops.status import report
from tasks.ops.usage import parse_since, read_fleet_usage, usage_from
from tests.conftest import cli_env, wait_for

# -- the rule: pure logic ------------------------------------------------------------------------


def _lease(task_id: str, device: str, user: str | None) -> LeaseRecord:
    return LeaseRecord(device=device, worker=f"w-{device}", pid=1, host="h", task_id=task_id, since=0.0, user=user)


def test_a_cap_names_known_kinds_and_whole_counts_and_says_which_value_is_wrong():
    assert parse_limits(["gpu=4", "cpu=0"]) == {"gpu": 4, "cpu": 0}
    with pytest.raises(CapError, match=r"unknown device kind 'tpu' in 'tpu=2'; use cpu or gpu"):
        parse_limits(["tpu=2"])
    with pytest.raises(CapError, match=r"'gpu=-1': the devices must be a whole number"):
        parse_limits(["gpu=-1"])
    with pytest.raises(CapError, match=r"'gpu' is not kind=devices"):
        parse_limits(["gpu"])


def test_what_a_user_and_a_team_hold_is_counted_from_the_leases_by_kind():
    caps = {"user:ann": Cap(limits={"cpu": 1}), "team:ml": Cap(limits={"cpu": 3, "gpu": 1}, borrow=True,
                                                               members=["ann", "ben"])}
    leases = [_lease("a", "cpu0", "ann"), _lease("b", "cpu1@h2", "ben"), _lease("c", "gpu0", "cy"),
              _lease("d", "cpu2", None)]
    uses = {(use.subject, use.kind): use for use in cap_uses(caps, leases)}
    assert uses["user:ann", "cpu"].held == 1 and uses["user:ann", "cpu"].at_cap
    assert uses["team:ml", "cpu"].held == 2 and not uses["team:ml", "cpu"].at_cap
    assert uses["team:ml", "gpu"].held == 0
    assert uses["user:ann", "cpu"].line() == "ann: 1/1 cpu (cap), borrowing off"
    assert uses["team:ml", "cpu"].line() == "team ml: 2/3 cpu, borrowing on"
    assert blocking(caps, list(uses.values()), "ann", "cpu") == [uses["user:ann", "cpu"]]
    assert blocking(caps, list(uses.values()), "ben", "cpu") == []
    assert CapUse("user:x", "gpu", 4, 4, False).line() == "x: 4/4 gpu (cap), borrowing off"


def test_usage_sums_each_users_and_teams_hours_since_a_time():
    hours = {"7200 ann cpu held": 100.0, "7200 ann cpu busy": 25.0, "10800 ann cpu held": 50.0,
             "3600 ann cpu held": 1000.0, "10800 ben gpu held": 30.0, "bad": 1.0}
    rows = {(row.name, row.kind): row for row in usage_from(hours, {"ml": ["ann", "ben"]}, since=7300.0)}
    assert rows["ann", "cpu"].held_s == 150.0 and rows["ann", "cpu"].busy_s == 25.0  # the 3600 hour ended before
    assert rows["ann", "cpu"].busy_fraction == pytest.approx(25 / 150) and rows["ann", "cpu"].idle_s == 125.0
    assert rows["ben", "gpu"].busy_fraction is None and rows["ben", "gpu"].idle_s is None  # not measured
    assert rows["team ml", "cpu"].held_s == 150.0 and rows["team ml", "gpu"].held_s == 30.0
    totals = {"ann cpu held": 9.0, "ann cpu busy": 3.0, "7200 ann cpu held": 1.0}
    assert [(row.name, row.held_s, row.busy_s) for row in usage_from(totals, {}, since=None)] == [("ann", 9.0, 3.0)]
    assert parse_since("7d") == 7 * 86400 and parse_since("1.5h") == 5400
    with pytest.raises(ConfigError, match=r"--since '7x'"):
        parse_since("7x")


# -- the take script's check ----------------------------------------------------------------------


def _take(jobs: JobState, task_id: str, device: str, user: str | None) -> Took:
    return jobs.take(_lease(task_id, device, user), 10_000).status


def test_the_take_refuses_a_lease_over_a_cap_and_audits_each_grant(client):
    jobs = JobState(client)
    set_cap(client, {"cpu": 1}, user="ann")
    assert _take(jobs, "a1", "cpu0", "ann") is Took.OK
    reply = jobs.take(_lease("a2", "cpu1", "ann"), 10_000)
    assert reply.status is Took.CAPPED and reply.capped == "ann: 1/1 cpu (cap), borrowing off"
    assert client.hget(keys.LEASES, "a2") is None and client.get(keys.lease("a2")) is None  # nothing written
    assert _take(jobs, "b1", "cpu1", "ben") is Took.OK  # ben has no cap
    assert _take(jobs, "g1", "gpu0", "ann") is Took.OK  # ann's cap names cpu only
    # Her lease released: the next one is hers.
    client.delete(keys.lease("a1"))
    client.hdel(keys.LEASES, "a1")
    assert _take(jobs, "a2", "cpu1", "ann") is Took.OK
    audit = read_audit(client)
    assert [(grant.task_id, grant.count, grant.limit, grant.borrowed) for grant in audit] == [
        ("a1", 1, 1, False), ("a2", 1, 1, False)]
    assert audit[0].subject == "user:ann" and audit[0].kind == "cpu" and audit[0].device == "cpu0"


def test_a_dead_workers_expired_lease_stops_counting_when_its_key_expires(client):
    jobs = JobState(client)
    set_cap(client, {"cpu": 1}, user="ann")
    assert _take(jobs, "a1", "cpu0", "ann") is Took.OK
    assert _take(jobs, "a2", "cpu1", "ann") is Took.CAPPED
    client.delete(keys.lease("a1"))  # its worker was SIGKILLed: the key expires, its record waits for the reaper
    assert client.hget(keys.LEASES, "a1") is not None
    assert _take(jobs, "a2", "cpu1", "ann") is Took.OK
    _, uses = read_cap_uses(client)
    assert [(use.subject, use.held) for use in uses] == [("user:ann", 1)]


def test_after_a_redis_restart_the_count_comes_back_with_the_leases_the_workers_restore(client):
    jobs = JobState(client)
    set_cap(client, {"cpu": 1}, user="ann")
    attempt = jobs.take(_lease("a1", "cpu0", "ann"), 10_000).attempt
    assert attempt is not None
    client.delete(keys.lease("a1"), keys.LEASES)  # a restart that lost the leases (no persistence of them)
    assert _take(jobs, "a2", "cpu1", "ann") is Took.OK  # nothing counts now: a2 takes the one device
    client.delete(keys.lease("a2"), keys.LEASES)
    assert jobs.renew(attempt, 10_000, restore=True)  # the lease keeper writes its lease again
    assert _take(jobs, "a3", "cpu1", "ann") is Took.CAPPED
    assert [(use.subject, use.held) for use in read_cap_uses(client)[1]] == [("user:ann", 1)]


def test_over_a_borrowing_cap_the_lease_is_taken_as_borrowed(client):
    jobs = JobState(client)
    set_team(client, "ml", ["ann", "ben"])
    set_cap(client, {"cpu": 1}, team="ml", borrow=True)
    first = jobs.take(_lease("a1", "cpu0", "ann"), 10_000)
    second = jobs.take(_lease("b1", "cpu1", "ben"), 10_000)
    assert first.status is Took.OK and not first.borrowed
    assert second.status is Took.OK and second.borrowed and second.attempt is not None
    stored = client.get(keys.lease("b1"))
    assert stored == second.attempt.lease and json.loads(stored)["borrowed"] is True
    assert JobState(client).renew(second.attempt, 10_000, restore=True)  # the attempt names what is stored
    assert [(grant.count, grant.borrowed) for grant in read_audit(client)] == [(1, False), (2, True)]


class _LaterLease(LeaseRecord):
    """A lease record with a field after ``borrowed`` (as a later version may add one)."""

    note: str = "added later"


def test_a_borrowed_lease_is_stored_as_borrowed_wherever_the_field_stands_in_the_record(client):
    """The take marks a borrowed lease whatever the record's field order: not by rewriting the end
    of its JSON, which held only while ``borrowed`` was its last field."""
    jobs = JobState(client)
    set_cap(client, {"cpu": 0}, user="ann", borrow=True)
    record = _LaterLease(device="cpu0", worker="w-cpu0", pid=1, host="h", task_id="a1", since=0.0, user="ann")
    assert list(json.loads(record.to_json()))[-1] == "note"
    reply = jobs.take(record, 10_000)
    assert reply.status is Took.OK and reply.borrowed and reply.attempt is not None
    stored = client.get(keys.lease("a1"))
    assert stored == reply.attempt.lease == client.hget(keys.LEASES, "a1")
    assert json.loads(stored)["borrowed"] is True and json.loads(stored)["note"] == "added later"
    assert jobs.renew(reply.attempt, 10_000, restore=False) and jobs.release(reply.attempt)
    assert client.get(keys.lease("a1")) is None and client.hget(keys.LEASES, "a1") is None


def test_a_cap_for_an_unknown_team_or_no_cap_says_what_to_do(client):
    with pytest.raises(CapError, match=r"unknown team 'ml'; name its users first: devicefleet cap team ml"):
        set_cap(client, {"gpu": 2}, team="ml")
    with pytest.raises(CapError, match=r"user 'zed' has no cap"):
        remove_cap(client, user="zed")


# -- two capped users on the session fleet ---------------------------------------------------------

TRIALS = 20
TRIAL_S = 0.2


@pytest.mark.timeout(180)
def test_two_users_capped_at_one_cpu_never_hold_two_at_once(fleet, app, tmp_path):
    client = connect(fleet.redis_url)
    users = ("cap-ann", "cap-ben")
    for user in users:
        set_cap(client, {"cpu": 1}, user=user)
    try:
        kwargs = {"marker": str(tmp_path), "seconds": TRIAL_S}
        handles = [sweep("counted", [{"score": float(i)} for i in range(TRIALS)], devices=["cpu0", "cpu1"],
                         kwargs=kwargs, priority="batch", user=user, app=app) for user in users]
        results = [handle.get(timeout=150) for handle in handles]
    finally:
        for user in users:
            remove_cap(client, user=user)
    assert all(len(entries) == TRIALS and {e["status"] for e in entries} == {"ok"} for entries in results)
    grants = [grant for grant in read_audit(client) if grant.user in users]
    # Every grant the take script made, with the count it made: never two at once.
    assert {grant.user for grant in grants} == set(users)
    assert len(grants) >= 2 * TRIALS
    assert max(grant.count for grant in grants) == 1
    assert not any(grant.borrowed for grant in grants)
    # What each used: their trials sleep, so their CPU device was held mostly idle.
    used = {row.name: row for row in read_fleet_usage(client) if row.kind == "cpu"}
    for user in users:
        assert used[user].held_s >= TRIALS * TRIAL_S
        assert used[user].busy_fraction is not None and used[user].busy_fraction < 0.5
        assert used[user].idle_s is not None and used[user].idle_s > used[user].held_s / 2
    shown = subprocess.run([sys.executable, "-m", "tasks", "usage", "--since", "1h"], capture_output=True, text=True,
                           env=cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url), timeout=60)
    assert shown.returncode == 0 and f"{users[0]}: " in shown.stdout and "held idle" in shown.stdout, shown


@pytest.mark.timeout(120)
def test_a_job_held_back_by_its_cap_says_why_everywhere_and_runs_once_the_cap_goes(fleet, app):
    client = connect(fleet.redis_url)
    user = "cap-cy"
    set_cap(client, {"cpu": 0}, user=user)
    try:
        handle = fan_out("noop", ["cpu0"], user=user, app=app)
        line = f"{user}: 0/0 cpu (cap), borrowing off"
        held = wait_for(lambda: [job for job in waiting(app=app) if job.user == user and job.reason.startswith(line)],
                        30, "the capped job listed as waiting for its cap")
        assert held[0].job == "noop"
        assert any(cap["line"] == line for cap in report(fleet.redis_url)["caps"])
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for metric in FleetCollector(fleet.redis_url).collect() for s in metric.samples}
        assert samples[("devicefleet_cap_reached", (("kind", "cpu"), ("reason", line), ("subject", user)))] == 1
        listed = subprocess.run([sys.executable, "-m", "tasks", "cap", "list"], capture_output=True, text=True,
                                env=cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url), timeout=60)
        assert listed.returncode == 0 and line in listed.stdout, listed
    finally:
        remove_cap(client, user=user)
    entry = handle.get(timeout=60)["cpu0"]
    assert entry["status"] == "ok", entry


@pytest.mark.timeout(180)
def test_borrowed_work_gives_its_device_back_to_a_user_under_its_cap(fleet, app, tmp_path):
    client = connect(fleet.redis_url)
    ann, ben = "bw-ann", "bw-ben"
    for user in (ann, ben):
        set_cap(client, {"cpu": 1}, user=user, borrow=True)
    try:
        # The workers' reads name a user's lists from their next refresh on: ben's first job teaches them his.
        assert fan_out("noop", ["cpu0", "cpu1"], user=ben, app=app).get(timeout=60)["cpu1"]["status"] == "ok"
        # Ben is idle: ann, capped at one CPU, runs on both, the second borrowed.
        hers = fan_out("counted", ["cpu0", "cpu1"], kwargs={"marker": str(tmp_path), "seconds": 8.0, "steps": 80},
                       user=ann, app=app)
        wait_for(lambda: len([g for g in read_audit(client) if g.user == ann]) >= 2, 60, "ann's second grant")
        grants = [g for g in read_audit(client) if g.user == ann]
        assert [g.borrowed for g in grants[:2]] == [False, True] and grants[1].count == 2
        lent = grants[1]

        def ran_a_while() -> bool:  # past preempt_min_run_s: it reported 30 of its 80 steps (3 s)
            raw = client.get(keys.progress(lent.task_id))
            return raw is not None and json.loads(raw).get("step", 0) >= 30

        wait_for(ran_a_while, 60, "ann's borrowed job to run 3 s")
        sent = time.time()
        his = fan_out("noop", [lent.device], user=ben, app=app).get(timeout=60)[lent.device]
        assert his["status"] == "ok", his
        back_after = datetime.fromisoformat(his["started_at"]).timestamp() - sent
        print(f"ben got {lent.device} back {back_after:.2f} s after sending (preempt_grace_s {PREEMPT_GRACE_S:g})")
        assert back_after <= PREEMPT_GRACE_S + 1.0
        entries = hers.get(timeout=120)
        assert {e["status"] for e in entries.values()} == {"ok"}, entries
        assert entries[lent.device]["preemptions"] == 1
    finally:
        for user in (ann, ben):
            remove_cap(client, user=user)
