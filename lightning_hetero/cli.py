"""`lightning-hetero`: Lightning's CLI with HeteroStrategy registered first.

Lightning resolves `trainer.strategy: hetero` before any callback entry point could import this package, so a plain
LightningCLI script does not know the name; this entry point imports the package, then hands over to LightningCLI
(subcommands fit, validate, test, predict; any LightningModule or LightningDataModule by `class_path`).
`lightning-hetero plan` is the cluster planner instead (:mod:`lightning_hetero.simulate.command`).
"""

from __future__ import annotations

import os
import sys

import lightning_hetero  # noqa: F401  (registers "hetero" in Lightning's StrategyRegistry)
from lightning_hetero.runtime.quiet import third_party_noise_silenced

DESCRIPTION = (
    "Lightning's CLI with HeteroStrategy registered (`trainer.strategy: hetero`): the subcommands below. And"
    " `lightning-hetero plan`: plan a mixed cluster before using it (`lightning-hetero plan --help`)."
)


def main(args: list[str] | None = None) -> None:
    arguments = sys.argv[1:] if args is None else list(args)
    if arguments[:1] == ["plan"]:
        # Not a LightningCLI subcommand: the cluster planner has its own arguments (lightning-hetero plan --help).
        from lightning_hetero.simulate.command import main as plan

        sys.exit(plan(arguments[1:]))
    from lightning.pytorch.cli import LightningCLI

    # Like `python -m`, let `class_path: mypackage.MyModel` name modules in the working directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # Parsing the arguments imports DeepSpeed (through the strategy's signature) before any strategy exists.
    with third_party_noise_silenced():
        LightningCLI(args=args, save_config_kwargs={"overwrite": True}, parser_kwargs={"description": DESCRIPTION})


if __name__ == "__main__":
    main()
