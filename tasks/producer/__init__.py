"""The producer side: sending jobs to the fleet and collecting their entries."""

from . import sent_at  # noqa: F401  (stamps each published message with its send time)
from .client import FleetClient
from .commands import LogFollower, command, follow_logs
from .dead_letters import dead_letters, forget_dead_letter
from .fanout import FanOut, JobSpec, fan_out, live_devices
from .handle import JobHandle, Report, Summary
from .sweep import Sweep, SweepSummary, grid, sweep
from .waiting import WaitingJob, fair_share, waiting

__all__ = [
    "FanOut",
    "FleetClient",
    "JobHandle",
    "JobSpec",
    "LogFollower",
    "Report",
    "Summary",
    "Sweep",
    "SweepSummary",
    "WaitingJob",
    "command",
    "dead_letters",
    "fan_out",
    "follow_logs",
    "forget_dead_letter",
    "grid",
    "live_devices",
    "sweep",
    "fair_share",
    "waiting",
]
