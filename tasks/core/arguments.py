"""A job's kwargs checked against the JSON schema its workers publish, before anything is sent.

The job process validates a job's kwargs with the job's pydantic params model (the authority:
:func:`tasks.jobproc.registry.validate_kwargs`); the producer only sees the model's JSON schema
(``model_json_schema()``, published by each worker: :data:`tasks.core.keys.job_schemas`). This
module reads that schema to refuse, at once, what the job process would refuse anyway: an
unknown argument (with a "did you mean"), a missing one, a value of the wrong JSON type, a value
outside an enum or a numeric bound. It never refuses what pydantic would accept: pydantic
validates in lax mode (``"3"`` and ``3.0`` are integers, ``1`` a float, ``"yes"`` a boolean),
so the type check follows those coercions, and a schema construct not read here passes.

Pure: no Redis, no pydantic model, no torch.
"""

from __future__ import annotations

import difflib
import math
import operator
from collections.abc import Callable, Collection, Mapping
from typing import Any

from .errors import InvalidJobArguments

#: What pydantic's lax mode reads as a boolean, from a string.
_BOOL_STRINGS = frozenset({"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"})

class _Sampled:
    """The value of a param a study samples: present, its name and type the study's."""


_SAMPLED = _Sampled()

#: JSON schema's numeric bounds, as the message words them.
_NUMBER_BOUNDS = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
_HOLDS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}

_TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "a boolean",
               "array": "a list", "object": "an object", "null": "null"}


def _number(value: Any) -> float | None:
    """``value`` as pydantic's lax mode reads a number, or None where it reads none."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _fits_type(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "string":
        return isinstance(value, str)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "number":
        return _number(value) is not None
    if kind == "integer":
        number = _number(value)
        return number is not None and math.isfinite(number) and number == int(number)
    if kind == "boolean":
        if isinstance(value, str):
            return value.strip().lower() in _BOOL_STRINGS
        return isinstance(value, (bool, int, float)) and value in (0, 1)
    return True  # a type this module does not know: the job process decides


class _Checker:
    """Walks one schema (its ``$defs`` resolve its ``$ref``s), collecting one line per problem."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self.defs: Mapping[str, Any] = schema.get("$defs", {})
        self.problems: list[str] = []

    def resolve(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            target = self.defs.get(ref.removeprefix("#/$defs/"), {})
            return {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return schema

    def fits(self, value: Any, schema: Mapping[str, Any]) -> bool:
        """Whether ``value`` may fit ``schema`` (without recording problems)."""
        probe = _Checker({"$defs": self.defs})
        probe.check(value, schema, "")
        return not probe.problems

    def check(self, value: Any, schema: Mapping[str, Any], where: str) -> None:
        if value is _SAMPLED:
            return
        schema = self.resolve(schema)
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                if not any(self.fits(value, branch) for branch in branches):
                    self.problems.append(f"{where}={value!r}: expected {self.expected(branches)}")
                return
        for branch in schema.get("allOf", []) or []:
            self.check(value, branch, where)
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if isinstance(kinds, list) and not any(_fits_type(value, kind) for kind in kinds):
            self.problems.append(f"{where}={value!r}: expected {self.expected([schema])}")
            return
        if "const" in schema and value != schema["const"]:
            self.problems.append(f"{where}={value!r}: must be {schema['const']!r}")
            return
        enum = schema.get("enum")
        if isinstance(enum, list) and value not in enum:
            close = difflib.get_close_matches(value, [e for e in enum if isinstance(e, str)], n=1) \
                if isinstance(value, str) else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            self.problems.append(f"{where}={value!r}: must be one of {', '.join(map(repr, enum))}{hint}")
            return
        self.bounds(value, schema, where)
        if isinstance(value, dict) and isinstance(schema.get("properties"), Mapping):
            self.check_object(value, schema, where)
        elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
            for i, item in enumerate(value):
                self.check(item, schema["items"], f"{where}[{i}]")

    def bounds(self, value: Any, schema: Mapping[str, Any], where: str) -> None:
        number = _number(value) if not isinstance(value, str) else None  # a numeric string: the job decides
        if number is not None:
            for key, word in _NUMBER_BOUNDS.items():
                bound = schema.get(key)
                if isinstance(bound, (int, float)) and not isinstance(bound, bool) \
                        and not _HOLDS[word](number, bound):
                    # A whole bound as an int: pydantic's schema writes gt=0 as 0 or 0.0 by release.
                    shown = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
                    self.problems.append(f"{where}={value!r}: must be {word} {shown}")
                    return
        if isinstance(value, (str, list)):
            unit, keys = ("characters", ("minLength", "maxLength")) if isinstance(value, str) \
                else ("items", ("minItems", "maxItems"))
            for key, word in zip(keys, ("at least", "at most"), strict=True):
                bound = schema.get(key)
                if isinstance(bound, int) and not _HOLDS[">=" if word == "at least" else "<="](len(value), bound):
                    self.problems.append(f"{where}={value!r}: must have {word} {bound} {unit}")
                    return

    def check_object(self, value: Mapping[str, Any], schema: Mapping[str, Any], where: str) -> None:
        properties: Mapping[str, Any] = schema["properties"]
        prefix = f"{where}." if where else ""
        for name, item in value.items():
            if name in properties:
                self.check(item, properties[name], f"{prefix}{name}")
            elif schema.get("additionalProperties") is False and item is not _SAMPLED:
                close = difflib.get_close_matches(str(name), list(properties), n=1)
                hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
                self.problems.append(f"unexpected argument {prefix + str(name)!r} ({item!r}){hint}")
        for name in schema.get("required", []) or []:
            if name not in value:
                self.problems.append(f"missing argument {prefix + name!r}")

    def expected(self, branches: list[Any]) -> str:
        words: list[str] = []
        for branch in branches:
            branch = self.resolve(branch) if isinstance(branch, Mapping) else {}
            kinds = branch.get("type")
            for kind in [kinds] if isinstance(kinds, str) else kinds or []:
                word = _TYPE_WORDS.get(kind, kind)
                if word not in words:
                    words.append(word)
        return " or ".join(words) or "another value"


def argument_problems(kwargs: Mapping[str, Any], schema: Mapping[str, Any],
                      sampled: Collection[str] = ()) -> list[str]:
    """One line per problem of ``kwargs`` under the job's params ``schema``; empty if none.
    ``sampled`` names params a study fills: present, and not checked at all (their names and
    values are the study's, which the job process checks trial by trial)."""
    checker = _Checker(schema)
    checker.check({**dict.fromkeys(sampled, _SAMPLED), **kwargs}, schema, "")
    return checker.problems


def check_arguments(job: str, kwargs: Mapping[str, Any], schema: Mapping[str, Any], *, where: str = "",
                    sampled: Collection[str] = ()) -> None:
    """Refuse ``kwargs`` that job ``job``'s params ``schema`` refuses.

    Args:
        where: what to name beside the job (a sweep's ``trial 3``).
        sampled: params a study samples (see :func:`argument_problems`).

    Raises:
        InvalidJobArguments: one line, the job and each bad field with its value, e.g.
            ``train: unexpected argument 'epoch' (3); did you mean 'epochs'?``.
    """
    problems = argument_problems(kwargs, schema, sampled)
    if problems:
        label = f"{job} ({where})" if where else job
        raise InvalidJobArguments(f"{label}: {'; '.join(problems)}")
