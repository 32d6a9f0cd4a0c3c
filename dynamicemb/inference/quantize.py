"""Row precisions of a frozen table: float32 / float16 / bfloat16 rows as
they are, and int8 rows in FBGEMM's fused 8-bit rowwise layout.

An int8 row is `dim` unsigned 8-bit codes followed by its float32 scale and
bias (dim + 8 bytes): value = code * scale + bias, with scale = (max - min) /
255 and bias = min of the row (the bytes of FBGEMM's
FloatToFused8BitRowwiseQuantized), so the error of an element is at most scale /
2 (half a step of its row's range) plus _EPS (the codes are taken with
255 / (range + _EPS): a row of range 1e-9 is off by up to about 1e-9). The kernels (emb_lookup_forward) read
this layout directly; the codes are computed here with torch alone, so that
building or serving a table needs no FBGEMM.
"""
import torch

from dynamicemb import rules

# FBGEMM's kEpsilon in FloatToFused8BitRowwiseQuantized: keeps a constant
# row's inverse scale finite.
_EPS = 1e-8
INT8_EXTRA_BYTES = rules.INT8_ROW_TAIL  # float32 scale and bias after the codes

VALUE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.uint8}


def value_dtype(name) -> torch.dtype:
    """The storage dtype of a precision name (or torch dtype): int8 rows are uint8 bytes."""
    if isinstance(name, torch.dtype):
        name = {torch.int8: "int8", torch.uint8: "int8"}.get(name, str(name).replace("torch.", ""))
    try:
        return VALUE_DTYPES[str(name)]
    except KeyError:
        raise ValueError(f"unknown value precision {name!r}; use one of {sorted(VALUE_DTYPES)}") from None


def quantize_rows_int8(values: torch.Tensor) -> torch.Tensor:
    """[n, dim] floats -> [n, dim + 8] uint8 rows (codes, float32 scale, bias)."""
    x = values.to(torch.float32)
    n = x.shape[0]
    if x.shape[1] == 0 or n == 0:
        mn = mx = torch.zeros(n, 1)
    else:
        mn, mx = x.min(1, keepdim=True).values, x.max(1, keepdim=True).values
    rng = mx - mn
    # A true division for the inverse scale, as FBGEMM's: torch computes
    # `255.0 / t` as 255 * (1 / t), which moves some codes across a .5.
    inverse = torch.full_like(rng, 255.0) / (rng + _EPS)
    codes = torch.round((x - mn) * inverse).clamp_(0, 255).to(torch.uint8)
    scale_bias = torch.cat([rng / 255.0, mn], dim=1).contiguous().view(torch.uint8)
    return torch.cat([codes, scale_bias], dim=1).contiguous()


def dequantize_rows_int8(rows: torch.Tensor) -> torch.Tensor:
    """[n, dim + 8] uint8 rows -> [n, dim] float32 (code * scale, then + bias)."""
    dim = rows.shape[1] - INT8_EXTRA_BYTES
    scale_bias = rows[:, dim:].contiguous().view(torch.float32)
    return rows[:, :dim].to(torch.float32) * scale_bias[:, :1] + scale_bias[:, 1:]


def to_storage(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [n, dim] in a storage dtype of VALUE_DTYPES."""
    if dtype == torch.uint8:
        return quantize_rows_int8(values)
    return values.to(dtype)


def storage_width(dim: int, dtype: torch.dtype) -> int:
    return dim + INT8_EXTRA_BYTES if dtype == torch.uint8 else dim
