"""Fault detection from worker output and heartbeats (no torch import).

- `rules`: HyperPod log rules; `NodeLogMonitor` judges each line in the agent
  (slow, faultOnMatch, NaN/inf metric) and records match times and progress;
- `hang`: job-wide hang and heartbeat timers, judged by the controller;
- `progress`: the training step read from completed-step lines;
- `heartbeat`: reading the files written by `trainguard.heartbeat()`;
- `stacks`: the Python stacks of stuck workers (py-spy), for a hang's evidence.
"""

from trainguard.monitor.hang import HangDetection, HangWatch, HeartbeatWatch, StaleRank
from trainguard.monitor.heartbeat import Beat, read_heartbeats
from trainguard.monitor.progress import DEFAULT_PROGRESS_PATTERN, ProgressMatcher
from trainguard.monitor.rules import Detection, LogRuleSpec, NodeLogMonitor
from trainguard.monitor.stacks import capture_stacks

__all__ = [
    "DEFAULT_PROGRESS_PATTERN",
    "Beat",
    "Detection",
    "HangDetection",
    "HangWatch",
    "HeartbeatWatch",
    "LogRuleSpec",
    "NodeLogMonitor",
    "ProgressMatcher",
    "StaleRank",
    "capture_stacks",
    "read_heartbeats",
]
