"""Jobs: named functions a worker runs, with JSON kwargs checked against a schema.

A module defines jobs with :func:`job`. A worker builds a :class:`JobRegistry` from the modules
of its allowlist (``Settings.job_modules``) when it starts; a message only names a job, so it
can never make a worker import other code.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import ConfigError, InvalidJobArguments, UnknownJob

logger = logging.getLogger(__name__)

P = TypeVar("P", bound=BaseModel)
JobFunc = Callable[["JobContext", Any], dict[str, Any]]


@dataclass
class JobContext:
    """What a running job knows about where it runs."""

    #: Device name, e.g. ``cpu0``.
    device: str
    #: ``cpu`` or ``cuda:0``: what to pass to ``torch.device``.
    torch_device: str
    #: This run's id (the Celery task id).
    job_id: str
    #: A folder only this run writes to, for checkpoints and other files.
    artifacts_dir: Path
    #: Cores this worker owns.
    cores: list[int] = field(default_factory=list)
    #: Called with progress fields (``step``, ``total``, ``loss``...); a no-op by default.
    reporter: Callable[[dict[str, Any]], None] | None = None
    #: The torch device this run fell back from after running out of memory (else None).
    fallback_from: str | None = None

    def progress(self, **fields: Any) -> None:
        """Report progress; cheap enough to call once per epoch or every few seconds."""
        if self.reporter is not None:
            self.reporter(fields)


@dataclass(frozen=True)
class JobDefinition:
    name: str
    func: JobFunc
    params: type[BaseModel]
    module: str
    doc: str = ""


_DEFINED: dict[str, JobDefinition] = {}


def job(name: str, *, params: type[P]) -> Callable[[Callable[[JobContext, P], dict[str, Any]]], Callable[[JobContext, P], dict[str, Any]]]:
    """Declare a job called ``name`` whose kwargs validate against ``params``.

    The function takes ``(ctx: JobContext, params: P)`` and returns a JSON-able dict.
    """

    def register(func: Callable[[JobContext, P], dict[str, Any]]) -> Callable[[JobContext, P], dict[str, Any]]:
        _DEFINED[name] = JobDefinition(
            name=name, func=func, params=params, module=func.__module__,
            doc=(func.__doc__ or "").strip().splitlines()[0] if func.__doc__ else "",
        )
        return func

    return register


def _allowed(module: str, allowlist: Iterable[str]) -> bool:
    return any(module == allowed or module.startswith(allowed + ".") for allowed in allowlist)


class JobRegistry:
    """The jobs one worker may run: those defined by its allowlisted modules."""

    def __init__(self, modules: Iterable[str]) -> None:
        self.modules = list(modules)
        for module in self.modules:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(
                    f"job module {module!r} of the allowlist cannot be imported: {exc}"
                ) from exc
        self._jobs = {
            name: definition
            for name, definition in _DEFINED.items()
            if _allowed(definition.module, self.modules)
        }
        logger.info("jobs allowed: %s (from %s)", ", ".join(sorted(self._jobs)), ", ".join(self.modules))

    @property
    def names(self) -> list[str]:
        return sorted(self._jobs)

    def get(self, name: str) -> JobDefinition:
        """The job called ``name``.

        Raises:
            UnknownJob: ``name`` is not a job of the allowlisted modules.
        """
        try:
            return self._jobs[name]
        except (KeyError, TypeError):
            raise UnknownJob(
                f"unknown job {name!r}: this worker runs only {', '.join(self.names)} "
                f"(from the allowlisted modules {', '.join(self.modules)}); add the module that "
                "defines it to DEVICEFLEET_JOB_MODULES on the workers"
            ) from None

    def parse(self, name: str, kwargs: Any) -> tuple[JobDefinition, BaseModel]:
        """Look ``name`` up and validate ``kwargs`` against its schema.

        Raises:
            UnknownJob: see :meth:`get`.
            InvalidJobArguments: the kwargs do not fit; the message names each bad field.
        """
        definition = self.get(name)
        if not isinstance(kwargs, dict):
            raise InvalidJobArguments(
                f"{name}: kwargs must be a JSON object, got {type(kwargs).__name__} {kwargs!r}"
            )
        try:
            return definition, definition.params.model_validate(kwargs)
        except ValidationError as exc:
            raise InvalidJobArguments(f"{name}: {describe_validation_error(exc)}") from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per bad field: ``epochs='many': Input should be a valid integer``."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "kwargs"
        if err["type"] == "extra_forbidden":
            parts.append(f"unexpected argument {where!r}")
        elif err["type"] == "missing":
            parts.append(f"missing argument {where!r}")
        else:
            parts.append(f"{where}={err.get('input')!r}: {err['msg']}")
    return "; ".join(parts)
