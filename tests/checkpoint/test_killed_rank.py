"""A rank SIGKILLed mid-step, or mid-dump, under torchrun --max-restarts 1:
the restarted group resumes from the last complete checkpoint (DynamicEmbDump,
or dcp.save of the model's state_dict) and ends with the same tables, bit for
bit, as a run that was never interrupted, cached tables (one over a FileStore
that the restarted ranks reopen) and admission counts included
(killed_rank_job.py is the job; the README's recipe is the same loop)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from ckpt_helpers import CLOCK_SCORES, TABLES  # noqa: E402

STEPS, EVERY = 8, 3  # checkpoints at steps 3 and 6

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch.distributed.run") is None or not torch.distributed.is_available()
    or not torch.distributed.is_gloo_available(),
    reason="torchrun (torch.distributed.run) with gloo is not available")


def torchrun(out, *job_args):
    os.makedirs(out)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", os.path.join(HERE, "killed_rank_job.py"), str(out), str(STEPS), str(EVERY),
           *map(str, job_args)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p.stderr


def finals(out):
    return [torch.load(os.path.join(out, f"final-rank{r}.pt"), weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("killed_rank") / "uninterrupted"
    torchrun(out)
    return finals(out)


@pytest.mark.parametrize("engine", ["dump", "dcp"])
@pytest.mark.parametrize("kill_step,kill_at,resumed_from", [(4, "step", 3), (6, "dump", 3)])
def test_resume_after_killed_rank_is_bit_identical(reference, tmp_path, kill_step, kill_at, resumed_from, engine):
    out = tmp_path / kill_at
    log = torchrun(out, kill_step, kill_at, engine)
    assert "exitcode: -9" in log, "rank 1 was not killed"
    # Attempt 0 started fresh; attempt 1 took the last *published* checkpoint
    # (a mid-dump kill leaves only step-6.tmp-<id>, which the resume ignores).
    with open(out / "resumed_from.txt") as f:
        assert f.read().split() == ["0", str(resumed_from)]
    if kill_at == "dump":
        assert any(n.startswith(f"step-{kill_step}.tmp-") for n in os.listdir(out / "ckpt"))
    for rank, (ref, got) in enumerate(zip(reference, finals(out))):
        assert got["_modules"] == ref["_modules"]  # steps and optimizer steps
        assert got["_counters"] == ref["_counters"], f"rank {rank}: admission counts differ"
        for t in TABLES:
            for k in ("keys", "values", "state") + (() if t in CLOCK_SCORES else ("scores",)):
                assert torch.equal(got[t][k], ref[t][k]), f"rank {rank} {t}: {k} differ from the uninterrupted run"
