"""Commands as jobs: what running a program through the fleet costs, and how soon its lines arrive.

Measured on one CPU device of the bench fleet, whose worker configs allow the interpreter
(``sys.executable``) in a throwaway folder (:func:`write_commands_table`), with a script written
there (:data:`SCRIPT`):

- ``vs_direct``: a fixed amount of CPU work (``numpy`` matmuls, the count calibrated once to take
  about :data:`WORK_S` seconds) run as ``tasks.fan_out(tasks.command([...]), device).get()``,
  from the send to the result, against the same script started with ``subprocess`` in the
  device's environment (its cores, ``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES=-1``), from the
  spawn to its exit. The figure is the median over the rounds of each round's ratio; the two run
  one after the other in each round, in alternating order. Where the time goes is reported
  beside it, from the script's own clock: ``send_to_start_s`` (send, job, command spawn,
  interpreter start) against ``direct_spawn_to_start_s``, and ``end_to_result_s`` (the script's
  last figures, just before its interpreter exits, to the producer having the entry) against
  ``direct_end_to_exit_s``.
  ``overhead_s`` is the fleet's wall time less its compute time, less the same of the direct
  run: what the fleet adds, apart from how fast the core computed in each run (on a busy host
  the compute times differ more than the overheads do);
- ``log_latency_s``: the script prints its ``time.time()`` every :data:`STAMP_INTERVAL_S`; the
  producer follows them with :func:`tasks.follow_logs` and notes when each arrives (one host, one
  clock). The median, with ``log_latency_s_p90`` and ``_max`` beside it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery import Celery

from ..core.errors import ConfigError
from ..core.records import Entry
from ..jobproc.command import inherited_environment
from ..producer.commands import command, follow_logs
from ..producer.fanout import fan_out, live_devices
from .dispatch import percentile
from .isolation import wait_warm

logger = logging.getLogger(__name__)

#: Seconds of CPU work the ``vs_direct`` script does (quick mode: :data:`QUICK_WORK_S`).
WORK_S = 5.0
QUICK_WORK_S = 1.0
#: Rounds of ``vs_direct`` (each: one fleet run, one direct run); quick mode: one.
ROUNDS = 5
#: How long the calibration run works to count matmuls per second.
CALIBRATE_S = 0.5
#: Side of the square float64 matrices the script multiplies (a few ms per product on one core).
MATRIX = 256
#: The ``log_latency_s`` script: a line every this many seconds, this many lines (quick: fewer).
STAMP_INTERVAL_S = 0.05
STAMP_LINES = 40
QUICK_STAMP_LINES = 10
#: Seconds any one run may take before the bench gives up.
STEP_TIMEOUT_S = 120.0
#: The script's file name in the bench's commands folder.
SCRIPT_NAME = "devicefleet_bench_command.py"

#: The script both ways run. ``work N``: N matmuls; ``calibrate S``: as many as S seconds allow;
#: ``stamps N INTERVAL``: N lines of ``stamp i time.time()``. Its figures are its last stdout line
#: (JSON) and, under the fleet, the events pipe's ``output`` (so they are in the job's entry).
SCRIPT = f'''\
import json, os, sys, time

started = time.time()


def report(fields):
    fields = {{"started": started, "ended": time.time(), **fields}}
    events = os.environ.get("DEVICEFLEET_EVENTS")
    if events:
        with open(events, "w") as pipe:
            pipe.write(json.dumps({{"output": fields}}) + "\\n")
    print(json.dumps(fields), flush=True)


def matmuls(count=None, seconds=None):
    import numpy as np

    # The same product each time (never a @ a @ ...: its values would drift into denormals,
    # which cost many times more, so a count calibrated early would not hold later).
    a, b = np.random.default_rng(0).standard_normal((2, {MATRIX}, {MATRIX}))
    c = np.empty_like(a)
    done, t0 = 0, time.perf_counter()
    while (count is not None and done < count) or (seconds is not None and time.perf_counter() - t0 < seconds):
        np.matmul(a, b, out=c)
        done += 1
    return done, time.perf_counter() - t0


mode = sys.argv[1]
if mode == "work":
    done, compute = matmuls(count=int(sys.argv[2]))
    report({{"matmuls": done, "compute_s": compute}})
elif mode == "calibrate":
    done, compute = matmuls(seconds=float(sys.argv[2]))
    report({{"matmuls": done, "compute_s": compute}})
elif mode == "stamps":
    for i in range(int(sys.argv[2])):
        print(f"stamp {{i}} {{time.time():.6f}}", flush=True)
        time.sleep(float(sys.argv[3]))
    report({{}})
else:
    sys.exit(f"unknown mode {{mode!r}}")
'''

_STAMP = re.compile(r"^stamp (\d+) ([0-9.]+)$")


def commands_table(workdir: Path, program: str = sys.executable) -> str:
    """The ``[commands]`` table of the bench's worker configs: ``program`` in ``workdir``."""
    return ("\n# devicefleet bench: the commands section runs the interpreter in its own folder\n"
            f"[commands]\nprograms = [{json.dumps(program)}]\nworkdirs = [{json.dumps(str(workdir))}]\n")


def write_commands_table(configs: Path, workdir: Path, program: str = sys.executable) -> None:
    """Give every ``*.toml`` of ``configs`` (the bench's copies) a ``[commands]`` table allowing
    ``program`` in ``workdir``, in place of any table of their own.

    Raises:
        ConfigError: a file's commands are set some other way (dotted keys) and were not replaced.
    """
    table = commands_table(workdir, program)
    for path in sorted(configs.glob("*.toml")):
        # An own [commands] table runs to the next table header or the end of the file.
        text = re.sub(r"(?ms)^[ \t]*\[commands\][ \t]*(#[^\n]*)?\n.*?(?=^[ \t]*\[|\Z)", "", path.read_text())
        text = text.rstrip("\n") + "\n" + table
        try:
            found = tomllib.loads(text).get("commands")
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"bench: {path.name} with the bench's [commands] table is not valid TOML "
                              f"({exc}): its own commands could not be replaced") from exc
        if found != {"programs": [program], "workdirs": [str(workdir)]}:
            raise ConfigError(f"bench: {path.name} sets commands some other way ({found!r}); "
                              "give them as a [commands] table")
        path.write_text(text)


def write_script(workdir: Path) -> Path:
    """The bench's script in ``workdir``; returns its path."""
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / SCRIPT_NAME
    script.write_text(SCRIPT)
    return script


def _last_json(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError(f"commands bench: the script printed no figures: {stdout[-500:]!r}")


class Direct:
    """The script started with ``subprocess`` as the device's job process would start it: its
    cores, its thread count, no GPU, the environment without the fleet's variables."""

    def __init__(self, script: Path, cores: Sequence[int], threads: int) -> None:
        self.script = script
        self.cores = list(cores)
        self.env = inherited_environment(os.environ)
        self.env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                        CUDA_VISIBLE_DEVICES="-1", PYTHONUNBUFFERED="1")

    def _pin(self) -> None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cores)

    def run(self, *args: str) -> tuple[float, float, dict[str, Any]]:
        """``(spawned at, exited at, the script's figures)``, both times by ``time.time()``."""
        spawned = time.time()
        proc = subprocess.run([sys.executable, str(self.script), *args], cwd=self.script.parent, env=self.env,
                              preexec_fn=self._pin, capture_output=True, text=True,
                              timeout=STEP_TIMEOUT_S, check=False)
        exited = time.time()
        if proc.returncode != 0:
            raise RuntimeError(f"commands bench: the direct script exited {proc.returncode}: {proc.stderr[-1000:]}")
        return spawned, exited, _last_json(proc.stdout)


def _fleet_entry(app: Celery, device: str, argv: list[str]) -> dict[str, Any]:
    handle = fan_out(command(argv), [device], app=app)
    entry: dict[str, Any] = handle.get(timeout=STEP_TIMEOUT_S)[device]
    if not Entry.parse(entry).ok:
        raise RuntimeError(f"commands bench: the command on {device} failed: {entry['error']}")
    return entry


def fleet_round(app: Celery, device: str, script: Path, matmuls: int) -> dict[str, float]:
    """The work script through the fleet: wall time from the send to the result, and its parts."""
    sent = time.time()
    entry = _fleet_entry(app, device, [sys.executable, str(script), "work", str(matmuls)])
    received = time.time()
    out = entry["output"]
    return {"fleet_s": received - sent, "fleet_compute_s": float(out["compute_s"]),
            "send_to_start_s": float(out["started"]) - sent, "end_to_result_s": received - float(out["ended"]),
            "fleet_command_s": float(out["command"]["seconds"])}


def direct_round(direct: Direct, matmuls: int) -> dict[str, float]:
    """The work script started directly: wall time from the spawn to its exit, and its start."""
    spawned, exited, out = direct.run("work", str(matmuls))
    return {"direct_s": exited - spawned, "direct_compute_s": float(out["compute_s"]),
            "direct_spawn_to_start_s": float(out["started"]) - spawned, "direct_end_to_exit_s": exited - float(out["ended"])}


def log_latencies(app: Celery, device: str, script: Path, lines: int) -> list[float]:
    """Seconds from each stamped line's print to :func:`tasks.follow_logs` yielding it."""
    handle = fan_out(command([sys.executable, str(script), "stamps", str(lines), str(STAMP_INTERVAL_S)]),
                     [device], app=app)
    latencies: list[float] = []
    deadline = time.monotonic() + STEP_TIMEOUT_S
    for _, stream, line in follow_logs(handle, until=lambda: handle.ready() or time.monotonic() > deadline):
        received = time.time()
        match = _STAMP.match(line)
        if stream == "out" and match:
            latencies.append(received - float(match.group(2)))
    entry = handle.get(timeout=STEP_TIMEOUT_S)[device]
    if not Entry.parse(entry).ok:
        raise RuntimeError(f"commands bench: the stamping command on {device} failed: {entry['error']}")
    if len(latencies) != lines:
        raise RuntimeError(f"commands bench: followed {len(latencies)} of the {lines} stamped lines")
    return latencies


def measure(app: Celery, device: str, workdir: Path, *, quick: bool) -> dict[str, Any]:
    """``{"vs_direct", "log_latency_s", ...}`` on ``device``, whose worker allows
    ``sys.executable`` in ``workdir`` (:func:`write_commands_table`)."""
    script = write_script(workdir)
    record = live_devices(app)[device]
    direct = Direct(script, record.cores, record.torch_threads or len(record.cores))
    _fleet_entry(app, device, [sys.executable, str(script), "stamps", "0", "0"])  # warm: the first command
    # A fresh fleet starts its warm spare job process after the first job: its torch import
    # takes the device's core for seconds, which the calibration or a round would be charged for.
    wait_warm(app, device)
    # Calibrate once (and warm the page cache for both): matmuls for the wanted seconds.
    _, _, calibration = direct.run("calibrate", str(CALIBRATE_S))
    work_s = QUICK_WORK_S if quick else WORK_S
    matmuls = max(1, round(calibration["matmuls"] * work_s / calibration["compute_s"]))
    rounds = 1 if quick else ROUNDS
    samples: dict[str, list[float]] = {}
    for index in range(rounds):
        # Alternate which goes first, so a drift of the host's speed is not always charged to one.
        pair = [lambda: fleet_round(app, device, script, matmuls), lambda: direct_round(direct, matmuls)]
        for run in pair if index % 2 == 0 else reversed(pair):
            for key, value in run().items():
                samples.setdefault(key, []).append(value)
        samples.setdefault("vs_direct", []).append(samples["fleet_s"][-1] / samples["direct_s"][-1])
        samples.setdefault("overhead_s", []).append(
            samples["fleet_s"][-1] - samples["fleet_compute_s"][-1]
            - (samples["direct_s"][-1] - samples["direct_compute_s"][-1]))
    latencies = log_latencies(app, device, script, QUICK_STAMP_LINES if quick else STAMP_LINES)
    out: dict[str, Any] = {key: statistics.median(values) for key, values in samples.items()}
    out.update({f"{key}_rounds": values for key, values in samples.items() if key in ("vs_direct", "fleet_s", "direct_s", "overhead_s")})
    out.update(log_latency_s=percentile(latencies, 0.5), log_latency_s_p90=percentile(latencies, 0.9),
               log_latency_s_max=max(latencies), log_lines=len(latencies), matmuls=matmuls, rounds=rounds,
               device=device, cores=list(record.cores))
    logger.info("commands: %s", out)
    return out
