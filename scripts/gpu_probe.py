"""What runs on the GPU machine beside a CPU build of fbgemm_gpu: the imports,
then TorchRec and FBGEMM ops on tensors of DEVICE, each recorded as ok or as
its error (nothing here fails the run). Part (a) of scripts/gpu_check.sh.

    python scripts/gpu_probe.py OUT.json [--device cuda|cpu]

The CPU build of fbgemm_gpu registers its ops for the CPU dispatch key only,
so an op that reaches an fbgemm kernel with CUDA tensors is expected to fail
("... is not available for the CUDA backend"); the probe says which ones do,
and whether a TorchRec model whose tables are all dynamic (our kernels) still
shards, trains and pipelines on CUDA on one rank.
"""
import argparse
import json
import os
import socket
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def _version(name):
    try:
        import importlib.metadata as md
        return md.version(name)
    except Exception:  # not installed
        return None


def env_info(device):
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "device": str(device)}
    for name in ("torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu", "tensordict", "torchmetrics", "pyre-extensions"):
        info[name] = _version(name)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_sm=f"{p.major}.{p.minor}", gpu_mem_gib=round(p.total_memory / 2**30, 1),
                    gpu_count=torch.cuda.device_count())
    return info


# ---- the checks (each returns a short note or raises) ------------------------------------------


@check
def import_fbgemm_gpu(dev):
    import fbgemm_gpu  # noqa: F401
    return f"fbgemm ops registered: {hasattr(torch.ops.fbgemm, 'asynchronous_complete_cumsum')}"


@check
def import_torchrec(dev):
    import torchrec  # noqa: F401
    import torchrec.distributed  # noqa: F401
    import torchrec.distributed.train_pipeline  # noqa: F401
    import torchrec.models.dlrm  # noqa: F401
    return "torchrec, .distributed, .train_pipeline, .models.dlrm"


@check
def import_dynamicemb_torchrec(dev):
    import dynamicemb.planner  # noqa: F401
    import dynamicemb.shard  # noqa: F401
    from dynamicemb import _ops  # noqa: F401
    return "dynamicemb.planner, dynamicemb.shard"


def _kjt(dev):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4, 5, 6], device=dev),
        lengths=torch.tensor([1, 2, 0, 3], device=dev))


@check
def kjt_to_dict_split(dev):
    kjt = _kjt(dev)
    d = kjt.to_dict()
    parts = kjt.split([1, 1])
    assert d["f2"].values().tolist() == [4, 5, 6] and parts[1].values().tolist() == [4, 5, 6]
    return "to_dict, split"


@check
def kjt_permute(dev):
    p = _kjt(dev).permute([1, 0])
    assert p.values().tolist() == [4, 5, 6, 1, 2, 3], p.values().tolist()
    return "permute (fbgemm permute_2D_sparse_data)"


@check
def fbgemm_complete_cumsum(dev):
    import fbgemm_gpu  # noqa: F401
    out = torch.ops.fbgemm.asynchronous_complete_cumsum(torch.tensor([1, 2, 3], device=dev))
    assert out.tolist() == [0, 1, 3, 6]
    return "asynchronous_complete_cumsum"


@check
def fbgemm_block_bucketize(dev):
    import fbgemm_gpu  # noqa: F401
    lengths = torch.tensor([2, 1], device=dev)
    indices = torch.tensor([0, 5, 3], device=dev)
    out = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths, indices, False, False, torch.tensor([4], device=dev), 2, None)
    return f"block_bucketize_sparse_features -> lengths {out[0].tolist()}"


@check
def fbgemm_jagged_to_dense(dev):
    import fbgemm_gpu  # noqa: F401
    values = torch.arange(6.0, device=dev).view(3, 2)
    out = torch.ops.fbgemm.jagged_2d_to_dense(values, torch.tensor([0, 1, 3], device=dev), 2)
    return f"jagged_2d_to_dense -> {tuple(out.shape)}"


@check
def keyed_tensor_regroup(dev):
    from torchrec.sparse.jagged_tensor import KeyedTensor
    kt = KeyedTensor(keys=["a", "b"], length_per_key=[2, 3], values=torch.randn(4, 5, device=dev))
    out = KeyedTensor.regroup([kt], [["b"], ["a"]])
    return f"regroup -> {[tuple(t.shape) for t in out]}"


@check
def unsharded_ebc(dev):
    import torchrec
    ebc = torchrec.EmbeddingBagCollection(device=dev, tables=[
        torchrec.EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
        torchrec.EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2"])])
    out = ebc(_kjt(dev))
    out.values().sum().backward()
    return f"EmbeddingBagCollection forward+backward -> {tuple(out.values().shape)}"


@check
def fbgemm_tbe(dev):
    sys.path.insert(0, os.path.join(ROOT, "benchmark"))
    from bench_embedding import fbgemm_tbe as make
    from dynamicemb.optimizer import EmbOptimType
    tbe = make(1, 100, 8, EmbOptimType.EXACT_SGD, 0.1, 1, dev)
    out = tbe(torch.tensor([1, 2, 3], device=dev), torch.tensor([0, 2, 3], device=dev))
    out.sum().backward()
    return f"SplitTableBatchedEmbeddingBagsCodegen forward+backward -> {tuple(out.shape)}"


def _process_group(dev):
    import torch.distributed as dist
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("cuda:nccl,cpu:gloo" if dev.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.GroupMember.WORLD


def _dlrm(dev, native: bool):
    """TorchRec's DLRM with 3 sparse features, all on dynamic tables (or the
    last on a native TBE table), sharded on one rank."""
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.models.dlrm import DLRM, DLRMTrain

    from dynamicemb import DynamicEmbTableOptions, EmbOptimType
    from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints
    from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder
    pg = _process_group(dev)
    tables = [torchrec.EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], embedding_dim=8,
                                          num_embeddings=1000 if (native and i == 2) else 2**40) for i in range(3)]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8],
                           over_arch_layer_sizes=[16, 1], dense_device=dev))
    opts = DynamicEmbTableOptions(max_capacity=1 << 12, init_capacity=1 << 10)
    constraints = {t.name: DynamicEmbParameterConstraints(use_dynamicemb=True, dynamicemb_options=opts)
                   for t in tables if t.num_embeddings > 1000}
    sharder = DynamicEmbeddingBagCollectionSharder(fused_params=dict(optimizer=EmbOptimType.EXACT_SGD,
                                                                     learning_rate=0.1))
    plan = DynamicEmbeddingShardingPlanner(tables, Topology(world_size=1, compute_device=dev.type),
                                           constraints=constraints).collective_plan(model, [sharder], pg)
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=dev, plan=plan,
                                    sharders=[sharder])


def _batches(n, seed=0):
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 3, (3 * 16,), generator=g)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
        out.append(Batch(dense_features=torch.randn(16, 4, generator=g),
                         sparse_features=KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], values, lengths),
                         labels=torch.randint(0, 2, (16,), generator=g).float()))
    return out


def _train_steps(model, dev, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for b in _batches(steps):
        loss, _ = model(b.to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.detach().item()


@check
def dmp_dynamic_tables_train(dev):
    loss = _train_steps(_dlrm(dev, native=False), dev)
    return f"DLRM, 3 dynamic tables, DMP on 1 rank: 3 steps, loss {loss:.4f}"


@check
def dmp_native_table_train(dev):
    loss = _train_steps(_dlrm(dev, native=True), dev)
    return f"DLRM, 2 dynamic + 1 native (TBE) table, DMP on 1 rank: 3 steps, loss {loss:.4f}"


@check
def train_pipeline_sparse_dist(dev):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    model = _dlrm(dev, native=False)
    pipe = TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), dev)
    it = iter(_batches(4, seed=1))
    steps = 0
    try:
        while True:
            pipe.progress(it)
            steps += 1
    except StopIteration:
        pass
    return f"TrainPipelineSparseDist, dynamic tables: {steps} steps"


def _sync_site(filename, lineno):
    """The innermost frame of dynamicemb's own code on the current stack, as
    "path:line code" (else the warning's own location)."""
    ours = os.path.join(ROOT, "dynamicemb") + os.sep
    stack = traceback.extract_stack()
    frames = [f for f in stack if f.filename.startswith(ours)]
    if not frames:  # the warning's location, and the frames that led there
        outer = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in stack[-6:-1][::-1])
        return f"{filename}:{lineno} < {outer}"
    f = frames[-1]
    return f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {(f.line or '').strip()[:80]}"


def _count_syncs(fn):
    """fn() under torch.cuda.set_sync_debug_mode("warn"): {site: count} of
    its host synchronisations (warnings raised in autograd's threads come
    back at backward()'s call: their site is then the caller's)."""
    import collections
    import warnings
    sites = collections.Counter()
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # restores showwarning and the filters
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, lineno, *a, **k: sites.update(
            [_sync_site(filename, lineno)])
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sites.most_common())


@check
def module_step_host_syncs(dev):
    """Host synchronisations inside one training step of our module (issue
    32 wants none), forward and backward apart, for a batch of stored keys
    and one of new keys: where each happens, for the session that removes them.
    torch's sync debug mode sees only syncs through torch (`.item()`, copies
    to the host); a C++ op's own cudaStreamSynchronize (emb_unique's group
    count, before the padded step) shows in `runtime_syncs`: per step and per
    op, from the profiler. The padded step (docs/gpu/sync_free_step.md) should show none."""
    if dev.type != "cuda":
        return "not counted: host synchronisation is a CUDA notion"
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions, EmbOptimType
    opts = [DynamicEmbTableOptions(dim=64, max_capacity=1 << 16, init_capacity=1 << 16) for _ in range(2)]
    m = BatchedDynamicEmbeddingTables(opts, optimizer=EmbOptimType.ADAM, learning_rate=0.01, device=dev)
    g = torch.Generator().manual_seed(0)

    def batch(lo, hi):
        idx = torch.randint(lo, hi, (2 * 512 * 8,), generator=g).to(dev)
        return idx, torch.arange(0, idx.numel() + 1, 8, device=dev)

    stored = batch(0, 10_000)
    for _ in range(3):
        m(*stored).sum().backward()
    out = {}
    for label, b in (("stored_keys", stored), ("new_keys", batch(10**6, 2 * 10**6))):
        held = {}
        fwd = _count_syncs(lambda: held.update(out=m(*b)))
        bwd = _count_syncs(lambda: held["out"].sum().backward())
        calls = _profile(lambda: m(*b).sum().backward())["runtime_calls"]
        out[label] = {"forward_syncs": sum(fwd.values()), "backward_syncs": sum(bwd.values()),
                      "forward_sites": fwd, "backward_sites": bwd,
                      "runtime_syncs": {op: c["sync"] for op, c in calls["by_op"].items()
                                        if c.get("sync") and op != "(no parent)"}}  # that one: the profile's own
    return out


def _wall_ms(fn, steps, sync_each=False):
    """Wall ms per call of fn over `steps` calls, the device idle before and
    after (and after each call with sync_each)."""
    import time
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) * 1e3 / steps, 3)


PROFILED_SHAPE = (8, 4096, 10)  # tables, batch, pooling: bench_embedding's


def _profiled_step(dev):
    """The profiled step's module (EXACT_SGD, dim 64) and its batch: skewed
    stored keys, offsets, and the output's gradient."""
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions, EmbOptimType
    tables, batch, pooling = PROFILED_SHAPE
    opts = [DynamicEmbTableOptions(dim=64, max_capacity=1 << 18, init_capacity=1 << 18) for _ in range(tables)]
    m = BatchedDynamicEmbeddingTables(opts, optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.01, device=dev)
    g = torch.Generator().manual_seed(0)
    idx = (torch.randint(0, 1 << 17, (tables * batch * pooling,), generator=g) ** 2 // (1 << 17)).to(dev)  # skewed
    off = torch.arange(0, idx.numel() + 1, pooling, device=dev)
    return m, idx, off, torch.randn(batch, tables * 64, device=dev)


@check
def module_step_profile(dev):
    """Where one CUDA training step of bench_embedding's shapes (8 tables,
    dim 64, batch 4096 x pooling 10, EXACT_SGD, stored keys) spends its time:
    wall ms per step, the GPU's busy ms in it, and the top ops by host time
    and by GPU time (torch.profiler), for the step against EmbeddingBag."""
    if dev.type != "cuda":
        return "not profiled: a CUDA step's profile"
    import time
    m, idx, off, grad = _profiled_step(dev)
    for _ in range(5):
        m(idx, off).backward(grad)
    torch.cuda.synchronize()
    t0, steps = time.perf_counter(), 10
    for _ in range(steps):
        m(idx, off).backward(grad)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    prof = _profile(lambda: m(idx, off).backward(grad))
    return {"wall_ms_per_step": round(wall_ms, 3), **_phase_walls(m, idx, off, grad),
            "gpu_busy_ms_per_step": prof["gpu_busy_ms"], "top_host_ms": prof["top_host_ms"],
            "top_gpu_ms": prof["top_gpu_ms"], "runtime_calls_per_step": prof["runtime_calls"]}


@check
def module_churn_step_profile(dev):
    """module_step_profile's step with keys that churn, as bench_embedding's
    do (a skewed draw over 2^20 ids per table into 2^18 slots: new keys,
    evictions and new rows every step), batches cycled: wall ms per step, the
    top ops by GPU and by host time, and the runtime calls."""
    if dev.type != "cuda":
        return "not profiled: a CUDA step's profile"
    import itertools
    import time
    m, _, off, grad = _profiled_step(dev)
    tables, batch, pooling = PROFILED_SHAPE
    g = torch.Generator().manual_seed(1)
    n = tables * batch * pooling
    batches = [(torch.rand(n, generator=g) ** 3 * (1 << 20)).long().to(dev) for _ in range(6)]
    for i in range(12):
        m(batches[i % 6], off).backward(grad)
    torch.cuda.synchronize()
    t0, steps = time.perf_counter(), 12
    for i in range(steps):
        m(batches[i % 6], off).backward(grad)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    nth = itertools.count()
    prof = _profile(lambda: m(batches[next(nth) % 6], off).backward(grad))
    return {"wall_ms_per_step": round(wall_ms, 3), "gpu_busy_ms_per_step": prof["gpu_busy_ms"],
            "top_gpu_ms": prof["top_gpu_ms"], "top_host_ms": prof["top_host_ms"],
            "runtime_calls_per_step": prof["runtime_calls"]}


@check
def module_step_host_breakdown(dev):
    """Where the host's time goes in module_step_profile's step: every CUDA
    runtime call by name (calls and host ms per step, e.g. allocations or
    event queries that block), the step without the backward's non-finite
    check (its one sync), and nn.EmbeddingBag's step on the same batch with
    its own runtime calls: what our step does that the baseline does not;
    also the step with emb_unique's exact (synchronising) form instead of the
    padded one (docs/gpu/sync_free_step.md)."""
    if dev.type != "cuda":
        return "not profiled: a CUDA step's host time"
    import collections
    from torch.profiler import ProfilerActivity, profile
    tables, batch, pooling = PROFILED_SHAPE
    m, idx, off, grad = _profiled_step(dev)
    bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(1 << 17, 64, mode="sum", sparse=True) for _ in range(tables)).to(dev)
    sgd = torch.optim.SGD(bags.parameters(), lr=0.01)
    per_table = idx.view(tables, -1)
    bag_off = torch.arange(0, batch * pooling, pooling, device=dev)

    def ours():
        m(idx, off).backward(grad)

    def bag_step():
        sgd.zero_grad(set_to_none=True)
        torch.cat([b(per_table[t], bag_off) for t, b in enumerate(bags)], 1).backward(grad)
        sgd.step()

    def wall(fn):
        for _ in range(5):
            fn()
        return _wall_ms(fn, 20)

    def runtime(fn, steps=3):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
        calls, ms = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.name.startswith(("cuda", "cu")) and not e.name.startswith("cudnn"):
                calls[e.name] += 1
                ms[e.name] += e.self_cpu_time_total / 1e3
        return {n: {"calls": round(calls[n] / steps, 1), "host_ms": round(ms[n] / steps, 3)}
                for n, _ in ms.most_common(12)}
    def exact_unique():  # the step as before the padded form: emb_unique's count read on the host (a sync)
        m._pads_unique = lambda indices: False
        try:
            ours()
        finally:
            del m._pads_unique

    # Alternating rounds, the best of each: the padded step against the exact one and the baseline.
    rounds = [(wall(ours), wall(exact_unique), wall(bag_step)) for _ in range(2)]
    out = {"ours_ms": min(r[0] for r in rounds), "ours_exact_unique_ms": min(r[1] for r in rounds),
           "bag_ms": min(r[2] for r in rounds)}
    out["ours_over_bag"] = round(out["ours_ms"] / out["bag_ms"], 3)
    cls = type(m)
    check = cls._apply_gradients
    try:  # the backward without its finiteness check: the cost of that one sync (not a semantic)
        def unchecked(self, grad_output, rows, utids, inverse, offsets, psw):
            self.optimizer_step += 1
            from dynamicemb._ops import ops
            from dynamicemb.optimizer import clipping_bound
            ops.emb_backward_update(grad_output.to(torch.float32).contiguous(), self.storage.weights(), rows, utids,
                                    inverse, offsets, self.feature_table_map, self.dims, psw, self.pooling,
                                    self.optimizer, self.learning_rate, self.eps, self.beta1, self.beta2,
                                    self.weight_decay, self.optimizer_step, self.weight_decay_mode,
                                    clipping_bound(self.gradient_clipping, self.max_gradient))
            self.storage.batch_done()
        cls._apply_gradients = unchecked
        out["ours_without_finite_check_ms"] = wall(ours)
    except Exception as e:  # the probe records
        out["ours_without_finite_check_ms"] = f"{type(e).__name__}: {e}"
    finally:
        cls._apply_gradients = check
    out["ours_runtime_calls"] = runtime(ours)
    out["bag_runtime_calls"] = runtime(bag_step)
    return out


RUNTIME_CALLS = {"cudaLaunchKernel": "launch", "cudaLaunchKernelExC": "launch", "cuLaunchKernel": "launch",
                 "cuLaunchKernelEx": "launch", "cudaMemcpyAsync": "memcpy", "cudaMemcpy": "memcpy",
                 "cudaMemsetAsync": "memset", "cudaStreamSynchronize": "sync", "cudaDeviceSynchronize": "sync",
                 "cudaEventSynchronize": "sync"}


@check
def table_op_profile(dev):
    """Where the table ops of bench_table spend their time (16M slots filled
    to LF 0.5, 1M-key batches, TIMESTAMP): per op (lookup, insert of new keys,
    insert of found keys; the median of 5 synced calls), the GPU's busy ms,
    the top kernels and host ops, and the CUDA runtime calls: which part of
    an op bounds it (2026-11-27: the insert kernel, 0.59 of a 0.62 ms op)."""
    if dev.type != "cuda":
        return "not profiled: CUDA table ops"
    import time
    from dynamicemb import ScoredHashTable
    t = ScoredHashTable(1 << 24, bucket_capacity=128, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)

    def keys(n):
        return torch.randint(0, 1 << 62, (n,), device=dev, generator=g)
    for _ in range(8):
        t.insert(keys(1 << 20))
    stored, fresh = keys(1 << 20), keys(1 << 20)
    t.insert(stored)
    # New keys: the same batch, erased before each insert (untimed; its
    # kernels show apart in the profile), so that the load factor stays put.
    ops = {"lookup": (lambda: t.lookup(stored), None), "insert_found": (lambda: t.insert(stored), None),
           "insert_new": (lambda: t.insert(fresh), lambda: t.erase(fresh))}
    out = {}
    for name, (fn, before) in ops.items():
        walls = []
        for r in range(8):
            if before is not None:
                before()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if r >= 3:
                walls.append((time.perf_counter() - t0) * 1e3)
        prof = _profile((lambda: (before(), fn())) if before is not None else fn, n_top=10)
        out[name] = {"wall_ms": round(sorted(walls)[len(walls) // 2], 3), **prof}
    return out


def _profile(fn, runs=3, n_top=14):
    """fn run `runs` times under torch.profiler (CPU and CUDA), per run: the
    GPU's busy ms, the top ops by host and by GPU time, the runtime calls."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    dev_attr = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"

    def top(attr):
        rows = sorted(ev, key=lambda e: getattr(e, attr), reverse=True)[:n_top]
        return {e.key[:70]: round(getattr(e, attr) / (runs * 1e3), 3) for e in rows if getattr(e, attr) > 0}
    return {"gpu_busy_ms": round(sum(getattr(e, dev_attr) for e in ev) / (runs * 1e3), 3),
            "top_host_ms": top("self_cpu_time_total"), "top_gpu_ms": top(dev_attr),
            "runtime_calls": _runtime_calls(prof.events(), runs)}


def _runtime_calls(events, steps):
    """Per step: the CUDA runtime calls (kernel launches, copies, memsets,
    synchronisations) in all, and per top-level op that issued them (the
    outermost dynamicemb:: op, else the outermost op): which ops to fuse."""
    import collections
    total = collections.Counter()
    per_op = collections.defaultdict(collections.Counter)
    for e in events:
        kind = RUNTIME_CALLS.get(e.name)
        if kind is None:
            continue
        total[kind] += 1
        chain, p = [], e.cpu_parent
        while p is not None:
            chain.append(p.name)
            p = p.cpu_parent
        ours = [n for n in chain if n.startswith("dynamicemb::")]
        owner = ours[-1] if ours else (chain[-1] if chain else "(no parent)")
        per_op[owner[:70]][kind] += 1
    top = sorted(per_op.items(), key=lambda kv: -sum(kv[1].values()))[:30]
    return {"total": {k: round(v / steps, 1) for k, v in total.items()},
            "by_op": {name: {k: round(v / steps, 1) for k, v in c.items()} for name, c in top}}


def _phase_walls(m, idx, off, grad, steps=10):
    """Wall ms of the forward alone, the backward alone (each followed by a
    device sync), and of the host issuing one step behind a long GPU sleep:
    the issue time is the host's share when nothing waits for the device; a
    step that syncs waits for the sleep, which then shows."""
    import time

    def timed(fn):
        return _wall_ms(fn, steps, sync_each=True)
    outs = []

    def fwd():
        outs.append(m(idx, off))

    def bwd():
        outs.pop().backward(grad)
    fwd_ms = timed(fwd)
    bwd_ms = timed(lambda: (fwd(), torch.cuda.synchronize(), bwd()))  # fwd + bwd
    torch.cuda.synchronize()
    issue = []
    for _ in range(3):
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time ahead of the step
        t = time.perf_counter()
        m(idx, off).backward(grad)
        issue.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    return {"forward_ms": fwd_ms, "forward_then_backward_ms": bwd_ms,
            "host_issue_ms_behind_sleep": round(sorted(issue)[1], 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    result = {"env": env_info(dev), "checks": {}}
    for fn in CHECKS:
        t0 = time.perf_counter()
        try:
            note = fn(dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            rec = {"ok": True, "note": note}
        except BaseException as e:  # record and go on: the probe only reports
            if isinstance(e, KeyboardInterrupt):
                raise
            msg = str(e).strip().splitlines()
            rec = {"ok": False, "error": f"{type(e).__name__}: {msg[0][:300] if msg else ''}",
                   "where": traceback.format_exc().strip().splitlines()[-3][:300]}
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        result["checks"][fn.__name__] = rec
        print(f"[probe] {fn.__name__:28s} {'ok  ' if rec['ok'] else 'FAIL'} "
              f"{rec.get('note') or rec.get('error')}", flush=True)
        with open(args.out, "w") as f:  # after every check: a probe cut short still reports
            json.dump(result, f, indent=1)
    ok = sum(r["ok"] for r in result["checks"].values())
    print(f"[probe] {ok}/{len(CHECKS)} ok on {dev} ({result['env'].get('gpu', 'no GPU')})", flush=True)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
