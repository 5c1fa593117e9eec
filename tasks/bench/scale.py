"""Scale (issue 63): what one Redis carries, by devices and by users.

- ``idle_users``: a two-device no-op fan-out (:func:`tasks.bench.dispatch.fanout_round_trips`)
  with one known user, then again once ``idle_users`` more users have each sent one job (none
  waiting now); beside each, one worker's ``BRPOP`` arguments (``CLIENT LIST``'s ``argv-mem``)
  and Redis' time per ``BRPOP`` (``INFO commandstats``).
- ``worker_rates``: an idle real worker's command stream (``INFO commandstats`` over a window on
  the bench's fleet of two, monitor included, per device), which the simulation copies.
- ``simulated``: ``devices`` simulated devices and ``users`` users against the fleet's own
  redis-server, ``waiting_users`` of them with work waiting (in the queue of the busy devices'
  kind), from one process of asyncio connections (:class:`Wire`, :func:`simulate`). Each
  simulated device makes the Redis traffic a real worker makes, read off a live fleet of two
  with ``MONITOR`` (on this 2-core VM, 2026-12): an idle one, per second, its poll (the users'
  read, :data:`tasks.core.fairshare.WAITING_READ`, then a ``BRPOP`` of 1 s over its real key list,
  :func:`tasks.core.queue_lists.brpop_keys` and its wake lists), the group host's nudge
  (``BLPOP`` of 1 s, ``DEL``, ``GET``, ``ZRANGE``), its service check (``HGET`` of the device
  state) and the reaper's look (:data:`tasks.core.jobstate.EXPIRED_LEASES` with the reaper's
  turn: a scan of the leases by one device a second, a ``GET`` by the others); every 2 s its
  heartbeat (``SET`` of a 782-byte record with its TTL, ``SADD``, ``PEXPIRE`` of its job
  schemas) and Celery's worker heartbeat event (``PUBLISH``); every 3 s the ACL keeper's
  ``HGETALL``. A busy one (its job runs, a lower level than the waiting work's) polls no
  queue: it renews its lease every third of its TTL (:data:`tasks.core.jobstate.RENEW`) and
  looks for higher-level work every :data:`~tasks.core.defaults.PREEMPT_CHECK_S` (the waiting
  users beside its lists, then their lengths: the preemption scanner's two round trips). A
  job's own take and store are not simulated: their Redis time per job is measured on the real
  fleet (``redis_us_per_job``, over the no-op fan-outs) and added per job ended.
  Meanwhile the real fleet's fan-outs are timed, and redis-server's own CPU seconds (psutil)
  are read over the window: ``redis_core_busy`` (a fraction of one core), per device and per
  user, and ``saturation_devices``: the devices at which one core is busy, at this mix
  (extrapolated from the CPU per device, idle and busy devices in the run's proportion).
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import random
import statistics
import time
from typing import Any

import psutil
import redis
from celery import Celery
from redis.connection import parse_url

from ..core import keys
from ..core.defaults import FAIRSHARE_REFRESH_S, HEARTBEAT_INTERVAL_S, LEASE_TTL_S, PREEMPT_CHECK_S, REAPER_INTERVAL_S
from ..core.fairshare import WAITING_READ, order_users, parse_usage
from ..core.jobstate import EXPIRED_LEASES, RENEW
from ..core.priority import Level
from ..core.queue_lists import (
    KOMBU_PRIORITY_STEPS,
    KOMBU_STEP_SEPARATOR,
    USER_SEPARATOR,
    QueueLists,
    brpop_keys,
    leveled,
    lists_beside,
    user_list,
    wake_list,
)
from ..core.queues import device_queue
from ..core.registry import connect
from ..core.replies import text
from ..producer.fanout import JobSpec, prioritized
from .dispatch import fanout_round_trips

logger = logging.getLogger(__name__)

#: How long every idle worker takes to read the users again: its poll's timeout (kombu's
#: ``brpop_timeout``, 1 s) and the refresh period, with a margin.
SETTLE_S = 1.0 + FAIRSHARE_REFRESH_S + 1.0


def brpop_figures(client: redis.Redis, devices: list[str]) -> dict[str, float]:
    """Redis' time per ``BRPOP`` since the last ``CONFIG RESETSTAT`` (µs) and the largest
    ``argv-mem`` of a client blocked in one now (bytes): a worker's poll's arguments."""
    stats = client.info("commandstats").get("cmdstat_brpop", {})
    argv = 0
    for _ in range(10):  # a worker between two polls is not in one: look a few times
        argv = max([argv, *(int(c.get("argv-mem", 0)) for c in client.client_list() if c.get("cmd") == "brpop")])
        time.sleep(0.05)
    return {"brpop_us": float(stats.get("usec_per_call", 0.0)), "brpop_calls": float(stats.get("calls", 0)),
            "brpop_argv_bytes": float(argv)}


def fanouts(app: Celery, devices: list[str], client: redis.Redis, runs: int) -> dict[str, float]:
    """The median two-device no-op fan-out (ms) and the poll figures over those fan-outs."""
    fanout_round_trips(app, devices, 0, warmup=3)
    client.config_resetstat()
    times = fanout_round_trips(app, devices, runs, warmup=0)
    return {"fanout_ms_p50": 1000 * statistics.median(times), **brpop_figures(client, devices)}


def send_once(app: Celery, devices: list[str], client: redis.Redis, users: list[str]) -> None:
    """Each of ``users`` sends one no-op job to the devices in turn, through the fleet's publish,
    expired as it is sent (a worker takes it and drops it: a job process per user would take a
    process start each); returns once every device's queue is empty."""
    noop = JobSpec.of("noop")
    for i, user in enumerate(users):
        prioritized(noop, user=user).signature(app, device_queue(devices[i % len(devices)])).apply_async(expires=1e-3)
    deadline = time.monotonic() + 120
    while any(QueueLists.read(client, device_queue(d)).count(client) for d in devices):
        if time.monotonic() > deadline:
            raise RuntimeError("the users' jobs still wait after 120 s")
        time.sleep(0.2)


def idle_users(app: Celery, devices: list[str], client: redis.Redis, count: int, runs: int) -> dict[str, Any]:
    """The fan-out and a worker's poll with one known user, then with ``count`` more who sent a
    job each, none waiting."""
    one = fanouts(app, devices, client, runs)
    send_once(app, devices, client, [f"idle{i}" for i in range(count)])
    time.sleep(SETTLE_S)
    many = fanouts(app, devices, client, runs)
    return {"users": count, "one_user": one, "many_users": many,
            "fanout_vs_one_user": many["fanout_ms_p50"] / one["fanout_ms_p50"],
            "argv_vs_one_user": many["brpop_argv_bytes"] / max(1.0, one["brpop_argv_bytes"]),
            "brpop_us_vs_one_user": many["brpop_us"] / max(1e-9, one["brpop_us"])}


#: The simulated record's size: a real CPU worker's (``devicefleet:worker:cpu0``, 782 bytes).
RECORD_BYTES = 782
#: Celery's worker heartbeat event as published (bytes, about).
EVENT_BYTES = 700
#: The ACL keeper's read of the fleet's users, per worker (seconds).
ACL_READ_S = 3.0
#: The round trips a simulated device means to make per second (the loops of :func:`_device`):
#: both, the heartbeat's 4 every 2 s, the service check, nudge read, reaper look's 4 every
#: second, the ACL keeper's 1 every 3 s; an idle one its poll's 2 (the users' read, BRPOP) and
#: the nudge wait's 2 (BLPOP, DEL) every second; a busy one its lease's renewal every third of
#: the TTL and the preemption scanner's 2 every PREEMPT_CHECK_S.
_BOTH_PER_S = 4 / HEARTBEAT_INTERVAL_S + 4 / REAPER_INTERVAL_S + 1 / ACL_READ_S
IDLE_COMMANDS_PER_S = _BOTH_PER_S + 2 + 2
BUSY_COMMANDS_PER_S = _BOTH_PER_S + 3 / LEASE_TTL_S + 2 / PREEMPT_CHECK_S
#: The kinds of the simulated devices: idle ones, and busy ones (whose queue holds the waiting work).
IDLE_KIND, BUSY_KIND = "simidle", "simbusy"
#: The simulated devices' stand-in for the ``fleet`` queue (the real one holds the real fan-outs'
#: collect steps, which a simulated device must not take).
SIM_FLEET = "simfleet"


def worker_rates(client: redis.Redis, devices: list[str], window_s: float) -> dict[str, float]:
    """``{command: calls per second per device}`` of the fleet at rest over ``window_s``, and
    ``redis_us_per_s_per_device``: Redis' time for them."""
    client.config_resetstat()
    time.sleep(window_s)
    stats = client.info("commandstats")
    out = {name.removeprefix("cmdstat_"): round(v["calls"] / window_s / len(devices), 2) for name, v in stats.items()}
    out["redis_us_per_s_per_device"] = sum(v["usec"] for v in stats.values()) / window_s / len(devices)
    return out



async def _every(period_s: float, stop: asyncio.Event, step: Any) -> None:
    await asyncio.sleep(random.uniform(0, period_s))  # spread, as real workers start apart
    while not stop.is_set():
        await step()
        await asyncio.sleep(period_s)


class Wire:
    """One simulated connection: each command written in RESP as any client writes it, its
    reply read back (a lock keeps each command's reply with it). It stands in for
    ``redis.asyncio``, whose own time per command (about 330 µs of the process's CPU here against
    120 µs, much of it its connection pool and retry wrapper) capped the simulation at 29% of its
    intended load at 1,000 devices; what Redis receives and does is the same."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, url: str) -> Wire:
        where = parse_url(url)
        if "path" in where:
            reader, writer = await asyncio.open_unix_connection(where["path"])
        else:
            reader, writer = await asyncio.open_connection(where.get("host", "localhost"), where.get("port", 6379))
        wire = cls(reader, writer)
        if where.get("password"):
            await wire.call("AUTH", *([where["username"]] if where.get("username") else []), where["password"])
        if where.get("db"):
            await wire.call("SELECT", where["db"])
        return wire

    async def call(self, *args: Any) -> Any:
        return (await self.pipeline([args]))[0]

    async def pipeline(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` at once and read their replies (one round trip)."""
        async with self._lock:
            self._writer.write(b"".join(_packed(args) for args in commands))
            return [await self._reply() for _ in commands]

    async def _reply(self) -> Any:
        line = await self._reader.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"$":
            size = int(rest)
            return None if size < 0 else (await self._reader.readexactly(size + 2))[:-2]
        if kind == b"*":
            size = int(rest)
            return None if size < 0 else [await self._reply() for _ in range(size)]
        if kind == b":":
            return int(rest)
        if kind == b"-":
            raise redis.ResponseError(rest.decode())
        return rest  # + a status

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()


def _packed(args: tuple[Any, ...]) -> bytes:
    parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in parts)


async def _device(url: str, name: str, busy: bool, stop: asyncio.Event, shas: dict[str, str], done: Any) -> None:
    """One simulated device's Redis traffic (the module's docstring) until ``stop``."""
    # A real worker's connections: one for its commands, and one for each of its blocking reads.
    client, poller, nudger = await Wire.open(url), await Wire.open(url), await Wire.open(url)
    kind = BUSY_KIND if busy else IDLE_KIND
    names = leveled([device_queue(name), kind, SIM_FLEET])
    record = json.dumps({"device": name, "pad": "x" * RECORD_BYTES})[:RECORD_BYTES]
    task_id = f"sim-{name}"
    event = "e" * EVENT_BYTES

    async def heartbeat() -> None:
        await client.pipeline([("SET", keys.worker(name), record, "PX", int(5 * HEARTBEAT_INTERVAL_S * 1000)),
                               ("SADD", f"{keys.PREFIX}sim-workers", name),
                               ("PEXPIRE", keys.job_schemas(name), 10_000)])
        await client.call("PUBLISH", "/0.celeryev/worker.heartbeat", event)
        done[0] += 4

    async def each_second() -> None:  # the group host's nudge wait, the service check, the reaper's look
        await client.call("HGET", keys.DEVICE_STATE, name)
        await client.call("GET", keys.group_hold(name))
        await client.call("ZRANGE", keys.device_claims(name), 0, -1, "WITHSCORES")
        await client.call("EVALSHA", shas["expired"], 2, keys.LEASES, keys.REAPER_TURN, keys.lease(""), name,
                          round(REAPER_INTERVAL_S * 1000))  # a scan on its turn only
        done[0] += 4

    async def nudges() -> None:
        await nudger.call("BLPOP", keys.group_nudge(name), 1)
        await nudger.call("DEL", keys.group_nudge(name))
        done[0] += 2

    async def poll() -> None:  # an idle worker's read of its users, then its BRPOP (transport)
        lists, found, usage = await client.call(
            "EVALSHA", shas["waiting"], 1 + len(names), keys.USAGE, *(keys.waiting_users(n) for n in names),
            USER_SEPARATOR, *names)
        users = [text(u) for u in found]
        order = order_users(users, parse_usage({u: v for u, v in zip(users, usage, strict=True) if v}, time.time()))
        beside = {n: {text(u) for u in listed} for n, listed in zip(names, lists, strict=True)}
        pairs = [*brpop_keys(names, order, KOMBU_PRIORITY_STEPS, KOMBU_STEP_SEPARATOR, beside=beside),
                 *dict.fromkeys((wake_list(n), "") for n in names)]
        await poller.call("BRPOP", *(key for key, _ in pairs), 1)
        done[0] += 2
        done[1] += 1

    async def renew() -> None:
        await client.call("EVALSHA", shas["renew"], 3, keys.lease(task_id), keys.LEASES, keys.fence(task_id),
                          "sim", int(LEASE_TTL_S * 1000), task_id, "1", 0)
        done[0] += 1

    async def scan() -> None:  # preemption: the waiting users beside each list, then the lengths above batch
        found = await client.pipeline([("ZRANGE", keys.waiting_users(n), 0, -1) for n in names])
        above = [listed for n, users in zip(names, found, strict=True) if not n.endswith(Level.BATCH.value)
                 for listed in lists_beside(n, [text(u) for u in users])]
        await client.pipeline([("LLEN", listed) for listed in above])
        done[0] += 2  # two round trips

    async def acl() -> None:
        await client.call("HGETALL", keys.FLEET_USERS)
        done[0] += 1

    loops = [_every(HEARTBEAT_INTERVAL_S, stop, heartbeat), _every(REAPER_INTERVAL_S, stop, each_second),
             _every(ACL_READ_S, stop, acl)]
    if busy:
        loops += [_every(LEASE_TTL_S / 3, stop, renew), _every(PREEMPT_CHECK_S, stop, scan)]
    else:
        loops += [_every(0, stop, poll), _every(0, stop, nudges)]
    try:
        await asyncio.gather(*loops)
    finally:
        for wire in (client, poller, nudger):
            await wire.close()


def simulate(url: str, devices: int, busy: int, seconds: float, ready: Any, done: Any, finish: Any) -> None:
    """Run ``devices`` simulated devices (``busy`` of them busy) until ``finish`` is set, for
    ``seconds`` at most (a process of its own); ``done``: a shared array of the heartbeats and
    the polls made so far."""
    import redis as sync_redis

    admin = sync_redis.Redis.from_url(url)
    shas = {"waiting": admin.script_load(WAITING_READ), "expired": admin.script_load(EXPIRED_LEASES),
            "renew": admin.script_load(RENEW)}

    async def main() -> None:
        stop = asyncio.Event()
        tasks = []
        for i in range(devices):  # joining as a fleet's workers start: a few at a time
            tasks.append(asyncio.create_task(_device(url, f"sim{i}", i < busy, stop, shas, done)))
            if i % 20 == 19:
                await asyncio.sleep(0.05)
        ready.set()
        deadline = time.monotonic() + seconds
        while not finish.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.wait(tasks, timeout=10)

    asyncio.run(main())


def seed_users(client: redis.Redis, users: int, waiting: int) -> None:
    """``users`` users who have sent jobs (their usage too), ``waiting`` of them with a job
    waiting in the busy kind's normal list, as the publish script leaves them."""
    now = time.time()
    with client.pipeline(transaction=False) as pipe:
        for i in range(users):
            user = f"user{i}"
            pipe.hsetnx(keys.USERS, user, f"{now:.6f}")
            pipe.hset(keys.USAGE, user, f"{random.uniform(0, 1e4):.3f} {now:.6f}")
            if i < waiting:
                pipe.zadd(keys.waiting_users(BUSY_KIND), {user: now})
                pipe.lpush(user_list(BUSY_KIND, user), json.dumps({"sim": user}))
        pipe.execute()


def simulated(app: Celery, devices: list[str], client: redis.Redis, *, sim_devices: int, users: int, waiting: int,
              busy: int, runs: int, us_per_job: float, job_s: float) -> dict[str, Any]:
    """The simulated load (module's docstring) with the real fleet's fan-outs timed under it."""
    pid = int(client.info("server")["process_id"])
    redis_proc = psutil.Process(pid)
    alone = 1000 * statistics.median(fanout_round_trips(app, devices, runs, warmup=3))
    seed_users(client, users, waiting)
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    done = context.Array("l", 2, lock=False)  # commands, polls
    finish = context.Event()
    window = 4.0 if runs < 20 else 30.0
    process = context.Process(target=simulate, args=(str(app.conf.broker_url), sim_devices, busy, 600, ready, done, finish),
                              daemon=True)
    process.start()
    try:
        if not ready.wait(300):
            raise RuntimeError("the simulated devices did not start")
        time.sleep(window / 4)  # every device past its first poll and beat
        idle_cpu, t0, done0 = redis_proc.cpu_times(), time.monotonic(), list(done)
        time.sleep(window / 2)  # the load alone
        idle_window = time.monotonic() - t0
        cpu_idle_end, done1 = redis_proc.cpu_times(), list(done)
        loaded = 1000 * statistics.median(fanout_round_trips(app, devices, runs, warmup=2))
    finally:
        finish.set()
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    redis_s = (cpu_idle_end.user + cpu_idle_end.system) - (idle_cpu.user + idle_cpu.system)
    # The share of the intended load the simulating process made (one Python process: on a
    # loaded host it falls behind); Redis' CPU is scaled up by it.
    intended = ((sim_devices - busy) * IDLE_COMMANDS_PER_S + busy * BUSY_COMMANDS_PER_S) * idle_window
    beats = (done1[0] - done0[0]) / intended
    polls = (done1[1] - done0[1]) / max(1, sim_devices - busy) / idle_window
    achieved = min(1.0, max(beats, 1e-9))
    busy_core = redis_s / idle_window / achieved
    # The jobs the busy devices end (one each job_s): their take and store, as measured on the fleet.
    jobs_core = busy / job_s * us_per_job / 1e6
    total = busy_core + jobs_core
    per_device = total / sim_devices
    return {"devices": sim_devices, "users": users, "waiting_users": waiting, "busy_devices": busy,
            "redis_core_busy": total, "redis_core_busy_polls": busy_core, "redis_core_busy_jobs": jobs_core,
            "core_per_device": per_device, "core_per_user": total / users,
            "saturation_devices": 1.0 / per_device if per_device else float("inf"),
            "fanout_ms_p50_alone": alone, "fanout_ms_p50_loaded": loaded, "fanout_loaded_vs_alone": loaded / alone,
            "job_s": job_s, "window_s": idle_window, "load_achieved": beats,
            "polls_per_s_per_idle_device": polls, "redis_core_busy_measured": redis_s / idle_window}


def measure(app: Celery, devices: list[str], *, quick: bool) -> dict[str, Any]:
    """The scale figures (see the module's docstring)."""
    client = connect(str(app.conf.broker_url))
    out: dict[str, Any] = {}
    idle = idle_users(app, devices, client, 20 if quick else 300, 20 if quick else 60)
    out.update(idle_fanout_vs_one_user=idle["fanout_vs_one_user"], idle_argv_vs_one_user=idle["argv_vs_one_user"],
               idle_users=idle)
    out["worker_rates"] = worker_rates(client, devices, 1.0 if quick else 10.0)
    # Redis' time per no-op job on the real fleet: every command over the fan-outs, per job.
    client.config_resetstat()
    runs = 10 if quick else 40
    fanout_round_trips(app, devices, runs, warmup=0)
    stats = client.info("commandstats")
    us_per_job = sum(v["usec"] for v in stats.values()) / (runs * len(devices))
    out["redis_us_per_job"] = us_per_job
    sim = simulated(app, devices, client, sim_devices=20 if quick else 1000, users=10 if quick else 300,
                    waiting=3 if quick else 100, busy=2 if quick else 100, runs=10 if quick else 60,
                    us_per_job=us_per_job, job_s=60.0)
    out["simulated"] = sim
    out.update(sim_redis_core_busy=sim["redis_core_busy"], sim_fanout_vs_alone=sim["fanout_loaded_vs_alone"],
               saturation_devices=sim["saturation_devices"])
    logger.info("scale: %s", out)
    return out
