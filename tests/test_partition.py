"""Network partitions on real processes (issue 39): a host cut off from Redis, then healed.

The rig (tests/partition_rig.py) runs Redis and one CPU worker per host in network namespaces
and cuts a host off by dropping every packet on its link. These tests print the figures the
issue's goals name and assert what the fleet guarantees today: the cut host takes work again
within a few seconds of the heal, and a sweep through a cut loses no trial. What fencing will
add (no two runs alive at once, the lease holder's entry, no death for a partition) is asserted
in tests/test_fencing_partition.py.
"""

from __future__ import annotations

import gc
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tasks import Settings
from tasks.core.app import create_app

from .partition_rig import (
    CutFigures,
    PartitionRig,
    SweepFigures,
    cut_long_trial,
    partition_rig,
    sweep_through_cut,
)


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
def swept(rig: PartitionRig, rig_app: Any, tmp_path_factory: pytest.TempPathFactory) -> SweepFigures:
    """The issue's second: many short trials over two hosts, one cut off for longer than a lease."""
    figures = sweep_through_cut(rig, rig_app, tmp_path_factory.mktemp("sweep"), "hosta")
    print(figures.report())
    return figures


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
