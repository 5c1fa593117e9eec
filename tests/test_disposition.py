"""Where a job's message goes (pure, in process): each ending's disposition
(:func:`tasks.worker.disposition.settle`), each lease refusal's (:func:`tasks.worker.admission.of_lease`),
and the one :func:`~tasks.worker.disposition.apply` that raises Celery's exception for it."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import Ignore, Reject, Retry

from tasks.core.defaults import CAP_RETRY_S, GIVE_WAY_S
from tasks.core.errors import DeviceFailed, JobCrashed, WorkerLost
from tasks.core.keys import FRONT_HEADER, OPTIONS_HEADER, PREEMPTIONS_HEADER
from tasks.core.priority import Level
from tasks.core.records import JobOptions
from tasks.core.wire import Outcome, StopJob, StopReason
from tasks.worker import disposition
from tasks.worker.admission import of_lease
from tasks.worker.disposition import Drop, JobFacts, Redeliver, Requeue, Store, apply, settle
from tasks.worker.lease import Take, Taken
from tasks.worker.supervisor import Ended

pytestmark = pytest.mark.timeout(30)


def _ended(outcome: Outcome, stop: StopJob | None = None) -> Ended:
    return Ended.by_worker(JobCrashed, "m", pid=1, retired=None, outcome=outcome, stop=stop)


@pytest.mark.parametrize("outcome", [Outcome.OK, Outcome.ERROR, Outcome.CANCELLED, Outcome.PEER_LOST])
def test_an_ending_of_the_job_itself_is_stored(outcome: Outcome):
    ended = _ended(outcome)
    assert settle(ended, JobFacts(options=JobOptions())) == Store(ended=ended)


def test_a_fenced_run_is_dropped_and_its_lease_left_to_expire():
    assert settle(_ended(Outcome.FENCED), JobFacts(options=JobOptions())) == Drop(fenced=True)


def test_a_preempted_job_goes_back_to_the_front_at_once_its_preemptions_counted():
    stop = StopJob(job_id="j", reason=StopReason.PREEMPT, message="m", level=Level.URGENT)
    back = settle(_ended(Outcome.PREEMPTED, stop), JobFacts(options=JobOptions(), preemptions=2))
    assert isinstance(back, Requeue)
    assert (back.delay_s, back.front, back.release_lease, back.preempted) == (0.0, True, True, True)
    assert back.headers == {PREEMPTIONS_HEADER: 3} and "urgent" in back.why


def test_a_preempted_job_that_borrowed_comes_back_later_at_the_back():
    back = settle(_ended(Outcome.PREEMPTED), JobFacts(options=JobOptions(), borrowed=True))
    assert isinstance(back, Requeue)
    assert (back.delay_s, back.front, back.headers) == (CAP_RETRY_S, False, {PREEMPTIONS_HEADER: 1})


def test_an_unpacked_member_goes_back_at_once_to_run_alone():
    back = settle(_ended(Outcome.UNPACK), JobFacts(options=JobOptions(pack=4, user="alice")))
    assert isinstance(back, Requeue) and back.release_lease and back.delay_s == 0
    alone = back.headers[OPTIONS_HEADER]
    assert alone["pack"] is None and alone["user"] == "alice"


def test_a_rank_that_gave_way_comes_back_later_its_lease_settled_after():
    assert settle(_ended(Outcome.GIVE_WAY), JobFacts(options=JobOptions())) == Requeue(delay_s=GIVE_WAY_S)


def test_a_failed_device_stores_a_job_sent_by_name_and_hands_back_a_shared_one():
    stop = StopJob(job_id="j", reason=StopReason.DEVICE_FAILED, message="gpu0 failed")
    ended = _ended(Outcome.DEVICE_FAILED, stop)
    stored = settle(ended, JobFacts(options=JobOptions(), by_name=True))
    assert isinstance(stored, Store) and stored.ended is ended
    assert isinstance(stored.failed, DeviceFailed) and str(stored.failed) == "gpu0 failed"
    back = settle(ended, JobFacts(options=JobOptions()))
    assert isinstance(back, Requeue) and back.release_lease and not back.front and back.delay_s == 0


def test_the_black_hole_rule_is_asked_only_of_an_error():
    asked: list[Outcome] = []

    def sent_back(ended: Ended) -> bool:
        asked.append(ended.outcome)
        return True

    facts = JobFacts(options=JobOptions(), sent_back=sent_back)
    back = settle(_ended(Outcome.ERROR), facts)
    assert isinstance(back, Requeue) and back.release_lease and back.delay_s == 0
    assert isinstance(settle(_ended(Outcome.OK), facts), Store)
    assert asked == [Outcome.ERROR]


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_outcome_has_one_disposition(outcome: Outcome):
    assert isinstance(settle(_ended(outcome), JobFacts(options=JobOptions())), Store | Drop | Requeue | Redeliver)


def _taken(outcome: Take, **kw: Any) -> Taken:
    return Taken(outcome, **kw)


def test_each_lease_refusal_has_its_disposition():
    woken: list[bool] = []
    worker: Any = SimpleNamespace(service=SimpleNamespace(wake=lambda: woken.append(True)))
    lost = WorkerLost("lost")
    assert of_lease(worker, "j", _taken(Take.TAKEN, attempt=object())) is None  # type: ignore[arg-type]
    assert of_lease(worker, "j", _taken(Take.CAPPED)) == Requeue(delay_s=CAP_RETRY_S)
    assert of_lease(worker, "j", _taken(Take.LOST, error=lost)) == Store(failed=lost)
    assert of_lease(worker, "j", _taken(Take.RUNNING_ELSEWHERE)) == Drop()
    assert of_lease(worker, "j", _taken(Take.FINISHED)) == Drop()
    assert of_lease(worker, "j", _taken(Take.UNCONFIRMED)) == Redeliver("job j: no replica confirmed its lease")
    back = of_lease(worker, "j", _taken(Take.OUT_OF_SERVICE, out="drained (by ops)"))
    assert isinstance(back, Requeue) and back.front and back.release_lease and "drained" in back.why
    assert woken == [True]  # its consumer stops taking now


class FakeTask:
    """A job task's ``retry``, recorded: what Celery's would be asked to send again."""

    def __init__(self, headers: dict[str, Any]) -> None:
        self.request = SimpleNamespace(id="j", headers=headers)
        self.app = SimpleNamespace(conf=SimpleNamespace(result_expires=60))
        self.retried: dict[str, Any] = {}

    def retry(self, **kwargs: Any) -> Retry:
        self.retried = kwargs
        return Retry(when=kwargs.get("countdown"))


class FakeLeases:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def release(self, job_id: str) -> None:
        self.calls.append(("release", job_id))

    def fenced(self, job_id: str, keep_s: int) -> None:
        self.calls.append(("fenced", job_id))

    def settle(self, job_id: str, request: Any) -> None:
        self.calls.append(("settle", job_id))


class FakeRun:
    def __init__(self, headers: dict[str, Any] | None = None, entry: dict[str, Any] | None = None) -> None:
        self.task = FakeTask(headers or {"id": "j"})
        self.leases = FakeLeases()
        self.worker = SimpleNamespace(leases=self.leases, device=SimpleNamespace(name="cpu0"), client=None)
        self.job_id = "j"
        self.idled: list[bool] = []
        self.entry = entry

    def idle(self, done: bool = True) -> None:
        self.idled.append(done)

    def end(self, ended: Ended | None = None, failed: BaseException | None = None) -> dict[str, Any] | None:
        return self.entry


def test_apply_stores_an_end_and_returns_its_entry():
    run: Any = FakeRun(entry={"device": "cpu0"})
    assert apply(Store(ended=_ended(Outcome.OK)), run) == {"device": "cpu0"}
    assert run.idled == [] and run.leases.calls == []  # its end's store idles it and releases the lease


def test_apply_of_a_cancelled_store_settles_the_lease_and_ignores():
    run: Any = FakeRun(entry=None)  # REVOKED stored already
    with pytest.raises(Ignore):
        apply(Store(ended=_ended(Outcome.CANCELLED)), run)
    assert run.leases.calls == [("settle", "j")]


def test_apply_of_a_drop_ignores_and_a_fenced_one_leaves_its_lease_to_expire():
    run: Any = FakeRun()
    with pytest.raises(Ignore):
        apply(Drop(), run, ran=False)
    assert run.leases.calls == [] and run.idled == []  # a copy dropped at its take: another holds the lease
    with pytest.raises(Ignore):
        apply(Drop(fenced=True), run)
    assert run.leases.calls == [("fenced", "j")] and run.idled == [False]


def test_apply_of_a_requeue_retries_with_its_countdown_bound_and_headers(monkeypatch):
    counted: list[str] = []
    monkeypatch.setattr(disposition, "count_preemption", lambda client, device: counted.append(device))
    run: Any = FakeRun(headers={"id": "j", "x": 1})
    back = Requeue(front=True, headers={PREEMPTIONS_HEADER: 2}, release_lease=True, preempted=True, why="made way")
    with pytest.raises(Retry):
        apply(back, run)
    assert run.task.retried == {"countdown": 0.0, "max_retries": None,
                                "headers": {"id": "j", "x": 1, PREEMPTIONS_HEADER: 2, FRONT_HEADER: True}}
    assert run.leases.calls == [("release", "j")] and counted == ["cpu0"] and run.idled == [False]


def test_apply_of_a_plain_requeue_keeps_the_message_headers_and_its_bound():
    run: Any = FakeRun()
    with pytest.raises(Retry):
        apply(Requeue(delay_s=GIVE_WAY_S, max_retries=3), run, ran=False)
    assert run.task.retried == {"countdown": GIVE_WAY_S, "max_retries": 3}  # Celery keeps the request's headers
    assert run.leases.calls == [] and run.idled == []


def test_apply_of_a_redelivery_rejects_back_to_the_queue():
    with pytest.raises(Reject) as rejected:
        apply(Redeliver("no replica"), FakeRun(), ran=False)  # type: ignore[arg-type]
    assert rejected.value.requeue is True and rejected.value.reason == "no replica"


def test_only_apply_tells_celery_and_only_the_modes_ask_which_mode():
    """One module of the worker raises Celery's Retry, Ignore or Reject; no module outside the
    run modes asks which mode a job runs in (its options' group, gang or pack, a pack's room)."""
    worker = Path(__file__).resolve().parent.parent / "tasks" / "worker"
    tells, asks = [], []
    for path in sorted(worker.rglob("*.py")):
        text, name = path.read_text(), str(path.relative_to(worker))
        if path.name != "disposition.py" and re.search(r"Ignore\(\)|\.retry\(|Reject\(", text):
            tells.append(name)
        if path.parent.name != "modes" and re.search(r"options\.(group|gang|pack) is|\.room_of\(", text):
            asks.append(name)
    assert (tells, asks) == ([], [])
