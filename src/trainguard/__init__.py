"""trainguard: fault-tolerant distributed PyTorch training."""

from trainguard.heartbeat import heartbeat

__all__ = ["heartbeat"]
__version__ = "0.1.0"
