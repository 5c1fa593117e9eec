"""A job process runs one user's jobs (tasks/worker/owners.py): the choices, in process.

The same on a real fleet, two users alternating on one device: tests/test_isolation.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks.core.wire import ProcessSpec, RunJob
from tasks.worker import owners
from tasks.worker.supervisor import ProcessPolicy, Supervisor


@dataclass(eq=False)
class _Process:
    owner: str | None
    alive: bool = True
    jobs_run: int = 1


def _job(user: str | None) -> RunJob:
    options = {} if user is None else {"user": user}
    return RunJob(job_id="j", job="echo", kwargs={}, options=options, fan_out_id="f")


def test_a_job_takes_its_users_warm_process_then_the_spare_and_never_anothers() -> None:
    alice, bob, spare, alice_older = _Process("alice"), _Process("bob"), _Process(None), _Process("alice")
    idle = [bob, alice, spare, alice_older]  # most recently used first
    assert owners.pick(idle, "alice") is alice
    assert owners.pick(idle, "carol") is spare
    assert owners.pick([bob, alice], "carol") is None
    assert owners.spares(idle) == 1
    # The least recently used owned process goes first; a spare never does.
    assert owners.victim(idle) is alice_older
    assert owners.victim([spare]) is None


def test_a_job_with_no_user_belongs_to_the_local_user_and_a_pack_to_one_user() -> None:
    assert owners.owner_of(_job(None)) == owners.LOCAL
    assert owners.owner_of(_job("alice")) == "alice"
    assert owners.pack_owner([_job("alice"), _job("alice")]) == "alice"
    with pytest.raises(ValueError, match=r"mixes the jobs of users \['alice', 'bob'\]"):
        owners.pack_owner([_job("alice"), _job("bob")])


def _supervisor(kept: int, slots: int = 1) -> Supervisor:
    spec = ProcessSpec(device="cpu0", torch_device="cpu", cores=[0], torch_threads=1, job_modules=[],
                       artifacts_dir="/nonexistent", tensorboard_dir="/nonexistent", result_expires_s=60)
    return Supervisor(spec, {}, Path("."), ProcessPolicy(kept_user_processes=kept), "cpu0", slots=slots)


def test_the_pool_keeps_a_spare_and_other_users_processes_within_its_bound() -> None:
    sup = _supervisor(kept=1)
    alice, bob = _Process("alice"), _Process("bob")
    # One user: their process and the spare, as before users were kept apart.
    sup._idle = [alice, _Process(None)]
    assert sup._room() == (False, None, None)
    # Bob took the spare: a fresh spare, alice's process kept (within slots + spare + 1).
    sup._idle, sup._busy = [alice], {bob}
    assert sup._room() == (True, None, None)
    # A third user took that spare too: the least recently used owned idle process makes room.
    carol, older = _Process("carol"), _Process("dave")
    sup._idle, sup._busy = [alice, older], {carol}
    assert sup._room() == (True, older, None)
    # Everyone's busy at the bound: nothing to retire, wait.
    sup._idle, sup._busy = [], {alice, bob, carol}
    assert sup._room() == (False, None, None)


def test_with_no_kept_processes_a_user_switch_retires_the_old_users_process() -> None:
    sup = _supervisor(kept=0)
    alice, bob = _Process("alice"), _Process("bob")
    sup._idle, sup._busy = [alice], {bob}
    assert sup._room() == (True, alice, None)
    # Its spare's spawn is in flight: nothing more to do until it is ready.
    sup._idle, sup._busy, sup._spawning = [], {bob}, 1
    assert sup._room() == (False, None, None)


def test_a_job_waiting_for_a_process_asks_for_one_beyond_the_spare() -> None:
    sup = _supervisor(kept=1)
    alice, bob = _Process("alice"), _Process("bob")
    sup._idle, sup._spawning, sup._waiting = [alice, bob], 1, 0
    assert sup._room() == (False, None, None)  # the spare on its way is enough
    sup._waiting = 1  # carol's job waits for that one: another spare, bob's (least recent) makes room
    assert sup._room() == (True, bob, None)


def test_under_job_accounts_a_waiting_user_gets_a_process_of_their_own_then_the_last_user_a_spare() -> None:
    """Job accounts (tasks/core/accounts.py): a process starts as one user's account, so no
    spare is anyone's; whose starts next is a pure choice."""
    plan = owners.plan_accounts_spawn
    alice, alice_fresh = _Process("alice"), _Process("alice", jobs_run=0)
    bob, local_fresh = _Process("bob"), _Process("", jobs_run=0)
    # A worker's start: its first process (no user's) is alive; one more, a spare of the last
    # (no) user, to reach one per slot and a spare.
    assert plan([local_fresh], 0, [], {}, last="", warm=2, most=2, spares=1) == ("", None)
    # Alice's job runs in her process and she has a fresh spare: enough.
    assert plan([alice_fresh], 1, [], {}, last="alice", warm=2, most=2, spares=1) is None
    # Bob's job waits: a process for bob, and at the bound the least recently used idle one goes,
    # whoever's it is (never a fresh one of bob's, which is what he waits for).
    assert plan([alice, alice_fresh], 0, [], {"bob": 1}, last="alice", warm=2, most=2, spares=1) == ("bob", alice_fresh)
    assert plan([alice], 1, [], {"bob": 1}, last="alice", warm=2, most=3, spares=1) == ("bob", None)
    # ... once: bob's process is starting, and then the last user's spare comes next.
    assert plan([alice], 1, ["bob"], {"bob": 1}, last="bob", warm=2, most=3, spares=1) is None
    assert plan([alice, bob], 1, [], {}, last="bob", warm=2, most=4, spares=1) == ("bob", None)
    # A spare for the last user never retires that user's own fresh spare to make room.
    assert plan([alice_fresh], 1, [], {}, last="alice", warm=1, most=2, spares=2) is None
    # Everyone's busy at the bound: nothing to retire, wait.
    assert plan([], 2, [], {"carol": 1}, last="alice", warm=2, most=2, spares=1) is None


def test_a_packs_leader_sends_another_users_trial_back_to_run_alone() -> None:
    from tasks.core.records import JobOptions
    from tasks.core.wire import Outcome
    from tasks.worker.launch import Launch
    from tasks.worker.modes.pack import _one_users
    from tasks.worker.pack import Room
    from tasks.worker.slots import Slot

    slot = Slot(index=0, cores=[0], threads=1, budget_bytes=None)

    def launch(job_id: str, user: str) -> Launch:
        message = RunJob(job_id=job_id, job="packed", kwargs={}, options={"user": user}, fan_out_id="f")
        return Launch(message=message, options=JobOptions(user=user), watch=None, slot=slot)  # type: ignore[arg-type]

    leader, mine, theirs = launch("a", "alice"), launch("b", "alice"), launch("c", "bob")
    room = Room(leader)
    room.expect("b")
    room.expect("c")
    assert _one_users(leader, room, [mine, theirs]) == [mine]
    ended = room.join(theirs)  # its thread gets its ending at once: back to its queue
    assert ended.outcome is Outcome.UNPACK
    assert ended.error is not None and "its user is not its pack leader's (alice)" in ended.error.message
