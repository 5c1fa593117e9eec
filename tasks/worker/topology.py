"""A GPU's links to the other GPUs of its host, read from NVML when its worker starts.

Each GPU worker publishes its own row of the host's topology with its registry record
(:attr:`~tasks.core.records.WorkerRecord.gpu_links`), so a producer choosing a GPU group's
devices prefers the best-connected set (:func:`tasks.core.groups.choose_groups`) without a
host-level process. The row is what ``nvidia-smi topo -m`` prints for that GPU, in the terms of
:class:`~tasks.core.groups.Link`:

- ``nvlink`` where one of this GPU's active NVLinks ends at the other GPU
  (``nvmlDeviceGetNvLinkState`` and ``nvmlDeviceGetNvLinkRemotePciInfo`` over its links, as
  ``nvidia-smi topo -m`` counts ``NV#``), or where NVML says the pair can talk peer to peer
  over NVLink (``nvmlDeviceGetP2PStatus`` with ``NVML_P2P_CAPS_INDEX_NVLINK``: the GPUs of an
  NVSwitch system, whose links end at the switch);
- else the closest common PCIe ancestor, ``nvmlDeviceGetTopologyCommonAncestor``'s level
  (one switch, several, the host bridge, one NUMA node, across sockets).

A pair NVML does not describe is left out of the row (unknown: such a group is taken in index
order). On one H200 under gVisor (driver 580.159.04) every NVLink call and the common-ancestor
call answered ``Not Supported``; a host's driver outside a sandbox answers them as
``nvidia-smi topo -m`` shows.

Indices are NVML's, which enumerates GPUs in PCI bus order: the order of ``gpu<N>`` names and of
a group's ``CUDA_VISIBLE_DEVICES`` under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
(:func:`tasks.core.groups.group_environment`). A host without NVML (no driver, no
``nvidia-ml-py``) publishes nothing, and its groups are taken in index order.
"""

from __future__ import annotations

import logging
from typing import Any

from ..core.groups import Link

logger = logging.getLogger(__name__)

#: The links NVML may report per GPU when the binding does not say (NVML 12's NVML_NVLINK_MAX_LINKS).
_MAX_LINKS = 18
_NVML_FEATURE_ENABLED = 1


def read_links(index: int, nvml: Any | None = None) -> dict[int, str] | None:
    """GPU ``index``'s link to each other GPU of this host: ``{other index: link name}``
    (``"nvlink"``, ``"pcie_switch"``...: :class:`~tasks.core.groups.Link`'s names in lower case).

    ``nvml`` is the ``pynvml`` module (``nvidia-ml-py``; a stand-in in the tests). Never raises:
    None, with the reason logged, where NVML cannot be read (not installed, no driver, no such GPU).
    """
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            logger.info("gpu%d: nvidia-ml-py is not installed: no topology published", index)
            return None
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001  (NVML's errors are its own classes)
        logger.info("gpu%d: NVML did not start (%s): no topology published", index, exc)
        return None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        own = handles[index]
        linked = _nvlink_peers(nvml, own)
        row: dict[int, str] = {}
        for other, handle in enumerate(handles):
            if other == index:
                continue
            if _bus_id(nvml.nvmlDeviceGetPciInfo(handle)) in linked or _p2p_nvlink(nvml, own, handle):
                link = Link.NVLINK
            else:
                try:
                    level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(own, handle))
                except nvml.NVMLError as exc:  # a sandbox's driver may not say (gVisor: Not Supported)
                    logger.info("gpu%d: NVML does not say how gpu%d is connected (%s)", index, other, exc)
                    continue
                # NVML_TOPOLOGY_INTERNAL (0): two GPUs of one board, behind its own switch.
                link = Link.PCIE_SWITCH if level == 0 else Link(level) if level in Link._value2member_map_ else Link.SYSTEM
            row[other] = link.name.lower()
    except Exception as exc:  # noqa: BLE001
        logger.warning("gpu%d: could not read NVML's topology (%s): no topology published", index, exc)
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001
            logger.debug("nvmlShutdown: %s", exc)
    logger.info("gpu%d: links %s", index, ", ".join(f"gpu{i} {name}" for i, name in sorted(row.items())) or "none")
    return row


def _nvlink_peers(nvml: Any, handle: Any) -> set[str]:
    """The PCI bus ids at the far end of ``handle``'s active NVLinks (none on a GPU without)."""
    peers: set[str] = set()
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", _MAX_LINKS))):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != _NVML_FEATURE_ENABLED:
                continue
            peers.add(_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)))
        except nvml.NVMLError:  # past its last link, a link it lacks, or no NVLink at all
            continue
    return peers


def _p2p_nvlink(nvml: Any, a: Any, b: Any) -> bool:
    try:
        return bool(nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK) == nvml.NVML_P2P_STATUS_OK)
    except nvml.NVMLError:
        return False


def _bus_id(pci: Any) -> str:
    """A PCI bus id as NVML spells it, in one form: ``00000000:07:00.0``."""
    bus = pci.busId
    return (bus.decode() if isinstance(bus, bytes) else str(bus)).strip().lower()
