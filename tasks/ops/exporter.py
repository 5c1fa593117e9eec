"""Fleet throughput metrics: what each device ran, how deep each queue is, in Prometheus format.

Design: Flower already turns Celery's task events into ``/metrics`` (``flower_events_total``,
``flower_task_runtime_seconds``, ``flower_worker_online``...). What it lacks (flower#1173) lives
in Redis, so the fleet exports it itself, from one exporter thread the launcher starts:

- each worker, when a job ends, adds to its device's counters in Redis
  (:class:`tasks.core.jobcount.JobCount`, stored with each result): jobs by status, busy
  seconds, the metrics the job declared (samples, the last samples/s and data-wait fraction), GPU
  memory, and the finish time in a sorted set (for jobs/s over the last minute). Counters in
  Redis survive a worker restart and need no event stream, so they are exact; they are read
  back through the same record's field names (:class:`tasks.core.jobcount.DeviceStats`);
- queue depth is ``LLEN`` of kombu's Redis lists (one per priority step), and the oldest waiting
  message's age comes from the send-time header every producer stamps
  (:mod:`tasks.producer.sent_at`);
- each user's device-seconds by level and fair-share usage, and each level's wait times (send
  to start), which the store script counts with each result (:mod:`tasks.core.fairshare`);
- the dead letters (jobs that took their worker down ``max_attempts`` times, not run again) are
  ``HLEN`` of ``keys.DEAD_LETTERS``;
- :class:`FleetCollector` reads all of that on each scrape; :class:`MetricsExporter` serves it
  with prometheus_client on loopback. :func:`fleet_snapshot` gives the same figures as a dict,
  for ``devicefleet status``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import redis
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core import keys
from ..core.caps import read_cap_uses
from ..core.defaults import RATE_WINDOW_S, WAIT_BUCKETS_S
from ..core.device_state import STATES, DeviceState, parse_states
from ..core.fairshare import read_usage, read_user_seconds, read_wait_times
from ..core.job import JobMetric
from ..core.jobcount import DeviceStats
from ..core.queue_lists import known_users, leveled, lists_beside, step_lists, waiting_users
from ..core.queues import QueueName, device_queue
from ..core.records import EntryStatus, WorkerRecord
from ..core.registry import connect, live_workers
from ..core.xids import read_xid_counts
from .usage import read_fleet_usage

logger = logging.getLogger(__name__)

# -- reading -----------------------------------------------------------------------------------------


def queue_depth(client: redis.Redis, queue: str, now: float | None = None,
                users: Iterable[str] = ()) -> tuple[int, float | None]:
    """``(messages waiting, age in seconds of the oldest)`` of one kombu Redis queue (a level
    list), with kombu's priority-step lists and the lists of each of ``users`` beside it
    (:mod:`tasks.core.queue_lists`). Read with a fleet user's credentials, the oldest is of the
    lists whose messages she may read (her own)."""
    now = time.time() if now is None else now
    depth = 0
    oldest: float | None = None
    for key in [*lists_beside(queue, users), *step_lists(queue)]:
        length = int(client.llen(key))  # type: ignore[arg-type]
        if not length:
            continue
        depth += length
        try:
            raw = client.lindex(key, -1)  # kombu LPUSHes and BRPOPs: the tail is the oldest
        except redis.exceptions.NoPermissionError:
            continue  # another user's list, read with a user's credentials: its length only
        sent = _sent_at(raw)
        if sent is not None:
            oldest = sent if oldest is None else min(oldest, sent)
    return depth, (max(0.0, now - oldest) if oldest is not None else None)


def _sent_at(raw: Any) -> float | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)["headers"].get(keys.SENT_AT_HEADER)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def fleet_queues(live: Mapping[str, WorkerRecord], devices: list[str]) -> list[str]:
    """Every queue list of the fleet: the shared ones, each device's own, and extra queues, each
    at every level (:mod:`tasks.core.priority`)."""
    names = leveled([q.value for q in QueueName])
    for device in devices:
        for name in leveled([device_queue(device)]):
            if name not in names:
                names.append(name)
    for rec in live.values():
        for name in leveled(rec.queues):
            if name not in names:
                names.append(name)
    return names


def fleet_snapshot(client: redis.Redis, now: float | None = None) -> dict[str, Any]:
    """The fleet at a glance, read from Redis.

    Returns:
        ``{"at", "devices": {device: {...}}, "queues": {queue: {"depth", "oldest_age_s"}}}``;
        a device appears while its worker is live or once it has run a job. Its fields:
        ``live``, ``worker``, ``busy`` (the longest-running job, or None), ``progress`` (its
        latest report), ``slots`` (each slot's ``index``, ``busy``, ``progress``,
        ``memory_bytes``, ``budget_bytes``), ``memory_kind``, ``jobs_ok``,
        ``jobs_error``, ``jobs_total``, ``busy_seconds``, ``samples``, ``jobs_per_s`` (last
        minute), ``samples_per_s``, ``data_wait_fraction``, ``gpu_memory_bytes``, ``jobs_fenced``, ``writes_refused``, ``jobs_preempted``, ``health`` (its service state: ``state`` ok, drained,
        quarantined or suspect, ``reason``, ``since``, ``by``, ``hardware``, ``now``:
        :class:`~tasks.core.device_state.DeviceState`). Also
        ``"dead_letters"``: how many jobs are kept as dead letters; ``"users"``: ``{user:
        {"usage_s", "device_seconds": {level: s}}}`` (usage decayed to now, the fair share's;
        device-seconds ever, by level); ``"wait_times"``: ``{level: {"le:<bound>", "count", "sum"}}``,
        each level's histogram of waits from send to start; ``"xids"``: ``{device: {xid: count}}``,
        the Xid events each GPU's health service saw;
        ``"caps"``: each cap set, per kind it
        names (``subject``, ``name``, ``kind``, ``held`` now, ``limit``, ``borrow``, ``at_cap``,
        ``line``: ``alice: 4/4 gpu (cap), borrowing off``; :mod:`tasks.core.caps`); ``"usage"``: each
        user's and team's device-seconds held and kept busy (``None``: not measured), per kind,
        ever (:mod:`tasks.ops.usage`).
    """
    now = time.time() if now is None else now
    live = live_workers(client)
    counted: set[str] = {str(d) for d in client.smembers(keys.STATS_DEVICES)}  # type: ignore[union-attr]
    devices = sorted(set(live) | counted)
    pipe = client.pipeline(transaction=False)
    for device in devices:
        pipe.hgetall(keys.stats(device))
        pipe.zcount(keys.finished(device), now - RATE_WINDOW_S, "+inf")
    pipe.hlen(keys.DEAD_LETTERS)
    pipe.hgetall(keys.DEVICE_STATE)
    replies = pipe.execute()
    health = parse_states(replies.pop())
    dead_letters = int(replies.pop())
    out: dict[str, dict[str, Any]] = {}
    for i, device in enumerate(devices):
        stats = DeviceStats.parse(replies[2 * i])
        recent = int(replies[2 * i + 1])
        rec = live.get(device)
        out[device] = {
            "live": rec is not None,
            "kind": rec.kind if rec else device.split("@", 1)[0].rstrip("0123456789"),
            "worker": rec.worker if rec else stats.worker,
            "ready": bool(rec and rec.ready),
            "busy": rec.busy.to_dict() if rec and rec.busy else None,
            "progress": _first_progress(rec),
            "slots": [slot.to_dict() for slot in rec.slots] if rec else [],
            "memory_kind": rec.memory_kind if rec else None,
            "jobs_ok": stats.jobs_ok,
            "jobs_error": stats.jobs_error,
            "jobs_total": stats.jobs_total,
            "busy_seconds": stats.busy_seconds,
            "samples": int(stats.counters.get(JobMetric.SAMPLES, 0)),
            "jobs_per_s": recent / RATE_WINDOW_S,
            "samples_per_s": stats.gauges.get(JobMetric.SAMPLES_PER_S),
            "data_wait_fraction": stats.gauges.get(JobMetric.DATA_WAIT_FRACTION),
            "gpu_memory_bytes": float(stats.gpu_memory_bytes) if stats.gpu_memory_bytes is not None else None,
            "jobs_fenced": stats.jobs_fenced,
            "writes_refused": stats.writes_refused,
            "jobs_preempted": stats.jobs_preempted,
            "health": health.get(device, DeviceState(device=device)).model_dump(exclude={"device"}),
        }
    queues = {}
    names = fleet_queues(live, devices)
    beside = waiting_users(client, names)  # the users waiting beside each, not every user ever seen
    for name in names:
        depth, age = queue_depth(client, name, now, beside[name])
        queues[name] = {"depth": depth, "oldest_age_s": age}
    usage = read_usage(client, now)
    user_seconds = read_user_seconds(client)
    _caps, uses = read_cap_uses(client)
    used = read_fleet_usage(client, now=now)
    return {"at": now, "devices": out, "queues": queues, "dead_letters": dead_letters,
            "caps": [{"subject": use.subject, "name": use.name, "kind": use.kind, "held": use.held,
                      "limit": use.limit, "borrow": use.borrow, "at_cap": use.at_cap, "line": use.line()}
                     for use in uses],
            "usage": [{"name": row.name, "kind": row.kind, "held_s": row.held_s, "busy_s": row.busy_s} for row in used],
            "users": {user: {"usage_s": usage.get(user, 0.0),
                             "device_seconds": {level: s for (u, level), s in user_seconds.items() if u == user}}
                      for user in sorted(set(known_users(client)) | set(usage) | {u for u, _ in user_seconds})},
            "wait_times": {level.value: fields for level, fields in read_wait_times(client).items()},
            "xids": read_xid_counts(client)}


def _first_progress(rec: WorkerRecord | None) -> dict[str, Any] | None:
    """The latest report of ``rec``'s longest-running job (what a one-slot device shows)."""
    if rec is None or rec.busy is None:
        return None
    return next((slot.progress for slot in rec.running if slot.busy == rec.busy), None)


# -- Prometheus ----------------------------------------------------------------------------------


class FleetCollector(Collector):
    """Reads :func:`fleet_snapshot` on each scrape and yields it as ``devicefleet_*`` metrics."""

    def __init__(self, url: str) -> None:
        self._client = connect(url)

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("devicefleet_up", "1 if the exporter could read the fleet's Redis")
        try:
            snap = fleet_snapshot(self._client)
        except redis.RedisError as exc:
            logger.warning("metrics scrape could not read Redis: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        labels = ["device", "kind"]
        jobs = CounterMetricFamily("devicefleet_jobs", "Jobs each device finished, by status",
                                   labels=[*labels, "status"])
        busy_s = CounterMetricFamily("devicefleet_job_seconds", "Seconds each device spent running jobs",
                                     labels=labels)
        fenced = CounterMetricFamily("devicefleet_fenced",
                                     "Jobs each device's worker stopped itself, cut off from Redis (stopped), "
                                     "and its writes refused for an older fencing token (refused)",
                                     labels=[*labels, "what"])
        preempted = CounterMetricFamily("devicefleet_preemptions",
                                        "Jobs each device's worker preempted for higher-level work (sent back "
                                        "to their queue to run again)", labels=labels)
        samples = CounterMetricFamily("devicefleet_train_samples", "Training samples each device processed",
                                      labels=labels)
        online = GaugeMetricFamily("devicefleet_worker_online", "1 while the device's worker heartbeats",
                                   labels=labels)
        busy = GaugeMetricFamily("devicefleet_worker_busy", "Jobs the device runs now (its busy slots)",
                                 labels=labels)
        slots = GaugeMetricFamily("devicefleet_slots", "Jobs the device may run at once (its slots)", labels=labels)
        slot_labels = [*labels, "slot"]
        slot_busy = GaugeMetricFamily("devicefleet_slot_busy", "1 while the slot runs a job", labels=slot_labels)
        slot_memory = GaugeMetricFamily(
            "devicefleet_slot_memory_bytes",
            "Memory the slot's running job holds at its last sample (GPU memory on a GPU, resident memory on a CPU)",
            labels=slot_labels)
        slot_budget = GaugeMetricFamily("devicefleet_slot_memory_budget_bytes",
                                        "The slot's memory budget (a job past it ends as out of memory)",
                                        labels=slot_labels)
        rate = GaugeMetricFamily("devicefleet_jobs_per_second",
                                 f"Jobs finished per second over the last {RATE_WINDOW_S:g} s", labels=labels)
        sps = GaugeMetricFamily("devicefleet_samples_per_second",
                                "Training samples/s of the device's last training job", labels=labels)
        wait = GaugeMetricFamily("devicefleet_data_wait_fraction",
                                 "Fraction of the last training job spent waiting for data", labels=labels)
        gpu = GaugeMetricFamily("devicefleet_gpu_memory_bytes",
                                "GPU memory the device's worker holds (CUDA caching allocator)",
                                labels=labels)
        for device, d in snap["devices"].items():
            lv = [device, str(d["kind"])]
            for status in (EntryStatus.OK, EntryStatus.ERROR):
                jobs.add_metric([*lv, status.value], d[f"jobs_{status.value}"])
            busy_s.add_metric(lv, d["busy_seconds"])
            fenced.add_metric([*lv, "stopped"], d["jobs_fenced"])
            fenced.add_metric([*lv, "refused"], d["writes_refused"])
            preempted.add_metric(lv, d["jobs_preempted"])
            samples.add_metric(lv, d["samples"])
            online.add_metric(lv, 1 if d["live"] else 0)
            busy.add_metric(lv, sum(1 for slot in d["slots"] if slot["busy"]) if d["slots"] else int(bool(d["busy"])))
            if d["live"]:
                slots.add_metric(lv, max(1, len(d["slots"])))
            for slot in d["slots"]:
                sl = [*lv, str(slot["index"])]
                slot_busy.add_metric(sl, 1 if slot["busy"] else 0)
                slot_memory.add_metric(sl, slot["memory_bytes"] or 0)
                if slot["budget_bytes"] is not None:
                    slot_budget.add_metric(sl, slot["budget_bytes"])
            rate.add_metric(lv, d["jobs_per_s"])
            if d["samples_per_s"] is not None:
                sps.add_metric(lv, d["samples_per_s"])
            if d["data_wait_fraction"] is not None:
                wait.add_metric(lv, d["data_wait_fraction"])
            if d["gpu_memory_bytes"] is not None:
                gpu.add_metric(lv, d["gpu_memory_bytes"])
        # Issue 50: one series per state, 1 for the device's (Xid counts: the health service's).
        health = GaugeMetricFamily("devicefleet_device_state",
                                   "1 for the device's service state (ok, suspect, drained, quarantined), else 0",
                                   labels=[*labels, "state"])
        for device, d in snap["devices"].items():
            for state in STATES:
                health.add_metric([device, str(d["kind"]), state], 1 if d["health"]["state"] == state else 0)
        depth = GaugeMetricFamily("devicefleet_queue_length", "Messages waiting in each queue",
                                  labels=["queue"])
        age = GaugeMetricFamily("devicefleet_queue_oldest_age_seconds",
                                "Age of the oldest message waiting in each queue (0 when empty)",
                                labels=["queue"])
        for name, q in snap["queues"].items():
            depth.add_metric([name], q["depth"])
            age.add_metric([name], q["oldest_age_s"] or 0.0)
        user_s = CounterMetricFamily("devicefleet_user_device_seconds",
                                     "Device-seconds of the jobs each user ran, by level", labels=["user", "level"])
        usage = GaugeMetricFamily("devicefleet_user_usage_seconds",
                                  "Each user's fair-share usage: device-seconds decayed over the half-life",
                                  labels=["user"])
        for user, u in snap["users"].items():
            usage.add_metric([user], u["usage_s"])
            for level, seconds in u["device_seconds"].items():
                user_s.add_metric([user, level], seconds)
        waits = HistogramMetricFamily("devicefleet_wait_seconds",
                                      "Seconds each job waited from its send to its start, by level", labels=["level"])
        for level, fields in snap["wait_times"].items():
            if not fields.get("count"):
                continue
            buckets, running = [], 0.0
            for bound in WAIT_BUCKETS_S:
                running += fields.get(f"le:{bound:g}", 0.0)
                buckets.append((f"{bound:g}", running))
            buckets.append(("+Inf", fields["count"]))
            waits.add_metric([level], buckets, fields.get("sum", 0.0))
        yield from (user_s, usage, waits)
        yield from self._caps(snap["caps"])
        yield from self._usage(snap["usage"])
        dead = GaugeMetricFamily("devicefleet_dead_letters",
                                 "Jobs given up after taking their worker down max_attempts times "
                                 "(kept until forgotten: tasks.forget_dead_letter)")
        dead.add_metric([], snap["dead_letters"])
        xids = CounterMetricFamily("devicefleet_device_xid", "Xid events each device's GPU health service saw, by Xid",
                                   labels=["device", "xid"])
        for device, counts in snap["xids"].items():
            for xid, count in sorted(counts.items()):
                xids.add_metric([device, str(xid)], count)
        yield xids
        yield from (jobs, busy_s, fenced, preempted, samples, online, busy, slots, slot_busy, slot_memory, slot_budget, rate, sps,
                    wait, gpu, depth, age, dead, health)

    @staticmethod
    def _caps(caps: list[dict[str, Any]]) -> Iterator[Metric]:
        """Each cap, its devices held now, and the one-line reason of a cap that holds work back."""
        labels = ["subject", "kind"]
        limit = GaugeMetricFamily("devicefleet_cap_devices", "Devices of a kind a user or team may hold at once",
                                  labels=labels)
        held = GaugeMetricFamily("devicefleet_cap_held_devices", "Devices of a kind a capped user or team holds now",
                                 labels=labels)
        reached = GaugeMetricFamily("devicefleet_cap_reached",
                                    "1 while a user or team holds its cap of a kind; reason: the one-line why",
                                    labels=[*labels, "reason"])
        for cap in caps:
            limit.add_metric([cap["name"], cap["kind"]], cap["limit"])
            held.add_metric([cap["name"], cap["kind"]], cap["held"])
            if cap["at_cap"]:
                reached.add_metric([cap["name"], cap["kind"], cap["line"]], 1)
        yield from (limit, held, reached)

    @staticmethod
    def _usage(rows: list[dict[str, Any]]) -> Iterator[Metric]:
        """Each user's and team's device-seconds held, kept busy and held idle, by kind
        (``devicefleet usage``, ever; busy and idle where measured: CPU devices)."""
        labels = ["name", "kind"]
        held = CounterMetricFamily("devicefleet_held_device_seconds",
                                   "Device-seconds each user's (or team's) jobs held devices of a kind", labels=labels)
        busy = CounterMetricFamily("devicefleet_busy_device_seconds",
                                   "Device-seconds they kept those devices busy (CPU devices: the job process's "
                                   "CPU seconds over its cores)", labels=labels)
        idle = CounterMetricFamily("devicefleet_held_idle_device_seconds",
                                   "Device-seconds they held devices idle (held less busy; CPU devices)", labels=labels)
        for row in rows:
            held.add_metric([row["name"], row["kind"]], row["held_s"])
            if row["busy_s"] is not None:
                busy.add_metric([row["name"], row["kind"]], row["busy_s"])
                idle.add_metric([row["name"], row["kind"]], max(0.0, row["held_s"] - row["busy_s"]))
        yield from (held, busy, idle)

    def close(self) -> None:
        self._client.close()


class MetricsExporter:
    """An HTTP server (a thread) that serves the fleet's metrics at ``http://HOST:PORT/metrics``."""

    def __init__(self, redis_url: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.redis_url = redis_url
        self.host = host
        self.port = port
        self._collector: FleetCollector | None = None
        self._server: Any = None
        self._thread: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def start(self) -> MetricsExporter:
        reg = CollectorRegistry(auto_describe=False)
        self._collector = FleetCollector(self.redis_url)
        reg.register(self._collector)
        self._server, self._thread = start_http_server(self.port, addr=self.host, registry=reg)
        self.port = int(self._server.server_port)
        logger.info("fleet metrics at %s", self.url)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._collector is not None:
            self._collector.close()
            self._collector = None
