"""What the launcher starts to watch the fleet: Flower and the Prometheus exporter.

:class:`FleetMonitor` is the launcher's one hook: it starts both (each optional) before the
workers, reports their URLs for ``fleet.json`` and ``devicefleet status``, and stops them.
"""

from __future__ import annotations

import logging
from typing import Any

from ..core.settings import Settings
from .exporter import MetricsExporter
from .flower import FlowerProcess

logger = logging.getLogger(__name__)


class FleetMonitor:
    """Flower (``flower=True``) and the metrics exporter (``metrics=True``) of one fleet."""

    def __init__(self, settings: Settings, redis_url: str, *, flower: bool, metrics: bool,
                 extra_env: dict[str, str] | None = None) -> None:
        self.flower = (
            FlowerProcess(redis_url, settings.state_dir, port=settings.flower_port, extra_env=extra_env)
            if flower else None
        )
        self.exporter = MetricsExporter(redis_url, port=settings.metrics_port) if metrics else None

    def start(self) -> FleetMonitor:
        """Start both; on failure, stop what started and re-raise (FlowerError)."""
        try:
            if self.exporter is not None:
                self.exporter.start()
            if self.flower is not None:
                self.flower.start()
        except BaseException:
            self.stop()
            raise
        return self

    def describe(self) -> dict[str, Any]:
        """URLs (never the password) for the fleet file: ``flower_url``, ``flower_auth_file``,
        ``metrics_url``; a key is absent when its part does not run."""
        out: dict[str, Any] = {}
        if self.flower is not None:
            out["flower_url"] = self.flower.url
            out["flower_auth_file"] = str(self.flower.auth_file) if self.flower.auth_file else None
        if self.exporter is not None:
            out["metrics_url"] = self.exporter.url
        return out

    def stop(self) -> None:
        if self.flower is not None:
            self.flower.stop()
        if self.exporter is not None:
            self.exporter.stop()
