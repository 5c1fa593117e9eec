"""The fed-device workload (:mod:`.workload`) fed by Ray (optional extra ``bench``).

Ray tasks produce the batches into Ray's shared-memory object store, ``producers`` in flight at
a time; the consumer takes them in order (``ray.get`` of a numpy array is zero-copy).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

from .workload import Workload, consume, make_batch

logger = logging.getLogger(__name__)


def available() -> bool:
    """Whether Ray is installed (``pip install 'devicefleet[bench]'``)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def wait_ray(work: Workload) -> float | None:
    """Mean wait for the next batch with Ray producers; ``None`` when Ray is not installed.

    Ray tasks run :func:`.workload.make_batch`; :func:`.workload.consume` takes their results.
    """
    if not available():
        return None
    import ray

    def produce(index: int) -> tuple[Any, Any]:
        import torch

        torch.set_num_threads(1)
        x, y = make_batch(index, work)
        return x.numpy(), y.numpy()

    ray.init(num_cpus=work.producers, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        remote = ray.remote(num_cpus=1)(produce)
        total = work.warmup + work.batches

        def batches() -> Iterator[Any]:
            pending: deque[Any] = deque(remote.remote(i) for i in range(min(work.producers, total)))
            sent = len(pending)
            while pending:
                ref = pending.popleft()
                if sent < total:
                    pending.append(remote.remote(sent))
                    sent += 1
                yield ray.get(ref)

        return consume(batches(), total, work.warmup, work.step_s)
    finally:
        ray.shutdown()
