"""Simulated device attributes for a CPU worker (issue 50's mixed fleet, on a machine with no GPU).

Put this folder on a worker's PYTHONPATH and give ``FAKE_DEVICE_ATTRIBUTES`` a JSON object of
what the device should say it is (``{"device_name": "NVIDIA H100 80GB HBM3",
"compute_capability": "9.0"}``): Python imports this module at start-up in the worker and in each
of its job processes (the job process reports what the device is; ``PYTHONPATH`` and a variable
outside ``DEVICEFLEET_*`` reach it), and :func:`tasks.core.devices.visibility` then gives those
values over torch's. Nothing else changes: the device is still a CPU, runs jobs as one, and
placement reads its record as it reads a GPU's.
"""

from __future__ import annotations

import json
import os

ATTRIBUTES_ENV = "FAKE_DEVICE_ATTRIBUTES"

if os.environ.get(ATTRIBUTES_ENV):
    from typing import Any

    import tasks.core.devices as _devices

    _simulated = json.loads(os.environ[ATTRIBUTES_ENV])
    _seen = _devices.visibility

    def _visibility() -> dict[str, Any]:
        return {**_seen(), **_simulated}

    _devices.visibility = _visibility
