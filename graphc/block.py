"""ModuleBlock: how a module assigned to a Graph appears to the user.

`self.model` in a Graph is a block: attribute access, indexing of Sequential/ModuleList,
and calls go to the wrapped module, and `.config` is that module's ModuleConfig.
"""
from __future__ import annotations

import torch.nn as nn

from .config import ModuleConfig


class ModuleBlock:
    def __init__(self, module: nn.Module, qualname: str, graph):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_qualname", qualname)
        object.__setattr__(self, "_graph", graph)

    @property
    def config(self) -> ModuleConfig:
        configs = self._graph._module_configs
        if self._qualname not in configs:
            configs[self._qualname] = ModuleConfig(self._qualname, self._graph)
        return configs[self._qualname]

    @property
    def origin(self) -> nn.Module:
        """The wrapped torch module."""
        return self._module

    def _child(self, name: str, child):
        if isinstance(child, nn.Module):
            return ModuleBlock(child, f"{self._qualname}.{name}", self._graph)
        return child

    def __getattr__(self, name: str):
        return self._child(name, getattr(self._module, name))

    def __setattr__(self, name: str, value) -> None:
        setattr(self._module, name, value)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return self._module[idx]
        child = self._module[idx]
        if isinstance(self._module, (nn.Sequential, nn.ModuleList)):
            # the child's own name: a Sequential built from an OrderedDict names them (ViT's
            # encoder.layers["encoder_layer_1"]), so position 1 is not named "1"
            name = list(self._module._modules)[idx]
        else:
            name = str(idx)
        return self._child(name, child)

    def __len__(self) -> int:
        return len(self._module)

    def __iter__(self):
        for name, child in self._module.named_children():
            yield self._child(name, child)

    def __call__(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ModuleBlock({self._qualname}: {type(self._module).__name__})"
