"""A training state as flat tensor bytes plus a JSON tree, and its in-place restore.

``state`` is a nested structure of dicts (keys: ``str`` or ``int``), lists, tuples,
tensors and plain values (``int``, ``float``, ``str``, ``bool``, ``None``). It becomes

- a :class:`Layout`: one :class:`TensorEntry` per tensor (key path, dtype, shape, byte
  offset, 64-byte aligned) and the total size of the data buffer; a DTensor's entry holds
  its local shard, and where that shard lies in the whole tensor
  (:mod:`trainguard.checkpoint.sharding`);
- a *tree*: the structure as JSON, with ``{"t": i}`` for the i-th tensor, ``{"v": x}``
  for a plain value, ``{"d": [[key, node], ...]}`` for a dict (keeping int keys),
  ``{"l": [...]}`` for a list and ``{"u": [...]}`` for a tuple.

Nothing is pickled, so loading a shard never runs code from it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.checkpoint.host_memory import Prefault
from trainguard.checkpoint.sharding import (
    NotCovered,
    Source,
    StateMismatch,
    dtype_name,
    is_dtensor,
    local_tensor,
    plan_copy,
    sharding_of,
)

__all__ = [
    "ALIGNMENT",
    "Layout",
    "NotCovered",
    "StateMismatch",
    "TensorEntry",
    "dtype_name",
    "flatten",
    "format_path",
    "plan_restore",
    "restore",
]

ALIGNMENT = 64
"""Byte alignment of every tensor in the data buffer."""

PathKey = str | int
Path = tuple[PathKey, ...]
PLAIN = (int, float, str, bool, type(None))


def format_path(path: Path) -> str:
    """``('optim', 'param_groups', 0, 'lr')`` -> ``state['optim']['param_groups'][0]['lr']``."""
    return "state" + "".join(f"[{key!r}]" for key in path)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live in the data buffer."""

    path: Path
    dtype: str  # "float32", ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    sharding: dict[str, Any] | None = None
    """A DTensor's shard: where it lies (:func:`~trainguard.checkpoint.sharding.sharding_of`);
    ``shape`` is then the local shape. None for a plain tensor."""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "path": list(self.path),
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }
        if self.sharding is not None:
            data["dtensor"] = self.sharding
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorEntry:
        shape = tuple(int(n) for n in data["shape"])
        sharding = data.get("dtensor")
        if sharding is not None:
            offsets = [int(n) for n in sharding["offsets"]]
            whole = [int(n) for n in sharding["global_shape"]]
            if not len(offsets) == len(whole) == len(shape) or any(
                o < 0 or o + n > w for o, n, w in zip(offsets, shape, whole, strict=True)
            ):
                raise ValueError(f"shard of {data['path']} lies outside its global shape")
            sharding = {**sharding, "offsets": offsets, "global_shape": whole}
        return cls(
            path=tuple(data["path"]),
            dtype=str(data["dtype"]),
            shape=shape,
            offset=int(data["offset"]),
            nbytes=int(data["nbytes"]),
            sharding=sharding,
        )

    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise StateMismatch(f"{format_path(self.path)}: unknown dtype {self.dtype!r}")
        return dtype

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This tensor as a view of ``buffer`` (a flat uint8 tensor)."""
        raw = buffer[self.offset : self.offset + self.nbytes]
        return raw.view(self.torch_dtype()).view(self.shape)


@dataclass(frozen=True)
class Layout:
    """The tensors of a state, their place in the data buffer, and the JSON tree."""

    entries: list[TensorEntry]
    nbytes: int
    tree: Any


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def flatten(state: Any) -> tuple[Layout, list[torch.Tensor]]:
    """The layout of ``state`` and its tensors (a DTensor's local tensor), in layout order.

    Raises ``TypeError`` naming the key path for a leaf that is neither a dense tensor nor
    a plain value, a DTensor placed other than Shard/Replicate, or a dict key that is not
    ``str``/``int``.
    """
    tensors: list[torch.Tensor] = []
    entries: list[TensorEntry] = []
    offset = 0

    def walk(node: Any, path: Path) -> Any:
        nonlocal offset
        if isinstance(node, torch.Tensor):
            sharding = sharding_of(node, format_path(path)) if is_dtensor(node) else None
            node = local_tensor(node)
            if node.layout != torch.strided or node.is_quantized:
                raise TypeError(f"{format_path(path)}: only dense tensors can be checkpointed")
            nbytes = node.numel() * node.element_size()
            shape = tuple(node.shape)
            entries.append(
                TensorEntry(path, dtype_name(node.dtype), shape, offset, nbytes, sharding)
            )
            tensors.append(node)
            offset = _align(offset + nbytes)
            return {"t": len(tensors) - 1}
        if isinstance(node, dict):
            items = []
            for key, value in node.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise TypeError(
                        f"{format_path(path)}: dict key {key!r} is a {type(key).__name__};"
                        " only str and int keys can be checkpointed"
                    )
                items.append([key, walk(value, (*path, key))])
            return {"d": items}
        if isinstance(node, list):
            return {"l": [walk(v, (*path, i)) for i, v in enumerate(node)]}
        if isinstance(node, tuple):
            return {"u": [walk(v, (*path, i)) for i, v in enumerate(node)]}
        if isinstance(node, PLAIN):
            return {"v": node}
        raise TypeError(
            f"{format_path(path)}: a {type(node).__name__} cannot be checkpointed; leaves must be "
            "tensors, int/float/str/bool/None (inside dicts, lists or tuples) or objects with "
            "state_dict()/load_state_dict()"
        )

    tree = walk(state, ())
    return Layout(entries, offset, tree), tensors


def restore(
    state: Any,
    layout: Layout,
    buffer: torch.Tensor,
    devices: list[torch.device] | None = None,
    non_blocking: bool = False,
    shards: Mapping[Path, Sequence[Source]] | None = None,
) -> None:
    """Restore ``state`` in place: :func:`plan_restore`, then run the plan."""
    plan_restore(state, layout, buffer, devices, non_blocking, shards)()


def plan_restore(
    state: Any,
    layout: Layout,
    buffer: torch.Tensor,
    devices: list[torch.device] | None = None,
    non_blocking: bool = False,
    shards: Mapping[Path, Sequence[Source]] | None = None,
) -> Callable[[], None]:
    """The in-place restore of ``state`` from ``buffer`` (flat uint8) laid out by ``layout``.

    Tensors are ``copy_``-ed into the existing tensors (references stay valid); plain
    values, tuples and anything the state lacks are put into their containers (a new
    tensor on ``buffer``'s device, or on ``devices[i]`` for the i-th entry when given,
    allocated by the plan and faulted in ahead of its copy by a
    :class:`~trainguard.checkpoint.host_memory.Prefault` thread).
    ``non_blocking`` copies asynchronously where the devices allow it: the caller then
    synchronises before it uses the state or changes the buffer. Every
    mismatch (shape, dtype, container type, list length, a tensor of ``state`` the
    checkpoint lacks) is found before anything is changed and raised as
    :class:`StateMismatch` naming the key.

    A DTensor of ``state``, or a target of a saved DTensor shard, gets the regions of its
    local shard from the saved shards that overlap it: ``shards[path]`` (every saved
    rank's entries of that path, for resharding) or else this layout's own entry;
    :class:`NotCovered` if they leave part of it unfilled.
    """
    if buffer.numel() < layout.nbytes:
        raise StateMismatch(f"data holds {buffer.numel()} bytes, the layout needs {layout.nbytes}")
    actions: list[Callable[[], None]] = []
    fresh: list[tuple[torch.Tensor, torch.Tensor]] = []  # a new tensor, and its bytes
    entries = layout.entries

    def build(node: Any, path: Path) -> Any:
        """A fresh object for ``node`` (no target to restore into); a tensor is allocated
        now and filled when the plan runs."""
        kind, value = _node(node, path)
        if kind == "t":
            view = entries[value].view(buffer)
            device = buffer.device if devices is None else devices[value]
            new = torch.empty(view.shape, dtype=view.dtype, device=device)
            fresh.append((new, view))
            return new
        if kind == "v":
            return value
        if kind == "d":
            return {key: build(child, (*path, key)) for key, child in value}
        children = [build(child, (*path, i)) for i, child in enumerate(value)]
        return children if kind == "l" else tuple(children)

    def plan(node: Any, target: Any, path: Path) -> Any:
        """Plan the restore of ``target``; returns what its container should hold."""
        kind, value = _node(node, path)
        if kind == "t":
            entry = entries[value]
            if isinstance(target, torch.Tensor) and (entry.sharding or is_dtensor(target)):
                sources = shards.get(path) if shards else None
                where = format_path(path)
                actions.append(plan_copy(target, sources or [(entry, buffer)], where, non_blocking))
                return target
            if entry.sharding is not None and target is None:
                raise StateMismatch(
                    f"{format_path(path)}: checkpoint has a DTensor shard here, and the state "
                    "has no DTensor to restore it into"
                )
            if not isinstance(target, torch.Tensor):
                if _holds_tensor(target):
                    raise StateMismatch(f"{format_path(path)}: checkpoint has a tensor here")
                return build(node, path)
            if tuple(target.shape) != entry.shape or dtype_name(target.dtype) != entry.dtype:
                raise StateMismatch(
                    f"{format_path(path)}: checkpoint has {entry.dtype}{list(entry.shape)}, "
                    f"state has {dtype_name(target.dtype)}{list(target.shape)}"
                )
            actions.append(lambda: target.copy_(entry.view(buffer), non_blocking=non_blocking))
            return target
        if _holds_tensor(target) and kind == "v":
            raise StateMismatch(f"{format_path(path)}: checkpoint has {value!r}, not a tensor")
        if kind == "v":
            return value
        if kind == "d":
            if not isinstance(target, dict):
                return _replace_or_fail(node, target, path, build)
            seen = set()
            for key, child in value:
                seen.add(key)
                new = plan(child, target.get(key), (*path, key))
                if key not in target or new is not target[key]:
                    actions.append(_setter(target, key, new))
            for key, old in target.items():
                if key not in seen and _holds_tensor(old):
                    raise StateMismatch(f"{format_path((*path, key))}: not in the checkpoint")
            return target
        if not isinstance(target, (list, tuple)):
            return _replace_or_fail(node, target, path, build)
        if len(target) != len(value):
            raise StateMismatch(
                f"{format_path(path)}: checkpoint has {len(value)} items, state has {len(target)}"
            )
        news = [
            plan(child, old, (*path, i))
            for i, (child, old) in enumerate(zip(value, target, strict=True))
        ]
        if kind == "l" and isinstance(target, list):
            for i, new in enumerate(news):
                if new is not target[i]:
                    actions.append(_setter(target, i, new))
            return target
        return news if kind == "l" else tuple(news)

    plan(layout.tree, state, ())
    # The fresh tensors' pages are faulted in from now on, on a thread of their own: the
    # copies into existing tensors run first, then the fresh tensors', behind the thread.
    # The thread knows only addresses: it is stopped when the plan has run, or is dropped
    # (before the tensors go).
    prefault = Prefault([[(t.data_ptr(), t.nbytes) for t, _ in fresh if t.device.type == "cpu"]])
    prefault.start()

    def run() -> None:
        try:
            with torch.no_grad():
                for action in actions:
                    action()
                for new, view in fresh:
                    new.copy_(view, non_blocking=non_blocking)
        finally:
            prefault.stop()

    weakref.finalize(run, prefault.stop)
    return run


def _node(node: Any, path: Path) -> tuple[str, Any]:
    if not isinstance(node, dict) or len(node) != 1:
        raise StateMismatch(f"{format_path(path)}: malformed checkpoint tree")
    ((kind, value),) = node.items()
    if kind not in ("t", "v", "d", "l", "u"):
        raise StateMismatch(f"{format_path(path)}: malformed checkpoint tree ({kind!r})")
    return kind, value


def _holds_tensor(node: Any) -> bool:
    if isinstance(node, torch.Tensor):
        return True
    if isinstance(node, dict):
        return any(_holds_tensor(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_tensor(v) for v in node)
    return False


def _replace_or_fail(node: Any, target: Any, path: Path, build: Callable[[Any, Path], Any]) -> Any:
    if _holds_tensor(target):
        raise StateMismatch(
            f"{format_path(path)}: checkpoint has a {_node(node, path)[0]!r} container, "
            f"state has a {type(target).__name__}"
        )
    return build(node, path)


def _setter(container: Any, key: PathKey, value: Any) -> Callable[[], None]:
    def apply() -> None:
        container[key] = value

    return apply
