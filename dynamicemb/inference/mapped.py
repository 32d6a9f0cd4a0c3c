"""An InferenceEmbeddingTable on disk, served from a memory map.

save() writes a table as one standard safetensors file (readable without
dynamicemb): its read-only hash index (slot_keys, slot_digests,
table_buckets), the eval initializers and each table's rows at their slots
(weight_<i>, in the table's precision: float rows or FBGEMM's 8-bit rowwise
uint8 rows), and in the metadata what the constructor derived (features,
dims, pooling, seed, ...). The data starts on a page boundary and each
tensor on a multiple of its element size (largest elements first).

load(path, mmap=True) maps the file (MAP_PRIVATE, never written) and the
module's buffers are views of the mapping: nothing is read at load, a
lookup reads the pages of the rows it touches through the page cache, and the
process holds no anonymous copy, so a table larger than the memory the
process may use is served (the kernel evicts clean pages under pressure).
On CUDA (device="cuda"), the index goes to device memory and the rows stay
in host memory registered with CUDA (cudaHostRegister), read by the lookup
kernel in place (cuda_view); load(..., hbm_cache_bytes=N) copies up to N
bytes of rows to the device, read there instead (hot_cache.py).
"""
import json
import math
import os
import struct
from typing import Dict, List

import torch

from dynamicemb import memory
from dynamicemb.inference import hot_cache
from dynamicemb.inference.quantize import value_dtype

FORMAT = "dynamicemb.inference/1"
_PAGE = 4096
_DTYPES = {torch.float64: "F64", torch.int64: "I64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.uint8: "U8"}
_FROM_CODE = {v: k for k, v in _DTYPES.items()}
# What the constructor derived, besides the buffers: enough to rebuild the module.
CONFIG = ("table_names", "dims", "feature_names", "feature_table_map", "feature_dims", "table_poolings", "pooling",
          "mean_divisor", "_mean_features", "is_weighted", "seed", "bucket_capacity")


def _config(module) -> dict:
    cfg = {k: getattr(module, k) for k in CONFIG}
    cfg["table_poolings"] = [int(p) for p in cfg["table_poolings"]]
    cfg["pooling"] = int(cfg["pooling"])
    cfg["value_dtype"] = str(module.value_dtype).replace("torch.", "")
    cfg["output_dtype"] = str(module.output_dtype).replace("torch.", "")
    return cfg


def save(module, path: str) -> str:
    """Writes `module` (an InferenceEmbeddingTable) to the safetensors file
    `path`, streaming each buffer (no second copy), fsynced, replacing any
    file there atomically."""
    # The hot-row cache (hot_cache.py) is a copy of rows: not written.
    bufs = {k: v.detach().cpu().contiguous() for k, v in module.named_buffers() if not k.startswith("hot_")}
    order = sorted(bufs, key=lambda k: -bufs[k].element_size())  # each tensor aligned to its element size
    header, offset = {}, 0
    for k in order:
        n = bufs[k].numel() * bufs[k].element_size()
        header[k] = {"dtype": _DTYPES[bufs[k].dtype], "shape": list(bufs[k].shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": FORMAT, "config": json.dumps(_config(module))}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % _PAGE)  # the data starts on a page (the format allows trailing spaces)
    # Written beside and renamed over `path`: a process serving the old file
    # keeps its pages (truncating a mapped file would fault its readers).
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for k in order:
                if bufs[k].numel():
                    f.write(memoryview(bufs[k].view(torch.uint8).numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def _offsets(pair) -> tuple:
    b, e = pair  # (a ValueError for another count)
    return int(b), int(e)


def read_header(path: str) -> tuple:
    """(tensors {name: (dtype, shape, begin, end) in file bytes}, config) of a saved table."""
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        size = os.path.getsize(path)
        if not 0 <= n <= size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # (UnicodeDecodeError, JSONDecodeError)
            raise ValueError(f"{path}: its header is not valid JSON ({type(e).__name__}: {e}): the file is "
                             f"damaged") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its header is not a safetensors header: the file is damaged")
    meta = header.pop("__metadata__", {}) or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not an InferenceEmbeddingTable file (format {meta.get('format')!r}, "
                         f"expected {FORMAT!r}; write one with InferenceEmbeddingTable.save)")
    try:  # every field a reader takes, as its type: the checks below then raise only their own errors
        entries = [(k, _offsets(v["data_offsets"]), v["dtype"], [int(d) for d in v["shape"]])
                   for k, v in header.items()]
        cfg = json.loads(meta["config"])
        missing = [k for k in CONFIG + ("value_dtype", "output_dtype") if k not in cfg]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: its header or config is damaged ({type(e).__name__}: {e})") from None
    if missing:
        raise ValueError(f"{path}: its config lacks {missing}: the file is damaged or from another version")
    tensors = {}
    for k, (b, e), code, shape in entries:
        if code not in _FROM_CODE or not 0 <= b <= e <= size - 8 - n:
            raise ValueError(f"{path}: tensor {k!r} ({code}, bytes {b}..{e}) is not readable: truncated or an "
                             f"unknown dtype")
        dtype = _FROM_CODE[code]
        if math.prod(shape) * dtype.itemsize != e - b:
            raise ValueError(f"{path}: tensor {k!r} of shape {shape} ({code}) does not fill its {e - b} bytes: "
                             f"the file is damaged")
        tensors[k] = (dtype, shape, 8 + n + b, 8 + n + e)
    return tensors, cfg


def map_file(path: str, tensors: Dict[str, tuple], device: torch.device) -> Dict[str, torch.Tensor]:
    """The file's tensors as views of one private mapping of it (never
    written); on CUDA, views of the mapping registered with CUDA (cuda_view)."""
    size = os.path.getsize(path)
    whole = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(path, shared=False, nbytes=size))
    if device.type == "cuda":
        whole = cuda_view(whole, device)
    return {k: whole[b:e].view(dtype).view(shape) for k, (dtype, shape, b, e) in tensors.items()}


def read_file(path: str, tensors: Dict[str, tuple]) -> Dict[str, torch.Tensor]:
    """The file's tensors read into memory (each in a mapping of its own, as a built table's)."""
    out = {}
    with open(path, "rb") as f:
        for k, (dtype, shape, b, e) in tensors.items():
            f.seek(b)
            t = memory.empty(shape, dtype, torch.device("cpu"), own_mapping=True)
            if e > b:
                f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy()))
            out[k] = t
    return out


def cuda_view(whole: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA uint8 tensor over the host mapping `whole` (no copy): its pages
    registered with CUDA (page-locked, mapped, read-only), which the lookup
    kernel reads in place over the bus (unified addressing: the host address
    is the device address). Registering pins the pages: the host must hold
    the rows (a table larger than device memory, not than host memory). The
    tensor keeps the mapping alive."""
    ptr, nbytes = whole.data_ptr(), whole.numel()
    length = (nbytes + _PAGE - 1) // _PAGE * _PAGE  # the mapping starts on a page and ends on one
    mapped, read_only = 2, 8  # cudaHostRegisterMapped | cudaHostRegisterReadOnly
    err = torch.cuda.cudart().cudaHostRegister(ptr, length, mapped | read_only)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {length} mapped bytes failed ({err}): the host cannot lock the "
                           f"table's pages (ulimit -l, or host memory)")
    return torch.as_tensor(_HostBytes(whole), device=device)


class _HostBytes:
    """__cuda_array_interface__ of registered host bytes; holds them alive,
    and unregisters them when the CUDA tensor over them goes."""

    def __init__(self, whole: torch.Tensor):
        self.whole = whole
        # Not flagged read-only: torch refuses such an interface. The pages are registered
        # read-only with CUDA, and nothing writes the tensor over them.
        self.__cuda_array_interface__ = {"shape": (whole.numel(),), "typestr": "|u1", "data": (whole.data_ptr(), False),
                                         "version": 3, "strides": None}

    def __del__(self):
        torch.cuda.cudart().cudaHostUnregister(self.whole.data_ptr())


def load(cls, path: str, mmap: bool = True, device=None, hbm_cache_bytes: int = 0, hot_keys=None):
    """An InferenceEmbeddingTable of the file at `path` (InferenceEmbeddingTable.load)."""
    tensors, cfg = read_header(path)
    device = torch.device(device) if device is not None else torch.device("cpu")
    bufs = map_file(path, tensors, device) if mmap else read_file(path, tensors)
    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    for k in CONFIG:
        setattr(m, k, cfg[k])
    m.value_dtype = value_dtype(getattr(torch, cfg["value_dtype"]))
    m.output_dtype = getattr(torch, cfg["output_dtype"])
    names: List[str] = ["slot_keys", "slot_digests", "table_buckets", "eval_init_params"] + \
        [f"weight_{i}" for i in range(len(cfg["table_names"]))]
    missing = [k for k in names if k not in bufs]
    if missing:
        raise ValueError(f"{path}: tables {cfg['table_names']}: the file lacks tensors {missing}")
    tb, slots = bufs["table_buckets"], bufs["slot_keys"].numel()
    if tb.dim() != 1 or tb.numel() != len(cfg["table_names"]) + 1 or int(tb[0]) != 0 or \
            bool((tb.diff() <= 0).any()) or int(tb[-1]) * int(cfg["bucket_capacity"]) != slots:
        raise ValueError(f"{path}: its table_buckets {tb.tolist()[:8]} do not lay out {len(cfg['table_names'])} "
                         f"tables over its {slots} slots: the file is damaged")
    for k in names:
        # On CUDA the index (keys, digests: 9 bytes a slot) is copied to device
        # memory; the rows stay in the registered host mapping.
        t = bufs[k]
        if not k.startswith("weight_"):
            t = t.clone() if device.type == "cuda" and mmap else t.to(device)
        m.register_buffer(k, t.to(device))
    if hbm_cache_bytes or hot_keys:
        hot_cache.build(m, int(hbm_cache_bytes), device, hot_keys)
    return m
