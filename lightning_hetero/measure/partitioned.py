"""Measure: the profile of a ZeRO-3 model whose parameters are partitioned.

Under ZeRO-3 a model built in ``configure_model`` is created partitioned (``deepspeed.zero.Init``: each rank holds a
slice, the parameters themselves are empty), and a ``validate`` or ``test`` leaves it so, with the hooks of that
call's DeepSpeed engine on its modules. The profile runs the plain module (:mod:`.profiler`), so for its duration
every rank gathers the whole parameters (a collective: the caller runs it once the ranks have agreed to profile) and
the hooks an earlier engine left are dropped: they fetch and release parameters through that engine's coordinator,
and running them outside its steps left the trace of the next engine's coordinator broken ("pop from an empty deque"
at the fit's first step). The fit's own engine registers its hooks afresh, as each of DeepSpeedStrategy's
validate/test calls does after removing the module's hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# Where torch keeps a module's forward hooks (and the flags some of them carry), by hook id.
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def partitioned_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters ZeRO-3 has partitioned (DeepSpeed marks them with ``ds_id``)."""
    return [p for p in module.parameters() if hasattr(p, "ds_id")]


@contextlib.contextmanager
def whole_parameters(module: torch.nn.Module) -> Iterator[None]:
    """``module``'s partitioned parameters whole on this rank for the block (every rank must enter it: all-gather),
    and an earlier engine's hooks gone. Leaving it partitions them again, without a collective."""
    import deepspeed

    drop_deepspeed_hooks(module)
    with deepspeed.zero.GatheredParameters(partitioned_parameters(module), modifier_rank=None):
        yield


def drop_deepspeed_hooks(module: torch.nn.Module) -> int:
    """Remove the forward hooks DeepSpeed registered on ``module`` and its submodules (the user's stay); returns
    how many."""
    dropped = 0
    for submodule in module.modules():
        for table in _HOOK_TABLES:
            hooks: dict[int, Any] = getattr(submodule, table)
            for hook_id in [key for key, hook in hooks.items() if _is_deepspeeds(hook)]:
                del hooks[hook_id]
                for flags in _HOOK_FLAGS:
                    getattr(submodule, flags, {}).pop(hook_id, None)
                dropped += 1
    return dropped


def _is_deepspeeds(hook: Any) -> bool:
    return (getattr(hook, "__module__", None) or "").split(".")[0] == "deepspeed"
