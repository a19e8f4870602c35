"""The files through which a node agent steers the resilient workers of its node.

The models and their readers and writers live in :mod:`trainguard.wire.control_files`
(the agent, which never imports torch, uses them too); this module is their name on
the worker's side.
"""

from trainguard.wire.control_files import (
    ATTEMPT_ENV,
    ATTEMPT_FILE,
    CONTROL_DIR_ENV,
    EXIT_BARRIER_TIMEOUT,
    SPARE_ID_ENV,
    STATE_SOURCES,
    Ack,
    ProtocolError,
    ResilientAttempt,
    SpareAssignment,
    StateSource,
    ack_path,
    read_ack,
    read_attempt,
    read_spare,
    spare_path,
    write_ack,
    write_attempt,
    write_json_atomic,
    write_spare,
)

__all__ = [
    "ATTEMPT_ENV",
    "ATTEMPT_FILE",
    "CONTROL_DIR_ENV",
    "EXIT_BARRIER_TIMEOUT",
    "SPARE_ID_ENV",
    "STATE_SOURCES",
    "Ack",
    "ProtocolError",
    "ResilientAttempt",
    "SpareAssignment",
    "StateSource",
    "ack_path",
    "read_ack",
    "read_attempt",
    "read_spare",
    "spare_path",
    "write_ack",
    "write_attempt",
    "write_json_atomic",
    "write_spare",
]
