"""The typed wire: every message between the controller, the node agents and the workers.

- :mod:`trainguard.wire.requests`: what the controller asks of an agent (the attempt's
  :class:`NodeAssignment` among it), one model per HTTP request;
- :mod:`trainguard.wire.status`: what an agent reports (:class:`NodeStatus`), polled by
  the controller and pushed to it the moment something happens;
- :mod:`trainguard.wire.control_files`: the files an agent and its resilient workers
  exchange on the node.

Both ends use the same models: the agent server and its client, the agent and the
worker wrapper. A body that does not fit gets a :class:`WireError` naming the field.
pydantic only: no torch, nothing that opens a socket. Import the models from their
modules (this package re-exports nothing).
"""
