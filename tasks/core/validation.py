"""One formatter for pydantic's validation errors: every message names the field and the value."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError


def describe_validation_error(exc: ValidationError, *, name: Callable[[str], str] = lambda field: field,
                              shown: Callable[[object], object] = lambda value: value) -> str:
    """One part per bad field, joined by ``; ``: ``epochs='many': Input should be a valid integer``.

    Args:
        name: how to print a field's dotted location (settings print ``DEVICEFLEET_<FIELD>``).
        shown: how to print a bad value (settings hide a URL's password).
    """
    parts = []
    for err in exc.errors():
        where = name(".".join(str(p) for p in err["loc"]) or "value")
        if err["type"] == "extra_forbidden":
            parts.append(f"unexpected argument {where!r}")
        elif err["type"] == "missing":
            parts.append(f"missing argument {where!r}")
        else:
            message = err["msg"].removeprefix("Value error, ")
            parts.append(f"{where}={shown(err.get('input'))!r}: {message}")
    return "; ".join(parts)
