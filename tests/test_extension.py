"""The CUDA extension compiles wherever a toolkit is present, GPU or not (CI catches build breaks)."""

import pytest
import torch

from magicube.ops import extension

needs_toolchain = pytest.mark.skipif(extension.toolchain() is not None,
                                     reason=f"cannot compile CUDA here: {extension.toolchain()}")


@pytest.mark.build
@needs_toolchain
@pytest.mark.parametrize("family", [f for f in extension.FAMILIES if extension.sources(f)[0].exists()])
def test_family_compiles_and_registers_its_ops(family):
    extension.load(family)
    ops = {"quantize": ["quantize"], "spmm": ["spmm"], "sddmm": ["sddmm"], "softmax": ["sparse_softmax"],
           "attention": ["sparse_attention"]}[family]
    for op in ops:
        assert hasattr(torch.ops.magicube_cuda, op), f"{family} did not register magicube_cuda::{op}"


def test_unknown_family_is_named():
    with pytest.raises(ValueError, match=r"family: expected one of \(.*\), got 'gemm'"):
        extension.sources("gemm")
