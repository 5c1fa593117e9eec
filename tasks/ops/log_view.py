"""Commands' output, as people see it: each line as it comes, after its device.

``devicefleet run -- python train.py`` prints ``[cpu0] epoch 3 loss 0.21`` while the command
runs (:func:`tasks.producer.commands.follow_logs`); the lines are the command's own, printed as
they are (no markup), and kept whole in each device's artifacts folder.
"""

from __future__ import annotations

import time
from typing import Any, TextIO

from ..producer.commands import follow_logs


def print_logs(handle: Any, timeout: float | None, out: TextIO, err: TextIO) -> None:
    """Print the lines of ``handle``'s commands until every device is done (or ``timeout``
    seconds passed): stdout's lines on ``out``, stderr's on ``err``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    width = max(len(device) for device in handle.devices)

    def done() -> bool:
        return handle.ready() or (deadline is not None and time.monotonic() > deadline)

    for device, stream, line in follow_logs(handle, until=done):
        target = err if stream == "err" else out
        target.write(f"[{device:>{width}}] {line}\n")
        target.flush()
