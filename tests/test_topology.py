"""A GPU group's devices by their links: NVML's topology as a GPU worker reads it
(tasks/worker/topology.py, fed a stand-in NVML module: no GPU here), the registry record that
publishes it, and the producer's choice from the records (tasks/core/groups.py).

The stand-in host has four GPUs: 0-1 on NVLink (an active link whose far end is the other's
PCI bus id), 2-3 on NVLink through an NVSwitch (NVML's NVLink peer-to-peer status, their links'
far end being the switch), 1-2 behind one PCIe switch, every other pair across sockets.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from tasks.core.groups import INDEX_ORDER, Link, choose_groups, explain, host_links, plan_groups
from tasks.core.records import WorkerRecord
from tasks.worker.topology import read_links


class _NVMLError(Exception):
    pass


def fake_nvml(*, count: int = 4, fail_init: bool = False) -> Any:
    """The functions of ``pynvml`` that :func:`read_links` calls, over the module's host."""
    bus = [f"00000000:{0x07 + 0x10 * i:02X}:00.0" for i in range(count)]
    switch_bus = "00000000:C0:00.0"
    # Per GPU, its NVLinks' far ends (None: the link is down).
    nvlinks = {0: [bus[1], None, bus[1]], 1: [bus[0], bus[0]], 2: [switch_bus], 3: [switch_bus]}
    levels = {frozenset({1, 2}): 10}
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if fail_init:
            raise _NVMLError("Driver Not Loaded")

    def link_state(handle: int, link: int) -> int:
        links = nvlinks.get(handle, [])
        if link >= len(links):
            raise _NVMLError("Invalid Argument")
        return 0 if links[link] is None else 1

    def remote(handle: int, link: int) -> Any:
        return types.SimpleNamespace(busId=nvlinks[handle][link].encode())  # bytes, as older bindings give

    def p2p(a: int, b: int, index: int) -> int:
        assert index == 2  # NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if {a, b} == {2, 3} else 4  # NVML_P2P_STATUS_OK, else "not supported"

    return types.SimpleNamespace(
        NVMLError=_NVMLError, NVML_NVLINK_MAX_LINKS=6, NVML_P2P_CAPS_INDEX_NVLINK=2, NVML_P2P_STATUS_OK=0,
        nvmlInit=init, nvmlShutdown=lambda: calls.append("shutdown"), nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=bus[h]),
        nvmlDeviceGetNvLinkState=link_state, nvmlDeviceGetNvLinkRemotePciInfo=remote,
        nvmlDeviceGetP2PStatus=p2p,
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: levels.get(frozenset({a, b}), 50),
        calls=calls,
    )


def _gpu(index: int, links: dict[int, str] | None, host: str = "h") -> WorkerRecord:
    return WorkerRecord(device=f"gpu{index}", kind="gpu", worker=f"gpu{index}@{host}", host=host, pid=1, queues=[],
                        cores=[index], pool="threads", jobs=["train"], started_at=0.0, gpu_links=links)


def test_read_links_reads_nvlink_peers_nvswitch_pairs_and_pcie_levels_from_nvml():
    nvml = fake_nvml()
    assert read_links(0, nvml) == {1: "nvlink", 2: "system", 3: "system"}
    assert read_links(1, nvml) == {0: "nvlink", 2: "pcie_switch", 3: "system"}
    assert read_links(2, nvml) == {0: "system", 1: "pcie_switch", 3: "nvlink"}
    assert nvml.calls == ["init", "shutdown"] * 3


def test_read_links_publishes_nothing_where_nvml_does_not_start():
    nvml = fake_nvml(fail_init=True)
    assert read_links(0, nvml) is None


def test_a_pair_nvml_does_not_describe_is_left_out():
    """As one H200's driver under gVisor answered: no NVLink call and no common ancestor."""
    nvml = fake_nvml(count=3)

    def not_supported(*args: Any) -> int:
        raise _NVMLError("Not Supported")

    nvml.nvmlDeviceGetNvLinkState = not_supported
    nvml.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 10 if {a, b} == {0, 2} else not_supported()
    assert read_links(0, nvml) == {2: "pcie_switch"}
    assert nvml.calls == ["init", "shutdown"]


def test_the_published_links_survive_the_registry_record_and_feed_the_choice():
    nvml = fake_nvml()
    records = [_gpu(i, read_links(i, nvml)) for i in range(4)]
    # What the heartbeat writes and the producer reads back.
    live = {r.device: WorkerRecord.model_validate_json(r.to_json()) for r in records}
    assert live["gpu1"].gpu_links == {0: "nvlink", 2: "pcie_switch", 3: "system"}
    links = host_links(live)
    assert links("h", 0, 1) is Link.NVLINK and links("h", 3, 2) is Link.NVLINK
    assert links("h", 1, 2) is Link.PCIE_SWITCH and links("other", 0, 1) is None

    chosen = choose_groups(["gpu1", "gpu2", "gpu3", "gpu0"], live, 2)
    assert [(c.devices, c.why) for c in chosen] == [(["gpu0", "gpu1"], "gpu0+gpu1: NVLink"),
                                                   (["gpu2", "gpu3"], "gpu2+gpu3: NVLink")]
    # Three of them: the NVLink pair is taken first, its third GPU the one on its PCIe switch.
    assert [(c.devices, c.why) for c in choose_groups(["gpu1", "gpu2", "gpu3"], live, 2)] == [
        (["gpu2", "gpu3"], "gpu2+gpu3: NVLink")]
    assert [(c.devices, c.why) for c in choose_groups(["gpu1", "gpu2"], live, 2)] == [
        (["gpu1", "gpu2"], "gpu1+gpu2: common PCIe switch")]
    assert choose_groups(list(live), live, 4)[0].why == "gpu0+gpu1+gpu2+gpu3: across CPU sockets"


def test_a_link_known_from_either_side_counts_and_without_links_groups_go_in_index_order():
    nvml = fake_nvml()
    # gpu2's worker published nothing (no NVML there): its links are in the others' rows.
    live = {f"gpu{i}": _gpu(i, read_links(i, nvml) if i != 2 else None) for i in range(4)}
    assert host_links(live)("h", 2, 3) is Link.NVLINK
    assert [c.why for c in choose_groups(list(live), live, 2)] == ["gpu0+gpu1: NVLink", "gpu2+gpu3: NVLink"]
    # gpu1 and gpu2 published nothing: 1-2 is not known, and a group of them says so.
    live["gpu1"] = _gpu(1, None)
    assert [(c.devices, c.why) for c in choose_groups(["gpu1", "gpu2"], live, 2)] == [
        (["gpu1", "gpu2"], f"gpu1+gpu2: {INDEX_ORDER}")]
    bare = {f"gpu{i}": _gpu(i, None) for i in range(4)}
    chosen = choose_groups(list(bare), bare, 2)
    assert [(c.devices, c.why) for c in chosen] == [(["gpu0", "gpu1"], f"gpu0+gpu1: {INDEX_ORDER}"),
                                                   (["gpu2", "gpu3"], f"gpu2+gpu3: {INDEX_ORDER}")]
    assert plan_groups(list(bare), bare, 2) == [["gpu0", "gpu1"], ["gpu2", "gpu3"]]
    assert explain(["cpu0", "cpu1"], None) == "cpu0+cpu1: index order (CPU devices)"


@pytest.mark.parametrize("level,link", [(0, "pcie_switch"), (20, "pcie_switches"), (30, "host_bridge"),
                                        (40, "numa_node"), (70, "system")])
def test_each_nvml_topology_level_is_a_link(level: int, link: str):
    nvml = fake_nvml(count=2)
    nvml.nvmlDeviceGetNvLinkState = lambda handle, n: (_ for _ in ()).throw(_NVMLError("Not Supported"))
    nvml.nvmlDeviceGetP2PStatus = lambda a, b, index: 4
    nvml.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: level
    assert read_links(0, nvml) == {1: link}
