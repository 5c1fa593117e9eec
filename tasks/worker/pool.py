"""A device worker's job processes, kept warm: one per slot and a spare, per user and OS account.

:class:`ProcessPool` owns the processes' life and never a run: it starts them, hands a ready one
to a job (:meth:`ProcessPool._take`), takes it back or retires it (:meth:`ProcessPool._give_back`)
and keeps the spares warm from a thread of its own; a run is :mod:`tasks.worker.runloop`'s.

A process belongs to the user of the first job it runs (:mod:`tasks.worker.owners`, which
chooses the process a job takes and, under job accounts, whose process starts next); a fresh
spare is spawned in the background. Up to ``kept_user_processes`` idle processes of other users
stay warm beyond the slots and spares (users who alternate each find theirs); past that, the
least recently used is retired to make room for the spare.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.accounts import JobAccount, JobAccounts
from ..core.defaults import (
    CANCEL_GRACE_S,
    KEPT_USER_PROCESSES,
    PROCESS_START_TIMEOUT_S,
    RESPAWN_BACKOFF_S,
    SPARE_PROCESSES,
    SUPERVISOR_JOIN_S,
)
from ..core.errors import NoJobAccount, NoJobProcess
from ..core.settings import TENSORBOARD_SUBDIR
from ..core.wire import Finished, Hello, ProcessSpec
from . import owners
from .group_host import GroupHostLink
from .jobprocess import JobProcess, ProcessGone

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessPolicy:
    """When job processes are retired, and how long a stopped job has."""

    #: Jobs one process runs before it is retired; 0: no limit.
    jobs_per_process: int = 0
    #: Retire a process whose resident memory grew by more than this since it was ready; 0: never.
    max_memory_growth_bytes: int = 0
    #: Seconds a job has to stop at ``ctx.progress()`` once asked, before its process is ended.
    cancel_grace_s: float = CANCEL_GRACE_S
    #: Seconds a new process has to import torch and the job modules and say hello.
    start_timeout_s: float = PROCESS_START_TIMEOUT_S
    #: Idle processes of other users kept warm beyond the slots and spares (:mod:`.owners`).
    kept_user_processes: int = KEPT_USER_PROCESSES


class ProcessPool:
    """The job processes of one device worker: warm, spare, other users' kept, starting."""

    def __init__(self, spec: ProcessSpec, env: dict[str, str], cwd: Path, policy: ProcessPolicy,
                 label: str, slots: int = 1, accounts: JobAccounts | None = None) -> None:
        self.spec = spec
        #: Each user's jobs run as the user's own system account (:mod:`tasks.core.accounts`);
        #: None or empty: every job process runs as this worker.
        self.accounts = accounts if accounts else None
        self.policy = policy
        self.label = label
        #: Job processes kept alive: one per slot and the spares.
        self.warm = slots + SPARE_PROCESSES
        #: The most job processes alive at once: the warm ones and the other users' kept.
        self.most = self.warm + policy.kept_user_processes
        self._env = env
        self._cwd = cwd
        self._cond = threading.Condition()
        self._idle: list[JobProcess] = []
        self._busy: set[JobProcess] = set()
        self._spawning = 0
        #: Under job accounts, whose processes are starting.
        self._spawning_for: list[str] = []
        #: Jobs waiting for a process (none of their user's and no spare was idle), and whose.
        self._waiting = 0
        self._waiting_for: Counter[str] = Counter()
        #: The user of the last job that took a process (under job accounts, its spares are theirs).
        self._last_owner = owners.LOCAL
        self._closed = False
        self._last_failure: str | None = None
        self._thread = threading.Thread(target=self._keep_warm, name="devicefleet-spawner", daemon=True)
        #: Called (outside the lock) when a process was started or ended: the registry shows them.
        self.on_change: Callable[[], None] | None = None
        #: Where a device group's own job process starts (:meth:`_take_apart`): the group host
        #: under systemd, whose unit may open every GPU of the host; None: this worker's child.
        self.group_host: GroupHostLink | None = None

    # -- life --------------------------------------------------------------------------------

    def start(self) -> Hello:
        """Start the first job process and wait for its hello, then keep a spare warm.

        Raises:
            ProcessGone: the process refused (a job module does not import, the device is not
                visible: see its ``refused``) or did not get ready in time.
        """
        first = self._spawn(owners.LOCAL if self.accounts else None)
        hello = first.wait_hello(self.policy.start_timeout_s)
        with self._cond:
            self._idle.append(first)
        self._thread.start()
        return hello

    def close(self) -> None:
        """End every job process (a running job's too) and stop spawning."""
        with self._cond:
            self._closed = True
            processes = [*self._idle, *self._busy]
            self._idle.clear()
            self._cond.notify_all()
        for process in processes:
            process.kill("the worker is leaving")
        if self.group_host is not None:
            self.group_host.close()
        if self._thread.is_alive():
            self._thread.join(SUPERVISOR_JOIN_S)

    def kill_all_now(self) -> None:
        """SIGKILL every job process group at once (a worker that must exit now; called from a
        signal handler, so it takes no lock and waits for nothing)."""
        for process in [*list(self._idle), *list(self._busy)]:
            process.kill_now("the worker is exiting now")

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no job runs; False if one still did after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @property
    def pids(self) -> list[int]:
        """The job processes alive now (running a job first)."""
        with self._cond:
            return [p.pid for p in [*self._busy, *self._idle] if p.alive]

    @property
    def spare_pids(self) -> list[int]:
        """The idle job processes that ran no job yet: any user's job may take one."""
        with self._cond:
            return [p.pid for p in self._idle if p.alive and p.jobs_run == 0]

    # -- handing out and taking back ---------------------------------------------------------

    def _take_apart(self, owner: str, cores: list[int], threads: int, env: dict[str, str]) -> JobProcess:
        """A process of its own for one job, started with ``env`` over the device's environment
        and pinned to ``cores``, counted busy until given back (retired): under systemd the group
        host's child (:attr:`group_host`), whose unit may open every GPU of the host.

        Raises:
            NoJobProcess: it did not become ready within the start timeout.
        """
        spec, account = self._account(owner) if self.accounts is not None else (self.spec, None)
        spec = spec.model_copy(update={"cores": cores, "torch_threads": threads})
        process: JobProcess | None = None
        try:
            process = JobProcess(spec, {**self._env, **env, "OMP_NUM_THREADS": str(threads)}, self._cwd, self.label,
                                 self.group_host, self.policy.start_timeout_s, account=account)
            with self._cond:
                self._busy.add(process)
            process.wait_hello(self.policy.start_timeout_s)
        except ProcessGone as exc:
            if process is not None:
                self._give_back(process, "it did not start")
            raise NoJobProcess(f"{self.label}: the group's own job process did not start: {exc}") from None
        return process

    def _retire_reason(self, process: JobProcess, finished: Finished | None) -> str | None:
        if finished is None:
            return "its job was not finished by it"
        if finished.retire:
            return finished.retire
        growth = process.rss_growth_bytes(finished.rss_bytes)
        if self.policy.max_memory_growth_bytes and growth > self.policy.max_memory_growth_bytes:
            return (f"its memory grew by {growth / 2**20:.0f} MiB, past the threshold of "
                    f"{self.policy.max_memory_growth_bytes / 2**20:.0f} MiB")
        if self.policy.jobs_per_process and process.jobs_run >= self.policy.jobs_per_process:
            return f"it ran jobs_per_process={self.policy.jobs_per_process} jobs"
        return None

    def _take(self, owner: str) -> JobProcess:
        """A ready process for a job of ``owner``: its own warm one, else the spare (then
        ``owner``'s), else the next fresh one (:func:`owners.pick`)."""
        deadline = time.monotonic() + self.policy.start_timeout_s
        checked = False
        with self._cond:
            while True:
                for dead in [p for p in self._idle if not p.alive]:
                    self._idle.remove(dead)
                    logger.warning("%s: idle job process %d died (%s); replacing it", self.label,
                                   dead.pid, dead.exit_text())
                    dead.kill("it died while idle")  # reaped, its group and pipe closed
                    self._cond.notify_all()
                process = owners.pick(self._idle, owner)
                if process is not None:
                    self._idle.remove(process)
                    spare, process.owner = process.jobs_run == 0, owner
                    self._last_owner = owner
                    self._busy.add(process)
                    self._cond.notify_all()  # the spare may be taken: the spawner makes another
                    break
                if self.accounts is not None and not checked:
                    self.accounts.resolve(owner)  # NoJobAccount now, not a start timeout later
                    checked = True
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise NoJobProcess(
                        f"{self.label}: no job process became ready in {self.policy.start_timeout_s:g} s"
                        + (f"; the last start failed: {self._last_failure}" if self._last_failure else ""))
                self._waiting += 1
                self._waiting_for[owner] += 1
                self._cond.notify_all()  # one more spare wanted
                try:
                    self._cond.wait(left)
                finally:
                    self._waiting -= 1
                    self._waiting_for[owner] -= 1
                    if not self._waiting_for[owner]:
                        del self._waiting_for[owner]
        if spare:
            self._changed()  # the registry lists the spares
        return process

    def _give_back(self, process: JobProcess, retire: str | None) -> None:
        with self._cond:
            self._busy.discard(process)
            if retire is None and not self._closed:
                self._idle.insert(0, process)  # the warm one first: its caches are hot
            self._cond.notify_all()
        if retire is not None:
            logger.info("%s: retiring job process %d: %s", self.label, process.pid, retire)
            process.kill(retire)
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception as exc:  # noqa: BLE001  (the registry's view is best effort)
                logger.debug("%s: on_change failed: %s", self.label, exc)

    # -- spawning ----------------------------------------------------------------------------

    def _spawn(self, owner: str | None = None) -> JobProcess:
        """A fresh job process: unowned, or under job accounts ``owner``'s, started as their
        system account (:meth:`_account`).

        Raises:
            ProcessGone: it could not start.
            NoJobAccount: ``owner`` has no usable account on this host.
        """
        if self.accounts is None:
            return JobProcess(self.spec, self._env, self._cwd, self.label)
        spec, account = self._account(owner or owners.LOCAL)
        process = JobProcess(spec, self._env, self._cwd, self.label, account=account)
        process.owner = owner or owners.LOCAL
        return process

    def _account(self, owner: str) -> tuple[ProcessSpec, JobAccount | None]:
        """The spec and system account of ``owner``'s job processes under job accounts: their
        artifacts and curves go to the user's own folder; a job that names no user runs as the
        worker (None).

        Raises:
            NoJobAccount: ``owner`` has no usable account on this host.
        """
        assert self.accounts is not None
        account = self.accounts.resolve(owner)
        if account is None:
            return self.spec, None
        return self.spec.model_copy(update={
            "artifacts_dir": str(account.folder), "tensorboard_dir": str(account.folder / TENSORBOARD_SUBDIR),
            "account": account.account}), account

    def _room(self) -> tuple[bool, JobProcess | None, str | None]:
        """Whether to spawn a process now (one per slot and the spares, or a job of a user with
        no process of theirs waits), the idle one to retire first to stay within :attr:`most`
        (the least recently used of some user's), and under job accounts whose the new one is
        (:func:`owners.plan_accounts_spawn`). Called under the lock."""
        if self.accounts is not None:
            plan = owners.plan_accounts_spawn(self._idle, len(self._busy), self._spawning_for, self._waiting_for,
                                              self._last_owner, self.warm, self.most, SPARE_PROCESSES)
            return (False, None, None) if plan is None else (True, plan[1], plan[0])
        alive = len(self._idle) + len(self._busy) + self._spawning
        unowned = owners.spares(self._idle) + self._spawning
        if alive >= self.warm and unowned >= SPARE_PROCESSES + self._waiting:
            return False, None, None
        if alive < self.most:
            return True, None, None
        old = owners.victim(self._idle)
        return old is not None, old, None

    def _keep_warm(self) -> None:
        backoff = RESPAWN_BACKOFF_S[0]
        while True:
            with self._cond:
                while not self._closed and not (room := self._room())[0]:
                    self._cond.wait()
                if self._closed:
                    return
                old, owner = room[1], room[2]
                if old is not None:
                    self._idle.remove(old)
                self._spawning += 1
                if owner is not None:
                    self._spawning_for.append(owner)
            if old is not None:
                logger.info("%s: retiring job process %d of user %r: its place goes to a fresh spare",
                            self.label, old.pid, old.owner)
                old.kill("its place went to a fresh spare for another user's job")
                self._changed()
            process: JobProcess | None = None
            try:
                process = self._spawn(owner)
                process.wait_hello(self.policy.start_timeout_s)
                failure = None
            except (ProcessGone, OSError, NoJobAccount) as exc:
                failure = str(exc)
                logger.error("%s: a job process failed to start: %s", self.label, failure)
            with self._cond:
                self._spawning -= 1
                if owner is not None:
                    self._spawning_for.remove(owner)
                self._last_failure = failure
                if failure is None and process is not None and not self._closed:
                    self._idle.append(process)
                    process = None
                self._cond.notify_all()
                if failure is not None:
                    self._cond.wait(backoff)
            if process is not None and failure is None:
                process.kill("the worker is leaving")  # spawned while the supervisor closed
            elif failure is None:
                self._changed()
            backoff = RESPAWN_BACKOFF_S[0] if failure is None else min(RESPAWN_BACKOFF_S[1], backoff * 2)

