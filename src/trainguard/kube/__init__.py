"""The Kubernetes platform: the TrainingJob custom resource, its operator and the cluster CLI.

- ``config``: names, labels and the operator's settings (defaults in one place);
- ``api``: the only module that talks to the Kubernetes API server;
- ``crd`` / ``manifests``: the CRD (generated from the spec model), RBAC and the operator;
- ``pods``: pure builders of a job's pods, Service and token Secret;
- ``node`` / ``runner``: the pod manager and the per-job loop driving ``JobController``;
- ``status``: the custom resource's status from the controller; ``metrics``: Prometheus;
- ``operator``: the kopf handlers (``python -m trainguard.kube.operator``); ``cli``: verbs.
"""
