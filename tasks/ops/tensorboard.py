"""Serving the fleet's loss curves: TensorBoard over ``<artifacts>/tensorboard``, on loopback.

Workers write the event files themselves (:mod:`tasks.jobproc.scalars`, with tensorboardX); the
TensorBoard server is only for looking at them, so it is an optional extra:
``pip install 'devicefleet[tensorboard]'``.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

from ..core.errors import MissingExtra

logger = logging.getLogger(__name__)

#: TensorBoard's own default port.
DEFAULT_PORT = 6006


def command(logdir: Path, port: int) -> list[str]:
    """The TensorBoard server's command line, bound to 127.0.0.1 only.

    Raises:
        MissingExtra: the ``tensorboard`` package is not installed.
    """
    if importlib.util.find_spec("tensorboard") is None:
        raise MissingExtra("TensorBoard is not installed: pip install 'devicefleet[tensorboard]' "
                           "(or point any TensorBoard at the log dir: tensorboard --logdir "
                           f"{logdir})")
    return [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
            "--port", str(port)]
