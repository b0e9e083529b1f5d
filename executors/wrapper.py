"""BlockWrapper: the base of modules that take a Block's place in model.layers and run it their way
(GraphedBlock, HostBlock), keeping the block itself as `.block`."""

from __future__ import annotations

from torch import nn


class BlockWrapper(nn.Module):
    """Holds `block` and gives read access to its modules and attributes (wrapper.attn, wrapper.ffn,
    ...), so that code written for a Block reads the wrapper alike; assign to `.block.<name>` instead."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "block" not in modules:
                raise
            return getattr(modules["block"], name)


__all__ = ["BlockWrapper"]
