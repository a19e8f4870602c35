"""Check results and findings travel as JSON (the wire's health reports) and come back the
same; bad ones are refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainguard.health import CheckResult, Finding
from trainguard.health.result import NODE_HEALTH_STATUS
from trainguard.wire.health import CheckReport, FindingReport


def test_a_check_result_survives_json() -> None:
    result = CheckResult("disk", "failed", "full", {"free_mib": 3.5, "dirs": ["/a"]}, 0.25)
    again = CheckReport.from_json(json.loads(json.dumps(result.to_json())))
    assert CheckResult(**again.model_dump()) == result
    assert result.failed


def test_a_finding_survives_json_and_names_its_label() -> None:
    finding = Finding("XID", "replace", "XID 79", {"code": 79, "pci": "0000:3b:00"}, 1700.5)
    again = FindingReport.from_json({"seq": 0, **json.loads(json.dumps(finding.to_json()))})
    assert Finding(**again.model_dump(exclude={"seq"})) == finding
    assert finding.node_health_status == "UnschedulablePendingReplacement"
    assert NODE_HEALTH_STATUS["reboot"] == "UnschedulablePendingReboot"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"kind": "XID", "action": "explode", "message": "m"}, "action"),
        ({"kind": "XID", "action": "reboot"}, "message"),
        ({"kind": "XID", "action": "reboot", "message": "m", "extra": 1}, "extra"),
        ({"kind": "XID", "action": "reboot", "message": "m", "time": "now"}, "time"),
    ],
)
def test_a_bad_finding_is_refused_naming_the_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FindingReport.from_json({"seq": 0, **data})


def test_a_bad_check_result_is_refused() -> None:
    with pytest.raises(ValueError, match="outcome"):
        CheckReport.from_json({"name": "cpu", "outcome": "fine", "message": ""})
    with pytest.raises(ValueError, match="seconds"):
        CheckReport.from_json({"name": "cpu", "outcome": "passed", "message": "", "seconds": -1})


def test_the_package_does_not_import_torch() -> None:
    code = "import sys, trainguard.health, trainguard.health.command; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
