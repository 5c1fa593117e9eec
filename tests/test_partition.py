"""Network partitions on real processes (issue 39): a host cut off from Redis, then healed.

The rig (tests/partition_rig.py) runs Redis and one CPU worker per host in network namespaces
and cuts a host off by dropping every packet on its link. These tests print the figures the
issue's goals name and assert them: the cut host takes work again within a few seconds of the
heal, and a sweep through a cut loses no trial; and what fencing makes true (items 1-3): a
cut-off worker stops its run before its lease can be given to someone else (self-fencing), its
late writes are refused (a fencing token per attempt), and the partition counts no death. One
rig and one run of each experiment serve every test (module-scoped fixtures).
"""

from __future__ import annotations

import gc
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tasks import Settings
from tasks.core.app import create_app
from tasks.core.defaults import CANCEL_GRACE_S

from .partition_jobs import TICK_S
from .partition_rig import (
    LEASE_TTL_S,
    RECOVERY_BOUND_S,
    CutFigures,
    GangFigures,
    PartitionRig,
    SweepFigures,
    cut_gang_rank,
    cut_long_trial,
    partition_rig,
    sweep_through_cut,
)

# A real system rig (root, network namespaces): its own step in .ci/run, `python3 -m pytest -m system`.
pytestmark = pytest.mark.system


class _Failed(Exception):
    pass


@pytest.mark.timeout(60)
def test_the_rig_cuts_heals_and_removes_all_it_made() -> None:
    """The drop qdisc cuts a host off silently (a connection times out, nothing refuses it),
    the heal restores it, and every namespace, veth, process and folder is gone afterwards,
    also when the test inside fails."""
    with pytest.raises(_Failed), partition_rig(workers=False) as rig:
        made = list(rig._namespaces)
        links = [name for host in rig.hosts.values() for name in (host.veth, host.peer)]
        redis_process, folder = rig.redis_process, rig.folder
        assert rig.reaches_redis("hosta") and rig.reaches_redis("hostb")
        with rig.partitioned("hosta"):
            assert not rig.reaches_redis("hosta")
            assert rig.reaches_redis("hostb")
        assert rig.reaches_redis("hosta")
        raise _Failed
    listed = subprocess.run([rig.ip, "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [name for name in made if name in listed]
    assert len(made) == 3
    ours = subprocess.run([rig.ip, "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert not [name for name in links if name in ours]
    assert redis_process is not None and redis_process.poll() is not None
    assert not folder.exists()

#: The goal: the cut host runs jobs again within this long of the heal.
BACK_AFTER_HEAL_S = 5.0
#: Two runs of one job alive at once, at most: two ticks of the rig's job (its resolution).
MAX_OVERLAP_S = 2 * TICK_S
#: A pause of the worker longer than its lease can last (longer than the margin: the
#: assumption self-fencing rests on does not hold, so two runs may overlap for the pause).
PAUSE_S = 7.0
#: The paused run's own length: paused 1 s in for PAUSE_S, it would tick on for 4 s after the
#: resume if nothing stopped it.
PAUSED_RUN_S = 12.0
#: A worker resumed after such a pause stops its run at once (it finds that its last confirmed
#: renewal is older than the margin): within half of what the run had left (an event a loaded
#: 2-core machine still tells apart from the run ending by itself; 1.0 s failed at load 13).
STOPPED_AFTER_RESUME_S = (PAUSED_RUN_S - 1.0 - PAUSE_S) / 2
#: The job runs again elsewhere within lease TTL + reaper interval + this of the cut.
RERUN_SLACK_S = 1.0
#: A gang whose rank's host is cut off moves on within the lease TTL + this of the cut (the
#: watch's interval, a round trip, and a loaded host's scheduling), where its collective would
#: wait out its 120-s timeout.
GANG_SLACK_S = 2.0


@pytest.fixture(scope="module")
def rig() -> Iterator[PartitionRig]:
    with partition_rig() as running:
        yield running


@pytest.fixture(scope="module")
def rig_app(rig: PartitionRig) -> Iterator[Any]:
    app = create_app(Settings.load(redis_url=rig.producer_url, device_names="host"))
    yield app
    gc.collect()  # result handles unsubscribe while the rig's Redis still runs


@pytest.fixture(scope="module")
def cut(rig: PartitionRig, rig_app: Any, tmp_path_factory: pytest.TempPathFactory) -> CutFigures:
    """The issue's first experiment, measured once: the host running a long trial is cut off
    mid-run for longer than lease TTL + reaper interval, then healed."""
    figures = cut_long_trial(rig, rig_app, tmp_path_factory.mktemp("cut"))
    print(figures.report())
    return figures


@pytest.fixture(scope="module")
def paused(rig: PartitionRig, rig_app: Any, tmp_path_factory: pytest.TempPathFactory) -> CutFigures:
    """The same with the worker paused (SIGSTOP) instead of cut off, longer than its lease
    lasts, while its job process runs on; then resumed."""
    figures = cut_long_trial(rig, rig_app, tmp_path_factory.mktemp("pause"), fault="pause",
                             long_s=PAUSED_RUN_S, cut_s=PAUSE_S)
    print(figures.report())
    return figures


@pytest.fixture(scope="module")
def swept(rig: PartitionRig, rig_app: Any, tmp_path_factory: pytest.TempPathFactory) -> SweepFigures:
    """The issue's second: many short trials over two hosts, one cut off for longer than a lease."""
    figures = sweep_through_cut(rig, rig_app, tmp_path_factory.mktemp("sweep"), "hosta")
    print(figures.report())
    return figures


@pytest.fixture(scope="module")
def gang_cut(rig: PartitionRig, rig_app: Any, tmp_path_factory: pytest.TempPathFactory) -> GangFigures:
    """Item 4: a distributed job of two ranks, one per host; rank 0's host cut off mid-run."""
    figures = cut_gang_rank(rig, rig_app, tmp_path_factory.mktemp("gang"))
    print(figures.report())
    return figures


@pytest.mark.timeout(180)
def test_a_gang_whose_ranks_host_is_cut_off_moves_on_from_the_fleet_within_the_lease(gang_cut: GangFigures) -> None:
    """The survivor learns from the cut rank's lease, not from its collective (which a dropped
    link never resets), that its peer is lost: the gang moves to its next generation within
    the lease TTL, the survivor leaves its stuck collective (after its stop's grace) and waits
    there, and once the cut host is back the gang completes, restarted once, with no death."""
    assert gang_cut.generation_at_cut == 0
    assert gang_cut.moved_on_after_cut_s is not None, gang_cut.report()
    assert gang_cut.moved_on_after_cut_s <= LEASE_TTL_S + GANG_SLACK_S, gang_cut.report()
    assert gang_cut.survivor_rejoined_after_cut_s is not None, gang_cut.report()
    # Its stop's grace, then its process ended: seconds, where its collective would wait 120.
    assert gang_cut.survivor_rejoined_after_cut_s <= LEASE_TTL_S + CANCEL_GRACE_S + 2 * GANG_SLACK_S, gang_cut.report()
    assert gang_cut.statuses == {gang_cut.cut_device: "ok", gang_cut.survivor_device: "ok"}, gang_cut.entries
    assert gang_cut.restarts == {gang_cut.cut_device: 1, gang_cut.survivor_device: 1}, gang_cut.report()
    assert gang_cut.deaths == [], gang_cut.report()


@pytest.mark.timeout(120)
def test_a_cut_host_takes_work_again_soon_after_the_heal(rig: PartitionRig, cut: CutFigures) -> None:
    assert cut.runs[0].device == cut.cut_device
    assert cut.back_after_heal_s < BACK_AFTER_HEAL_S, rig.log_tail(cut.cut_device.split("@")[1])


@pytest.mark.timeout(120)
def test_a_trial_cut_off_mid_run_still_ends_ok(cut: CutFigures) -> None:
    assert cut.statuses == ["ok", "ok"], cut.entry
    assert cut.entry_run is not None, f"the entry's run {cut.entry['output']} ticked nowhere: {cut.runs}"


@pytest.mark.timeout(120)
def test_a_sweep_through_a_cut_loses_no_trial(swept: SweepFigures) -> None:
    assert swept.statuses == ["ok"] * swept.trials
    assert swept.never_ran == []


@pytest.mark.timeout(120)
def test_a_cut_off_job_runs_again_elsewhere_within_the_lease_bound(cut: CutFigures) -> None:
    assert cut.runs[0].device == cut.cut_device
    assert cut.rerun_after_cut_s is not None, f"it never ran on {cut.other_device} during the cut: {cut.runs}"
    assert cut.rerun_after_cut_s <= RECOVERY_BOUND_S + RERUN_SLACK_S, cut.report()


@pytest.mark.timeout(120)
def test_two_runs_of_a_cut_off_job_are_never_alive_at_once(cut: CutFigures) -> None:
    """The cut-off worker stops its run before the lease it no longer renews can be given
    to another host (self-fencing)."""
    assert cut.overlap_s <= MAX_OVERLAP_S, cut.report()


@pytest.mark.timeout(120)
def test_the_entry_is_the_lease_holding_attempts(cut: CutFigures) -> None:
    """The cut-off run's late store is refused: the producer gets the run that held the lease
    (the last one to start), ok."""
    assert cut.statuses == ["ok", "ok"], cut.entry
    assert cut.entry_run is not None, f"the entry's run {cut.entry['output']} ticked nowhere: {cut.runs}"
    assert cut.entry_run == cut.runs[-1], cut.report()
    assert cut.entry_run.device == cut.other_device


@pytest.mark.timeout(120)
def test_a_partition_counts_no_death(cut: CutFigures) -> None:
    assert cut.deaths == [], cut.report()


@pytest.mark.timeout(120)
def test_a_sweep_through_a_cut_never_runs_a_trial_twice_at_once(swept: SweepFigures) -> None:
    assert swept.statuses == ["ok"] * swept.trials
    assert swept.never_ran == []
    assert swept.overlap_s <= MAX_OVERLAP_S, swept.report()


@pytest.mark.timeout(150)
def test_a_worker_paused_past_its_lease_stops_its_run_on_resume_and_its_store_is_refused(paused: CutFigures) -> None:
    """SIGSTOP (item 2's case): the paused worker cannot stop its job process while paused;
    once resumed it stops it at once, and the entry is still the lease holder's."""
    assert paused.rerun_after_cut_s is not None, f"it never ran on {paused.other_device} during the pause"
    assert paused.cut_run_ended_after_heal_s <= STOPPED_AFTER_RESUME_S, paused.report()
    assert paused.statuses == ["ok", "ok"], paused.entry
    assert paused.entry_run == paused.runs[-1], paused.report()


#: The issue's second experiment at its full size (160 trials, a 30-s cut): about 40 s with the
#: rig's start on 2 cores (the cut alone lasts 30), so not in the default run.
LONG_SWEEP = os.environ.get("PARTITION_LONG_SWEEP", "") not in ("", "0")


@pytest.mark.slow
@pytest.mark.skipif(not LONG_SWEEP, reason="the 160-trial sweep through a 30-s cut takes about 40 s: "
                    "PARTITION_LONG_SWEEP=1 python3 -m pytest tests/test_partition.py -k long_sweep -s")
@pytest.mark.timeout(400)
def test_a_long_sweep_through_a_long_cut_loses_no_trial_and_never_overlaps(rig: PartitionRig, rig_app: Any,
                                                                          tmp_path: Any) -> None:
    figures = sweep_through_cut(rig, rig_app, tmp_path, "hosta", trials=160, cut_s=30.0)
    print(figures.report())
    assert figures.statuses == ["ok"] * figures.trials
    assert figures.never_ran == []
    assert figures.overlap_s <= MAX_OVERLAP_S, figures.report()
