"""A real systemd for the tests: PID 1 of a ``systemd-nspawn`` container booted from this
machine's own root, driven from outside with ``nsenter`` (../shared/notes/systemd-nspawn.md).

``--volatile=yes`` gives the container an empty tmpfs root with the host's ``/usr`` bound
read-only, so everything else it needs is bound in: the rendered ``/etc`` folders, the Python
environment and checkout the units run, and a host folder as the fleet's state directory (the
tests read the jobs' marker files there). The container shares the host's network, so the
rendered Redis URL on 127.0.0.1 works from the test process as it would for a producer on the
host. ``SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1`` and ``--system-call-filter=bpf`` are what make
systemd's device cgroup rules (DeviceAllow=) enforced inside.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

BOOT_TIMEOUT_S = 30.0
CGROUP_LEFTOVERS = [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")]


class BootFailed(Exception):
    """The container did not reach a running systemd in time (the reason is the message)."""


@dataclass
class Container:
    nspawn: str
    name: str
    log: Path
    #: (host path, container path, read-only)
    binds: list[tuple[Path, Path, bool]] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    leader: int = 0

    def boot(self, timeout: float = BOOT_TIMEOUT_S) -> None:
        args = [self.nspawn, "--directory=/", "--volatile=yes", "--register=no", "--keep-unit",
                f"--machine={self.name}", "--console=read-only", "--system-call-filter=bpf"]
        for host, inside, read_only in self.binds:
            args.append(f"--bind{'-ro' if read_only else ''}={host}:{inside}")
        args += ["--boot", "systemd.unit=basic.target", "systemd.firstboot=off"]
        env = {**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BootFailed(f"systemd-nspawn exited with {self.proc.returncode}: {self._log_tail()}")
            if not self.leader:
                found = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-x", "systemd"], capture_output=True,
                                       text=True)
                self.leader = int(found.stdout.split()[0]) if found.stdout.strip() else 0
            if self.leader:
                state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return
            time.sleep(0.1)
        raise BootFailed(f"no running systemd within {timeout:g} s (last state {state!r}): {self._log_tail()}")

    def _log_tail(self) -> str:
        return " | ".join(self.log.read_text(errors="replace").splitlines()[-5:])

    def run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A command inside the container (all its namespaces), as its root."""
        done = subprocess.run(["nsenter", "-t", str(self.leader), "-a", *args], capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done

    def systemctl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        return self.run("systemctl", "--no-pager", *args, check=check, timeout=timeout).stdout

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "-o", "cat", "-u", unit, check=False).stdout

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # nspawn shuts the container's systemd down
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # nspawn leaves its empty payload/ and supervisor/ cgroups behind on this machine.
        for base in CGROUP_LEFTOVERS:
            for leftover in ("payload", "supervisor"):
                for path in sorted((base / leftover).glob("**/"), key=lambda p: -len(p.parts)):
                    try:
                        path.rmdir()
                    except OSError:
                        pass


def nspawn_binary() -> str | None:
    return shutil.which("systemd-nspawn")
