"""Run a function on N spawned processes joined in a gloo (or NCCL) process group.

Every rank runs ``fn(rank, world_size, *args)``. The helper returns the per-rank return values
(which must pickle) and raises :class:`DistributedTestError` carrying the traceback of each
failing rank when any rank raises, exits abnormally or overruns the timeout. Rendezvous goes
through a file store in a fresh temporary directory, so parallel test runs never share a port.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["DistributedTestError", "run_distributed"]


class DistributedTestError(RuntimeError):
    """One or more ranks of a :func:`run_distributed` call failed."""


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    init_file: str,
    backend: str,
    collective_timeout_s: float,
    results: mp.Queue,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            # A failed rank must not block its peers in a barrier: destroy without one.
            dist.destroy_process_group()
        # Plain pickle to bytes: the queue's own pickler would share a tensor's storage through
        # a file descriptor that dies with this process.
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - the traceback is the product here
        results.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    collective_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        timeout_s: wall-clock limit for the whole run; ranks still alive after it are killed.
        collective_timeout_s: timeout handed to the process group, so a rank waiting on a peer
            that died fails instead of hanging.
        env: extra environment variables for the children.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        DistributedTestError: with every failing rank's traceback (or exit code) in the message.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    child_env = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
    child_env.update({k: v for k, v in (env or {}).items()})
    with tempfile.TemporaryDirectory(prefix="cp_modules_dist_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    r,
                    world_size,
                    args,
                    init_file,
                    backend,
                    collective_timeout_s,
                    results,
                    child_env,
                ),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(outputs) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                status, rank, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit) is an error too.
                for r, p in enumerate(procs):
                    if (
                        r not in outputs
                        and r not in errors
                        and not p.is_alive()
                        and p.exitcode not in (0, None)
                    ):
                        # Give its queued message a moment to arrive before declaring it silent.
                        try:
                            status, rank, payload = results.get(timeout=1.0)
                        except queue.Empty:
                            errors[r] = f"rank {r} exited with code {p.exitcode} without a report"
                            continue
                        (outputs if status == "ok" else errors)[rank] = payload
                continue
            (outputs if status == "ok" else errors)[rank] = payload
            if errors:
                # Give peers blocked on the failed rank the collective timeout to fail themselves,
                # then stop waiting.
                deadline = min(deadline, time.monotonic() + collective_timeout_s + 10.0)
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()) if not errors else 5.0)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for r, p in enumerate(procs):
            if r not in outputs and r not in errors:
                errors[r] = (
                    "rank did not finish within the timeout (killed)"
                    if r in hung
                    else f"rank {r} exited with code {p.exitcode} without a report"
                )
        if errors:
            parts = [f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)]
            raise DistributedTestError(
                f"{len(errors)} of {world_size} ranks failed:\n" + "\n".join(parts)
            )
        return [pickle.loads(outputs[r]) for r in range(world_size)]
