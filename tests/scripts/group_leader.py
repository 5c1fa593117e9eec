"""A GPU group's leader under a real systemd, reduced to what tests/test_systemd.py checks.

Run as ``devicefleet-worker@gpu0.service``'s main process (its ExecStart replaced in a drop-in),
with the unit's rendered drop-ins and its socket: it takes the listening socket systemd passed
it, as the worker does, waits for the group host (``devicefleet-groups.service``) to connect,
and runs the ``sandbox`` job (tests/fleet_jobs.py) as a GPU group's job over gpu0 and gpu1 through
the worker's own :meth:`~tasks.worker.supervisor.Supervisor.run` (``apart``): its job process is the
group host's child. It prints, for the journal, one ``devprobe`` line per node for itself (the
leader, behind its own unit's device policy) and for the group's job process, then the job's
parent and visibility.
"""

import errno
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks.core.devices import Device
from tasks.core.groups import group_environment
from tasks.core.wire import ProcessSpec, RunJob
from tasks.worker.group_host import GroupHostLink, inherited_listener
from tasks.worker.jobenv import job_environment
from tasks.worker.supervisor import Apart, ProcessPolicy, Supervisor

NODES = ["/dev/nvidia0", "/dev/nvidia1"]


class Watch:
    """Relays nothing, never stops the job."""

    def report(self, fields: dict[str, Any]) -> None: ...
    def log(self, lines: Sequence[tuple[str, str]]) -> None: ...
    def heard(self, message: Any) -> None: ...
    def stop(self) -> None: return None
    def act_on(self, stop: Any) -> Any: return stop
    def memory(self, used: int) -> None: ...


def main() -> int:
    for path in NODES:
        try:
            os.close(os.open(path, os.O_RDWR))
            print("devprobe leader", path, "opened")
        except OSError as exc:
            print("devprobe leader", path, errno.errorcode[exc.errno or 0])
    listener = inherited_listener()
    if listener is None:
        print("group leader: no listening socket from systemd", file=sys.stderr)
        return 1
    state = Path(sys.argv[1])
    spec = ProcessSpec(device="cpu0", torch_device="cpu", cores=sorted(os.sched_getaffinity(0))[:1], torch_threads=1,
                       job_modules=["tests.fleet_jobs"], artifacts_dir=str(state / "artifacts"),
                       tensorboard_dir=str(state / "tb"), result_expires_s=60)
    supervisor = Supervisor(spec, job_environment(Device.parse("gpu0"), 1, []), Path("/"), ProcessPolicy(),
                            label="gpu0")
    supervisor.group_host = GroupHostLink(listener, "gpu0")
    kwargs: dict[str, Any] = {"open": NODES}
    job = RunJob(job_id="group-under-systemd", job="sandbox", kwargs=kwargs, fan_out_id="group-under-systemd",
                 devices=["gpu0", "gpu1"], cores=spec.cores, torch_threads=1)
    ended = supervisor.run(job, Watch(), apart=Apart(group_environment(["gpu0", "gpu1"])))
    if ended.finished is None or ended.finished.output is None:
        print("group leader: the job did not finish:", ended.error, file=sys.stderr)
        return 1
    out = ended.finished.output
    assert isinstance(out, dict) and isinstance(out["opens"], dict)
    for path, seen in out["opens"].items():
        print("devprobe group", path, seen)
    print("grouprun", json.dumps({"ppid": out["ppid"], "uid": out["uid"],
                                  "cuda_visible_devices": out["cuda_visible_devices"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
