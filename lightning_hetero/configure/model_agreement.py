"""Configure: the check that every rank built the same model: each parameter's and buffer's name, shape, dtype and
``requires_grad``, compared between ranks and the first difference said in words.

Kept apart from :mod:`.deepspeed_config`: it reads the model, not the config, though both are checked across ranks
before the engine is built (a rank-dependent layer makes the gradient exchange mismatch or hang).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

# A placeholder module's attribute: the signature (:func:`model_signature`) of the part it stands in for, which
# another rank holds (a pipeline's stage keeps its own blocks only: :class:`~lightning_hetero.pipeline.chain.
# ElsewhereBlock`). The ranks of a split model then still compare as the whole model they hold between them.
STANDS_IN_FOR = "stands_in_for"


def model_signature(module: Any) -> list[tuple[str, str, tuple[int, ...], str, bool]]:
    """What must be the same on every rank for their collectives to line up: each parameter's and buffer's name,
    shape (the full one of a ZeRO-3 partitioned parameter), dtype and ``requires_grad``, in module order (that of
    ``named_parameters()``, then ``named_buffers()``); a placeholder (:data:`STANDS_IN_FOR`) gives its part's."""
    entries: list[tuple[str, str, tuple[int, ...], str, bool]] = []
    for kind in ("parameter", "buffer"):
        seen: set[int] = set()  # (a tensor shared by two modules counts once, as named_parameters() has it)
        for prefix, submodule in module.named_modules():
            stands_in_for = getattr(submodule, STANDS_IN_FOR, None)
            if stands_in_for is not None:
                entries.extend(
                    (kind, f"{prefix}.{name}" if prefix else name, tuple(shape), dtype, requires_grad)
                    for entry_kind, name, shape, dtype, requires_grad in stands_in_for
                    if entry_kind == kind
                )
                continue
            named = (
                submodule.named_parameters(recurse=False)
                if kind == "parameter"
                else submodule.named_buffers(recurse=False)
            )
            for name, tensor in named:
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                shape = tuple(getattr(tensor, "ds_shape", None) or tensor.shape)
                entries.append(
                    (
                        kind,
                        f"{prefix}.{name}" if prefix else name,
                        tuple(int(n) for n in shape),
                        str(tensor.dtype),
                        bool(tensor.requires_grad),
                    )
                )
    return entries


def model_disagreement(signatures: Sequence[Sequence[Sequence[Any]]]) -> Optional[str]:
    """The first difference between rank 0's model and another rank's (see :func:`model_signature`), in words;
    None when every rank has the same model."""
    reference = [tuple(entry) for entry in signatures[0]]
    for rank, signature in enumerate(signatures[1:], start=1):
        other = [tuple(entry) for entry in signature]
        if other != reference:
            return (
                f"HeteroStrategy: the ranks' models differ: {_first_difference(reference, other, rank)}. Every rank"
                " must build the same model (a size or a layer that depends on the rank makes the gradient exchange"
                " mismatch or hang); build it from the same arguments on every rank."
            )
    return None


def _first_difference(reference: list[tuple], other: list[tuple], rank: int) -> str:
    mine = {entry[:2]: entry for entry in reference}
    theirs = {entry[:2]: entry for entry in other}
    for holder, lacker, entries, others in ((0, rank, reference, theirs), (rank, 0, other, mine)):
        for kind, name, *_ in entries:
            if (kind, name) not in others:
                return f"rank {holder} has {kind} `{name}`, which rank {lacker} lacks"
    for key, entry in mine.items():
        differs = [
            f"{field} {a!r} on rank 0, {b!r} on rank {rank}"
            for field, a, b in zip(("shape", "dtype", "requires_grad"), entry[2:], theirs[key][2:])
            if a != b
        ]
        if differs:
            return f"{key[0]} `{key[1]}` has {'; '.join(differs)}"
    first = next(index for index, (a, b) in enumerate(zip(reference, other)) if a != b)
    return (
        f"the same tensors in another order: position {first} is {reference[first][0]} `{reference[first][1]}` on"
        f" rank 0, {other[first][0]} `{other[first][1]}` on rank {rank}"
    )
