"""Adapters that turn control decisions into reality (local processes; later Kubernetes)."""
