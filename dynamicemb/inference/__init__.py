"""Serving trained dynamic tables (API.md §5): frozen tables as a plain
torch.nn.Module that torch.export can export, built from a dump or from a
trained model. Importing it does not import torchrec."""
from dynamicemb.inference.convert import to_inference
from dynamicemb.inference.export import export, export_model, ops_library, package
from dynamicemb.inference.quantize import dequantize_rows_int8, quantize_rows_int8
from dynamicemb.inference.frozen import FrozenTable
from dynamicemb.inference.request_files import save_requests
from dynamicemb.inference.table import InferenceEmbeddingTable

__all__ = [
    "FrozenTable",
    "InferenceEmbeddingTable",
    "dequantize_rows_int8",
    "export",
    "export_model",
    "ops_library",
    "package",
    "quantize_rows_int8",
    "save_requests",
    "to_inference",
]
