"""DCP ``Metadata`` as JSON, so reading a checkpoint never unpickles it.

torch's own ``FileSystemWriter`` pickles the metadata; ours writes this JSON
form (tensor properties, chunks, planner data, storage locations) and
rebuilds the objects on read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)


@dataclass(frozen=True)
class Location:
    """Where one write item's bytes are: a byte range of one rank's data file."""

    rank: int
    start: int
    length: int


def _torch_attr(name: Any, kind: type, field: str) -> Any:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, kind):
        raise ValueError(f"metadata: {field} {name!r} is not a torch {kind.__name__}")
    return value


def _index_to_json(index: MetadataIndex) -> dict[str, Any]:
    offset = None if index.offset is None else list(index.offset)
    return {"fqn": index.fqn, "offset": offset, "index": index.index}


def _path_item(item: Any) -> str | int:
    if isinstance(item, (str, int)) and not isinstance(item, bool):
        return item
    raise TypeError(f"metadata: planner_data path item {item!r} is not a str or int")


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    """DCP ``Metadata`` (default planner's ``planner_data``, our storage data) as JSON."""
    entries: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            entries[fqn] = {"type": "bytes"}
            continue
        props = md.properties
        entries[fqn] = {
            "type": "tensor",
            "size": list(md.size),
            "dtype": str(props.dtype),
            "layout": str(props.layout),
            "requires_grad": props.requires_grad,
            "memory_format": str(props.memory_format),
            "pin_memory": props.pin_memory,
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    planner = metadata.planner_data
    if planner is not None and not isinstance(planner, dict):
        raise TypeError(f"metadata: planner_data {type(planner).__name__} is not a dict")
    storage = metadata.storage_data or {}
    locations = []
    for index, where in storage.items():
        if not isinstance(where, Location):
            raise TypeError(f"metadata: storage_data of {index.fqn} was not written by us")
        locations.append(_index_to_json(index) | {"rank": where.rank, "start": where.start,
                                                  "length": where.length})  # fmt: skip
    meta = metadata.storage_meta
    return {
        "version": metadata.version,
        "state_dict_metadata": entries,
        "planner_data": None
        if planner is None
        else {str(k): [_path_item(i) for i in v] for k, v in planner.items()},
        "storage_data": locations,
        "storage_meta": None
        if meta is None
        else {
            "checkpoint_id": None if meta.checkpoint_id is None else os.fspath(meta.checkpoint_id),
            "save_id": meta.save_id,
            "load_id": meta.load_id,
            "modules": list(meta.modules),
        },
    }


def metadata_from_json(doc: dict[str, Any]) -> Metadata:
    """Rebuild what :func:`metadata_to_json` wrote; ``ValueError`` names a bad field."""
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, md in doc["state_dict_metadata"].items():
        if md["type"] == "bytes":
            entries[fqn] = BytesStorageMetadata()
            continue
        props = TensorProperties(
            dtype=_torch_attr(md["dtype"], torch.dtype, f"{fqn}.dtype"),
            layout=_torch_attr(md["layout"], torch.layout, f"{fqn}.layout"),
            requires_grad=bool(md["requires_grad"]),
            memory_format=_torch_attr(
                md["memory_format"], torch.memory_format, f"{fqn}.memory_format"
            ),
            pin_memory=bool(md["pin_memory"]),
        )
        chunks = [
            ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
            for c in md["chunks"]
        ]
        entries[fqn] = TensorStorageMetadata(props, torch.Size(md["size"]), chunks)
    planner = doc["planner_data"]
    storage = {
        MetadataIndex(s["fqn"], s["offset"], s["index"]): Location(
            int(s["rank"]), int(s["start"]), int(s["length"])
        )
        for s in doc["storage_data"]
    }
    meta = doc["storage_meta"]
    return Metadata(
        state_dict_metadata=entries,
        planner_data=None if planner is None else {k: tuple(v) for k, v in planner.items()},
        storage_data=storage,
        storage_meta=None if meta is None else StorageMeta(**meta),
        version=doc["version"],
    )
