"""The worker side: a device worker's bootsteps and everything they run (jobs, leases, heartbeat,
the OOM guard, the stop handlers, progress and accounting). Loaded by Celery workers only."""
