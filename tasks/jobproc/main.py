"""The job process's life: get its spec, prepare, say hello, run jobs until the worker is gone."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

from pydantic import ValidationError

from ..core.errors import ConfigError, DeviceFleetError
from ..core.records import ErrorInfo
from ..core.wire import ProcessSpec, Refused, decode_from_worker
from .channel import Channel
from .runtime import JobRuntime

logger = logging.getLogger(__name__)

#: ``prctl`` option: the signal this process gets when the thread that started it exits.
PR_SET_PDEATHSIG = 1
#: Exit statuses: the worker could not be reached or sent no spec; a setting is at fault.
EXIT_NO_WORKER = 1
EXIT_CONFIG = 2


def die_with_parent() -> None:
    """Ask Linux for SIGKILL when the worker dies (even by SIGKILL, when the pipe's reader thread
    would be too late: a job holding the GIL in native code). The worker starts job processes
    from one long-lived thread, whose exit is what the kernel watches."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError) as exc:  # no prctl: the pipe's EOF still ends this process
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable: %s", exc)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    die_with_parent()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    channel = Channel(Connection(int(args[0])))
    try:
        spec = decode_from_worker(channel.receive_first())
    except (EOFError, OSError, ValidationError) as exc:
        print(f"devicefleet job process: no spec from the worker ({exc})", file=sys.stderr)
        return EXIT_NO_WORKER
    if not isinstance(spec, ProcessSpec) or os.getppid() != spec.parent_pid:
        return EXIT_NO_WORKER  # the worker died before the death signal was set: nothing to do
    try:
        runtime = JobRuntime.prepare(spec)
    except DeviceFleetError as exc:
        channel.send(Refused(error=ErrorInfo.of(exc), config=isinstance(exc, ConfigError)))
        return EXIT_CONFIG if isinstance(exc, ConfigError) else EXIT_NO_WORKER
    channel.send(runtime.hello())
    channel.start()
    while (job := channel.next_job()) is not None:
        channel.send(runtime.run(job, channel))
    return 0
