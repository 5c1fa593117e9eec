"""What a job leaves on its device decides whether its process runs another (issue 48 item 4):
the pure rule of tasks/jobproc/oom.py, with the release and the reading injected (a real CUDA
context is in tests/test_gpu_issues.py's issue-48 check)."""

from __future__ import annotations

from tasks.core.defaults import MAX_GPU_MEMORY_LEFT_MIB
from tasks.jobproc.oom import MiB, leftover, settle_device

LIMIT = MAX_GPU_MEMORY_LEFT_MIB * MiB


def test_memory_left_allocated_past_the_limit_retires_naming_the_bytes() -> None:
    assert leftover(LIMIT, LIMIT) is None
    reason = leftover(20 * 1024 * MiB, LIMIT)
    assert reason is not None and "20,480 MiB" in reason and "module global" in reason


def test_a_cuda_job_is_released_after_every_job_and_measured() -> None:
    released: list[str] = []
    after = settle_device("cuda:0", failed=False, limit_bytes=LIMIT, release=lambda d: released.append(d) or False,
                          measure=lambda: (20 * 1024 * MiB, 21 * 1024 * MiB))
    assert released == ["cuda:0"]
    assert after.reserved_bytes == 21 * 1024 * MiB and after.error is None
    assert after.retire is not None and "20,480 MiB" in after.retire
    fine = settle_device("cuda:0", failed=False, limit_bytes=LIMIT, release=lambda d: False,
                         measure=lambda: (8 * MiB, 32 * MiB))
    assert fine.retire is None and fine.reserved_bytes == 32 * MiB


def test_a_cpu_job_is_collected_only_after_a_failure_and_never_measured() -> None:
    released: list[str] = []

    def measure() -> tuple[int, int]:
        raise AssertionError("a CPU job's process must not ask CUDA")

    assert settle_device("cpu", failed=False, limit_bytes=LIMIT, release=released.append, measure=measure).retire is None
    assert settle_device("cpu", failed=True, limit_bytes=LIMIT, release=released.append, measure=measure).retire is None
    assert released == ["cpu"]


def test_an_error_while_releasing_is_returned_and_retires_never_raised() -> None:
    def poisoned(device: str) -> bool:
        raise RuntimeError("CUDA error: device-side assert triggered")

    after = settle_device("cuda:0", failed=False, limit_bytes=LIMIT, release=poisoned)
    assert isinstance(after.error, RuntimeError)
    assert after.retire is not None and "device-side assert triggered" in after.retire
    assert after.reserved_bytes is None

    def unreadable() -> tuple[int, int]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    after = settle_device("cuda:0", failed=True, limit_bytes=LIMIT, release=lambda d: False, measure=unreadable)
    assert after.error is not None and "illegal memory access" in str(after.retire)
