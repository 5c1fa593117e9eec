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


def hide_from_children(secrets: Iterable[str]) -> None:
    """Close this process's keys to its children (Linux).

    - ``prctl(PR_SET_DUMPABLE, 0)``: a process of the same user, its job processes included,
      can no longer read its ``/proc/<pid>/environ`` or memory, nor ptrace it (nor can
      ``py-spy`` as that user: profile a worker as root);
    - the ``secrets`` are overwritten with ``*`` in its initial environment and argument blocks
      (what ``/proc/<pid>/environ`` and ``/proc/<pid>/cmdline`` show, to root as well, and the
      cmdline to every user): ``os.environ`` is Python's copy, and keeps them.
    """
    import ctypes
    import ctypes.util

    needles = [secret.encode() for secret in secrets]
    if not needles:  # no fleet (an in-process check of the jobs): nothing to hide, py-spy still works
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if int(libc.prctl(4, 0, 0, 0, 0)) != 0:  # PR_SET_DUMPABLE = 4
            logger.warning("prctl(PR_SET_DUMPABLE, 0) failed (errno %d)", ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        logger.warning("could not make this worker non-dumpable: %s", exc)
    try:
        with open("/proc/self/stat", "rb") as handle:
            # proc(5): after the command's ")", field 3 on; arg_start..env_end are fields 48-51.
            fields = handle.read().rsplit(b")", 1)[1].split()
        blocks = {"cmdline": (int(fields[45]), int(fields[46])), "environ": (int(fields[47]), int(fields[48]))}
        for name, (start, end) in blocks.items():
            with open(f"/proc/self/{name}", "rb") as handle:
                shown = handle.read()
            # Only where the block is what /proc shows (else the addresses are not what they seem).
            if end <= start or ctypes.string_at(start, end - start) != shown[:end - start]:
                logger.warning("could not hide the fleet's secrets in /proc/self/%s", name)
                continue
            for needle in needles:
                at = shown.find(needle)
                while at >= 0:
                    ctypes.memset(start + at, ord("*"), len(needle))
                    at = shown.find(needle, at + len(needle))
    except (OSError, ValueError, IndexError) as exc:
        logger.warning("could not hide the fleet's secrets from /proc: %s", exc)
