"""The kernel benchmarks' file names and target summaries, on synthetic records (no GPU)."""

from magicube.eval import bench_sddmm
from magicube.eval.timing import device_slug


def test_device_slug_names_the_device():
    assert device_slug({"device": "NVIDIA H100 80GB HBM3"}) == "nvidia_h100_80gb_hbm3"
    assert device_slug({}) == "gpu"


def test_sddmm_summary_reads_the_target_shape_only():
    target = bench_sddmm.TARGET
    base = dict(target, n=target["m"])
    other = dict(base, sparsity=0.5)
    records = [
        dict(base, kernel="sddmm L8-R8", speedup_vs_dense=5.2, median_ms=0.075),
        dict(other, kernel="sddmm L8-R8", speedup_vs_dense=1.3, median_ms=0.3),
        dict(base, kernel="softmax out_bits=8", fraction_of_copy=0.87, median_ms=0.06),
        dict(base, kernel="dense fp16 (cuBLAS bmm)", median_ms=0.4),
    ]
    summary = bench_sddmm.summarize(records)
    assert summary["sddmm_speedup_vs_dense"] == {"sddmm L8-R8": 5.2}
    assert abs(summary["sddmm_us"]["sddmm L8-R8"] - 75.0) < 1e-9
    assert summary["softmax_fraction_of_copy"] == {"softmax out_bits=8": 0.87}
