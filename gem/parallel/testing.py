"""Run a function on N CPU processes joined by gloo, for tests and examples.

    results = run_distributed(fn, 4, arg)   # fn(rank, world_size, arg) in 4 processes; rank-ordered results

Processes are forked from a forkserver that imported torch once, so a call costs well under a
second rather than one torch import per rank. fn must be importable (module level) and its
result picklable. An exception on any rank is re-raised here with that rank's traceback.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

from gem.launcher import free_port

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.functional"])
    return _CTX


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes share 2 cores in CI; more threads only thrash
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=dt.timedelta(seconds=120))
        out = fn(rank, world_size, *args)
        # plain pickle bytes: tensors by value, not as shared-memory handles that die with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
                    env: dict[str, str] | None = None) -> list[Any]:
    """fn(rank, world_size, *args) on world_size gloo processes; the results in rank order."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, results, dict(env or {})), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout)
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # the other ranks are likely stuck in a collective
    except queue.Empty:
        errors.append(f"timed out after {timeout}s waiting for ranks {sorted(set(range(world_size)) - set(out))}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("distributed run failed: " + "\n".join(errors))
    return [out[r] for r in range(world_size)]
