"""Devices: their names, what a worker process may see, and how cores are shared.

A device is named ``<kind><index>``: ``cpu0``, ``cpu1``, ``gpu0``. The worker that owns a
device starts its job processes with ``CUDA_VISIBLE_DEVICES`` set (``-1`` for a CPU device, the
GPU's index for a GPU device), so torch in them sees that device and no other.

In a fleet of several hosts (``DEVICEFLEET_DEVICE_NAMES=host``) a device's name also carries its
host, ``cpu0@hosta``, equal to its worker's Celery node name, so every device of every host has
one name, one queue (``device.cpu0@hosta``) and one registry entry.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .errors import ConfigError, DeviceVisibilityError

logger = logging.getLogger(__name__)

_NAME = re.compile(
    r"^(?P<kind>cpu|gpu)(?P<index>\d{1,3})(?:@(?P<host>[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})))?$"
)


class DeviceNames(str, Enum):
    """How devices are named: ``short`` (``cpu0``, one host) or ``host`` (``cpu0@hosta``)."""

    SHORT = "short"
    HOST = "host"


class DeviceKind(str, Enum):
    """What a device is; also the name of the queue every worker of that kind consumes."""

    CPU = "cpu"
    GPU = "gpu"


@dataclass(frozen=True)
class Device:
    """A device of this host, parsed from its name."""

    kind: DeviceKind
    index: int
    #: The host part of a multi-host name (``cpu0@hosta``); None for a short name.
    host: str | None = None

    @property
    def base(self) -> str:
        """The name without its host: ``cpu0``; worker configs and core plans use it."""
        return f"{self.kind.value}{self.index}"

    @property
    def name(self) -> str:
        """The device's id in queues, the registry and results: ``cpu0`` or ``cpu0@hosta``."""
        return self.base if self.host is None else f"{self.base}@{self.host}"

    @property
    def cuda_visible_devices(self) -> str:
        """What the owning worker's ``CUDA_VISIBLE_DEVICES`` must be."""
        return "-1" if self.kind is DeviceKind.CPU else str(self.index)

    @classmethod
    def parse(cls, name: str) -> Device:
        """Parse ``cpu0`` / ``gpu3``, or ``cpu0@hosta`` with a host.

        Raises:
            ConfigError: ``name`` is not a device name.
        """
        match = _NAME.match(name)
        if not match:
            raise ConfigError(
                f"{name!r} is not a device name: expected cpu<N> or gpu<N>, optionally with "
                "@<host>, e.g. cpu0, gpu1 or gpu1@hosta"
            )
        return cls(DeviceKind(match["kind"]), int(match["index"]), match["host"])

    @classmethod
    def named(cls, name: str, naming: DeviceNames, host: str) -> Device:
        """The device ``name`` stands for under ``naming``: ``cpu0`` -> ``cpu0@host`` for HOST.

        Raises:
            ConfigError: ``name`` is not a device name, or carries a host under SHORT naming.
        """
        device = cls.parse(name)
        if naming is DeviceNames.SHORT:
            if device.host is not None:
                raise ConfigError(
                    f"device {name!r} names a host, but DEVICEFLEET_DEVICE_NAMES=short; use "
                    f"{device.base!r}, or set DEVICEFLEET_DEVICE_NAMES=host for a multi-host fleet"
                )
            return device
        return device if device.host is not None else cls(device.kind, device.index, host)

    def __str__(self) -> str:
        return self.name


def _nvml_uuid(uuid: object) -> str | None:
    """torch's device UUID as NVML and ``nvidia-smi -L`` spell it: ``GPU-<uuid>``."""
    if not uuid:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def visibility() -> dict[str, Any]:
    """What this process sees: its ``CUDA_VISIBLE_DEVICES`` and torch's view of the devices."""
    import torch

    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    info: dict[str, Any] = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_available": cuda,
        "cuda_device_count": torch.cuda.device_count() if cuda else 0,
        "device_name": torch.cuda.get_device_name(0) if cuda else cpu_model_name(),
        "total_memory": props.total_memory if props is not None else None,
        # How NVML finds the same GPU (its index order need not be CUDA's): "GPU-<uuid>".
        "uuid": _nvml_uuid(getattr(props, "uuid", None)) if props is not None else None,
        "compute_capability": f"{props.major}.{props.minor}" if props is not None else None,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    return info


def check_visibility(device: Device) -> dict[str, Any]:
    """Refuse to run a worker that cannot see exactly the device it owns.

    Returns:
        :func:`visibility` of this process.

    Raises:
        DeviceVisibilityError: a GPU worker sees no GPU, or a CPU worker sees one.
    """
    seen = visibility()
    if device.kind is DeviceKind.GPU and not seen["cuda_available"]:
        raise DeviceVisibilityError(
            f"{device}: GPU {device.index} is not visible (CUDA_VISIBLE_DEVICES="
            f"{seen['cuda_visible_devices']}, torch {seen['torch_version']} sees no CUDA device). "
            "Check `nvidia-smi`, the driver, and that this host has that many GPUs; "
            "refusing to start."
        )
    if device.kind is DeviceKind.CPU and seen["cuda_available"]:
        raise DeviceVisibilityError(
            f"{device}: a CPU worker sees a CUDA device (CUDA_VISIBLE_DEVICES="
            f"{seen['cuda_visible_devices']}); refusing to start"
        )
    return seen


def cpu_model_name() -> str:
    """The host CPU's model name, or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def host_name() -> str:
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def usable_cores() -> list[int]:
    """The cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def count_gpus() -> int:
    """GPUs torch sees in this process (honours ``CUDA_VISIBLE_DEVICES``)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_core_list(text: str) -> list[int]:
    """Parse a Linux CPU list such as ``0-3,6``.

    Raises:
        ConfigError: ``text`` is not a CPU list.
    """
    cores: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
                if high < low:
                    raise ValueError
                cores.update(range(low, high + 1))
            else:
                cores.add(int(part))
    except ValueError:
        raise ConfigError(f"cores={text!r} is not a CPU list such as 0-3,6") from None
    if not cores or min(cores) < 0:
        raise ConfigError(f"cores={text!r} is not a CPU list such as 0-3,6")
    return sorted(cores)


def format_core_list(cores: list[int]) -> str:
    """The inverse of :func:`parse_core_list`, compact: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[str] = []
    ordered = sorted(set(cores))
    start = prev = ordered[0]
    for core in ordered[1:] + [None]:  # type: ignore[list-item]
        if core is not None and core == prev + 1:
            prev = core
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(runs)


def plan_cores(
    cores: list[int], cpu_workers: int, gpu_workers: int, loader_cores_per_gpu: int
) -> dict[str, list[int]]:
    """Share ``cores`` between workers so they never oversubscribe the host.

    Each GPU worker gets up to ``loader_cores_per_gpu`` cores for its data loading, but never
    more than its fair share; the rest is split evenly between CPU workers, who each get at
    least one core. With fewer cores than workers, workers share cores round-robin.

    Returns:
        ``{device name: cores}`` for ``cpu0..`` and ``gpu0..``.
    """
    if cpu_workers < 0 or gpu_workers < 0 or cpu_workers + gpu_workers == 0:
        raise ConfigError(
            f"cannot plan cores for {cpu_workers} CPU and {gpu_workers} GPU workers"
        )
    total = len(cores)
    workers = cpu_workers + gpu_workers
    plan: dict[str, list[int]] = {}
    if total < workers:
        names = [f"gpu{i}" for i in range(gpu_workers)] + [f"cpu{i}" for i in range(cpu_workers)]
        for position, name in enumerate(names):
            plan[name] = [cores[position % total]]
        return plan
    fair = total // workers
    per_gpu = max(1, min(loader_cores_per_gpu, fair)) if cpu_workers else total // workers
    next_core = 0
    for index in range(gpu_workers):
        plan[f"gpu{index}"] = cores[next_core : next_core + per_gpu]
        next_core += per_gpu
    remaining = cores[next_core:]
    if cpu_workers:
        share, extra = divmod(len(remaining), cpu_workers)
        start = 0
        for index in range(cpu_workers):
            size = share + (1 if index < extra else 0)
            plan[f"cpu{index}"] = remaining[start : start + size]
            start += size
    return plan
