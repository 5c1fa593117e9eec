"""tasks.core.stopflag: a stop flag that a signal handler sets without a lock.

`devicefleet up` set a threading.Event from its SIGTERM handler while its main thread waited on
that event every half second (Fleet.supervise): a handler that ran inside Event.wait, whose lock
that thread then held, waited on it for ever ("SIGTERM: stopping the fleet" and nothing more: the
stop of tests/test_packaging.py's `up`, once in a suite run on a loaded host)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from tasks.core.stopflag import StopFlag

#: Rounds of a timer signal that sets a fresh flag while the main thread waits on it with no pause
#: between waits, so that the handler often lands inside a wait; FLAG=threading.Event hangs in
#: most runs of it.
SIGNAL_ROUNDS = '''
import os, signal, threading
from tasks.core.stopflag import StopFlag
make = threading.Event if os.environ.get("FLAG") == "threading.Event" else StopFlag
for _ in range(300):
    flag = make()
    signal.signal(signal.SIGALRM, lambda *_: flag.set())
    signal.setitimer(signal.ITIMER_REAL, 0.0005)
    while not flag.wait(0):
        pass
print("done")
'''


def test_a_signal_handler_that_sets_the_flag_inside_its_wait_never_hangs() -> None:
    done = subprocess.run([sys.executable, "-c", SIGNAL_ROUNDS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr


def test_the_flag_waits_as_an_event_does() -> None:
    flag = StopFlag()
    started = time.monotonic()
    assert flag.wait(0.2) is False and not flag.is_set()
    assert time.monotonic() - started >= 0.19
    threading.Timer(0.1, flag.set).start()  # set on another thread: a waiter wakes at once
    started = time.monotonic()
    assert flag.wait(30) is True and time.monotonic() - started < 10
    assert flag.wait() is True and flag.wait(0) is True and flag.is_set()  # set for good
    flag.set()  # again: nothing more
    assert flag.wait(0)
