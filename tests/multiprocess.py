"""Runs a function on N gloo ranks (spawned processes, a free port each run)
and returns what every rank returned, re-raising a rank's failure."""
import os
import queue as queue_mod
import socket
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 300):
    """[fn(rank, world_size, *args) for each rank], run in parallel processes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and all(not p.is_alive() for p in procs):
                    raise RuntimeError(f"ranks {dead} exited without a result (exit codes "
                                       f"{[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout} s") from None
                continue
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
