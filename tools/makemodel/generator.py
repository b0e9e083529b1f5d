"""The generator: every tensor of the plan as row chunks, planted from a float32 calibration forward."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from makemodel.spec import Spec, expert_shares, firing_probs
from makemodel.tensors import Pool, count_params, pool_size, tensor_plan

# ----------------------------------------------------------------------------- the generator

CHUNK_BYTES = 8 << 20  # rows generated at once (per tensor chunk, in the storage dtype)
EXPERT_GROUP = 16  # expert matrices copied from the pool at once, in threads (see WeightGenerator._experts)


def rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """HF rotate-half rotary embedding. x: [B, T, H, Dh] at positions 0..T-1."""
    B, T, H, Dh = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh))
    freqs = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1).float()
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    rotated = torch.cat((-x[..., Dh // 2 :], x[..., : Dh // 2]), -1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention. q: [B, T, H, Dh], k/v: [B, T, K, Dh] -> [B, T, H*Dh]."""
    B, T, H, Dh = q.shape
    rep = H // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(B, T, H * Dh)


Chunk = tuple[str, int, torch.Tensor]  # (HF name, first row, rows in the storage dtype)
RESID_GROWTH = 2.0  # the residual's variance grows (1 + this)-fold over the layers
QK_STD = 2.0  # q and k entries of std 2: attention logits of std ~4 (peaked, as in trained LLMs)
LOGIT_STD = 3.0  # std of the output logits over the vocabulary


def _grid(std: float) -> float:
    """std rounded to a 2^(1/8) grid (few distinct pools are cached)."""
    return float(2.0 ** (round(8 * math.log2(std)) / 8))


class WeightGenerator:
    """Produces every tensor of the plan, in order, as row chunks, while running a float32 forward of
    a few hundred calibration tokens through the layers generated so far; the forward gives each
    FFN (or router) the statistics its planted biases are solved from.

    Planting (dense): channel c of the residual stream is a constant "massive activation": every
    embedding row holds A = 2 sqrt(D) there and no layer writes it (o_proj/down_proj rows c are zero,
    and no q/k/v/up/lm_head weight reads it), so after RMSNorm x_c is almost the same for every token
    (it varies by 1-5%) and W_gate[i, c] * x_c acts as neuron i's bias. With the rest of neuron i's
    pre-activation y_i and x_c modelled as jointly normal over the calibration tokens,
    W_gate[i, c] solves P(y_i + W_gate[i, c] x_c > 0) = p_i (a quadratic). OPT has real biases:
    fc1.bias_i = sigma_i Phi^-1(p_i) - mu_i. MoE: the router's column c is a per-expert bias, fitted
    so that top-k routing reproduces the target expert shares.

    Scales: input projections get weights making their outputs unit-variance over the calibration
    tokens (q and k QK_STD, so attention is peaked); each attention/FFN output adds RESID_GROWTH / 2L
    of the embedding's variance to the residual; lm_head gives logits of std LOGIT_STD. Nothing
    blows up over 80 layers, in any storage dtype.
    """

    def __init__(self, spec: Spec, dtype: torch.dtype, seed: int, sparsity: float, mass80: float,
                 expert_skew: float, calib: torch.Tensor, gate_rank: int = 0, gate_noise: float = 0.0):
        self.s, self.dtype, self.seed = spec, dtype, seed
        self.gate_rank, self.gate_noise = gate_rank, gate_noise
        self.sparsity, self.mass80, self.expert_skew = sparsity, mass80, expert_skew
        self.plan = tensor_plan(spec)
        self.pool = Pool(seed, pool_size(count_params(self.plan)), dtype)
        self.rng = np.random.default_rng([seed, 1])
        self.tokens = calib  # [B, T]
        D = spec.hidden
        self.c = int(np.random.default_rng([seed, 2]).integers(D)) if spec.family != "opt" else -1
        self.A = 2 * math.sqrt(D)  # the constant channel's value in every embedding row: 4x the rest's energy
        L = spec.layers
        # Each attention and FFN output adds RESID_GROWTH / (2 L) of the embedding's variance to every
        # residual channel, so the residual's non-constant part grows (1 + RESID_GROWTH)-fold over depth.
        embed_var = 1.0 + (0.25 if spec.family == "opt" else 0.0)
        self.out_var = RESID_GROWTH * embed_var / (2 * L)
        self.probs = firing_probs(spec.ffn, sparsity, mass80) if not spec.moe else None
        self.shares = expert_shares(spec.experts, spec.top_k, expert_skew) if spec.moe else None
        self.layer_notes: list[dict] = []

    # -- helpers ---------------------------------------------------------------------

    def _rows_per_chunk(self, rows: int, cols: int, align: int = 1) -> int:
        per = max(1, CHUNK_BYTES // (cols * torch.finfo(self.dtype).bits // 8))
        per = max(align, per // align * align)
        return min(rows, per)

    def _gate_basis(self, layer: int) -> torch.Tensor | None:
        """This layer's gate subspace: [gate_rank, D] orthonormal rows, channel c left out; None when
        gate_rank is 0 (isotropic gate rows, which no low-rank predictor can anticipate)."""
        k, D = self.gate_rank, self.s.hidden
        if k <= 0:
            return None
        g = torch.from_numpy(np.random.default_rng([self.seed, 6, layer]).standard_normal((D, k), dtype=np.float32))
        if self.c >= 0:
            g[self.c] = 0
        q, _ = torch.linalg.qr(g)  # [D, k], orthonormal columns
        return q.T.contiguous()

    def _in_std(self, x: torch.Tensor, gain: float = 1.0) -> float:
        """Std of a projection reading x ([N, D]) that gives outputs of std `gain` over the
        calibration tokens (channel c, which it does not read, left out)."""
        e = x.pow(2).sum(-1)
        if self.c >= 0:
            e = e - x[:, self.c].pow(2)
        return _grid(gain / math.sqrt(max(float(e.mean()), 1e-12)))

    def _out_std(self, h: torch.Tensor, energy: torch.Tensor | None = None) -> float:
        """Std of an output projection whose input is h ([N, in]) so that each output channel gets
        variance self.out_var over the calibration tokens (energy: per-token sum of h^2, if given)."""
        e = float((h.pow(2).sum(-1) if energy is None else energy).mean())
        return _grid(math.sqrt(self.out_var / max(e, 1e-12)))

    def _const(self, name: str, n: int, value: float) -> Iterator[Chunk]:
        yield name, 0, torch.full((n,), value, dtype=self.dtype)

    def _linear(self, name: str, rows: int, cols: int, std: float, x: torch.Tensor | None, *,
                zero_col: int = -1, zero_row: int = -1, align: int = 1,
                plant: Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                basis: torch.Tensor | None = None, out: torch.Tensor | None = None,
                row_scale: torch.Tensor | None = None) -> Iterator[Chunk]:
        """Yield a random [rows, cols] weight in chunks; return y = x @ W^T ([N, rows], or None; written
        into `out` when given).
        basis ([k, cols], orthonormal rows): each row is a random combination of the basis rows
        carrying 1 - gate_noise of its expected energy, plus isotropic noise carrying the rest.
        row_scale ([rows]): row i multiplied by row_scale[i]."""
        y = None if x is None else (torch.empty(x.shape[0], rows) if out is None else out)
        per = self._rows_per_chunk(rows, cols, align)
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            w32 = None  # w in float32 (the forward's operand), when x is given
            if basis is None and x is not None:
                w, w32 = self.pool.normal((r1 - r0, cols), std, self.rng, with_float=True)
            elif basis is None:
                w = self.pool.normal((r1 - r0, cols), std, self.rng)
            else:
                k = basis.shape[0]
                coef = self.pool.normal((r1 - r0, k), 1.0, self.rng).float()  # [rows, k]
                low = (coef * (std * math.sqrt((1 - self.gate_noise) * cols / k))) @ basis  # [rows, cols]
                noise = self.pool.normal((r1 - r0, cols), 1.0, self.rng).float() * (std * math.sqrt(self.gate_noise))
                w = (low + noise).to(self.dtype)
            if row_scale is not None:
                w = (w.float() * row_scale[r0:r1, None]).to(self.dtype)
                w32 = None
            if x is not None and w32 is None:
                w32 = w.float()
            for m in (w, w32) if w32 is not None else (w,):
                if zero_col >= 0:
                    m[:, zero_col] = 0
                if r0 <= zero_row < r1:
                    m[zero_row - r0] = 0
            if x is not None:
                yc = x @ w32.T
                if plant is not None:
                    yc = plant(r0, r1, w, yc)
                y[:, r0:r1] = yc
            yield name, r0, w
        return y

    def _experts(self, names: list[str], rows: int, cols: int, std: float, xs: torch.Tensor, bounds: list[int],
                 out: torch.Tensor, *, zero_col: int = -1, zero_row: int = -1) -> Iterator[Chunk]:
        """One stack's expert matrices, expert e = one `_linear(names[e], rows, cols, std, xs[b_e], out=out[b_e])`
        with b_e = bounds[e]:bounds[e + 1], the same bytes and products: the pool offsets are drawn in the same
        order, the copies (numpy, no GIL) run EXPERT_GROUP matrices at a time in threads, one group ahead, and
        the products stay on this thread in expert order (torch runs each on all cores). A MoE layer's 3 x E
        matrices were copied one by one: on a 16-core host most of a generated layer's time."""
        if self._rows_per_chunk(rows, cols) < rows or self.dtype == torch.float32:  # not one chunk each
            for e, name in enumerate(names):
                yield from self._linear(name, rows, cols, std, xs[bounds[e]:bounds[e + 1]], zero_col=zero_col,
                                        zero_row=zero_row, out=out[bounds[e]:bounds[e + 1]])
            return
        pool = self.pool._pool(std)
        image = self.pool._image(std, pool)
        n = rows * cols
        offsets = [self.pool.offsets(n, self.rng) for _ in names]

        def build(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            w = self.pool.as_tensor(self.pool.gather(pool, offsets[e], np.empty(n, dtype=pool.dtype)), (rows, cols))
            w32 = torch.from_numpy(self.pool.gather(image, offsets[e], np.empty(n, dtype=np.float32))).view(rows, cols)
            for m in (w, w32):
                if zero_col >= 0:
                    m[:, zero_col] = 0
                if 0 <= zero_row < rows:
                    m[zero_row] = 0
            return w, w32

        groups = [range(g, min(len(names), g + EXPERT_GROUP)) for g in range(0, len(names), EXPERT_GROUP)]
        with ThreadPoolExecutor(min(EXPERT_GROUP, os.cpu_count() or 1)) as ex:
            ahead = [ex.submit(build, e) for e in groups[0]]
            for i, group in enumerate(groups):
                done, ahead = ahead, [ex.submit(build, e) for e in (groups[i + 1] if i + 1 < len(groups) else ())]
                for e, job in zip(group, done):
                    w, w32 = job.result()
                    b0, b1 = bounds[e], bounds[e + 1]
                    out[b0:b1, 0:rows] = xs[b0:b1] @ w32.T
                    del w32
                    yield names[e], 0, w

    # -- the model -------------------------------------------------------------------

    def chunks(self) -> Iterator[Chunk]:
        s = self.s
        B, T = self.tokens.shape
        flat = self.tokens.reshape(-1)
        resid = torch.zeros(B * T, s.hidden)
        if s.family == "opt":
            yield from self._embedding("model.decoder.embed_tokens.weight", flat, resid, 1.0, -1)
            pos = torch.arange(T).repeat(B) + 2
            yield from self._embedding("model.decoder.embed_positions.weight", pos, resid, 0.5, -1,
                                       rows=s.context + 2)
            for layer in range(s.layers):
                yield from self._opt_layer(layer, resid)
            yield from self._const("model.decoder.final_layer_norm.weight", s.hidden, 1.0)
            yield from self._const("model.decoder.final_layer_norm.bias", s.hidden, 0.0)
            return
        yield from self._embedding("model.embed_tokens.weight", flat, resid, 1.0, self.c)
        for layer in range(s.layers):
            yield from self._llama_layer(layer, resid)
        yield from self._const("model.norm.weight", s.hidden, 1.0)
        std = self._in_std(rmsnorm(resid, s.norm_eps), LOGIT_STD)
        yield from self._linear("lm_head.weight", s.vocab, s.hidden, std, None, zero_col=self.c)

    def _embedding(self, name: str, ids: torch.Tensor, resid: torch.Tensor, std: float, c: int,
                   rows: int | None = None) -> Iterator[Chunk]:
        """Random rows (channel c set to A when c >= 0); adds the rows of `ids` to resid."""
        rows = rows or self.s.vocab
        per = self._rows_per_chunk(rows, self.s.hidden)
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            w = self.pool.normal((r1 - r0, self.s.hidden), std, self.rng)
            if c >= 0:
                w[:, c] = self.A
            sel = (ids >= r0) & (ids < r1)
            resid[sel] += w[ids[sel] - r0].float()
            yield name, r0, w

    def _attention(self, p: str, layer: int, x: torch.Tensor, resid: torch.Tensor, qk_norm: bool, bias: bool,
                   names: tuple[str, str, str, str]) -> Iterator[Chunk]:
        s = self.s
        B, T = self.tokens.shape
        H, K, Dh = s.heads, s.kv_heads, s.head_dim
        c = self.c
        sqk, sv = self._in_std(x, QK_STD), self._in_std(x)
        q = yield from self._linear(p + names[0], H * Dh, s.hidden, sqk, x, zero_col=c, align=Dh)
        k = yield from self._linear(p + names[1], K * Dh, s.hidden, sqk, x, zero_col=c, align=Dh)
        v_scale = None
        if s.act == "silu":  # o's input Laplacian-like (see the module help): each v channel's variance ~ Exp(1)
            gen = np.random.default_rng([self.seed, 7, layer])
            v_scale = torch.from_numpy(np.sqrt(gen.exponential(1.0, K * Dh))).float()
        v = yield from self._linear(p + names[2], K * Dh, s.hidden, sv, x, zero_col=c, row_scale=v_scale)
        if bias:  # OPT: zero q/k/v biases (written after the three weights: GGUF's fused qkv bias)
            for n in ("q", "k", "v"):
                yield from self._const(f"{p}self_attn.{n}_proj.bias", H * Dh if n == "q" else K * Dh, 0.0)
        q, k, v = q.view(B, T, H, Dh), k.view(B, T, K, Dh), v.view(B, T, K, Dh)
        if qk_norm:  # Qwen3: RMSNorm per head (weights 1) before the rotary embedding
            yield from self._const(p + "self_attn.q_norm.weight", Dh, 1.0)
            yield from self._const(p + "self_attn.k_norm.weight", Dh, 1.0)
            q, k = rmsnorm(q, s.norm_eps), rmsnorm(k, s.norm_eps)
        if s.family != "opt":
            q, k = rope(q, s.rope_theta), rope(k, s.rope_theta)
        a = attention(q, k, v, Dh**-0.5).reshape(B * T, H * Dh)
        o = yield from self._linear(p + names[3], s.hidden, H * Dh, self._out_std(a), a, zero_row=c)
        resid += o
        if bias:
            yield from self._const(p + "self_attn.out_proj.bias", s.hidden, 0.0)

    def _llama_layer(self, layer: int, resid: torch.Tensor) -> Iterator[Chunk]:
        s = self.s
        p = f"model.layers.{layer}."
        yield from self._const(p + "input_layernorm.weight", s.hidden, 1.0)
        x = rmsnorm(resid, s.norm_eps)
        yield from self._attention(p, layer, x, resid, s.family == "qwen3_moe", False,
                                   ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                    "self_attn.v_proj.weight", "self_attn.o_proj.weight"))
        yield from self._const(p + "post_attention_layernorm.weight", s.hidden, 1.0)
        x = rmsnorm(resid, s.norm_eps)
        xc = x[:, self.c].clone()
        note = {"layer": layer, "x_c_mean": float(xc.mean()), "x_c_rel_std": float(xc.std() / xc.mean())}
        self.layer_notes.append(note)
        if s.moe:
            out = yield from self._moe(p, layer, x, xc)
        else:
            out = yield from self._gated_ffn(p, layer, x, xc)
        resid += out

    def _neuron_targets(self, layer: int) -> np.ndarray:
        """This layer's firing probability per neuron: the power law, randomly permuted."""
        perm = np.random.default_rng([self.seed, 3, layer]).permutation(self.s.ffn)
        return self.probs[perm]

    def _bias_planter(self, p_target: np.ndarray, xc: torch.Tensor | None):
        """Returns plant(r0, r1, w, y) that solves each neuron's bias from y = its bias-free
        pre-activation over the calibration tokens ([N, r1-r0]) and writes it (into w's column c, or
        into self._bias for OPT); returns y with the bias added."""
        z_all = torch.special.ndtri(torch.from_numpy(p_target)).float()  # Phi^-1

        def plant(r0: int, r1: int, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            mu, sd = y.mean(0), y.std(0).clamp_min(1e-12)
            b = sd * z_all[r0:r1] - mu
            if xc is None:  # OPT: a real bias
                bq = b.to(self.dtype)
                self._bias[r0:r1] = bq
                return y + bq.float()[None, :]
            w[:, self.c] = _solve_gate_bias(y, xc, z_all[r0:r1]).to(self.dtype)
            return y + xc[:, None] * w[:, self.c].float()[None, :]

        return plant

    def _gated_ffn(self, p: str, layer: int, x: torch.Tensor, xc: torch.Tensor) -> Iterator[Chunk]:
        s, c = self.s, self.c
        relu = s.act == "relu"  # SwiGLU: no planted firing, isotropic gate rows
        plant = self._bias_planter(self._neuron_targets(layer), xc) if relu else None
        si = self._in_std(x)
        g = yield from self._linear(p + "mlp.gate_proj.weight", s.ffn, s.hidden, si, x, zero_col=c,
                                    plant=plant, basis=self._gate_basis(layer) if relu else None)
        u = yield from self._linear(p + "mlp.up_proj.weight", s.ffn, s.hidden, si, x, zero_col=c)
        h = (torch.relu(g) if relu else F.silu(g)) * u
        out = yield from self._linear(p + "mlp.down_proj.weight", s.hidden, s.ffn, self._out_std(h), h, zero_row=c)
        return out

    def _opt_layer(self, layer: int, resid: torch.Tensor) -> Iterator[Chunk]:
        s = self.s
        p = f"model.decoder.layers.{layer}."
        yield from self._const(p + "self_attn_layer_norm.weight", s.hidden, 1.0)
        yield from self._const(p + "self_attn_layer_norm.bias", s.hidden, 0.0)
        x = F.layer_norm(resid, (s.hidden,), eps=1e-5)
        yield from self._attention(p, layer, x, resid, False, True,
                                   ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                    "self_attn.v_proj.weight", "self_attn.out_proj.weight"))
        yield from self._const(p + "final_layer_norm.weight", s.hidden, 1.0)
        yield from self._const(p + "final_layer_norm.bias", s.hidden, 0.0)
        x = F.layer_norm(resid, (s.hidden,), eps=1e-5)
        self._bias = torch.empty(s.ffn, dtype=self.dtype)
        plant = self._bias_planter(self._neuron_targets(layer), None)
        g = yield from self._linear(p + "fc1.weight", s.ffn, s.hidden, self._in_std(x), x, plant=plant,
                                    basis=self._gate_basis(layer))
        yield p + "fc1.bias", 0, self._bias
        h = torch.relu(g)
        out = yield from self._linear(p + "fc2.weight", s.hidden, s.ffn, self._out_std(h), h)
        yield from self._const(p + "fc2.bias", s.hidden, 0.0)
        resid += out
        self.layer_notes.append({"layer": layer})

    # -- MoE -------------------------------------------------------------------------

    def _expert_targets(self, layer: int) -> np.ndarray:
        perm = np.random.default_rng([self.seed, 4, layer]).permutation(self.s.experts)
        return self.shares[perm]

    def _fit_router_bias(self, logits: torch.Tensor, xc: torch.Tensor, target: np.ndarray, layer: int
                         ) -> torch.Tensor:
        """Router weights w on the constant channel such that top-k of (logits + w * x_c) routes each
        expert its target share. Fitted on 8192 synthetic tokens drawn from the normal distribution
        with the mean and covariance of (logits, x_c) over the calibration tokens."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small tensors: threads only add latency (a lot, on a busy machine)
        try:
            return self._fit_router_bias_1(logits, xc, target, layer)
        finally:
            torch.set_num_threads(threads)

    def _fit_router_bias_1(self, logits: torch.Tensor, xc: torch.Tensor, target: np.ndarray, layer: int
                           ) -> torch.Tensor:
        k = self.s.top_k
        n, E = logits.shape
        gen = torch.Generator().manual_seed(int(np.random.default_rng([self.seed, 5, layer]).integers(2**62)))
        joint = torch.cat([logits, xc[:, None]], 1)
        mean = joint.mean(0)
        z = torch.randn(8192, n, generator=gen) / math.sqrt(max(n - 1, 1))
        sample = mean + z @ (joint - mean)  # [M, E + 1]
        logit, scale = sample[:, :E], (sample[:, E:] / mean[E]).clamp_min(0.5)  # x_c relative to its mean
        want = torch.from_numpy(target).float()
        spread = float(logit.std(0).mean()) or 1.0
        floor = 0.25 / (len(logit) * k)
        b = torch.zeros(E)
        for it in range(50):
            eff = logit + scale * b
            # each token's k-th largest effective logit: numpy's partition gives topk's value 7x faster
            # ([8192, 128], k 8: 2.9 against 22 ms; 50 iterations a MoE layer)
            kth = torch.from_numpy(np.partition(eff.numpy(), E - k, axis=-1)[:, E - k:E - k + 1])
            got = (eff >= kth).float().mean(0) / k
            step = spread * 0.5 * 0.92**it
            b += step * (torch.log(want) - torch.log(got.clamp_min(floor)))
            b -= b.mean()
        return b / mean[E]

    def _moe(self, p: str, layer: int, x: torch.Tensor, xc: torch.Tensor) -> Iterator[Chunk]:
        s, c = self.s, self.c
        E, k = s.experts, s.top_k
        mixtral = s.family == "mixtral"
        moe = p + ("block_sparse_moe." if mixtral else "mlp.")
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        target = self._expert_targets(layer)

        def plant(r0: int, r1: int, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            assert (r0, r1) == (0, E)
            w[:, c] = self._fit_router_bias(y, xc, target, layer).to(self.dtype)
            return y + xc[:, None] * w[:, c].float()[None, :]

        si = self._in_std(x)
        logits = yield from self._linear(moe + "gate.weight", E, s.hidden, si, x, zero_col=c, plant=plant)
        probs = torch.softmax(logits, -1)
        weights, ids = torch.topk(probs, k, -1)
        weights = weights / weights.sum(-1, keepdim=True)  # mixtral and qwen3-moe renormalise
        # Routings grouped by expert, each expert's tokens in token order (what torch.nonzero(ids == e)
        # gives), with each token's routings sorted by expert: the per-expert products run on contiguous
        # slices of one gathered input, and each token's outputs are summed in expert order by a reshape
        # (no per-expert gather or index_add_, which loops over rows).
        ids, perm = ids.sort(-1)
        weights = weights.gather(1, perm)
        N = x.shape[0]
        order = torch.argsort(ids.reshape(-1), stable=True)  # sorted routing -> flat routing (t * k + j)
        tok = order // k
        bounds = [0, *np.cumsum(torch.bincount(ids.reshape(-1), minlength=E).tolist())]
        xs = x[tok]  # [N k, D]
        gu = []
        for m in range(2):
            buf = torch.empty(N * k, s.ffn)
            yield from self._experts([f"{moe}experts.{e}.{names[m]}.weight" for e in range(E)], s.ffn, s.hidden, si,
                                     xs, bounds, buf, zero_col=c)
            gu.append(buf)
        hs = F.silu(gu[0]).mul_(gu[1])  # [N k, I], sorted routings
        del gu, xs
        ws = weights.reshape(-1)[order]  # routing weight per sorted routing
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(N * k)
        energy = (hs.pow(2).sum(-1) * ws.pow(2))[unsort].view(N, k).sum(1)
        std = self._out_std(x, energy)
        ys = torch.empty(N * k, s.hidden)
        yield from self._experts([f"{moe}experts.{e}.{names[2]}.weight" for e in range(E)], s.hidden, s.ffn, std,
                                 hs, bounds, ys, zero_row=c)
        ys.mul_(ws[:, None])
        out = ys[unsort].view(N, k, s.hidden).sum(1)
        share = torch.bincount(ids.reshape(-1), minlength=E).double() / ids.numel()
        self.layer_notes[-1]["calib_top25_share"] = _top_share(share.numpy())
        return out


def _solve_gate_bias(y: torch.Tensor, xc: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Per neuron, the weight w on the constant channel such that y + w * x_c > 0 on a fraction
    Phi(z) of tokens, with (y, x_c) modelled as jointly normal over the calibration tokens
    (y: [N, n], x_c: [N], z: [n]): (mu + w m) / sqrt(s2 + 2 w cov + w^2 v) = z, a quadratic in w."""
    y, xc = y.double(), xc.double()
    mu, s2 = y.mean(0), y.var(0).clamp_min(1e-24)
    m, v = xc.mean(), xc.var()
    cov = ((y - mu) * (xc - m)[:, None]).mean(0) * len(xc) / max(len(xc) - 1, 1)
    z = z.double()
    a = m * m - z * z * v  # > 0: x_c varies by a few percent only
    b = 2 * (mu * m - z * z * cov)
    c = mu * mu - z * z * s2
    root = torch.sqrt((b * b - 4 * a * c).clamp_min(0))
    w = torch.where(z >= 0, (-b + root) / (2 * a), (-b - root) / (2 * a))
    simple = (z * s2.sqrt() - mu) / m  # x_c taken as constant
    return torch.where(a > 0.5 * m * m, w, simple).float()


def _top_share(share: np.ndarray) -> float:
    top = max(1, math.ceil(len(share) / 4))
    return float(np.sort(share)[::-1][:top].sum())
