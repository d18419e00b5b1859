"""Train: the pipeline's contract with the user's module: the chain of blocks found and checked, and this rank's
stage installed in it (``HeteroStrategy(pipeline={"stages": S, "blocks": "net"})``).

The contract. The LightningModule holds a chain of blocks at the attribute ``blocks`` (an ``nn.Sequential``, or a
``ModuleList`` / ``ModuleDict`` that its forward applies in order), and ``training_step`` is unchanged. Stage ``s``
holds blocks ``boundaries[s-1] .. boundaries[s]-1`` (:mod:`.placement`); the others are replaced in the
chain by :class:`ElsewhereBlock`, which holds nothing, so the rank's ``state_dict()`` names its blocks under their
own names (``net.3.weight``). Every stage runs the user's ``training_step`` on every micro-batch of its pipeline:

- what comes before the chain (an embedding) runs on every stage; on the first stage its output enters the chain, on
  the others the input that the stage receives from the previous one replaces it;
- the stage's first block takes the previous stage's output (received before the step, outside the emulated compute);
- the stage's last block, on every stage but the last, hands its output over (:class:`HandOff`): the rest of
  ``training_step`` (the head, the loss, its ``self.log`` calls) runs only on the last stage, which returns the loss;
- the backward runs from the loss on the last stage and from the gradient received for the output on the others.

What cannot be split is refused with the attribute named: a chain that is not a Sequential/ModuleList/ModuleDict, a
block applied out of order or twice, a stage output that is not one tensor. A skip connection from one stage's block
to a later stage's is not detected (the later stage would use its own, discarded, value): the chain's blocks must pass
everything on through their output.

Apart from the schedule that runs the stages (:mod:`lightning_hetero.pipeline.stage`): what is accepted of the user's
module, and how a stage sits in it, can be read (and tested) without any process group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

from torch import Tensor, nn

from lightning_hetero.configure.model_agreement import model_signature
from lightning_hetero.pipeline.options import PipelineChoice
from lightning_hetero.pipeline.placement import check_boundaries

CHAINS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class HandOff(Exception):
    """Raised by a stage's last block on every stage but the last: the rest of ``training_step`` is not this rank's."""

    def __init__(self, output: Any) -> None:
        super().__init__("pipeline hand-off")
        self.output = output


def find_chain(module: nn.Module, path: str) -> tuple[nn.Module, list[str]]:
    """The container at ``path`` and its blocks' names, in order; raised naming the attribute when there is none."""
    owner: Any = module
    for depth, part in enumerate(path.split(".")):
        if not hasattr(owner, part):
            children = [name for name, _ in owner.named_children()] if isinstance(owner, nn.Module) else []
            where = type(owner).__name__ if depth == 0 else ".".join(path.split(".")[:depth])
            raise ValueError(
                f"HeteroStrategy(pipeline=...): `blocks` {path!r}: {where} has no attribute {part!r} (its modules:"
                f" {children}). Name the attribute that holds the chain of blocks."
            )
        owner = getattr(owner, part)
    if not isinstance(owner, CHAINS):
        raise ValueError(
            f"HeteroStrategy(pipeline=...): `blocks` {path!r} is a {type(owner).__name__}, not a chain the strategy"
            " can split: hold the blocks in an nn.Sequential, or an nn.ModuleList / nn.ModuleDict that the forward"
            " applies in order."
        )
    names = list(owner._modules.keys())
    if not names:
        raise ValueError(f"HeteroStrategy(pipeline=...): `blocks` {path!r} holds no blocks.")
    return owner, names


def block_of(chain: nn.Module, name: str) -> nn.Module:
    """The block ``name`` of ``chain`` (torch types a module's children as Optional; a chain's blocks are set)."""
    block = chain._modules[name]
    assert block is not None
    return block


def check_chain_shape(
    module: nn.Module, choice: PipelineChoice, stage_kept: bool = False
) -> tuple[nn.Module, list[str]]:
    """The chain exists, and ``stages`` and ``boundaries`` fit its blocks; checked before any collective.
    ``stage_kept``: the strategy keeps the placement of an earlier call with ``pipeline`` (an evaluation after its
    fit), so a chain that call split, each rank holding its own stage's blocks, runs on that placement."""
    chain, names = find_chain(module, choice.blocks)
    elsewhere = [name for name in names if isinstance(chain._modules[name], ElsewhereBlock)]
    if elsewhere and not stage_kept:
        # (placed anew, a rank could be given a block it no longer has, and run its stand-in silently)
        raise ValueError(
            f"HeteroStrategy(pipeline=...): `{choice.blocks}` was split by an earlier pipeline fit on this rank (blocks"
            f" {elsewhere[:5]} are held elsewhere): build the model again and pass the fit's checkpoint"
            " (`trainer.fit(model, ckpt_path=...)`; `validate`, `test` and `predict` run on the Trainer that fitted"
            " it, or likewise with `ckpt_path`), or load a pipeline checkpoint into a whole model with"
            " `lightning_hetero.pipeline.state.whole_model_state(path)`."
        )
    if choice.stages > len(names):
        raise ValueError(
            f"HeteroStrategy(pipeline=...): `stages` {choice.stages} is more than the {len(names)} blocks of"
            f" `{choice.blocks}`; every stage needs at least one block. Use at most {len(names)} stages."
        )
    if choice.boundaries is not None:
        check_boundaries(choice.boundaries, choice.stages, len(names))
    return chain, names


class ElsewhereBlock(nn.Module):
    """A block another stage holds: no parameters; what flows into it flows on (and is replaced by the received
    activation at this stage's first block, or never reached after this stage's last). It keeps the block's
    :func:`~lightning_hetero.configure.model_agreement.model_signature`, so that the ranks of a split model compare as
    the whole model at a later trainer call's setup."""

    def __init__(self, name: str, block: nn.Module) -> None:
        super().__init__()
        self.held_by_another_stage = name
        self.stands_in_for = model_signature(block)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


class StageOfChain:
    """This rank's stage installed in the user's module: blocks of other stages dropped, hooks on its first and last
    block (the received input in, the hand-off out), and a check that the chain runs in order, each block once.

    With the interleaved schedule the stage holds several chunks (``chunks``, contiguous ranges in the chain's order;
    chunk ``v`` is the chain's chunk ``v * stages + stage``): each forward pass runs one of them (:meth:`running`),
    whose first block takes the received input and whose last block hands off; the stage's blocks of earlier chunks
    stand aside during it (their work belongs to their own pass)."""

    def __init__(
        self,
        chain: nn.Module,
        names: Sequence[str],
        owned: Sequence[int],
        stage: int,
        stages: int,
        path: str,
        chunks: Optional[Sequence[range]] = None,
    ):
        self.chain, self.names, self.owned = chain, list(names), list(owned)
        self.chunks = list(chunks) if chunks is not None else [range(self.owned[0], self.owned[-1] + 1)]
        self.stage, self.stages, self.path = stage, stages, path
        self.incoming: Optional[Tensor] = None
        self.active = 0  # the chunk the forward pass under way runs
        self._called: list[int] = []
        self._handles: list[Any] = []
        self._stand_ins: dict[str, ElsewhereBlock] = {}  # (for the blocks of earlier chunks, made once)

    def _global_chunk(self, chunk: int) -> int:
        return chunk * self.stages + self.stage

    def takes_input(self, chunk: int) -> bool:
        """Whether chunk ``chunk``'s first block takes a received input (every chunk but the chain's first)."""
        return self._global_chunk(chunk) > 0

    def hands_off(self, chunk: int) -> bool:
        """Whether chunk ``chunk``'s last block hands off (every chunk but the chain's last)."""
        return self._global_chunk(chunk) < self.stages * len(self.chunks) - 1

    @contextlib.contextmanager
    def running(self, chunk: int) -> Iterator[None]:
        """A forward pass of chunk ``chunk``: the stage's blocks of earlier chunks stand aside (what flows into them
        flows on, and is replaced at this chunk's first block), and are back in place after it."""
        self.active = chunk
        aside = {self.names[i]: block_of(self.chain, self.names[i]) for c in self.chunks[:chunk] for i in c}
        for name, block in aside.items():
            if name not in self._stand_ins:
                self._stand_ins[name] = ElsewhereBlock(name, block)
            self.chain._modules[name] = self._stand_ins[name]
        try:
            yield
        finally:
            for name, block in aside.items():
                self.chain._modules[name] = block
            self.active = 0

    def install(self) -> None:
        for index, name in enumerate(self.names):
            if index not in self.owned and not isinstance(block_of(self.chain, name), ElsewhereBlock):
                self.chain._modules[name] = ElsewhereBlock(name, block_of(self.chain, name))
        self.hook()

    def hook(self) -> None:
        """The order check on every block, the hand-in and hand-off on this stage's first and last; again after
        something removed every module hook (Lightning's DeepSpeed inference setup does, before building the engine
        of `validate`, `test` and `predict`)."""
        self.uninstall()
        for index, name in enumerate(self.names):
            block = block_of(self.chain, name)
            self._handles.append(block.register_forward_pre_hook(self._order_hook(index), with_kwargs=True))
        for chunk, blocks in enumerate(self.chunks):
            first, last = block_of(self.chain, self.names[blocks[0]]), block_of(self.chain, self.names[blocks[-1]])
            if self.takes_input(chunk):
                self._handles.append(first.register_forward_pre_hook(self._take_incoming_for(chunk), with_kwargs=True))
            if self.hands_off(chunk):
                self._handles.append(last.register_forward_hook(self._hand_off_for(chunk)))

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def parameters(self) -> list[nn.Parameter]:
        return [p for i in self.owned for p in block_of(self.chain, self.names[i]).parameters()]

    def pass_starts(self) -> None:
        self._called = []

    def _order_hook(self, index: int) -> Callable[..., None]:
        def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._called and index <= self._called[-1]:
                again = "twice" if index in self._called else "out of order"
                raise ValueError(
                    f"HeteroStrategy(pipeline=...): block {self.names[index]!r} of `{self.path}` ran {again} in one"
                    f" forward (blocks run so far: {[self.names[i] for i in self._called]}). A pipeline needs each"
                    " block applied once, in the chain's order; apply them so, or train without `pipeline`."
                )
            self._called.append(index)

        return check

    def _take_incoming_for(self, chunk: int) -> Callable[..., Any]:
        def take(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            return self._take_incoming(module, args, kwargs) if self.active == chunk else None

        return take

    def _hand_off_for(self, chunk: int) -> Callable[..., None]:
        def hand_off(module: nn.Module, args: tuple, output: Any) -> None:
            if self.active == chunk:
                self._hand_off(module, args, output)

        return hand_off

    def _take_incoming(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.incoming is None:
            raise RuntimeError(
                f"HeteroStrategy(pipeline=...): stage {self.stage}'s first block ran a second time in one micro-batch."
            )
        incoming, self.incoming = self.incoming, None
        if args:
            return (incoming, *args[1:]), kwargs
        first = next(iter(kwargs))
        return args, {**kwargs, first: incoming}

    def _hand_off(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not isinstance(output, Tensor):
            last = self.names[self.chunks[self.active][-1]]
            raise ValueError(
                f"HeteroStrategy(pipeline=...): block {last!r} of `{self.path}` returned a"
                f" {type(output).__name__}; a stage boundary passes one tensor. Put the boundary after a block that"
                " returns a tensor (`boundaries`)."
            )
        raise HandOff(output)
