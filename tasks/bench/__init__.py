"""``devicefleet bench``: the fleet measured against what users would do instead, in one run.

- :mod:`.dispatch`: the fleet's own cost per fan-out and per job (no-op jobs);
- :mod:`.efficiency`: K equal CPU-bound jobs on K devices vs. one after another and vs. the
  plain ``multiprocessing`` + ``Manager().dict()`` pattern;
- :mod:`.pipeline`: the wait for the next batch (sequential, multiprocessing + Queue, the
  ``train`` job's DataLoader);
- :mod:`.gpu`: on a CUDA host, the ``train`` job's GPU busy fraction and a cpu+gpu fan-out;
- :mod:`.commands`: a program run as a command job against the same started directly, and how
  soon the producer sees the lines it prints;
- :mod:`.isolation`: a job that crashes its process, or hangs and is cancelled, and the
  device's next job (with the misbehaving jobs of :mod:`.misbehave`, allowlisted there only);
- :mod:`.report`: the table and the JSON figures.

:func:`tasks.bench.run.run_bench` runs them all against an embedded fleet.
"""
