"""The files through which a node agent steers the resilient workers of its node.

The models and their readers and writers live in :mod:`trainguard.wire.control_files`
(the agent, which never imports torch, uses them too); this module is their name on
the worker's side.
"""

from trainguard.wire.control_files import *  # noqa: F403 (every name, under this name)
from trainguard.wire.control_files import __all__ as __all__
