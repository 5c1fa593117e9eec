"""Every tunable of devicefleet in one place: its timing budget, retry counts and thresholds.

Each value is spelled here once, with the reason for it; the modules that use one import it from
here, and :class:`~tasks.core.settings.Settings`, :class:`~tasks.core.worker_config.WorkerConfig`
and the wire (:mod:`tasks.core.wire`) take their defaults from here. A setting a user may change
(``DEVICEFLEET_*``, a worker config's key) is named in its comment; the others are constants of
the design. (rq keeps its tunables the same way, in ``rq/defaults.py``; huey in
``huey/consumer_options.py``.) ``tests/test_defaults.py`` fails on a ``*_S = <number>`` constant
defined anywhere else in the package.

Seconds unless the name ends in ``_MS`` (milliseconds). Sections follow who runs the code:
the fleet's Redis, the worker's registry life, the worker and its job processes, a job process,
distributed gangs, producers, the launcher and operations, deployment.
"""

from __future__ import annotations

# -- The fleet's Redis: connections, retries, replication --------------------------------------

#: A registry client (:func:`tasks.core.registry.connect`) gives up connecting after this and
#: checks an idle connection after that (redis-py's ``socket_connect_timeout`` and
#: ``health_check_interval``): a dead Redis is said within seconds, a half-open socket is found
#: before it is used.
REDIS_CONNECT_TIMEOUT_S = 5
REDIS_HEALTH_CHECK_INTERVAL_S = 30
#: The result backend's own idle-connection check (Celery's ``redis_backend_health_check_interval``).
BACKEND_HEALTH_CHECK_INTERVAL_S = 5
#: Tries of a result write or read through a Redis outage (Celery's ``result_backend_max_retries``).
BACKEND_MAX_RETRIES = 60
#: How a result-backend connection retries through a Redis outage: up to 120 tries, at most 1 s
#: apart (kombu's retry_over_time), long enough for `devicefleet up` or systemd to restart Redis.
#: Celery's default (20 tries, 1 s apart) gave up during a Redis restart of ``devicefleet up``.
REDIS_OUTAGE_RETRY_POLICY = {"max_retries": 120, "interval_start": 0, "interval_step": 0.5, "interval_max": 1}
#: How long the fleet's own clients keep retrying a command while a Sentinel failover runs: the
#: sentinels' ``down-after-milliseconds`` (:data:`SENTINEL_DOWN_AFTER_MS`) plus an election (a
#: few seconds), with room to spare. Backoff from :data:`FAILOVER_BACKOFF_S`'s first value to its
#: second (doubling): about 40 s in all.
FAILOVER_RETRIES = 45
FAILOVER_BACKOFF_S = (0.05, 1.0)
#: How long the edges (``devicefleet status``, a worker's start) wait for each sentinel's answer
#: before they say it is unreachable.
SENTINEL_PROBE_TIMEOUT_S = 2.0
#: How long a write waits for its replicas (Redis's WAIT) before the fleet goes on with it not
#: yet replicated (``DEVICEFLEET_REDIS_WAIT_TIMEOUT_MS``): a replica down or slow costs at most
#: this per write.
REDIS_WAIT_TIMEOUT_MS = 1000
#: How long results stay in Redis (``DEVICEFLEET_RESULT_EXPIRES_S``): a day, for a producer that
#: comes back to a fan-out's handle; also a command's output stream and a job's progress.
RESULT_EXPIRES_S = 86_400

# -- A worker's life in the registry: heartbeat, leases, reaper ---------------------------------

#: How often a worker refreshes its registry entry, and how long the entry lives without it
#: (``DEVICEFLEET_HEARTBEAT_INTERVAL_S``, ``DEVICEFLEET_HEARTBEAT_TTL_S``): five beats may be
#: missed (a stalled event loop, a slow Redis) before the worker counts as gone.
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TTL_S = 10.0
#: A running job's lease (renewed every third of it) and how often the fleet looks for the expired
#: leases of dead workers (one worker's reaper a turn) (``DEVICEFLEET_LEASE_TTL_S``, ``DEVICEFLEET_REAPER_INTERVAL_S``): a
#: killed worker's job runs again after about max(lease, heartbeat TTL) + reaper interval,
#: whatever the job's length (Celery's visibility timeout would be an hour: celery#4984, #3501).
LEASE_TTL_S = 10.0
REAPER_INTERVAL_S = 1.0
#: Self-fencing: a worker stops a job whose lease Redis has not confirmed for this fraction of
#: the lease TTL, measured on the worker's monotonic clock from the time the last confirmed
#: renewal was SENT (Redis started the TTL later than that). Renewals go every third of the TTL,
#: so one late or lost renewal is tolerated; the rest of the TTL is the stop's budget (below)
#: and the margin for clock-rate drift between the worker and Redis. It rests on the worker not
#: being paused (SIGSTOP, a VM migration) for longer than that margin.
FENCE_AFTER_TTL = 0.5
#: The part of the lease TTL a self-fenced job has to stop at its ``ctx.progress()`` before its
#: process and children are ended: with :data:`FENCE_AFTER_TTL` it leaves a quarter of the TTL
#: for the kill and the drift.
FENCE_GRACE_TTL = 0.25
#: A running job's updates (busy, progress, idle) are written at most this late: a job shorter
#: than this costs no registry write of its own, and a stream of short jobs one write per period.
HEARTBEAT_COALESCE_S = 0.05
#: A running job's memory samples reach its slot's registry record at most this late.
MEMORY_WRITE_S = 1.0
#: Finish times older than this are dropped from ``keys.finished(device)`` (jobs/s is counted
#: over :data:`RATE_WINDOW_S`; the rest is room for a slow scrape).
FINISHED_KEEP_S = 600.0
#: How long a task event waits in the worker's buffer for others to go out with it (Flower and
#: the monitor see events this much later; a job's result is never delayed by it).
EVENT_FLUSH_S = 0.1

# -- The worker and its job processes (worker configs: ``worker_configs/*.toml``) ---------------

#: Longest job a worker is expected to run when its config does not say (``max_job_seconds``):
#: also a job's time limit unless it sets its own; systemd's stop timeout is derived from it.
MAX_JOB_SECONDS = 3600
#: Seconds a job asked to stop (cancelled, past its time limit, its worker stopping) has to stop
#: at its next ``ctx.progress()`` before its process is ended (``cancel_grace_s``): a training
#: step of a few seconds ends cleanly, a job that never reports is not waited on long.
CANCEL_GRACE_S = 5.0
#: Preemption (:mod:`tasks.worker.preemption`): how often a worker running a job below the top
#: level looks for higher-level work waiting in its queues (one pipelined round trip of LLENs).
PREEMPT_CHECK_S = 0.5
#: Seconds a preempted job has to checkpoint and stop at ``ctx.progress()`` before its process is
#: ended (``preempt_grace_s``): Slurm's ``GraceTime``.
PREEMPT_GRACE_S = 5.0
#: Seconds a worker's claim on a waiting message (:func:`tasks.core.keys.preempt_claims`) outlives
#: the job it preempted: the time its freed slot has to take that message before another worker
#: may preempt a job of its own for it. A claim also lasts at most ``preempt_grace_s`` plus this.
PREEMPT_CLAIM_HOLD_S = 5.0
#: Seconds a job runs before it may be preempted (``preempt_min_run_s``): Slurm's
#: ``PreemptExemptTime``, so that a job makes some progress between two preemptions.
PREEMPT_MIN_RUN_S = 2.0
#: Cores a GPU worker keeps for its data loading when its config does not say (``loader_cores``):
#: PyTorch's usual starting point of 4 DataLoader workers per GPU.
LOADER_CORES = 4
#: Most slots one device may have (``slots``).
MAX_SLOTS = 64
#: Growth of a job process's resident memory, since it was ready, past which it is retired after
#: its job (``max_memory_growth_mib``): a leak is cut before it takes the host.
MAX_MEMORY_GROWTH_MIB = 2048
#: Seconds a new job process has to import torch and the job modules and say hello (a cold
#: ``import torch`` on a loaded host takes tens of seconds).
PROCESS_START_TIMEOUT_S = 120.0
#: Spare job processes kept alive beside one per slot, so a retired one is replaced at once.
SPARE_PROCESSES = 1
#: Idle job processes of users other than the last a device keeps warm beyond its slots and
#: spares (``kept_user_processes``): a job process runs one user's jobs only
#: (:mod:`tasks.worker.owners`), so two users who alternate on a device each find their own warm
#: process; each costs a process's memory (a CUDA context on a GPU), the least recently used
#: goes first. 0: an owned process is retired whenever its spare is needed for another user.
KEPT_USER_PROCESSES = 1
#: How often a running job's watch is asked whether to stop it (also the longest a cancel waits
#: before its stop request goes out).
JOB_POLL_S = 0.05
#: Back-off between failed job-process spawns (doubling, from the first to the second).
RESPAWN_BACKOFF_S = (0.5, 30.0)
#: How long a job process's group has between SIGTERM and SIGKILL.
TERM_GRACE_S = 1.0
#: How long the worker waits, once a job process has gone, for the last lines its output relay
#: reads (for the crash report), and for the process's exit status.
OUTPUT_RELAY_JOIN_S = 1.0
OUTPUT_TAIL_WAIT_S = 0.5
EXIT_STATUS_WAIT_S = 1.0
#: How long a leaving worker waits for its supervisor's thread to end the job processes.
SUPERVISOR_JOIN_S = 5.0
#: How long a stopping worker waits for its job processes, beyond the stop timeout and the
#: cancel grace: room for ending their groups and storing the entries.
STOP_SLACK_S = 5.0
#: How often a running job's memory is sampled. A job shorter than this is never sampled.
MEMORY_SAMPLE_S = 0.25
#: Seconds the forced stop (a second signal) waits for Redis while it puts the running jobs back.
REQUEUE_TIMEOUT_S = 5.0
#: Seconds the MPS control program has to start the daemon or to answer ``quit``.
MPS_CONTROL_TIMEOUT_S = 15.0
#: Seconds a GPU worker's probe of its GPU's UUID may take (a Python child importing torch and
#: starting CUDA on a busy host), before its MPS daemon starts.
MPS_UUID_PROBE_TIMEOUT_S = 120.0

#: Fair share within a level (:mod:`tasks.core.fairshare`): a user's usage (device-seconds) is
#: halved every this many seconds. One hour: long enough that a sweep of many short trials is
#: remembered over its whole run (a user who just had the fleet for ten minutes yields to one who
#: had nothing), short enough that yesterday's work does not count today (after a night, eight
#: half-lives, 1/256 of it is left). Slurm's ``PriorityDecayHalfLife`` defaults to 7 days for a
#: centre's month-long allocations; a team's fleet turns over in hours.
FAIRSHARE_HALF_LIFE_S = 3600.0
#: How long a worker keeps the users' order (who has used least) before reading it again, at the
#: start of its next blocking read: one pipelined round trip at most this often, never per job.
FAIRSHARE_REFRESH_S = 0.5
#: How long after a user joins a queue list's waiting users (:func:`tasks.core.keys.waiting_users`)
#: each of her messages there also leaves a wake mark (:func:`tasks.core.keys.wake`): every idle
#: worker has read the users again by then (its poll's 1 s timeout, then its read), so past it a
#: mark would wake none.
WAKE_WINDOW_S = 2.0
#: The most wake marks one queue keeps (the newest): marks no worker needed (its read named the
#: list already) cost a worker one poll each, so they are bounded.
WAKE_KEEP = 32
#: Bucket bounds (seconds) of the wait-time histogram per level (from send to start).
WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 1800.0, 7200.0)

# -- A GPU's health service (tasks.worker.health, issue 50) -------------------------------------

#: Seconds one NVML call may take before the health service gives up on it and marks the device
#: ``suspect`` (a hung driver call; NVML answers a healthy GPU in milliseconds). The call runs
#: on a thread of its own: the heartbeat and the lease keeper never wait on it.
HEALTH_NVML_TIMEOUT_S = 5.0
#: How long one ``nvmlEventSetWait`` waits for an Xid or ECC event (its own timeout, so the
#: watchdog allows this plus :data:`HEALTH_NVML_TIMEOUT_S`); the loop reads again at once.
HEALTH_EVENT_WAIT_S = 1.0
#: How often the health service reads the GPU's counters (volatile uncorrected ECC errors,
#: retired pages pending, remapped rows pending or failed, the GPU's recovery action).
HEALTH_POLL_S = 10.0
#: Seconds a job on a device that just failed has to stop at ``ctx.progress()`` before its
#: process is ended: short, its GPU is gone (or going) and its work is handed elsewhere.
HEALTH_STOP_GRACE_S = 1.0

# -- A device's service state: drain, quarantine (tasks.worker.service, issue 50) ----------------

#: How often a device worker reads its device's state (``devicefleet device drain``): a drain is
#: obeyed within this (the take script refuses a job at once; this stops the consumer).
DEVICE_STATE_CHECK_S = 0.5
#: A job that fails within this many seconds of run time is a *fast* failure, the mark of a black
#: hole (a device that fails every job at once): a job's own bug usually fails as fast, which is
#: why one device's fast failures count only while other devices end the same work.
BLACKHOLE_FAST_S = 2.0
#: Distinct jobs that must fail fast on one device, none of them failing on another device, before
#: the fleet quarantines it. 3: one or two fast failures are what a buggy trial or two does; three
#: different jobs in a row failing fast on one device while no job fails on two devices is already
#: unlikely from the jobs, and a sweep loses at most 3 runs (none of them an attempt) before the
#: device stops taking work (issue 50's 50 ms device is out after ~150 ms of failures).
BLACKHOLE_K = 3
#: How long a device's window of recent fast failures (and a job's record of the devices it failed
#: on) is kept: fast failures further apart than this are not one black hole.
BLACKHOLE_WINDOW_S = 300
#: How long ``devicefleet device undrain`` waits for its probe job on a device drained for a
#: hardware error (a healthy device answers in well under a second; a GPU's first job loads CUDA).
UNDRAIN_PROBE_TIMEOUT_S = 60.0

# -- A job process ----------------------------------------------------------------------------

#: Progress reports closer together than this are folded into the next one (a few updates a
#: second: a bar moves smoothly, a job reporting every step costs no pipe traffic).
PROGRESS_MIN_INTERVAL_S = 0.25
#: How often the background thread moves buffered scalars into the event file, and how often
#: tensorboardX flushes that file (``flush_secs``): TensorBoard shows a run a few seconds behind.
SCALARS_DRAIN_INTERVAL_S = 1.0
SCALARS_FLUSH_S = 2
#: How often a command's reading loop wakes without output, to look for a stop request or the
#: command's end.
COMMAND_POLL_S = 0.05
#: After a command ends, how long its pipes are read for what is left when something it
#: started still holds them open.
COMMAND_DRAIN_S = 0.5
#: How long what a command left running has between SIGTERM and SIGKILL once it ended, and how
#: long those it killed have to be reaped.
COMMAND_DESCENDANTS_GRACE_S = 0.5
COMMAND_REAP_S = 2.0
#: A command asked to stop gets the job's cancel grace less this (at least
#: :data:`COMMAND_DESCENDANTS_GRACE_S`) before SIGKILL: the job process needs the rest to report.
COMMAND_STOP_MARGIN_S = 1.5
#: How long a command's output lines wait to be sent as one batch; the producer sees a line
#: within about this.
COMMAND_FLUSH_INTERVAL_S = 0.05

# -- Distributed gangs ------------------------------------------------------------------------

#: How often a waiting rank looks at its gang (one pipelined round trip).
GANG_POLL_S = 0.02
#: A waiting rank refreshes its gang's ``alive`` key with this TTL: a gang whose ranks all died
#: while assembling stops holding younger gangs back this long after.
GANG_ALIVE_TTL_MS = 3_000
#: A rank that gave its device up to an older gang (wait-die) comes back after this long.
GIVE_WAY_S = 0.5

# -- Placement (tasks.core.placement) -------------------------------------------------------

#: Times a job from a shared queue is handed back by workers whose devices do not meet its
#: constraints (each after ``GIVE_WAY_S``) before it ends as ``DeviceMismatch``: the producer sends
#: placed work only to matching devices, so this is only reached when every matching device
#: changed or left while it waited.
PLACEMENT_HAND_BACKS = 120

# -- Caps (tasks.core.caps) --------------------------------------------------------------------------

#: Seconds a job refused by its user's (or team's) cap waits before its message is taken again.
CAP_RETRY_S = 0.5
#: Grants kept in the cap audit list (``keys.CAP_AUDIT``): the newest, the rest trimmed.
CAP_AUDIT_KEEP = 10000
#: Days the hourly usage figures are kept (``devicefleet usage --since``; its totals are kept for ever).
USAGE_KEEP_DAYS = 400

# -- Packed trials (tasks.worker.pack) ------------------------------------------------------

#: The most trials one pack may hold (``tasks.sweep(..., pack=K)``), and what ``pack="auto"``
#: takes at most: the job process packs fewer where its memory budget says so.
PACK_MAX = 1024
PACK_AUTO_MAX = 256
#: How long a pack's leader waits for the members it took to take their leases and join it;
#: one still on its way then finds the pack gone and runs alone.
PACK_JOIN_TIMEOUT_S = 10.0
#: How long a pack's job process waits for the worker's answer when it asks for a trial to
#: refill a freed place (the worker takes one from the queue and waits for it to join).
PACK_REFILL_WAIT_S = 15.0
#: A pack's leader goes on taking its queue's trials while they still arrive (a sweep publishes
#: them in a burst, and the leader may take the first before the rest are there): until none
#: came for PACK_GATHER_S, looking every PACK_GATHER_POLL_S, PACK_GATHER_MAX_S at most.
PACK_GATHER_S = 0.1
PACK_GATHER_POLL_S = 0.01
PACK_GATHER_MAX_S = 1.0
#: A pack member's thread on the worker is kept for the next pack's members (its result backend's
#: Redis connection stays open: a fresh thread opens one, about 4 ms a member): until it waited
#: this long for one (tasks.worker.siblings.MemberThreads).
PACK_THREAD_IDLE_S = 300.0
#: How often a running rank's worker looks at its gang (failed, or moved to a new generation:
#: the rank is stopped).
GANG_WATCH_INTERVAL_S = 0.25
#: How often rank 0's job process of a distributed command looks at how many ranks have ended
#: while it keeps the gang's store for them (tasks/jobproc/rank.py).
STORE_POLL_S = 0.05
#: How long a rank whose job raised waits for its worker to fail the gang before it takes its
#: process group down (a worker that does not answer is stuck or gone: the rank goes on).
RANK_FAILED_ASK_S = 10.0
#: A distributed job's defaults (``DistributedOptions``): how many times the whole gang runs
#: again after a rank's worker died, how long a rank waits for the others to start, and how long
#: a collective may wait for a peer (``init_process_group(timeout=...)``, instead of torch's 30
#: minutes: a dead peer's gloo connection fails at once).
GANG_MAX_RESTARTS = 2
GANG_JOIN_TIMEOUT_S = 120.0
GANG_COLLECTIVE_TIMEOUT_S = 120.0
#: How long a producer waits for another producer to finish sending its gang.
GANG_SEND_WAIT_S = 30.0

# -- Device groups (tasks.worker.group) ---------------------------------------------------------

#: How often a waiting group's leader looks at its devices' holds when nothing woke it (a keeper
#: that holds a device for it wakes it at once: :func:`tasks.core.keys.group_wake`), and a single
#: job waiting at a closed gate looks at whether its worker stops.
GROUP_POLL_S = 0.05
#: How often a device worker looks at its device's reservations when nothing nudged it
#: (:func:`tasks.core.keys.group_nudge`: every change of them does): the fallback that drops a
#: dead leader's reservation. Idle, a keeper makes two round trips to Redis this often.
GROUP_KEEPER_POLL_S = 1.0
#: How long the devices a producer reserved as it sent a group stay reserved for it before its
#: leader takes the message (the leader then renews them to a lease's TTL): past it, they take
#: single jobs again and the leader reserves them anew when it takes the message. It bounds how
#: long a group whose producer died before sending it keeps them, and how long they wait idle
#: for a leader busy with a long job.
GROUP_CLAIM_TTL_S = 30.0
#: TTL of the nudge and wake lists (a keeper or leader that is gone never pops them).
GROUP_NUDGE_TTL_MS = 60_000
#: How often a running group's leader refreshes its reservation's ``alive`` key (at most; a
#: quarter of its TTL, the lease's: a dead leader's devices take work again as its job is given
#: back by the reaper), and says in the group's record what it still waits for.
GROUP_REFRESH_S = 1.0
#: Seconds between the group host's tries to reach a GPU leader that is not listening (yet):
#: its unit starts it, so a try a second costs nothing and a group waits at most this long.
GROUP_HOST_RECONNECT_S = 1.0
#: How long a leaving worker waits for its group-host link's threads (the acceptor, each
#: connection's reader) once it has ended their connection.
GROUP_HOST_CLOSE_S = 5.0

# -- Producers ---------------------------------------------------------------------------------

#: Seconds between a blocking handle's reads while jobs finish often; it backs off (doubling) to
#: :data:`MAX_POLL_S` while nothing changes (awaiting listens instead).
MIN_POLL_S = 0.002
MAX_POLL_S = 0.1
#: Seconds a waiter that heard nothing reads the stored states again (a pub/sub message lost in
#: a reconnect is found this late).
LISTENER_RECHECK_S = 5.0
#: Seconds to wait for Redis to confirm a subscription before reading anyway.
LISTENER_CONFIRM_S = 10.0
#: Seconds before the state listener tries again after its connection failed for good.
LISTENER_RETRY_S = 0.5
#: How long one read of a command's output streams blocks for new lines (milliseconds).
FOLLOW_BLOCK_MS = 200
#: Seconds between a sweep's checks that every chosen device's worker still consumes its queue,
#: and how long it waits for the workers' replies to ``add_consumer``.
SWEEP_REFRESH_S = 5.0
SWEEP_ATTACH_TIMEOUT_S = 2.0
#: How long the relay keeps the workers that answered a user's attach (``keys.sweep_attached``):
#: her producer reads it within seconds; the key is left for a look afterwards.
SWEEP_ATTACHED_TTL_S = 3600
#: A user's producer reads who answered her attach every ATTACH_READ_POLL_S, for the relay's
#: period, the workers' reply time and ATTACH_READ_SLACK_S more (a relay busy with cancels).
ATTACH_READ_POLL_S = 0.05
ATTACH_READ_SLACK_S = 2.0
#: Messages ``devicefleet status`` (:func:`tasks.waiting`) reads from each queue list: the next
#: ones to start. Deeper messages are counted (``LLEN``), not listed.
WAITING_READ_LIMIT = 1000
#: Queued jobs ``devicefleet status`` lists in its table (``--json`` has them all).
STATUS_WAITING_ROWS = 20
#: Seconds a cancelled ``devicefleet run`` or sweep waits for its running jobs to stop and report.
CANCEL_WAIT_S = 120.0
#: Runs of a job that may take their whole worker down before it ends as ``WorkerLost``
#: (``JobOptions.max_attempts``): a worker killed under it is not the job's fault twice.
MAX_ATTEMPTS = 3
#: Seconds between a waiting ``devicefleet run``'s or sweep's looks at its local fleet's fleet
#: file: a launcher gone ends the wait this soon (tasks.ops.fleet_lost).
FLEET_CHECK_S = 0.5
#: How long ``devicefleet run`` waits for every device, and ``devicefleet sweep`` for every
#: trial (``--timeout``), and how often ``devicefleet status --watch`` redraws (``--interval``).
RUN_TIMEOUT_S = 3600.0
SWEEP_TIMEOUT_S = 86_400.0
STATUS_WATCH_INTERVAL_S = 1.0
#: The widest a table may grow when the command's output is a pipe or a file (no terminal to
#: fit): lines are never wrapped there, so a path or an error stays on one line.
PIPED_OUTPUT_WIDTH = 1000

# -- The launcher (``devicefleet up``, the test fleet) and operations ---------------------------

#: How long the launcher waits for Redis and every worker to be ready (a cold ``import torch``
#: per worker on a loaded host), and for them to stop.
FLEET_START_TIMEOUT_S = 120.0
FLEET_STOP_TIMEOUT_S = 60.0
#: The stop timeout of the fleet ``devicefleet run`` starts for itself (its jobs are done by then).
RUN_FLEET_STOP_TIMEOUT_S = 30.0
#: How long stopping everything at once (a second Ctrl-C) may take.
FLEET_KILL_STOP_S = 5.0
#: How often the launcher looks for a dead worker or Redis to restart.
FLEET_SUPERVISE_S = 0.5
#: Back-off between tries to restart an embedded redis-server that keeps failing (doubling).
REDIS_RESTART_BACKOFF_S = (0.5, 10.0)
#: How long stopping workers may take when Redis is gone for good: they cannot store a result.
REDIS_GONE_STOP_S = 5.0
#: Most messages of the ``fleet`` queue a stop looks through for the fan-outs' collect steps it
#: runs itself (the others go back to the queue).
LEFT_COLLECTS_SCAN = 10_000
#: How long an embedded redis-server has to answer PING; how long one PING may take, and how
#: often it is sent.
REDIS_START_TIMEOUT_S = 15.0
REDIS_PING_TIMEOUT_S = 1
REDIS_START_POLL_S = 0.02
#: How long Flower has to answer its health check; how often it is asked, and how long one ask
#: may take.
FLOWER_START_TIMEOUT_S = 60.0
FLOWER_POLL_S = 0.2
FLOWER_REQUEST_TIMEOUT_S = 2
#: How long a child process (a worker, redis-server, Flower) has between SIGTERM and SIGKILL
#: when the launcher stops it.
PROCESS_STOP_TIMEOUT_S = 10.0
#: How often :func:`tasks.ops.proc.wait_until` checks its condition.
WAIT_UNTIL_POLL_S = 0.05
#: How often the live views (``devicefleet status --watch``, a sweep's table) redraw.
VIEW_REFRESH_S = 0.25
#: Jobs/s is counted over this window (the exporter).
RATE_WINDOW_S = 60.0

# -- Deployment (deploy/, ``devicefleet deploy``) -----------------------------------------------

#: Seconds a worker's stop may take beyond its longest job: Celery's shutdown and storing the
#: result (systemd's ``TimeoutStopSec``).
STOP_MARGIN_S = 60
#: A primary that answers no PING this long is down for a sentinel (Redis's default: 30 s).
SENTINEL_DOWN_AFTER_MS = 5000
#: A failover not done by then is tried again; replicas have this long to follow (default 180 s).
SENTINEL_FAILOVER_TIMEOUT_MS = 60_000

# -- The built-in jobs (tasks.jobs) -----------------------------------------------------------

#: How often the ``train`` job saves a resumable checkpoint (``checkpoint_every_s``): a job that
#: runs again after its worker died loses at most this much work, and a short epoch does not pay
#: a write each time.
CHECKPOINT_EVERY_S = 10.0

#: Batches each DataLoader worker keeps ready ahead of the training loop (``prefetch_factor``).
LOADER_PREFETCH = 4
#: The most of a job's memory budget its dataset may take to live on the device (``train``'s
#: ``data="auto"``, :func:`tasks.jobs.resident.decide`): the rest is the model's, its gradients',
#: optimizer state's and activations'.
RESIDENT_DATA_FRACTION = 0.5
#: Device memory a job may leave allocated (``torch.cuda.memory_allocated()`` after it ends and
#: its memory is released, above what was allocated before it) before its process is retired:
#: tensors a job keeps in a module global hold the device from every later job. Room for what
#: torch itself keeps (cuBLAS workspaces: a few MiB per stream).
MAX_GPU_MEMORY_LEFT_MIB = 256
#: How long the training loop waits for the shared memory of a batch its worker sent (it is sent
#: ahead of the batch, so it is there at once; past this, a bug is reported instead of a hang).
LOADER_HANDOFF_TIMEOUT_S = 10.0

# -- built-in jobs ----------------------------------------------------------------------------------

#: How often the ``hogwild`` job process looks at its training processes and at
#: ``ctx.progress()`` (where a cancel or time limit reaches it).
HOGWILD_POLL_S = 0.2
#: How long a ``hogwild`` training process has after SIGTERM before SIGKILL when the job ends it.
HOGWILD_STOP_GRACE_S = 2.0

# -- users and their credentials (issue 49) ---------------------------------------------------------

#: The oldest Redis a fleet's per-user credentials work on: ACL selectors and read-only key
#: patterns (``%R~``), which keep a user's read of the fleet's status from being a write.
ACL_MIN_REDIS = (7, 0)
#: How long a worker keeps the users' signing keys it read before it reads them again (a user
#: added since is read at once, on the first job that names them).
USER_KEYS_REFRESH_S = 30.0
#: How often a worker's cancel relay looks for users' cancel requests (only on a fleet with
#: users: one read of their count every USER_KEYS_REFRESH_S otherwise), and the most it takes at once.
CANCEL_RELAY_INTERVAL_S = 1.0
#: How often each worker checks that the fleet's Redis (on Sentinel: each replica and sentinel
#: too) has every fleet user's ACL user, and makes again those it lost (a restarted Redis keeps
#: the fleet's keys but not its ACL users): a restart's users are refused at most this long.
#: One ``ACL USERS`` per node a tick (:class:`tasks.worker.acl_keeper.AclUsersKeeper`).
ACL_USERS_CHECK_S = 5.0
CANCEL_RELAY_BATCH = 100
