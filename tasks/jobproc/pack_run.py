"""Running a :class:`~tasks.core.wire.RunPack`: K trials of one job as one packed model.

Each member is a trial of its own: its kwargs are checked on their own (a bad member ends alone,
with its error), it has its own context (job id, artifacts folder, progress reports tagged with
its id, TensorBoard curve, stops asked of its id), and its :class:`Finished` goes to the worker
as soon as it ends, while the others train on (:func:`tasks.jobproc.packed.train_pack`). The
members must share the job's pack key (:class:`tasks.core.job.Packing`); one that differs ends
with a clear error. Members past what fits the slot's memory budget give way: the worker sends
them back to their queue.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.defaults import MAX_GPU_MEMORY_LEFT_MIB, PACK_AUTO_MAX
from ..core.errors import InvalidJobArguments, OutOfMemory, PackTooLarge
from ..core.job import JobDefinition
from ..core.records import ErrorInfo
from ..core.wire import Finished, Outcome, Report, RunJob, RunPack
from .channel import Channel
from .oom import MiB, _oom_error, memory_figures, release_memory, settle_device
from .packed import Member, choose_pack, probe_bytes, train_pack
from .progress import ProgressThrottle
from .registry import validate_kwargs
from .runtime import JobRuntime, classify, context_of, gpu_memory_in_use, rss_bytes
from .scalars import ScalarLog, run_dir

logger = logging.getLogger(__name__)

GiB = 1024**3


@dataclass
class _Seat:
    """One member's place in the pack: its message, its progress and curve, whether it ended."""

    job: RunJob
    throttle: ProgressThrottle
    scalars: ScalarLog
    ended: bool = False


def run_pack(runtime: JobRuntime, pack: RunPack, channel: Channel) -> None:
    """Run ``pack`` from the baseline state of its first member's slot; send each member's
    :class:`Finished` as it ends. Never raises: every member gets its Finished."""
    spec, first = runtime.spec, pack.members[0]
    runtime.reset(first)
    seats = [_seat(runtime, job, channel) for job in pack.members]
    failed = False
    definition: JobDefinition | None = None

    def finish(seat: _Seat, output: dict[str, Any] | None, exc: BaseException | None,
               outcome: Outcome | None = None, retire: str | None = None) -> None:
        nonlocal failed
        seat.ended = True
        seat.throttle.flush()  # the member's last report always goes out
        seat.scalars.close()
        metrics: dict[str, float] = {}
        if exc is not None:
            failed = True
            exc.__traceback__ = exc.__context__ = exc.__cause__ = None  # no frames holding tensors
            decided, retire = classify(spec, seat.job.job, seat.job.job_id, exc)
            outcome = outcome or decided
        else:
            try:
                json.dumps(output)  # results travel as JSON: fail here, in the entry
                metrics = {m.value: v for m, v in definition.metric_values(output).items()} if definition else {}
            except (TypeError, ValueError) as error:
                finish(seat, None, error)
                return
        channel.send(Finished(
            outcome=outcome or Outcome.OK, output=output if exc is None else None,
            error=ErrorInfo.of(exc) if exc is not None else None,
            error_module=type(exc).__module__ if exc is not None else None, metrics=metrics,
            gpu_memory_bytes=gpu_memory_in_use(), rss_bytes=rss_bytes(), retire=retire, job_id=seat.job.job_id,
        ))

    try:
        definition = runtime.registry.get(first.job)
        members, seated = _members(runtime, definition, seats, channel, finish)
        if members:
            # The first member's allocator limit: the slot's budget on a GPU (the worker sets none on
            # a CPU today: there an auto pack packs every member given).
            budget = first.allocator_limit_bytes
            assert definition.pack is not None
            need, how = probe_bytes(definition.pack, members[0].params, members[0].data, spec.torch_device)
            auto = first.options.get("pack") == "auto"
            fit, why = choose_pack(len(members), need, budget, PACK_AUTO_MAX if auto else len(members))
            if fit == 0:
                refusal = PackTooLarge(
                    f"a pack of {first.job!r} trials: {why} ({how}); a budget of at least {need / MiB:.1f} MiB fits "
                    "one: run these trials without pack= or on a slot with more memory")
                for seat in seated:
                    finish(seat, None, refusal, Outcome.ERROR)
                members, seated = [], []
            elif fit < len(members):
                too_large = (f"a pack of {len(pack.members)} trials of {first.job!r}: at most {fit} trials of this "
                             f"shape fit the slot's budget of {(budget or 0) / GiB:.2f} GiB (about {need / MiB:.1f} MiB "
                             f"each, {how}); this trial goes back to its queue and runs in a later pack")
                for seat in seated[fit:]:
                    finish(seat, None, PackTooLarge(too_large), Outcome.GIVE_WAY)
                members, seated = members[:fit], seated[:fit]
            for member in members:  # each trial's output says how its pack's size was chosen
                member.chosen = f"pack='auto': {why} ({how})" if auto else None

            def refill(index: int) -> tuple[Member, _Seat] | None:
                """The worker's next trial for free place ``index``, checked as the first were."""
                while pack.refill and (job := channel.want_member(index)) is not None:
                    seat = _seat(runtime, job, channel)
                    seats.append(seat)
                    assert definition is not None
                    joined, _ = _members(runtime, definition, [seat], channel, finish)
                    if joined:  # else it ended with its own error: ask for the next
                        return joined[0], seat
                return None

            if members:
                _train(spec.torch_device, definition, members, seated, finish, refill)
    except BaseException as exc:  # what fails the whole pack ends every member not yet ended
        for seat in seats:
            if not seat.ended:
                finish(seat, None, exc)
    finally:
        for seat in seats:
            if not seat.ended:  # cannot happen; a member without its Finished would hang its thread
                finish(seat, None, RuntimeError("the pack ended without this member's outcome"))
        if failed:
            try:
                release_memory(spec.torch_device)
            except Exception as exc:  # noqa: BLE001  (a CUDA context a device-side assert broke)
                # Every member has its Finished already: the process runs nothing more; whatever
                # it is sent next gives way, unspent, and retires it (JobRuntime.hand_back).
                runtime.broken = f"CUDA error after a pack, the context may be poisoned: {type(exc).__name__}"
                logger.warning("after a pack: could not release device memory: %s: %s", type(exc).__name__, exc)


def _seat(runtime: JobRuntime, job: RunJob, channel: Channel) -> _Seat:
    job_id = job.job_id
    return _Seat(job=job,
                 throttle=ProgressThrottle(runtime.spec.device,
                                           send=lambda meta: channel.send(Report(fields=meta, job_id=job_id))),
                 scalars=ScalarLog(run_dir(Path(runtime.spec.tensorboard_dir), job.job, job.fan_out_id,
                                           runtime.spec.device)))


def _members(runtime: JobRuntime, definition: JobDefinition, seats: list[_Seat], channel: Channel,
             finish: Any) -> tuple[list[Member], list[_Seat]]:
    """The members that can train together; each of the others ends with its own error."""
    packing = definition.pack
    if packing is None:
        refusal = InvalidJobArguments(
            f"job {definition.name!r} does not pack: its @job(...) declares no pack=Packing(...); "
            "run its trials without pack=, or give the job a Packing (docs/guides/packing.md)")
        for seat in seats:
            finish(seat, None, refusal)
        return [], []
    members: list[Member] = []
    seated: list[_Seat] = []
    key: dict[str, Any] | None = None
    slot_of = seats[0].job
    for seat in seats:
        try:
            if seat.job.job != definition.name:
                raise InvalidJobArguments(f"a pack runs trials of one job: {seat.job.job!r} came in a pack "
                                          f"of {definition.name!r}")
            params = validate_kwargs(definition, seat.job.kwargs)
            mine = dict(zip(packing.key, packing.key_of(params), strict=True))
            if key is not None and mine != key:
                differ = {name: (key[name], mine[name]) for name in key if key[name] != mine[name]}
                raise InvalidJobArguments(
                    f"{definition.name}: trials whose shapes differ cannot share a pack: "
                    + ", ".join(f"{name}={theirs!r} where the pack has {ours!r}" for name, (ours, theirs) in differ.items())
                    + f"; trials pack only when {', '.join(packing.key)} are equal")
            data = packing.data(params)
        except Exception as exc:  # this member's own fault: it ends alone
            finish(seat, None, exc)
            continue
        key = key or mine
        ctx = context_of(runtime, seat.job, slot_of, channel, seat.throttle, seat.scalars)
        members.append(Member(ctx=ctx, params=params, data=data))
        seated.append(seat)
    return members, seated


def _train(torch_device: str, definition: JobDefinition, members: list[Member], seated: list[_Seat],
           finish: Any, refill: Any = None) -> None:
    """Train the members; torch's out-of-memory becomes the fleet's, for every member not ended.
    ``refill(index)`` gives the member and seat that take a freed place (None: no more)."""
    assert definition.pack is not None
    oom = _oom_error()

    def on_end(index: int, output: dict[str, Any] | None, error: BaseException | None) -> None:
        finish(seated[index], output, error)

    def take(index: int) -> Member | None:
        taken = refill(index) if refill is not None else None
        if taken is None:
            return None
        seated[index] = taken[1]  # the place's endings are the newcomer's from now on
        return taken[0]

    try:
        outputs = train_pack(definition.pack, members, torch_device, on_end, take if refill is not None else None)
    except oom as exc:
        figures = memory_figures(torch_device)
        raise OutOfMemory(f"a pack of {len(members)} trials of {definition.name!r} ran out of memory on "
                          f"{torch_device} ({exc}); run smaller packs (pack=K with a lower K, or pack='auto')",
                          memory=figures) from None
    # The pack's tensors are gone: free the cache before the memory each Finished reports, and
    # what is still allocated (tensors a job kept) or a CUDA error surfacing now retires the
    # process after the pack, as after a lone job (.oom.settle_device).
    device = settle_device(torch_device, failed=False, limit_bytes=MAX_GPU_MEMORY_LEFT_MIB * MiB)
    for index, output in outputs.items():
        if device.error is not None:
            finish(seated[index], None, device.error)
        else:
            finish(seated[index], output, None, retire=device.retire)
