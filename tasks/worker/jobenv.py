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
  (:func:`fleet_secrets`: the Redis URL and each password in it), such as a copy of the URL
  under another name or ``REDISCLI_AUTH``;
- **set**: the device's visibility (``CUDA_VISIBLE_DEVICES``), ``OMP_NUM_THREADS`` unless set,
  ``PYTHONUNBUFFERED`` and ``PYTHONPATH`` (this devicefleet first, then the worker's working
  directory, for job modules).

A command's sandbox (:func:`tasks.jobproc.command.inherited_environment`) starts from this one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from urllib.parse import unquote, urlsplit

from ..core.devices import Device
from ..core.sentinel import SentinelURL, is_sentinel
from ..core.shadow import child_pythonpath

logger = logging.getLogger(__name__)

#: Name prefixes of the variables no job process gets: the fleet's settings and Celery's.
DROPPED_PREFIXES = ("DEVICEFLEET_", "CELERY_")
#: A secret shorter than this is not looked for in other variables' values (a one-letter
#: password would drop half the environment; such a password is no secret anyway).
MIN_SECRET_CHARS = 4


def fleet_secrets(url: str | None) -> list[str]:
    """What opens the fleet's Redis at ``url``: the URL itself and each password in it."""
    if not url:
        return []
    secrets = [url]
    try:
        if is_sentinel(url):
            parsed = SentinelURL.parse(url)
            secrets += [s for s in (parsed.password, parsed.sentinel_password) if s]
        else:
            password = urlsplit(url).password
            if password:
                secrets += [password, unquote(password)]
    except ValueError:  # a malformed URL: the worker refuses it elsewhere; the URL is still hidden
        pass
    return list(dict.fromkeys(s for s in secrets if len(s) >= MIN_SECRET_CHARS))


def holds_secret(value: str, secrets: Iterable[str]) -> bool:
    return any(secret in value for secret in secrets)


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


def hide_from_children() -> bool:
    """Make this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``): a process of the same
    user, its job processes included, can no longer read its ``/proc/<pid>/environ`` (where the
    Redis URL is) or memory, nor ptrace it. Linux only; whether it took."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(4, 0, 0, 0, 0)) == 0  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        return False
