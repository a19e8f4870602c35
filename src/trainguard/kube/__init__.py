"""The Kubernetes platform: the TrainingJob custom resource, its operator and the cluster CLI.

- ``config``: names, labels and the operator's settings (defaults in one place);
- ``api``: the only module that talks to the Kubernetes API server;
- ``crd`` / ``manifests``: the CRD (generated from the spec model), RBAC and the operator;
- ``pods``: pure builders of a job's pods, Service and token Secret;
- ``node`` / ``kube_platform``: a node's pod, and the platform the control loop drives
  (pods launched, retired, observed);
- ``runner``: one job (set-up, the loop on a worker thread, clean-up);
- ``status`` / ``record``: the custom resource's status, Events and metrics
  (``trainguard.observe.metrics``) from the controller;
- ``node_labels`` / ``node_health``: node health on Kubernetes Nodes (HyperPod's labels,
  the unhealthy taint): the rules (pure), and the operator's reads and writes;
- ``health_agent`` / ``health_manifests``: the node health agent's DaemonSet
  (``python -m trainguard.kube.health_agent``) and its manifests;
- ``operator``: the kopf handlers (``python -m trainguard.kube.operator``); ``cli``: verbs.
"""
