"""A run's ending as a value (pure logic, in process): the stop the worker sent travels into the
run's :class:`~tasks.worker.supervisor.Ended` and settles its outcome, which the runner matches
on (:func:`tasks.worker.disposition.settle`; mypy's ``assert_never`` there holds every outcome to
one handling); a job's options choose its run mode."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.core.errors import JobCrashed, Preempted, WorkerStopped
from tasks.core.priority import Level
from tasks.core.records import ErrorInfo, GangSpec, GroupSpec, JobOptions
from tasks.core.wire import STOPS, Outcome, StopJob, StopReason
from tasks.worker.modes import RunModes
from tasks.worker.supervisor import Ended


def _stop(reason: StopReason) -> StopJob:
    return StopJob(job_id="j1", reason=reason, message=f"stopped: {reason.value}",
                   level=Level.URGENT if reason is StopReason.PREEMPT else None)


def _ended(outcome: Outcome, error: str | None = None) -> Ended:
    return Ended(outcome=outcome, finished=None, error=ErrorInfo(type=error, message="m") if error else None,
                 error_module=None, pid=1, retired=None)


def test_a_fenced_stop_and_a_preemption_are_outcomes_of_their_own():
    assert STOPS[StopReason.FENCED] == (WorkerStopped, Outcome.FENCED)
    assert STOPS[StopReason.PREEMPT] == (Preempted, Outcome.PREEMPTED)


@pytest.mark.parametrize("outcome", list(Outcome))
def test_a_run_its_worker_fenced_off_ends_fenced_however_its_process_ended(outcome: Outcome):
    stop = _stop(StopReason.FENCED)
    ended = _ended(outcome).under(stop)
    assert ended.outcome is Outcome.FENCED and ended.stop is stop


@pytest.mark.parametrize("outcome", [o for o in Outcome if o is not Outcome.OK])
def test_a_run_asked_to_make_way_ends_preempted_unless_it_finished_first(outcome: Outcome):
    stop = _stop(StopReason.PREEMPT)
    ended = _ended(outcome, "JobCrashed").under(stop)
    assert (ended.outcome, ended.stop) == (Outcome.PREEMPTED, stop)
    assert ended.error is not None and ended.error.type == "JobCrashed"  # what it said is kept
    assert _ended(Outcome.OK).under(stop).outcome is Outcome.OK


def test_preempted_or_fenced_is_never_a_jobs_own_saying():
    """A job that raised Preempted (or ended so) though its worker sent no such stop failed."""
    for outcome in (Outcome.PREEMPTED, Outcome.FENCED):
        assert _ended(outcome, "Preempted").under(None).outcome is Outcome.ERROR
        assert _ended(outcome, "Preempted").under(_stop(StopReason.CANCEL)).outcome is Outcome.ERROR


@pytest.mark.parametrize("reason", [StopReason.CANCEL, StopReason.TIMEOUT, StopReason.SHUTDOWN, StopReason.GANG])
def test_other_stops_leave_the_outcome_the_process_said(reason: StopReason):
    stop = _stop(reason)
    for outcome in (Outcome.OK, Outcome.ERROR, Outcome.CANCELLED, Outcome.PEER_LOST, Outcome.GIVE_WAY):
        ended = _ended(outcome).under(stop)
        assert (ended.outcome, ended.stop) == (outcome, stop)


@pytest.mark.parametrize("reason", list(StopReason))
def test_a_run_ended_by_a_stop_before_it_ran_carries_its_error_and_outcome(reason: StopReason):
    stop = _stop(reason)
    ended = Ended.stopped(stop)
    error, outcome = STOPS[reason]
    assert (ended.outcome, ended.stop, ended.pid) == (outcome, stop, 0)
    assert ended.error is not None and (ended.error.type, ended.error.message) == (error.__name__, stop.message)
    # The outcome it carries is the one its stop settles it to.
    assert ended.under(stop).outcome is outcome


def test_a_crash_keeps_its_error_under_no_stop():
    ended = Ended.by_worker(JobCrashed, "died", pid=3, retired="crashed").under(None)
    assert (ended.outcome, ended.crashed, ended.stop) == (Outcome.ERROR, True, None)


def test_the_options_choose_one_run_mode():
    sentinel: Any = object()
    modes = RunModes.build(sentinel, sentinel, "cpu0", sentinel, "127.0.0.1", expires_s=60, lease_ttl_s=30.0,
                           preempt_grace_s=5.0)
    gang = GangSpec(id="g", devices=["cpu0", "cpu1"], seq=1, backend="gloo", max_restarts=0, join_timeout_s=1.0,
                    collective_timeout_s=1.0)
    group = GroupSpec(id="gr", devices=["cpu0", "cpu1"], seq=1)
    assert modes.of(JobOptions()) is modes.plain
    assert modes.of(JobOptions(gang=gang)) is modes.gang
    assert modes.of(JobOptions(group=group)) is modes.group
    assert modes.gang.plain is modes.group.plain is modes.plain  # built once, shared
