"""Queue names. Every device worker consumes three queues:

- its kind's queue (``cpu`` or ``gpu``): work for any worker of that kind;
- its own queue (``device.<name>``): work for exactly this device, which is how a fan-out
  addresses each device once;
- ``fleet``: bookkeeping every worker may do, such as a chord's collect step.

Each of them is one list per level (:mod:`tasks.core.priority`): ``device.cpu0:urgent``,
``device.cpu0`` (``normal``), ``device.cpu0:batch``, and the worker takes every ``urgent`` list
before any ``normal`` one.

A sweep adds a fourth for its lifetime: ``sweep.<id>``, which the sweep's producer asks the
chosen devices' workers to consume (Celery's ``add_consumer`` control command), so each device
takes the sweep's next trial the moment it is free.
"""

from __future__ import annotations

from enum import Enum

from .devices import Device

DEVICE_QUEUE_PREFIX = "device."
SWEEP_QUEUE_PREFIX = "sweep."


class QueueName(str, Enum):
    CPU = "cpu"
    GPU = "gpu"
    FLEET = "fleet"


def device_queue(device: str) -> str:
    """The queue only ``device``'s worker consumes."""
    return f"{DEVICE_QUEUE_PREFIX}{device}"


#: Between a device and a copy number in a fan-out's keys when it runs one job per slot
#: (``fan_out(..., per_slot=True)``: ``cpu0/0``, ``cpu0/1``).
SLOT_KEY_SEPARATOR = "/"


def slot_key(device: str, copy: int) -> str:
    """The key of ``device``'s ``copy``-th job in a fan-out that runs one job per slot."""
    return f"{device}{SLOT_KEY_SEPARATOR}{copy}"


def key_device(key: str) -> str:
    """The device of a fan-out's key: ``cpu0/1`` -> ``cpu0``; a device name is its own."""
    return key.split(SLOT_KEY_SEPARATOR, 1)[0]


def sweep_queue(sweep_id: str) -> str:
    """The queue of one sweep's trials, consumed by the sweep's devices while it runs."""
    return f"{SWEEP_QUEUE_PREFIX}{sweep_id}"


def worker_queues(device: Device, extra: list[str] | None = None) -> list[str]:
    """Every queue the worker owning ``device`` consumes, in order within a level (its registry
    record's ``queues``); it consumes each one's list of every level, in the order
    :func:`tasks.core.queue_lists.leveled` gives."""
    queues = [device_queue(device.name), device.kind.value, QueueName.FLEET.value]
    for name in extra or []:
        if name not in queues:
            queues.append(name)
    return queues
