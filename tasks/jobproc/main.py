"""The job process's life: get its spec, prepare, say hello, run jobs until the worker is gone.

It dies with its worker: the worker starts it with Linux's parent-death signal
(:func:`tasks.core.children.spawn_child`), and its pipe's reader ends it when the pipe closes.
"""

from __future__ import annotations

import logging
import sys
from multiprocessing.connection import Connection

from pydantic import ValidationError

from ..core.errors import EXIT_FAILED, ConfigError, DeviceFleetError, start_exit_status
from ..core.records import ErrorInfo
from ..core.wire import ProcessSpec, Refused, RunPack, decode_from_worker
from .channel import Channel
from .pack_run import run_pack
from .runtime import JobRuntime

logger = logging.getLogger(__name__)



def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    channel = Channel(Connection(int(args[0])))
    try:
        spec = decode_from_worker(channel.receive_first())
    except (EOFError, OSError, ValidationError) as exc:
        print(f"devicefleet job process: no spec from the worker ({exc})", file=sys.stderr)
        return EXIT_FAILED  # the worker could not be reached or sent no spec
    if not isinstance(spec, ProcessSpec):
        return EXIT_FAILED
    try:
        runtime = JobRuntime.prepare(spec, channel)
    except DeviceFleetError as exc:
        channel.send(Refused(error=ErrorInfo.of(exc), config=isinstance(exc, ConfigError)))
        return start_exit_status(exc)
    channel.send(runtime.hello())
    channel.start()
    while (job := channel.next_job()) is not None:
        if runtime.broken is not None:  # found after its last job: it runs nothing more
            for finished in runtime.hand_back(job):
                channel.send(finished)
        elif isinstance(job, RunPack):
            run_pack(runtime, job, channel)  # each member's Finished goes out as it ends
        else:
            channel.send(runtime.run(job, channel))
    return 0
