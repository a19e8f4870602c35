"""The control plane as pure logic: no sockets, no subprocesses, no clocks it does not receive."""
