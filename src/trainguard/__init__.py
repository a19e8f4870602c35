"""trainguard: fault-tolerant distributed PyTorch training."""

__version__ = "0.1.0"
