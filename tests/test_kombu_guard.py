"""The guard on what devicefleet copies from, overrides in, or reads of kombu's, Celery's and
redis-py's internals (issue 47): pure, no Redis.

- each kombu method the transport copies or overrides has the source it was read in
  (``tasks.core.transport.KOMBU_SOURCES``: a hash, and what to re-check);
- each private name relied on still exists, with the parameters relied on (:data:`RELIED_ON`);
- pyproject.toml lists every one of them beside the dependencies, and bounds kombu and Celery to
  the minor release checked;
- :mod:`tasks.core.queue_lists` names kombu's priority-step lists as kombu does.

A kombu, Celery or redis-py upgrade that changes any of these fails here, naming what changed and
what to re-check, before it fails in a fleet.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import tomllib
import types
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent

#: ``(target, parameters relied on)``: ``module:Qual.name``; the parameters a callable must still
#: take, in order (``**kwargs`` for any keywords), or ``None`` for an attribute that must exist
#: (on the class, or assigned as ``self.<name> =`` in a class of its MRO).
RELIED_ON: list[tuple[str, tuple[str, ...] | None]] = [
    # kombu's Redis QoS (tasks/core/transport.py, tasks/worker/reaper.py)
    ("kombu.transport.redis:QoS.ack", ("self", "delivery_tag")),
    ("kombu.transport.redis:QoS.reject", ("self", "delivery_tag", "requeue")),
    ("kombu.transport.redis:QoS.append", ("self", "message", "delivery_tag")),
    ("kombu.transport.redis:QoS.restore_by_tag", ("self", "tag", "client", "leftmost")),
    ("kombu.transport.redis:QoS.unacked_key", None),
    ("kombu.transport.redis:QoS.unacked_index_key", None),
    ("kombu.transport.virtual:QoS.ack", ("self", "delivery_tag")),
    # a pack's leader takes its siblings (tasks/core/transport.py take_waiting): the in-memory half of
    # QoS.append, the channel's Message class, and basic_get where a key prefix is set
    ("kombu.transport.virtual:QoS.append", ("self", "message", "delivery_tag")),
    ("kombu.transport.virtual:Channel.Message", None),
    ("kombu.transport.virtual:Channel.basic_get", ("self", "queue", "no_ack", "**kwargs")),
    # kombu's Redis channel (tasks/core/transport.py)
    ("kombu.transport.redis:Channel._create_client", ("self", "asynchronous")),
    ("kombu.transport.redis:Channel._put", ("self", "queue", "message", "**kwargs")),
    ("kombu.transport.redis:Channel._purge", ("self", "queue")),
    ("kombu.transport.redis:Channel._brpop_start", ("self", "timeout")),
    ("kombu.transport.redis:Channel._brpop_read", ("self", "**options")),
    ("kombu.transport.redis:Channel._q_for_pri", ("self", "queue", "pri")),
    ("kombu.transport.redis:Channel.priority", ("self", "n")),
    ("kombu.transport.redis:Channel._get_message_priority", ("self", "message", "reverse")),
    ("kombu.transport.redis:Channel._do_restore_message",
     ("self", "payload", "exchange", "routing_key", "pipe", "leftmost")),
    ("kombu.transport.redis:Channel.conn_or_acquire", ("self", "client")),
    ("kombu.transport.redis:Channel._flush_brpop_reauth", ("self",)),
    ("kombu.transport.redis:Channel._in_poll", None),
    ("kombu.transport.redis:Channel._brpop_sent_at", None),
    ("kombu.transport.redis:Channel._queue_cycle", None),
    ("kombu.transport.redis:Channel._expires", None),
    ("kombu.transport.redis:Channel.brpop_timeout", None),
    ("kombu.transport.redis:Channel.active_queues", None),
    ("kombu.transport.redis:Channel.global_keyprefix", None),
    ("kombu.transport.redis:Channel.priority_steps", None),
    ("kombu.transport.redis:Channel.sep", None),
    ("kombu.transport.redis:Channel.unacked_key", None),
    ("kombu.transport.redis:Channel.unacked_index_key", None),
    ("kombu.transport.redis:Channel.queue_order_strategy", None),
    ("kombu.transport.redis:PrefixedStrictRedis._prefix_args", ("self", "args")),
    ("kombu.transport.redis:SentinelChannel.connection_class", None),
    ("kombu.transport.redis:SentinelChannel.from_transport_options", None),
    ("kombu.transport.virtual.base:Transport._deliver", ("self", "message", "queue")),
    ("kombu.transport.virtual.base:Message._raw", None),
    ("kombu.utils.scheduling:round_robin_cycle.update", ("self", "it")),
    ("kombu.utils.scheduling:round_robin_cycle.rotate", ("self", "last_used")),
    ("kombu.utils.scheduling:round_robin_cycle.consume", ("self", "n")),
    ("kombu.utils.scheduling:round_robin_cycle.items", None),
    ("kombu.connection:Connection.switch", ("self", "conn_str")),
    ("kombu.connection:Connection.transport_cls", None),
    # Celery's Redis result backend (tasks/core/backend.py, tasks/worker/lease.py)
    ("celery.backends.redis:RedisBackend._store_result",
     ("self", "task_id", "result", "state", "traceback", "request", "**kwargs")),
    ("celery.backends.redis:RedisBackend._get_result_meta",
     ("self", "result", "state", "traceback", "request", "format_date", "encode")),
    ("celery.backends.redis:RedisBackend._MAX_STR_VALUE_SIZE", None),
    ("celery.backends.redis:RedisBackend.set_chord_size", ("self", "group_id", "chord_size")),
    ("celery.backends.redis:RedisBackend._unpack_chord_result", ("self", "tup", "decode")),
    ("celery.backends.redis:RedisBackend.remove_pending_result", ("self", "result")),
    ("celery.backends.redis:RedisBackend.ResultConsumer", None),
    ("celery.backends.redis:ResultConsumer._reconnect", ("self",)),
    ("celery.backends.redis:RedisBackend.prepare_exception", ("self", "exc", "serializer")),
    ("celery.backends.redis:RedisBackend.failure_expires", None),
    ("celery.backends.redis:RedisBackend.chord_expires", None),
    ("celery.backends.redis:SentinelBackend._get_pool", ("self", "**params")),
    # Celery's app, worker consumer and state (tasks/core/app.py, tasks/worker/)
    ("celery.app.base:Celery._get_backend", ("self",)),
    ("celery.worker.consumer:Consumer.on_send_event_buffered", ("self",)),
    ("celery.worker.consumer:Consumer._flush_events", ("self",)),
    ("celery.worker.consumer:Consumer.on_unknown_task", ("self", "body", "message", "exc")),
    ("celery.worker.state:task_ready", ("request",)),
    ("celery.worker.state:revoked", None),
    ("celery.worker.state:should_stop", None),
    ("celery.worker.state:should_terminate", None),
    ("celery.worker.request:Request", None),
    ("celery.worker.strategy:default", ("task", "app", "consumer")),
    # redis-py (tasks/core/sentinel.py)
    ("redis.connection:AbstractConnection.connect_check_health", ("self", "check_health", "retry_socket_connect")),
    ("redis.connection:AbstractConnection._sock", None),
    ("redis.sentinel:SentinelManagedConnection._connect_retry", ("self",)),
]


#: What :func:`_resolve` gives for a name its owner does not have (``None`` is a value: Celery's
#: ``should_stop``).
MISSING = object()


def _resolve(target: str) -> tuple[Any, Any, str]:
    """``(owner, object or MISSING, name)`` of ``module:Qual.name``; ``owner`` the class or module."""
    module_name, _, qualname = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, getattr(owner, name, MISSING), name


def _assigned(owner: Any, name: str) -> bool:
    """Whether a class of ``owner``'s MRO assigns ``self.<name>`` (an instance attribute)."""
    pattern = re.compile(rf"self\.{re.escape(name)}\s*[:=]")
    for cls in getattr(owner, "__mro__", ()):
        if cls is object:
            continue
        try:
            if pattern.search(inspect.getsource(cls)):
                return True
        except (OSError, TypeError):
            continue
    return False


def _parameters(func: Any) -> list[str]:
    out = []
    for param in inspect.signature(func).parameters.values():
        prefix = {param.VAR_POSITIONAL: "*", param.VAR_KEYWORD: "**"}.get(param.kind, "")
        out.append(prefix + param.name)
    return out


def _signature_problem(func: Any, relied: tuple[str, ...]) -> str | None:
    """What differs between ``func``'s parameters and those relied on, or None: the named ones
    must come first in that order (``**x``: it still takes any keyword), and no parameter
    after them may be required."""
    params = _parameters(func)
    named = [p for p in relied if not p.startswith("**")]
    if params[:len(named)] != named:
        return f"takes {params}, relied on {list(relied)}"
    if any(p.startswith("**") for p in relied) and not any(p.startswith("**") for p in params):
        return f"takes no **keywords any more: {params}"
    sig = inspect.signature(func).parameters
    required = [n for n in list(sig)[len(named):] if sig[n].default is inspect.Parameter.empty
                and sig[n].kind in (sig[n].POSITIONAL_ONLY, sig[n].POSITIONAL_OR_KEYWORD, sig[n].KEYWORD_ONLY)]
    if required:
        return f"now requires {required} too"
    return None


def test_each_kombu_method_copied_or_overridden_is_the_source_it_was_read_in() -> None:
    import kombu

    from tasks.core.transport import KOMBU_CHECKED, KOMBU_SOURCES

    changed = []
    for target, (recorded, recheck) in KOMBU_SOURCES.items():
        _owner, obj, _name = _resolve(target)
        if obj is MISSING:
            changed.append(f"{target}: gone. {recheck}")
            continue
        digest = hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
        if digest != recorded:
            changed.append(f"{target}: source changed (sha256 {digest}, read as {recorded}). {recheck}")
    assert not changed, (
        f"kombu {kombu.__version__} changed what tasks/core/transport.py copies or overrides (read in "
        f"kombu {KOMBU_CHECKED}); re-read each, carry the change over, then renew its hash in "
        "KOMBU_SOURCES and KOMBU_CHECKED:\n" + "\n".join(changed))


def test_each_private_name_relied_on_still_exists_with_the_parameters_relied_on() -> None:
    problems = []
    for target, relied in RELIED_ON:
        owner, obj, name = _resolve(target)
        if obj is MISSING and not _assigned(owner, name):
            problems.append(f"{target}: gone")
        elif relied is not None and obj is not MISSING:
            problem = _signature_problem(obj, relied)
            if problem:
                problems.append(f"{target}: {problem}")
        elif relied is not None:
            problems.append(f"{target}: not a callable any more")
    assert not problems, ("an internal of kombu, Celery or redis-py that devicefleet relies on changed; "
                          "re-check its user (pyproject.toml's list says where):\n" + "\n".join(problems))


def test_celery_command_still_takes_its_app_as_its_first_option() -> None:
    from celery.bin.celery import celery

    # tasks/ops/celery_main.py sets this option's default as Celery.start() does.
    assert celery.params[0].name == "app", [p.name for p in celery.params]


def _dependency_comments() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index("dependencies = ["):]
    block = block[:block.index("\n]")]
    return "\n".join(line for line in block.splitlines() if line.strip().startswith("#"))


def test_pyproject_lists_every_internal_relied_on() -> None:
    comments = _dependency_comments()
    missing = [target for target, _ in RELIED_ON
               if not re.search(rf"(?<![A-Za-z0-9_]){re.escape(target.rpartition('.')[2].rpartition(':')[2])}(?![A-Za-z0-9_])",
                                comments)]
    assert not missing, f"pyproject.toml's comment beside the dependencies does not name: {missing}"


def test_kombu_and_celery_are_bounded_to_the_minor_release_checked() -> None:
    import celery
    import kombu

    from tasks.core.transport import KOMBU_CHECKED

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    minor = ".".join(KOMBU_CHECKED.split(".")[:2])
    upper = f"{minor.split('.')[0]}.{int(minor.split('.')[1]) + 1}"
    assert f"kombu>={KOMBU_CHECKED},<{upper}" in deps, deps
    assert f"celery[redis]>={KOMBU_CHECKED},<{upper}" in deps, deps
    assert kombu.__version__.startswith(minor + ".") and celery.__version__.startswith(minor + ".")


def test_queue_lists_name_kombus_priority_step_lists_as_kombu_does() -> None:
    from kombu.transport.redis import Channel

    from tasks.core.queue_lists import KOMBU_PRIORITY_STEPS, KOMBU_STEP_SEPARATOR, brpop_keys, step_list

    assert (Channel.sep, tuple(Channel.priority_steps)) == (KOMBU_STEP_SEPARATOR, KOMBU_PRIORITY_STEPS)
    channel = types.SimpleNamespace(sep=Channel.sep, priority_steps=Channel.priority_steps)
    channel.priority = types.MethodType(Channel.priority, channel)
    for step in KOMBU_PRIORITY_STEPS:
        assert step_list("cpu:batch", step) == Channel._q_for_pri(channel, "cpu:batch", step)
    # kombu's own BRPOP names every step list of every queue, step by step; the fleet's names the
    # non-zero steps' lists after the level and user lists, in kombu's order.
    queues = ["cpu:urgent", "cpu", "cpu:batch"]
    kombus = [Channel._q_for_pri(channel, q, pri) for pri in Channel.priority_steps for q in queues]
    ours = [key for key, _ in brpop_keys(queues, [], Channel.priority_steps)]
    assert ours == kombus
