"""The worker side: a device worker's bootstep and everything it runs (jobs, leases, heartbeat,
the OOM guard, the stop handlers, progress and accounting). Loaded by Celery workers only."""
