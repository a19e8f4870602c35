"""Continuous monitors: kernel log lines through the file hook, free space, memory
pressure, nvidia-smi (a fake one), and the watch that runs them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainguard.health import (
    KERNEL_LOG_ENV,
    FileSource,
    Finding,
    HealthWatch,
    KernelLogMonitor,
    KmsgSource,
    MemoryPressureMonitor,
    NvidiaSmiMonitor,
    SpaceMonitor,
    continuous_watch,
    default_sources,
    set_disk_full,
    xid_line,
)
from trainguard.health.kernel_log import kmsg_message
from trainguard.health.procfs import free_mib
from trainguard.health.xid import parse_line

XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."


def append(path: Path, *lines: str) -> None:
    with path.open("a") as file:
        file.write("".join(line + "\n" for line in lines))


@pytest.fixture
def kernel_log(tmp_path: Path) -> Path:
    path = tmp_path / "kern.log"
    path.write_text("NVRM: Xid (PCI:0000:aa:00): 79, pid=1, logged before the monitor\n")
    return path


def test_an_xid_79_line_is_one_replace_finding_with_its_code_and_gpu(kernel_log: Path) -> None:
    monitor = KernelLogMonitor([FileSource(str(kernel_log))])
    assert monitor.poll(1.0) == []  # the line logged before it started is not news
    append(kernel_log, "[12345.678] some other kernel line", XID_79)
    (finding,) = monitor.poll(2.0)
    assert (finding.kind, finding.action, finding.time) == ("XID", "replace", 2.0)
    assert finding.evidence["code"] == 79
    assert finding.evidence["pci"] == "0000:3b:00"
    assert finding.evidence["pid"] == "1234"
    assert "0000:3b:00" in finding.message
    append(kernel_log, XID_79, XID_79)
    assert monitor.poll(3.0) == []  # the same fault again: no flood
    append(kernel_log, xid_line(79, pci="0000:3c:00"))
    (other_gpu,) = monitor.poll(4.0)
    assert other_gpu.evidence["pci"] == "0000:3c:00"


def test_an_application_xid_is_not_a_node_fault(kernel_log: Path) -> None:
    monitor = KernelLogMonitor([FileSource(str(kernel_log))])
    append(kernel_log, "NVRM: Xid (PCI:0000:3b:00): 13, pid=99, Graphics Exception on GPC 0")
    append(kernel_log, "NVRM: Xid (PCI:0000:3b:00): 31, pid=99, MMU Fault")
    assert monitor.poll(1.0) == []
    assert monitor.application_xids == 2


def test_xid_codes_map_to_their_action() -> None:
    actions = {code: parse_line(xid_line(code)) for code in (48, 63, 64, 74, 94, 95, 43, 999)}
    assert {code: event.action for code, event in actions.items() if event} == {
        48: "reboot",
        63: "reboot",
        64: "replace",
        74: "reboot",
        94: "reboot",
        95: "reboot",
        43: None,
        999: "reboot",  # unknown codes: a node fault, the cheaper remedy
    }
    old_format = parse_line("kernel: NVRM: Xid (0000:3B:00.0): 48, Ch 00000010, DBE")
    assert old_format is not None and (old_format.code, old_format.pci) == (48, "0000:3b:00")
    off_bus = parse_line("NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.")
    assert off_bus is not None and (off_bus.kind, off_bus.action) == ("NVRM", "replace")
    assert parse_line("NVRM: loading NVIDIA UNIX x86_64 Kernel Module 550.54") is None
    assert parse_line("usb 1-1: new high-speed USB device") is None


def test_a_truncated_log_is_read_again_from_its_start(kernel_log: Path) -> None:
    source = FileSource(str(kernel_log))
    monitor = KernelLogMonitor([source])
    monitor.poll(1.0)
    append(kernel_log, "filler line " * 20, "another filler line " * 20)
    assert monitor.poll(2.0) == []
    kernel_log.write_text(xid_line(48, pci="0000:01:00") + "\n")  # truncated, shorter
    (finding,) = monitor.poll(3.0)
    assert (finding.evidence["code"], finding.action) == (48, "reboot")
    replaced = kernel_log.with_suffix(".new")
    replaced.write_text(xid_line(74, pci="0000:02:00") + "\n" + "x" * 4000 + "\n")
    os.replace(replaced, kernel_log)  # rotated: a new file, longer than the old offset
    (nvlink,) = monitor.poll(4.0)
    assert nvlink.evidence["code"] == 74


def test_a_log_that_appears_later_is_read_whole_and_partial_lines_wait(tmp_path: Path) -> None:
    path = tmp_path / "later.log"
    source = FileSource(str(path))
    assert source.read_lines() == []
    path.write_text("first\nsecond without end")
    assert source.read_lines() == ["first"]
    append(path, " of line")
    assert source.read_lines() == ["second without end of line"]


def test_kmsg_records_and_the_real_device() -> None:
    record = b"4,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=7, off the bus\n DEVICE=x\n"
    assert kmsg_message(record) == "NVRM: Xid (PCI:0000:3b:00): 79, pid=7, off the bus"
    try:
        source = KmsgSource()
    except OSError:
        pytest.skip("/dev/kmsg cannot be read here")
    try:
        assert isinstance(source.read_lines(), list)  # never blocks
    finally:
        source.close()


def test_the_env_hook_names_the_file_source(tmp_path: Path) -> None:
    path = str(tmp_path / "kern.log")
    sources = default_sources({KERNEL_LOG_ENV: path})
    assert sources[0].name == path
    assert all(source.name != path for source in default_sources({}))
    for source in sources:
        source.close()


def test_low_space_is_reported_once_until_it_clears(tmp_path: Path) -> None:
    monitor = SpaceMonitor(str(tmp_path), min_free_mib=free_mib(tmp_path) * 10 + 1024)
    (finding,) = monitor.poll(1.0)
    assert (finding.kind, finding.action) == ("DiskSpace", "replace")
    assert finding.evidence["directory"] == str(tmp_path)
    assert monitor.poll(2.0) == []
    monitor.min_free_mib = 1
    assert monitor.poll(3.0) == []  # cleared
    monitor.min_free_mib = 1e12
    assert len(monitor.poll(4.0)) == 1  # back again: reported again


def test_disk_full_can_be_injected_and_taken_back(tmp_path: Path) -> None:
    watch = HealthWatch([SpaceMonitor(str(tmp_path), min_free_mib=1, interval=0)])
    assert watch.poll(1.0) == []
    assert set_disk_full(watch, True) == 1
    (finding,) = watch.poll(2.0)
    assert finding.evidence["injected"] is True
    assert "injected" in finding.message
    set_disk_full(watch, False)
    assert watch.poll(3.0) == []
    set_disk_full(watch, True)
    assert len(watch.poll(4.0)) == 1


def test_memory_pressure_from_psi_or_little_available(tmp_path: Path) -> None:
    (tmp_path / "pressure").mkdir()
    psi = tmp_path / "pressure" / "memory"
    meminfo = tmp_path / "meminfo"
    psi.write_text("some avg10=55.00 avg60=10.00 avg300=1.00 total=1\nfull avg10=0 total=0\n")
    meminfo.write_text("MemTotal: 1000000 kB\nMemAvailable: 500000 kB\n")
    monitor = MemoryPressureMonitor(proc=tmp_path)
    (finding,) = monitor.poll(1.0)
    assert (finding.kind, finding.action) == ("MemoryPressure", "reboot")
    assert finding.evidence["psi_some_avg10"] == 55.0
    assert monitor.poll(2.0) == []
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n")
    assert monitor.poll(3.0) == []
    meminfo.write_text("MemTotal: 1000000 kB\nMemAvailable: 1000 kB\n")
    (short,) = monitor.poll(4.0)
    assert "0.1% of memory available" in short.message
    assert MemoryPressureMonitor().poll(5.0) == []  # this machine is calm


def fake_nvidia_smi(tmp_path: Path, output: str, code: int = 0) -> str:
    script = tmp_path / "nvidia-smi"
    (tmp_path / "out.csv").write_text(output)
    script.write_text(f"#!/bin/sh\ncat '{tmp_path / 'out.csv'}'\nexit {code}\n")
    script.chmod(0o755)
    return str(script)


def test_nvidia_smi_gives_count_and_ecc_findings(tmp_path: Path) -> None:
    healthy = "0, 00000000:3B:00.0, GPU-a, 0\n1, 00000000:3C:00.0, GPU-b, [N/A]\n"
    monitor = NvidiaSmiMonitor(expected_gpus=2, nvidia_smi=fake_nvidia_smi(tmp_path, healthy))
    assert monitor.poll(1.0) == []
    fake_nvidia_smi(tmp_path, "0, 00000000:3B:00.0, GPU-a, 2\n")
    findings = {f.kind: f for f in monitor.poll(2.0)}
    assert findings["GpuCount"].action == "replace"
    assert findings["GpuCount"].message == "GPU count: expected 2, got 1"
    assert findings["Ecc"].action == "reboot"
    assert findings["Ecc"].evidence["uncorrected_ecc"] == 2
    assert monitor.poll(3.0) == []
    fake_nvidia_smi(tmp_path, "No devices were found\n", code=6)
    assert monitor.poll(4.0) == []  # still missing: already reported


def test_without_nvidia_smi_there_is_nothing_to_find() -> None:
    monitor = NvidiaSmiMonitor(expected_gpus=8)
    monitor.nvidia_smi = None  # as where it is not installed
    assert monitor.poll(1.0) == []


def test_a_failing_nvidia_smi_counts_what_it_listed(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, "Unable to determine the device handle for GPU0\n", code=15)
    (finding,) = NvidiaSmiMonitor(expected_gpus=8, nvidia_smi=smi).poll(1.0)
    assert finding.kind == "GpuCount"
    assert "exit 15" in finding.message
    assert finding.evidence["gpu_count"] == 0


class Broken:
    name = "broken"
    interval = 0.0

    def poll(self, now: float) -> list[Finding]:
        raise OSError("gone")


class Counting:
    name = "counting"
    interval = 10.0

    def __init__(self) -> None:
        self.polls = 0

    def poll(self, now: float) -> list[Finding]:
        self.polls += 1
        return []


def test_the_watch_polls_each_monitor_at_its_interval_and_survives_errors() -> None:
    tick = [0.0]
    counting = Counting()
    watch = HealthWatch([Broken(), counting], clock=lambda: tick[0])
    for t in (0.0, 5.0, 9.9, 10.0, 15.0, 20.0):
        tick[0] = t
        assert watch.poll(1000.0 + t) == []
    assert counting.polls == 3
    assert watch.errors == {"broken": "OSError: gone"}


def test_the_default_watch_runs_here(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    watch = continuous_watch(str(tmp_path), env={KERNEL_LOG_ENV: str(log)})
    assert watch.poll() == []
    assert watch.errors == {}
    append(log, xid_line(79))
    (kernel,) = [m for m in watch.monitors if isinstance(m, KernelLogMonitor)]
    assert [f.kind for f in kernel.poll(1.0)] == ["XID"]
    watch.close()
