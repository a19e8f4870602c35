"""Separate "hosts" on this machine for multi-host tests: network namespaces on one bridge.

Each :class:`Host` is a network namespace with one veth interface (``eth0`` inside) on a
bridge of its own :class:`NamespaceHosts` instance, and one IPv4 address in that
instance's /24. The bridge holds the subnet's ``.1`` (:attr:`NamespaceHosts.bridge_addr`):
the machine itself, where a controller outside the namespaces can listen. The hosts have
only the subnet's connected route (no default route): they reach each other and the
bridge address, nothing else.

Every process started through :meth:`NamespaceHosts.popen` runs in its host's network
namespace and in a UTS and mount namespace of its own: its hostname is the host's name and
``/etc/hosts`` is a bind-mounted file that maps every host's name to its address (and
localhost to loopback), so a host's own name resolves to its bridge address, never to
127.0.0.1. The machine's ``/sys`` stays as it is (``nsenter`` rather than ``ip netns exec``).

Cutting a host off (:meth:`NamespaceHosts.cut`) sets the host-side veth down. Inside, the
interface keeps its address and route but loses carrier, so every packet it sends or is
sent is dropped silently in both directions, like a pulled cable: connects to or from the
host time out (once the neighbour entry is gone, after ~3 s, they may fail with "no route
to host" instead), established connections hang without a reset, and loopback and the
host's own address still work inside. No iptables needed (it is not installed
everywhere), and unlike an iptables OUTPUT DROP no send fails with EPERM on the cut host.
:meth:`NamespaceHosts.restore` sets it up again, waits until the port forwards and flushes
the neighbour caches, so new connections work at once; TCP's retransmission timers decide
when an established connection's waiting data arrives.

Uniqueness: names of kernel objects come from a tag made of this process's pid and a
counter (``tg<pid36><n36>``: bridge ``<tag>b``, veths ``<tag>v<i>``, namespaces
``<tag>n<i>``, all within the 15-character limit), and the /24 is the first one from
10.200.0.0/16-10.249.0.0/16, starting at a place derived from the same pid and counter,
that overlaps no route of this machine and no nameserver; both are picked under a file
lock, so pytest-xdist workers never clash. Each instance records what it created in
``/run/trainguard-netns/<tag>.json``; a later instance removes what a dead owner left.

Teardown (:meth:`NamespaceHosts.close`) kills by pid: the process group of every process
started through it, then every process still in one of its network namespaces (found by
``/proc/<pid>/ns/net``, which catches children that detached with ``setsid``), until none
is left; then it deletes veths, bridge and namespaces (veths explicitly: ``ip netns del``
frees a namespace, and its veth, asynchronously).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from trainguard.platform.procs import start_time

RUN_DIR = Path("/run/trainguard-netns")
NETNS_DIR = Path("/run/netns")
IFNAME = "eth0"
SUBNET_FIRST = 200 << 8  # 10.200.0.0/24 ...
SUBNET_COUNT = 50 << 8  # ... to 10.249.255.0/24
KILL_TIMEOUT = 10.0
LINK_TIMEOUT = 5.0
REQUIRED_TOOLS = ("ip", "nsenter", "unshare", "sh", "hostname", "mount")
# Inside a process's own UTS and mount namespace: its hostname, its hosts file, its program.
_UNSHARE = ("unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c")
_ENTER = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
_counter = itertools.count()
_live: set[NamespaceHosts] = set()  # closed at exit if a test did not


class NetnsUnavailable(RuntimeError):
    """This machine cannot make namespace hosts (not root, tools missing, creation failed)."""


@dataclass(frozen=True)
class Host:
    """One namespace host."""

    index: int
    name: str  # its hostname, in every host's hosts file
    addr: str  # its IPv4 address on the bridge
    netns: str  # network namespace, /run/netns/<netns>
    ifname: str  # its interface inside (GLOO_SOCKET_IFNAME)
    veth: str  # the host-side peer of ifname, on the bridge


def unavailable_reason() -> str | None:
    """Why namespace hosts cannot be made here, or None when they can be tried."""
    if os.geteuid() != 0:
        return "namespace hosts need root"
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"namespace hosts need {', '.join(missing)} on PATH"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _netns_pids(netns: str) -> list[int]:
    """The pids of the live processes in network namespace ``netns`` (zombies have none)."""
    try:
        ino = (NETNS_DIR / netns).stat().st_ino
    except FileNotFoundError:
        return []
    want = f"net:[{ino}]"
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/ns/net") == want:
                    pids.append(int(entry.name))
    return pids


def _kill_netns(netns: str, timeout: float = KILL_TIMEOUT) -> None:
    """SIGKILL every process in ``netns`` until none is left, then wait until each has
    exited: a dying process leaves its namespaces before it is a zombie."""
    deadline = time.monotonic() + timeout
    killed: set[int] = set()
    while pids := _netns_pids(netns):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes left in {netns} after {timeout:.0f}s: {pids}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(pids)
        time.sleep(0.02)
    while dying := [pid for pid in killed if _running(pid)]:  # waited for, never killed again
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of {netns} still exiting after {timeout:.0f}s: {dying}")
        time.sleep(0.02)


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _remove(record: dict[str, Any]) -> list[str]:
    """Delete what a record lists (processes, veths, bridge, namespaces, files); errors."""
    errors = []
    for netns in record["netns"]:
        try:
            _kill_netns(netns)
        except RuntimeError as e:
            errors.append(str(e))
    for link in [*record["veths"], record["bridge"]]:
        done = _ip("link", "del", link, check=False)
        if done.returncode != 0 and _ip("link", "show", link, check=False).returncode == 0:
            errors.append(f"ip link del {link}: {done.stderr.strip()}")
    for netns in record["netns"]:
        done = _ip("netns", "del", netns, check=False)
        if (NETNS_DIR / netns).exists():
            errors.append(f"ip netns del {netns}: {done.stderr.strip()}")
    shutil.rmtree(record["dir"], ignore_errors=True)
    return errors


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made, with its folder, if missing): one test
    process at a time records, sweeps or tears down (this harness's, slurm_cluster's)."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _sweep_stale() -> None:
    """Remove what instances of dead processes left behind (caller holds the lock)."""
    for path in RUN_DIR.glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if start_time(record["owner"]) != record["owner_start"] and not _remove(record):
            path.unlink(missing_ok=True)


def _tag_taken(tag: str) -> bool:
    """Whether ``tag`` has a record or a bridge already (caller holds the lock)."""
    return (RUN_DIR / f"{tag}.json").exists() or Path(f"/sys/class/net/{tag}b").exists()


def _taken_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 route's destination on this machine, and every nameserver."""
    taken = []
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst", "default")
        if dst != "default":
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.IPv4Network(dst, strict=False))
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    taken.append(ipaddress.IPv4Network(words[1]))
    return taken


def _pick_subnet(seed: int) -> ipaddress.IPv4Network:
    taken = _taken_networks()
    for step in range(SUBNET_COUNT):
        n = SUBNET_FIRST + (seed + step) % SUBNET_COUNT
        net = ipaddress.IPv4Network(f"10.{n >> 8}.{n & 0xFF}.0/24")
        if not any(net.overlaps(other) for other in taken):
            return net
    raise NetnsUnavailable("no free /24 in 10.200.0.0-10.249.255.255")


class NamespaceHosts:
    """``count`` namespace hosts on a bridge of their own; a context manager.

    Hostnames are ``<prefix><i>`` (``node0``, ``node1``, ...): private to the hosts'
    processes, so two instances may use the same ones. Raises :class:`NetnsUnavailable`
    when the machine cannot make them (having removed whatever it had made).
    """

    def __init__(self, count: int, *, prefix: str | None = None) -> None:
        prefix = prefix or "node"
        if not 1 <= count <= 250:
            raise ValueError(f"count must be 1..250, not {count}")
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,40}", prefix):
            raise ValueError(f"prefix {prefix!r} does not make hostnames")
        why = unavailable_reason()
        if why:
            raise NetnsUnavailable(why)
        self._procs: list[subprocess.Popen[Any]] = []
        self._cut: set[str] = set()
        self._closed = False
        self._owner = os.getpid()
        self.hosts: list[Host] = []
        with locked(RUN_DIR / "lock"):
            _sweep_stale()
            n = next(_counter)
            while _tag_taken(tag := f"tg{_base36(os.getpid())}{_base36(n)}"):
                n = next(_counter)
            self.tag = tag
            self.subnet = _pick_subnet(os.getpid() * 8 + n)
            self.bridge = f"{self.tag}b"
            self.bridge_addr = str(self.subnet[1])
            self.dir = RUN_DIR / self.tag
            self.hosts_file = self.dir / "hosts"
            self.hosts = [
                Host(
                    index=i,
                    name=f"{prefix}{i}",
                    addr=str(self.subnet[i + 2]),
                    netns=f"{self.tag}n{i}",
                    ifname=IFNAME,
                    veth=f"{self.tag}v{i}",
                )
                for i in range(count)
            ]
            self._record_path = RUN_DIR / f"{self.tag}.json"
            self._record_path.write_text(json.dumps(self._record()))
            _live.add(self)
            try:
                self._create()
            except BaseException:
                with contextlib.suppress(RuntimeError):
                    self.close()
                raise

    def _record(self) -> dict[str, Any]:
        return {
            "owner": os.getpid(),
            "owner_start": start_time(os.getpid()),
            "bridge": self.bridge,
            "veths": [h.veth for h in self.hosts],
            "netns": [h.netns for h in self.hosts],
            "dir": str(self.dir),
        }

    def _create(self) -> None:
        self.dir.mkdir(mode=0o755)
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{h.addr}\t{h.name}" for h in self.hosts]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        _ip("link", "add", self.bridge, "type", "bridge", "forward_delay", "0")
        _ip("addr", "add", f"{self.bridge_addr}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", h.ifname, "netns", h.netns)
            _ip("link", "set", h.veth, "master", self.bridge, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/{self.subnet.prefixlen}", "dev", h.ifname)
            _ip("-n", h.netns, "link", "set", h.ifname, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")

    def __enter__(self) -> NamespaceHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def argv(self, host: Host, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` as a process of ``host``."""
        enter = [f"--net={NETNS_DIR / host.netns}", *_UNSHARE, _ENTER, "sh", host.name]
        return ["nsenter", *enter, str(self.hosts_file), *argv]

    def popen(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        **kw: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host``, in a new session; killed by :meth:`close`.

        ``stdout``/``stderr`` default to this process's (pytest captures them); the
        environment defaults to this process's.
        """
        if self._closed:
            raise RuntimeError("NamespaceHosts is closed")
        proc = subprocess.Popen(
            self.argv(host, argv),
            env=env,
            cwd=cwd,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            **kw,
        )
        self._procs.append(proc)
        return proc

    def run(
        self, host: Host, argv: Sequence[str], timeout: float = 60.0, **kw: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` on ``host`` to its end; output captured as text unless ``kw`` says.

        Past ``timeout`` its whole session is killed and TimeoutExpired raised.
        """
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        proc = self.popen(host, argv, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def cut(self, host: Host) -> None:
        """Cut ``host`` off the network: its bridge-side veth goes down (see the module)."""
        _ip("link", "set", host.veth, "down")
        self._cut.add(host.name)

    def restore(self, host: Host, timeout: float = LINK_TIMEOUT) -> None:
        """Put ``host`` back on the network; returns once its link forwards again.

        Address resolutions begun during the cut are flushed (everywhere on the bridge):
        left alone, a connect right after restore waits for the next ARP retry (1 s).
        TCP's own retransmissions (established connections, pending connects) keep their
        timers.
        """
        _ip("link", "set", host.veth, "up")
        deadline = time.monotonic() + timeout
        while not self._forwarding(host):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{host.name}'s link is not up {timeout:.0f}s after restore")
            time.sleep(0.01)
        _ip("neigh", "flush", "dev", self.bridge)
        for h in self.hosts:
            _ip("-n", h.netns, "neigh", "flush", "dev", h.ifname)
        self._cut.discard(host.name)

    def _forwarding(self, host: Host) -> bool:
        """Whether both ends of ``host``'s veth are up and its bridge port forwards."""
        veth = Path("/sys/class/net") / host.veth
        try:
            up = (veth / "operstate").read_text().strip() == "up"
            forwarding = (veth / "brport" / "state").read_text().strip() == "3"
        except OSError:
            return False
        inside = _ip("-n", host.netns, "-j", "link", "show", host.ifname).stdout
        return up and forwarding and json.loads(inside)[0].get("operstate") == "UP"

    def is_cut(self, host: Host) -> bool:
        return host.name in self._cut

    def pids(self, host: Host) -> list[int]:
        """The live processes on ``host`` (every process in its network namespace)."""
        return _netns_pids(host.netns)

    def kill(self, host: Host) -> None:
        """SIGKILL every process of ``host`` (a host that crashes; it stays on the network)."""
        _kill_netns(host.netns)

    def close(self) -> None:
        """Kill every process started here and everything still in the namespaces, then
        delete veths, bridge, namespaces and files. Idempotent; raises if something stayed."""
        if self._closed or os.getpid() != self._owner:  # not in a forked child
            return
        self._closed = True
        _live.discard(self)
        for proc in self._procs:
            if proc.poll() is None:
                _killpg(proc.pid)
        errors = _remove(self._record())
        for proc in self._procs:
            try:
                proc.wait(timeout=KILL_TIMEOUT)
            except subprocess.TimeoutExpired:
                errors.append(f"pid {proc.pid} did not exit")
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        if errors:  # the record stays, for a later sweep
            raise RuntimeError("namespace hosts teardown: " + "; ".join(errors))
        self._record_path.unlink(missing_ok=True)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@atexit.register
def _close_all() -> None:
    for hosts in list(_live):
        with contextlib.suppress(Exception):
            hosts.close()


@contextlib.contextmanager
def factory() -> Iterator[Callable[..., NamespaceHosts]]:
    """``make(count, prefix=None)`` for a test; skips the test when the machine cannot make
    namespace hosts, and closes every instance made, however the test ends."""

    made: list[NamespaceHosts] = []

    def make(count: int, *, prefix: str | None = None) -> NamespaceHosts:
        try:
            hosts = NamespaceHosts(count, prefix=prefix)
        except NetnsUnavailable as e:
            print(f"namespace hosts unavailable: {e}")
            pytest.skip(f"namespace hosts unavailable: {e}")
        made.append(hosts)
        return hosts

    try:
        yield make
    finally:
        errors = []
        for hosts in made:
            try:
                hosts.close()
            except RuntimeError as e:
                errors.append(str(e))
        if errors:
            raise RuntimeError("; ".join(errors))
