""":class:`RNGState`: this process's random generators, as one object of a checkpoint state.

``{"rng": RNGState()}`` in a state saves, at each :meth:`Checkpointer.save`, the
generators as they are then, and :meth:`Checkpointer.load_latest` sets them back:

- torch's CPU generator (``torch.get_rng_state``);
- the current CUDA device's generator, when this process has initialised CUDA (never
  another device's: reading one makes a context on it);
- Python's ``random``;
- NumPy's legacy global generator (``numpy.random``), when NumPy is imported.

Everything is tensors and plain values (the generators' words as int64), so nothing is
pickled. A checkpoint saved without CUDA loads into a process that has CUDA initialised
only if the state names no CUDA generator either (the restore names the mismatch).
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["RNGState"]


class RNGState:
    """The random generators of this process (see the module doc); a ``Stateful``."""

    def state_dict(self) -> dict[str, Any]:
        """The generators' state now (every tensor a fresh copy)."""
        version, words, gauss = random.getstate()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": {
                "version": version,
                "state": torch.tensor(words, dtype=torch.int64),
                "gauss": gauss,
            },
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            kind, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
            state["numpy"] = {
                "kind": str(kind),
                "keys": torch.from_numpy(keys.astype(numpy.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(cached),
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the generators to ``state_dict`` (those it names)."""
        torch.set_rng_state(state_dict["torch"])
        python = state_dict.get("python")
        if python is not None:
            words = tuple(int(word) for word in python["state"].tolist())
            random.setstate((int(python["version"]), words, python["gauss"]))
        cuda = state_dict.get("cuda")
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        saved = state_dict.get("numpy")
        if saved is not None:
            import numpy

            keys = saved["keys"].numpy().astype(numpy.uint32)
            numpy.random.set_state(
                (saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["gauss"])
            )
