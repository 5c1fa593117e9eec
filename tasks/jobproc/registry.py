"""The jobs a job process may run: those defined by the modules of its device's allowlist.

A job process imports the allowlisted modules (``Settings.job_modules``) before it says hello
and keeps the jobs they define with :func:`tasks.core.job.job`; it tells the worker their names,
and the worker's jobs step registers each as the Celery task ``devicefleet.<name>``. A message
only names a job, so it can never make a worker or a job process import code.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from ..core.commands import COMMAND_JOB
from ..core.errors import ConfigError, InvalidJobArguments
from ..core.job import DEFINED, JobDefinition, unknown_job
from ..core.validation import describe_validation_error
from ..core.wire import JobInfo

logger = logging.getLogger(__name__)

#: Job names the fleet keeps for itself (their Celery task names are the fleet's own tasks).
RESERVED = frozenset({"collect", COMMAND_JOB})


def _allowed(module: str, allowlist: Iterable[str]) -> bool:
    return any(module == allowed or module.startswith(allowed + ".") for allowed in allowlist)


class JobRegistry:
    """The jobs defined by the allowlisted ``modules``.

    Raises:
        ConfigError: a module cannot be imported, or defines a job with a reserved name.
    """

    def __init__(self, modules: Iterable[str]) -> None:
        self.modules = list(modules)
        for module in self.modules:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(
                    f"job module {module!r} of the allowlist (DEVICEFLEET_JOB_MODULES) cannot be "
                    f"imported: {exc}; make it importable on the worker (PYTHONPATH or an "
                    "installed package) or take it off the list"
                ) from exc
        self._jobs = {name: d for name, d in DEFINED.items() if _allowed(d.module, self.modules)}
        clash = RESERVED & set(self._jobs)
        if clash:
            raise ConfigError(f"job name(s) {', '.join(sorted(clash))} are reserved by the fleet; rename the job")
        if self.modules:  # the empty registry a worker holds before it loads its allowlist says nothing
            logger.info("jobs allowed: %s (from %s)", ", ".join(sorted(self._jobs)), ", ".join(self.modules))

    def add_builtin(self, definition: JobDefinition) -> None:
        """Add one of the fleet's own jobs (the command job, where commands are allowed)."""
        self._jobs[definition.name] = definition

    @property
    def names(self) -> list[str]:
        return sorted(self._jobs)

    def definitions(self) -> list[JobDefinition]:
        return [self._jobs[name] for name in self.names]

    def infos(self) -> list[JobInfo]:
        """The jobs as a job process names them in its hello."""
        return [JobInfo(name=d.name, module=d.module, doc=d.func.__doc__,
                        pack=list(d.pack.key) if d.pack is not None else None,
                        params_schema=params_schema(d)) for d in self.definitions()]

    def get(self, name: str) -> JobDefinition:
        """The job ``name``.

        Raises:
            UnknownJob: it is not one of these.
        """
        definition = self._jobs.get(name)
        if definition is None:
            raise unknown_job(name, self.names, self.modules)
        return definition


def params_schema(definition: JobDefinition) -> dict[str, Any] | None:
    """The JSON schema of the job's params, or None where pydantic cannot make one (a field of a
    type with no JSON form): such a job's kwargs are checked here only, as before."""
    try:
        return definition.params.model_json_schema()
    except Exception as exc:  # PydanticInvalidForJsonSchema and whatever a custom type raises
        logger.warning("job %s: its params have no JSON schema (%s); producers will not check its kwargs",
                       definition.name, exc)
        return None


def validate_kwargs(definition: JobDefinition, kwargs: Any) -> BaseModel:
    """``kwargs`` checked against the job's schema.

    Raises:
        InvalidJobArguments: the kwargs do not fit; the message names each bad field.
    """
    if not isinstance(kwargs, dict):
        raise InvalidJobArguments(
            f"{definition.name}: kwargs must be a JSON object, got {type(kwargs).__name__} {kwargs!r}"
        )
    try:
        return definition.params.model_validate(kwargs)
    except ValidationError as exc:
        raise InvalidJobArguments(f"{definition.name}: {describe_validation_error(exc)}") from None
