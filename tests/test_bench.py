"""The end-to-end benchmark refuses to time a backend whose answer is off."""

import argparse

import pytest
import torch

from magicube.eval import bench_model


def test_a_backend_over_its_error_tolerance_is_not_timed(monkeypatch):
    args = argparse.Namespace(reps=3, cuda_graph=False)
    cpu = torch.device("cpu")
    monkeypatch.setitem(bench_model.TOLERANCE, "8b-8b", 1e-6)  # 8-bit quantization error is far above this
    row = bench_model.run_case("8b-8b", 1, 64, 1, 0.5, 8, args, cpu, torch.float32)
    assert "over the tolerance" in row["rejected"] and "model" not in row
    row = bench_model.run_case("sparse", 1, 64, 1, 0.5, 8, args, cpu, torch.float32)
    assert "rejected" not in row and row["layer_rel_err"] < 1e-2 and row["model"]["median_ms"] > 0


def test_profile_lists_where_the_layer_spends_its_time():
    args = argparse.Namespace(reps=3, cuda_graph=False, profile=True)
    row = bench_model.run_case("8b-8b", 1, 64, 1, 0.5, 8, args, torch.device("cpu"), torch.float32)
    kernels = row["layer_kernels"]
    assert 0 < len(kernels) <= 10 and all(k["us_per_call"] > 0 for k in kernels)
    assert [k["us_per_call"] for k in kernels] == sorted((k["us_per_call"] for k in kernels), reverse=True)
    assert any("magicube" in k["name"] for k in kernels)  # the quantized ops are among them


def test_compiled_model_is_checked_and_timed():
    """8b-4b: two bit widths in one layer, which must stay constants through recompiles."""
    args = argparse.Namespace(reps=3, cuda_graph=False, compile="default")
    row = bench_model.run_case("8b-4b-fused", 1, 64, 1, 0.5, 8, args, torch.device("cpu"), torch.float32)
    assert "rejected" not in row and row["layer_rel_err"] < 0.35 and row["model"]["median_ms"] > 0


def test_reduce_overhead_excludes_the_manual_graph(capsys):
    """--compile reduce-overhead replays torch.compile's own CUDA graphs: --cuda-graph on top of it is
    refused by name rather than nesting one capture in another."""
    with pytest.raises(SystemExit) as exit_info:
        bench_model.main(["--compile", "reduce-overhead", "--cuda-graph"])
    assert exit_info.value.code == 2 and "drop --cuda-graph" in capsys.readouterr().err


def test_calibrated_scales_are_fitted_to_the_timed_inputs():
    """--scales calibrated: fixed per-head scales from the bench's own batch, which then quantize
    that batch as closely as the per-batch absmax does (and a fp16/fp32 backend is untouched)."""
    cpu = torch.device("cpu")
    model = bench_model.build("8b-8b-fused", 64, 2, 0.5, 8, cpu, torch.float32, scales="calibrated")
    assert model.config.calibrated and torch.equal(model.blocks[0].attn.qkv_scale, torch.ones(3, 2))
    bench_model.build_inputs(model, 2)
    for block in model.blocks:
        s = block.attn.qkv_scale
        assert s.shape == (3, 2) and (s > 0).all() and not torch.equal(s, torch.ones(3, 2))
    assert not bench_model.build("sparse", 64, 2, 0.5, 8, cpu, torch.float32, scales="calibrated").config.calibrated
    errors = {}
    for scales in ("absmax", "calibrated"):
        args = argparse.Namespace(reps=3, cuda_graph=False, scales=scales)
        row = bench_model.run_case("8b-8b", 2, 64, 2, 0.5, 8, args, cpu, torch.float32)
        assert "rejected" not in row
        errors[scales] = row["layer_rel_err"]
    assert errors["calibrated"] < 2 * errors["absmax"]
