"""The kernel benchmarks' command line, file names and target summaries, on synthetic records (no GPU)."""

import pytest
import torch

from magicube.eval import bench_attention, bench_sddmm, bench_spmm
from magicube.eval.timing import device_slug


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device would start the benchmark")
@pytest.mark.parametrize("bench", [bench_spmm, bench_sddmm, bench_attention], ids=lambda m: m.__name__)
def test_kernel_benchmarks_say_they_need_a_gpu(bench, tmp_path, capsys):
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 2
    name = bench.__name__.rsplit(".", 1)[1]
    assert f"{name}: needs a CUDA device" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_kernel_benchmarks_reject_unknown_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_spmm.main(["--quik"])
    assert exit_.value.code == 2
    assert "python -m magicube.eval.bench_spmm" in capsys.readouterr().err


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
