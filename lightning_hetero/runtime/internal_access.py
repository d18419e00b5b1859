"""Runtime: one private name of Lightning, DeepSpeed or torch (:class:`Internal`) and the means to reach it:
:func:`resolve` it, :func:`replace` it for good, or swap it for a block (:func:`patched`).

The names themselves are listed by library (:mod:`.lightning_internals`, :mod:`.deepspeed_internals`,
:mod:`.torch_internals`) and gathered in :mod:`.internals`; this module holds only what every list and every patch
site shares, so that a patch site need not import the lists of the other libraries.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Internal:
    module: str  # where the name lives
    # Attribute path inside the module: "Class.method"; "Class().attribute" for an attribute that a new instance has;
    # "Class#attribute" for one the class's code sets on its instances (``self.attribute = ...``) where an instance
    # cannot be made without a whole run (DeepSpeed's engine and optimizers).
    name: str
    use: str  # "patched" (replaced for a while), "read" or "called"
    by: str  # the package module that uses it
    why: str
    undone: str = ""  # where a patch is put back


def resolve(internal: Internal) -> Any:
    """The object ``internal`` names; AttributeError or ImportError when this version no longer has it.

    For ``Class#attribute``: the class, once its code (or a base class's) is seen to set ``self.attribute``."""
    target: Any = importlib.import_module(internal.module)
    path, _, instance_attribute = internal.name.partition("#")
    for part in path.split("."):
        if part.endswith("()"):  # an attribute that instances get in __init__: look at a new instance
            target = getattr(target, part[:-2])()
        else:
            target = getattr(target, part)
    if instance_attribute and not _sets_on_instances(target, instance_attribute):
        raise AttributeError(f"{target.__qualname__} no longer sets `self.{instance_attribute}`")
    return target


def _sets_on_instances(cls: type, attribute: str) -> bool:
    pattern = re.compile(rf"\bself\.{re.escape(attribute)}\s*(?::[^=]*)?=[^=]")
    for klass in cls.__mro__:
        with contextlib.suppress(OSError, TypeError):  # builtins and C types have no source
            if pattern.search(inspect.getsource(klass)):
                return True
    return False


def replace(internal: Internal, replacement: Any) -> None:
    """Put ``replacement`` where ``internal`` (a module-level name) was, for good."""
    *path, name = internal.name.split(".")
    owner: Any = importlib.import_module(internal.module)
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, replacement)


@contextlib.contextmanager
def patched(internal: Internal, replacement: Any) -> Iterator[None]:
    """``internal`` (a module-level name or a class attribute) replaced by ``replacement`` inside the block."""
    owner: Any = importlib.import_module(internal.module)
    *path, name = internal.name.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)
