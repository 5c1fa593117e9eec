"""Placement by what a device is (issue 50): the one owner of a job's :class:`Constraints`.

A job, a sweep, a study, a gang or a group may ask for devices by what they are::

    tasks.sweep("train", trials, constraints={"min_memory_gib": 40, "labels": {"nvlink": True}})
    devicefleet sweep train ... --require min_memory_gib=40 --require label.nvlink=true

Each worker registers what its device is in its :class:`~tasks.core.records.WorkerRecord`
(kind, ``device_name``, ``total_memory``, ``compute_capability``, ``host``, and the ``labels``
of its worker config). The producer keeps the devices that match (:func:`place`) and sends only
to them; a request that no device in service meets is refused before anything is sent, naming
the closest devices and what each lacks (:class:`~tasks.core.errors.PlacementUnavailable`). The
constraints also travel in the job's options, so a worker that takes a job its device does not
match (its labels changed on a restart) hands it back instead of running it.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from .errors import ConfigError, PlacementUnavailable
from .validation import describe_validation_error


class _Slot(Protocol):
    @property
    def budget_bytes(self) -> int | None: ...


class DeviceFacts(Protocol):
    """What placement reads of a device: its :class:`~tasks.core.records.WorkerRecord` (which
    imports this module for its ``labels``, hence a protocol)."""

    @property
    def kind(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def device_name(self) -> str | None: ...
    @property
    def total_memory(self) -> int | None: ...
    @property
    def compute_capability(self) -> str | None: ...
    @property
    def labels(self) -> Mapping[str, Any]: ...
    @property
    def slots(self) -> Sequence[_Slot]: ...
    @property
    def host_memory(self) -> int | None: ...

GIB = 1 << 30
#: A label's value: a JSON scalar (bool first: ``true`` stays a bool, not the int 1).
LabelValue = StrictBool | StrictInt | StrictFloat | StrictStr
#: How many of the closest devices a refusal names.
CLOSEST_SHOWN = 3
#: The CLI's prefix of one label: ``--require label.nvlink=true``.
LABEL_PREFIX = "label."


class Constraints(BaseModel):
    """What a device must be to run a job; every field given must hold (an empty one: any device)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: ``"cpu"`` or ``"gpu"``.
    kind: Literal["cpu", "gpu"] | None = None
    #: A part of the device's model name, case-insensitive: ``"H100"`` matches
    #: ``"NVIDIA H100 80GB HBM3"`` (a CPU device's name is its CPU model).
    gpu_model: str | None = Field(default=None, min_length=1)
    #: At least this much memory (GiB): a GPU's device memory; a CPU device's slots' budgets together.
    min_memory_gib: float | None = Field(default=None, gt=0, le=1 << 20)
    #: At least this CUDA compute capability, ``"8.0"`` (a CPU device has none: never matches).
    min_compute_capability: str | None = Field(default=None, pattern=r"^\d+\.\d+$")
    #: The device's host name.
    host: str | None = Field(default=None, min_length=1)
    #: Labels of the device's worker config that must have these values (``labels`` in its TOML).
    labels: dict[str, LabelValue] = Field(default_factory=dict)

    @field_validator("min_compute_capability", mode="before")
    @classmethod
    def _capability_text(cls, value: object) -> object:
        # 8 or 8.6 read as "8.0" / "8.6": a number is how people write it.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return f"{value:.1f}" if isinstance(value, int) or float(value).is_integer() else str(value)
        return value

    @property
    def is_empty(self) -> bool:
        return self == Constraints()

    @classmethod
    def parse(cls, value: Constraints | Mapping[str, Any] | None) -> Constraints | None:
        """``constraints=`` as given to a way of sending: None or empty means none.

        Raises:
            ConfigError: an unknown key (with a close known one and every known key) or a bad
                value (naming it); one line.
        """
        if value is None or isinstance(value, Constraints):
            return None if value is None or value.is_empty else value
        if not isinstance(value, Mapping):
            raise ConfigError(f"constraints={value!r}: give a dict, e.g. {{'min_memory_gib': 40, "
                              f"'labels': {{'nvlink': True}}}}; known keys: {', '.join(KNOWN_KEYS)}")
        for key in value:
            if key not in KNOWN_KEYS:
                close = difflib.get_close_matches(str(key), KNOWN_KEYS, n=1, cutoff=0.5)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(f"unknown constraint {key!r}: {hint}known constraints: {', '.join(KNOWN_KEYS)} "
                                  "(nothing was sent)")
        try:
            parsed = cls.model_validate(dict(value))
        except ValidationError as exc:
            raise ConfigError(f"constraint {describe_validation_error(exc)} (nothing was sent)") from None
        return None if parsed.is_empty else parsed

    # -- matching ------------------------------------------------------------------------------

    def unmet(self, record: DeviceFacts) -> list[str]:
        """What ``record``'s device lacks, one phrase per constraint it does not meet."""
        out: list[str] = []
        if self.kind is not None and record.kind != self.kind:
            out.append(f"kind is {record.kind}, not {self.kind}")
        if self.gpu_model is not None and self.gpu_model.lower() not in (record.device_name or "").lower():
            out.append(f"model is {record.device_name or 'unknown'}, not {self.gpu_model}")
        if self.min_memory_gib is not None:
            memory = device_memory(record)
            if memory is None or memory < self.min_memory_gib * GIB:
                have = "unknown" if memory is None else f"{memory / GIB:.1f} GiB"
                out.append(f"memory {have} < {self.min_memory_gib:g} GiB")
        if self.min_compute_capability is not None:
            capability = record.compute_capability
            if capability is None or _capability(capability) < _capability(self.min_compute_capability):
                out.append(f"compute capability {capability or 'none'} < {self.min_compute_capability}")
        if self.host is not None and record.host != self.host:
            out.append(f"host is {record.host}, not {self.host}")
        for name, wanted in self.labels.items():
            have_label = record.labels.get(name)
            if name not in record.labels or have_label != wanted or type(have_label) is not type(wanted):
                shown = "unset" if name not in record.labels else json.dumps(have_label)
                out.append(f"label {name} is {shown}, not {json.dumps(wanted)}")
        return out

    def matches(self, record: DeviceFacts) -> bool:
        """Whether ``record``'s device meets every constraint."""
        return not self.unmet(record)

    def shortfall(self, record: DeviceFacts) -> float:
        """How far ``record``'s device falls short of the least amounts asked (memory, compute
        capability): per amount, 0 where it has enough, the missing fraction where it has less,
        1 where it has none or it is unknown. Orders devices that lack as many things: an 8.0
        GPU is closer to ``min_compute_capability=9.5`` than a CPU."""
        short = 0.0
        if self.min_memory_gib is not None:
            memory = device_memory(record)
            short += 1.0 if memory is None else max(0.0, 1 - memory / (self.min_memory_gib * GIB))
        if self.min_compute_capability is not None:
            have, wanted = record.compute_capability, float(self.min_compute_capability)  # "8.6": 8.6
            short += 1.0 if have is None else max(0.0, 1 - float(have) / wanted)
        return short

    def why_not(self, record: DeviceFacts) -> str:
        """Why ``record``'s device does not match (``""`` when it does)."""
        return "; ".join(self.unmet(record))

    def describe(self) -> str:
        """The constraints as ``--require`` would give them: ``min_memory_gib=40 label.nvlink=true``."""
        parts = [f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
                 for key, value in self.model_dump(exclude_none=True, exclude={"labels"}).items()]
        parts += [f"{LABEL_PREFIX}{name}={json.dumps(value)}" for name, value in self.labels.items()]
        return " ".join(parts)


#: The keys a constraint may have, in the order messages list them.
KNOWN_KEYS: list[str] = list(Constraints.model_fields)


def _capability(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def device_memory(record: DeviceFacts) -> int | None:
    """Bytes of memory the device offers its jobs: a GPU's device memory; else its slots' budgets
    together (``memory_gib``, or the host's RAM split among several slots); else, a CPU device
    whose one slot has no budget, its host's RAM. None where none of these is known."""
    if record.total_memory is not None:
        return record.total_memory
    budgets = [slot.budget_bytes for slot in record.slots]
    if budgets and all(budget is not None for budget in budgets):
        return sum(int(budget) for budget in budgets if budget is not None)
    return record.host_memory if record.kind == "cpu" else None


def parse_requirements(items: Iterable[str]) -> Constraints | None:
    """The CLI's ``--require KEY=VALUE`` (repeated) as constraints: ``min_memory_gib=40``,
    ``gpu_model=H100``, ``label.nvlink=true``. A value is read as JSON where it is JSON (``40``,
    ``true``), else as text.

    Raises:
        ConfigError: an item is not ``KEY=VALUE``, or a key or value is refused (as :meth:`Constraints.parse`).
    """
    data: dict[str, Any] = {}
    labels: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--require {item!r}: give KEY=VALUE, e.g. min_memory_gib=40 or "
                              f"{LABEL_PREFIX}nvlink=true; known keys: {', '.join(KNOWN_KEYS)}")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        if key.startswith(LABEL_PREFIX) or key.startswith("labels."):
            labels[key.partition(".")[2]] = value
        elif key in {"gpu_model", "host"}:
            data[key] = text  # a model or a host is a name, even when it reads as a number
        else:
            data[key] = value
    if labels:
        data["labels"] = labels
    return Constraints.parse(data)


def place(chosen: Sequence[str], live: Mapping[str, DeviceFacts], constraints: Constraints | None,
          out_of_service: Iterable[str] = (), named: Iterable[str] = ()) -> list[str]:
    """The devices of ``chosen`` that meet ``constraints`` and are in service, in order (all of
    ``chosen`` without constraints). Of ``named``, the devices the caller named outright (not
    through a kind or ``"all"``), each must match: naming a device is asking for it, so one that
    does not match is refused, never dropped quietly (a gang's world size would shrink).

    Raises:
        PlacementUnavailable: none does; it names the closest devices and what each lacks
            (nothing was sent). Or a named device does not; it names each such device.
    """
    if constraints is None:
        return list(chosen)
    off = set(out_of_service)

    def why(device: str) -> list[str]:
        return (["out of service"] if device in off else []) + constraints.unmet(live[device])

    refused = {device: "; ".join(why(device)) for device in dict.fromkeys(named)
               if device in live and (device in off or not constraints.matches(live[device]))}
    if refused:
        raise PlacementUnavailable(constraints.describe(), refused, len(chosen), named=True)
    matching = [device for device in chosen if device not in off and constraints.matches(live[device])]
    if matching:
        return matching
    whys = {device: why(device) for device in chosen}
    closest = sorted(whys, key=lambda device: (len(whys[device]), constraints.shortfall(live[device]),
                                               device))[:CLOSEST_SHOWN]
    raise PlacementUnavailable(constraints.describe(), {device: "; ".join(whys[device]) for device in closest},
                               len(chosen))
