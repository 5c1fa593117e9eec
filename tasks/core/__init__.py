"""The shared core: settings, errors, devices, queues, the Celery app and its transport and
result backend, typed records and every Redis key. Every other layer imports from here."""
