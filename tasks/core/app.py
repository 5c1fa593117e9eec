"""The Celery app: Redis as broker and result backend, JSON only, late acks.

``create_app(settings)`` builds an app for explicit settings (tests, the launcher, several
fleets in one process). The module-level ``tasks.app`` reads :class:`Settings` lazily, the first
time Celery needs its configuration, so ``celery -A tasks worker`` and producers that set
``DEVICEFLEET_REDIS_URL`` late both work; either way the settings are read once, at that edge.

A worker of a devicefleet app is a device worker: the app names its bootsteps
(:mod:`tasks.worker.steps`) by import path, as Celery names its own components, so that
producers that import this module never load the worker side.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from celery import Celery
from kombu import Queue

from .defaults import BACKEND_HEALTH_CHECK_INTERVAL_S, BACKEND_MAX_RETRIES, REDIS_OUTAGE_RETRY_POLICY
from .errors import NoFleetError
from .keys import OPTIONS_HEADER, SIGNATURE_HEADER
from .queues import QueueName
from .sentinel import Replication, SentinelURL, disconnect_pool, is_sentinel
from .settings import Settings, check_sender
from .transport import NO_FLEET_OPTION, REPLICATION_OPTION
from .users import denial, job_signature, owned_task_id

logger = logging.getLogger(__name__)

#: The worker's bootsteps, one per service of a device worker (their ``requires`` order them),
#: and the consumer's step that marks it ready.
WORKER_STEPS = tuple(f"tasks.worker.steps:{step}" for step in (
    "DeviceStep", "JobProcessesStep", "SlotsStep", "RegistryStep", "HealthStep", "LeaseStep", "ReaperStep", "PreemptionStep",
    "CancelRelayStep", "AclUsersStep", "ServiceStep",
    "JobsStep", "GroupsStep", "StopHandlersStep",
))
CONSUMER_STEP = "tasks.worker.steps:ConsumerReadyStep"
#: The worker's consumer: Celery's, answering a task outside the allowlist as UnknownJob.
CONSUMER = "tasks.worker.consumer:FleetConsumer"
#: Celery's ``<backend class>+<url>`` form picks the backend class for the URL.
BACKEND = "tasks.core.backend:FleetBackend"
#: The broker transport, and the pair an app uses when it finds no fleet (see below).
TRANSPORT = "tasks.core.transport:Transport"
#: The pair a ``sentinel://`` fleet uses: kombu's and Celery's Sentinel classes, hardened alike.
SENTINEL_TRANSPORT = "tasks.core.transport:SentinelTransport"
SENTINEL_BACKEND = "tasks.core.backend:FleetSentinelBackend"
#: The app's setting that keeps the fleet's URL as the user gave it (a Sentinel URL's broker
#: URL is kombu's form, without the options): what the fleet's own clients connect to.
FLEET_URL_OPTION = "devicefleet_redis_url"
NO_FLEET_TRANSPORT = "tasks.core.transport:NoFleetTransport"
NO_FLEET_BACKEND = "tasks.core.backend:NoFleetBackend"
#: A URL that names no reachable host: only ever used with the no-fleet transport and backend.
NO_FLEET_URL = "redis://no-fleet.invalid/0"


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings derived from ``settings``.

    Raises:
        NoFleetError: no Redis URL is set and no local fleet runs.
    """
    url = settings.resolve_redis_url()
    config = {
        FLEET_URL_OPTION: url,
        REPLICATION_OPTION: settings.replication(url).to_dict(),
        "broker_url": url,
        "result_backend": f"{BACKEND}+{url}",
        # JSON only: a pickle payload is refused by workers and producers alike.
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # A job is acknowledged once it has finished, and a worker process holds one message
        # at a time, so a crash never swallows queued work.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        # A plain `celery -A tasks worker -n cpu0@%h` runs like `devicefleet worker cpu0` with the
        # default cpu.toml: one job at a time on a thread (Celery's CLI maps its default prefork
        # to this setting). prefork is not supported: see tasks/core/worker_config.py.
        "worker_pool": "threads",
        "worker_consumer": CONSUMER,
        "worker_concurrency": 1,
        # Events feed Flower (producers' task-sent only if asked); extended results keep the
        # task name, args and worker.
        "worker_send_task_events": True,
        "task_send_sent_event": settings.sent_events,
        "result_extended": True,
        "task_track_started": True,
        "result_expires": settings.result_expires_s,
        "task_queues": [Queue(name.value) for name in QueueName],
        "task_default_queue": QueueName.FLEET.value,
        "broker_connection_retry_on_startup": True,
        # Redis may restart under a running fleet (README "Reliability"): workers reconnect,
        # result writes and reads retry instead of failing, and a waiting producer's pub/sub
        # connection is checked and re-made.
        # kombu's Redis transport, hardened: a malformed message is dropped, not fatal.
        "broker_transport": TRANSPORT,
        "broker_connection_retry": True,
        "broker_connection_max_retries": None,
        "result_backend_always_retry": True,
        "result_backend_max_retries": BACKEND_MAX_RETRIES,
        # A producer waiting on results re-makes its pub/sub connection under this policy.
        # Celery's default (20 tries, 1 s apart) gave up during a Redis restart of `devicefleet
        # up` ("Retry limit exceeded ... The Celery application must be restarted"): two minutes.
        "result_backend_transport_options": {"retry_policy": REDIS_OUTAGE_RETRY_POLICY},
        "redis_retry_on_timeout": True,
        "redis_socket_keepalive": True,
        "redis_backend_health_check_interval": BACKEND_HEALTH_CHECK_INTERVAL_S,
        "worker_redirect_stdouts": False,
        "enable_utc": True,
    }
    if is_sentinel(url):
        config.update(sentinel_config(SentinelURL.parse(url), settings.replication(url)))
    return config


def sentinel_config(sentinel: SentinelURL, replication: Replication) -> dict[str, Any]:
    """What a ``sentinel://`` fleet changes in :func:`celery_config`: kombu's URL form for the
    broker and the backend, the Sentinel transport and backend, and the options they take apart
    from the URL (the master's name, the sentinels' password)."""
    options = sentinel.transport_options()
    return {
        "broker_url": sentinel.kombu_url(),
        "broker_transport": SENTINEL_TRANSPORT,
        "broker_transport_options": {**options, REPLICATION_OPTION: replication.to_dict()},
        "result_backend": f"{SENTINEL_BACKEND}+{sentinel.kombu_url()}",
        "result_backend_transport_options": {**options, "retry_policy": REDIS_OUTAGE_RETRY_POLICY},
        # A publish retries through a failover (the sentinels' down-after time and an election,
        # seconds) instead of Celery's default three tries 0.2 s apart.
        "task_publish_retry_policy": REDIS_OUTAGE_RETRY_POLICY,
    }


def lazy_celery_config(settings: Settings) -> dict[str, Any]:
    """:func:`celery_config` for the app ``celery -A tasks`` loads: with no fleet to find, the
    app still loads (``celery -A tasks report`` works offline) and every connection fails at
    once with the one-line :class:`NoFleetError` (``celery -A tasks inspect active``)."""
    try:
        return celery_config(settings)
    except NoFleetError as exc:
        config = celery_config(settings.model_copy(update={"redis_url": NO_FLEET_URL}))
        config.update({
            "broker_transport": NO_FLEET_TRANSPORT,
            "broker_transport_options": {NO_FLEET_OPTION: str(exc)},
            "result_backend": f"{NO_FLEET_BACKEND}+{NO_FLEET_URL}",
            NO_FLEET_OPTION: str(exc),
        })
        return config


def redis_url_of(app: Celery) -> str:
    """The Redis URL ``app`` talks to, for the fleet's own reads (the registry).

    Raises:
        NoFleetError: the app found no fleet (see :func:`lazy_celery_config`).
    """
    no_fleet = app.conf.get(NO_FLEET_OPTION)
    if no_fleet:
        raise NoFleetError(str(no_fleet))
    return str(app.conf.get(FLEET_URL_OPTION) or app.conf.broker_url)


class FleetCelery(Celery):
    """A Celery app configured from devicefleet :class:`Settings`, read once."""

    #: Its broker connections keep the fleet's transport when kombu fails over to the next
    #: sentinel (:class:`tasks.core.transport.FleetConnection`).
    amqp_cls = "tasks.core.transport:FleetAMQP"

    def __init__(self, settings: Settings | None = None, *, main: str = "devicefleet") -> None:
        # Never Celery's current app: a process with an app of its own that imports tasks keeps
        # its own current_app (its shared_task.delay() goes through it). `celery -A tasks` and the
        # fleet's entry points name this app; Celery's worker makes it current in its process.
        super().__init__(main, set_as_current=False)
        self._fleet_settings = settings
        self._backends: weakref.WeakSet[Any] = weakref.WeakSet()
        #: What :meth:`close` calls first (:meth:`on_close`).
        self._closing: list[Callable[[], None]] = []
        if settings is None:
            # A promise: evaluated when the configuration is first read, not at import.
            self.add_defaults(lambda: lazy_celery_config(self.fleet_settings))
        else:
            self.conf.update(celery_config(settings))
        self.steps["worker"].update(WORKER_STEPS)
        self.steps["consumer"].add(CONSUMER_STEP)

    @property
    def fleet_settings(self) -> Settings:
        """The settings this app was made from (loaded from the environment on first use).

        Raises:
            ConfigError: a setting in the environment is invalid.
        """
        if self._fleet_settings is None:
            self._fleet_settings = Settings.load()
        return self._fleet_settings

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, countdown: Any = None,
                  eta: Any = None, task_id: str | None = None, **options: Any) -> Any:
        """Celery's, but a job this app sends with a user's credentials (:mod:`tasks.core.users`)
        gets a task id of that user's (``<uuid>~alice``: its result is a key only she reads) and
        their signature, which the worker checks before it runs or counts the job as theirs.

        Raises:
            CredentialsError: the job names another user than the credentials'.
        """
        headers = options.get("headers")
        job_options = headers.get(OPTIONS_HEADER) if isinstance(headers, dict) else None
        credentials = self.fleet_settings.user_credentials if isinstance(job_options, dict) else None
        if credentials is not None and isinstance(job_options, dict) and isinstance(headers, dict):
            user = check_sender(credentials, job_options.get("user"))
            task_id = task_id or owned_task_id(user)
            options["headers"] = {**headers, SIGNATURE_HEADER: job_signature(credentials.signing_key, task_id, user)}
        try:
            return super().send_task(name, args, kwargs, countdown, eta, task_id, **options)
        except Exception as exc:
            refused = denial(exc, credentials.user if credentials is not None else None)
            if refused is None:
                raise
            raise refused from None

    def _get_backend(self) -> Any:
        # Celery makes a result backend per thread: the app keeps track of them for close().
        backend = super()._get_backend()
        self._backends.add(backend)
        return backend

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when this app closes: the producer's default connections
        (:meth:`tasks.producer.connections.Connections.of`), which the core does not import."""
        self._closing.append(callback)

    def close(self) -> None:
        """Celery's clean-up, with the Redis connections of every result backend this app made
        (one per thread that used it) and the producer's default ones closed now, rather than
        whenever the garbage collector finds them."""
        closing, self._closing = self._closing, []
        for callback in closing:
            callback()
        for backend in list(self._backends):
            backend.closed = True
        self.drop_connections()
        super().close()

    def drop_connections(self) -> None:
        """Disconnect every connection of this app's result backends (and, on Sentinel, their
        connections to the sentinels); each reconnects when next used. For code that was
        interrupted (Ctrl-C's ``KeyboardInterrupt``) while it read results: the interrupt may have
        come between a command and its reply, and redis-py then hands the connection back to its
        pool with the reply unread, for the next command to read as its own."""
        for backend in list(self._backends):
            if "client" in vars(backend):
                disconnect_pool(backend.client.connection_pool)


def create_app(settings: Settings | None = None, *, main: str = "devicefleet") -> FleetCelery:
    """A Celery app for ``settings``; ``None`` reads them from the environment when first needed."""
    return FleetCelery(settings, main=main)


#: The app of ``celery -A tasks ...`` and of producers that name none (``tasks.app``); its
#: settings are read from the environment the first time Celery needs its configuration.
app = create_app()
