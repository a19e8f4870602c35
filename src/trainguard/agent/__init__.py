"""The node agent: owns one node's worker processes, driven by the controller over HTTP.

Run it with ``python -m trainguard.agent`` (see :mod:`trainguard.agent.__main__`);
talk to it with :class:`trainguard.agent.client.AgentClient`. This package
``__init__`` imports nothing: the exec shim and the client stay light.
"""
