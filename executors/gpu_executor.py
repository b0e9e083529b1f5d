"""The GPU executor: one layer's fast-tier part, its predictor and its hot neurons.

Masks are produced in *hot-first order*: column j < H is hot neuron j (the plan's order), column
H + k is cold neuron k (ascending neuron index). The predictor's output rows are permuted once at
build time, so splitting a mask into its hot and cold parts is two slices, not two gathers.

Mask sources (x: [N, D] -> bool [N, I], or None for "all active"):
  LearnedMask  the layer's NeuronPredictor: w2(relu(w1 x)) > threshold, in the model's half
               precision (see predictor_dtype) or float32; on the fast tier or, per the plan, the CPU
  OracleMask   the true active set |h| > threshold from the full up/gate weights (tests only: it
               keeps a second copy of W_up/W_gate on the fast tier)
  None         no predictor for the layer: every neuron is computed
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hotcold.executors.stats import now
from hotcold.executors.weights import HotFFN, fast_rows
from hotcold.models.layers import DenseFFN, GatedFFN, project
from hotcold.predictors.neurons import NeuronPredictor
from hotcold.sparse_ops.cpu import gemv, set_threads
from hotcold.sparse_ops.gpu import activation, hot_ffn


def _plain(t: torch.Tensor, device, dtype=None) -> torch.Tensor:
    """A detached copy on device (not a Parameter, so module.to() and dtype casts leave it alone)."""
    with torch.inference_mode(False):
        return t.detach().to(device, dtype or t.dtype, copy=True)


def predictor_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a predictor runs in for a model computing in `dtype`: half precision stays half (2
    bytes per parameter, as the planner counts them), float32 stays float32. Against float32 on the
    profile's samples of a 7B-shaped layer, float16 flipped 0.003% of the decisions and bfloat16
    0.02-0.04%, with the same predicted-active fraction to 4 digits."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


HOST_PREDICTOR_QTYPE = "Q8_0"  # block type of a predictor on the CPU (see LearnedMask)


def _host_predictor(w1: torch.Tensor, b1: torch.Tensor, w2, b2: torch.Tensor, threads: int,
                    qtype: str | None = HOST_PREDICTOR_QTYPE, memo=None, name: str = ""):
    """The two layers of a CPU predictor as HostLinear (numba's kernels for one token). w1: [r, D],
    w2: [I, r] -> (l1, l2): float32 for qtype None or D not a multiple of its block size; else blocks
    of qtype, the rank r padded to a multiple of the block size with zero rows of w1 and zero
    columns of w2 (relu(0) adds nothing), rows interleaved with Q8 activations (`pack_rows`) where
    their count allows. Q8_0 holds half a half-precision predictor's bytes; on a 4-layer 7B shape's
    FFN inputs 0.06-0.09% of its decisions differ from float32's with float x (bfloat16:
    0.03-0.05%), 0.11-0.15% interleaved with Q8 x, with the same active fraction to 4 digits; the
    interleaved pair runs in 224 instead of 400 us per layer (1 thread, [352, 4096] and [11008, 352]).
    w2: a tensor, or a function returning it (only called where it is needed). memo: an
    executors.split_cache.SplitMemo serving and keeping the two block matrices, named after `name`."""
    from hotcold.executors.host_attention import HostLinear
    from hotcold.models.quantized import QuantLinear
    from hotcold.sparse_ops.quant import QTYPES, QuantMatrix, pack_rows

    def linear(w, b):  # nn.Linear holding float32 copies
        lin = nn.Linear(1, 1)
        lin.weight, lin.bias = (nn.Parameter(_plain(t, "cpu", torch.float32), requires_grad=False) for t in (w, b))
        return lin

    w2_of = w2 if callable(w2) else (lambda: w2)
    if qtype is None or w1.shape[1] % QTYPES[qtype][1]:
        return HostLinear(linear(w1, b1), threads), HostLinear(linear(w2_of(), b2), threads)
    pad = -w1.shape[0] % QTYPES[qtype][1]
    b1 = F.pad(b1.float(), (0, pad))  # [r']

    def blocks(part: str, w):  # w(): the float matrix, its rank padded
        def build():
            return pack_rows(QuantMatrix.quantize(w().detach().numpy(), qtype), xq=True)
        return build() if memo is None else memo.matrix(f"{name}.{part}.{qtype}", build)

    m1 = blocks("w1", lambda: F.pad(w1.float(), (0, 0, 0, pad)))  # [r', D]
    m2 = blocks("w2", lambda: F.pad(w2_of().float(), (0, pad)))  # [I, r']
    return tuple(HostLinear(QuantLinear(m, _plain(b, "cpu")), threads) for m, b in ((m1, b1), (m2, b2)))


class LearnedMask:
    """A NeuronPredictor with output rows permuted to hot-first order, on the fast tier in `dtype`
    (see predictor_dtype; the threshold comparison is in float32), or with host_threads on the CPU:
    numba's kernels over host_qtype blocks (None: float32) for one token (see _host_predictor), as
    the planner assumes."""

    def __init__(self, pred: NeuronPredictor, perm: torch.Tensor, device, dtype: torch.dtype = torch.float32,
                 host_threads: int | None = None, worker=None, book=None, host_qtype: str | None = HOST_PREDICTOR_QTYPE,
                 memo=None, name: str = ""):
        if pred.w2.out_features != len(perm):
            raise ValueError(f"predictor predicts {pred.w2.out_features} neurons, the FFN has {len(perm)}")
        p = perm.to(pred.w2.weight.device)
        if host_threads:  # (the permuted w2 gathered only where its blocks are not in the memo)
            self.device, self.dtype = torch.device("cpu"), torch.float32
            self.l1, self.l2 = _host_predictor(pred.w1.weight, pred.w1.bias, lambda: pred.w2.weight[p],
                                               pred.w2.bias[p], host_threads, host_qtype, memo, name)
        else:
            weights = (pred.w1.weight, pred.w1.bias, pred.w2.weight[p], pred.w2.bias[p])  # w1 [r, D], b1, w2 [I, r], b2
            self.device, self.dtype = torch.device(device), dtype
            self.l1, self.l2 = nn.Linear(1, 1), nn.Linear(1, 1)
            for lin, (w, b) in ((self.l1, weights[:2]), (self.l2, weights[2:])):
                lin.weight, lin.bias = (nn.Parameter(_plain(t, device, dtype), requires_grad=False) for t in (w, b))
        self.threshold = _plain(pred.threshold, self.device, torch.float32)
        self.worker, self.book = worker, book  # a CPU predictor runs on the worker thread (see HostAttention)
        # one token on the host: numpy views for _predict_one (float32 biases, the threshold)
        self._one = None if not host_threads else (
            np.ascontiguousarray(self.l1.bias.detach().float().numpy()),
            np.ascontiguousarray(self.l2.bias.detach().float().numpy()), np.float32(self.threshold.item()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] -> bool [N, I], on x's device (the predictor may live on the CPU, per the plan)
        t0 = now()
        xs = x.to(self.device, self.dtype)
        mask = self.worker.call(self._predict, xs) if self.worker is not None else self._predict(xs)
        mask = mask.to(x.device)
        if self.worker is not None and self.book is not None and self.book.enabled:
            self.book.add("decode" if x.shape[0] == 1 else "prefill", host_s=now() - t0)
        return mask

    def _predict(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] on the predictor's device -> bool [N, I] there
        if self._one is not None and x.shape[0] == 1:
            return self._predict_one(x)
        z = torch.relu(project(self.l1, x))  # [N, r]
        return project(self.l2, z).float() > self.threshold

    def _predict_one(self, x: torch.Tensor) -> torch.Tensor:
        """One token on the host: the two GEMVs (numba) with the bias, ReLU and threshold in place in
        numpy, where HostLinear's and the comparison's torch ops took a third of a 13B-shaped layer's
        660 us on 2 cores. x: float32 [1, D] -> bool [1, I]."""
        b1, b2, threshold = self._one
        set_threads(self.l1.threads)  # numba's count is per calling thread
        z = gemv(self.l1.host, np.ascontiguousarray(x.reshape(-1).numpy(), dtype=np.float32))  # [r]
        z += b1
        np.maximum(z, 0.0, out=z)
        y = gemv(self.l2.host, z)  # [I]
        y += b2
        return torch.from_numpy(y > threshold).reshape(1, -1)

    @property
    def nbytes(self) -> int:
        from hotcold.models.quantized import quant_bytes

        return sum(quant_bytes(m) + sum(t.numel() * t.element_size() for t in m.parameters()) for m in (self.l1, self.l2))


class OracleMask:
    """The true active set, |h| > threshold, from full up/gate (+bias) weights permuted hot-first
    (a quantised FFN's rows dequantised: float h, where the CPU kernels may round x to Q8)."""

    def __init__(self, ffn: DenseFFN | GatedFFN, perm: torch.Tensor, act: str, threshold: float, device, dtype):
        self.up = fast_rows(ffn.up, perm, device, dtype)
        self.gate = fast_rows(ffn.gate, perm, device, dtype) if isinstance(ffn, GatedFFN) else None
        self.bias = None if self.gate is not None else _plain(ffn.up.bias[perm.to(ffn.up.bias.device)], device, dtype)
        self.act, self.threshold = activation(act), threshold

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] -> bool [N, I]
        if self.gate is not None:
            h = self.act(F.linear(x, self.gate)) * F.linear(x, self.up)
        else:
            h = self.act(F.linear(x, self.up, self.bias))
        return h.abs() > self.threshold

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.up, self.gate, self.bias) if t is not None)


class GPUExecutor:
    """One layer on the fast tier: predict the active mask, compute the hot neurons."""

    def __init__(self, hot: HotFFN, down_bias: torch.Tensor | None, mask_fn, act: str, dim: int):
        self.hot, self.down_bias, self.mask_fn, self.act, self.dim = hot, down_bias, mask_fn, act, dim

    @property
    def n_hot(self) -> int:
        return self.hot.n

    def predict(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: [N, D] -> bool [N, I] hot-first, or None (all active)."""
        return None if self.mask_fn is None else self.mask_fn(x)

    def compute(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Hot neurons' share of the FFN output (+ down bias). x: [N, D]; mask: bool [N, H] | [H] | None
        (hot rows kept int4 have H' >= H padding neurons, which hot_ffn leaves out of the mask)."""
        h = self.hot
        if h.n:
            y = hot_ffn(x, h.up, h.down_t, self.act, h.gate, h.up_bias, mask)  # [N, D]
        else:
            y = x.new_zeros(x.shape[0], self.dim)
        return y if self.down_bias is None else y + self.down_bias

    @property
    def nbytes(self) -> int:
        pred = getattr(self.mask_fn, "nbytes", 0)
        return self.hot.nbytes + pred + (0 if self.down_bias is None else self.down_bias.numel() * self.down_bias.element_size())
