"""The fast tier's device context: streams, events, host buffers, and timing marks.

On CUDA: `compute` is the current stream at build time, `copy` a second stream for the D2H copies
of FFN inputs and masks, host buffers are pinned, and marks are CUDA events. On the CPU device the
same calls run: there are no streams (None), events are None (nothing to wait for), host buffers
are plain tensors, copies are ordinary synchronous copies, and marks are perf_counter floats.
"""

from __future__ import annotations

import contextlib

import torch

from hotcold.executors.stats import now


class FastTier:
    """device/dtype of the fast tier ("GPU"); `timing` enables event marks for statistics."""

    def __init__(self, device: torch.device, dtype: torch.dtype, timing: bool = False):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype
        self.cuda = self.device.type == "cuda"
        self.timing = timing
        self.copy = torch.cuda.Stream(self.device) if self.cuda else None

    @property
    def compute(self):
        """The stream the model's work is queued on (the current one), or None on the CPU."""
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def host_empty(self, shape, dtype=torch.float32) -> torch.Tensor:
        """A host buffer: pinned (page-locked) on CUDA so that async copies are truly async."""
        with torch.inference_mode(False):
            return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def event(self, stream=None):
        """Record a (non-timing) event on stream (default: compute); None on the CPU."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream or self.compute)
        return ev

    def mark(self, stream=None):
        """A timing mark: CUDA event with timing on `stream`, perf_counter on the CPU, None if off."""
        if not self.timing:
            return None
        if not self.cuda:
            return now()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream or self.compute)
        return ev

    def on_copy_stream(self):
        """Context: queue work on the copy stream after what the compute stream has queued so far."""
        if not self.cuda:
            return contextlib.nullcontext()
        self.copy.wait_stream(self.compute)
        return torch.cuda.stream(self.copy)

    def wait(self, event) -> None:
        """Make the compute stream wait for event (no host blocking); no-op for None."""
        if event is not None:
            self.compute.wait_event(event)
