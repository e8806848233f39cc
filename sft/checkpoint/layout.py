"""What a committed checkpoint is, and whether one is complete and undamaged: the light part of
checkpointing, which the run directory, export and the CLIs import.

Layout of a run directory's checkpoints:

    checkpoints/step-N/          one committed checkpoint
        .metadata, *.distcp      DCP: model + optimizer, sharded (reshardable to any world size)
        scheduler.pt             LR scheduler state
        rng-rank{r}.pt           python / numpy / torch / cuda RNG state of rank r
        train_state.json         step, tokens seen, global batch, world size, first eval loss
        digests.json             CRC-32 of every other file, verified before a resume loads it
        config.yaml              the resolved config of the run
        hf/                      the model's config.json and tokenizer (export needs nothing else)
    checkpoints/latest           name of the newest committed checkpoint (for people and tools)

A save writes `step-N.tmp/`, waits for every rank, fsyncs it and renames it to `step-N/`, then
rewrites `latest`, and only then deletes checkpoints beyond `keep_last`: a crash at any point
leaves a complete checkpoint. Resume `auto` takes the newest complete `step-N/`, skipping (with a
warning) any that is incomplete or damaged: every file a resume reads is checked (sizes, parse,
every rank's RNG file), and every file against the CRC-32 of it written at commit (`digests.json`;
the ranks share the reading; a checkpoint whose train_state.json says it has digests and has none
is damaged). A skipped checkpoint is set aside by the run
directory (sft/training/rundir.py), so a requeued job does not stumble on it again.
A save that fails (disk full, permissions) removes its `.tmp`, leaves the previous checkpoints as
they were and stops the run with one clear error.

Data position: the sampler is a pure function of (seed, step, global batch), so the step is the
data position. Resuming on another number of ranks with the same global batch (micro-batch x
grad-acc x ranks) continues with exactly the samples the original run would have seen.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml

from sft.errors import UserError

# The names of a checkpoint's files besides DCP's (the layout above); the manager writes them,
# export and the checks below read them.
TRAIN_STATE = "train_state.json"
SCHEDULER = "scheduler.pt"
CONFIG = "config.yaml"
HF_FILES = "hf"
LATEST = "latest"
DIGESTS = "digests.json"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def read_train_state(path: Path) -> dict:
    state = json.loads(path.read_text())
    for key in ("step", "tokens_seen", "global_batch", "world_size"):
        state[key]  # noqa: B018 -- a KeyError marks the file as damaged
    return state


# Files of a checkpoint besides DCP's, each with a reader that fails if the file is damaged.
_FILES = {
    TRAIN_STATE: read_train_state,
    SCHEDULER: lambda path: torch.load(path, weights_only=False),
    CONFIG: lambda path: yaml.safe_load(path.read_text())["model"],
    f"{HF_FILES}/config.json": lambda path: json.loads(path.read_text())["model_type"],
}


class CheckpointError(UserError):
    """A checkpoint cannot be used or written; the message names the directory and the fix."""


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def committed_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories, newest first."""
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name.removeprefix("step-").isdigit()]
    return sorted(found, key=step_of, reverse=True)



def digest(path: Path) -> str:
    """CRC-32 of a file's bytes: 3.6 GiB/s on one core of the CPU dev machine, and zlib releases the
    GIL, so the writer thread computes it beside training."""
    crc, buffer = 0, bytearray(1 << 24)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"crc32:{crc:08x}"


def data_files(path: Path, rank: int = 0, world_size: int = 1) -> list[Path]:
    """This rank's share of a checkpoint's DCP data files (every world_size-th, sorted by name)."""
    return sorted(path.glob("*.distcp"))[rank::world_size]


def content_problem(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """Which of this rank's share of `path`'s files differs from the digest written at commit (a bit
    flip, a partial overwrite, bytes of the right size that are not the checkpoint), or None. Never
    raises: a file that cannot be read is a problem like any other (every rank must reach the
    collective that compares their answers). A checkpoint written before digests existed has none."""
    reading = DIGESTS
    try:
        if not (path / DIGESTS).is_file():
            reading = TRAIN_STATE
            state = path / reading
            return f"missing {DIGESTS}" if state.is_file() and json.loads(state.read_text()).get("digests") else None
        digests = json.loads((path / DIGESTS).read_text())
        if not isinstance(digests, dict) or not all(isinstance(d, str) for d in digests.values()):
            return f"unreadable {DIGESTS} (not a mapping of file names to digests)"
        unlisted = [data.name for data in data_files(path) if data.name not in digests]
        if rank == 0 and unlisted:
            return f"{unlisted[0]} is not in {DIGESTS}"
        for reading in sorted(digests)[rank::world_size]:
            if digest(path / reading) != digests[reading]:
                return f"{reading} differs from its digest (damaged after it was written)"
        return None
    except Exception as e:  # unreadable (EIO, a stale handle, garbage)
        return f"unreadable {reading} ({type(e).__name__}: {e})"


def checkpoint_problem(path: Path, files: tuple[str, ...] = tuple(_FILES)) -> str | None:
    """Why `path` is not a complete, readable checkpoint (DCP data plus `files`), or None. Never
    raises: a filesystem error is a problem of the checkpoint, and the search goes on."""
    try:
        return _structure_problem(path, files)
    except OSError as e:
        return f"unreadable ({e})"


def _structure_problem(path: Path, files: tuple[str, ...]) -> str | None:
    if not path.is_dir():
        return "no such directory"
    missing = [f for f in (".metadata", *files) if not (path / f).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # unreadable metadata: truncated or corrupt
        return f"unreadable .metadata ({type(e).__name__}: {e})"
    for info in metadata.storage_data.values():
        data = path / info.relative_path
        if not data.is_file() or data.stat().st_size < info.offset + info.length:
            return f"data file {info.relative_path} is missing or truncated"
    for name in files:
        try:
            _FILES[name](path / name)
        except Exception as e:  # empty, truncated or garbage: what a crash before fsync leaves
            return f"unreadable {name} ({type(e).__name__})"
    if TRAIN_STATE in files:  # every rank of the saving run wrote its RNG state
        ranks = read_train_state(path / TRAIN_STATE)["world_size"]
        missing = [rng_file(r) for r in range(ranks) if not (path / rng_file(r)).is_file()]
        if missing:
            return f"missing {', '.join(missing)}"
    for rng in path.glob(rng_file("*")):
        try:
            torch.load(rng, weights_only=False)
        except Exception as e:
            return f"unreadable {rng.name} ({type(e).__name__})"
    return None


def shape_mismatches(path: Path, model_state: dict) -> list[str]:
    """Model tensors that differ between a model's state dict and the checkpoint `path`'s (another
    architecture, size or depth): shapes of the tensors both have, and tensors only one of them has."""
    saved = {key.removeprefix("model."): tuple(meta.size)
             for key, meta in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
             if key.startswith("model.")}
    ours = {name: tuple(tensor.shape) for name, tensor in model_state.items()}
    return [f"{name}: {ours.get(name, 'absent')} here, {saved.get(name, 'absent')} in the checkpoint"
            for name in sorted(ours.keys() | saved.keys()) if ours.get(name) != saved.get(name)]
