"""Run a function on every rank: under torchrun (environment present) or on spawned processes.

``launch(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on each rank after the
default process group is up:

- under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) this process is one rank: the group comes
  from the environment and the call returns this rank's result;
- otherwise ``world_size`` processes are spawned and rendezvous over TCP on ``master_addr``
  (loopback by default) at a free port; the call returns rank 0's result, and raises if any
  rank fails (with its traceback);
- ``world_size == 1`` runs ``fn`` here without any process group.

NCCL ranks use GPU ``LOCAL_RANK``. Only rank 0 shows progress bars
(:func:`~cp_modules.distributed.progress.progress_bars_on_rank_zero`). Rank 0's result comes
back pickled to bytes, so it arrives whatever it holds (a tensor is copied, not shared through
a file descriptor of a process that has exited).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from cp_modules.distributed.progress import progress_bars_on_rank_zero

__all__ = ["LaunchError", "launch", "under_torchrun"]


class LaunchError(RuntimeError):
    """A spawned rank failed; the message carries its traceback."""


def under_torchrun() -> bool:
    """True when this process is one rank of a job started by torchrun (or a similar launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _init(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _worker(fn, rank, world_size, args, backend, timeout_s, env, results) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    progress_bars_on_rank_zero(rank)
    try:
        import torch.distributed as dist

        _init(backend, rank, world_size, timeout_s)
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle to bytes: the queue's own pickler would share a tensor's storage through
        # a file descriptor that dies with this process.
        results.put(("ok", rank, pickle.dumps(out if rank == 0 else None)))
    except BaseException:  # noqa: BLE001 - the traceback is what the parent reports
        results.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    master_addr: str = "127.0.0.1",
    timeout_s: float = 300.0,
) -> Any:
    """Run ``fn(rank, world_size, *args)`` on every rank; return rank 0's (or this rank's) result.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of ranks.
        backend: ``"gloo"`` or ``"nccl"``.
        master_addr: rendezvous address of spawned ranks.
        timeout_s: collective timeout; a rank whose peer died fails after it.

    Raises:
        ValueError: for ``world_size < 1``, or a torchrun job of another size.
        LaunchError: when a spawned rank fails.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if under_torchrun():
        import torch.distributed as dist

        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size:
            raise ValueError(
                f"torchrun started {env_world} ranks but the configuration needs {world_size}: "
                f"use torchrun --nproc-per-node {world_size}"
            )
        rank = int(os.environ["RANK"])
        progress_bars_on_rank_zero(rank)
        if not dist.is_initialized():
            _init(backend, rank, world_size, timeout_s)
        try:
            return fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    if world_size == 1:
        return fn(0, 1, *args)
    return _spawn(fn, world_size, args, backend, master_addr, timeout_s)


def _spawn(fn, world_size, args, backend, master_addr, timeout_s):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(_free_port(master_addr))}
    procs = [
        ctx.Process(
            target=_worker, args=(fn, r, world_size, args, backend, timeout_s, env, results)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = None
    try:
        while len(outputs) + len(errors) < world_size:
            if deadline is not None and time.monotonic() > deadline:
                break
            try:
                status, rank, payload = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in outputs and r not in errors and p.exitcode not in (None, 0):
                        try:  # its report may still be in flight
                            status, rank, payload = results.get(timeout=1.0)
                        except queue.Empty:
                            errors[r] = f"exited with code {p.exitcode} without a report"
                            continue
                        (outputs if status == "ok" else errors)[rank] = payload
                if errors and deadline is None:
                    deadline = time.monotonic() + 10.0
                continue
            (outputs if status == "ok" else errors)[rank] = payload
            if errors and deadline is None:
                # Peers blocked on the failed rank: give them a moment to report, then stop.
                deadline = time.monotonic() + 10.0
    finally:
        for p in procs:
            p.join(timeout=5.0 if errors else 60.0)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        parts = [f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)]
        raise LaunchError(f"{len(errors)} of {world_size} ranks failed:\n" + "\n".join(parts))
    missing = [r for r in range(world_size) if r not in outputs]
    if missing:
        raise LaunchError(f"ranks {missing} ended without a result")
    return pickle.loads(outputs[0])
