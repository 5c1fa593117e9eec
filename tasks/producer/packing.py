"""Packed trials, the producer's part: whether a sweep's trials may share a pack.

``tasks.sweep(..., pack=K)`` asks the workers to train up to K trials of one job as one packed
(vmapped) model in one job process (``pack="auto"``: as many as fit the slot's budget). Before
anything is sent, :func:`plan_packing`

- refuses, with one line naming the value, a ``pack=`` that is not a count >= 1 or ``"auto"``, a
  command, a device group, or a job that a chosen device's worker does not list as packable (its
  registry record's ``packable``, from the job process's hello);
- runs the trials unpacked, and says why, when they differ in a param their models' shapes hang on
  (the job's pack key, :attr:`tasks.core.wire.JobInfo.pack`): trials that cannot share a model
  are not packed at all, rather than packed in groups the producer would have to keep apart.

A trial that leaves a key param to its default is compared as "default": mixed with trials that
set it, the sweep runs unpacked (the producer does not know the job's defaults; the worker's job
process checks the shapes again in any case).

A study (``tasks.optimize(..., pack=K)``) is checked the same way by :func:`plan_study_packing`
on its fixed kwargs; one that samples a key param runs unpacked and says why.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..core.commands import COMMAND_JOB
from ..core.errors import ConfigError
from ..core.records import WorkerRecord, parse_pack
from .fanout import JobSpec

logger = logging.getLogger(__name__)

#: How a trial that leaves a key param to the job's default shows in the reason.
DEFAULT = "default"


@dataclass(frozen=True)
class Packing:
    """What a sweep does with ``pack=``: ``pack`` is what each trial's options carry (None:
    the trials run alone) and ``reason`` says so, e.g. ``"packed 8"`` or
    ``"unpacked: trials differ in hidden (64, 128)"``."""

    pack: int | str | None
    reason: str

    @property
    def packed(self) -> bool:
        return self.pack is not None


def plan_packing(pack: object, specs: Sequence[JobSpec], devices: Sequence[str],
                 live: Mapping[str, WorkerRecord], group: int | None = None) -> Packing:
    """The sweep's :class:`Packing` for ``pack=`` (see the module's docstring).

    Raises:
        ConfigError: ``pack`` is not a count >= 1 or ``"auto"``, the job is a command, the sweep
            runs on device groups, or a chosen device's worker does not pack the job.
    """
    if pack is None:
        return Packing(None, "unpacked")
    count = parse_pack(pack)
    name = specs[0].name if specs else None
    if name == COMMAND_JOB:
        raise ConfigError(f"pack={pack!r}: a command cannot be packed, each trial is its own program; "
                          "drop pack= (nothing was sent)")
    if group is not None:
        raise ConfigError(f"pack={pack!r} with group={group}: a packed trial runs on one device; "
                          "give one of them (nothing was sent)")
    if name is None:
        return Packing(None, "unpacked: no trials")
    for param in pack_key(pack, name, devices, live):
        values = {_shown(spec.kwargs.get(param, DEFAULT)) for spec in specs}
        if len(values) > 1:
            reason = f"unpacked: trials differ in {param} ({', '.join(sorted(values))})"
            logger.warning("sweep of %s with pack=%r runs %s: a pack trains trials of one shape", name, pack, reason)
            return Packing(None, reason)
    if count == 1:
        return Packing(1, "packed 1")
    return Packing(count, f"packed {count}")


def plan_study_packing(pack: object, base: JobSpec, sampled: Sequence[str], devices: Sequence[str],
                       live: Mapping[str, WorkerRecord], group: int | None = None) -> Packing:
    """A study's :class:`Packing` for ``pack=`` (``tasks.optimize(..., pack=K)``): the refusals
    of :func:`plan_packing` on the study's fixed kwargs; a study that samples a param of the job's
    pack key runs unpacked and says why (its trials' shapes are Optuna's to choose, one at a time,
    so no two of them are known to be equal when they are sent)."""
    packing = plan_packing(pack, [base], devices, live, group)
    if not packing.packed:
        return packing
    varied = [param for param in pack_key(pack, base.name, devices, live) if param in sampled]
    if varied:
        reason = f"unpacked: the study samples {', '.join(varied)}, which the models' shapes hang on"
        logger.warning("study of %s with pack=%r runs %s: a pack trains trials of one shape", base.name, pack, reason)
        return Packing(None, reason)
    return packing


def pack_key(pack: object, name: str, devices: Sequence[str], live: Mapping[str, WorkerRecord]) -> list[str]:
    """The params that must be equal for trials of ``name`` to share a pack on ``devices``.

    Raises:
        ConfigError: a chosen device's worker does not list ``name`` as packable.
    """
    refusing = [device for device in devices if name not in live[device].packable]
    if refusing:
        raise ConfigError(
            f"pack={pack!r}: job {name!r} does not pack on {', '.join(refusing)} (its workers list it as not "
            "opting in to packed trials: tasks.core.job Packing); drop pack= to run it as today (nothing was sent)")
    return sorted({param for device in devices for param in live[device].packable[name]})


def packed_spec(spec: JobSpec, packing: Packing) -> JobSpec:
    """``spec`` with its options carrying the sweep's ``pack`` (unchanged when unpacked)."""
    if not packing.packed:
        return spec
    return spec.model_copy(update={"options": spec.options.model_copy(update={"pack": packing.pack})})


def _shown(value: object) -> str:
    return value if isinstance(value, str) else repr(value)
