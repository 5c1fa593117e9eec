"""The worker's kept pack-member threads (tasks.worker.siblings.MemberThreads): pure, no fleet."""

from __future__ import annotations

import threading

import pytest

from tasks.worker.siblings import MemberThreads

pytestmark = pytest.mark.timeout(30)


def _pack(threads: MemberThreads, size: int) -> set[int]:
    """Run ``size`` members that all wait for each other (as a pack's members wait in their room);
    returns the thread idents they ran on."""
    barrier = threading.Barrier(size, timeout=10)
    done = threading.Semaphore(0)
    idents: set[int] = set()
    lock = threading.Lock()

    def member() -> None:
        with lock:
            idents.add(threading.get_ident())
        barrier.wait()  # a member never waits for a thread: all of them run at once
        done.release()

    for _ in range(size):
        threads.run(member)
    for _ in range(size):
        assert done.acquire(timeout=10)
    return idents


def test_a_later_pack_runs_on_the_threads_an_earlier_one_left_and_grows_when_it_must() -> None:
    threads = MemberThreads("test-pack")
    first = _pack(threads, 8)
    assert len(first) == 8 and threads.started == 8
    # the next pack's members reuse the kept threads (their Redis connections stay open) ...
    assert _pack(threads, 8) == first and threads.started == 8
    # ... and a larger pack starts only the threads it lacks
    assert first < _pack(threads, 12) and threads.started == 12


def test_a_thread_idle_past_its_limit_leaves_and_a_member_still_runs() -> None:
    threads = MemberThreads("test-idle", idle_s=0.05)
    _pack(threads, 2)
    left = [t for t in threading.enumerate() if t.name.startswith("test-idle")]
    for thread in left:
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert len(_pack(threads, 2)) == 2 and threads.started == 4
