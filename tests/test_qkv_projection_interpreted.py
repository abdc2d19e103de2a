"""The fused Q/K/V projection kernel on the CPU, run by Triton's interpreter: its addressing in each
store order and with 64-bit offsets, bit-exact against the reference (tests/interpret_qkv_projection.py),
so that CI checks the kernel's semantics without a GPU."""

import os
import subprocess
import sys

import pytest

from magicube.ops import qkv_gemm


@pytest.mark.skipif(not qkv_gemm.available(), reason="needs Triton with tensor descriptors")
@pytest.mark.skipif(qkv_gemm.available() and qkv_gemm.TRITON_VERSION < (3, 7),
                    reason="Triton 3.6's interpreter cannot run the kernel's persistent tile loop")
def test_the_kernel_interpreted_matches_the_reference():
    script = os.path.join(os.path.dirname(__file__), "interpret_qkv_projection.py")
    done = subprocess.run([sys.executable, script], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.rstrip().endswith("ok"), done.stdout
