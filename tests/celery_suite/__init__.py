"""Celery's own integration tests, run against devicefleet's transport and result backend (issue 31).

``python3 -m tests.celery_suite`` (``.ci/celery-suite``; the README's Development section):
see :mod:`tests.celery_suite.__main__`.
"""
