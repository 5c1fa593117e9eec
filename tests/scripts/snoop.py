"""Looks for the fleet's keys wherever a job could find them, and tries every one it finds.

Where it looks: its own environment and arguments, its own and its parent's ``/proc`` environ
and cmdline, its open descriptors, the files it is asked to read (a deployed host's environment
files), and the ``/proc`` environ and cmdline of every other process of its user that it can
see (the launcher, Flower, the exporter, the other workers and their job processes).

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


def _files(paths):
    """The contents of ``paths`` it could read, and why it could not read the others."""
    texts, closed = {}, {}
    for path in paths:
        text, error = _read(path)
        if text is None:
            closed[f"file {path}"] = error
        else:
            texts[f"file {path}"] = text
    return texts, closed


def _other_processes():
    """Every other process of this user it can see: ``({pid: {"name", "environ", "cmdline"}},
    {"/proc/PID/environ (name)": text})``, each of environ and cmdline ``"read"`` or why not."""
    seen, texts = {}, {}
    mine = {os.getpid(), os.getppid()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != os.getuid():
                continue
        except OSError:
            continue  # gone
        name = (_read(f"/proc/{entry}/comm")[0] or "?").strip()
        seen[entry] = {"name": name}
        for what in ("environ", "cmdline"):
            text, error = _read(f"/proc/{entry}/{what}")
            seen[entry][what] = error or "read"
            if text is not None:
                texts[f"/proc/{entry}/{what} ({name})"] = text
    return seen, texts


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


def scan(needles, paths=()):
    """``{"pid", "ppid", "found": [where a needle was], "urls": [Redis URLs seen], "reached":
    [those that answered], "closed": {what could not be read: why}, "read": [what was read],
    "processes": {pid: {"name", "environ", "cmdline"}}}``.

    ``urls`` come from what is its own (environment, arguments, parent, descriptors, ``paths``);
    other processes of its user are searched for the ``needles`` only (on a shared machine, one
    user's other fleets are not this fleet's business)."""
    texts, closed = _texts()
    more, unread = _files(paths)
    texts.update(more)
    closed.update(unread)
    processes, others = _other_processes()
    found = sorted(where for where, text in {**texts, **others}.items() if any(n and n in text for n in needles))
    urls = sorted({match for text in texts.values() for match in URL.findall(text)})
    return {"pid": os.getpid(), "ppid": os.getppid(), "found": found, "urls": urls,
            "reached": [url for url in urls if _reach(url)], "closed": closed, "read": sorted(texts),
            "processes": processes}


if __name__ == "__main__":
    with open(sys.argv[1]) as needles_file:
        needles = json.load(needles_file)
    report = scan(needles)
    with open(os.environ["DEVICEFLEET_EVENTS"], "w") as events:
        events.write(json.dumps({"output": {"snoop": report}}) + "\n")
