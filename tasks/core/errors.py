"""Every exception devicefleet raises derives from :class:`DeviceFleetError`.

The tree, by area::

    DeviceFleetError
    ├── ConfigError               settings, worker configs, command-line values
    │   └── MissingExtra          an optional package a feature needs is not installed
    ├── FleetError                starting or finding a fleet
    │   ├── RedisServerError      the embedded redis-server
    │   ├── NoFleetError          nothing to connect to
    │   ├── FleetLost             the fleet went away while a producer waited on it
    │   ├── FlowerError           Flower, started with the fleet
    │   ├── DeviceVisibilityError a worker cannot see the device it owns
    │   └── CredentialsError      a user's credentials are wrong, missing, revoked or not enough
    ├── FanOutError               dispatching and collecting jobs
    │   ├── DeviceUnavailable     a requested device has no live worker
    │   ├── GroupUnavailable      no live host has the devices a group asks for
    │   ├── FanOutTimeout         the result did not arrive in time
    │   └── SweepConflict         a named sweep exists with other trials
    └── JobError                  raised inside a worker, reported in an entry
        ├── UnknownJob            not a job of the worker's allowlist
        ├── InvalidJobArguments   kwargs that the job's schema refuses
        ├── DatasetError          a dataset file is missing or unreadable
        ├── TrainingDiverged      the loss became NaN or infinite
        ├── PackTooLarge          more packed trials than fit the slot's memory budget
        ├── OutOfMemory           the device ran out of memory
        ├── GangFailed            a distributed job's ranks could not form or gave up
        ├── JobCrashed            the job's process died (a signal, an exit status)
        ├── CommandRefused        a command's program or folder is not in the worker's config
        ├── CommandFailed         a command exited with a non-zero status or a signal
        ├── NoJobProcess          no job process became ready to run the job
        │   └── NoJobAccount      none may run as the job's user's system account on its host
        ├── JobTimeout            the job ran past its time limit and was ended
        ├── WorkerLost            the job's workers died with it too often: not run again
        ├── WorkerStopped         the worker stopped and the job did not end within its stop timeout
        ├── JobCancelled          the producer cancelled it (``handle.cancel()``, a pruned trial)
        └── UserNotVerified       the job names a user whose credentials did not send it

Control flow, apart (as dramatiq keeps its ``Retry`` and ``Skip``): raised and caught inside the
worker wing to steer a distributed job's rank, never reported in an entry::

    DeviceFleetError
    └── ControlFlow
        ├── GiveWay               a rank gives its device to an older assembling gang (wait-die)
        ├── Preempted             higher-level work takes the device: the job goes back to its queue
        └── PeerLost              a rank's gang lost a peer: it runs again in the next generation

Every message says what was wrong, with the offending value, and what to do.

The exit statuses of devicefleet's commands and processes are spelled here once
(:data:`EXIT_FAILED`, :data:`EXIT_CONFIG`, :data:`EXIT_FLEET_LOST`, :data:`EXIT_INTERRUPTED`).

Control-flow exceptions, which their caller catches to take another path rather than to
report a failure, are documented apart from this tree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class DeviceFleetError(Exception):
    """Root of every devicefleet error."""


class ConfigError(DeviceFleetError, ValueError):
    """A setting, worker config or command-line value is invalid."""


class MissingExtra(ConfigError, ImportError):
    """An optional package a feature needs is not installed; the message says how to add it."""


class CapError(ConfigError):
    """A cap (``devicefleet cap``, :mod:`tasks.core.caps`) names an unknown device kind, user or
    team, or a bad value; the message names it and says what to do."""


class FleetError(DeviceFleetError):
    """Starting, stopping or finding a fleet failed."""


class RedisServerError(FleetError):
    """The embedded redis-server could not be found or started."""


class NoFleetError(FleetError):
    """No Redis URL was given and no local fleet is running."""


class FleetLost(FleetError):
    """The fleet went away while a producer waited on it: its launcher stopped (``devicefleet
    up`` ended before every job did), or its Redis stayed unreachable past the retries."""


class DeviceVisibilityError(FleetError):
    """A worker cannot see the device it is meant to own."""


class CredentialsError(FleetError, PermissionError):
    """A user's credentials are wrong, missing or revoked, name an unknown user, or do not allow
    what was asked (another user's job or result, a purge); the message says what to do."""


class FlowerError(FleetError):
    """Flower, started with the fleet, failed to start or is misconfigured."""


#: Exit status of a command or process that failed: a job failed, the fleet could not be reached.
EXIT_FAILED = 1
#: Exit status of a command or process refused before it did anything: a bad setting, worker
#: config or command-line value (click's usage errors exit 2 too). systemd does not restart a
#: worker that exits 2 (``RestartPreventExitStatus=2``): starting it again cannot fix its settings.
EXIT_CONFIG = 2
#: Exit status of a producer command whose fleet went away while it waited (:class:`FleetLost`).
EXIT_FLEET_LOST = 3
#: Exit status of a command stopped by Ctrl-C: 128 + SIGINT, as a shell reports it.
EXIT_INTERRUPTED = 130


def start_exit_status(exc: BaseException) -> int:
    """The exit status of a process that could not start because of ``exc``: :data:`EXIT_CONFIG`
    for a :class:`ConfigError` (starting it again cannot help), else :data:`EXIT_FAILED`."""
    return EXIT_CONFIG if isinstance(exc, ConfigError) else EXIT_FAILED


class FanOutError(DeviceFleetError):
    """A fan-out could not be dispatched or collected."""


class DeviceUnavailable(FanOutError, LookupError):
    """A requested device has no live worker."""

    def __init__(self, missing: Iterable[str], live: Iterable[str]) -> None:
        self.missing = sorted(missing)
        self.live = sorted(live)
        if self.live:  # a fleet runs: `up` already started a worker for each device its host has
            fix = (f"The fleet runs and has no worker for it: start one on a host that has "
                   f"{self.missing[0].split(' ')[0]} (`devicefleet worker NAME` there), or ask for live devices "
                   f"only (--devices {','.join(self.live)})")
        else:
            fix = "Start the workers (`devicefleet up`, or `devicefleet worker NAME`)"
        super().__init__(
            f"no live worker for device(s) {', '.join(self.missing)}; live devices: "
            f"{', '.join(self.live) or 'none'}. {fix}."
        )


class UnknownDevice(ConfigError, LookupError):
    """An operator named a device the fleet does not know, or one not in the state asked for
    (``devicefleet device drain | undrain``)."""

    def __init__(self, device: str, known: list[str], why: str, choices: str = "known devices") -> None:
        self.device = device
        self.known = known
        super().__init__(f"device {device!r}: {why}; {choices}: {', '.join(known) if known else 'none'}")


class GroupUnavailable(FanOutError, LookupError):
    """No live host can give a device group what it asks (k devices of one kind); nothing was sent."""

    def __init__(self, asked: str, hosts: Mapping[str, Iterable[str]]) -> None:
        self.asked = asked
        self.hosts = {host: sorted(devices) for host, devices in hosts.items()}
        has = "; ".join(f"{host} has {', '.join(devices) or 'none'}" for host, devices in sorted(self.hosts.items()))
        super().__init__(
            f"no live host can run a group of {asked}: {has or 'no live worker'}. A group's devices "
            "are of one kind on one host: ask for fewer, or start more workers on one host."
        )


class PlacementUnavailable(FanOutError, LookupError):
    """No live device in service meets a job's constraints (:mod:`tasks.core.placement`); nothing was sent."""

    def __init__(self, asked: str, closest: Mapping[str, str], considered: int, *, named: bool = False) -> None:
        self.asked = asked
        self.closest = dict(closest)
        lacks = "; ".join(f"{device}: {why}" for device, why in self.closest.items())
        if named:  # devices the caller named outright: each must match, none is dropped quietly
            super().__init__(
                f"{', '.join(self.closest)}, named outright, "
                f"{'does' if len(self.closest) == 1 else 'do'} not meet the constraints {asked}: {lacks}. "
                "Name only devices that meet them, or give a kind ('cpu', 'gpu', 'all') to run on the "
                "matching ones (nothing was sent)."
            )
            return
        super().__init__(
            f"no live device meets the constraints {asked} (of {considered} considered); closest: "
            f"{lacks or 'no live worker'}. Ask for less, or start or label a device that has it (nothing was sent)."
        )


class FanOutTimeout(FanOutError, TimeoutError):
    """``FanOut.get`` ran out of time before every device reported."""

    def __init__(self, timeout: float, pending: Iterable[str]) -> None:
        self.timeout = timeout
        self.pending = sorted(pending)
        super().__init__(
            f"fan-out not finished after {timeout:g} s; still running on: "
            f"{', '.join(self.pending) or 'none (collecting)'}. Call get() again to keep waiting."
        )


class SweepConflict(FanOutError, ValueError):
    """A sweep or study of that name exists with other jobs or trials; nothing was sent."""


class JobError(DeviceFleetError):
    """A job could not run; reported in the device's entry, never raised to the producer."""


class UnknownJob(JobError, LookupError):
    """The job name is not in the worker's allowlist."""


class InvalidJobArguments(JobError, ValueError):
    """The job's kwargs do not match its schema.

    Raised by the producer (``fan_out``, ``sweep``, ``optimize``, ``devicefleet run``) before
    anything is sent, from the params schema the workers publish: one line naming the job (and a
    sweep's trial), each bad field with its value and a close name, e.g. ``train: unexpected
    argument 'epoch' (3); did you mean 'epochs'?``; the CLI exits 2 (:data:`EXIT_CONFIG`). Else (a plain Celery
    producer, a worker that publishes no schema) the job process raises it: the entry's error.
    """


class DatasetError(JobError):
    """A dataset is missing, unreadable, or not of the expected shape."""


class TrainingDiverged(JobError, ArithmeticError):
    """Training produced a NaN or infinite loss."""


class PackTooLarge(JobError, MemoryError):
    """More packed trials than fit the slot's memory budget; the message says how many fit.
    A member the job process did not run for it goes back to its queue (a later pack runs it)."""


class OutOfMemory(JobError, MemoryError):
    """The job ran out of device memory; ``memory`` holds the figures at the time."""

    def __init__(self, message: str, *, memory: dict[str, object] | None = None, recycle: bool = False) -> None:
        super().__init__(message)
        self.memory = memory or {}
        #: Device memory was still held after the release: the worker should be recycled.
        self.recycle = recycle


class GangFailed(JobError):
    """A distributed job failed as a whole: a rank did not join within the join timeout (the
    message names its device), a rank's job raised, or the gang used up its restarts."""


class CommandRefused(JobError, PermissionError):
    """A command names a program or a working directory its device's worker config does not
    allow (``[commands]``), or the device runs no commands; refused before it starts."""


class CommandFailed(JobError):
    """A command exited with a non-zero status, or was ended by a signal; ``command`` holds
    the figures (``exit_code``, ``signal``, ``tail``: its last lines, ``log``: its log folder)."""

    def __init__(self, message: str, *, command: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.command = command or {}


class JobCancelled(JobError):
    """The job was cancelled while it ran: raised by ``ctx.progress()`` (cooperative, at the
    job's next report), so the job's own ``finally`` blocks and context managers run."""


class JobCrashed(JobError):
    """The job's process died while it ran (a signal such as SIGSEGV or SIGKILL, ``os._exit``,
    the kernel's out-of-memory killer): the message names the signal or exit status and ends
    with the last lines the job printed. The worker lives on; the job is not run again."""


class NoJobProcess(JobError):
    """No job process of the worker became ready in time to run the job (the message says what
    the last start said: a job module that stopped importing, a device that went away)."""


class JobTimeout(JobError, TimeoutError):
    """The job ran past its time limit (the job option ``time_limit_s``, else the worker
    config's ``max_job_seconds``) and was stopped: at its next ``ctx.progress()``, or by ending
    its process when it did not report within the grace period."""


class WorkerLost(JobError):
    """Each of the job's last ``max_attempts`` runs took its whole worker down (the worker
    died holding it); it is not run again, and is kept in the dead-letter record."""


class DeviceMismatch(JobError, LookupError):
    """A job sent to one device by name asks for what that device is not (its constraints: see
    :mod:`tasks.core.placement`; the device changed since it was sent); it did not run."""


class WorkerStopped(JobError):
    """The worker was asked to stop (``systemctl stop``, Ctrl-C on ``up``) and the job did not
    end within the worker's stop timeout; its process was ended."""


class DeviceFailed(JobError):
    """The job's device failed under it (a fatal Xid, a double-bit ECC error: its worker's health
    service drained it, :mod:`tasks.worker.health`). A job from a shared queue goes back to it
    without spending an attempt; a job sent to that device by name ends with this error."""


class UserNotVerified(JobError, PermissionError):
    """The job names a user (``options.user``) but was not signed with that user's credentials
    (:mod:`tasks.core.users`): it is refused, never run or counted as theirs."""


class NoJobAccount(NoJobProcess, PermissionError):
    """The worker runs each user's jobs as the user's own system account (``job_accounts``:
    :mod:`tasks.core.accounts`) and has none for this job's user, or it is not usable (no such
    account on the host, the user's folder missing or open to others): the job is refused."""


class ControlFlow(DeviceFleetError):
    """Not a failure: the worker wing steers a distributed job's rank with these (see the
    module's docstring); they never reach an entry or a producer."""


class GiveWay(ControlFlow):
    """A gang's rank or a group's leader gives its device up to older work, or work of a higher
    level, that claims it (:mod:`tasks.core.claims`); its message goes back to the queue and runs again later."""

    def __init__(self, device: str, older: str) -> None:
        super().__init__(f"{device} is needed by the older gang {older}; this rank comes back later")
        self.device = device
        self.older = older


class Preempted(ControlFlow):
    """Work of a higher level waits for the job's device: raised by ``ctx.progress()`` once the
    worker asked the job to make way (:mod:`tasks.worker.preemption`). Let it propagate (the job
    has checkpointed, or does in its ``finally``): the job goes back to its queue with the same id
    and runs again, counted as a preemption, not as a failure or a death."""


class PeerLost(ControlFlow):
    """A rank's gang lost a peer (its collective failed, or the gang moved to a later
    generation meanwhile): the rank runs again with the gang's next generation."""


# --- issue 51: one exit-code rule for every command -------------------------------------------

#: Errors raised before anything was sent (a producer's refusal at its edge): a bad value on the
#: command line or in Python, an unknown job or device, a group that cannot form, a command its
#: device does not allow, a sweep that clashes. A command ended by one exits :data:`EXIT_CONFIG`.
REFUSALS: tuple[type[DeviceFleetError], ...] = (
    ConfigError, UnknownJob, InvalidJobArguments, CommandRefused, DeviceUnavailable, GroupUnavailable,
    SweepConflict, PlacementUnavailable, CredentialsError,
)


def exit_status(exc: BaseException) -> int:
    """The exit status of a command ended by ``exc``: :data:`EXIT_CONFIG` for a refusal before
    anything was sent (:data:`REFUSALS`), :data:`EXIT_FLEET_LOST` for a fleet that went away or
    is not there (:class:`FleetLost`, :class:`NoFleetError`), else :data:`EXIT_FAILED`."""
    if isinstance(exc, (FleetLost, NoFleetError)):
        return EXIT_FLEET_LOST
    return EXIT_CONFIG if isinstance(exc, REFUSALS) else EXIT_FAILED
