"""How many ranks a run has: ``--processes`` and an external launcher's environment (``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``), read without importing torch, so that a command refuses a run too small for its ranks at once."""

from __future__ import annotations

import os

from .errors import InputError


def launched_world() -> tuple[int, int, int] | None:
    """``(rank, world size, local rank)`` set by an external launcher (or by vlmbind for its spawned ranks), or None
    when the process runs alone (no ``WORLD_SIZE`` above 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    rank = int(os.environ.get("RANK", "0"))
    return rank, world, int(os.environ.get("LOCAL_RANK", str(rank)))


def world_size(processes: int) -> int:
    """The number of ranks a command asked for ``--processes N`` runs with (a launcher's WORLD_SIZE wins over 1).

    Raises:
        InputError: ``processes`` is below 1, or disagrees with the launcher's WORLD_SIZE.
    """
    if processes < 1:
        raise InputError(f"--processes must be at least 1, got {processes}")
    launched = launched_world()
    if launched is None:
        return processes
    if processes not in (1, launched[1]):
        raise InputError(f"--processes {processes} disagrees with the launcher's WORLD_SIZE={launched[1]}; drop "
                         "--processes under torchrun / accelerate launch")
    return launched[1]
