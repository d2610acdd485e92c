"""Where bytes live and how they move: tiers and budgets, the disk tier, quantization.

Knows nothing about transformers: never imports flexgen_dist.models, .engine or .distributed.
"""
from flexgen_dist.memory.disk import DiskStore, DiskStoreError, DiskTensor, aligned_empty
from flexgen_dist.memory.quant import (QTensor, dequantize, empty_qtensor, qtensor_layout,
                                       quantize)
from flexgen_dist.memory.tiers import (MemoryBudgetError, MemoryTracker, Tier, copy_between,
                                       pin_if_cuda, tensor_nbytes)
from flexgen_dist.memory.units import format_bytes, parse_size

__all__ = [
    "DiskStore", "DiskStoreError", "DiskTensor", "MemoryBudgetError", "MemoryTracker",
    "QTensor", "Tier", "aligned_empty", "copy_between", "dequantize", "empty_qtensor",
    "format_bytes", "parse_size", "pin_if_cuda", "qtensor_layout", "quantize", "tensor_nbytes",
]
