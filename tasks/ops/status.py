"""``devicefleet status``: the live fleet at a glance, as a dict (``--json``) or rich tables.

:func:`report` reads the registry and the throughput counters (:func:`tasks.ops.exporter.fleet_snapshot`)
and the dead letters (:mod:`tasks.producer.dead_letters`), and adds the Flower and metrics URLs
from the fleet file; :func:`render` draws it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table

from ..core.defaults import STATUS_WAITING_ROWS
from ..core.groups import read_groups
from ..core.priority import DEFAULT_LEVEL
from ..core.queue_lists import split_level
from ..core.records import FleetFile, iso
from ..core.registry import live_workers, reading
from ..core.settings import redact_url
from ..producer.dead_letters import read_dead_letters
from ..producer.waiting import by_level_and_user, read_fair_share, read_waiting
from .exporter import fleet_snapshot
from .progress_view import describe, fraction

logger = logging.getLogger(__name__)


def report(url: str, fleet_info: FleetFile | None = None) -> dict[str, Any]:
    """``{"redis_url", "flower_url", "metrics_url", "workers", "devices", "queues", "waiting",
    "waiting_by_level", "fair_share", "dead_letters", "groups", "at"}``.

    ``workers`` are the registry records (as JSON); ``devices`` the throughput figures of
    :func:`tasks.ops.exporter.fleet_snapshot`; ``queues`` each queue list's depth and oldest age;
    ``waiting`` each queued job (:class:`tasks.producer.waiting.WaitingJob` as JSON: its level,
    user, position and why it waits), in order, and ``waiting_by_level`` their counts
    ``{level: {user: n}}``; ``fair_share`` each user's usage and share, least first: the order a
    free device serves them in within a level (:func:`tasks.producer.waiting.read_fair_share`); ``dead_letters`` the jobs given up after taking their worker down
    (as JSON, oldest first); ``groups`` the device groups that reserved devices, waiting or
    running, and what a waiting one waits for (:func:`tasks.core.groups.read_groups`); ``caps``
    each cap set and what it holds now (``line``: ``alice: 4/4 gpu (cap), borrowing off``).
    Each live device's entry in ``devices`` has its ``labels`` (its worker config's, what
    placement's ``label.NAME`` constraints match: :mod:`tasks.core.placement`).

    Raises:
        FleetError: Redis cannot be read.
    """
    with reading(url) as client:
        live = live_workers(client)
        snap = fleet_snapshot(client)
        groups = read_groups(client, live)
        letters = read_dead_letters(client) if snap["dead_letters"] else []
        waiting = read_waiting(client)
        fair_share = read_fair_share(client)
    return {
        "redis_url": redact_url(url),
        "flower_url": fleet_info.flower_url if fleet_info else None,
        "flower_auth_file": fleet_info.flower_auth_file if fleet_info else None,
        "metrics_url": fleet_info.metrics_url if fleet_info else None,
        "at": snap["at"],
        "workers": {device: record.to_dict() for device, record in live.items()},
        "devices": {device: {**figures, "labels": live[device].labels} if device in live else figures
                    for device, figures in snap["devices"].items()},
        "queues": snap["queues"],
        "waiting": [job.model_dump(mode="json") for job in waiting],
        "waiting_by_level": by_level_and_user(waiting),
        "fair_share": fair_share,
        "dead_letters": [letter.to_dict() for letter in letters],
        "groups": groups,
        "caps": snap["caps"],
    }


def _job_text(busy: dict[str, Any], fields: dict[str, Any] | None, now: float) -> str:
    """``train 12s 3/10 loss=0.2``: a running job, how long it ran, its latest report."""
    text = f"{busy.get('job')} {now - float(busy.get('since', now)):.0f}s"
    counter = fraction(fields or {})
    if counter is not None:
        text += f" {counter[0]:g}/{counter[1]:g}"
    extra = describe(fields or {})
    return f"{text} {extra}" if extra else text


def _state(device: dict[str, Any], now: float) -> str:
    busy = device.get("busy")
    if not device.get("live"):
        return "[dim]offline[/]"
    slots = device.get("slots") or []
    if len(slots) > 1:
        running = sum(1 for slot in slots if slot.get("busy"))
        if running:
            return f"[yellow]busy[/] {running}/{len(slots)} slots"
        return f"idle ({len(slots)} slots)" if device.get("ready") else "starting"
    if not busy:
        return "idle" if device.get("ready") else "starting"
    return f"[yellow]busy[/]: {_job_text(busy, device.get('progress'), now)}"


def health_text(health: dict[str, Any] | None) -> str:
    """``ok``, or ``drained: fan noise (alice, 12:03:04)``: a device's service state, why, by whom, since."""
    if not health or health.get("state", "ok") == "ok":
        return "ok"
    since = time.strftime("%H:%M:%S", time.localtime(float(health.get("since") or 0)))
    return (f"[red]{health['state']}[/]: {escape(str(health.get('reason') or '-'))} "
            f"({escape(str(health.get('by') or '?'))}, {since})")


def labels_text(labels: dict[str, Any] | None) -> str:
    """``rack="a", nvlink=true``: a device's labels as a constraint names them (values in JSON,
    so ``"1"`` and ``1`` differ as they do in matching); ``""`` without any."""
    return ", ".join(f"{name}={json.dumps(value)}" for name, value in sorted((labels or {}).items()))


def _mib(value: Any) -> str:
    return "-" if value is None else f"{float(value) / 2**20:,.0f}"


def slot_lines(name: str, device: dict[str, Any], now: float) -> list[str]:
    """One line per slot of a device with several: its job (or idle) and its memory against its
    budget (``cpu0 slot 1: train 12s 3/10 · 812/2,048 MiB resident``)."""
    slots = device.get("slots") or []
    if len(slots) < 2 or not device.get("live"):
        return []
    kind = "GPU" if device.get("memory_kind") == "device" else "resident"
    lines = []
    for slot in slots:
        busy = slot.get("busy")
        job = _job_text(busy, slot.get("progress"), now) if busy else "idle"
        used = _mib(slot.get("memory_bytes")) if busy else "-"
        cores = ",".join(str(c) for c in slot.get("cores") or []) or "-"
        lines.append(f"  {name} slot {slot.get('index')}: {job} · {used}/{_mib(slot.get('budget_bytes'))} MiB "
                     f"{kind} · cores {cores}")
    return lines


def waiting_part(rep: dict[str, Any]) -> list[Any]:
    """The queued jobs, by level and user, then the first :data:`STATUS_WAITING_ROWS` of them in
    order with their position and why they wait (nothing when no job waits)."""
    jobs = rep.get("waiting") or []
    if not jobs:
        return []
    counts = "; ".join(f"{level}: " + ", ".join(f"{user} {n}" for user, n in users.items())
                       for level, users in (rep.get("waiting_by_level") or {}).items())
    rows = table(f"{len(jobs)} job(s) waiting ({counts})", ["#", "level", "user", "job", "queue", "why"], right=("#",))
    for job in jobs[:STATUS_WAITING_ROWS]:
        rows.add_row(str(job["position"]), job["level"], job["user"] or "?", job["job"], job["queue"], job["reason"])
    more = len(jobs) - STATUS_WAITING_ROWS
    share = rep.get("fair_share") or {}
    served = ("within a level, users are served least usage first: "
              + ", ".join(f"{user} {u['share']:.0%} ({u['usage_s']:.0f} device-s)" for user, u in share.items()))
    return (["", rows] + ([f"... and {more} more (devicefleet status --json lists them all)"] if more > 0 else [])
            + ([served] if share else []))


def caps_part(rep: dict[str, Any]) -> list[str]:
    """One line per cap set and kind it names (nothing when none is set)."""
    caps = rep.get("caps") or []
    return ["", "caps: " + "; ".join(cap["line"] for cap in caps)] if caps else []


def _num(value: float | None, fmt: str = "{:.3g}") -> str:
    return "-" if value is None else fmt.format(value)


def table(title: str, columns: list[str], right: tuple[str, ...] = ()) -> Table:
    """A table that fits an 80-column terminal and never truncates: light borders, and a cell
    too long for its column wraps (folds) instead of ending in an ellipsis. Headers wrap at
    spaces and never get narrower than their longest word."""
    out = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, title_justify="left")
    for column in columns:
        out.add_column(column, overflow="fold", justify="right" if column in right else "left",
                       min_width=max(len(word) for word in column.split()))
    return out


def render(rep: dict[str, Any]) -> Group:
    """Rich tables: devices (state, jobs, jobs/s, samples/s...), then queues, then each
    worker's process and what it sees (as lines, which wrap, rather than two wide columns), then
    the dead letters if there are any."""
    now = float(rep.get("at") or time.time())
    live = sum(1 for d in rep["devices"].values() if d["live"])
    # GPU memory only on a fleet with a GPU: the column would be all dashes on a CPU host.
    gpus = any(dev.get("gpu_memory_bytes") is not None for dev in rep["devices"].values())
    devices = table(f"{live} live device(s)",
                    ["device", "state", "health", "ok", "errors", "jobs/s", "samples/s", "data wait"]
                    + (["GPU MiB"] if gpus else []) + ["cores"],
                    right=("ok", "errors", "jobs/s", "samples/s", "data wait", "GPU MiB"))
    seen: list[str] = []
    slot_rows: list[str] = []
    for name, dev in rep["devices"].items():
        slot_rows += slot_lines(name, dev, now)
        rec = rep["workers"].get(name, {})
        gpu = dev.get("gpu_memory_bytes")
        devices.add_row(
            name, _state(dev, now), health_text(dev.get("health")), str(dev["jobs_ok"]), str(dev["jobs_error"]), f"{dev['jobs_per_s']:.2f}",
            _num(dev.get("samples_per_s"), "{:,.0f}"), _num(dev.get("data_wait_fraction"), "{:.0%}"),
            *(["-" if gpu is None else f"{gpu / 2**20:,.0f}"] if gpus else []),
            ",".join(str(c) for c in rec.get("cores", [])) or "-",
        )
        if rec:
            sees = f"{rec.get('device_name')}" + (" (CUDA)" if rec.get("cuda_available") else "")
            jobs = ",".join(str(pid) for pid in rec.get("job_pids") or []) or "none"
            commands = rec.get("commands") or {}
            allowed = (f", commands: {', '.join(commands.get('programs') or {})} in "
                       f"{', '.join(commands.get('workdirs') or [])}") if commands.get("programs") else ""
            labels = labels_text(rec.get("labels"))
            labelled = f", labels: {escape(labels)}" if labels else ""
            seen.append(f"{name}: {dev.get('worker') or rec.get('worker')} pid {rec.get('pid')} (job processes "
                        f"{jobs}), CUDA_VISIBLE_DEVICES={rec.get('cuda_visible_devices')}, sees {sees}{labelled}"
                        f"{allowed}")
    queues = table("queues", ["queue", "waiting", "oldest"], right=("waiting", "oldest"))
    for name, q in rep["queues"].items():
        if not q["depth"] and split_level(name)[1] is not DEFAULT_LEVEL:
            continue  # an empty urgent or batch list: the normal one stands for its queue
        age = q.get("oldest_age_s")
        queues.add_row(name, str(q["depth"]), "-" if age is None else f"{age:.1f}s")
    parts: list[Any] = [devices, *slot_rows, *seen, "", queues, *waiting_part(rep), *caps_part(rep)]
    if rep.get("groups"):
        parts.extend(["", group_table(rep["groups"], now)])
    letters = rep.get("dead_letters") or []
    if letters:
        dead = table(f"{len(letters)} dead letter(s): jobs that took their worker down, not run again",
                     ["job id", "job", "device", "workers it took down", "given up at"])
        for letter in letters:
            dead.add_row(letter["task_id"], letter["job"], letter["device"], ", ".join(letter["workers"]),
                         iso(letter["at"]) or "-")
        parts.extend(["", dead, "tasks.dead_letters() lists them; tasks.forget_dead_letter(job_id) removes one."])
    links = []
    if rep.get("flower_url"):
        where = rep.get("flower_auth_file") or "FLOWER_BASIC_AUTH"
        links.append(f"Flower: {rep['flower_url']} (login in {where})")
    if rep.get("metrics_url"):
        links.append(f"Prometheus metrics: {rep['metrics_url']}")
    parts.extend(links)
    return Group(*parts)


def group_table(groups: list[dict[str, Any]], now: float) -> Table:
    """The device groups that reserved devices: running, or waiting and for what."""
    out = table(f"{len(groups)} device group(s)", ["group", "chosen for", "job id", "state", "waiting for"])
    for group in groups:
        waited = f" {now - group['since']:.0f}s" if group["since"] else ""
        state = f"{group['state']}{waited}"
        if group["state"] in ("sent", "waiting"):
            open_to_singles = [d for d in group["name"].split("+") if d not in group["closed"]]
            if open_to_singles:
                state += f" (reserving {', '.join(open_to_singles)})"
        held = sum(group["closed"].values())
        if held:
            state += f", {held} single job{'' if held == 1 else 's'} held back"
        waiting = "; ".join(f"{device}: {what}" for device, what in group["waiting_for"].items()) or "-"
        why = group.get("why") or "-"
        why = why.removeprefix(f"{group['name']}: ")
        out.add_row(group["name"], why, str(group["job_id"]), state, waiting)
    return out
