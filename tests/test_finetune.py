"""Quantization finetuning: the fake-quantized forward against the integer ops, STE gradients,
calibration, the finetuning run (resume, what its checkpoint records) and evaluation's checks."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import awkward_mask
from magicube import ops
from magicube.eval.evaluate import evaluate
from magicube.model import fakequant
from magicube.model.lra import QUANTIZED, LRAClassifier, LRAConfig
from magicube.train.config import load_config
from magicube.train.finetune import calibrate, finetune, finetune_config
from magicube.train.checkpoint import read_trainer_state
from magicube.train.trainer import train

PRECISIONS = list(QUANTIZED)
# The fake-quantized forward trains on GPUs too, where its reductions run other kernels.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def small_config(**kw):
    base = dict(vocab_size=16, num_classes=10, max_len=64, emb_dim=32, num_heads=2, num_layers=2, mlp_dim=64,
                dropout=0.0, attention_dropout=0.0, attention="sparse", mask_kind="random", sparsity=0.7, v=8)
    return LRAConfig(**{**base, **kw})


def qkv(B=2, H=2, T=64, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # uneven magnitudes per head, so that per-head and per-tensor scales differ
    return [torch.randn(B, H, T, d, generator=g) * torch.tensor([1.0, 3.0])[:H, None, None] for _ in range(3)]


def fp16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of fp16 at |x| (subnormal spacing below the normal range)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -14)))
    return 2.0 ** (e - 10)


def ops_intermediates(attn_mask, q, k, v, p_bits, bits, scales=None):
    """The integer ops on CPU (the reference): SDDMM int64, probabilities, output."""
    B, H, T, d = q.shape
    pat = ops.SRBCRS.from_mask(ops.VectorMask(attn_mask, 8), stride=32)
    flat = [t.reshape(B * H, T, d) for t in (q, k, v)]
    if scales is None:
        s = [ops.absmax_scale(t, bits, dim=(1, 2)).view(-1) for t in flat]
    else:
        s = [row.repeat(H // len(row)).repeat(B) for row in scales]
    qq, kq, vq = (ops.quantize_to_container(t, si.view(-1, 1, 1), bits) for t, si in zip(flat, s))
    acc = ops.sddmm(pat, qq, kq, bits=bits, out_dtype=torch.int64)
    scores = ops.sddmm(pat, qq, kq, bits=bits, scale_a=s[0], scale_b=s[1])
    probs, row_scale = ops.sparse_softmax(pat, scores, scale=d ** -0.5, out_bits=p_bits)
    out = ops.spmm(pat, probs, vq, a_bits=p_bits, a_signed=False, b_bits=bits, scale_a=row_scale, scale_b=s[2])
    dense = lambda x: pat.to_dense(x).view(B, H, T, T)  # noqa: E731
    p_int = dense(ops.from_container(probs, p_bits, signed=False))
    return dense(acc), p_int, out.view(B, H, T, d).float()


@pytest.mark.parametrize("scales", ["absmax", "head", "tensor", "learned"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fake_quantized_attention_reproduces_the_integer_ops(precision, scales):
    p_bits, bits = QUANTIZED[precision]
    mask = awkward_mask(64, 64, 8, 0.7, seed=3).mask  # an empty vector row and a full one
    keep = mask.repeat_interleave(8, dim=0)
    q, k, v = qkv(seed=1)
    given = None
    if scales != "absmax":
        absmax = torch.stack([t.abs().amax(dim=(0, 2, 3)) for t in (q, k, v)])  # [3, H]
        # 0.8: the largest values saturate, which the fake quantization must clamp like the ops
        given = fakequant.scales_from_absmax(0.8 * absmax, bits, "head" if scales == "learned" else scales)
    ref_acc, ref_p, ref_out = ops_intermediates(mask, q, k, v, p_bits, bits, given)
    if scales == "learned":  # the LSQ gradient scaling leaves the forward values alone
        given = given.clone().requires_grad_()

    sq, sk, sv = fakequant.qkv_scales(q, k, v, bits, given)
    qi, ki = fakequant.fake_quantize(q, sq, bits), fakequant.fake_quantize(k, sk, bits)
    assert torch.equal((qi @ ki.transpose(-1, -2)).masked_fill(~keep, 0).long(), ref_acc)  # exact scores
    out = fakequant.attention(q, k, v, keep, p_bits=p_bits, bits=bits, softmax_scale=16 ** -0.5, scales=given)
    scores = fakequant.fp16_ste((qi @ ki.transpose(-1, -2)) * (sq * sk))
    row, col = keep.nonzero(as_tuple=True)
    p, _ = fakequant.quantized_softmax(scores[..., row, col], row, keep.sum(dim=1), 16 ** -0.5, p_bits)
    assert torch.equal(p.long(), ref_p[..., row, col]) and not ref_p[..., ~keep].any()  # the same probabilities
    # the output: only the row sum's fp32 summation order differs: at most one fp16 ulp
    diff = (out - ref_out).abs()
    assert (diff <= fp16_ulp(ref_out)).all(), f"max diff {diff.max()}"
    assert (diff > 0).float().mean() < 0.01
    assert out[:, :, :8].abs().max() == 0  # the empty vector row
    assert torch.equal(out, out.half().float())  # fp16 values


def test_long_attention_runs_in_row_chunks_with_the_same_result(monkeypatch):
    q, k, v = (t.requires_grad_() for t in qkv(seed=4))
    keep = awkward_mask(64, 64, 8, 0.5, seed=0).mask.repeat_interleave(8, dim=0)
    whole = fakequant.attention(q, k, v, keep, p_bits=8, bits=8, softmax_scale=0.25)
    grads = torch.autograd.grad(whole.square().sum(), (q, k, v))
    monkeypatch.setattr(fakequant, "CHUNK_ELEMENTS", 2 * 2 * 64 * 24)  # 24 rows a chunk, the last one short
    chunked = fakequant.attention(q, k, v, keep, p_bits=8, bits=8, softmax_scale=0.25)
    assert torch.equal(chunked, whole)
    for a, b in zip(torch.autograd.grad(chunked.square().sum(), (q, k, v)), grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # the same terms, summed per chunk


def dense_attention(q, k, v, keep, p_bits, bits, softmax_scale, scales):
    """The oracle: fakequant.attention's semantics written on the dense [B, H, T, T] scores."""
    sq, sk, sv = fakequant.qkv_scales(q, k, v, bits, scales)
    qi, ki, vi = (fakequant.fake_quantize(t, s, bits) for t, s in ((q, sq), (k, sk), (v, sv)))
    x = fakequant.fp16_ste((qi @ ki.transpose(-1, -2)) * (sq * sk)) * softmax_scale
    m = x.detach().masked_fill(~keep, float("-inf")).amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = torch.exp(x - m).masked_fill(~keep, 0.0)
    s = e.sum(dim=-1, keepdim=True)
    pmax = (1 << p_bits) - 1
    row_scale = torch.where(s > 0, 1.0 / (torch.where(s > 0, s, 1.0) * pmax), 0.0)
    acc = (fakequant.round_ste(e * pmax).double() @ vi.double()).float()
    return fakequant.fp16_ste(acc * (row_scale * sv))


def awkward_problem(p_bits, bits, T=200, B=2, H=2, d=32, device="cpu"):
    """T = 25 row groups of 8 (no power of two), the first one empty, one full (a CLS row), one with a
    single entry (its max is that score, negative in some rows), 90 % sparse elsewhere; learned per-head
    scales that saturate the largest values; a fixed output weighting, so that a loss has the same
    upstream gradient whatever the output's last bit."""
    keep = awkward_mask(T, T, 8, 0.9, seed=1).mask.repeat_interleave(8, dim=0)
    keep[8:16] = False
    keep[8:16, T - 1] = True
    g = torch.Generator().manual_seed(p_bits + bits)
    q, k, v = (torch.randn(B, H, T, d, generator=g) * torch.tensor([1.0, 3.0])[:, None, None] for _ in range(3))
    absmax = torch.stack([t.abs().amax(dim=(0, 2, 3)) for t in (q, k, v)])
    scales = fakequant.scales_from_absmax(0.8 * absmax, bits, "head")
    inputs = [t.to(device).requires_grad_() for t in (q, k, v, scales)]
    return inputs, keep.to(device), torch.randn(B, H, T, d, generator=g).to(device)


def assert_grads_close(got, want):
    # The same terms, but the row sums S (a few fp32 ulps apart) enter them through row_scale, and
    # the reductions over the kept entries (the scales' gradients, a chunk's share of K's and V's)
    # add them in another order: fp32 rounding of sums of up to ~10^4 terms of both signs, observed
    # within 7e-6 of the largest gradient (the scales'; 1e-6 for q, k, v). A near-zero element is
    # such a cancelling sum, so the bound is relative to the largest: 3e-5, some 4 times the worst seen.
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=3e-5 * b.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("p_bits", [8, 16])
def test_compact_attention_against_the_dense_formulation(p_bits, bits, device):
    (q, k, v, scales), keep, w = awkward_problem(p_bits, bits, device=device)
    d = q.shape[-1]
    out = fakequant.attention(q, k, v, keep, p_bits=p_bits, bits=bits, softmax_scale=d ** -0.5, scales=scales)
    want = dense_attention(q, k, v, keep, p_bits, bits, d ** -0.5, scales)
    # Only S is summed in another order: its few fp32 ulps move an output by one fp16 ulp, rarely.
    diff = (out - want).abs()
    assert (diff <= fp16_ulp(want)).all(), f"max diff {diff.max()}"
    assert (diff > 0).sum() <= diff.numel() // 1000, f"{(diff > 0).sum()} outputs differ"
    assert out[:, :, :8].abs().max() == 0 and want.abs().max() > 0  # the empty rows, and not all empty

    got = torch.autograd.grad((out * w).sum(), (q, k, v, scales))
    assert all(torch.isfinite(g).all() for g in got)
    assert_grads_close(got, torch.autograd.grad((want * w).sum(), (q, k, v, scales)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p_bits, bits", [(8, 8), (8, 4), (16, 8)])
def test_p_times_v_is_exact_in_the_dtype_chosen_for_the_longest_row(monkeypatch, p_bits, bits, device):
    if device == "cuda":  # TF32 rounds fp32 inputs to 11 bits: the chosen dtype must hold up to it too
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    pmax, qmin, qmax = (1 << p_bits) - 1, -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    assert fakequant.pv_dtype(8, 8, 514) == torch.float32 and fakequant.pv_dtype(16, 8, 1) == torch.float64
    g = torch.Generator().manual_seed(p_bits + bits)
    for longest in (1, 300, 514, 515, 8224, 8225, 9000):  # both sides of 8-bit p's bounds (docstring)
        p = torch.cat([torch.full((1, longest), pmax), torch.randint(0, pmax + 1, (3, longest), generator=g)])
        # the largest odd sum (one qmin + 1 among qmin), which fp32 cannot hold past 2^24, and random columns
        v = torch.cat([torch.full((longest, 1), qmin), torch.full((longest, 1), qmax),
                       torch.randint(qmin, qmax + 1, (longest, 2), generator=g)], dim=1)
        v[0, 0] += 1
        dtype = fakequant.pv_dtype(p_bits, bits, longest)
        got = (p.to(device, dtype) @ v.to(device, dtype)).cpu()
        assert torch.equal(got.long(), p.long() @ v.long()), (longest, dtype)


@pytest.mark.parametrize("device", DEVICES)
# T 600 at 8b-8b: the full row (600 kept) needs fp64 for p @ q_V, the other chunks sum it in fp32
@pytest.mark.parametrize("p_bits, bits, T", [(8, 4, 200), (16, 8, 200), (8, 8, 600)])
def test_chunked_compact_attention_equals_the_whole(monkeypatch, p_bits, bits, T, device):
    (q, k, v, scales), keep, w = awkward_problem(p_bits, bits, T=T, device=device)
    B, H, T, d = q.shape

    def run():
        out = fakequant.attention(q, k, v, keep, p_bits=p_bits, bits=bits, softmax_scale=d ** -0.5, scales=scales)
        return out, torch.autograd.grad((out * w).sum(), (q, k, v, scales))

    whole, grads = run()
    # 7 rows a chunk: chunks cut through row groups, the first holds nothing kept, the last is short
    monkeypatch.setattr(fakequant, "CHUNK_ELEMENTS", B * H * T * 7)
    longest, pv_dtype = [], fakequant.pv_dtype
    monkeypatch.setattr(fakequant, "pv_dtype", lambda p_bits, bits, n: longest.append(n) or pv_dtype(p_bits, bits, n))
    chunked, chunked_grads = run()
    assert longest == [keep[r:r + 7].sum(dim=1).max().item() for r in range(0, T, 7)]  # each chunk's own
    assert torch.equal(chunked, whole)  # a row's entries, and so its sum S, never span two chunks
    assert_grads_close(chunked_grads, grads)


def test_masked_scores_never_reach_the_gradients():
    """A masked score far above its row's kept ones (or any score of an empty row) overflows exp(x - max):
    it is never computed, so it cannot turn a zero gradient into NaN (0 * inf)."""
    T = 16
    keep = torch.zeros(T, T, dtype=torch.bool)
    keep[8:, :4] = True  # rows 0..7 empty
    q, k, v = torch.full((1, 1, T, 16), 5.0), torch.full((1, 1, T, 16), 5.0), torch.randn(1, 1, T, 16)
    k[..., :4, :] = -5.0  # kept scores -100, masked ones +100
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fakequant.attention(q, k, v, keep, p_bits=8, bits=8, softmax_scale=0.25, scales=torch.full((3, 1), 0.1))
    assert out[:, :, :8].abs().max() == 0 and out[:, :, 8:].abs().max() > 0
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), (q, k, v)))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_model_fake_quantized_and_integer_ops_agree(precision):
    """The training function and the inference function of one finetuned model: logits within the fp16
    output rounding, the same predictions."""
    torch.manual_seed(0)
    model = LRAClassifier(small_config(attention=precision, quant_precision=precision, quant_scales="fixed",
                                       quant_granularity="head")).eval()
    ids = torch.randint(1, 16, (6, 63))
    bits = QUANTIZED[precision][1]
    amax = calibrate(model, ids, 3, 2, seed=0, attention="sparse", device="cpu")
    for block, a in zip(model.blocks, amax):
        block.attn.qkv_scale.copy_(fakequant.scales_from_absmax(0.9 * a, bits, "head"))
    x = torch.randint(1, 16, (8, 63))
    with torch.no_grad():
        model.set_attention(precision, "masked")
        fake = model(x).logits
        model.set_attention(precision, "ops")
        real = model(x).logits
        model.config.fused = True
        assert torch.equal(model(x).logits, real)  # the fused op reads the same calibrated scales
        model.config.fused = False
        model.config.quant_scales = "absmax"  # the same model, scales from each batch
        absmax = model(x).logits
    torch.testing.assert_close(fake, real, rtol=2e-3, atol=2e-3)
    assert torch.equal(fake.argmax(-1), real.argmax(-1))
    assert not torch.allclose(absmax, real, rtol=1e-4, atol=1e-4)  # the calibrated scales were used


def test_straight_through_gradients():
    x = torch.tensor([-200.0, -3.5, -0.4, 0.5, 2.5, 126.6, 127.4, 300.0], requires_grad=True)
    q = fakequant.fake_quantize(x, torch.tensor(1.0), 8)
    assert q.tolist() == [-128, -4, -0, 0, 2, 127, 127, 127]  # half to even, saturated
    (g,) = torch.autograd.grad(q.sum(), x)
    assert g.tolist() == [0, 1, 1, 1, 1, 1, 1, 0]  # identity inside the range, zero where it saturates
    y = torch.tensor([1.0 + 2 ** -12, 70000.0], requires_grad=True)
    h = fakequant.fp16_ste(y)
    assert h.tolist() == [1.0, float("inf")] and torch.autograd.grad(h.sum(), y)[0].tolist() == [1.0, 1.0]

    # LSQ: d(q * s)/ds = q - x/s inside the range, qmax outside (before the gradient scale)
    s = torch.tensor(0.5, requires_grad=True)
    xs = torch.tensor([0.3, 100.0])
    (gs,) = torch.autograd.grad((fakequant.fake_quantize(xs, s, 8) * s).sum(), s)
    assert gs.item() == pytest.approx((1 - 0.6) + 127)


@pytest.mark.parametrize("scales", ["absmax", "learned"])
def test_gradients_flow_through_the_fake_quantized_model(scales):
    torch.manual_seed(0)
    model = LRAClassifier(small_config(attention="8b-4b", quant_precision="8b-4b", quant_scales=scales)).train()
    model.blocks[1].attn.mask[0] = False  # an empty row must not poison the gradients
    if scales == "learned":
        for b in model.blocks:
            b.attn.qkv_scale.data.fill_(0.3)
    x, y = torch.randint(1, 16, (4, 63)), torch.randint(0, 10, (4,))
    out = model(x, labels=y)  # sparse_impl auto + gradients: the fake-quantized path
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["blocks.0.attn.qkv.weight"].abs().sum() > 0
    if scales == "learned":
        assert grads["blocks.0.attn.qkv_scale"].shape == (3, 2) and grads["blocks.0.attn.qkv_scale"].abs().min() > 0
    model.set_attention("8b-4b", "ops")
    with pytest.raises(RuntimeError, match="no backward"):
        model(x, labels=y)


# ---- finetuning runs ---------------------------------------------------------------------

SMALL = ["data.generate.num_train=256", "data.generate.num_val=32", "data.generate.num_test=32",
         "data.generate.max_length=60", "model.max_len=64", "model.emb_dim=32", "model.mlp_dim=64",
         "train.batch_size=16", "train.warmup=4", "train.log_every=2", "train.eval_every=4",
         "train.checkpoint_every=4", "train.keep_checkpoints=null", "train.steps=8"]
FT = ["finetune.train.steps=6", "finetune.train.checkpoint_every=2", "finetune.train.eval_every=3",
      "finetune.train.warmup=2", "finetune.calibration_batches=3", "finetune.train.lr=1e-3",
      "finetune.train.scale_lr=1e-3"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A trained sparse run (8 steps)."""
    tmp = tmp_path_factory.mktemp("source")
    cfg = load_config("tiny", [*SMALL, f"data.path={tmp / 'listops'}", f"data.cache_dir={tmp / 'cache'}",
                               f"out_dir={tmp / 'run'}"])
    train(cfg, progress=False)
    return tmp / "run"


def test_calibration_is_deterministic_and_is_the_absmax(source):
    ckpt = source / "checkpoints" / "step_0000008"
    model = LRAClassifier.from_pretrained(ckpt)
    ids = torch.randint(1, 16, (40, 63), generator=torch.Generator().manual_seed(0))
    a = calibrate(model, ids, 8, 3, seed=0, attention="sparse", device="cpu")
    b = calibrate(model, ids, 8, 3, seed=0, attention="sparse", device="cpu")
    assert torch.equal(a, b) and a.shape == (2, 3, 4) and (a > 0).all()
    assert model.config.attention == "sparse" and model.config.sparse_impl == "auto"  # restored
    # the running max over the batches is the max over their union
    from magicube.train.trainer import batch_indices
    seen = torch.cat([batch_indices(s, 40, 8, 0) for s in range(3)])
    outs = []
    h = model.blocks[1].attn.qkv.register_forward_hook(lambda m, i, o: outs.append(o))
    with torch.no_grad():
        model.eval().set_attention("sparse", "masked")
        model(ids[seen])
    h.remove()
    assert torch.equal(a[1], fakequant.observe_absmax(outs[0], 4))
    s = fakequant.scales_from_absmax(a[1], 8, "tensor")
    assert s.shape == (3, 1) and torch.equal(s[:, 0], a[1].amax(1) / 127)


def test_finetune_resumes_and_records_precision_and_scales(source, tmp_path):
    full = finetune(source, "8b-8b", overrides=[*FT, f"finetune.out_dir={tmp_path / 'full'}"], progress=False)
    cut_ov = [*FT, f"finetune.out_dir={tmp_path / 'cut'}"]
    cut = finetune(source, "8b-8b", overrides=cut_ov, progress=False, stop_after=3)
    assert cut["step"] == 3
    resumed = finetune(source, "8b-8b", overrides=cut_ov, progress=False)
    assert full["step"] == resumed["step"] == 6 and full["eval_accuracy"] == resumed["eval_accuracy"]
    a, b = (tmp_path / r / "checkpoints" / "step_0000006" for r in ("full", "cut"))
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    # the checkpoint records its precision and scales; the scales were learned
    cfg = json.loads((a / "config.json").read_text())
    assert (cfg["quant_precision"], cfg["quant_scales"], cfg["quant_granularity"], cfg["attention"]) == \
        ("8b-8b", "learned", "head", "8b-8b")
    scales = wa["blocks.0.attn.qkv_scale"]
    assert scales.shape == (3, 4) and (scales > 0).all()
    run = load_config(a / "run_config.yaml")
    assert run["finetune"]["precision"] == "8b-8b" and run["finetune"]["from"].endswith("step_0000008")
    groups = read_trainer_state(a)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and groups[1]["lr"] == pytest.approx(1e-3)
    assert [json.loads(line)["step"] for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
            if "eval_accuracy" in line] == [3, 6]

    # evaluation: the finetuned precision through the ops and its fake twin agree; other bits are refused
    report = evaluate(tmp_path / "full", progress=False)
    rows = {r["backend"]: r for r in report["results"]}
    assert list(rows) == ["sparse-masked", "sparse", "8b-8b-fake", "8b-8b"] and report["quant_precision"] == "8b-8b"
    assert rows["8b-8b"]["accuracy"] == rows["8b-8b-fake"]["accuracy"]
    assert abs(rows["8b-8b"]["loss"] - rows["8b-8b-fake"]["loss"]) < 1e-3
    with pytest.raises(ValueError, match="finetuned for 8b-8b.*8b-4b.*--precision 8b-4b"):
        evaluate(tmp_path / "full", backends=["dense", "8b-4b"], progress=False)

    # a finetuned checkpoint can be the source of another precision: recalibrated through its float function
    again = finetune(tmp_path / "full", "8b-4b", overrides=[*FT, "train.steps=2", "finetune.scales=fixed"],
                     progress=False)
    w = load_file(tmp_path / "full" / "finetune_8b-4b" / "checkpoints" / "step_0000002" / "model.safetensors")
    assert again["step"] == 2 and again["config"]["finetune"]["source_attention"] == "sparse"
    assert (w["blocks.1.attn.qkv_scale"] > 0).all() and (w["blocks.1.attn.qkv_scale"] != 1).all()  # calibrated


def test_finetune_config_composition(source):
    ckpt = source / "checkpoints" / "step_0000008"
    cfg = finetune_config(ckpt, None, overrides=["finetune.scales=fixed", "finetune.granularity=tensor",
                                                 "train.steps=7"])
    assert cfg["model"]["attention"] == "8b-8b" and cfg["model"]["quant_scales"] == "fixed"
    assert cfg["train"]["steps"] == 7 and cfg["train"]["schedule"] == "constant"
    assert cfg["train"]["batch_size"] == 16  # the source's
    assert cfg["out_dir"] == str(source / "finetune_8b-8b")
    with pytest.raises(ValueError, match="precision"):
        finetune_config(ckpt, "4b-4b")
    with pytest.raises(ValueError, match="finetune.scales"):
        finetune_config(ckpt, "8b-8b", overrides=["finetune.scales=sometimes"])
    with pytest.raises(ValueError, match=r"finetune.calibration_batches: expected an integer >= 1, got 0"):
        finetune_config(ckpt, "8b-8b", overrides=["finetune.calibration_batches=0"])
    # a typo would be kept and ignored; a whole section replaced is read before the late overrides
    with pytest.raises(ValueError, match=r"finetune: unknown key scale; expected keys among precision"):
        finetune_config(ckpt, "8b-8b", overrides=["finetune.scale=fixed"])
    with pytest.raises(ValueError, match=r"finetune: expected a section of key: value settings, got 3"):
        finetune_config(ckpt, "8b-8b", overrides=["finetune=3"])
