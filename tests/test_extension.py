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


def test_build_command_names_unknown_families(capsys):
    """`magicube build` (extension.main) refuses an unknown family before building anything."""
    with pytest.raises(SystemExit) as exit_:
        extension.main(["spmm", "gemm"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: magicube build" in err and "unknown families ['gemm']" in err


def _fake_build(monkeypatch, tmp_path, torch_has_baton: bool):
    """load("spmm") into tmp_path with the compile replaced by a probe of the build directory."""
    from filelock import FileLock, Timeout
    from torch.utils import cpp_extension

    monkeypatch.setenv("MAGICUBE_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(extension, "toolchain", lambda: None)
    if torch_has_baton:
        monkeypatch.setattr(cpp_extension, "FileBaton", object, raising=False)
    else:
        monkeypatch.delattr(cpp_extension, "FileBaton", raising=False)
    build_dir = tmp_path / "magicube_spmm"
    build_dir.mkdir()
    (build_dir / "lock").touch()
    seen = {}

    def probe(**kwargs):
        seen["build_directory"] = kwargs["build_directory"]
        seen["baton"] = (build_dir / "lock").exists()
        try:
            with FileLock(str(build_dir / "magicube.lock"), timeout=0):
                seen["lock_held"] = False
        except Timeout:
            seen["lock_held"] = True

    monkeypatch.setattr(cpp_extension, "load", probe)
    extension.load.__wrapped__("spmm")
    return seen, build_dir


def test_a_stopped_build_leaves_no_lock_that_blocks_the_next(monkeypatch, tmp_path, capsys):
    seen, build_dir = _fake_build(monkeypatch, tmp_path, torch_has_baton=True)
    assert seen == {"build_directory": str(build_dir), "baton": False, "lock_held": True}
    assert f"removing {build_dir / 'lock'}, left by a build of the spmm kernels" in capsys.readouterr().err


def test_torch_own_lock_file_is_left_alone_where_torch_locks_by_os(monkeypatch, tmp_path):
    # torch 2.14 holds an OS lock on its `lock` file, which may outlive the build harmlessly.
    seen, _ = _fake_build(monkeypatch, tmp_path, torch_has_baton=False)
    assert seen["baton"] and seen["lock_held"]
