"""NVIDIA driver lines in the kernel log: what they say about the node, and what to do.

An XID line looks like ``NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off
the bus.`` (older drivers write ``(0000:3b:00)`` without ``PCI:``). `parse_line` turns a
line into a `DriverEvent` (XID code, PCI id, pid) or None.

The action per XID code (`XID_ACTIONS`), after NVIDIA's XID catalog
(docs.nvidia.com/deploy/xid-errors): ``replace`` where the hardware is gone or cannot
be repaired in place, ``reboot`` where a GPU reset or a reboot clears it:

====  ==========================================================  =========
XID   meaning                                                      action
====  ==========================================================  =========
48    double-bit ECC error (the reset applies the row remap)       reboot
61    internal micro-controller breakpoint / warning               reboot
62    internal micro-controller halt                               reboot
63    ECC page retirement / row remap recorded (applies at reset)  reboot
64    ECC page retirement / row remap failed (cannot be repaired)  replace
74    NVLink error                                                 reboot
79    GPU has fallen off the bus                                   replace
92    high single-bit ECC error rate                               reboot
94    contained ECC error                                          reboot
95    uncontained ECC error                                        reboot
119   GSP RPC timeout                                              reboot
120   GSP error                                                    reboot
====  ==========================================================  =========

Application XIDs (`APPLICATION_XIDS`: 13 graphics engine exception, 31 GPU memory page
fault, 43 GPU stopped processing, 45 preemptive cleanup after earlier errors, 68 video
processor exception; the same list NVIDIA's Kubernetes device plugin skips) are the
program's fault, not the node's: they give **no finding** (the program's crash is
reported as a worker fault anyway). Every other XID, known or not, is treated as a node
fault asking for a ``reboot``, as the device plugin marks a GPU unhealthy on any XID
outside that list.

NVRM lines that are not XIDs but say the GPU is gone (`NVRM_PATTERNS`): "GPU has
fallen off the bus" -> replace; "RmInitAdapter failed" (the driver could not set the
GPU up) -> reboot. Other NVRM lines are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from trainguard.health.result import Action

__all__ = [
    "APPLICATION_XIDS",
    "NVRM_PATTERNS",
    "UNKNOWN_XID_ACTION",
    "XID_ACTIONS",
    "DriverEvent",
    "parse_line",
    "xid_action",
    "xid_line",
]

XID_ACTIONS: Final[Mapping[int, tuple[Action, str]]] = {
    48: ("reboot", "double-bit ECC error"),
    61: ("reboot", "internal micro-controller breakpoint/warning"),
    62: ("reboot", "internal micro-controller halt"),
    63: ("reboot", "ECC page retirement or row remapping recorded"),
    64: ("replace", "ECC page retirement or row remapping failed"),
    74: ("reboot", "NVLink error"),
    79: ("replace", "GPU has fallen off the bus"),
    92: ("reboot", "high single-bit ECC error rate"),
    94: ("reboot", "contained ECC error"),
    95: ("reboot", "uncontained ECC error"),
    119: ("reboot", "GSP RPC timeout"),
    120: ("reboot", "GSP error"),
}
APPLICATION_XIDS: Final[Mapping[int, str]] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    68: "video processor exception",
}
UNKNOWN_XID_ACTION: Final[Action] = "reboot"

NVRM_PATTERNS: Final[tuple[tuple[re.Pattern[str], Action, str], ...]] = (
    (re.compile(r"fallen off the bus", re.IGNORECASE), "replace", "GPU has fallen off the bus"),
    (re.compile(r"RmInitAdapter failed", re.IGNORECASE), "reboot", "GPU initialisation failed"),
)

_PCI: Final = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-9a-fA-F])?"
_XID: Final = re.compile(
    rf"NVRM: Xid \((?:PCI:)?(?P<pci>{_PCI})\): (?P<code>\d+)(?:,\s*(?P<detail>.*))?"
)
_NVRM: Final = re.compile(r"NVRM: (?P<text>.*)")
_NVRM_PCI: Final = re.compile(rf"(?:PCI:|GPU )(?P<pci>{_PCI})")
_PID: Final = re.compile(r"pid='?(?P<pid>[^,' ]+)")
_MAX_LINE: Final = 500


@dataclass(frozen=True)
class DriverEvent:
    """One NVRM line that matters: an XID (``code`` set) or a GPU-gone line (``code`` None).

    ``action`` is None for an application XID (not the node's fault).
    """

    kind: Literal["XID", "NVRM"]
    action: Action | None
    description: str
    pci: str | None
    code: int | None
    pid: str | None
    line: str

    @property
    def key(self) -> tuple[str, int | None, str | None, str]:
        """What makes two lines the same fault (the same code on the same GPU)."""
        return (self.kind, self.code, self.pci, self.description)


def xid_action(code: int) -> tuple[Action | None, str]:
    """(action or None for an application XID, description) of an XID code."""
    if code in APPLICATION_XIDS:
        return None, APPLICATION_XIDS[code]
    if code in XID_ACTIONS:
        return XID_ACTIONS[code]
    return UNKNOWN_XID_ACTION, f"XID {code} (not in trainguard's table)"


def parse_line(line: str) -> DriverEvent | None:
    """The driver event a kernel log line reports, or None."""
    if "NVRM" not in line:
        return None
    text = line.strip()[:_MAX_LINE]
    xid = _XID.search(text)
    if xid is not None:
        code = int(xid["code"])
        action, description = xid_action(code)
        pid = _PID.search(xid["detail"] or "")
        return DriverEvent(
            "XID",
            action,
            description,
            _short_pci(xid["pci"]),
            code,
            pid["pid"] if pid else None,
            text,
        )
    nvrm = _NVRM.search(text)
    if nvrm is None:
        return None
    for pattern, action, description in NVRM_PATTERNS:
        if pattern.search(nvrm["text"]):
            pci = _NVRM_PCI.search(nvrm["text"])
            return DriverEvent(
                "NVRM",
                action,
                description,
                _short_pci(pci["pci"]) if pci else None,
                None,
                None,
                text,
            )
    return None


def xid_line(code: int, pci: str = "0000:00:1e", pid: int | str = "N/A") -> str:
    """A kernel-log-style XID line, as the driver writes it (for rehearsals and tests)."""
    action, description = xid_action(code)
    del action
    return f"NVRM: Xid (PCI:{pci}): {code}, pid={pid}, {description}"


def _short_pci(pci: str) -> str:
    """``0000:3b:00.0`` and ``0000:3b:00`` name the same GPU: keep domain:bus:device."""
    return pci.split(".")[0].lower()
