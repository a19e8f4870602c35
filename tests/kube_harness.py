"""A Kubernetes stand-in for the operator's tests: an API server and a kubelet on this machine.

- :class:`ApiServer`: kmock's ``KubernetesEmulator`` (a stateful API over HTTP, with
  watches) on a background thread, filling in what a real API server adds on create
  (namespace, uid, creationTimestamp) and serving pod logs from the kubelet.
- :class:`Kubelet`: polls the pods, schedules each onto a fake Node (as the API server
  has it now: labels and taints) that is not cordoned, satisfies its required node
  affinity (In, NotIn, Exists, DoesNotExist) and whose NoSchedule/NoExecute taints it
  tolerates, preferring the Nodes its preferred node affinity weighs most, then the
  least loaded (a pod that names its ``spec.nodeName``, as a DaemonSet's do, goes
  there); it does not count resources. It runs its first
  container's command as a local process group with its own loopback pod IP
  (127.77.0.N) and its environment (``value``, ``fieldRef`` podIP/name/namespace/
  nodeName, ``secretKeyRef``, ``$(VAR)`` expansion), and writes the pod status back
  (Running with podIP, then Succeeded/Failed with the exit code). A deleted pod gets
  SIGTERM, then SIGKILL after a grace period; an evicted one (:meth:`Kubelet.evict`)
  the ``DisruptionTarget`` condition first, the same ending, and the reason Evicted. Its
  processes' ``$HOME`` is the kubelet's root: a kubeconfig at ``<root>/.kube/config`` is
  what they connect with.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock

from trainguard.kube.api import KubeApi, NotFound

Obj = dict[str, Any]
REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
POLL_SECONDS = 0.2
DELETE_GRACE_SECONDS = 5.0

RESOURCES: dict[str, kmock.ResourceInfo] = {
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        namespaced=False, kind="CustomResourceDefinition"
    ),
    "v1/namespaces": kmock.ResourceInfo(namespaced=False, kind="Namespace"),
    "v1/nodes": kmock.ResourceInfo(namespaced=False, kind="Node"),
    "v1/pods": kmock.ResourceInfo(namespaced=True, kind="Pod", subresources={"status", "log"}),
    "v1/services": kmock.ResourceInfo(namespaced=True, kind="Service"),
    "v1/secrets": kmock.ResourceInfo(namespaced=True, kind="Secret"),
    "v1/events": kmock.ResourceInfo(namespaced=True, kind="Event"),
    "v1/serviceaccounts": kmock.ResourceInfo(namespaced=True, kind="ServiceAccount"),
    "apps/v1/deployments": kmock.ResourceInfo(namespaced=True, kind="Deployment"),
    "apps/v1/daemonsets": kmock.ResourceInfo(namespaced=True, kind="DaemonSet"),
    "rbac.authorization.k8s.io/v1/clusterroles": kmock.ResourceInfo(
        namespaced=False, kind="ClusterRole"
    ),
    "rbac.authorization.k8s.io/v1/clusterrolebindings": kmock.ResourceInfo(
        namespaced=False, kind="ClusterRoleBinding"
    ),
    "rbac.authorization.k8s.io/v1/roles": kmock.ResourceInfo(namespaced=True, kind="Role"),
    "rbac.authorization.k8s.io/v1/rolebindings": kmock.ResourceInfo(
        namespaced=True, kind="RoleBinding"
    ),
    "coordination.k8s.io/v1/leases": kmock.ResourceInfo(namespaced=True, kind="Lease"),
    "networking.k8s.io/v1/networkpolicies": kmock.ResourceInfo(
        namespaced=True, kind="NetworkPolicy"
    ),
    # Kueue's resources (kube/kueue.py): the tests play Kueue's controller.
    "kueue.x-k8s.io/v1beta1/workloads": kmock.ResourceInfo(
        namespaced=True, kind="Workload", subresources={"status"}
    ),
    "kueue.x-k8s.io/v1beta1/localqueues": kmock.ResourceInfo(namespaced=True, kind="LocalQueue"),
    "kueue.x-k8s.io/v1beta1/clusterqueues": kmock.ResourceInfo(
        namespaced=False, kind="ClusterQueue"
    ),
    "trainguard.dev/v1/trainingjobs": kmock.ResourceInfo(
        namespaced=True,
        kind="TrainingJob",
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
}


def now_rfc3339() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Emulator(kmock.KubernetesEmulator):
    """The emulator plus what a real API server fills in when an object is created."""

    async def _handle(self, request: kmock.Request) -> Any:
        if (
            request.resource is not None
            and request.action == kmock.action.CREATE
            and isinstance(request.data, dict)
        ):
            meta = request.data.setdefault("metadata", {})
            if request.namespace and not meta.get("namespace"):
                meta["namespace"] = request.namespace
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now_rfc3339())
            meta.setdefault("resourceVersion", "1")
        return await super()._handle(request)


class ApiServer:
    """The emulated API server on 127.0.0.1:<port>, run on its own thread and event loop."""

    def __init__(self) -> None:
        self.port = 0
        self.logs: dict[tuple[str, str], Path] = {}  # (namespace, pod) -> log file
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name="kube-api")
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the emulated API server did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {}}],
                    "contexts": [
                        {
                            "name": "emulator",
                            "context": {
                                "cluster": "emulator",
                                "user": "tester",
                                "namespace": namespace,
                            },
                        }
                    ],
                    "current-context": "emulator",
                }
            )
        )
        return path

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        emulator = _Emulator()
        for key, info in RESOURCES.items():
            emulator.resources[key] = info
        emulator["get", kmock.subresource("log")] << self._pod_log
        async with emulator, kmock.Server(emulator) as server:
            self.port = server.port
            self._ready.set()
            await self._stop.wait()

    def _pod_log(self, request: kmock.Request) -> bytes:
        """The pod's output, raw (a ``str`` would be served as a JSON string)."""
        path = self.logs.get((str(request.namespace), str(request.name)))
        return path.read_bytes() if path is not None and path.exists() else b""


@dataclass
class PodProcess:
    namespace: str
    name: str
    ip: str
    node: str
    process: subprocess.Popen[bytes]
    log: Path
    container: str
    reported: bool = False  # its end was written to the pod status
    evicted: str | None = None  # why the kubelet evicted it (its status message)
    pids: set[int] = field(default_factory=set)


class Kubelet:
    """Runs the emulator's pods as local processes; see the module docstring."""

    def __init__(self, server: ApiServer, api: KubeApi, root: Path, nodes: dict[str, Obj]) -> None:
        self.server = server
        self.api = api
        self.root = root
        self.nodes = nodes  # node name -> labels
        self.pods: dict[tuple[str, str], PodProcess] = {}
        self.started: list[str] = []  # pod names, in start order
        self._next_ip = 2
        self._halt = threading.Event()
        self._lock = threading.Lock()
        for name, labels in nodes.items():
            api.core.create_node(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "labels": {"kubernetes.io/hostname": name, **labels},
                    },
                },
                _preload_content=False,
            )
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kubelet")
        self._thread.start()

    # -- for tests -----------------------------------------------------------------------

    def process(self, name: str) -> PodProcess:
        with self._lock:
            for pod in self.pods.values():
                if pod.name == name:
                    return pod
        raise KeyError(name)

    def kill_pod(self, name: str) -> None:
        """SIGKILL every process of the pod at once, as when its container or node dies.

        Every process is frozen (SIGSTOP) first: none of them sees another die, so the
        agent cannot report its workers' deaths before its own, just as in a pod whose
        processes a container runtime kills together.
        """
        pod = self.process(name)
        _kill_tree(pod.process.pid, signal.SIGSTOP)
        _kill_tree(pod.process.pid, signal.SIGKILL)

    def evict(
        self, name: str, grace: float, reason: str = "TerminationByKubelet", message: str = ""
    ) -> threading.Thread:
        """Evict the pod as a kubelet under node pressure does: the condition
        ``DisruptionTarget`` (``reason``) at once; after ``grace`` seconds the pod's first
        process (its container's) gets SIGTERM, and what is left of the pod SIGKILL after
        the delete grace period; the pod ends Failed with the reason Evicted. Returns the
        thread that ends it."""
        pod = self.process(name)
        message = message or "The node was low on resource: memory."
        condition = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": now_rfc3339(),
        }
        raw = self.api.core.read_namespaced_pod(name, pod.namespace, _preload_content=False)
        conditions = (json.loads(raw.data).get("status") or {}).get("conditions") or []
        self._patch_status(pod.namespace, name, {"conditions": [*conditions, condition]})

        def end() -> None:
            self._halt.wait(grace)
            pod.evicted = message
            with contextlib.suppress(ProcessLookupError):
                pod.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                pod.process.wait(DELETE_GRACE_SECONDS)
            _kill_tree(pod.process.pid, signal.SIGKILL)

        thread = threading.Thread(target=end, daemon=True, name=f"evict-{name}")
        thread.start()
        return thread

    def all_pids(self, prefix: str = "") -> set[int]:
        """Every process seen in the pods whose name starts with ``prefix`` (agents, workers)."""
        with self._lock:
            return {
                pid for pod in self.pods.values() if pod.name.startswith(prefix) for pid in pod.pids
            }

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(10)
        with self._lock:
            pods = list(self.pods.values())
        for pod in pods:
            _kill_tree(pod.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                pod.process.wait(10)

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._halt.wait(POLL_SECONDS):
            try:
                self._sync()
            except Exception as exc:  # keep going: a test sees the effect, not a dead thread
                print(f"kubelet: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _sync(self) -> None:
        raw = self.api.core.list_pod_for_all_namespaces(_preload_content=False)
        listed = {
            (p["metadata"]["namespace"], p["metadata"]["name"]): p
            for p in json.loads(raw.data).get("items") or []
        }
        for key, pod in listed.items():
            deleting = bool(pod["metadata"].get("deletionTimestamp"))
            if key not in self.pods and not deleting and not pod.get("status", {}).get("phase"):
                self._start(pod)
        with self._lock:
            running = list(self.pods.items())
        for key, proc in running:
            proc.pids |= _tree(proc.process.pid)
            pod = listed.get(key)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                if proc.process.poll() is None:
                    threading.Thread(target=_terminate, args=(proc,), daemon=True).start()
                continue
            code = proc.process.poll()
            if code is not None and not proc.reported:
                proc.reported = True
                self._report_end(proc, code)

    def _start(self, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        namespace, name = meta["namespace"], meta["name"]
        node = self._schedule(pod)
        if node is None:
            self._patch_status(
                namespace,
                name,
                {
                    "phase": "Pending",
                    "conditions": [
                        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
                    ],
                },
            )
            return
        ip = f"127.77.0.{self._next_ip}"
        self._next_ip += 1
        container = spec["containers"][0]
        env = self._environment(container, namespace, name, ip, node)
        argv = [
            _expand(arg, env) for arg in [*container.get("command", []), *container.get("args", [])]
        ]
        log = self.root / "pods" / f"{namespace}-{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cwd = container.get("workingDir") or str(self.root)
        with open(log, "ab") as out:
            process = subprocess.Popen(
                argv,
                env={
                    "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
                    "HOME": str(self.root),
                    **env,
                },
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        with self._lock:
            self.pods[(namespace, name)] = PodProcess(
                namespace, name, ip, node, process, log, container["name"]
            )
            self.started.append(name)
        self.server.logs[(namespace, name)] = log
        self.api.core.patch_namespaced_pod(
            name, namespace, {"spec": {"nodeName": node}}, _preload_content=False
        )
        self._patch_status(
            namespace,
            name,
            {
                "phase": "Running",
                "podIP": ip,
                "hostIP": "127.0.0.1",
                "startTime": now_rfc3339(),
                "containerStatuses": [
                    {
                        "name": container["name"],
                        "ready": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": now_rfc3339()}},
                    }
                ],
            },
        )

    def _report_end(self, proc: PodProcess, code: int) -> None:
        exit_code = 128 - code if code < 0 else code  # a signal: 128 + signal number
        evicted = {"reason": "Evicted", "message": proc.evicted} if proc.evicted else {}
        with contextlib.suppress(NotFound):
            self._patch_status(
                proc.namespace,
                proc.name,
                {
                    **evicted,
                    "phase": "Failed" if evicted or exit_code else "Succeeded",
                    "containerStatuses": [
                        {
                            "name": proc.container,
                            "ready": False,
                            "restartCount": 0,
                            "state": {
                                "terminated": {"exitCode": exit_code, "finishedAt": now_rfc3339()}
                            },
                        }
                    ],
                },
            )

    def _patch_status(self, namespace: str, name: str, status: Obj) -> None:
        try:
            self.api.core.patch_namespaced_pod_status(
                name, namespace, {"status": status}, _preload_content=False
            )
        except Exception as exc:
            if "404" not in str(exc):
                raise

    def _schedule(self, pod: Obj) -> str | None:
        """The fitting node its preferred affinity weighs most, then the one with the
        fewest of our pods (so a job's pods spread out); or the node the pod names."""
        spec = pod["spec"]
        if spec.get("nodeName"):
            return str(spec["nodeName"])
        node_affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
        required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
        terms = (required or {}).get("nodeSelectorTerms") or [{}]
        preferred = node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        selector = spec.get("nodeSelector") or {}
        tolerations = spec.get("tolerations") or []
        raw = self.api.core.list_node(_preload_content=False)
        nodes = {
            n["metadata"]["name"]: n
            for n in json.loads(raw.data).get("items") or []
            if n["metadata"]["name"] in self.nodes
        }
        load = {n: 0 for n in nodes}
        with self._lock:
            for running in self.pods.values():
                if running.process.poll() is None and running.node in load:
                    load[running.node] += 1
        score: dict[str, int] = {}
        for name, node in nodes.items():
            labels = {"kubernetes.io/hostname": name, **(node["metadata"].get("labels") or {})}
            taints = (node.get("spec") or {}).get("taints") or []
            if (
                not (node.get("spec") or {}).get("unschedulable")  # cordoned
                and all(labels.get(k) == v for k, v in selector.items())
                and any(_term_matches(t, labels) for t in terms)
                and all(_tolerated(t, tolerations) for t in taints)
            ):
                score[name] = sum(
                    int(p.get("weight", 0))
                    for p in preferred
                    if _term_matches(p.get("preference") or {}, labels)
                )
        return min(score, key=lambda n: (-score[n], load[n], n)) if score else None

    def _environment(
        self, container: Obj, namespace: str, name: str, ip: str, node: str
    ) -> dict[str, str]:
        env: dict[str, str] = {}
        fields = {
            "status.podIP": ip,
            "metadata.name": name,
            "metadata.namespace": namespace,
            "spec.nodeName": node,
        }
        for var in container.get("env") or []:
            source = var.get("valueFrom")
            if source is None:
                env[var["name"]] = _expand(var.get("value") or "", env)
            elif "fieldRef" in source:
                env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                raw = self.api.read_secret(namespace, ref["name"])
                env[var["name"]] = base64.b64decode(raw["data"][ref["key"]]).decode()
        return env


def _term_matches(term: Obj, labels: dict[str, str]) -> bool:
    for expr in term.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _tolerated(taint: Obj, tolerations: list[Obj]) -> bool:
    """A taint a pod may land under: PreferNoSchedule, or one of its tolerations matches."""
    if taint.get("effect") not in ("NoSchedule", "NoExecute"):
        return True
    for toleration in tolerations:
        if toleration.get("effect") not in (None, "", taint.get("effect")):
            continue
        if toleration.get("operator") == "Exists":
            if toleration.get("key") in (None, "", taint.get("key")):
                return True
        elif toleration.get("key") == taint.get("key") and toleration.get("value") == taint.get(
            "value"
        ):
            return True
    return False


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names replaced, ``$$`` is a literal ``$``."""

    def one(match: re.Match[str]) -> str:
        if match.group(1) is None:
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR.sub(one, text)


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        ppid = int(raw[raw.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def _tree(pid: int) -> set[int]:
    """``pid`` and all its live descendants."""
    children = _children()
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        if current in found:
            continue
        found.add(current)
        todo += children.get(current, [])
    return found


def _kill_tree(pid: int, sig: signal.Signals) -> None:
    for target in _tree(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, sig)


def _terminate(proc: PodProcess) -> None:
    """What a kubelet does to a deleted pod: SIGTERM, then SIGKILL after the grace period."""
    _kill_tree(proc.process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.process.wait(DELETE_GRACE_SECONDS)
    _kill_tree(proc.process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.process.wait(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quiet_port_base(count: int = 16) -> int:
    """The first of ``count`` ports free on every address and below the ephemeral range.

    Rank 0's store binds the rendezvous port on every address, late; an ephemeral port
    (what :func:`free_port` returns) may meanwhile be the local end of any connection on
    this machine, and the store then fails with EADDRINUSE. Below the range only a
    listener can take a port.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, max(10001, low - count))
        if all(_bindable(port) for port in range(base, base + count)):
            return base
    raise RuntimeError("no free port range below the ephemeral ports")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
