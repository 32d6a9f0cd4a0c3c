"""Runs documentation code blocks, one after another in this process, each as
a fresh program would see it: a new namespace (``__name__ == "__main__"``), a
new empty working directory, the environment as it was, and no process group
left over from the block before. Torch is imported once for all of them,
which keeps the docs test fast.

    python run_blocks.py BLOCKS.json RESULTS.json

BLOCKS.json: [{"where": "README.md:12", "code": "..."}]. RESULTS.json gets,
per block, {"where", "ok", "error", "seconds"}; it is rewritten after each
block, so a block that kills the process leaves the results before it. Each
block's output follows a line "=== block <where> ===" on stdout."""
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
import warnings


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(where: str, code: str) -> dict:
    import torch.distributed as dist
    env, cwd = dict(os.environ), os.getcwd()
    work = tempfile.mkdtemp(prefix="docblock-")
    # A block that starts a process group takes MASTER_PORT from the
    # environment when set: a free port, so that runs in parallel never meet.
    os.environ["MASTER_PORT"] = _free_port()
    os.chdir(work)
    start = time.monotonic()
    try:
        with warnings.catch_warnings():
            exec(compile(code, where, "exec"), {"__name__": "__main__"})  # noqa: S102 - the docs' own code
        ok, error = True, None
    except BaseException:  # noqa: BLE001 - reported to the test
        ok, error = False, traceback.format_exc()
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        shutil.rmtree(work, ignore_errors=True)
    return {"where": where, "ok": ok, "error": error, "seconds": round(time.monotonic() - start, 2)}


def main(blocks_path: str, results_path: str) -> int:
    with open(blocks_path) as f:
        blocks = json.load(f)
    results = []
    for b in blocks:
        print(f"=== block {b['where']} ===", flush=True)
        results.append(_run(b["where"], b["code"]))
        sys.stdout.flush()
        sys.stderr.flush()
        with open(results_path, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
