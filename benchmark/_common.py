"""Small helpers shared by the benchmark scripts: device-aware timing, rates,
fixed-width tables and the JSON result file.

Units: a batch of "1M keys" is 2**20 keys, so rates are reported in
Mkeys/s = 2**20 keys/s (and Gkeys/s = 2**30 keys/s on CUDA).
"""
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

MKEYS = float(2**20)
GKEYS = float(2**30)
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def default_out(name: str) -> str:
    """benchmark/results/<name>.json"""
    return os.path.join(RESULTS_DIR, f"{name}.json")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device):
    """(seconds, fn()) with the device synchronised on both sides."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


class Measurement:
    """Times of one operation over repeats of `n` items each."""

    def __init__(self, name: str, n: int, times: Sequence[float], extra: Optional[dict] = None):
        self.name = name
        self.n = n
        self.times = list(times)
        self.extra = dict(extra or {})

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)

    @property
    def rate(self) -> float:
        """items per second at the median time"""
        return self.n / self.median_s

    @property
    def mrate(self) -> float:
        return self.rate / MKEYS

    def to_json(self) -> dict:
        return {
            "n": self.n,
            "median_s": self.median_s,
            "min_s": min(self.times),
            "times_s": self.times,
            "keys_per_s": self.rate,
            "mkeys_per_s": self.mrate,
            "gkeys_per_s": self.rate / GKEYS,
            **self.extra,
        }


def _cpu_times():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]  # total, idle + iowait


def cpu_idle_share(window: float = 0.1) -> float:
    """Share of all CPUs left idle over the next `window` seconds (1.0 where unknown)."""
    try:
        t0, i0 = _cpu_times()
        time.sleep(window)
        t1, i1 = _cpu_times()
    except (OSError, ValueError, IndexError):
        return 1.0
    return (i1 - i0) / max(1, t1 - t0)


class IdleGate:
    """Waits, before a timed repeat, until the CPUs the benchmark uses are idle
    (other processes on a shared machine skew timings); gives up after
    `max_wait` seconds and counts that. max_wait <= 0 disables it."""

    def __init__(self, max_wait: float, threads: int):
        self.max_wait = max_wait
        self.need = 0.9 * min(1.0, threads / (os.cpu_count() or 1))
        self.waited_s = 0.0
        self.gave_up = 0
        self.gated = 0

    def __call__(self) -> None:
        if self.max_wait <= 0:
            return
        t0 = time.perf_counter()
        self.gated += 1
        while cpu_idle_share() < self.need:
            if time.perf_counter() - t0 >= self.max_wait:
                self.gave_up += 1
                break
        self.waited_s += time.perf_counter() - t0

    def to_json(self) -> dict:
        return {"max_wait_s": self.max_wait, "idle_share_needed": round(self.need, 3),
                "repeats_gated": self.gated, "gave_up": self.gave_up, "waited_s": round(self.waited_s, 1)}


class Op(NamedTuple):
    """One timed operation: setup() -> arg, fn(arg) timed, then (untimed)
    teardown(arg, result) and keep(result), and at the end extra(the kept
    values of the timed repeats) -> a dict for the JSON record. keep should
    make results small: results held across repeats (tens of MiB for a
    million keys) made the next calls' outputs land on fresh pages, and
    their page faults doubled an evicting insert's time."""
    name: str
    fn: Callable[[Any], Any]
    setup: Optional[Callable[[], Any]] = None
    teardown: Optional[Callable[[Any, Any], None]] = None
    keep: Optional[Callable[[Any], Any]] = None
    extra: Optional[Callable[[List[Any]], dict]] = None


def bench_round_robin(ops: Sequence[Op], n: int, device: torch.device, repeats: int, warmup: int = 1,
                      gate: Optional[Callable[[], None]] = None) -> Dict[str, Measurement]:
    """Times each op `warmup` times (discarded) and `repeats` times (kept),
    the ops taking turns: one call of each per round, so that ops whose rates
    are compared see the same state of a shared machine (load from other
    VMs came and went within seconds here, moving single measurements by up
    to 2x). `gate()` (e.g. an IdleGate) runs before each timed call."""
    times: Dict[str, List[float]] = {op.name: [] for op in ops}
    results: Dict[str, List[Any]] = {op.name: [] for op in ops}
    for r in range(warmup + repeats):
        for op in ops:
            arg = op.setup() if op.setup is not None else None
            if gate is not None and r >= warmup:
                gate()
            dt, out = timed(lambda: op.fn(arg), device)
            if op.teardown is not None:
                op.teardown(arg, out)
            if r >= warmup:
                times[op.name].append(dt)
                if op.extra is not None:
                    results[op.name].append(op.keep(out) if op.keep is not None else out)
    return {op.name: Measurement(op.name, n, times[op.name],
                                 op.extra(results[op.name]) if op.extra is not None else None) for op in ops}


def bench(name: str, fn: Callable[[Any], Any], n: int, device: torch.device, repeats: int,
          warmup: int = 1, setup: Optional[Callable[[], Any]] = None,
          teardown: Optional[Callable[[Any, Any], None]] = None,
          keep: Optional[Callable[[Any], Any]] = None,
          extra: Optional[Callable[[List[Any]], dict]] = None,
          gate: Optional[Callable[[], None]] = None) -> Measurement:
    """One op timed alone (bench_round_robin of one)."""
    return bench_round_robin([Op(name, fn, setup, teardown, keep, extra)], n, device, repeats, warmup,
                             gate)[name]


def fmt_rate(m: Optional[Measurement], device: torch.device) -> str:
    if m is None:
        return "-"
    if device.type == "cuda":
        return f"{m.rate / GKEYS:.3f}G"
    return f"{m.mrate:.1f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], min_width: int = 6) -> str:
    """Right-aligned fixed-width columns, the first left-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(min_width, max(len(r[i]) for r in cells)) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _git_commit() -> Optional[str]:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except Exception:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def loadavg() -> Optional[List[float]]:
    """1, 5 and 15 minute load averages (None where unknown): other work on the
    machine skews the timings, so the results record it."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def busy_warning(threads: int) -> Optional[str]:
    """A warning line when the machine already runs other work."""
    la = loadavg()
    if la is not None and la[0] > 0.5:
        return (f"warning: load average {la[0]:.2f} before the run ({os.cpu_count()} CPUs, {threads} threads "
                f"used here): other processes are running, timings may be low and noisy")
    return None


def _thp_mode() -> Optional[str]:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
        return mode[mode.index("[") + 1:mode.index("]")]
    except (OSError, ValueError):
        return None


def huge_page_share(t: torch.Tensor) -> Optional[float]:
    """The share of a CPU tensor's bytes on 2 MiB pages (from /proc/self/smaps;
    None where that is not readable)."""
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    huge = 0
    try:
        with open("/proc/self/smaps") as f:
            overlaps = False
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    a, b = (int(x, 16) for x in head.split("-"))
                    overlaps = a < hi and lo < b
                elif overlaps and head == "AnonHugePages:":
                    huge += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return min(huge, hi - lo) / max(1, hi - lo)


def env_info(device: torch.device) -> Dict[str, Any]:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "units": "Mkeys/s = 2^20 keys/s, Gkeys/s = 2^30 keys/s",
        "loadavg_start": loadavg(),
        # Huge pages matter for random access over GiB-sized tensors: PyTorch
        # madvises its CPU allocations >= 2 MiB when THP_MEM_ALLOC_ENABLE=1.
        "thp_mode": _thp_mode(),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def write_json(path: str, payload: Dict[str, Any]) -> str:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")
    return path
