"""The pure half of the Slurm harness (tests/slurm_cluster.py): slurm.conf as a function of
the cluster's layout, and readers of ``scontrol`` output. No process, no file.

The configuration is Debian's slurm-wlm 22.05 on a machine without systemd or cgroup
delegation: ``proctrack/linuxproc`` and ``task/none`` (no cgroup plugin to set up),
``select/cons_tres`` with ``CR_CPU`` (jobs share a node by CPU; with memory as a resource
every job would take the node's whole declared memory), and ``SlurmdParameters=
config_overrides`` so that ``CPUs=N`` may declare more CPUs than a 2-core box has. Root runs
everything (``SlurmUser``/``SlurmdUser``). There is no slurmdbd: ``JobCompType=
jobcomp/filetxt`` records finished jobs, and ``scontrol show job`` keeps them for
``MinJobAge``.

:data:`FAST` shortens Slurm's timers for fault tests; what they give, measured, is in
tests/slurm_cluster.py's docstring. ``cred_expire`` (in ``AuthInfo``) is 10 s instead of
120 s: a requeued job may start only once its old credential has expired.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

# Slurm's timers, short for fault tests.
FAST = {
    "SlurmdTimeout": "10",  # a silent node is NOT_RESPONDING, then DOWN, after 10-20 s
    "MessageTimeout": "5",  # one RPC's wait (default 10)
    "KillWait": "5",  # SIGTERM to SIGKILL on cancel or time limit (default 30)
    "SchedulerParameters": "sched_interval=2,bf_interval=1",  # scheduling passes (60 s, 30 s)
    "ReturnToService": "2",  # a DOWN node that registers again is usable at once
    "MinJobAge": "600",  # finished jobs stay in `scontrol show job` (no sacct here)
}
CRED_EXPIRE = 10  # seconds; a requeued job runs again after this (default 120)
# A key of `scontrol show -o`: a word of letters, digits and _:/ right before "=".
_KEY = re.compile(r"(?:^|\s)(?=[A-Za-z][A-Za-z0-9_:/]*=)")


def slurm_conf(
    *,
    cluster_name: str,
    controller: tuple[str, str],
    port: int,
    directory: Path,
    nodes: Mapping[str, str],
    partition: str,
    cpus: int,
    extra: Mapping[str, str] | None = None,
) -> str:
    """slurm.conf's text. ``controller``: (hostname, address) of slurmctld's machine; ``port``
    its SlurmctldPort; ``directory``: the private directory (munge/, state/, spool/<node>/,
    log/); ``nodes``: name -> address, each with ``cpus`` CPUs, all in one default
    ``partition``. ``extra`` overrides or adds global keys (``AuthInfo`` replaced whole)."""
    d = directory
    conf = {
        "ClusterName": cluster_name,
        "SlurmctldHost": f"{controller[0]}({controller[1]})",
        "SlurmctldPort": str(port),
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        "AuthInfo": f"socket={d / 'munge' / 'munge.socket'},cred_expire={CRED_EXPIRE}",
        "StateSaveLocation": str(d / "state"),
        "SlurmdSpoolDir": str(d / "spool" / "%n"),
        "SlurmctldPidFile": str(d / "state" / "slurmctld.pid"),
        "SlurmdPidFile": str(d / "spool" / "slurmd-%n.pid"),
        "SlurmctldLogFile": str(d / "log" / "slurmctld.log"),
        "SlurmdLogFile": str(d / "log" / "slurmd-%n.log"),
        "PlugStackConfig": str(d / "plugstack.conf"),
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "SlurmdParameters": "config_overrides",
        "SchedulerType": "sched/backfill",
        "JobCompType": "jobcomp/filetxt",
        "JobCompLoc": str(d / "log" / "jobcomp.txt"),
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "MpiDefault": "none",
        "MailProg": "/bin/true",
        **FAST,
        **(extra or {}),
    }
    lines = [f"{key}={value}" for key, value in conf.items()]
    lines += [f"NodeName={n} NodeAddr={a} CPUs={cpus} State=UNKNOWN" for n, a in nodes.items()]
    lines.append(f"PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def parse_record(line: str) -> dict[str, str]:
    """One line of ``scontrol show <entity> -o`` as a dict. A value may hold spaces (a node's
    ``Reason=trainguard: test [root@...]``) and ``=`` (``TRES=cpu=2,node=1``): the line is
    split only before a word that looks like a key (``Name=``), so a value with a space
    followed by ``word=`` would be cut there."""
    record = {}
    for word in _KEY.split(line.strip()):
        if word:
            key, _, value = word.partition("=")
            record[key] = value.strip()
    return record


def node_states(state: str) -> set[str]:
    """A node's ``State`` as a set of words: ``IDLE*+DRAIN`` -> {IDLE, NOT_RESPONDING, DRAIN}.
    (``scontrol show node`` spells the flag out, ``DOWN+NOT_RESPONDING``; sinfo's ``down*``
    and the ``*`` form read the same.)"""
    words = set()
    for word in state.split("+"):
        if word.endswith("*"):
            words.add("NOT_RESPONDING")
        words.add(word.rstrip("*"))
    return words - {""}
