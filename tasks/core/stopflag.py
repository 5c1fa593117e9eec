"""A stop flag that a signal handler may set: :class:`StopFlag`.

``threading.Event.set`` takes the lock that ``Event.wait`` holds on its way in and out of each
wait, and Python runs a signal handler on the main thread between any two bytecodes: a handler
that sets an event which the main thread is waiting on can land inside that ``wait``, lock held,
and then waits for ever on its own thread (the :mod:`signal` docs: "Synchronization primitives
such as threading.Lock should not be used within signal handlers"). ``devicefleet up`` did so,
one SIGTERM in many, and a second signal only deadlocked again. Here ``set`` writes a byte to a
pipe and ``wait`` selects on it: no lock anywhere.
"""

from __future__ import annotations

import os
import select


class StopFlag:
    """A flag set once, for ever (``set``, ``is_set`` and ``wait`` as ``threading.Event``'s), which a
    signal handler may set, and any thread may wait on or set."""

    def __init__(self) -> None:
        self._set = False
        self._read, self._write = os.pipe()  # not inherited by children (PEP 446)
        os.set_blocking(self._write, False)

    def set(self) -> None:
        if not self._set:
            self._set = True
            os.write(self._write, b"!")  # the pipe stays readable: every wait, now or later, returns

    def is_set(self) -> bool:
        return self._set

    def fileno(self) -> int:
        """Readable once the flag is set: a thread may ``select`` on it beside its own sockets."""
        return self._read

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the flag is set, waiting up to ``timeout`` seconds (None: until it is)."""
        if not self._set:
            select.select([self._read], [], [], timeout)  # a handler's set() in between wakes it
        return self._set

    def __del__(self) -> None:
        os.close(self._read)
        os.close(self._write)
