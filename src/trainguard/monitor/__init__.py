"""Fault detection from worker output and heartbeats (no torch import).

- `rules`: HyperPod log rules; `NodeLogMonitor` judges each line in the agent
  (slow, faultOnMatch, NaN/inf metric) and records match times and progress;
- `hang`: job-wide hang and heartbeat timers, judged by the controller;
- `progress`: the training step read from completed-step lines;
- `heartbeat`: reading the files written by `trainguard.heartbeat()`;
- `stacks`: the Python stacks of stuck workers (py-spy), for a hang's evidence.
"""
