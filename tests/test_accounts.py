"""Each user's jobs as the user's own system account (tasks/core/accounts.py): the pure parts, in
process. Under a real systemd, two users' jobs on one worker: tests/test_systemd.py (`-m system`)."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from tasks.core.accounts import (
    CAPABILITY_NUMBERS,
    JobAccounts,
    check_worker_capabilities,
    held_capabilities,
    missing_worker_capabilities,
)
from tasks.core.errors import ConfigError, NoJobAccount
from tasks.core.settings import Settings
from tasks.ops.deploy import plan_host, render

from .conftest import ROOT

ME = pwd.getpwuid(os.getuid()).pw_name


def test_a_user_of_the_fleet_runs_only_as_their_account_and_a_mapped_account_only_for_them(tmp_path: Path) -> None:
    accounts = JobAccounts({"alice": "devicefleet-alice"}, tmp_path)
    assert accounts.refusal("alice", verified=True) is None
    # The admin's job (no user, or a name that is no user of the fleet): the worker's account.
    assert accounts.refusal(None, verified=False) is None and accounts.refusal("root", verified=False) is None
    carol = accounts.refusal("carol", verified=True)
    assert carol is not None and "maps none to user 'carol'" in carol and "--job-account carol" in carol
    unverified = accounts.refusal("alice", verified=False)
    assert unverified is not None and "devicefleet user add alice" in unverified
    # No mapping: every job runs as the worker, as before.
    assert JobAccounts({}, tmp_path).refusal("carol", verified=True) is None and not JobAccounts({}, tmp_path)


def test_an_account_resolves_only_to_a_folder_its_own_and_closed_to_others(tmp_path: Path) -> None:
    accounts = JobAccounts({"alice": ME, "bob": "no-such-account-here"}, tmp_path)
    assert accounts.resolve("") is None and accounts.resolve("root-admin") is None  # the worker's own
    with pytest.raises(NoJobAccount, match="system account 'no-such-account-here' of user 'bob' does not exist"):
        accounts.resolve("bob")
    with pytest.raises(NoJobAccount, match=r"folder .*users/alice cannot be read .*mode 0700"):
        accounts.resolve("alice")
    folder = tmp_path / "users" / "alice"
    folder.mkdir(parents=True, mode=0o755)
    folder.chmod(0o755)
    with pytest.raises(NoJobAccount, match="only it may open \\(mode 0700\\); it is owned by uid .* with mode 0755"):
        accounts.resolve("alice")
    folder.chmod(0o700)
    account = accounts.resolve("alice")
    assert account is not None
    assert (account.account, account.uid, account.folder) == (ME, os.getuid(), folder)


def test_capability_sets_are_read_from_proc_and_the_missing_ones_named(tmp_path: Path) -> None:
    status = "Name:\tpython\nCapInh:\t0000000000000000\nCapPrm:\t00000000000800e0\nCapEff:\t00000000000800e0\n" \
             "CapBnd:\t00000000000800e0\nCapAmb:\t00000000000800e0\n"
    wanted = sum(1 << bit for bit in CAPABILITY_NUMBERS.values())
    assert wanted == 0x800E0
    assert held_capabilities(status) == {"CapInh": 0, "CapPrm": wanted, "CapEff": wanted, "CapAmb": wanted}
    assert missing_worker_capabilities(wanted) == []
    assert missing_worker_capabilities(1 << CAPABILITY_NUMBERS["CAP_KILL"]) == ["CAP_SETGID", "CAP_SETUID",
                                                                                "CAP_SYS_PTRACE"]
    path = tmp_path / "status"
    path.write_text(status.replace("00000000000800e0", "0000000000000020"))
    with pytest.raises(ConfigError, match="lacks CAP_SETGID, CAP_SETUID, CAP_SYS_PTRACE.*--job-account"):
        check_worker_capabilities(str(path))


def test_the_job_accounts_setting_reads_user_account_pairs_and_names_a_bad_one() -> None:
    settings = Settings.load(job_accounts="alice=devicefleet-alice, bob=devicefleet-bob")
    assert settings.job_accounts == {"alice": "devicefleet-alice", "bob": "devicefleet-bob"}
    assert Settings.load().job_accounts == {} == Settings.load(job_accounts="{}").job_accounts
    assert Settings.load(job_accounts='{"alice": "devicefleet-alice"}').job_accounts == {"alice": "devicefleet-alice"}
    with pytest.raises(ConfigError, match="'alice' is not USER=ACCOUNT"):
        Settings.load(job_accounts="alice")
    with pytest.raises(ConfigError, match="system account 'Alice Smith' is not an account name"):
        Settings.load(job_accounts="alice=Alice Smith")


def test_deploy_renders_each_job_users_account_folder_and_the_workers_capabilities(tmp_path: Path) -> None:
    root = tmp_path / "root"
    plan = plan_host(gpus=0, cpu_workers=2, root=root, worker_configs_src=ROOT / "worker_configs",
                     job_users=["alice", "bob"])
    render(plan, root)
    sysusers = (root / "etc/sysusers.d/devicefleet.conf").read_text()
    assert 'u       devicefleet-alice  -   "devicefleet jobs of alice"  /var/lib/devicefleet/artifacts/users/alice' \
        in sysusers
    tmpfiles = (root / "etc/tmpfiles.d/devicefleet.conf").read_text().splitlines()
    assert "d       /var/lib/devicefleet/artifacts/users/bob  0700  devicefleet-bob  devicefleet-bob  -" in tmpfiles
    assert "d       /var/lib/devicefleet/artifacts  0751  devicefleet  devicefleet  -" in tmpfiles
    for device in ("cpu0", "cpu1"):
        dropin = (root / f"etc/systemd/system/devicefleet-worker@{device}.service.d/40-job-accounts.conf").read_text()
        assert 'Environment="DEVICEFLEET_JOB_ACCOUNTS=alice=devicefleet-alice,bob=devicefleet-bob"' in dropin
        assert "AmbientCapabilities=CAP_KILL CAP_SETGID CAP_SETUID CAP_SYS_PTRACE\n" in dropin
        assert "SystemCallFilter=@setuid capset\n" in dropin
    # What the worker reads back from that drop-in is the mapping deploy rendered.
    assert Settings.load(job_accounts="alice=devicefleet-alice,bob=devicefleet-bob").job_accounts == plan.job_accounts
    # Without job users: nothing of it, and the folders closed as before.
    plain = tmp_path / "plain"
    render(plan_host(gpus=0, cpu_workers=1, root=plain, worker_configs_src=ROOT / "worker_configs"), plain)
    assert not list(plain.glob("etc/systemd/system/*/40-job-accounts.conf"))
    assert "d       /var/lib/devicefleet/artifacts  0750  devicefleet  devicefleet  -" in \
        (plain / "etc/tmpfiles.d/devicefleet.conf").read_text().splitlines()
    with pytest.raises(ConfigError, match="--job-account a-very-long-fleet-user-name: system account"):
        plan_host(gpus=0, cpu_workers=1, root=plain, worker_configs_src=ROOT / "worker_configs",
                  job_users=["a-very-long-fleet-user-name"])
