"""The producer side: sending jobs to the fleet and collecting their entries."""

from . import sent_at  # noqa: F401  (stamps each published message with its send time)
from .fanout import FanOut, JobSpec, fan_out, live_devices
from .sweep import Sweep, SweepSummary, grid, sweep

__all__ = ["FanOut", "JobSpec", "Sweep", "SweepSummary", "fan_out", "grid", "live_devices", "sweep"]
