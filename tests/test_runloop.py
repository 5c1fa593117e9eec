"""The one run loop (tasks/worker/runloop.py) against a scripted job process: a lone job is a pack
of one member, so both read the same messages and end the same way, except where a pack can
send its members back to run alone."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.core.wire import (
    Finished,
    LogLines,
    Outcome,
    Proceed,
    Report,
    RunJob,
    RunPack,
    StopJob,
    StopReason,
    StoreOpened,
)
from tasks.worker.jobprocess import ProcessGone
from tasks.worker.runloop import Ended, RunLoop


class _Process:
    """A job process that says ``script`` in order (an exception: it went), then nothing."""

    pid = 4242

    def __init__(self, script: list[Any]) -> None:
        self.script = list(script)
        self.sent: list[Any] = []
        self.killed_because: str | None = None

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def receive(self, timeout: float) -> Any:
        if self.killed_because is not None:
            raise ProcessGone("killed by SIGKILL")
        if not self.script:
            return None
        said = self.script.pop(0)
        if isinstance(said, BaseException):
            raise said
        return said

    def kill(self, because: str) -> None:
        self.killed_because = self.killed_because or because

    def tail_text(self) -> str:
        return "step 3 | boom"

    def exit_text(self) -> str:
        return "killed by SIGKILL"


class _Watch:
    def __init__(self, stop: StopJob | None = None) -> None:
        self.reports: list[dict[str, Any]] = []
        self.lines: list[Any] = []
        self.heard_: list[Any] = []
        self.asked = stop

    def report(self, fields: dict[str, Any]) -> None:
        self.reports.append(fields)

    def log(self, lines: Any) -> None:
        self.lines.extend(lines)

    def heard(self, message: Any) -> Proceed | None:
        self.heard_.append(message)
        return Proceed()

    def stop(self) -> StopJob | None:
        return self.asked

    def slot_stop(self) -> StopJob | None:
        return None

    def act_on(self, stop: StopJob) -> StopJob | None:
        return stop

    def memory(self, used: int) -> None: ...


def _job(job_id: str) -> RunJob:
    return RunJob(job_id=job_id, job="train", kwargs={}, fan_out_id="f1")


def _run(process: _Process, ids: list[str], packed: bool,
         watches: dict[str, _Watch] | None = None) -> tuple[dict[str, Ended], tuple[Any, Any]]:
    watches = watches or {job_id: _Watch() for job_id in ids}
    ends: dict[str, Ended] = {}

    def on_end(job_id: str, ended: Ended) -> None:
        assert job_id not in ends, f"{job_id} ended twice"
        ends[job_id] = ended

    result = RunLoop(process, [_job(i) for i in ids], watches, 0.0, None, on_end,  # type: ignore[arg-type]
                     packed=packed).wait()
    return ends, result


@pytest.mark.parametrize("packed", [False, True])
def test_a_lone_job_and_a_pack_of_one_read_the_same_messages_and_end_the_same(packed: bool) -> None:
    finished = Finished(outcome=Outcome.OK, rss_bytes=1, job_id="j1" if packed else None)
    process = _Process([Report(fields={"step": 1}), LogLines(lines=[("out", "hello")]), StoreOpened(port=1234),
                        finished])
    watch = _Watch()
    ends, (last, retire) = _run(process, ["j1"], packed, {"j1": watch})
    assert ends == {"j1": Ended(outcome=Outcome.OK, finished=finished, error=None, error_module=None, pid=4242,
                                retired=None)}
    assert last == finished and retire is None
    assert watch.reports == [{"step": 1}] and watch.lines == [("out", "hello")]
    assert watch.heard_ == [StoreOpened(port=1234)]  # the mode's message, answered by its watch
    first = process.sent[0]
    assert isinstance(first, RunPack) if packed else first == _job("j1")  # a lone job goes as its own RunJob
    assert process.sent[1:] == [Proceed()]


def test_a_crash_ends_a_lone_job_naming_it_and_sends_a_packs_members_back_to_run_alone() -> None:
    ends, (last, retire) = _run(_Process([ProcessGone("killed by SIGSEGV")]), ["j1"], packed=False)
    lone = ends["j1"]
    assert last is None and retire == lone.retired == "crashed: killed by SIGSEGV"
    assert lone.crashed and lone.outcome is Outcome.ERROR and lone.error is not None
    assert "died: killed by SIGSEGV; its last lines: step 3 | boom" in lone.error.message

    ends, (last, retire) = _run(_Process([ProcessGone("killed by SIGSEGV")]), ["j1", "j2"], packed=True)
    assert retire == "crashed: killed by SIGSEGV"
    assert {job_id: e.outcome for job_id, e in ends.items()} == {"j1": Outcome.UNPACK, "j2": Outcome.UNPACK}
    assert all(e.shared_by == 2 for e in ends.values())


def test_a_member_past_its_grace_ends_with_its_stops_error_and_a_packs_others_run_alone() -> None:
    cancel = StopJob(job_id="j1", reason=StopReason.CANCEL, message="job j1 was cancelled", grace_s=0.0)
    process = _Process([])
    ends, (_, retire) = _run(process, ["j1"], packed=False, watches={"j1": _Watch(cancel)})
    assert retire == "ended after cancel" and process.killed_because is not None
    lone = ends["j1"]
    assert lone.outcome is Outcome.CANCELLED and lone.stop == cancel and lone.error is not None
    assert lone.error.type == "JobCancelled"
    assert "did not stop at ctx.progress() within 0 s" in lone.error.message
    assert process.sent[1] == cancel

    process = _Process([])
    ends, (_, retire) = _run(process, ["j1", "j2"], packed=True, watches={"j1": _Watch(cancel), "j2": _Watch()})
    assert retire == "ended after cancel"
    assert {job_id: e.outcome for job_id, e in ends.items()} == {"j1": Outcome.CANCELLED, "j2": Outcome.UNPACK}
    assert [m.job_id for m in process.sent[1:]] == ["j1"]  # its cancel went to it alone


def test_a_lone_job_the_worker_ended_is_stopped_under_the_stop_it_was_sent() -> None:
    """A preempted job whose process the worker ended (it is leaving) ends preempted, not failed:
    the ending is the process's, under the stop the worker sent it."""
    preempt = StopJob(job_id="j1", reason=StopReason.PREEMPT, message="make way", grace_s=60.0)
    process = _Process([None])
    watch = _Watch(preempt)
    original = process.receive

    def receive(timeout: float) -> Any:
        if len(process.sent) > 1:  # the stop went: the worker leaves, ending the process
            process.kill("the worker is leaving")
        return original(timeout)

    process.receive = receive  # type: ignore[method-assign]
    ends, (_, retire) = _run(process, ["j1"], packed=False, watches={"j1": watch})
    assert retire == "the worker is leaving"
    assert ends["j1"].outcome is Outcome.PREEMPTED and ends["j1"].stop == preempt
    assert ends["j1"].error is not None and ends["j1"].error.type == "WorkerStopped"
