"""The LRA classifier: attention backends against each other, masks, save/load."""
import pytest
import torch

from magicube import ops
from magicube.model.lra import QUANTIZED, LRAClassifier, LRAConfig
from magicube.model.masks import layer_mask, structured_vector_mask


def small_config(**kw):
    base = dict(vocab_size=16, num_classes=10, max_len=64, emb_dim=32, num_heads=2, num_layers=2, mlp_dim=64,
                dropout=0.0, attention_dropout=0.0, attention="sparse", mask_kind="random", sparsity=0.7, v=8)
    return LRAConfig(**{**base, **kw})


def attention_reference(attn, q, k, v):
    """softmax over the kept entries in fp64, rows with nothing kept -> 0."""
    keep = attn.mask.repeat_interleave(attn.config.v, 0)
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0)
    return p @ v.double()


def qkv(B=2, H=2, T=64, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, d, generator=g) for _ in range(3)]


def projection(q, k, v):
    """Q, K, V as the layer hands them to the ops: a [3, B, H, T, d] view of one [B, T, 3, H, d] tensor."""
    return torch.stack((q, k, v)).permute(1, 3, 0, 2, 4).contiguous().permute(2, 0, 3, 1, 4)


def heads_first(y, heads):
    """The ops' [B, T, H * d] (the output projection's input) as [B, H, T, d]."""
    B, T, E = y.shape
    return y.view(B, T, heads, E // heads).transpose(1, 2)


@pytest.mark.parametrize("v", [2, 4, 8])
@pytest.mark.parametrize("kind", ["random", "structured"])
def test_masked_and_ops_paths_compute_the_same_function(v, kind):
    model = LRAClassifier(small_config(v=v, mask_kind=kind, window=4))
    attn = model.blocks[0].attn
    attn.mask[1] = False  # a vector row with nothing kept
    attn._patterns.clear()
    q, k, val = qkv()
    ref = attention_reference(attn, q, k, val)
    masked = attn.masked(q, k, val, 0.0)
    ops_out = heads_first(attn.sparse_ops(projection(q, k, val)), q.shape[1]).float()
    torch.testing.assert_close(masked.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops_out.double(), ref, atol=5e-3, rtol=5e-3)  # fp16 inputs and output
    rows = slice(v, 2 * v)
    assert masked[..., rows, :].abs().max() == 0 and ops_out[..., rows, :].abs().max() == 0


def test_model_logits_agree_across_sparse_paths():
    torch.manual_seed(0)
    model = LRAClassifier(small_config()).eval()
    x = torch.randint(1, 16, (3, 50))
    with torch.no_grad():
        model.set_attention("sparse", "masked")
        masked = model(x).logits
        model.set_attention("sparse", "ops")
        ops_logits = model(x).logits
        model.set_attention("dense")
        dense = model(x).logits
    torch.testing.assert_close(ops_logits, masked, atol=2e-2, rtol=2e-2)
    assert (dense - masked).abs().max() > 1e-3  # the mask matters


@pytest.mark.parametrize("backend, tol", [("16b-8b", 0.03), ("8b-8b", 0.04), ("8b-4b", 0.3)])
def test_quantized_backends_close_to_fp(backend, tol):
    model = LRAClassifier(small_config())
    attn = model.blocks[0].attn
    q, k, v = qkv(seed=1)
    ref = attention_reference(attn, q, k, v).float()
    model.set_attention(backend)
    out = heads_first(attn.sparse_ops(projection(q, k, v)), q.shape[1]).float()
    rel = (out - ref).norm() / ref.norm()
    assert rel < tol, f"{backend}: relative error {rel:.4f}"
    if backend == "8b-4b":
        model.set_attention("8b-8b")
        out8 = heads_first(attn.sparse_ops(projection(q, k, v)), q.shape[1]).float()
        assert rel > (out8 - ref).norm() / ref.norm()  # fewer bits, more error


@pytest.mark.parametrize("backend", ["sparse", "16b-8b", "8b-8b", "8b-4b"])
def test_fused_op_matches_the_three_ops(backend):
    model = LRAClassifier(small_config(attention=backend))
    attn = model.blocks[0].attn
    q, k, v = qkv(seed=2)
    unfused = attn.sparse_ops(projection(q, k, v))
    model.config.fused = True
    assert torch.equal(attn.sparse_ops(projection(q, k, v)), unfused)


def per_head_copies(attn, q, k, v):
    """The quantized backend as it ran on contiguous [BH, T, d] copies of Q, K and V, each with
    its own absmax (abs, then amax) or the calibrated scales repeated over batch x heads, through
    the three ops: [B, H, T, d]."""
    B, H, T, d = q.shape
    p_bits, bits = QUANTIZED[attn.config.attention]
    flat = [t.reshape(B * H, T, d).contiguous() for t in (q, k, v)]
    scales = attn.scales()
    if scales is None:
        qmax = (1 << (bits - 1)) - 1
        amax = [t.abs().amax(dim=(1, 2)).float() for t in flat]
        s = [torch.where(a > 0, a / qmax, torch.ones_like(a)) for a in amax]
    else:
        s = scales.detach().repeat(1, H // scales.shape[1]).repeat(1, B)
    qq, kq, vq = (ops.quant.quantize_to_container(t, si.view(-1, 1, 1), bits) for t, si in zip(flat, s))
    pat = attn.pattern(q.device)
    scores = ops.sddmm(pat, qq, kq, bits=bits, scale_a=s[0], scale_b=s[1])
    p, row_scale = ops.sparse_softmax(pat, scores, scale=d ** -0.5, out_bits=p_bits)
    y = ops.spmm(pat, p, vq, a_bits=p_bits, a_signed=False, b_bits=bits, scale_a=row_scale, scale_b=s[2])
    return y.view(B, H, T, d)


@pytest.mark.parametrize("emb_dim", [32, 24])  # head dim 16: the one-pass op; 12: the PyTorch path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scales", ["absmax", "head", "tensor"])
@pytest.mark.parametrize("backend", list(QUANTIZED))
def test_quantized_backends_quantize_the_projection_in_place(backend, scales, dtype, emb_dim):
    """Q, K, V quantized straight from the projection's view give the very outputs of the
    per-(batch x head) copies, absmax (an all-zero head included) or calibrated scales."""
    calibrated = {} if scales == "absmax" else dict(quant_precision=backend, quant_scales="fixed",
                                                    quant_granularity=scales)
    model = LRAClassifier(small_config(attention=backend, emb_dim=emb_dim, **calibrated))
    attn = model.blocks[0].attn
    if calibrated:
        attn.qkv_scale.copy_(torch.rand(attn.qkv_scale.shape, generator=torch.Generator().manual_seed(4)) / 20 + 0.01)
    q, k, v = (t.to(dtype) for t in qkv(d=emb_dim // 2, seed=3))
    q[1, 0] = 0
    want = per_head_copies(attn, q, k, v)
    for fused in (False, True):
        model.config.fused = fused
        assert torch.equal(heads_first(attn.sparse_ops(projection(q, k, v)), q.shape[1]), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("backend", ["sparse", *QUANTIZED])
def test_layer_output_is_the_transposed_three_op_result(backend, fused, dtype):
    """The layer feeds the projection the ops' [B, T, H * d] (written in that layout by the fused op):
    bit for bit the three ops' [B * H, T, d] transposed, as the layer computed it before."""
    model = LRAClassifier(small_config(attention=backend, emb_dim=48, num_heads=3, fused=fused)).eval().to(dtype)
    attn = model.blocks[0].attn
    x = torch.randn(2, 64, 48, generator=torch.Generator().manual_seed(6)).to(dtype)
    B, T, E = x.shape
    with torch.no_grad():
        q, k, v = attn.qkv(x).view(B, T, 3, 3, E // 3).permute(2, 0, 3, 1, 4)
        if backend == "sparse":
            pat, d = attn.pattern(x.device), E // 3
            flat = [t.reshape(B * 3, T, d).half() for t in (q, k, v)]
            probs, _ = ops.sparse_softmax(pat, ops.sddmm(pat, *flat[:2], bits=16), scale=d ** -0.5)
            y = ops.spmm(pat, probs, flat[2], a_bits=16, b_bits=16).view(B, 3, T, d)
        else:
            y = per_head_copies(attn, q, k, v)
        want = attn.proj(y.to(dtype).transpose(1, 2).reshape(B, T, E))
        assert torch.equal(attn(x), want)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("granularity", ["head", "tensor"])
@pytest.mark.parametrize("backend", list(QUANTIZED))
def test_calibrated_fp16_layer_quantizes_in_the_projection(backend, granularity, fused, monkeypatch):
    """With fixed scales and fp16 activations, Q/K/V come quantized out of ops.qkv_projection (the
    fp16 projection is never formed): the outputs of the per-(batch x head) copies of
    fp16(x @ W^T + b) through the three ops, bit for bit."""
    model = LRAClassifier(small_config(attention=backend, emb_dim=48, num_heads=3, fused=fused, quant_precision=backend,
                                       quant_scales="fixed", quant_granularity=granularity)).eval().half()
    attn = model.blocks[0].attn
    attn.qkv_scale.copy_(torch.rand(attn.qkv_scale.shape, generator=torch.Generator().manual_seed(5)) / 20 + 0.01)
    x = torch.randn(2, 64, 48, generator=torch.Generator().manual_seed(7)).half()
    B, T, E = x.shape
    calls = []
    projection_op = ops.qkv_projection
    monkeypatch.setattr(ops, "qkv_projection", lambda *a, **k: calls.append(k["bits"]) or projection_op(*a, **k))
    with torch.no_grad():
        y = torch.nn.functional.linear(x.float(), attn.qkv.weight.float(), attn.qkv.bias.float()).half()
        q, k, v = y.view(B, T, 3, 3, E // 3).permute(2, 0, 3, 1, 4)
        want = attn.proj(per_head_copies(attn, q, k, v).transpose(1, 2).reshape(B, T, E))
        assert torch.equal(attn(x), want)
    assert calls == [QUANTIZED[backend][1]]


@pytest.mark.parametrize("mode", ["fixed", "learned"])
def test_scales_stay_fp32_when_the_weights_change_dtype(mode):
    """qkv_scale keeps its fp32 values through .half() and .to(): a half model divides by the
    calibrated values themselves, and hands fixed ones to the kernels as they are."""
    model = LRAClassifier(small_config(attention="8b-8b", quant_precision="8b-8b", quant_scales=mode))
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.qkv_scale.copy_(torch.tensor([[0.1, 1e-6], [3.3, 70000.0], [0.7, 2.0 ** -30]]))  # none an fp16 value
    want = attn.qkv_scale.detach().clone()
    if mode == "learned":
        attn.qkv_scale.grad = torch.ones_like(attn.qkv_scale)
    model.half().to(torch.bfloat16).to("cpu")
    assert attn.qkv.weight.dtype == torch.bfloat16
    assert attn.qkv_scale.dtype == torch.float32 and torch.equal(attn.qkv_scale, want)
    assert isinstance(attn.qkv_scale, torch.nn.Parameter) == (mode == "learned")
    assert any(p is attn.qkv_scale for p in model.parameters()) == (mode == "learned")
    if mode == "fixed":
        assert attn.scales() is attn.qkv_scale  # no clamp or conversion a forward
    else:
        assert attn.qkv_scale.grad.dtype == torch.float32
        with torch.no_grad():
            attn.qkv_scale[0, 0] = -1.0  # a learned step past zero
        assert attn.scales()[0, 0] == torch.finfo(torch.float32).tiny and torch.equal(attn.scales()[1:], want[1:])


def test_the_layer_quantizes_through_the_one_pass_op(monkeypatch):
    """The projection's strided view goes to the quantize op as it is, not through PyTorch."""
    attn = LRAClassifier(small_config(attention="8b-8b")).eval().blocks[0].attn
    x = torch.randn(2, 64, 32)
    with torch.no_grad():
        want = attn(x)
        monkeypatch.setattr(ops.quant, "quantize_to_container", None)  # the PyTorch path would call it
        assert torch.equal(attn(x), want)


@pytest.mark.parametrize("scales", ["absmax", "calibrated"])
@pytest.mark.parametrize("fused", [False, True])
def test_quantized_layer_compiles_into_one_graph(fused, scales):
    """torch.compile takes the whole 8b-8b layer in one graph once its pattern is built (fullgraph:
    a graph break raises), the quantize op included, and computes what the layer computes eagerly."""
    quant = dict(quant_precision="8b-8b", quant_scales="fixed") if scales == "calibrated" else {}
    attn = LRAClassifier(small_config(attention="8b-8b", fused=fused, **quant)).eval().blocks[0].attn
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = attn(x)  # builds and caches the pattern, which the compiled layer then reads
        got = torch.compile(attn, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(got, want)


def test_quantize_compiles_the_op_path_for_any_first_row():
    """quantize_to_container picks the op from shapes and strides alone, so torch.compile keeps it in
    one graph; a view whose first row is off 16 bytes (rows 64 bytes apart) takes the op too."""
    x = torch.randn(4 * 16 + 1)[1:].view(4, 16)
    s = torch.rand(4, 1) + 0.5
    want = ops.quant.quantize_to_container(x, s, 8)
    compiled = torch.compile(lambda x, s: ops.quantize_to_container(x, s, 8), backend="aot_eager", fullgraph=True)
    assert torch.equal(ops.quantize_to_container(x, s, 8), want)
    assert torch.equal(compiled(x, s), want)


def test_training_path_and_gradients():
    torch.manual_seed(0)
    model = LRAClassifier(small_config()).train()
    model.blocks[1].attn.mask[0] = False  # an empty row must not poison the gradients
    x, y = torch.randint(1, 16, (4, 63)), torch.randint(0, 10, (4,))
    out = model(x, labels=y)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.set_attention("8b-8b", "ops")
    with pytest.raises(RuntimeError, match="no backward"):
        model(x, labels=y)
    model.set_attention("8b-8b", "auto")  # gradients: the fake-quantized twin of the ops
    model(x, labels=y).loss.backward()


def test_masks():
    m = structured_vector_mask(128, 8, 0.8, window=8, seed=0)
    assert m.mask.shape == (16, 128)
    assert m.mask[0].all() and m.mask[:, 0].all()  # global CLS row and column
    assert all(m.mask[i, max(0, 8 * i - 8):8 * i + 16].all() for i in range(16))  # local window
    budget = round(0.2 * 128)
    assert (m.mask.sum(1)[1:] == budget).all()
    assert torch.equal(m.mask, structured_vector_mask(128, 8, 0.8, window=8, seed=0).mask)
    r = layer_mask("random", 128, 8, 0.9, seed=0)
    assert (r.mask.sum(1) == round(0.1 * 128)).all()
    model = LRAClassifier(small_config(num_layers=3))
    masks = [b.attn.mask for b in model.blocks]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    with pytest.raises(ValueError, match="multiple of the vector length"):
        small_config(max_len=60)
    with pytest.raises(ValueError, match="attention"):
        small_config(attention="fancy")
    for settings, message in ((dict(num_layers=0), r"num_layers: expected an integer >= 1, got 0"),
                              (dict(window=-3), r"window: expected an integer >= 0, got -3"),
                              (dict(max_len=0), r"max_len: expected an integer >= 1, got 0"),
                              (dict(dropout=1.0), r"dropout: expected a probability in \[0, 1\), got 1.0"),
                              (dict(attention_dropout="0.1"), r"attention_dropout: expected a probability .*'0.1'"),
                              (dict(sparsity="abc"), r"sparsity: expected a fraction in \[0, 1\], got 'abc'"),
                              (dict(sparsity=float("nan")), r"sparsity: expected a fraction in \[0, 1\], got nan"),
                              (dict(fused="yes"), r"fused: expected true or false, got 'yes'"),
                              (dict(mask_seed=-1), r"mask_seed: expected an integer >= 0, got -1")):
        with pytest.raises(ValueError, match=message):
            small_config(**settings)
    for kind in ("structured", "random"):
        for sparsity in (1.5, -0.5):
            with pytest.raises(ValueError, match=rf"sparsity: expected a fraction in \[0, 1\], got {sparsity}"):
                layer_mask(kind, 128, 8, sparsity, seed=0)


def test_save_load_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = LRAClassifier(small_config(mask_kind="structured", mask_seed=5)).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = LRAClassifier.from_pretrained(tmp_path).eval()
    assert loaded.config.mask_kind == "structured" and loaded.config.mask_seed == 5
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.randint(1, 16, (2, 63))
    with torch.no_grad():
        for backend in ("dense", "sparse", "8b-4b"):
            model.set_attention(backend)
            loaded.set_attention(backend)
            assert torch.equal(model(x).logits, loaded(x).logits)


def test_loaded_mask_replaces_the_generated_one(tmp_path):
    model = LRAClassifier(small_config())
    model.blocks[0].attn.mask[2:4] = False
    model.save_pretrained(tmp_path)
    loaded = LRAClassifier.from_pretrained(tmp_path)
    attn = loaded.blocks[0].attn
    assert torch.equal(attn.mask, model.blocks[0].attn.mask)
    assert not attn.pattern(torch.device("cpu")).vector_mask().mask[2:4].any()
    fresh = LRAClassifier(small_config())
    fresh.blocks[0].attn.pattern(torch.device("cpu"))  # cached before the load
    fresh.load_state_dict(model.state_dict())
    assert not fresh.blocks[0].attn.pattern(torch.device("cpu")).vector_mask().mask[2:4].any()


def test_input_checks():
    model = LRAClassifier(small_config())
    with pytest.raises(ValueError, match="at most 63"):
        model(torch.zeros(1, 64, dtype=torch.long))
    # token ids are integers in 2-D: a float would be truncated to an id without a word
    for ids, got in ((torch.full((1, 8), 2.7), r"torch.float32 tensor of shape \(1, 8\)"),
                     (torch.zeros(8, dtype=torch.long), r"torch.int64 tensor of shape \(8,\)"),
                     (torch.zeros(1, 8, dtype=torch.bool), r"torch.bool tensor")):
        with pytest.raises(ValueError, match=r"input_ids: expected a 2-D \[batch, tokens\] tensor of integer token "
                                             rf"ids, got {got}"):
            model(ids)
    with pytest.raises(ValueError, match="input_ids: expected a tensor of token ids, got list"):
        model([[1, 2]])
    assert model(torch.ones(2, 8, dtype=torch.int16)).logits.shape == (2, 10)  # the data's own dtype
    mean = LRAClassifier(small_config(pool="mean"))
    assert mean.config.input_len == 64 and mean(torch.ones(2, 64, dtype=torch.long)).logits.shape == (2, 10)


@pytest.mark.parametrize("attention", ["dense", "materialized", "sparse", "16b-8b", "8b-8b", "8b-4b"])
def test_an_empty_batch_gives_empty_logits(attention):
    """Every backend and path takes a batch of none (the fake quantization's segment reductions and
    the quantized paths' views had nothing to infer a width from)."""
    ids = torch.zeros(0, 63, dtype=torch.long)
    for impl, fused in (("masked", False), ("ops", False), ("ops", True)):
        model = LRAClassifier(small_config(attention=attention, sparse_impl=impl, fused=fused))
        with torch.no_grad():
            assert model.eval()(ids).logits.shape == (0, 10)
    if attention in ("16b-8b", "8b-8b", "8b-4b"):  # the finetuning path, learned scales
        model = LRAClassifier(small_config(attention=attention, quant_precision=attention, quant_scales="learned"))
        assert model.train()(ids).logits.shape == (0, 10)


def test_materialized_attention_matches_sdpa():
    torch.manual_seed(0)
    model = LRAClassifier(LRAConfig(max_len=32, emb_dim=16, num_heads=2, num_layers=1, mlp_dim=32, num_classes=3,
                                    attention="dense", dropout=0.0, attention_dropout=0.0)).eval()
    ids = torch.randint(1, 257, (2, 31))
    with torch.no_grad():
        dense = model(ids).logits
        model.set_attention("materialized")
        assert torch.allclose(model(ids).logits, dense, atol=1e-5)
