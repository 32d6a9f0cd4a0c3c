"""A training job for torchrun (torchelastic, gloo, CPU) that checkpoints
every N steps (ENGINE "dump": DynamicEmbDump; "dcp": dcp.save of the model's
state_dict) and resumes from the last complete one.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \
        tests/checkpoint/killed_rank_job.py OUT STEPS EVERY [KILL_STEP [KILL_AT [ENGINE]]]

Two tables are cached (dcp_helpers.options): one over a host store, one over
a FileStore in OUT/store, which the restarted ranks reopen as it was left;
one table has frequency admission.

Step s trains on global_batch(s) (data order is a function of the step) and
a key's initial row is a function of (seed, table, key), so a resumed run
must end with the same tables, bit for bit, as an uninterrupted one. In the
first attempt only (TORCHELASTIC_RESTART_COUNT == 0), rank 1 SIGKILLs
itself at KILL_STEP: KILL_AT="step" after the forward, before the backward;
KILL_AT="dump" inside that step's checkpoint, after its shard is written and
before the checkpoint is published (KILL_STEP must be a checkpoint step then).
Both engines publish by renaming step-<n>.tmp-<id> to step-<n> once every
rank's part is written. At the end every rank saves its tables' entries (read
through both tiers, with the admission counts) to OUT/final-rank<r>.pt."""
import faulthandler
import os
import re
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_helpers as H  # noqa: E402
import dcp_helpers as D  # noqa: E402

from dynamicemb.checkpoint import dump as dump_mod  # noqa: E402
from dynamicemb.checkpoint.dump import DynamicEmbDump  # noqa: E402
from dynamicemb.checkpoint.load import DynamicEmbLoad  # noqa: E402

STEP_DIR = re.compile(r"^step-(\d+)$")  # PATH.tmp-<id> / PATH.old-<id> never match


def last_checkpoint(root: str):
    """(step, path) of the newest published checkpoint, or (0, None). A dump
    is published by an atomic rename, so an exact step-<n> name is complete;
    a dump that died midway left only step-<n>.tmp-<id>."""
    best = (0, None)
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = STEP_DIR.match(name)
        if m and int(m.group(1)) > best[0]:
            best = (int(m.group(1)), os.path.join(root, name))
    return best


def init_group() -> None:
    """init_process_group("gloo") on torchrun's store under a prefix of this
    attempt: with the plain env:// init, a restarted group could read the
    killed attempt's gloo addresses from the surviving store and fail (or
    hang) connecting to a dead rank."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timedelta(seconds=60))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"/job/attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))


def save_dcp(model, path: str, pg) -> None:
    """dcp.save into PATH.tmp-<attempt>, published by rank 0's rename once the
    save is complete (DCP's coordinator writes .metadata after every rank's
    data). A killed attempt's directory stays behind, never loaded."""
    tmp = f"{path}.tmp-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    D.save(model, tmp, pg)
    if dist.get_rank(pg) == 0:
        os.rename(tmp, path)
    dist.barrier(group=pg)


def kill_inside(cls, method: str, kill_step: int, path_of) -> None:
    """Wraps cls.method so that this process SIGKILLs itself once the call
    for step KILL_STEP's unpublished checkpoint has written its part."""
    original = getattr(cls, method)

    def dying(*args, **kwargs):
        result = original(*args, **kwargs)
        if os.path.basename(str(path_of(args))).startswith(f"step-{kill_step}.tmp-"):
            os.kill(os.getpid(), signal.SIGKILL)  # this rank's part written, checkpoint not published
        return result
    setattr(cls, method, dying)


def main(out: str, steps: int, every: int, kill_step: int = -1, kill_at: str = "step", engine: str = "dump") -> None:
    faulthandler.dump_traceback_later(60, exit=True)  # a hung rank fails the job, not the test's timeout
    init_group()
    pg = dist.group.WORLD
    rank = dist.get_rank()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    doomed = first_attempt and rank == 1

    model = D.build(pg, H.ADAM, tiers=True, store_dir=os.path.join(out, "store"))
    ckpt = os.path.join(out, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    start, path = last_checkpoint(ckpt)
    if path is not None:
        if engine == "dcp":
            D.load(model, path, pg)
        else:
            DynamicEmbLoad(path, model, counter=True, pg=pg)
    if rank == 0:
        with open(os.path.join(out, "resumed_from.txt"), "a") as f:
            f.write(f"{start}\n")

    if doomed and kill_at == "dump":
        if engine == "dcp":
            from torch.distributed.checkpoint import FileSystemWriter
            kill_inside(FileSystemWriter, "write_data", kill_step, lambda args: args[0].path)
        else:
            kill_inside(dump_mod, "_write_shard", kill_step, lambda args: args[0])

    model.train()
    for s in range(start, steps):
        loss = sum((v * v).sum() for v in H.outputs(model, H.kjts(H.global_batch(s), pg)).values())
        if doomed and kill_at == "step" and s == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: forward done, no update yet
        loss.backward()
        if (s + 1) % every == 0:
            path = os.path.join(ckpt, f"step-{s + 1}")
            save_dcp(model, path, pg) if engine == "dcp" else DynamicEmbDump(path, model, counter=True, pg=pg)
    torch.save(D.entries(model), os.path.join(out, f"final-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), int(a[2]), int(a[3]) if len(a) > 3 else -1, a[4] if len(a) > 4 else "step",
         a[5] if len(a) > 5 else "dump")
