"""kt-kernel (kvcache-ai's CPU MoE kernels, PyPI `kt-kernel`) driven for tools/bench_kt_kernel.py.

Every call is written from kt-kernel 0.6.1's Python source (`KTMoEWrapper`, its LLAMAFILE loader,
the MoE objects' `forward_task`); each assumption is checked before loading (`kt_preflight`) or
wrapped so that a failure says the exact call that was tried (`KtError`).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import numpy as np

KT_METHODS = ("LLAMAFILE", "AMXINT4", "AMXINT8")
KT_VERSION = "0.6.1"  # the version whose source the calls below were written from


class KtMissing(Exception):
    """kt-kernel (or torch under it) cannot be imported."""


class KtError(Exception):
    """A kt-kernel call failed; the message says what was tried."""


def dequantised_bf16(layer, E: int, D: int, I: int) -> tuple:
    """The layer's Q4_0 weights dequantised and rounded to bfloat16, shaped as KTMoEWrapper takes them."""
    import torch

    from hotcold.sparse_ops.quant import qdequantize

    g, u, d = (torch.from_numpy(qdequantize(m, bf16=True)).view(torch.bfloat16) for m in layer.packed)
    return g.view(E, I, D), u.view(E, I, D), d.view(E, D, I)



class _Blocks:
    """Stands in for kt-kernel's GGUFLoader (`LlamafileMoEWrapper._gguf_loader_instance`): hands its
    `load_weights` our stacks in the GGUF layout, as `get_undequanted_tensor_and_ggml_type` returns a
    file's tensor (uint8 torch tensor of the blocks, gguf's GGMLQuantizationType)."""

    def __init__(self, layers: list, qtype: str):
        import gguf

        self.layers, self.type = layers, gguf.GGMLQuantizationType[qtype]

    def get_undequanted_tensor_and_ggml_type(self, name: str):
        import torch

        parts = name.split(".")  # blk.{layer}.ffn_{gate|up|down}_exps.weight
        kinds = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in kinds or not parts[1].isdigit():
            raise KeyError(f"unexpected tensor name {name!r} (expected blk.N.ffn_gate|up|down_exps.weight)")
        m = self.layers[int(parts[1])].raw[kinds[parts[2]]]
        return torch.from_numpy(m.data.reshape(-1)), self.type


@contextlib.contextmanager
def _unpinned(torch):
    """Without CUDA, torch.zeros / torch.empty with pin_memory=True fail; KTMoEWrapper's constructor
    pins only its gpu_experts_mask that way (0.6.1), which the task calls made here never copy to a
    GPU: within this block those two calls ignore pin_memory where CUDA is absent."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.zeros, torch.empty

    def plain(fn):
        return lambda *a, pin_memory=False, **kw: fn(*a, **kw)

    torch.zeros, torch.empty = plain(saved[0]), plain(saved[1])
    try:
        yield
    finally:
        torch.zeros, torch.empty = saved


def _tried(fn: str, kwargs: dict) -> str:
    return f"{fn}(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"


class Kt:
    """One kt-kernel method over the layers: a KTMoEWrapper per layer, called through its MoE task."""

    def __init__(self, kt, method: str, layers: list, args, threads: int, workdir: Path):
        import torch

        self.torch, self.name, self.method = torch, f"kt {method}", method
        E, D, I, k = args.experts, args.hidden, args.inter, args.k
        self.k = k
        if method == "LLAMAFILE":
            self.expert_bytes = sum(m.nbytes for m in layers[0].raw) / E
        else:
            bits = 4 if method == "AMXINT4" else 8
            self.expert_bytes = 3 * I * D * bits / 8 + 4 * (2 * I + D)
        path = workdir / method
        path.mkdir(parents=True, exist_ok=True)
        self.wrappers = []
        if method == "LLAMAFILE":
            from kt_kernel.utils.llamafile import LlamafileMoEWrapper

            LlamafileMoEWrapper._gguf_loader_instance = _Blocks(layers, args.qtype)  # (its loader singleton)
        chunk = -(-max(args.tokens) // 32) * 32  # the AMX methods' buffers: a multiple of their M_STEP (32)
        for n, layer in enumerate(layers):
            kw = dict(layer_idx=n, num_experts=E, num_experts_per_tok=k, hidden_size=D, moe_intermediate_size=I,
                      gpu_experts_mask=None, cpuinfer_threads=threads, threadpool_count=args.kt_pools,
                      weight_path=str(path), chunked_prefill_size=chunk, method=method)
            try:
                with _unpinned(torch):
                    wrapper = kt.KTMoEWrapper(**kw)
            except Exception as e:
                raise KtError(f"{_tried('KTMoEWrapper', kw)} raised {type(e).__name__}: {e}") from e
            if method == "LLAMAFILE":
                what = "load_weights() (its GGUF loader replaced by the _Blocks stand-in)"
            else:
                what = (f"load_weights_from_tensors(gate bf16 [{E}, {I}, {D}], up bf16 [{E}, {I}, {D}], down bf16 "
                        f"[{E}, {D}, {I}], torch.arange({E}, dtype=int64)) with weight_path={str(path)!r}")
            try:
                if method == "LLAMAFILE":
                    wrapper.load_weights()  # (identity expert map by default)
                else:
                    if not layer.bf16:
                        layer.bf16 = dequantised_bf16(layer, E, D, I)
                    wrapper.load_weights_from_tensors(*layer.bf16, torch.arange(E, dtype=torch.int64))
            except Exception as e:
                raise KtError(f"{self.name} layer {n}: {what} raised {type(e).__name__}: {e}") from e
            shutil.rmtree(path / f"_layer_{n}", ignore_errors=True)  # AMX's saved copy: it is in memory now
            if getattr(wrapper, "moe", None) is None or not hasattr(wrapper.moe, "forward_task"):
                raise KtError(f"{self.name}: after loading, wrapper.moe is {getattr(wrapper, 'moe', None)!r} "
                              "(expected a MoE object with forward_task)")
            self.wrappers.append(wrapper)
        self.cpu_infer = self.wrappers[0].cpu_infer
        self.bsz = {}

    def prepare(self, n: int, x, ids, w):
        torch = self.torch
        T = x.shape[0]
        if T not in self.bsz:
            self.bsz[T] = torch.tensor([T], dtype=torch.int32)
        xin = torch.from_numpy(x).to(torch.bfloat16).contiguous()
        ids_t, w_t = torch.from_numpy(ids).contiguous(), torch.from_numpy(w).contiguous()
        out = torch.empty_like(xin)
        keep = (xin, ids_t, w_t, out)
        return (self.wrappers[n].moe, self.bsz[T].data_ptr(), ids_t.data_ptr(), w_t.data_ptr(), xin.data_ptr(),
                out.data_ptr(), keep)

    def run(self, p) -> None:
        moe, bsz, ids, w, xin, out, _ = p
        self.cpu_infer.submit(moe.forward_task(bsz, self.k, ids, w, xin, out, False))
        self.cpu_infer.sync()

    def output(self, p) -> np.ndarray:
        return p[6][3].float().numpy()

    def forward_check(self, n: int, x, ids, w, task_out: np.ndarray) -> str:
        """KTMoEWrapper.forward (the public call, through the GPU) on the check input, against the task."""
        torch = self.torch
        if not torch.cuda.is_available():
            return "forward(): not called (no CUDA)"
        try:
            dev = torch.device("cuda")
            stream = torch.cuda.current_stream(dev)
            y = self.wrappers[n].forward(torch.from_numpy(x).to(dev, torch.bfloat16), torch.from_numpy(ids).to(dev),
                                         torch.from_numpy(w).to(dev), stream.cuda_stream)
            torch.cuda.synchronize()
            y = y.float().cpu().numpy()
        except Exception as e:
            return (f"forward(): forward(x cuda bf16 {x.shape}, ids cuda int64, weights cuda float32, "
                    f"torch.cuda.current_stream().cuda_stream) raised {type(e).__name__}: {e}")
        diff = float(np.linalg.norm(y - task_out) / max(np.linalg.norm(task_out), 1e-30))
        return f"forward(): relative difference from the task call {diff:.2g}"

    def close(self) -> None:
        self.wrappers.clear()


def import_kt():
    """kt_kernel, or KtMissing with its import error in one line."""
    try:
        import kt_kernel
    except Exception as e:  # ImportError, OSError (a library or symbol), RuntimeError (its CPU detection)
        raise KtMissing(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
    return kt_kernel


def kt_preflight(kt, methods: list[str], args) -> dict[str, str]:
    """method -> why it cannot run here (the API assumptions this tool makes, checked before loading)."""
    import torch

    bad = {}
    if not hasattr(kt, "KTMoEWrapper"):
        return {m: f"kt_kernel has no KTMoEWrapper (version {getattr(kt, '__version__', '?')})" for m in methods}
    for m in methods:
        try:
            if m == "LLAMAFILE":
                from kt_kernel.utils import llamafile as lf

                if not getattr(lf, "_HAS_LLAMAFILE_SUPPORT", False):
                    bad[m] = "kt_kernel_ext.moe has no MOE (built without llamafile)"
                elif not hasattr(lf.LlamafileMoEWrapper, "_gguf_loader_instance"):
                    bad[m] = "LlamafileMoEWrapper has no _gguf_loader_instance (its GGUF loading changed)"
                elif args.inter % 256:
                    bad[m] = f"moe_intermediate_size {args.inter} is not a multiple of 256 (LLAMAFILE's QK_K)"
                else:
                    import gguf

                    if args.qtype not in gguf.GGMLQuantizationType.__members__:
                        bad[m] = f"gguf has no type {args.qtype}"
            else:
                from kt_kernel.utils import amx

                flag = "_HAS_AMXINT4_SUPPORT" if m == "AMXINT4" else "_HAS_AMXINT8_SUPPORT"
                if not getattr(amx, flag, False):
                    bad[m] = (f"kt_kernel.utils.amx.{flag} is false (variant {getattr(kt, '__cpu_variant__', '?')}: "
                              "built without AVX-512/AMX)")
        except Exception as e:
            bad[m] = f"checking it raised {type(e).__name__}: {e}"
    return bad
