"""Every Redis key and message header devicefleet writes, in one place.

Celery's and kombu's own keys (``celery-task-meta-<id>``, ``unacked``, the queue lists) are
theirs; these are devicefleet's. A key that takes an argument is a function.
"""

from __future__ import annotations

#: Every devicefleet key starts with this, so ``redis-cli --scan --pattern 'devicefleet:*'``
#: lists them all.
PREFIX = "devicefleet:"

# -- the registry (tasks.worker.heartbeat writes, tasks.core.registry reads) --------------------

#: Set of the device names that have registered; a member whose record expired is not live.
WORKERS = f"{PREFIX}workers"


def worker(device: str) -> str:
    """A device worker's record (:class:`tasks.core.records.WorkerRecord`, JSON, with a TTL)."""
    return f"{PREFIX}worker:{device}"


def job_schemas(device: str) -> str:
    """Hash ``{job: JSON schema of its params}`` of a device worker's jobs, written once as it
    joins (beside its record, whose TTL it shares; rewritten if it was lost), for producers to
    check kwargs before sending (:mod:`tasks.core.arguments`)."""
    return f"{PREFIX}job-schemas:{device}"


#: Hash ``{device: DeviceState JSON}`` of every device out of service (drained, quarantined,
#: suspect), no TTL; :mod:`tasks.core.device_state` owns its layout.
DEVICE_STATE = f"{PREFIX}device-state"
#: Hash ``{"<device>:<xid>": count}``: the Xid events each device's health service saw
#: (:mod:`tasks.worker.health`), no TTL; the exporter's ``devicefleet_device_xid_total``.
XID_COUNTS = f"{PREFIX}xid-counts"

#: Prefix of :func:`fast_failures` (the failed-fast script names other devices' windows by it).
FAST_FAILURES_PREFIX = f"{PREFIX}fast-failures:"


def queue_ok(queue: str) -> str:
    """Hash ``{device: epoch seconds}``: when each device last ended ok a job of shared queue
    ``queue`` (the store script), the "succeeds elsewhere" of a black hole's evidence
    (:data:`tasks.core.device_state.FAILED_FAST`). TTL: :data:`~tasks.core.defaults.BLACKHOLE_WINDOW_S`."""
    return f"{PREFIX}queue-ok:{queue}"


def fast_failures(device: str) -> str:
    """Sorted set ``{task id: when}`` of the different jobs that failed fast on ``device`` lately
    (:data:`~tasks.core.defaults.BLACKHOLE_WINDOW_S`), none of them on another device; emptied by a
    job that ends ok there. TTL: the window."""
    return f"{FAST_FAILURES_PREFIX}{device}"


def fast_failure_errors(device: str) -> str:
    """Hash ``{task id: its error}`` beside :func:`fast_failures`: the evidence a quarantine names."""
    return f"{PREFIX}fast-failure-errors:{device}"


def failed_on(task_id: str) -> str:
    """Hash ``{device: error}`` of the devices job ``task_id`` failed fast on (two: the job's fault).
    TTL: the window."""
    return f"{PREFIX}failed-on:{task_id}"


# -- leases (tasks.worker.lease, .reaper) ----------------------------------------------------------

#: Hash ``{task id: lease record}`` of every job running now, for the reaper.
LEASES = f"{PREFIX}leases"
#: Lock that keeps reaping to one worker at a time (redis-py's ``Lock``).
REAPER_LOCK = f"{PREFIX}reaper:lock"
#: The reaper whose turn it is to look for expired leases (its token), for one interval: one look a
#: fleet, not one a worker (:meth:`tasks.core.jobstate.JobState.expired_on_turn`). TTL: the interval.
REAPER_TURN = f"{PREFIX}reaper:turn"
#: Hash of counts of what the reaper did: ``{"restored": n, "orphans": m}`` (orphans: given back
#: from a live owner that no longer ran them, counted in ``restored`` too), and ``fenced``: the
#: jobs workers reported they stopped themselves, cut off from Redis (no death counted).
REAPER_STATS = f"{PREFIX}reaper:stats"


def lease(task_id: str) -> str:
    """The lease of a running job: a :class:`tasks.core.records.LeaseRecord`, with a TTL."""
    return f"{PREFIX}lease:{task_id}"


def worker_deaths(task_id: str) -> str:
    """List of the workers that died holding a job's lease (``"<worker> pid <pid>"``, oldest
    first), pushed by the reaper or the worker that takes over; it bounds the job's runs
    (:attr:`tasks.core.records.JobOptions.max_attempts`). Expires with the results."""
    return f"{PREFIX}deaths:{task_id}"


def fence(task_id: str) -> str:
    """A job's fencing token: the number of its latest attempt, INCR'd by the take script (it only
    grows); a write of an attempt with an older token is refused (:mod:`tasks.core.jobstate`).
    Expires with the results."""
    return f"{PREFIX}fence:{task_id}"


def fenced(task_id: str) -> str:
    """Set of the workers (``"<worker> pid <pid>"``, as in :func:`worker_deaths`) that stopped a
    job themselves, cut off from Redis (self-fencing), and reported it: their loss of the job is
    no death. Expires with the results."""
    return f"{PREFIX}fenced:{task_id}"


#: Hash ``{task id: dead letter}`` (:class:`tasks.core.records.DeadLetter`, JSON) of the jobs
#: that took their worker down ``max_attempts`` times and are not run again. Kept until forgotten
#: (``tasks.forget_dead_letter``).
DEAD_LETTERS = f"{PREFIX}dead-letters"


def command_log(task_id: str) -> str:
    """Stream of a command's output as it runs (``tasks.jobproc.command`` adds, a producer's
    ``LogFollower`` reads): one entry per batch of lines, field ``lines`` = JSON
    ``[[stream, line], ...]``; capped in length, expires with the job's result."""
    return f"{PREFIX}log:{task_id}"


def progress(task_id: str) -> str:
    """A job's latest progress report (JSON), kept after the job ends (expires with its result)."""
    return f"{PREFIX}progress:{task_id}"


# -- sweeps (tasks.producer.sweep, tasks.producer.optimize) ------------------------------------------


def sweep(sweep_id: str) -> str:
    """A sweep's :class:`tasks.core.records.SweepRecord` (JSON, expires with the results)."""
    return f"{PREFIX}sweep:{sweep_id}"


def sweep_sent(sweep_id: str) -> str:
    """Set of the trial indexes a sweep's producer has sent (a resumed producer sends the rest)."""
    return f"{PREFIX}sweep:{sweep_id}:sent"


def sweep_attached(sweep_id: str) -> str:
    """Set of the workers (node names) that answered the cancel relay's ``add_consumer`` of a
    user's sweep or study queue ``sweep.<sweep_id>`` (:mod:`tasks.worker.cancels`): what her
    producer waits for, as the admin's waits for Celery's replies. Expires after
    :data:`tasks.core.defaults.SWEEP_ATTACHED_TTL_S`."""
    return f"{PREFIX}sweep:{sweep_id}:attached"


#: Prefix of the keys of Optuna's journal storage (``JournalRedisBackend(url, prefix=...)``):
#: one log per study name under it.
OPTUNA_PREFIX = f"{PREFIX}optuna"


# -- distributed jobs (tasks.producer.fanout sends, tasks.worker.gang assembles) -----------------

#: Counter that gives each distributed job and each device group its ``seq`` (its age): one
#: counter, so that gangs and groups are ordered by their sends (:mod:`tasks.core.claims`).
CLAIM_SEQ = f"{PREFIX}claim:seq"
#: Lock held while one gang's ranks are sent: every device's queue has one gang's ranks before
#: the next gang's (redis-py's ``Lock``).
GANG_SEND_LOCK = f"{PREFIX}gang:send-lock"


def gang(gang_id: str) -> str:
    """Hash of a gang's rendezvous: ``gen`` (its generation: how often it restarted),
    ``m:<gen>:<rank>`` (the host of each rank that joined), ``task:<rank>`` and ``token:<rank>``
    (the task id and fencing token of the attempt that last joined as the rank: its peers watch
    its lease), ``done:<rank>`` (the rank's job ended ok: its lease going is no loss),
    ``master:<gen>`` (rank 0's ``address:port``), ``failed`` (why it gave up). Expires with the
    results."""
    return f"{PREFIX}gang:{gang_id}"


def gang_alive(gang_id: str) -> str:
    """Set (with a short TTL) while any rank of the gang waits for the others."""
    return f"{PREFIX}gang:{gang_id}:alive"


def device_claims(device: str) -> str:
    """Sorted set ``{<kind>:<id>: precedence}`` of the gangs and device groups that want
    ``device`` (:class:`tasks.core.claims.Claim`): later work waiting on it gives it up to them."""
    return f"{PREFIX}claims:{device}"


# -- device groups (tasks.worker.group) -----------------------------------------------------------


def group_run(run_id: str) -> str:
    """Hash of one attempt of a device group's job (its leader writes it): ``group`` (the
    group's id), ``job_id``, ``leader``, ``devices`` (comma list), ``seq`` (its age), ``state``
    (``sent``: reserved by its producer, its leader has not taken the message; ``waiting`` |
    ``running``), ``waiting_for`` (JSON ``{device: what it runs}`` while it
    waits), ``since``, and ``closed:<device>`` once that device's worker takes no new single
    job for it: the number of single jobs waiting there. Deleted when the attempt ends; expires with its ``alive`` key's TTL."""
    return f"{PREFIX}group:{run_id}"


def group_alive(run_id: str) -> str:
    """Set, with a short TTL the leader refreshes, while a group's attempt waits or runs: a
    reservation whose key is gone is a dead leader's and is dropped."""
    return f"{PREFIX}group:{run_id}:alive"


def group_hold(device: str) -> str:
    """The group attempt ``device`` is held for: its worker runs nothing else (set by the
    device's worker once it is idle; a leader starts when every device of its group holds it)."""
    return f"{PREFIX}group-hold:{device}"


def group_choice(group_id: str) -> str:
    """Why a device group got its devices (``gpu0+gpu1: NVLink``), written by the producer that
    chose them (:func:`tasks.core.groups.choose_groups`) and shown by ``devicefleet status``;
    expires with the job's result."""
    return f"{PREFIX}group:{group_id}:choice"


def group_nudge(device: str) -> str:
    """List that wakes ``device``'s group keeper (it waits on it with ``BLPOP``): pushed to, with
    a short TTL, by whatever changed the device's reservations or, on the device's own worker, a
    job that left its closed gate (:mod:`tasks.core.group_reservation`)."""
    return f"{PREFIX}group-nudge:{device}"


def group_wake(run_id: str) -> str:
    """List that wakes a waiting group attempt's leader (``BLPOP``): a keeper pushes to it, with a
    short TTL, when it holds its device for the attempt. Deleted when the attempt ends."""
    return f"{PREFIX}group:{run_id}:wake"




# -- throughput counters (tasks.core.jobcount's records: the store script writes, the exporter reads)

#: Set of the devices that have counters.
STATS_DEVICES = f"{PREFIX}stats-devices"


def stats(device: str) -> str:
    """Hash of a device's counters: ``jobs_ok``, ``jobs_error``, ``busy_seconds``, metrics."""
    return f"{PREFIX}stats:{device}"


def finished(device: str) -> str:
    """Sorted set ``{task id: finish time}`` of a device's recent jobs, for jobs/s."""
    return f"{PREFIX}finished:{device}"


# -- preemption (tasks.worker.preemption) -------------------------------------------------------


def preempt_claims(queue_list: str) -> str:
    """Sorted set of the claims on the messages waiting in one queue list (a level's list of a
    queue, ``cpu:urgent``): ``{job id: expiry}``, one per job asked to make way for that list's
    work; a worker preempts a job only while there are fewer claims than messages waiting."""
    return f"{PREFIX}preempt-claims:{queue_list}"


# -- fair share between users (tasks.core.fairshare) -----------------------------------------------

#: Hash ``{user: first seen}`` (Redis time, epoch seconds) of every user who sent a job, ever
#: (``devicefleet status``, the exporter, a purge). Written by the publish script; no hot path
#: reads it (a worker reads :func:`waiting_users`).
USERS = f"{PREFIX}users"


#: Set of the level lists whose users' lists have been adopted into their waiting users, once a
#: fleet (:data:`tasks.core.fairshare.ADOPT_WAITING`: lists written before the waiting sets).
WAITING_ADOPTED = f"{PREFIX}waiting-adopted"


def waiting_users(queue_list: str) -> str:
    """Sorted set ``{user: when added}`` (Redis time) of the users whose list beside level list
    ``queue_list`` (``cpu:batch``) may hold messages: added by the publish script, a user taken
    out by a worker's read once her list there is empty (:data:`tasks.core.fairshare.WAITING_READ`).
    A worker names the lists of these users only, never of every user ever seen."""
    return f"{PREFIX}waiting-users:{queue_list}"


def wake(queue: str) -> str:
    """List of one queue's (``cpu``) wake marks: the name of a user's list that got a message
    while her place in :func:`waiting_users` was new (a worker's read may not name it yet). Every
    worker of the queue names it last in its poll; one that pops a mark for a list it does not
    name reads the users again at once (:mod:`tasks.core.fairshare`)."""
    return f"{PREFIX}wake:{queue}"
#: Hash ``{user: "<device-seconds> <epoch seconds>"}``: each user's usage, decayed to that time
#: (read decayed to now). Written by the store script at each job's end.
USAGE = f"{PREFIX}usage"
#: Hash ``{"<level>:<user>": device-seconds}``: every job's device-seconds, by level and user,
#: never decayed (Prometheus' ``devicefleet_user_device_seconds``).
USER_SECONDS = f"{PREFIX}user-seconds"


# -- caps on the devices a user or team holds at once (tasks.core.caps) -------------------------

#: Hash ``{"user:<name>" | "team:<name>": Cap JSON}``: each cap an admin set (``devicefleet cap
#: set``), read by the take script (:data:`tasks.core.jobscripts.TAKE`) at each lease it hands out.
CAPS = f"{PREFIX}caps"
#: Hash ``{"<user> <kind> held|busy": seconds}``: the device-seconds each user's jobs held devices
#: of a kind, and kept them busy (where measured), ever (Prometheus). Written by the store script
#: at each job's end (:data:`tasks.core.fairshare.USAGE_LUA`); read by :mod:`tasks.ops.usage`.
USAGE_TOTALS = f"{PREFIX}usage-totals"


def usage_day(day: int | str) -> str:
    """Hash ``{"<hour> <user> <kind> held|busy": seconds}`` of the jobs that ended on ``day``
    (epoch seconds // 86400; ``""``: the prefix the store script adds the day to), by the hour
    they ended in (epoch seconds, a multiple of 3600): ``devicefleet usage --since``. Kept
    :data:`tasks.core.defaults.USAGE_KEEP_DAYS` days."""
    return f"{PREFIX}usage-day:{day}"


#: List of the take script's grants to a capped user or team, oldest first: each a
#: :class:`tasks.core.caps.CapGrant` JSON with the count that grant made (audited, not sampled);
#: trimmed to :data:`tasks.core.defaults.CAP_AUDIT_KEEP`.
CAP_AUDIT = f"{PREFIX}cap-audit"


def wait_times(level: str) -> str:
    """Hash of the wait-time histogram of ``level`` (from a job's send to its start): ``le:<bound>``
    (jobs whose wait fell in that bucket, ``le:+Inf`` past the last), ``count``, ``sum``."""
    return f"{PREFIX}wait:{level}"


# -- message headers ------------------------------------------------------------------------------

#: Header every producer stamps with the send time, for the oldest waiting message's age.
SENT_AT_HEADER = "devicefleet_sent_at"
#: Header carrying a job's :class:`tasks.core.records.JobOptions` (beside its kwargs).
OPTIONS_HEADER = "devicefleet_options"
#: Header of a preempted job's message sent back to its queue: how many times it was preempted
#: (absent: never). Its entry's ``preemptions``.
PREEMPTIONS_HEADER = "devicefleet_preemptions"
#: Header of a message to put at the front of its queue's list (the next one popped) instead of
#: the back: a preempted job keeps its place among its level. The transport takes it off the
#: message as it pushes it (:meth:`tasks.core.transport.HardenedChannel._put`): never stored.
FRONT_HEADER = "devicefleet_front"
#: Key of the error entry inside a failed job's stored exception (tasks.core.backend).
ENTRY_FIELD = "devicefleet_entry"


# -- users and their credentials (tasks.core.users; issue 49) -----------------------------------

#: Hash ``{user: FleetUser JSON}`` of the users a fleet admin added (``devicefleet user add``),
#: with the key each one's producer signs its jobs with. Outside :data:`PREFIX` on purpose: a
#: user's read-only pattern over the fleet's keys (``%R~devicefleet:*`` parts) never reaches it;
#: only the admin (default) user, the workers, reads it.
FLEET_USERS = "devicefleet-admin:users"
#: Header of a job sent with a user's credentials: ``HMAC-SHA256(user's key, "<task id> <user>")``
#: in hex, which the worker checks before it counts or runs the job as that user.
SIGNATURE_HEADER = "devicefleet_signature"
#: List of the cancel requests of users (:class:`tasks.core.users.CancelRequest`, JSON): a user
#: may only push to it (``LPUSH``); a worker's cancel relay pops them, checks each is signed by the
#: user whose job it names, and sends Celery's revoke with the fleet's own credentials.
CANCEL_REQUESTS = f"{PREFIX}cancel-requests"
