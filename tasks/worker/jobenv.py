"""What a job process starts with: the worker's environment, less every key to the fleet.

A job process runs untrusted code, and nothing in it may open the fleet's Redis (torchrun's
elastic agent hands its workers their variables, nothing of its own store). The rule
(:func:`job_environment`):

- **kept**: the worker's environment, which holds what jobs legitimately need: ``PATH``,
  ``HOME``, ``LANG``, ``LD_LIBRARY_PATH``, ``CUDA_*``, ``OMP_*``, ``NCCL_*``, and the user's own
  variables (a dataset folder, an experiment tracker's key);
- **dropped**: every ``DEVICEFLEET_*`` variable (the fleet's own settings; the Redis URL with
  its password is one) and every ``CELERY_*`` one (Celery's settings, a broker URL among them),
  and any variable, of any name, whose value holds one of the fleet's secrets
  (:func:`tasks.core.hiding.fleet_secrets`: the Redis URL and each password in it), such as a
  copy of the URL under another name or ``REDISCLI_AUTH``;
- **set**: the device's visibility (``CUDA_VISIBLE_DEVICES``), ``OMP_NUM_THREADS`` unless set,
  ``PYTHONUNBUFFERED`` and ``PYTHONPATH`` (this devicefleet first, then the worker's working
  directory, for job modules).

A command's sandbox (:func:`tasks.jobproc.command.inherited_environment`) starts from this one.
The worker itself hides the same secrets from its job processes
(:func:`tasks.core.hiding.hide_from_children`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

from ..core.devices import Device
from ..core.hiding import fleet_secrets, holds_secret
from ..core.shadow import child_pythonpath

logger = logging.getLogger(__name__)

#: Name prefixes of the variables no job process gets: the fleet's settings and Celery's.
DROPPED_PREFIXES = ("DEVICEFLEET_", "CELERY_")


def job_environment(device: Device, threads: int, secrets: Iterable[str],
                    base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every job process of ``device`` starts with (and every job in it): the
    worker's (``base``, default ``os.environ``) by the rule of the module's docstring."""
    secrets = list(secrets)
    env: dict[str, str] = {}
    for name, value in (os.environ if base is None else base).items():
        if name.startswith(DROPPED_PREFIXES):
            continue
        if holds_secret(value, secrets):
            logger.info("%s: %s holds the fleet's Redis URL or password: job processes do not get it", device, name)
            continue
        env[name] = value
    env["CUDA_VISIBLE_DEVICES"] = device.cuda_visible_devices
    # numpy and friends follow OpenMP's setting, torch its own (set by the job process).
    env.setdefault("OMP_NUM_THREADS", str(threads))
    # Prints reach the worker's log (and a crash report's last lines) as they happen.
    env["PYTHONUNBUFFERED"] = "1"
    # The same devicefleet as this worker's (first, as for every child: tasks.core.shadow), and
    # the job modules it could import from its working directory (after it).
    paths = [*child_pythonpath(env).split(os.pathsep), os.getcwd()]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


# fleet_secrets: what the rule drops, and what the worker gives job_environment.
__all__ = ["DROPPED_PREFIXES", "fleet_secrets", "job_environment"]
