"""Device groups, the pure part: which devices make a group, what its one job process sees.

A device group is one job over ``k`` devices of one kind on one host, in **one** job process
that sees all of them (``fan_out(job, "cpu", group=2)``, ``devicefleet run --group 2``). The
producer picks the devices (:func:`plan_groups`) from the fleet's registry and refuses a group
that no live host can give (:class:`~tasks.core.errors.GroupUnavailable`); the leader's worker
reserves and runs it (:mod:`tasks.worker.group`) with the visibility these functions compute:

- :func:`group_cores`: the union of the devices' cores (the process's affinity and torch
  threads);
- :func:`group_environment`: ``CUDA_VISIBLE_DEVICES`` listing the GPUs in PCI bus order, with
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that the indices mean the bus order, as
  ``nvidia-smi`` numbers them; ``-1`` for a CPU group;
- :func:`best_connected`: on GPUs, the best-connected set (NVLink, then a common PCIe switch)
  from a link-cost function: :func:`choose_groups` feeds it the links each GPU worker read
  from NVML and published with its registry record (:mod:`tasks.worker.topology`), and says
  why each group got its devices (``gpu0+gpu1: NVLink``; ``devicefleet status`` shows it).

A group's key in a fan-out's result is its devices joined by ``+`` (``cpu0+cpu1``).
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import redis

from . import claims, keys
from .devices import Device, DeviceKind
from .errors import ConfigError, GroupUnavailable
from .priority import DEFAULT_LEVEL, Level, parse_level, precedence
from .records import WorkerRecord
from .replies import text

#: Between the devices of a group's key: ``cpu0+cpu1``.
GROUP_SEPARATOR = "+"
#: The most devices one group may ask for (the largest hosts have 16 GPUs).
MAX_GROUP_SIZE = 64


def group_key(devices: Sequence[str]) -> str:
    """``["cpu0", "cpu1"]`` -> ``cpu0+cpu1``."""
    return GROUP_SEPARATOR.join(devices)


def key_devices(key: str) -> list[str]:
    """The devices of a fan-out's key: ``cpu0+cpu1`` -> both; ``cpu0`` -> itself."""
    return key.split(GROUP_SEPARATOR)


def check_group_size(size: object) -> int:
    """``size`` as a group's device count.

    Raises:
        ConfigError: it is not an integer from 2 to :data:`MAX_GROUP_SIZE`.
    """
    if isinstance(size, bool) or not isinstance(size, int) or not 2 <= size <= MAX_GROUP_SIZE:
        raise ConfigError(f"group={size!r}: give the number of devices the job runs over together, "
                          f"an integer from 2 to {MAX_GROUP_SIZE} (e.g. group=2)")
    return size


class Link(IntEnum):
    """How two GPUs of a host are connected, best first (NVML's ``nvmlGpuTopologyLevel_t``
    levels, NVLink ahead of them): the cost :func:`best_connected` minimises."""

    NVLINK = 0
    #: One PCIe switch between them (``NVML_TOPOLOGY_SINGLE``).
    PCIE_SWITCH = 10
    #: Several PCIe switches, no host bridge (``NVML_TOPOLOGY_MULTIPLE``).
    PCIE_SWITCHES = 20
    #: Through the host bridge (``NVML_TOPOLOGY_HOSTBRIDGE``).
    HOST_BRIDGE = 30
    #: Through the CPU's interconnect on one NUMA node (``NVML_TOPOLOGY_NODE``).
    NUMA_NODE = 40
    #: Across sockets (``NVML_TOPOLOGY_SYSTEM``).
    SYSTEM = 50

    @property
    def words(self) -> str:
        """How ``devicefleet status`` says it: ``NVLink``, ``common PCIe switch``..."""
        return _LINK_WORDS[self]

    @classmethod
    def named(cls, name: str) -> Link | None:
        """The link a worker record names (``"nvlink"``); None for a name this version does not know."""
        return cls.__members__.get(name.upper())


_LINK_WORDS = {
    Link.NVLINK: "NVLink", Link.PCIE_SWITCH: "common PCIe switch", Link.PCIE_SWITCHES: "PCIe switches",
    Link.HOST_BRIDGE: "PCIe host bridge", Link.NUMA_NODE: "one NUMA node", Link.SYSTEM: "across CPU sockets",
}

#: Why a group got its devices where no link between them is known.
INDEX_ORDER = "index order: no topology known"


def best_connected(gpus: Sequence[int], size: int, link: Callable[[int, int], Link]) -> tuple[list[int], str]:
    """The ``size`` GPUs of ``gpus`` best connected to one another, and why, in words.

    The set whose worst pair has the best link wins (every pair on NVLink beats any set with
    one PCIe pair), then the lowest total cost, then the lowest indices. The result is in index
    order (the PCI bus order, under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``).

    Raises:
        ValueError: fewer than ``size`` GPUs.
    """
    if len(gpus) < size:
        raise ValueError(f"{size} GPUs asked of {len(gpus)}")
    best: tuple[tuple[int, int, tuple[int, ...]], tuple[int, ...]] | None = None
    for combo in itertools.combinations(sorted(gpus), size):
        costs = [int(link(a, b)) for a, b in itertools.combinations(combo, 2)]
        score = (max(costs, default=0), sum(costs), combo)
        if best is None or score < best[0]:
            best = (score, combo)
    assert best is not None
    (worst, _, _), chosen = best
    why = f"gpu{'+gpu'.join(map(str, chosen))}: every pair at best {Link(worst).name.lower().replace('_', ' ')}"
    return list(chosen), why


@dataclass(frozen=True)
class GroupChoice:
    """A group's devices and why it got them (``devicefleet status`` shows it)."""

    devices: list[str]
    why: str

    @property
    def key(self) -> str:
        return group_key(self.devices)


def host_links(live: Mapping[str, WorkerRecord]) -> Callable[[str, int, int], Link | None]:
    """``links(host, a, b)``: how GPUs ``a`` and ``b`` of ``host`` are connected, from the GPU
    workers' published :attr:`~tasks.core.records.WorkerRecord.gpu_links` (either side's
    record); None where neither says."""
    rows = {(r.host, Device.parse(name).index): r.gpu_links for name, r in live.items()
            if r.kind == DeviceKind.GPU.value and r.gpu_links}

    def links(host: str, a: int, b: int) -> Link | None:
        for one, other in ((a, b), (b, a)):
            name = (rows.get((host, one)) or {}).get(other)
            if name is not None and (link := Link.named(name)) is not None:
                return link
        return None

    return links


def explain(devices: Sequence[str], link: Callable[[int, int], Link | None] | None) -> str:
    """Why ``devices`` make a group: on GPUs, the worst link between two of them
    (``gpu0+gpu1: NVLink``), else :data:`INDEX_ORDER`; a CPU group's devices are taken in index order."""
    parsed = [Device.parse(d) for d in devices]
    if any(d.kind is not DeviceKind.GPU for d in parsed):
        return f"{group_key(devices)}: index order (CPU devices)"
    pairs = list(itertools.combinations(parsed, 2))
    known = [found for a, b in pairs if link is not None and (found := link(a.index, b.index)) is not None]
    if not pairs or len(known) != len(pairs):
        return f"{group_key(devices)}: {INDEX_ORDER}"
    return f"{group_key(devices)}: {max(known).words}"


def choose_groups(candidates: Sequence[str], live: Mapping[str, WorkerRecord], size: int) -> list[GroupChoice]:
    """Disjoint groups of ``size`` devices of one kind on one host, from ``candidates`` (live
    device names, in the caller's order), and why each: as many as they make, each host's
    devices taken in index order, except GPUs whose links are all known (each GPU worker
    publishes its own, :attr:`~tasks.core.records.WorkerRecord.gpu_links`): there the
    best-connected set first (:func:`best_connected`: NVLink, then a common PCIe switch).

    Raises:
        GroupUnavailable: no host has ``size`` devices of one kind among the candidates.
    """
    links = host_links(live)
    buckets: dict[tuple[str, str], list[str]] = {}
    for name in candidates:
        record = live[name]
        buckets.setdefault((record.host, record.kind), []).append(name)
    groups: list[GroupChoice] = []
    for (host, kind), names in sorted(buckets.items()):
        names = sorted(names, key=lambda n: Device.parse(n).index)
        link = functools.partial(links, host)
        while len(names) >= size:
            index = {Device.parse(n).index: n for n in names}
            pairs = list(itertools.combinations(sorted(index), 2))
            known = {pair: found for pair in pairs if (found := link(*pair)) is not None}
            if kind == DeviceKind.GPU.value and len(known) == len(pairs):
                chosen, _ = best_connected(list(index), size, functools.partial(_pair_link, known))
                group = [index[i] for i in chosen]
            else:
                group = names[:size]
            groups.append(GroupChoice(group, explain(group, link)))
            names = [n for n in names if n not in group]
    if not groups:
        hosts: dict[str, list[str]] = {}
        for name, record in live.items():
            hosts.setdefault(record.host, []).append(f"{name} ({record.kind})")
        kinds = sorted({live[n].kind for n in candidates})
        raise GroupUnavailable(f"{size} {' or '.join(kinds) or 'any'} devices of one host", hosts)
    return groups


def _pair_link(known: Mapping[tuple[int, int], Link], a: int, b: int) -> Link:
    return known[min(a, b), max(a, b)]


def plan_groups(candidates: Sequence[str], live: Mapping[str, WorkerRecord], size: int) -> list[list[str]]:
    """The devices of :func:`choose_groups`' groups.

    Raises:
        GroupUnavailable: no host has ``size`` devices of one kind among the candidates.
    """
    return [choice.devices for choice in choose_groups(candidates, live, size)]


def check_named_group(devices: Sequence[str], live: Mapping[str, WorkerRecord]) -> list[str]:
    """A group named device by device (``{"cpu0+cpu1": job}``): live, one kind, one host.

    Raises:
        GroupUnavailable: they are not all live, or not of one kind on one host.
    """
    if len(devices) < 2 or len(set(devices)) != len(devices):
        raise ConfigError(f"group {group_key(devices)!r}: name two or more different devices, e.g. cpu0+cpu1")
    records = [live.get(d) for d in devices]
    places = {(r.host, r.kind) for r in records if r is not None}
    if None in records or len(places) != 1:
        hosts: dict[str, list[str]] = {}
        for name, record in live.items():
            hosts.setdefault(record.host, []).append(f"{name} ({record.kind})")
        raise GroupUnavailable(group_key(devices), hosts)
    return list(devices)


def group_cores(records: Sequence[WorkerRecord]) -> list[int]:
    """The union of the devices' cores: the group's job process's affinity and thread count."""
    return sorted({core for record in records for core in record.cores})


def group_budget(records: Sequence[WorkerRecord | None]) -> int | None:
    """A group's memory budget in bytes: the sum of its devices' budgets, each device's the sum
    of its slots' (the whole device is the group's while it runs). None, not enforced, when any
    device's is not (a slot without a budget, or a device whose record is not known)."""
    total = 0
    for record in records:
        if record is None or not record.slots:
            return None
        for slot in record.slots:
            if slot.budget_bytes is None:
                return None
            total += slot.budget_bytes
    return total if records else None


def group_environment(devices: Sequence[str]) -> dict[str, str]:
    """What a group's job process's environment says of its devices: the GPUs' indices in PCI
    bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes the indices mean it), else ``-1``."""
    parsed = [Device.parse(d) for d in devices]
    if any(d.kind is DeviceKind.GPU for d in parsed):
        indexes = sorted(d.index for d in parsed if d.kind is DeviceKind.GPU)
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, indexes)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    return {"CUDA_VISIBLE_DEVICES": "-1"}


def read_groups(client: redis.Redis, devices: Iterable[str]) -> list[dict[str, Any]]:
    """The device groups that reserved any of ``devices`` now (``devicefleet status``), first
    in wait-die first (:func:`tasks.core.priority.precedence`: level, then age): ``{"attempt",
    "group", "name", "job_id", "leader", "state", "waiting_for", "closed", "since", "seq",
    "level", "why"}``, where ``state`` is ``sent`` (its producer reserved its other devices; its
    leader has not taken it yet), ``waiting`` or ``running``, ``waiting_for`` is
    ``{device: what it still runs}`` of a group not running yet, ``closed``
    ``{device: single jobs waiting there}`` of the devices that take no new single job for it,
    and ``why`` why the group got its devices (None: not known)."""
    attempts = claims.groups_on(client, devices, sent=True)
    pipe = client.pipeline(transaction=False)
    for attempt in attempts:
        pipe.hgetall(keys.group_run(attempt))
    runs = [{text(k): text(v) for k, v in raw.items()} for raw in pipe.execute()]
    pipe = client.pipeline(transaction=False)
    for fields in runs:
        pipe.get(keys.group_choice(fields.get("group") or "-"))
    out = []
    for attempt, fields, why in zip(attempts, runs, pipe.execute(), strict=True):
        if not fields:
            continue
        try:
            waiting = json.loads(fields.get("waiting_for") or "{}")
        except ValueError:
            waiting = {}
        out.append({
            "attempt": attempt, "group": fields.get("group"), "name": fields.get("devices", "").replace(",", GROUP_SEPARATOR),
            "job_id": fields.get("job_id"), "leader": fields.get("leader"), "state": fields.get("state"),
            "waiting_for": waiting if fields.get("state") in ("sent", "waiting") else {},
            "closed": {k.split(":", 1)[1]: int(v or 0) for k, v in sorted(fields.items()) if k.startswith("closed:")},
            "since": float(fields.get("since") or 0.0), "seq": int(fields.get("seq") or 0),
            "level": _level(fields.get("level")).value,
            "why": text(why) if why is not None else None,
        })
    return sorted(out, key=lambda g: precedence(Level(g["level"]), g["seq"]))


def _level(value: str | None) -> Level:
    """A group's level as its hash says it (a hash written before groups had levels: normal)."""
    try:
        return parse_level(value or DEFAULT_LEVEL)
    except ConfigError:
        return DEFAULT_LEVEL
