"""CUDA MPS for one GPU's slots: a control daemon the device worker starts and stops.

With ``mps = true`` in a GPU worker's config, the worker starts ``nvidia-cuda-mps-control -d``
for its GPU before its first job process, with a pipe and log folder of its own under the state
directory, and every job process starts as a client of it (``CUDA_MPS_PIPE_DIRECTORY``): the
slots' kernels then run at the same time on the GPU instead of taking turns. Each client's
device memory is also limited by MPS itself (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) to its slot's
budget. The trade: an MPS server runs its clients in one GPU context, so a fatal GPU error in
one client (an illegal address, a device-side assert) ends every client on the GPU.

The GPU is named by its UUID to the daemon and to its clients (``CUDA_VISIBLE_DEVICES=GPU-...``),
not by its index: an MPS server renumbers the devices it was started with, so a client keeping
``CUDA_VISIBLE_DEVICES=N`` would find no GPU N for every N but 0 (NVIDIA's MPS guide, "Appendix:
Environment Variables"), and a client that did not reach the daemon would, with ``0``, run on the
host's GPU 0. The worker asks torch for the UUID in a child process that sees only GPU N, before
the daemon starts (:meth:`MpsServer.gpu_uuid`).

The worker stops the daemon when it leaves (``quit`` on the control pipe). A daemon left by a
worker that was killed is told to quit before a new one starts on the same pipe folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..core.defaults import MPS_CONTROL_TIMEOUT_S as CONTROL_TIMEOUT_S
from ..core.defaults import MPS_UUID_PROBE_TIMEOUT_S
from ..core.devices import Device
from ..core.errors import ConfigError, FleetError
from ..core.hiding import environment_secrets, holds_secret
from ..core.shadow import CHILD_FLAGS, child_pythonpath
from .jobenv import DROPPED_PREFIXES
from .memory import MiB

logger = logging.getLogger(__name__)

#: The MPS control program (NVIDIA's driver package ships it).
MPS_CONTROL = "nvidia-cuda-mps-control"
#: What the UUID probe runs: torch's view of the one GPU it sees, as NVML spells its UUID.
UUID_PROBE = ("import json; from tasks.core.devices import visibility; "
              "print(json.dumps(visibility()['uuid']))")


class MpsServer:
    """The MPS control daemon of one GPU worker."""

    def __init__(self, device: Device, state_dir: Path) -> None:
        self.device = device
        self.folder = state_dir / "mps" / device.name
        self.pipe_dir = self.folder / "pipe"
        self.log_dir = self.folder / "log"
        self._program: str | None = None
        #: The GPU as the daemon and its clients see it: its UUID once known (:meth:`start`).
        self.visible = device.cuda_visible_devices

    @staticmethod
    def _keyless_env() -> dict[str, str]:
        # The daemon runs as the jobs' user, and is dumpable: like a job process, it gets no key
        # to the fleet (tasks.worker.jobenv's rule), so that its /proc/<pid>/environ shows none.
        secrets = environment_secrets()
        return {name: value for name, value in os.environ.items()
                if not name.startswith(DROPPED_PREFIXES) and not holds_secret(value, secrets)}

    def _env(self) -> dict[str, str]:
        return {**self._keyless_env(), "CUDA_VISIBLE_DEVICES": self.visible,
                "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def gpu_uuid(self) -> str:
        """The UUID (``GPU-...``) of the GPU that ``CUDA_VISIBLE_DEVICES=N`` shows, as torch sees
        it in a child process started with only that GPU visible and no MPS.

        Raises:
            FleetError: the probe failed or gave no UUID.
        """
        env = {name: value for name, value in self._keyless_env().items() if not name.startswith("CUDA_MPS_")}
        env["CUDA_VISIBLE_DEVICES"] = self.device.cuda_visible_devices
        env["PYTHONPATH"] = child_pythonpath(env)
        try:
            done = subprocess.run([sys.executable, *CHILD_FLAGS, "-c", UUID_PROBE], env=env, capture_output=True,
                                  text=True, timeout=MPS_UUID_PROBE_TIMEOUT_S, check=False)
            lines = done.stdout.strip().splitlines()
            uuid = json.loads(lines[-1]) if done.returncode == 0 and lines else None
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            raise FleetError(f"{self.device}: could not ask torch for GPU {self.device.index}'s UUID "
                             f"(for its MPS daemon): {exc}") from None
        if not isinstance(uuid, str) or not uuid:
            raise FleetError(f"{self.device}: torch gave no UUID for GPU {self.device.index} (for its MPS daemon; "
                             f"exit status {done.returncode}): {(done.stderr or done.stdout).strip()[-500:]}")
        return uuid

    def start(self, budget_bytes: int | None) -> dict[str, str]:
        """Start the daemon; the variables that make a job process its client (limited to
        ``budget_bytes`` of device memory).

        Raises:
            ConfigError: ``nvidia-cuda-mps-control`` is not on PATH.
            FleetError: it did not start, or the GPU's UUID could not be read.
        """
        program = shutil.which(MPS_CONTROL)
        if program is None:
            raise ConfigError(f"{self.device}: mps = true, but {MPS_CONTROL} is not on PATH "
                              f"({os.environ.get('PATH', '')}); install NVIDIA's driver utilities or set mps = false")
        self._program = program
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._quit(quiet=True)  # a daemon a killed worker left on this pipe folder
        # Asked once that one is gone: a GPU in exclusive-process mode (NVIDIA's advice with MPS)
        # takes no other process while an MPS server holds it.
        self.visible = self.gpu_uuid()
        try:
            done = subprocess.run([program, "-d"], env=self._env(), capture_output=True, text=True,
                                  timeout=CONTROL_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FleetError(f"{self.device}: {program} -d did not start: {exc}") from None
        if done.returncode != 0:
            raise FleetError(f"{self.device}: {program} -d failed with exit status {done.returncode}: "
                             f"{(done.stderr or done.stdout).strip()[-500:]}")
        logger.info("%s: CUDA MPS control daemon started for %s (pipes in %s)", self.device, self.visible,
                    self.pipe_dir)
        client = {"CUDA_VISIBLE_DEVICES": self.visible, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
                  "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}
        if budget_bytes:
            # Device 0 of the client: the only GPU it sees. MPS's own per-client limit.
            client["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={max(1, budget_bytes // MiB)}M"
        return client

    def stop(self) -> None:
        """Tell the daemon to quit (its clients, the job processes, are ended first)."""
        if self._program is not None:
            self._quit(quiet=False)
            self._program = None

    def _quit(self, quiet: bool) -> None:
        assert self._program is not None
        try:
            done = subprocess.run([self._program], input="quit\n", env=self._env(), capture_output=True,
                                  text=True, timeout=CONTROL_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            if not quiet:
                logger.warning("%s: the MPS daemon did not answer quit: %s", self.device, exc)
            return
        if done.returncode != 0 and not quiet:
            logger.warning("%s: MPS quit: exit status %d: %s", self.device, done.returncode,
                           (done.stderr or done.stdout).strip()[-300:])
