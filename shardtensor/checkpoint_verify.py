"""Checksums beside a ``torch.distributed.checkpoint`` directory, and the verification that runs before a load.

[Note: all-or-nothing loads]
DCP reads each file straight into the tensors it loads: a flipped byte lands in a weight silently, and a missing
or truncated file raises half way, after part of the model was overwritten.  So ``save_checkpoint`` writes
``shardtensor.checksums.json`` beside DCP's files: the world size, and for every file (``.metadata`` included)
its size and sha256, and for every item DCP wrote (each tensor chunk, each pickled object) its byte range and
sha256.  The sidecar carries a checksum of its own content, so a damaged sidecar is named as such.

``verify`` runs on every rank before anything is copied: the sidecar, then ``.metadata`` against its checksum
(before it is unpickled), then every data file's size, then the sha256 of this rank's share of the files (file i
on rank i % world: each file is read once in all), naming the item whose bytes changed.  The caller exchanges
the verdicts in one collective and loads only if every rank passed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

from .checkpoint_files import CheckpointError

SIDECAR = "shardtensor.checksums.json"
METADATA = ".metadata"
_FORMAT = "shardtensor.dcp-checksums/1"
_BLOCK = 8 << 20


def _self_digest(record: dict) -> str:
    body = {k: v for k, v in record.items() if k != "self_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _digest(path: Path, ranges: list[tuple[int, int]]) -> tuple[str, list[str]]:
    """sha256 of the whole file and of each (offset, length) range, in one sequential read."""
    size = path.stat().st_size
    bounds = sorted({0, size, *(min(o, size) for o, _ in ranges), *(min(o + n, size) for o, n in ranges)})
    whole = hashlib.sha256()
    parts = [hashlib.sha256() for _ in ranges]
    with open(path, "rb") as f:
        for start, end in zip(bounds, bounds[1:]):
            inside = [i for i, (o, n) in enumerate(ranges) if o <= start and end <= o + n]
            pos = start
            while pos < end:
                block = f.read(min(_BLOCK, end - pos))
                if not block:
                    break
                whole.update(block)
                for i in inside:
                    parts[i].update(block)
                pos += len(block)
    return whole.hexdigest(), [p.hexdigest() for p in parts]


def _items_by_file(metadata) -> dict[str, list[tuple[str, int, int]]]:
    """relative file -> [(item name, offset, length)] from DCP's storage index."""
    out: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        name = index.fqn + (f" (chunk at {list(index.offset)})" if index.offset is not None and any(index.offset)
                            else "")
        out.setdefault(info.relative_path, []).append((name, int(info.offset), int(info.length)))
    return out


def file_records(directory: Path, metadata, rank: int, world: int) -> dict[str, dict]:
    """Checksums of this rank's share of the data files (computed right after DCP wrote them)."""
    out = {}
    for i, (rel, items) in enumerate(sorted(_items_by_file(metadata).items())):
        if i % world != rank:
            continue
        whole, parts = _digest(directory / rel, [(o, n) for _, o, n in items])
        out[rel] = {"bytes": (directory / rel).stat().st_size, "sha256": whole,
                    "items": [[name, o, n, d] for (name, o, n), d in zip(items, parts)]}
    return out


def write_sidecar(directory: Path, world: int, files: dict[str, dict]) -> None:
    meta = directory / METADATA
    whole, _ = _digest(meta, [])
    record = {"format": _FORMAT, "world": world, "metadata": {"bytes": meta.stat().st_size, "sha256": whole},
              "files": files}
    record["self_sha256"] = _self_digest(record)
    tmp = directory / (SIDECAR + ".tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps(record, indent=1, sort_keys=True).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / SIDECAR)


def read_metadata_unverified(directory: Path, *, files_present: bool = False):
    """DCP's metadata without checksums (``verify_checksums=False``); a parse failure still names the file.
    ``files_present``: also check that every file it lists is there and long enough, the part of "a failed load
    changes nothing" that needs no checksums (DCP copies what it can read before it fails on a missing file)."""
    path = directory / METADATA
    try:
        metadata = pickle.loads(path.read_bytes())
    except Exception as exc:  # noqa: BLE001 - any failure here is this file's
        raise CheckpointError(f"{path}: damaged or missing DCP metadata ({type(exc).__name__}: {str(exc)[:200]})") from None
    for info in (getattr(metadata, "storage_data", None) or {}).values() if files_present else ():
        file = directory / info.relative_path
        size = file.stat().st_size if file.is_file() else None
        if size is None or size < int(info.offset) + int(info.length):
            raise CheckpointError(f"{file}: " + ("checkpoint file missing" if size is None else
                                  f"truncated: {size} bytes, but DCP's metadata places an item up to byte "
                                  f"{int(info.offset) + int(info.length)}") + " (not verified: no checksums)")
    return metadata


def _read_sidecar(directory: Path) -> dict:
    path = directory / SIDECAR
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing, so the checkpoint cannot be verified (it was not written by shardtensor."
            "save_checkpoint, or the file was lost). Fix: pass verify_checksums=False to load_checkpoint to load it unverified.")
    try:
        record = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: damaged checksum file (not JSON: {exc})") from None
    if not isinstance(record, dict) or record.get("format") != _FORMAT or record.get("self_sha256") != _self_digest(record):
        raise CheckpointError(f"{path}: damaged checksum file (its own checksum or format tag does not match)")
    return record


def verify(directory: Path, rank: int, world: int) -> Any:
    """Every integrity check of a DCP checkpoint directory, nothing loaded; returns DCP's metadata."""
    if not directory.is_dir():  # (else: "checksum file missing", and a fix that would not help)
        raise CheckpointError(f"{directory}: no checkpoint there (not a directory); save_checkpoint writes one")
    sidecar = _read_sidecar(directory)
    meta_path = directory / METADATA
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path}: DCP metadata file missing")
    raw = meta_path.read_bytes()
    expected = sidecar["metadata"]
    if len(raw) != expected["bytes"] or hashlib.sha256(raw).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"{meta_path}: damaged DCP metadata ({len(raw)} bytes, checksum "
                              f"{'differs' if len(raw) == expected['bytes'] else 'not checked: size differs'}; "
                              f"saved: {expected['bytes']} bytes)")
    try:
        metadata = pickle.loads(raw)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{meta_path}: DCP metadata cannot be read ({type(exc).__name__}: {exc})") from None
    files = sidecar["files"]
    referenced = _items_by_file(metadata)
    if sorted(referenced) != sorted(files):
        raise CheckpointError(f"{directory / SIDECAR}: lists files {sorted(files)[:4]} but the DCP metadata references "
                              f"{sorted(referenced)[:4]} (files of another save mixed in?)")
    for rel, want in sorted(files.items()):
        path = directory / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: checkpoint file missing (saved by a {sidecar['world']}-rank job)")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: truncated or extended: {size} bytes, {want['bytes']} when saved")
    for i, (rel, want) in enumerate(sorted(files.items())):
        if i % world != rank:
            continue
        whole, parts = _digest(directory / rel, [(o, n) for _, o, n, _ in want["items"]])
        if whole != want["sha256"]:
            bad = [name for (name, _, _, d), got in zip(want["items"], parts) if d != got]
            what = f"the bytes of {bad[0]!r} changed" if bad else "bytes outside any saved item changed"
            raise CheckpointError(f"{directory / rel}: corrupted: {what} (sha256 differs from the one saved)")
    return metadata
