"""Packed trials, the job side, in-process: the packed trainer against ``train`` run alone, and
the job process's handling of a RunPack (each member's own ending, progress and Finished).

The worker's side (the pull of a pack's siblings, leases, re-running a dead pack's members) runs
with real workers in the sweep tests; here the job process's runtime runs in this process with a
real pipe to read what it sends, as the worker would.
"""

from __future__ import annotations

import os
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel
from safetensors.torch import load_file
from torch import nn

from tasks.core.batch_order import LoaderOrder
from tasks.core.job import DEFINED, JobContext, PackData, Packing, job
from tasks.core.wire import (
    DeviceView,
    Finished,
    Outcome,
    ProcessSpec,
    Report,
    RunJob,
    RunPack,
    StopJob,
    StopReason,
    decode_from_job_process,
)
from tasks.jobproc.channel import Channel
from tasks.jobproc.pack_run import run_pack
from tasks.jobproc.packed import Member, choose_pack, probe_bytes, train_pack
from tasks.jobproc.registry import JobRegistry
from tasks.jobproc.runtime import JobRuntime, _Baseline
from tasks.jobs.loader import build_loader
from tasks.jobs.models import build
from tasks.jobs.train import TRAIN_PACKING, TrainParams, train

pytestmark = pytest.mark.timeout(120)


class ToyParams(BaseModel):
    width: int = 8
    epochs: int = 2
    batch_size: int = 16
    lr: float = 0.01
    seed: int = 0
    #: A member whose data holds NaN: its loss is not finite.
    poison: bool = False


def _toy_data(params: ToyParams) -> PackData:
    generator = torch.Generator().manual_seed(params.seed)
    x = torch.randn(64, 4, generator=generator)
    if params.poison:
        x[:] = float("nan")
    y = (x[:, 0] > 0).long()
    return PackData(x[:48], y[:48], x[48:], y[48:])


@job("packtoy", params=ToyParams, pack=Packing(
    key=("width", "epochs", "batch_size"),
    model=lambda params, data: nn.Sequential(nn.Linear(4, params.width), nn.ReLU(), nn.Linear(params.width, 2)),
    data=_toy_data))
def packtoy(ctx: JobContext, params: ToyParams) -> dict[str, Any]:
    return {}


@job("unpackable", params=ToyParams)
def unpackable(ctx: JobContext, params: ToyParams) -> dict[str, Any]:
    return {}


def _ctx(tmp_path: Path, name: str) -> JobContext:
    return JobContext(device="cpu0", torch_device="cpu", job_id=name, artifacts_dir=tmp_path / name)


def test_batch_order_is_train_loaders(tmp_path):
    """A packed member sees its batches in the order its DataLoader would give ``train``."""
    loader = build_loader(torch.utils.data.TensorDataset(torch.arange(50)), batch_size=16, num_workers=0,
                          cuda=False, shuffle=True, seed=7)
    order = LoaderOrder(7, 50)
    for _ in range(3):  # each epoch runs its loader to the end, as train's does
        epoch = torch.cat([batch for (batch,) in loader])
        assert torch.equal(epoch, order.next_epoch())


def test_packed_train_equals_each_trial_alone(tmp_path):
    """4 trials (own seeds, lr, weight decay) packed end within 0.01 accuracy of each run alone."""
    torch.set_num_threads(1)
    kwargs = [dict(epochs=2, lr=lr, seed=seed, weight_decay=decay, num_workers=0)
              for lr, seed, decay in [(3e-3, 0, 0.0), (1e-2, 1, 1e-3), (1e-3, 2, 0.0), (5e-3, 3, 1e-2)]]
    params = [TrainParams(**k) for k in kwargs]
    alone = [train(_ctx(tmp_path, f"alone{i}"), p) for i, p in enumerate(params)]
    early: list[tuple[int, Any]] = []
    members = [Member(_ctx(tmp_path, f"packed{i}"), p, TRAIN_PACKING.data(p)) for i, p in enumerate(params)]
    ends = train_pack(TRAIN_PACKING, members, "cpu", lambda i, out, err: early.append((i, err)))
    assert early == [] and sorted(ends) == [0, 1, 2, 3]
    for i, out in ends.items():
        assert abs(out["accuracy"] - alone[i]["accuracy"]) <= 0.01, (i, out["accuracy"], alone[i]["accuracy"])
        assert out["loss"] == pytest.approx(alone[i]["loss"], rel=1e-3)
        assert out["packed"] == {"members": 4, "index": i, "pid": os.getpid()}
        assert len(out["history"]) == 2 and out["model"] == "mlp" and out["dataset"] == "digits"
        # Its own checkpoint, in its own folder, that loads into the model train builds.
        assert Path(out["checkpoint"]).parent == tmp_path / f"packed{i}"
        net = build(params[i].model, 64, 10, params[i].hidden)
        net.load_state_dict(load_file(out["checkpoint"]))
    assert len({out["weights_digest"] for out in ends.values()}) == 4


def test_a_freed_place_is_refilled_and_its_trial_trains_as_alone(tmp_path):
    """A pack of 2 whose member is cancelled after its first epoch: the third trial takes its
    place (its own seed, lr, step count and epochs) and ends where it ends alone; the member
    that finished first ends at once, not when the refilled one does."""
    torch.set_num_threads(1)
    params = [TrainParams(epochs=2, lr=lr, seed=seed, num_workers=0) for lr, seed in [(3e-3, 0), (1e-2, 1), (5e-3, 2)]]
    cancel = _ctx(tmp_path, "cancelled")
    cancel.cancelled = lambda: True  # its first progress() raises JobCancelled
    members = [Member(_ctx(tmp_path, "kept"), params[0], TRAIN_PACKING.data(params[0])),
               Member(cancel, params[1], TRAIN_PACKING.data(params[1]))]
    queue = [Member(_ctx(tmp_path, "third"), params[2], TRAIN_PACKING.data(params[2]))]
    asked: list[int] = []

    def refill(index: int) -> Member | None:
        asked.append(index)
        return queue.pop() if queue else None

    ended: list[tuple[str, Any, Any]] = []
    ends = train_pack(TRAIN_PACKING, members, "cpu",
                      lambda i, out, err: ended.append((members[i].ctx.job_id if err else str(i), out, err)), refill)
    assert asked[0] == 1 and ended[0][0] == "cancelled" and type(ended[0][2]).__name__ == "JobCancelled"
    # "kept" finished at the end of epoch 2, while the third trial still had an epoch to go.
    assert ended[1][0] == "0" and ended[1][1]["packed"] == {"members": 2, "index": 0, "pid": os.getpid()}
    assert sorted(ends) == [1]
    third = ends[1]
    assert third["packed"] == {"members": 2, "index": 1, "pid": os.getpid(), "refilled": True}
    assert Path(third["checkpoint"]).parent == tmp_path / "third"
    assert [h["epoch"] for h in third["history"]] == [1, 2]
    for output, p in ((ended[1][1], params[0]), (third, params[2])):
        alone = train(_ctx(tmp_path, f"alone{p.seed}"), p)
        assert abs(output["accuracy"] - alone["accuracy"]) <= 0.01, (p.seed, output["accuracy"], alone["accuracy"])
        assert output["loss"] == pytest.approx(alone["loss"], rel=1e-3)


def test_a_packed_members_checkpoint_is_the_one_it_would_save_alone(tmp_path):
    """What a packed member saves (weights and Adam's moments) is what train saves alone, so a
    member that runs again unpacked resumes where the pack left it."""
    params = [TrainParams(epochs=2, lr=lr, seed=seed, num_workers=0, checkpoint_every_s=0)
              for lr, seed in [(3e-3, 0), (1e-2, 1)]]
    members = [Member(_ctx(tmp_path, f"packed{i}"), p, TRAIN_PACKING.data(p)) for i, p in enumerate(params)]
    train_pack(TRAIN_PACKING, members, "cpu", lambda i, out, err: None)
    for i, p in enumerate(params):
        train(_ctx(tmp_path, f"alone{i}"), p)
        packed = load_file(str(tmp_path / f"packed{i}" / "resume.safetensors"))
        alone = load_file(str(tmp_path / f"alone{i}" / "resume.safetensors"))
        assert sorted(packed) == sorted(alone)
        for key, value in alone.items():
            torch.testing.assert_close(packed[key], value, rtol=1e-4, atol=1e-5)


# --- the job process's RunPack -------------------------------------------------------------


@pytest.fixture
def runtime(tmp_path):
    """A job process's runtime, in this process, and the worker's end of its pipe."""
    worker_end, process_end = Pipe()
    spec = ProcessSpec(device="cpu0", torch_device="cpu", cores=sorted(os.sched_getaffinity(0)), torch_threads=1,
                       job_modules=["tasks.jobs"], artifacts_dir=str(tmp_path / "artifacts"),
                       tensorboard_dir=str(tmp_path / "tb"), result_expires_s=60)
    registry = JobRegistry(["tasks.jobs"])
    for name in ("packtoy", "unpackable"):
        registry.add_builtin(DEFINED[name])
    baseline = _Baseline(environ=dict(os.environ), cwd=os.getcwd(), sys_path=list(__import__("sys").path),
                         cores=list(spec.cores), threads=torch.get_num_threads())
    yield JobRuntime(spec=spec, registry=registry, visibility=DeviceView(), baseline=baseline), Channel(process_end), \
        worker_end
    worker_end.close()
    process_end.close()


def _member(job_id: str, kwargs: dict[str, Any], job_name: str = "train", **extra: Any) -> RunJob:
    return RunJob(job_id=job_id, job=job_name, kwargs=kwargs, fan_out_id="sweep-1", options={"pack": 4}, **extra)


def _run(runtime_fixture: Any, pack: RunPack, *stops: StopJob) -> tuple[dict[str, Finished], list[Report]]:
    """Run ``pack`` as the job process does after the worker sent it, then ``stops``."""
    runtime, channel, worker_end = runtime_fixture
    channel.deliver(pack)
    for stop in stops:
        channel.deliver(stop)
    run_pack(runtime, channel.next_job(), channel)  # type: ignore[arg-type]
    finished: dict[str, Finished] = {}
    reports: list[Report] = []
    while worker_end.poll(0):
        message = decode_from_job_process(worker_end.recv_bytes())
        if isinstance(message, Finished):
            assert message.job_id not in finished, "one Finished per member"
            finished[message.job_id] = message
        elif isinstance(message, Report):
            reports.append(message)
    return finished, reports


def test_run_pack_ends_each_member_alone(runtime):
    """A cancelled, a preempted, a bad and a differently shaped member each end with their own
    outcome; the others train on and finish, each with its own progress and checkpoint."""
    small = {"epochs": 2, "num_workers": 0}
    pack = RunPack(members=[
        _member("ok0", {**small, "seed": 0}),
        _member("cancelled", {**small, "seed": 1}),
        _member("preempted", {**small, "seed": 2}),
        _member("bad", {**small, "lr": -1}),
        _member("other-shape", {**small, "hidden": 32}),
        _member("ok1", {**small, "seed": 5, "lr": 1e-2}),
    ])
    finished, reports = _run(runtime, pack,
                             StopJob(job_id="cancelled", reason=StopReason.CANCEL, message="pruned"),
                             StopJob(job_id="preempted", reason=StopReason.PREEMPT, message="urgent work"))
    assert set(finished) == {m.job_id for m in pack.members}
    for name in ("ok0", "ok1"):
        assert finished[name].outcome is Outcome.OK
        output = finished[name].output
        assert output is not None and output["packed"] == {"members": 4, "index": 0 if name == "ok0" else 3, "pid": os.getpid()}
        assert Path(str(output["checkpoint"])).parent.name == name
        assert finished[name].metrics["samples_per_s"] > 0
    assert finished["cancelled"].outcome is Outcome.CANCELLED
    assert finished["cancelled"].error is not None and "pruned" in finished["cancelled"].error.message
    assert finished["preempted"].outcome is Outcome.PREEMPTED
    # It saved what train resumes from before it made way: run again unpacked, it resumes.
    artifacts = Path(runtime[0].spec.artifacts_dir)
    again = train(JobContext(device="cpu0", torch_device="cpu", job_id="preempted", artifacts_dir=artifacts / "preempted",
                             attempt=2), TrainParams(**small, seed=2))
    assert again["resumed_from_epoch"] == 1 and again["epochs"] == 2
    assert finished["bad"].outcome is Outcome.ERROR and finished["bad"].error is not None
    assert finished["bad"].error.type == "InvalidJobArguments" and "lr" in finished["bad"].error.message
    shape = finished["other-shape"].error
    assert finished["other-shape"].outcome is Outcome.ERROR and shape is not None
    assert shape.type == "InvalidJobArguments" and "hidden=32" in shape.message
    # Each report names its member; the finished ones reported their last epoch.
    by_member = {r.job_id: r.fields for r in reports}
    assert by_member["ok0"]["epoch"] == 2 and by_member["ok1"]["epoch"] == 2
    assert None not in by_member


def test_run_pack_diverged_member_is_masked_out(runtime):
    """A member whose loss is not finite ends TrainingDiverged; the others are untouched by it."""
    pack = RunPack(members=[_member("a", {"seed": 1}, "packtoy"), _member("nan", {"seed": 2, "poison": True}, "packtoy"),
                            _member("b", {"seed": 3}, "packtoy")])
    finished, _ = _run(runtime, pack)
    assert finished["nan"].outcome is Outcome.ERROR
    assert finished["nan"].error is not None and finished["nan"].error.type == "TrainingDiverged"
    alone = [Member(JobContext(device="cpu0", torch_device="cpu", job_id=n, artifacts_dir=Path(runtime[0].spec.artifacts_dir) / f"x{n}"),
                    ToyParams(seed=s), _toy_data(ToyParams(seed=s))) for n, s in (("a", 1), ("b", 3))]
    ends = train_pack(DEFINED["packtoy"].pack, alone, "cpu", lambda i, out, err: None)  # type: ignore[arg-type]
    for i, name in enumerate(("a", "b")):
        output = finished[name].output
        assert finished[name].outcome is Outcome.OK and output is not None
        assert output["loss"] == pytest.approx(ends[i]["loss"], rel=1e-5)


def test_run_pack_of_a_job_that_does_not_pack(runtime):
    pack = RunPack(members=[_member("a", {}, "unpackable"), _member("b", {}, "unpackable")])
    finished, _ = _run(runtime, pack)
    for ending in finished.values():
        assert ending.outcome is Outcome.ERROR and ending.error is not None
        assert ending.error.type == "InvalidJobArguments" and "does not pack" in ending.error.message


def test_run_pack_gives_way_past_the_budget(runtime):
    """Members past what fits the budget come back GIVE_WAY, saying how many fit; the rest run."""
    params = ToyParams()
    need, _ = probe_bytes(DEFINED["packtoy"].pack, params, _toy_data(params), "cpu")  # type: ignore[arg-type]
    pack = RunPack(members=[_member(f"m{i}", {"seed": i}, "packtoy", allocator_limit_bytes=2 * need + need // 2)
                            for i in range(4)])
    finished, _ = _run(runtime, pack)
    assert [finished[f"m{i}"].outcome for i in range(4)] == [Outcome.OK, Outcome.OK, Outcome.GIVE_WAY, Outcome.GIVE_WAY]
    error = finished["m3"].error
    assert error is not None and error.type == "PackTooLarge" and "at most 2 trials" in error.message


def test_choose_pack_takes_the_least_of_budget_cap_and_trials():
    mib = 1024**2
    assert choose_pack(10, 100 * mib, 1000 * mib, 256) == (
        10, "10 of 10 trials: the slot's budget of 1000 MiB fits 10 at about 100.0 MiB each (at most 256)")
    assert choose_pack(40, 100 * mib, 1000 * mib, 256)[0] == 10  # the budget decides
    assert choose_pack(400, 1 * mib, 1000 * mib, 256)[0] == 256  # the cap decides
    assert choose_pack(3, 1 * mib, 1000 * mib, 256)[0] == 3  # the trials decide
    assert choose_pack(300, 1 * mib, None, 256) == (256, "256 of 300 trials: no memory budget on this slot (at most 256)")
    k, why = choose_pack(4, 100 * mib, 50 * mib, 256)
    assert k == 0 and why == "not one trial fits: the slot's budget of 50 MiB fits 0 at about 100.0 MiB each"


def test_run_pack_where_not_one_member_fits_says_what_fits(runtime):
    params = ToyParams()
    need, how = probe_bytes(DEFINED["packtoy"].pack, params, _toy_data(params), "cpu")  # type: ignore[arg-type]
    assert how == "estimated"
    pack = RunPack(members=[_member(f"m{i}", {"seed": i}, "packtoy", allocator_limit_bytes=need // 2) for i in range(2)])
    finished, _ = _run(runtime, pack)
    for ending in finished.values():
        assert ending.outcome is Outcome.ERROR and ending.error is not None and ending.error.type == "PackTooLarge"
        assert "not one trial fits" in ending.error.message and "run these trials without pack=" in ending.error.message


def test_the_refill_messages_travel_each_one_way():
    from pydantic import ValidationError

    from tasks.core.wire import NewMember, WantMember, decode_from_worker

    want = WantMember(index=3)
    answer = NewMember(member=_member("next", {"seed": 9}))
    assert decode_from_job_process(want.encode()) == want
    assert decode_from_worker(answer.encode()) == answer and decode_from_worker(NewMember().encode()) == NewMember()
    with pytest.raises(ValidationError):
        decode_from_job_process(answer.encode())


def test_hello_names_the_pack_key():
    infos = {info.name: info for info in JobRegistry(["tasks.jobs"]).infos()}
    assert infos["train"].pack == ["model", "hidden", "dataset", "epochs", "batch_size", "test_fraction"]
    assert infos["noop"].pack is None


@pytest.mark.gpu
def test_packed_train_on_gpu_equals_each_trial_alone(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    params = [TrainParams(epochs=3, lr=lr, seed=seed, num_workers=0) for lr, seed in [(3e-3, 0), (1e-2, 1)]]
    members = [Member(JobContext(device="gpu0", torch_device="cuda:0", job_id=f"g{i}", artifacts_dir=tmp_path / f"g{i}"),
                      p, TRAIN_PACKING.data(p)) for i, p in enumerate(params)]
    ends = train_pack(TRAIN_PACKING, members, "cuda:0", lambda i, out, err: None)
    for i, p in enumerate(params):
        alone = train(JobContext(device="gpu0", torch_device="cuda:0", job_id=f"a{i}", artifacts_dir=tmp_path / f"a{i}"), p)
        assert abs(ends[i]["accuracy"] - alone["accuracy"]) <= 0.01


@pytest.mark.gpu
def test_probe_measures_one_member_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    params = TrainParams(epochs=1, num_workers=0)
    need, how = probe_bytes(TRAIN_PACKING, params, TRAIN_PACKING.data(params), "cuda:0")
    weights = sum(p.numel() * 4 for p in build(params.model, 64, 10, params.hidden).parameters())
    assert how == "measured" and need >= 4 * weights  # weights, grads and two moments at least


class _Watch:
    """A member's watch that gives the stop it is set to (the runner's JobWatch, in memory)."""

    def __init__(self, stop: StopJob | None = None) -> None:
        self.asked = stop
        #: What its slot is asked (a preemption), which ``stop`` gives after the job's own stops.
        self.slot: StopJob | None = None

    def stop(self) -> StopJob | None:
        return self.asked or self.slot

    def slot_stop(self) -> StopJob | None:
        return self.slot

    def act_on(self, stop: StopJob) -> StopJob | None:
        return stop


class _Process:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: Any) -> None:
        self.sent.append(message)


def test_a_pack_whose_leader_ended_still_makes_way_as_a_whole():
    """Members that took freed places outlive the leader; the leader's watch still says when the
    slot must make way, and every open member is stopped; the ended leader's own cancel is not
    sent, nor does it hide the preemption that comes after it."""
    from tasks.worker.runloop import RunLoop

    pack = RunPack(members=[_member("leader", {}), _member("kept", {})], refill=True)
    process = _Process()
    watches: dict[str, Any] = {"leader": _Watch(), "kept": _Watch(), "newcomer": _Watch()}
    run = RunLoop(process, pack.members, watches, grace_s=5.0, budget=None, on_end=lambda *_: None,  # type: ignore[arg-type]
                  packed=True)
    del run.open["leader"]  # its own trial ended (its Finished came)
    run.open["newcomer"] = None  # a trial that took a freed place
    watches["leader"].asked = StopJob(job_id="leader", reason=StopReason.CANCEL, message="its own cancel")
    assert run._ask_stops() is None and process.sent == []
    # Its own cancel still stands, and comes first in its stop(): the slot's preemption is heard.
    watches["leader"].slot = StopJob(job_id="leader", reason=StopReason.PREEMPT, message="urgent work")
    assert run._ask_stops() is None
    assert sorted((m.job_id, m.reason) for m in process.sent) == [("kept", StopReason.PREEMPT),
                                                                   ("newcomer", StopReason.PREEMPT)]
    assert "leader" not in run.open
