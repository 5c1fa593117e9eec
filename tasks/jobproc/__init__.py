"""The job process: where a device's jobs run, apart from the worker that supervises them.

A device worker (:mod:`tasks.worker.supervisor`) starts ``python -m tasks.jobproc <fd>`` with
the device's visibility in its environment, and talks to it over the socket ``fd``
(:mod:`tasks.core.wire`). The process pins itself to the device's cores, imports torch and the
allowlisted job modules, says hello, then runs the jobs it is sent, one at a time, each from the
environment and working directory it started with (:mod:`tasks.jobproc.runtime`).

It knows nothing of Celery, leases, attempts or restarts, and holds no key to the fleet: no
Redis URL or password reaches it (:mod:`tasks.core.wire`, :mod:`tasks.worker.jobenv`), and what a
job sends out (progress, a command's log lines, a gang's store) goes over the pipe for the worker
to relay. A rank of a distributed job gets its rank, generation and rank 0's address from the
worker's gang (:mod:`tasks.worker.gang`) and runs only its process group and its job
(:mod:`tasks.jobproc.rank`). A job that crashes it, hangs in it or leaks into it costs this
process, which the worker ends and replaces, never the worker.
"""
