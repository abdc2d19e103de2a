"""The Long Range Arena Transformer classifier with dense, sparse and quantized sparse attention.

    ids -> token embedding (+ CLS) + sinusoidal positions -> N x pre-LN block -> LN -> pool -> head

One block: x + Attn(LN(x)), then x + MLP(LN(x)) with GELU. Attention backends (config.attention):

    dense    softmax(QK^T / sqrt(d)) V through scaled_dot_product_attention, no mask
    materialized  the same computed as softmax(QK^T / sqrt(d)) V with the scores in memory (the
             paper's dense baseline)
    sparse   the same restricted to the layer's V x 1 vector mask, in fp16:
             magicube.ops.sddmm -> sparse_softmax -> spmm
    16b-8b   Q, K, V in 8 bits (absmax per batch x head), probabilities in unsigned 16 bits
    8b-8b    Q, K, V in 8 bits, probabilities in 8 bits
    8b-4b    Q, K, V in 4 bits, probabilities in 8 bits  ("softmax bits - QKV bits")

With config.fused the three ops run as the one op magicube.ops.sparse_attention (same roundings).

The ops have no backward, so whenever gradients are needed (or with sparse_impl "masked") the
sparse backend runs the same function as masked dense attention (scores outside the mask at
-inf), and the quantized backends their fake-quantized twin (model/fakequant.py: the same
integers and roundings, straight-through gradients). Padding tokens are not masked out: the
mask is shared by the whole batch, as the kernels require.

A quantization-finetuned model records its precision (config.quant_precision) and how its
Q/K/V scales are set (config.quant_scales: "absmax" per batch x head, or calibrated "fixed" /
"learned" scales per head or per tensor, kept in each layer's `qkv_scale`); the integer ops
then quantize with those scales instead of the per-batch absmax, in fp16 inside the Q/K/V
projection itself (magicube.ops.qkv_projection).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

from magicube import ops
from magicube.model import fakequant
from magicube.model.masks import KINDS, layer_mask
from magicube.train.config import check_count, check_flag

# backend -> (softmax output bits, Q/K/V bits)
QUANTIZED = {"16b-8b": (16, 8), "8b-8b": (8, 8), "8b-4b": (8, 4)}
BACKENDS = ("dense", "materialized", "sparse", *QUANTIZED)
SPARSE_IMPLS = ("auto", "ops", "masked")
POOLS = ("cls", "mean")


def _is_real(x) -> bool:
    """Not train.config.check_real, which takes a string that spells a number: the config keeps the
    value as given (and saves it), so a string would reach nn.Dropout and the mask generators."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class LRAConfig(PretrainedConfig):
    model_type = "magicube_lra"

    def __init__(self, vocab_size=257, num_classes=2, max_len=4096, emb_dim=256, num_heads=4, num_layers=4,
                 mlp_dim=1024, dropout=0.1, attention_dropout=0.1, pool="cls", attention="dense",
                 sparse_impl="auto", fused=False, mask_kind="random", sparsity=0.9, v=8, mask_seed=0, window=32,
                 quant_precision=None, quant_scales="absmax", quant_granularity="head", **kwargs):
        self.vocab_size, self.num_classes, self.max_len = vocab_size, num_classes, max_len
        self.emb_dim, self.num_heads, self.num_layers, self.mlp_dim = emb_dim, num_heads, num_layers, mlp_dim
        self.dropout, self.attention_dropout, self.pool = dropout, attention_dropout, pool
        self.attention, self.sparse_impl, self.fused = attention, sparse_impl, fused
        self.mask_kind, self.sparsity, self.v, self.mask_seed, self.window = mask_kind, sparsity, v, mask_seed, window
        self.quant_precision, self.quant_scales = quant_precision, quant_scales
        self.quant_granularity = quant_granularity
        super().__init__(**kwargs)
        self.validate_lra()

    def validate_lra(self):
        for name, value, allowed in (("attention", self.attention, BACKENDS), ("pool", self.pool, POOLS),
                                     ("sparse_impl", self.sparse_impl, SPARSE_IMPLS),
                                     ("mask_kind", self.mask_kind, KINDS),
                                     ("quant_precision", self.quant_precision, (None, *QUANTIZED)),
                                     ("quant_scales", self.quant_scales, fakequant.SCALE_MODES),
                                     ("quant_granularity", self.quant_granularity, fakequant.GRANULARITIES)):
            if value not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")
        for name in ("max_len", "emb_dim", "num_heads", "num_layers", "mlp_dim", "window", "mask_seed"):
            check_count(name, getattr(self, name), 0 if name in ("window", "mask_seed") else 1)
        check_flag("fused", self.fused)
        for name in ("dropout", "attention_dropout"):
            if not (_is_real(getattr(self, name)) and 0.0 <= getattr(self, name) < 1.0):
                raise ValueError(f"{name}: expected a probability in [0, 1), got {getattr(self, name)!r}")
        if not (_is_real(self.sparsity) and 0.0 <= self.sparsity <= 1.0):
            raise ValueError(f"sparsity: expected a fraction in [0, 1], got {self.sparsity!r}")
        if self.emb_dim % self.num_heads:
            raise ValueError(f"emb_dim {self.emb_dim} is not a multiple of num_heads {self.num_heads}")
        if self.max_len % self.v:
            raise ValueError(f"max_len {self.max_len} (the attention length, CLS included) is not a multiple "
                             f"of the vector length v={self.v}")

    @property
    def calibrated(self) -> bool:
        """Whether the layers hold calibrated Q/K/V scales (`qkv_scale`) for quant_precision."""
        return self.quant_precision is not None and self.quant_scales != "absmax"

    @property
    def input_len(self) -> int:
        """Tokens of data per example: the attention length less the CLS slot."""
        return self.max_len - (self.pool == "cls")


def sinusoidal_positions(length: int, dim: int, device=None) -> torch.Tensor:
    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(length, dim, device=device)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)
    return pe


class Attention(nn.Module):
    def __init__(self, config: LRAConfig, layer: int):
        super().__init__()
        self.config, self.h = config, config.num_heads
        self.qkv = nn.Linear(config.emb_dim, 3 * config.emb_dim)
        self.proj = nn.Linear(config.emb_dim, config.emb_dim)
        self.drop = nn.Dropout(config.dropout)
        m = layer_mask(config.mask_kind, config.max_len, config.v, config.sparsity,
                       seed=config.mask_seed + layer, window=config.window)
        # Saved with the weights, so a checkpoint carries the exact pattern it was trained with.
        self.register_buffer("mask", m.mask, persistent=True)
        self._patterns: dict[torch.device, ops.SRBCRS] = {}
        if config.calibrated:
            # Q, K, V scales (rows) per head or per tensor; calibration sets them before finetuning.
            init = torch.ones(3, self.h if config.quant_granularity == "head" else 1, dtype=torch.float32)
            if config.quant_scales == "learned":
                self.qkv_scale = nn.Parameter(init)
            else:
                self.register_buffer("qkv_scale", init, persistent=True)

    def _apply(self, fn, recurse=True):
        # The Q/K/V scales are quantization metadata and stay fp32 when the weights change dtype
        # (model.half()): a half model divides by the calibrated values themselves, and its
        # forward passes them to the kernels without a conversion.
        before = self.qkv_scale.detach() if self.config.calibrated else None
        super()._apply(fn, recurse)
        if before is not None and self.qkv_scale.dtype != before.dtype:
            kept = before.to(self.qkv_scale.device)
            if isinstance(self.qkv_scale, nn.Parameter):
                self.qkv_scale.data = kept
                if self.qkv_scale.grad is not None:  # converted with the parameter: it must match it
                    self.qkv_scale.grad = self.qkv_scale.grad.float()
            else:
                self.qkv_scale = kept
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        self._patterns.clear()
        super()._load_from_state_dict(*args, **kwargs)

    def pattern(self, device) -> ops.SRBCRS:
        if device not in self._patterns:
            vm = ops.VectorMask(self.mask.detach().cpu(), self.config.v)
            self._patterns[device] = ops.SRBCRS.from_mask(vm, stride=32).to(device)
        return self._patterns[device]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, E = x.shape
        backend, impl = self.config.attention, self.config.sparse_impl
        p_drop = self.config.attention_dropout if self.training else 0.0
        needs_grad = torch.is_grad_enabled() and x.requires_grad
        scales = self.scales()
        if backend in QUANTIZED and impl != "masked" and not needs_grad and scales is not None \
                and x.dtype == torch.float16:
            # Fixed scales: Q, K and V are quantized in the projection's epilogue, never stored in fp16.
            scales = scales.detach()
            qkv = ops.qkv_projection(x, self.qkv.weight, self.qkv.bias, scales, heads=self.h,
                                     bits=QUANTIZED[backend][1])
            return self.drop(self.proj(self.integer_ops(qkv, scales, B).to(x.dtype)))
        qkv = self.qkv(x).view(B, T, 3, self.h, E // self.h).permute(2, 0, 3, 1, 4)  # [3, B, H, T, d], a view
        q, k, v = qkv
        if backend == "dense":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop)
        elif backend == "materialized":
            # The paper's dense baseline: the L x L scores and probabilities go through memory.
            probs = F.dropout(torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1), p_drop)
            y = probs @ v
        elif backend == "sparse" and (impl == "masked" or (impl == "auto" and needs_grad)):
            y = self.masked(q, k, v, p_drop)
        elif backend in QUANTIZED and (impl == "masked" or (impl == "auto" and needs_grad)):
            y = self.fake_quantized(q, k, v).to(x.dtype)
        elif needs_grad:
            raise RuntimeError(f"attention {backend!r} (sparse_impl {impl!r}) runs through the magicube ops, "
                               "which have no backward; train with 'dense' or 'sparse' and evaluate with it")
        else:
            return self.drop(self.proj(self.sparse_ops(qkv).to(x.dtype)))
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, E)))

    def masked(self, q, k, v, p_drop: float) -> torch.Tensor:
        """Masked dense attention: the sparse function, differentiable."""
        keep = self.mask.repeat_interleave(self.config.v, dim=0)  # [T, T]
        empty = ~keep.any(dim=1)
        # An empty row would be softmax over nothing (NaN): let it see everything, then zero it.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | empty[:, None], dropout_p=p_drop)
        return y.masked_fill(empty[:, None], 0.0)

    def scales(self) -> torch.Tensor | None:
        """The calibrated Q/K/V scales [3, H or 1] in fp32 if they serve the current backend, else
        None (absmax). Fixed scales serve as calibrated (positive: `scale_of_absmax`); learned ones
        are kept positive, as a step can reach zero or below."""
        c = self.config
        if not (c.calibrated and c.attention == c.quant_precision):
            return None
        return fakequant.positive(self.qkv_scale) if c.quant_scales == "learned" else self.qkv_scale

    def fake_quantized(self, q, k, v) -> torch.Tensor:
        """The quantized backend's function, differentiable (attention dropout does not apply: the
        integer ops have none)."""
        p_bits, bits = QUANTIZED[self.config.attention]
        keep = self.mask.repeat_interleave(self.config.v, dim=0)
        return fakequant.attention(q, k, v, keep, p_bits=p_bits, bits=bits, softmax_scale=q.shape[-1] ** -0.5,
                                   scales=self.scales())

    def sparse_ops(self, qkv) -> torch.Tensor:
        """Attention through the ops; qkv: Q, K, V as [3, B, H, T, d] (any strides). Returns fp16
        [B, T, H * d], the layout of the output projection: the fused op writes it directly, the
        three-op pipeline's [B * H, T, d] is transposed into it."""
        _, B, H, T, d = qkv.shape
        if self.config.attention != "sparse":
            return self.integer_ops(*self.quantize(qkv, QUANTIZED[self.config.attention][1]), B)
        pat = self.pattern(qkv.device)
        if self.config.fused:  # the [B, H, T, d] views, read in place
            return ops.sparse_attention(pat, *qkv.half(), softmax_scale=d ** -0.5).view(B, T, H * d)
        q, k, v = (t.reshape(B * H, T, d).half() for t in qkv)
        s = ops.sddmm(pat, q, k, bits=16)
        p, _ = ops.sparse_softmax(pat, s, scale=d ** -0.5, out_bits=0)
        y = ops.spmm(pat, p, v, a_bits=16, b_bits=16)
        return y.view(B, H, T, d).transpose(1, 2).reshape(B, T, H * d)

    def integer_ops(self, qkv: torch.Tensor, scales: torch.Tensor, batch: int) -> torch.Tensor:
        """sparse_ops on quantized Q, K, V: containers [3, B * H, T, d'] with fp32 scales per Q/K/V and
        head [3, H] (or [3, 1]: per tensor) or per Q/K/V and batch x head [3, B * H]."""
        T, H, d = qkv.shape[2], self.h, self.config.emb_dim // self.h
        pat = self.pattern(qkv.device)
        qq, kq, vq = qkv
        p_bits, bits = QUANTIZED[self.config.attention]
        if self.config.fused:  # the kernel reads per-head scales in place
            sq, sk, sv = scales
            return ops.sparse_attention(pat, qq, kq, vq, softmax_scale=d ** -0.5, qk_bits=bits, p_bits=p_bits,
                                        scale_q=sq, scale_k=sk, scale_v=sv, heads=H).view(batch, T, H * d)
        sq, sk, sv = scales if scales.shape[1] == batch * H else scales.expand(3, H).repeat(1, batch)
        s = ops.sddmm(pat, qq, kq, bits=bits, scale_a=sq, scale_b=sk)
        p, row_scale = ops.sparse_softmax(pat, s, scale=d ** -0.5, out_bits=p_bits)
        y = ops.spmm(pat, p, vq, a_bits=p_bits, a_signed=False, b_bits=bits, scale_a=row_scale, scale_b=sv)
        return y.view(batch, H, T, d).transpose(1, 2).reshape(batch, T, H * d)

    def quantize(self, qkv: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """quantize_qkv with the calibrated scales, or else the absmax."""
        _, B, H, _, _ = qkv.shape
        scales = self.scales()
        if scales is not None:
            scales = scales.detach().view(3, 1, -1, 1, 1).expand(3, B, H, 1, 1)
        return quantize_qkv(qkv, bits, scales)


def quantize_qkv(qkv: torch.Tensor, bits: int, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of Q, K, V [3, B, H, T, d] per (batch x head) with `scale`
    [3, B, H, 1, 1], or else the absmax: (containers [3, BH, T, d'], fp32 scales [3, BH]).

    Each of the two steps reads the strided projection output in place, one pass over it.
    """
    _, B, H, T, _ = qkv.shape
    if scale is None:
        scale = qkv_absmax_scale(qkv, bits)
    c = ops.quantize_to_container(qkv, scale, bits)
    return c.view(3, B * H, T, c.shape[-1]), scale.reshape(3, B * H)  # the width named: B may be 0


def qkv_absmax_scale(qkv: torch.Tensor, bits: int) -> torch.Tensor:
    """ops.absmax_scale(qkv, bits, dim=(3, 4)), [3, B, H, 1, 1], reduced in the memory order of the
    projection output [B, T, 3, H, d]: min and max over T in one streaming pass, then the small
    rest (34 us at B=8, L=4096, E=256 on an H200; reducing the permuted view itself took 56)."""
    lo, hi = torch.aminmax(qkv.permute(1, 3, 0, 2, 4), dim=1)  # [B, 3, H, d]
    absmax = torch.maximum(hi, -lo).amax(dim=-1)  # exact in any float dtype; NaN propagates
    return ops.scale_of_absmax(absmax.transpose(0, 1)[..., None, None], bits)


class Block(nn.Module):
    def __init__(self, config: LRAConfig, layer: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(config.emb_dim), nn.LayerNorm(config.emb_dim)
        self.attn = Attention(config, layer)
        self.mlp = nn.Sequential(nn.Linear(config.emb_dim, config.mlp_dim), nn.GELU(), nn.Dropout(config.dropout),
                                 nn.Linear(config.mlp_dim, config.emb_dim), nn.Dropout(config.dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LRAPreTrainedModel(PreTrainedModel):
    config_class = LRAConfig
    base_model_prefix = "lra"
    main_input_name = "input_ids"

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=1.0)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, LRAClassifier) and module.cls is not None:
            nn.init.normal_(module.cls, std=1.0)


class LRAClassifier(LRAPreTrainedModel):
    def __init__(self, config: LRAConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.emb_dim)
        # Only with CLS pooling: an unused parameter would stall DDP's gradient reduction.
        self.cls = nn.Parameter(torch.zeros(config.emb_dim)) if config.pool == "cls" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.emb_dim)
        self.head = nn.Sequential(nn.Linear(config.emb_dim, config.mlp_dim), nn.ReLU(),
                                  nn.Linear(config.mlp_dim, config.num_classes))
        self.post_init()

    def set_attention(self, backend: str, sparse_impl: str | None = None):
        """Switch every layer's attention backend (the weights and masks are shared by all)."""
        self.config.attention = backend
        if sparse_impl is not None:
            self.config.sparse_impl = sparse_impl
        self.config.validate_lra()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        c = self.config
        # metadata only: a range check of the ids would cost a device sync every forward
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError(f"input_ids: expected a tensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.is_complex() \
                or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids: expected a 2-D [batch, tokens] tensor of integer token ids, got "
                             f"{input_ids.dtype} tensor of shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] > c.input_len:
            raise ValueError(f"input_ids: {input_ids.shape[1]} tokens, the model takes at most {c.input_len}")
        # The masks are built for exactly max_len positions: pad shorter inputs.
        input_ids = F.pad(input_ids.long(), (0, c.input_len - input_ids.shape[1]))
        x = self.embed(input_ids)
        if c.pool == "cls":
            x = torch.cat([self.cls.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)
        x = self.drop(x + sinusoidal_positions(c.max_len, c.emb_dim, x.device).to(x.dtype))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = self.head(x[:, 0] if c.pool == "cls" else x.mean(dim=1))
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)
