"""One producer of the load test: ``python -m tests.load_burst URL PRODUCER FANOUTS``.

Sends FANOUTS fan-outs of ``echo`` to every device at once (a burst), then waits for all of them
and prints one JSON line: ``{"producer": n, "entries": [[value, device, status, worker], ...]}``.
"""

from __future__ import annotations

import json
import sys

from tasks import Settings, create_app, fan_out


def main(url: str, producer: int, fanouts: int) -> None:
    app = create_app(Settings.load(redis_url=url))
    handles = [
        (f"p{producer}-{i}", fan_out("echo", "all", kwargs={"value": f"p{producer}-{i}"}, app=app))
        for i in range(fanouts)
    ]
    entries = []
    for value, handle in handles:
        for device, entry in handle.get(timeout=1800).items():
            got = (entry.get("output") or {}).get("value")
            entries.append([got if got is not None else f"MISSING:{value}", device,
                            entry["status"], entry["worker"]])
    print(json.dumps({"producer": producer, "entries": entries}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
