"""Commands from a producer: an existing program as a job, and its output as it runs.

::

    import tasks
    handle = tasks.fan_out(tasks.command(["python", "train.py", "--lr", "0.1"]), devices="cpu")
    for device, stream, line in tasks.follow_logs(handle):   # until every device has finished
        print(f"[{device}] {line}")
    results = handle.get()   # {device: entry}; entry["output"]["command"]["exit_code"] == 0

    tasks.sweep(tasks.command(["python", "train.py", "--lr", "{lr}"]), tasks.grid({"lr": [0.1, 0.01]}))

A command is the job ``command`` (:mod:`tasks.core.commands`); it runs only on devices whose
worker config allows its program and folder, which ``fan_out`` checks against the
registry before anything is sent (:func:`tasks.producer.fanout.check_jobs`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import redis

from ..core import keys
from ..core.commands import COMMAND_JOB, command_params
from ..core.defaults import FOLLOW_BLOCK_MS
from ..core.errors import ConfigError
from ..core.records import JobOptions
from .fanout import JobSpec

logger = logging.getLogger(__name__)


def command(argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
            options: JobOptions | Mapping[str, Any] | None = None, **params: Any) -> JobSpec:
    """The job that runs ``argv`` on a device: give it to ``fan_out``, ``sweep`` or ``optimize``.

    Args:
        argv: the program and its arguments; ``{name}`` is replaced by the parameter ``name``
            (a sweep's trial, an Optuna trial, or ``params``).
        cwd: working directory: absolute, or relative to the worker's first allowed folder
            (its config's ``commands.workdirs``; default: that folder).
        env: variables added to the command's environment.
        options: :class:`~tasks.core.records.JobOptions` (e.g. ``{"time_limit_s": 600}``).
        params: parameters for the placeholders (also in ``$DEVICEFLEET_PARAMS`` as JSON).

    Raises:
        ConfigError: the argv, env or a parameter is malformed; the message names it.
    """
    if isinstance(argv, str):
        raise ConfigError(f"argv={argv!r} is a string: give the program and its arguments as a list, "
                          "e.g. ['python', 'train.py', '--lr', '0.1'] (no shell is involved)")
    kwargs: dict[str, Any] = {"argv": list(argv), **params}
    if cwd is not None:
        kwargs["cwd"] = cwd
    if env:
        kwargs["env"] = dict(env)
    command_params(kwargs)
    return JobSpec.of(COMMAND_JOB, kwargs, options)


class LogFollower:
    """The output of commands as it arrives: ``poll()`` returns new ``(device, stream, line)``
    (``stream`` is ``out`` or ``err``) from every device's stream in one blocking read."""

    def __init__(self, client: redis.Redis, task_ids: Mapping[str, str]) -> None:
        self.client = client
        self._device_of = {keys.command_log(task_id): device for device, task_id in task_ids.items()}
        self._last = dict.fromkeys(self._device_of, "0-0")

    def poll(self, block_ms: int | None = FOLLOW_BLOCK_MS) -> list[tuple[str, str, str]]:
        """New lines, waiting up to ``block_ms`` for some (None: do not wait)."""
        if not self._last:
            return []
        answer: Any = self.client.xread(dict(self._last), block=block_ms)  # type: ignore[arg-type]
        out: list[tuple[str, str, str]] = []
        for key, entries in answer or []:
            name = key.decode() if isinstance(key, bytes) else str(key)
            for entry_id, fields in entries:
                self._last[name] = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                raw = fields.get(b"lines") or fields.get("lines")
                try:
                    batch = json.loads(raw) if raw else []
                except ValueError:
                    continue
                out.extend((self._device_of[name], str(stream), str(line)) for stream, line in batch)
        return out


def follow_logs(handle: Any, *, until: Callable[[], bool] | None = None,
                block_ms: int = FOLLOW_BLOCK_MS) -> Iterator[tuple[str, str, str]]:
    """``(device, stream, line)`` of a fan-out's commands as they print them, until every job
    has finished (or ``until()`` is true), then what is left.

    ``handle`` is a :class:`~tasks.producer.fanout.FanOut` (or anything with ``app``,
    ``task_ids`` and ``ready()``).
    """
    from .connections import Connections

    connections = getattr(handle, "connections", None) or Connections.of(handle.app)
    follower = LogFollower(connections.redis, handle.task_ids)
    done = until or handle.ready
    while True:
        finished = done()
        yield from follower.poll(block_ms)
        if finished:
            yield from follower.poll(None)
            return
