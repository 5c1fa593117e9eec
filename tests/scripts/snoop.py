"""Looks for the fleet's keys wherever a job could find them, and tries every one it finds.

tests/test_security.py runs it twice: as a ``@job`` (``snoop`` in tests/fleet_jobs.py calls
:func:`scan`) and as a command (``python snoop.py NEEDLES_FILE``, which reports on its events pipe; the needles come in a
file, read and closed before the scan, so that its own arguments do not hold them).
``needles`` are the fleet's secrets, which the test knows (its Redis URL and password): the scan
says where it found any of them, and which Redis URL it found and could reach. No devicefleet
import, no Redis client: a raw socket speaks RESP.
"""

import json
import os
import re
import socket
import stat
import sys
from urllib.parse import unquote, urlsplit

#: What a Redis URL looks like, in any text.
URL = re.compile(r"(?:rediss?|sentinel|unix)://[^\s\x00'\"]+")


def _read(path):
    try:
        with open(path, "rb") as handle:
            return handle.read(1 << 20).decode(errors="replace"), None
    except OSError as exc:
        return None, type(exc).__name__


def _texts():
    """Every text a job can read without searching the disk: its environment and arguments, its
    own and its parent's ``/proc`` environ and cmdline, its open descriptors' targets and, for
    regular files, their contents. Also what it could not read, and why."""
    texts = {"os.environ": "\n".join(f"{k}={v}" for k, v in os.environ.items()), "sys.argv": " ".join(sys.argv)}
    closed = {}
    for pid, who in ((os.getpid(), "self"), (os.getppid(), "parent")):
        for name in ("environ", "cmdline"):
            text, error = _read(f"/proc/{pid}/{name}")
            if text is None:
                closed[f"/proc/{who}/{name}"] = error
            else:
                texts[f"/proc/{who}/{name}"] = text
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        texts[f"fd {fd} -> {target}"] = target
        try:
            if stat.S_ISREG(os.fstat(int(fd)).st_mode):
                texts[f"fd {fd} content"] = os.pread(int(fd), 1 << 20, 0).decode(errors="replace")
        except OSError:
            pass
    return texts, closed


def _reach(url):
    """Whether the Redis at ``url`` answers PING with the URL's password."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), timeout=2) as conn:
            if parts.password:
                auth = unquote(parts.password).encode()
                conn.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(auth), auth))
            conn.sendall(b"*1\r\n$4\r\nPING\r\n")
            return b"+PONG" in conn.recv(256) + conn.recv(256)
    except (OSError, ValueError):
        return False


def scan(needles):
    """``{"pid", "ppid", "found": [where a needle was], "urls": [Redis URLs seen], "reached":
    [those that answered], "closed": {what could not be read: why}, "read": [what was read]}``."""
    texts, closed = _texts()
    found = sorted(where for where, text in texts.items() if any(n and n in text for n in needles))
    urls = sorted({match for text in texts.values() for match in URL.findall(text)})
    return {"pid": os.getpid(), "ppid": os.getppid(), "found": found, "urls": urls,
            "reached": [url for url in urls if _reach(url)], "closed": closed, "read": sorted(texts)}


if __name__ == "__main__":
    with open(sys.argv[1]) as needles_file:
        needles = json.load(needles_file)
    report = scan(needles)
    with open(os.environ["DEVICEFLEET_EVENTS"], "w") as events:
        events.write(json.dumps({"output": {"snoop": report}}) + "\n")
