"""Per-rank shard files with a manifest that is verified before anything is loaded.

``save_shards(model, directory)`` writes, on every rank, ``shards-rank{r}-of-{W}.pt`` (this rank's padded shard of
every sharded parameter, plus the replicated entries of the state dict) and ``manifest-rank{r}-of-{W}.json``:
the file's size and sha256, and per entry its global shape, shard shape, rows, dtype, layout and the sha256 of its
bytes.  ``load_shards(model, directory)`` treats the directory as untrusted input:

  - the file's size and sha256 must match the manifest (a truncated or corrupted file is named, not parsed);
  - ``torch.load(..., weights_only=True)`` only: a checkpoint must not be able to run code;
  - every entry's key, shapes, dtype and layout must match the model and the manifest, and its bytes their sha256;
  - the world size must be the saved one (resharding to another world: ``shardtensor.checkpoint``);
  - every rank verifies its files, the verdicts are exchanged, and only if all ranks pass is anything copied,
    so a bad file on one rank fails every rank with that file's name instead of leaving the others to hang.

Files are written to a temporary name, fsynced and renamed, so a crash mid-save never leaves a file that looks
complete.  This is the simple, same-world format; ``shardtensor.checkpoint`` (DCP) handles resharding.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Union

import torch
from torch import nn

from . import _comm
from .tensor import ShardedParam

__all__ = ["save_shards", "load_shards", "CheckpointError"]

_FORMAT = "shardtensor.shards/2"  # /2: the manifest carries a checksum of its own content
_FORMATS = ("shardtensor.shards/1", _FORMAT)
PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupted or does not fit the model; the message names the file."""


def _names(rank: int, world: int) -> tuple[str, str]:
    stem = f"rank{rank:05d}-of-{world:05d}"
    return f"shards-{stem}.pt", f"manifest-{stem}.json"


def _tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu().reshape(-1)  # 1-d: a 0-d tensor cannot be viewed as bytes
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def _manifest_sha256(manifest: dict) -> str:
    """Checksum of a manifest's own content (every field but this one), so a damaged manifest that still parses
    is named as damaged instead of being believed."""
    body = {k: v for k, v in manifest.items() if k != "self_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _group_of(module: nn.Module):
    state = getattr(module, "_shardtensor", None)
    return state.group if state is not None else None


def _entries(module: nn.Module) -> dict[str, tuple[torch.Tensor, dict]]:
    """state-dict key -> (tensor this rank stores, its manifest record)."""
    out = {}
    for key, value in module.state_dict().items():
        if isinstance(value, ShardedParam):
            layout = value._layout
            local = value._local
            record = {"layout": "dim0", "shape": list(layout.shape), "local_shape": list(local.shape),
                      "rows_per_rank": layout.rows_per_rank, "row_start": layout.row_start,
                      "valid_rows": layout.valid_rows}
        elif isinstance(value, torch.Tensor):
            local = value
            record = {"layout": "replicated", "shape": list(value.shape), "local_shape": list(value.shape)}
        else:  # extra state objects are not tensors; this format carries tensors only
            raise CheckpointError(f"save_shards: state-dict entry {key!r} is a {type(value).__name__}, not a tensor")
        record["dtype"] = str(local.dtype).removeprefix("torch.")
        out[key] = (local, record)
    return out


def save_shards(module: nn.Module, directory: PathLike) -> Path:
    """Write this rank's shards and manifest into ``directory`` (every rank calls it); returns the manifest path.

    Never gathers: each rank writes only what it holds.  Ends with a (timed) barrier, so when it returns on any
    rank, every rank's files are complete.
    """
    group = _group_of(module)
    rank, world = _comm.rank(group), _comm.world_size(group)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # One id per save, rank 0's, in every manifest: a load of files from two saves (a save into the same directory
    # cut short on some ranks) is refused, where each file alone is complete and checks out.
    save_id = _comm.all_gather_object(os.urandom(8).hex(), group, label="save_shards (agreeing on a save id)")[0]
    shard_name, manifest_name = _names(rank, world)
    entries = _entries(module)
    tensors = {key: t.detach().contiguous().cpu().clone() for key, (t, _) in entries.items()}
    records = {key: {**record, "sha256": _tensor_sha256(tensors[key])} for key, (_, record) in entries.items()}
    _write_atomically(directory / shard_name, lambda f: torch.save(tensors, f))
    manifest = {"format": _FORMAT, "rank": rank, "world": world, "save_id": save_id, "file": shard_name,
                "file_bytes": (directory / shard_name).stat().st_size,
                "file_sha256": _file_sha256(directory / shard_name), "entries": records}
    manifest["self_sha256"] = _manifest_sha256(manifest)
    _write_atomically(directory / manifest_name, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    _comm.barrier(group, label="save_shards (waiting for every rank's files)")
    return directory / manifest_name


def _read_manifest(path: Path, rank: int, world: int) -> dict:
    if not path.is_file():
        others = sorted(p.name for p in path.parent.glob("manifest-*.json"))
        if any(name.endswith(path.name.split("-of-")[-1]) for name in others):
            raise CheckpointError(f"{path}: missing (the other ranks' manifests of this world size are there: "
                                  "the save did not complete on this rank, or the file was lost). Save again.")
        raise CheckpointError(f"{path}: no manifest for rank {rank} of {world} ranks (found {others[:4]}). A "
                              "checkpoint saved on another world size needs resharding: shardtensor.checkpoint.")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupted manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in _FORMATS or not isinstance(manifest.get("entries"), dict):
        raise CheckpointError(f"{path}: damaged manifest, or not a {_FORMAT} manifest (format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("world") != world or manifest.get("rank") != rank:
        raise CheckpointError(f"{path}: saved by rank {manifest.get('rank')} of {manifest.get('world')} ranks, "
                              f"loading on rank {rank} of {world}. Resharding: use shardtensor.checkpoint.")
    return manifest


def _verify(module: nn.Module, directory: Path, rank: int, world: int) -> tuple[dict[str, torch.Tensor], str]:
    """Every check, nothing copied: returns key -> tensor to copy and the save's id, or raises CheckpointError
    naming the file.

    A manifest whose content does not match its own checksum is reported as damaged, with what the damage
    led to (a renamed key would otherwise read as "keys do not match the model: missing [], unexpected []")."""
    manifest_path = directory / _names(rank, world)[1]
    manifest = _read_manifest(manifest_path, rank, world)
    damaged = manifest["format"] != _FORMATS[0] and manifest.get("self_sha256") != _manifest_sha256(manifest)
    what = (f"{manifest_path}: damaged manifest: its content does not match its own checksum (a changed byte?); "
            "restore it or save the checkpoint again")
    try:
        loaded = _verify_against(module, directory, manifest, rank, world)
    except CheckpointError as exc:
        raise CheckpointError(f"{what}. It leads to: {exc}" if damaged else str(exc)) from None
    if damaged:
        raise CheckpointError(what)
    return loaded, manifest.get("save_id")


def _verify_against(module: nn.Module, directory: Path, manifest: dict, rank: int, world: int) -> dict:
    shard_name, manifest_name = _names(rank, world)
    path = directory / shard_name
    if manifest.get("file") != shard_name or not path.is_file():
        raise CheckpointError(f"{path}: shard file missing (manifest {directory / manifest_name} names "
                              f"{manifest.get('file')!r})")
    size = path.stat().st_size
    if size != manifest.get("file_bytes"):
        raise CheckpointError(f"{path}: truncated or extended: {size} bytes, the manifest says "
                              f"{manifest.get('file_bytes')}")
    if _file_sha256(path) != manifest.get("file_sha256"):
        raise CheckpointError(f"{path}: corrupted: its sha256 differs from the manifest's")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)  # untrusted input: never run code
    except Exception as exc:  # noqa: BLE001 - any parse failure is this file's fault
        raise CheckpointError(f"{path}: cannot be read as a weights-only torch file ({type(exc).__name__}: "
                              f"{str(exc)[:300]})") from None
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in loaded.items()):
        raise CheckpointError(f"{path}: expected a dict of str -> tensor")
    expected = _entries(module)
    records = manifest["entries"]
    missing = sorted(expected.keys() - loaded.keys())
    unexpected = sorted(loaded.keys() - expected.keys())
    if missing or unexpected or records.keys() != loaded.keys():
        raise CheckpointError(f"{path}: keys do not match the model: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}")
    for key, (target, want) in expected.items():
        tensor, record = loaded[key], records[key]
        got = {"layout": record.get("layout"), "shape": record.get("shape"), "local_shape": list(tensor.shape),
               "dtype": str(tensor.dtype).removeprefix("torch.")}
        for field in ("layout", "shape", "local_shape", "dtype", "rows_per_rank", "row_start", "valid_rows"):
            if field in want and got.get(field, record.get(field)) != want[field]:
                raise CheckpointError(f"{path}: entry {key!r} has {field} {got.get(field, record.get(field))!r}, "
                                      f"the model expects {want[field]!r}")
            if field in record and field in got and record[field] != got[field]:
                raise CheckpointError(f"{path}: entry {key!r} has {field} {got[field]!r} but its manifest says "
                                      f"{record[field]!r}")
        if _tensor_sha256(tensor) != record.get("sha256"):
            raise CheckpointError(f"{path}: entry {key!r}: checksum mismatch (corrupted bytes)")
    return loaded


@torch.no_grad()
def load_shards(module: nn.Module, directory: PathLike) -> None:
    """Load what ``save_shards`` wrote into a model sharded the same way (same world size, same architecture).

    Verifies sizes, sha256 checksums (file and per shard), keys, shapes, dtypes and layouts on every rank, then
    exchanges the verdicts: one bad file fails every rank with its name, and nothing is copied.
    """
    group = _group_of(module)
    rank, world = _comm.rank(group), _comm.world_size(group)
    directory = Path(directory)
    try:
        (loaded, save_id), error = _verify(module, directory, rank, world), ""
    except CheckpointError as exc:
        loaded, save_id, error = None, None, str(exc)
    verdicts = _comm.all_gather_object((error, save_id), group, label="load_shards (exchanging verdicts)")
    errors = [e for e, _ in verdicts if e]
    if not errors and len({i for _, i in verdicts}) > 1:
        saves = ", ".join(f"rank {r}: {i}" for r, (_, i) in enumerate(verdicts))
        errors = [f"{directory}: the ranks' files come from different saves ({saves}): a save into this directory "
                  "was cut short on some ranks, or files were copied in from another save. Save again."]
    if errors:
        raise CheckpointError("load_shards: nothing was loaded: " + " | ".join(errors))
    for key, value in module.state_dict().items():
        target = value._local if isinstance(value, ShardedParam) else value
        target.copy_(loaded[key])
