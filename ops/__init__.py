"""Sparse formats, quantization and the public ops of Magicube.

Importing registers the ops `torch.ops.magicube.{spmm, sddmm, sparse_softmax, sparse_attention,
quantize, qkv_projection}`; the CUDA kernels build on first use and the pure-PyTorch reference
serves everywhere else.
"""

from .format import BANK_GROUP, INT4_SHUFFLE, SRBCRS, VectorMask, random_vector_mask, vector_mask_from_dense
from .functional import (expand_scale, qkv_projection, quantize_to_container, sddmm, sparse_attention, sparse_softmax,
                         spmm)
from .library import SDDMM_BITS, SOFTMAX_BITS, SPMM_PAIRS
from .quant import (absmax_scale, combine_planes, container_dtype, dequantize, from_container, pack_int4,
                    qrange, quantize, scale_of_absmax, split_planes, to_container, unpack_int4)

__all__ = [
    "BANK_GROUP", "INT4_SHUFFLE", "SRBCRS", "VectorMask", "random_vector_mask", "vector_mask_from_dense",
    "spmm", "sddmm", "sparse_softmax", "sparse_attention", "qkv_projection", "expand_scale",
    "SPMM_PAIRS", "SDDMM_BITS", "SOFTMAX_BITS",
    "absmax_scale", "combine_planes", "container_dtype", "dequantize", "from_container", "pack_int4",
    "qrange", "quantize", "quantize_to_container", "scale_of_absmax", "split_planes", "to_container", "unpack_int4",
]
