"""The Redis transport, hardened: a malformed message in a queue is dropped, never fatal.

kombu's Redis channel decodes each popped item and hands it to Celery inside the worker's
event loop; an item that is not a kombu envelope (bytes pushed straight into the list), or a
task body Celery cannot unpack (``"a string"`` instead of ``[args, kwargs, embed]``), raises
out of that loop and stops the whole worker. This transport catches those errors for one
message, logs them, and keeps consuming. Celery uses it through ``broker_transport``.

Its QoS lets a job's acknowledgement be made by the script that stores the job's result
(:class:`tasks.core.jobstate.MessageAck`, in the unacked hash and index
:func:`stored_ack_keys` names): :func:`acked_in_redis` marks the message, and the
acknowledgement that follows (on Celery's usual path, in the event loop) is then only kombu's
in-memory bookkeeping, not a second round trip.

It is also cheaper per message: kombu's channel builds a new ``redis.Redis`` client object (a
response-callback table of a few hundred entries) for each publish and each acknowledgement,
on the same connection pool. This channel builds that client once per pool and reuses it:
redis-py clients are thread-safe and take a connection from the pool per command, as before.

A job that names a user is published to its user's list beside its queue's, by one script call
that also registers the user and adds her to the level list's waiting users, and a worker's BRPOP
names each level's lists, then the lists of that level's waiting users, users by usage
(:mod:`tasks.core.fairshare`: the fair share within a level), then its queues' wake lists
(a new waiting user's mark: the worker reads the users at once and polls again); the key a
message is popped from is delivered as its queue's. Every list's name comes from
:mod:`tasks.core.queue_lists`.

Why the BRPOP is a copy of kombu's (``_brpop_start``, ``_brpop_read``) rather than kombu's own
over a ``queue_order_strategy`` with each user's list a queue the consumer consumes: kombu's cycle
orders only the queues a consumer was given, and is told of them only when a consumer is added or
cancelled. Each new user would then need every worker to add a consumer for the user's list of
each of its queues at each level (a broadcast control command, and Celery's consumer re-declaring
its queues, per user), and the order by decayed usage, re-read every
:data:`~tasks.core.defaults.FAIRSHARE_REFRESH_S`, would need the cycle, which has no Redis client,
to read Redis. The copy is kept under guard instead: kombu is bounded to its minor release
(pyproject.toml), and :data:`KOMBU_SOURCES` holds the hash of each kombu method copied or
overridden, which ``tests/test_kombu_guard.py`` compares with the installed kombu.

A ``sentinel://`` fleet uses :class:`SentinelTransport`: kombu's Sentinel channel (which asks
the sentinels where the primary is, each in turn) with the same hardening, connections that
take ``READONLY`` from a demoted primary as a lost connection
(:class:`tasks.core.sentinel.ReadOnlyAwareConnection`), and a publish that waits for a replica
to have the message (:class:`tasks.core.sentinel.Replication`), so a failover cannot lose it (a
publish no replica had in time is logged and the producer goes on: see that rule).

A message popped but not recorded is given back (:class:`QoS`, :meth:`HardenedChannel._brpop_start`):
kombu takes a message from its queue (BRPOP) and records it in its unacked hash (the one the
visibility timeout and the reaper restore from) in a second round trip. When Redis goes away
between the two (a primary killed, a Redis restart), the message is out of the queue, in no
unacked hash, and in no worker's hands: lost for good, though the producer waits for it (found
by the Sentinel failover test: one trial of 200 never ran). The QoS keeps such a message in the
process (:data:`POPPED`) and the next BRPOP of any channel of the process, once Redis answers,
first pushes it back to the front of its queue (and waits for a replica on Sentinel). Lost only
if the worker process dies too before Redis is back; a copy the old primary recorded all the
same comes back an hour later, and finds the job's lease or result (it is dropped).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from queue import Empty
from time import monotonic
from typing import TYPE_CHECKING, Any

from celery.app.amqp import AMQP
from kombu import Connection
from kombu.transport import redis as kombu_redis
from kombu.transport import resolve_transport
from kombu.transport import virtual as kombu_virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads
from kombu.utils.objects import cached_property
from kombu.utils.scheduling import round_robin_cycle

from . import keys
from .defaults import WAKE_KEEP, WAKE_WINDOW_S
from .errors import NoFleetError
from .fairshare import PUBLISH, UserOrder
from .keys import FRONT_HEADER
from .priority import USER_PATTERN
from .queue_lists import brpop_keys, insert_in_level, known_users, queue_rank, user_list, user_lists, wake_list
from .sentinel import ReadOnlyAwareConnection, Replication

logger = logging.getLogger(__name__)

#: What a malformed message raises while being decoded or unpacked.
MALFORMED = (ValueError, KeyError, TypeError, AttributeError, IndexError)
#: The transport option (and Celery setting) that carries the fleet's
#: :class:`~tasks.core.sentinel.Replication` policy, as a dict.
REPLICATION_OPTION = "devicefleet_replication"

#: The kombu release the copied and overridden kombu methods below were read in (pyproject.toml
#: bounds kombu to its minor release).
KOMBU_CHECKED = "5.7.0"
#: Each kombu method this module copies or overrides, or whose behaviour it builds on: the first 16
#: hex digits of the sha256 of its source (``inspect.getsource``) in :data:`KOMBU_CHECKED`, and
#: what to re-check when it changes. ``tests/test_kombu_guard.py`` compares them with the
#: installed kombu, so an upgrade that changes one fails until it is re-read and its hash renewed.
KOMBU_SOURCES: dict[str, tuple[str, str]] = {
    "kombu.transport.redis:Channel._brpop_start": (
        "06723d707ddf2240", "copied in HardenedChannel._brpop_start: carry over what changed (the keys "
        "and their order, the timeout, _in_poll and _brpop_sent_at, the key prefix)"),
    "kombu.transport.redis:Channel._brpop_read": (
        "c42518699709f2df", "copied in HardenedChannel._brpop_reply: carry over what changed (the reply's "
        "parse, the disconnect on a connection error, the queue a key is delivered as, rotate, "
        "_deliver, what runs in its finally)"),
    "kombu.transport.redis:Channel._put": (
        "1c0cf9749576614c", "HardenedChannel._put publishes to a user's list and to the front itself and "
        "leaves the rest to kombu: re-check which publishes it must still leave (a batch, an expiring "
        "queue, a priority, a key prefix)"),
    "kombu.transport.redis:Channel._purge": (
        "221e37da7c172561", "HardenedChannel._purge adds the users' lists to kombu's purge"),
    "kombu.transport.redis:Channel._create_client": (
        "dae92bc4075dafb9", "HardenedChannel._create_client keeps one client per pool: re-check that a "
        "client is still only a view of its pool"),
    "kombu.transport.redis:Channel._q_for_pri": (
        "f3997660680dd00f", "tasks.core.queue_lists.step_list names kombu's priority-step lists as this does"),
    "kombu.transport.redis:Channel.priority": (
        "3268c345339a75d1", "tasks.core.queue_lists.brpop_keys takes each of priority_steps as its own step"),
    "kombu.transport.redis:QoS.ack": (
        "1bc15a4ddf541af6", "QoS.ack skips this round trip for a message acknowledged in Redis already"),
    "kombu.transport.redis:QoS.reject": (
        "747a02434344d1a6", "QoS.reject clears the acknowledged-in-Redis mark, then calls this"),
    "kombu.transport.redis:QoS.append": (
        "35c655f6ecc62fe6", "QoS.append keeps a popped message whose record fails (POPPED); TAKE writes "
        "the record this writes (the index's score, the hash's [message, exchange, routing key])"),
    "kombu.transport.virtual:QoS.append": (
        "b388f0cd6485c28a", "take_waiting calls it for the in-memory half of a record TAKE wrote"),
    "kombu.transport.virtual:Channel.basic_get": (
        "ba4884c15b6bed6d", "take_waiting takes with it where a key prefix is set: re-check that it "
        "records the message as delivered (QoS.append)"),
    "kombu.transport.redis:MultiChannelPoller._register_BRPOP": (
        "85724582464a615f", "the event loop's caller of _brpop_start: re-check when it calls it"),
    "kombu.utils.scheduling:round_robin_cycle.update": (
        "32ae50f63e598825", "LevelCycle.update replaces it (the queues sorted by level)"),
    "kombu.utils.scheduling:round_robin_cycle.rotate": (
        "753748bf5e3a33eb", "LevelCycle.rotate replaces it (to the end of its level's queues)"),
    "kombu.utils.scheduling:round_robin_cycle.consume": (
        "eebda26662b3ae48", "LevelCycle keeps kombu's consume: re-check that it returns items in order"),
    "kombu.connection:Connection.switch": (
        "2b1f8abee4fecb28", "FleetConnection.switch keeps the fleet's transport across a failover"),
}

#: Messages this process popped from a queue whose record in the unacked hash failed (Redis
#: went away between the two): ``(payload, exchange, routing key)``, given back to their queue
#: by the next BRPOP of any channel (the consumer's channel is a new one after a reconnect).
POPPED: deque[tuple[Any, str, str]] = deque()
_POPPED_LOCK = threading.Lock()

#: Delivery tags of messages the result store's script acknowledged in Redis (out of the
#: unacked hash and index already): their channel's acknowledgement is bookkeeping only. Kept
#: per process: the store runs in the thread of the job's task, the channel's acknowledgement
#: in the consumer's, and a delivery tag is unique.
_ACKED_IN_REDIS: set[str] = set()
_ACKED_LOCK = threading.Lock()

#: Set while this process takes messages from its queues (every process, unless a device worker
#: whose device is out of service cleared it: :mod:`tasks.worker.service`). Cleared, the next
#: BRPOP is not sent: the queues' waiting jobs stay for the other devices; the control channel
#: (pidbox) is read as before. Per process, as the consumer's channel is.
CONSUMING = threading.Event()
CONSUMING.set()


def consume(on: bool) -> None:
    """Take messages from the queues (``on``) or not (a device out of service)."""
    if on:
        CONSUMING.set()
    else:
        CONSUMING.clear()


def acked_in_redis(delivery_tag: str) -> None:
    """The message ``delivery_tag`` is out of the unacked hash and index already (the result
    store's script took it out): its acknowledgement skips kombu's round trip (:class:`QoS`)."""
    with _ACKED_LOCK:
        _ACKED_IN_REDIS.add(delivery_tag)


def _take_mark(delivery_tag: str) -> bool:
    with _ACKED_LOCK:
        marked = delivery_tag in _ACKED_IN_REDIS
        _ACKED_IN_REDIS.discard(delivery_tag)
    return marked


def stored_ack_keys(conf: Any) -> tuple[str, str] | None:
    """kombu's unacked hash and index on the broker of a Celery configuration ``conf``, for the
    script that stores a job's result to acknowledge the job's message in: ``None`` unless the
    broker's transport is this module's (whose :class:`QoS` then skips its own round trip) and
    its keys have no prefix (the script names them itself)."""
    name = conf.broker_transport
    if not name:
        return None
    transport = resolve_transport(name)
    channel = getattr(transport, "Channel", None)
    options = conf.broker_transport_options or {}
    if not (isinstance(channel, type) and issubclass(channel, HardenedChannel)) or options.get("global_keyprefix"):
        return None
    return (str(options.get("unacked_key", channel.unacked_key)),
            str(options.get("unacked_index_key", channel.unacked_index_key)))


def _user_of(message: Any) -> str | None:
    """The user a kombu message's job options name (None: none, or not a valid name)."""
    try:
        user = message["headers"][keys.OPTIONS_HEADER]["user"]
    except (KeyError, TypeError):
        return None
    return user if isinstance(user, str) and re.fullmatch(USER_PATTERN, user) else None


class QoS(kombu_redis.QoS):
    """kombu's Redis QoS; an acknowledgement already made in Redis is bookkeeping only.

    kombu internals (checked on kombu 5.7.0, pyproject.toml's floor and the newest release when
    checked): ack and reject, and virtual.QoS.ack as the in-memory part of an acknowledgement;
    the unacked hash and index it names (unacked_key, unacked_index_key, also named by
    :func:`stored_ack_keys`) are read by tasks.worker.reaper (with restore_by_tag).
    """

    def ack(self, delivery_tag: str) -> None:
        if _take_mark(delivery_tag):
            kombu_virtual.QoS.ack(self, delivery_tag)  # kombu's bookkeeping: the message is done
        else:
            super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        _take_mark(delivery_tag)
        super().reject(delivery_tag, requeue=requeue)

    # kombu internal: the record of a delivered message in the unacked hash and index, made
    # after BRPOP took it from its queue (kombu 5.7.0); channel.connection_errors.
    def append(self, message: Any, delivery_tag: str) -> None:
        try:
            super().append(message, delivery_tag)
        except self.channel.connection_errors:
            delivery = message.delivery_info
            with _POPPED_LOCK:
                POPPED.append((message._raw, delivery["exchange"], delivery["routing_key"]))
            logger.warning("Redis went away after message %s left its queue, before it was recorded "
                           "as delivered; it goes back to its queue once Redis is back", delivery_tag)
            raise


#: Pop up to ARGV[1] messages from KEYS[1..n-2] in order, each recorded in kombu's unacked hash
#: (KEYS[n-1]: delivery tag -> [message, exchange, routing key], as kombu's QoS.append writes it)
#: and index (KEYS[n]: the tag scored by ARGV[2], the time taken), in one round trip; returns the
#: messages. A message that is not kombu's (no delivery tag) is left at the end of its list.
TAKE = """
local want = tonumber(ARGV[1])
local taken = {}
local hash, index = KEYS[#KEYS - 1], KEYS[#KEYS]
for i = 1, #KEYS - 2 do
  while #taken < want do
    local raw = redis.call('RPOP', KEYS[i])
    if not raw then break end
    local ok, m = pcall(cjson.decode, raw)
    if ok and type(m) == 'table' and type(m.properties) == 'table' and m.properties.delivery_tag then
      local info = type(m.properties.delivery_info) == 'table' and m.properties.delivery_info or {}
      local tag = m.properties.delivery_tag
      redis.call('ZADD', index, ARGV[2], tag)
      redis.call('HSET', hash, tag, '[' .. raw .. ',' .. cjson.encode(info.exchange or '') .. ','
                 .. cjson.encode(info.routing_key or '') .. ']')
      taken[#taken + 1] = raw
    else
      redis.call('RPUSH', KEYS[i], raw)
      break
    end
  end
end
return taken
"""


def take_waiting(channel: Any, lists: list[str], count: int) -> list[Any]:
    """Up to ``count`` waiting messages of ``lists`` (a queue's Redis lists, in order), each
    recorded as delivered as kombu's BRPOP and ``QoS.append`` record one: in kombu's unacked hash
    and index (:data:`TAKE`, one round trip for them all) and in ``channel``'s own bookkeeping,
    so a worker that dies holding one gives it back the usual way (the reaper, the visibility
    timeout) and its acknowledgement is kombu's. A pack's leader takes its members so
    (:class:`tasks.worker.siblings.Siblings`). With a key prefix, which the script cannot name,
    by kombu's ``basic_get``, a round trip each."""
    if channel.global_keyprefix:
        taken: list[Any] = []
        for name in lists:
            while len(taken) < count and (message := channel.basic_get(name, no_ack=False)) is not None:
                taken.append(message)
        return taken
    script = channel.client.register_script(TAKE)  # EVALSHA: the script is sent once per server
    raw = script(keys=[*lists, channel.unacked_key, channel.unacked_index_key], args=[count, time.time()],
                 client=channel.client)
    messages = []
    for item in raw:
        message = channel.Message(loads(bytes_to_str(item)), channel=channel)
        # kombu internal: the in-memory half of QoS.append (the script wrote the Redis half).
        kombu_virtual.QoS.append(channel.qos, message, message.delivery_tag)
        messages.append(message)
    return messages


class LevelCycle(round_robin_cycle):  # type: ignore[misc]
    """kombu's queue cycle of a Redis channel (its ``queue_order_strategy``): levels strictly in
    order, the queues of one level in turns (:mod:`tasks.core.priority`).

    kombu hands it the channel's active queues whenever a consumer is added or cancelled
    (``update``), takes the list for each ``BRPOP`` (``consume``), and names the queue a message
    just came from (``rotate``). The queues are kept sorted by level, stably (within a level, in
    the order they were added); the queue just used goes to the end of its own level's queues,
    as kombu's default ``round_robin`` moves it to the end of all of them, so that one busy queue
    (a fleet-wide sweep's) does not starve the others of its level (a fan-out's collect step on
    ``fleet``), and never past a lower level's. kombu 5.7.0's ``kombu.utils.scheduling``.
    """

    def update(self, it: Any) -> None:
        self.items[:] = sorted(it, key=queue_rank)

    def rotate(self, last_used: str) -> str:
        items = self.items
        try:
            items.pop(items.index(last_used))
        except ValueError:
            return last_used
        insert_in_level(items, last_used)
        return last_used


if TYPE_CHECKING:
    _ChannelBase = kombu_redis.Channel
else:  # a mixin: the kombu channel comes after it in each subclass's bases
    _ChannelBase = object


class HardenedChannel(_ChannelBase):
    """What devicefleet adds to a kombu Redis channel, plain or Sentinel: dropping a malformed
    message instead of raising, one client object per connection pool, :class:`QoS` (see
    the module's docstring), and queues taken in level order (:class:`~tasks.core.priority.LevelCycle`). A mixin, first in the bases of :class:`Channel` and
    :class:`SentinelChannel`."""

    QoS = QoS
    #: kombu's queue cycle, by name: the worker's queues in level order (in turns within a
    #: level), so each BRPOP takes a message of the highest level waiting
    #: (:mod:`tasks.core.priority`). A transport option of that name still overrides it.
    queue_order_strategy = f"{__name__}:LevelCycle"

    _pool_client: Any = None
    #: The fleet's :class:`~tasks.core.sentinel.Replication` as a dict, from the transport option
    #: :data:`REPLICATION_OPTION` where the channel takes it (:class:`SentinelChannel`).
    devicefleet_replication: Any = None

    # kombu internal: the channel's client factory (its `asynchronous` argument), kombu 5.7.0.
    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:  # the event loop's own client: made once by kombu already
            return super()._create_client(asynchronous=True)
        client = self._pool_client
        if client is None or client.connection_pool is not self.pool:
            client = self._pool_client = super()._create_client()
        return client

    @cached_property
    def _user_order(self) -> UserOrder:
        return UserOrder()

    #: The list each key of the BRPOP in flight stands for (a user's list -> its queue list; a
    #: wake list -> "").
    _queue_of_key: dict[str, str] = {}

    # kombu internals: the publish of one message to a queue (LPUSH: the back, as BRPOP pops
    # from the right), the list it goes to (_q_for_pri, _get_message_priority), queue expiry
    # (_expires), kombu 5.7.0.
    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        """kombu's publish, but: a message with :data:`~tasks.core.keys.FRONT_HEADER` goes to the
        front of its queue's own list (RPUSH: the next one popped, ahead of its level's users'
        lists too), without that header; a job that names a user goes to the user's list beside
        its queue's (:mod:`tasks.core.fairshare`). A kombu publish batch, an expiring queue, a
        message with a Celery priority or a key prefix keep kombu's own publish."""
        headers = message.get("headers") if isinstance(message, dict) else None
        if isinstance(headers, dict) and headers.pop(FRONT_HEADER, None):
            key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
            with self.conn_or_acquire() as client:
                client.rpush(key, dumps(message))
            return
        user = _user_of(message)
        if (user is None or kwargs.get("_publish_batch") is not None or self.global_keyprefix
                or (self._expires and queue in self._expires)
                or self._q_for_pri(queue, self._get_message_priority(message, reverse=False)) != queue):
            super()._put(queue, message, **kwargs)
            return
        with self.conn_or_acquire() as client:
            script = self._publish_script
            if script is None:
                script = self._publish_script = client.register_script(PUBLISH)
            script(keys=[user_list(queue, user), keys.USERS, keys.waiting_users(queue), wake_list(queue)],
                   args=[user, dumps(message), WAKE_WINDOW_S, WAKE_KEEP], client=client)

    _publish_script: Any = None

    # kombu internal: a queue's purge (queue_purge, kombu 5.7.0): the users' lists beside the
    # queue go with it. (Its size, which kombu reads at every declare, is left to kombu: a
    # round trip more per publish for a count nothing of the fleet reads.)
    def _purge(self, queue: str) -> int:
        with self.conn_or_acquire() as client:
            theirs_lists = user_lists(queue, known_users(client))
            with client.pipeline() as pipe:
                for name in theirs_lists:
                    pipe.llen(name).delete(name)
                theirs = sum(int(n) for n in pipe.execute()[::2]) if theirs_lists else 0
        return int(super()._purge(queue)) + theirs

    # kombu internals: the event loop's start of a BRPOP and the read of its reply, where a
    # popped message is decoded and delivered (kombu 5.7.0: brpop_timeout, _queue_cycle,
    # active_queues, priority_steps, _in_poll, _brpop_sent_at, global_keyprefix,
    # client._prefix_args, _flush_brpop_reauth, connection._deliver). A copy of kombu's
    # (KOMBU_SOURCES holds the hash of the source copied), with the users' lists of each level
    # after its queue lists, users in order of usage, and kombu's priority-step lists last
    # (tasks.core.queue_lists.brpop_keys). Why a copy and not kombu's queue_order_strategy over
    # real per-user queues: see the module's docstring.
    def _brpop_start(self, timeout: Any = None) -> None:
        self._give_back_popped()
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues or not CONSUMING.is_set():  # none, or out of service: the poll times out idle
            return
        with self.conn_or_acquire() as client:
            waiting = self._user_order.read(client, queues)
        pairs = [*brpop_keys(queues, waiting.order, self.priority_steps, self.sep, beside=waiting.beside),
                 *dict.fromkeys((wake_list(name), "") for name in queues)]
        self._queue_of_key = dict(pairs)
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()  # type: ignore[assignment]  # kombu declares it None
        command_args = ["BRPOP", *(key for key, _ in pairs), timeout or 0]
        if self.global_keyprefix:
            command_args = self.client._prefix_args(command_args)
        self.client.connection.send_command(*command_args)

    def _brpop_reply(self, **options: Any) -> bool:
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # the next iteration reconnects
                raise
            if not dest__item:
                raise Empty()
            dest, item = dest__item
            key = bytes_to_str(dest)  # a global key prefix is stripped by kombu's client already
            if self._queue_of_key.get(key) == "":  # a wake mark: a list this poll did not name?
                if bytes_to_str(item) not in self._queue_of_key:
                    self._user_order.stale()  # read the users at once; the next poll names it
                raise Empty()
            queue = self._queue_of_key.get(key) or key.rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            self.connection._deliver(loads(bytes_to_str(item)), queue)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]  # kombu declares it a bool
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()

    def _give_back_popped(self) -> None:
        """Push the messages of :data:`POPPED` back to the front of their queues; those Redis
        does not take now stay for the next try."""
        while True:
            with _POPPED_LOCK:
                if not POPPED:
                    return
                popped = POPPED.popleft()
            try:
                with self.conn_or_acquire() as client:
                    with client.pipeline() as pipe:
                        self._do_restore_message(*popped, pipe, leftmost=False)
                        pipe.execute()
                    Replication.of(self.devicefleet_replication).wait(client, "a message given back to its queue")
            except Exception as exc:  # noqa: BLE001  (kept whatever went wrong: it is the only copy)
                with _POPPED_LOCK:
                    POPPED.appendleft(popped)
                logger.warning("could not give a popped message back to its queue yet (%s: %s)",
                               type(exc).__name__, exc)
                return
            logger.warning("gave back to its queue a message popped before Redis went away")

    # kombu internal: the event loop's read of a BRPOP reply, where a popped message is decoded
    # and delivered; connection_errors is the channel's own tuple (kombu 5.7.0).
    def _brpop_read(self, **options: Any) -> bool:
        try:
            return self._brpop_reply(**options)
        except self.connection_errors:
            raise
        except MALFORMED as exc:
            logger.error("dropped a malformed message from Redis (%s: %s); the worker goes on",
                         type(exc).__name__, exc)
            return True


class Channel(HardenedChannel, kombu_redis.Channel):
    """kombu's Redis channel, hardened (:class:`HardenedChannel`)."""


class SentinelChannel(HardenedChannel, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel, hardened (:class:`HardenedChannel`); a publish waits for the
    fleet's :class:`~tasks.core.sentinel.Replication` (the transport option
    :data:`REPLICATION_OPTION`)."""

    from_transport_options = (*kombu_redis.SentinelChannel.from_transport_options,  # type: ignore[assignment]
                              REPLICATION_OPTION)
    # kombu internal: the connection class its Sentinel pool is made with (kombu 5.7.0).
    connection_class = ReadOnlyAwareConnection

    # kombu internals: the publish of one message to a queue (LPUSH) and conn_or_acquire,
    # kombu 5.7.0. A kombu publish batch (which devicefleet and Celery do not use) is left to
    # its own flush.
    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        batched = kwargs.get("_publish_batch") is not None
        super()._put(queue, message, **kwargs)
        if batched:
            return
        with self.conn_or_acquire() as client:
            Replication.of(self.devicefleet_replication).wait(client, f"message to {queue}")


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Sentinel transport (``sentinel://``) with :class:`SentinelChannel`."""

    Channel = SentinelChannel


#: The fleet's transports (as the app names them) and the URL scheme each stands in for.
_SCHEMES_OF = {f"{__name__}:SentinelTransport": "sentinel", f"{__name__}:Transport": "redis"}


class FleetConnection(Connection):
    """kombu's connection, which keeps the transport it was made with when it fails over.

    A Sentinel broker URL names each sentinel (``sentinel://a;sentinel://b``) and kombu, after a
    failed connect, moves to the next with ``switch()``, which takes the transport from that URL's
    scheme (kombu 5.7.0: "parse_url() sets transport to the raw URL scheme, overriding any
    transport given at construction time"). A worker whose primary died then consumed through
    kombu's own Sentinel transport: no :class:`QoS` (a message popped as Redis went away was lost:
    the failover test's missing trial), no dropping of malformed messages, no ``WAIT`` after a
    publish. This connection keeps the fleet's transport across the switch when the new URL's
    scheme is the one it stands for (``sentinel``); any other switch is kombu's.
    """

    def switch(self, conn_str: str) -> None:
        kept = self.transport_cls
        super().switch(conn_str)
        if kept in _SCHEMES_OF and self.transport_cls == _SCHEMES_OF[kept]:
            self.transport_cls = kept


class FleetAMQP(AMQP):
    """Celery's AMQP helper with :class:`FleetConnection` (the app's ``amqp_cls``)."""

    Connection = FleetConnection


#: The transport option that carries why there is no fleet (see :class:`NoFleetTransport`).
NO_FLEET_OPTION = "devicefleet_no_fleet"


class NoFleetTransport(Transport):
    """The transport of an app that found no fleet to talk to (``celery -A tasks report`` with
    no ``DEVICEFLEET_REDIS_URL`` and no local fleet): the app loads, and any connection fails at
    once with the :class:`NoFleetError` that says how to start or name a fleet."""

    def establish_connection(self) -> Any:
        options = getattr(self.client, "transport_options", None) or {}
        raise NoFleetError(str(options.get(NO_FLEET_OPTION, "no fleet to connect to")))


def body_problem(body: Any) -> str | None:
    """What is wrong with a task message body of protocol 2, or None if it has the right shape."""
    if not isinstance(body, (list, tuple)) or len(body) != 3:
        return f"the body must be [args, kwargs, embed], got {type(body).__name__} {body!r:.80}"
    args, kwargs, embed = body
    if not isinstance(args, (list, tuple)):
        return f"args must be a list, got {type(args).__name__}"
    if not isinstance(kwargs, dict):
        return f"kwargs must be an object, got {type(kwargs).__name__}"
    if embed is not None and not isinstance(embed, dict):
        return f"embed must be an object, got {type(embed).__name__}"
    return None
