"""The kernel benchmarks' command line, file names and target summaries, on synthetic records (no GPU)."""

import json

import pytest
import torch

from magicube.eval import bench_attention, bench_sddmm, bench_spmm
from magicube.eval.timing import device_slug


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device would start the benchmark")
@pytest.mark.parametrize("bench", [bench_spmm, bench_sddmm, bench_attention], ids=lambda m: m.__name__)
def test_kernel_benchmarks_say_they_need_a_gpu(bench, tmp_path, capsys):
    assert bench.main(["--quick", "--out", str(tmp_path)] + (["--ways"] if bench is bench_spmm else [])) == 2
    name = bench.__name__.rsplit(".", 1)[1]
    assert f"{name}: needs a CUDA device" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_kernel_benchmarks_reject_unknown_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_spmm.main(["--quik"])
    assert exit_.value.code == 2
    assert "python -m magicube.eval.bench_spmm" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        bench_attention.main(["--mask", "banded"])
    assert exit_.value.code == 2
    assert "--mask: invalid choice: 'banded'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        bench_spmm.main(["--kernel", "fastest"])
    assert exit_.value.code == 2
    assert "--kernel: invalid choice: 'fastest'" in capsys.readouterr().err


def test_spmm_off_grid_lies_beside_the_sweeps_grid(monkeypatch, capsys):
    full, off = bench_spmm.FULL, bench_spmm.OFF_GRID
    assert not set(off["mk"]) & set(full["mk"]) and not set(off["sparsity"]) & set(full["sparsity"])
    # Both grids named: refused before anything is built or timed.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench_spmm.main(["--quick", "--off-grid"]) == 2
    assert "--quick and --off-grid each name the cells to time" in capsys.readouterr().err


def test_spmm_off_grid_times_its_cells_under_its_own_name(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_spmm.extension, "load", lambda name: None)
    monkeypatch.setattr(bench_spmm, "environment", lambda: dict(device="NVIDIA H200", torch="2.11", cuda="13.0"))
    timed = {}

    def run(cfg, reps, log, checkpoint, ways):
        timed.update(cfg=cfg, ways=ways)
        return []

    monkeypatch.setattr(bench_spmm, "run", run)
    monkeypatch.setattr(bench_spmm, "run_pv", lambda reps, log: [])
    monkeypatch.setattr(bench_spmm, "plot", lambda records, path, title: None)
    assert bench_spmm.main(["--off-grid", "--ways", "--out", str(tmp_path)]) == 0
    assert timed == dict(cfg=bench_spmm.OFF_GRID, ways=True)
    saved = json.loads((tmp_path / "spmm_offgrid_ways_nvidia_h200.json").read_text())
    assert saved["off_grid"] and saved["config"] == bench_spmm.OFF_GRID and saved["complete"]


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


def test_spmm_gathered_bytes_count_one_b_row_per_kept_vector():
    # 512 vector rows x 410 kept vectors (the target's mask), rows of 256 values.
    density = 410 / 4096
    assert bench_spmm.gathered_bytes("L8-R8", 4096, 4096, 256, 8, density) == 512 * 410 * 256
    assert bench_spmm.gathered_bytes("L16-R4", 4096, 4096, 256, 8, density) == 512 * 410 * 128
    assert bench_spmm.gathered_bytes("sparse_fp16", 4096, 4096, 256, 2, density) == 2048 * 410 * 512
    assert bench_spmm.gathered_bytes("cublas_fp16", 4096, 4096, 256, 8, density) is None


def test_spmm_summary_reports_the_targets_gather_rate():
    t = bench_spmm.TARGET
    rec = dict(m=t["mk"], k=t["mk"], n=t["n"], v=t["v"], sparsity=t["sparsity"], density=410 / 4096)
    gathered = bench_spmm.gathered_bytes(t["pair"], rec["m"], rec["k"], rec["n"], rec["v"], rec["density"])
    records = [
        dict(m=rec["m"], k=rec["k"], n=rec["n"], kernel="cublas_fp16", ms=0.0167, speedup=1.0),
        dict(rec, kernel=t["pair"], ms=0.0107, speedup=0.0167 / 0.0107, gather_tbs=gathered / 0.0107 / 1e9),
        dict(rec, kernel="sparse_fp16", ms=0.020, speedup=0.0167 / 0.020, gather_tbs=2 * gathered / 0.020 / 1e9),
    ]
    target = bench_spmm.summarize(records)["target"]
    assert abs(target["gathered_mb"] - 53.73952) < 1e-9
    assert abs(target["gather_tbs"] - 5.02) < 0.01
    assert abs(target["cublas_fp16_us"] - 16.7) < 1e-9
    assert abs(target["speedup_vs_sparse_fp16"] - 0.020 / 0.0107) < 1e-12


def test_attention_summary_reports_the_targets_gather_rate():
    t = bench_attention.TARGET
    base = dict(b=t["b"], h=t["h"], seq=t["seq"], d=64, v=8, sparsity=t["sparsity"], mask=t["mask"],
                density=410 / 4096)
    # 32 batch x heads x 512 vector rows x 410 kept slots, a 64-byte key row and value row each.
    gathered = bench_attention.gathered_bytes(32, 4096, 410 / 4096, 64, 8)
    assert gathered == 32 * 512 * 410 * 128
    assert bench_attention.gathered_bytes(32, 4096, 410 / 4096, 64, 4) == gathered / 2
    records = [
        dict(base, method="SDPA flash fp16", ms=0.29, total_ms=0.29, speedup_vs_flash=1.0),
        dict(base, method=t["method"], ms=0.1526, total_ms=0.2306, speedup_vs_flash=0.29 / 0.2306,
             gather_tbs=gathered / 0.1526 / 1e9),
    ]
    target = bench_attention.summarize(records)["target"]
    assert abs(target["gathered_mb"] - 859.83232) < 1e-9
    assert abs(target["gather_tbs"] - 5.63) < 0.01
    assert abs(target["speedup_vs_flash_kernel_only"] - 0.29 / 0.1526) < 1e-12
    # The target is the random mask's: a run on another mask reports none.
    assert "target" not in bench_attention.summarize([dict(r, mask="structured") for r in records])


def test_spmm_ways_are_those_that_apply_to_the_pair():
    assert bench_spmm.ways_of(16, 8, 2) == ["gather", "stacked", "merged", "resident", "dense"]
    assert bench_spmm.ways_of(12, 4, 4) == ["gather", "stacked", "resident", "dense"]
    assert bench_spmm.ways_of(16, 4, 4) == ["gather", "resident", "dense"]
    assert bench_spmm.ways_of(12, 4, 8) == ["gather", "resident", "dense"]
    assert bench_spmm.ways_of(16, 16, 2) == ["gather", "stacked", "merged", "dense"]
    assert bench_spmm.ways_of(8, 8, 8) == ["gather", "resident", "dense"]
    assert bench_spmm.ways_of(8, 4, 2) == ["gather", "merged", "resident", "dense"]


def test_spmm_summary_weighs_the_choice_against_the_fastest_way():
    cell = dict(m=4096, k=4096, n=256, v=2, density=0.3, speedup=1.0)
    records = [
        # The choice took the fastest way, then 1.5x it where the dense path was faster, then 1.2x
        # at sparsity 0.5 (outside the >= 0.7 mean), where one way's output differed.
        dict(cell, sparsity=0.9, kernel="L8-R8", ms=0.010, ways=dict(gather=0.010, resident=0.012, dense=0.020),
             ways_equal=True),
        dict(cell, sparsity=0.7, kernel="L8-R8", ms=0.015, ways=dict(gather=0.015, resident=0.016, dense=0.010),
             ways_equal=True),
        dict(cell, sparsity=0.5, kernel="L8-R8", ms=0.024, ways=dict(gather=0.024, resident=0.030, dense=0.020),
             ways_equal=False),
        dict(cell, sparsity=0.9, kernel="L16-R16", ms=0.020, ways=dict(gather=0.020, stacked=0.021, dense=0.030),
             ways_equal=True),
        dict(cell, sparsity=0.9, kernel="cublas_fp16", ms=0.010),
    ]
    choice = bench_spmm.summarize(records)["choice_over_fastest_way"]
    assert set(choice) == {"L8-R8", "L16-R16"}
    l8 = choice["L8-R8"]
    assert l8["geomean"] == pytest.approx((1.5 * 1.2) ** (1 / 3))
    assert l8["geomean_sparsity_ge_0_7"] == pytest.approx(1.5**0.5)
    assert l8["worst"] == pytest.approx(1.5)
    assert (l8["worst_cell"]["sparsity"], l8["worst_cell"]["ways"]["dense"]) == (0.7, 0.010)
    assert l8["unequal_cells"] == 1
    assert choice["L16-R16"]["geomean"] == pytest.approx(1.0) and choice["L16-R16"]["unequal_cells"] == 0
    # A sweep without --ways has no such summary.
    plain = [{k: x for k, x in r.items() if k not in ("ways", "ways_equal")} for r in records]
    assert "choice_over_fastest_way" not in bench_spmm.summarize(plain)
