"""The producer side: sending jobs to the fleet and collecting their entries."""

from . import sent_at  # noqa: F401  (stamps each published message with its send time)
from .dead_letters import dead_letters, forget_dead_letter
from .fanout import FanOut, JobSpec, fan_out, live_devices
from .sweep import Sweep, SweepSummary, grid, sweep

__all__ = [
    "FanOut",
    "JobSpec",
    "Sweep",
    "SweepSummary",
    "dead_letters",
    "fan_out",
    "forget_dead_letter",
    "grid",
    "live_devices",
    "sweep",
]
