"""A small fit with HeteroStrategy(pipeline=...) on CPU ranks; each rank saves its parameters (by name) and the
losses Lightning saw, for tests/pipeline/test_pipeline_multiprocess.py to compare with one process.

    python tests/workers/pipeline_fit.py --out DIR --devices 2 --stages 2 [--boundaries 3] [--schedule gpipe]
        [--optimizer adam] [--speeds 1.0,0.4] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_hetero import HeteroMonitor, HeteroStrategy  # noqa: E402

WIDTH, BLOCKS, SAMPLES, FEATURES = 16, 6, 96, 8


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = torch.randn(SAMPLES, 1, generator=generator)
    return TensorDataset(x, y)


class ChainModel(LightningModule):
    """An embedding before the chain, blocks of unequal width, a head and the loss after it."""

    def __init__(
        self, optimizer: str = "sgd", container: str = "sequential", kill: str = "", width: int = WIDTH
    ) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.sync_dist = False
        self.signal_dir: Path | None = None
        self.kill = kill  # "RANK:STEP[:freeze]": that rank SIGKILLs (or SIGSTOPs) itself at that step
        self.embed = nn.Linear(FEATURES, width)
        blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(BLOCKS)]
        self.container = container
        self.net = nn.Sequential(*blocks) if container == "sequential" else nn.ModuleList(blocks)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.embed(x))
        if self.container == "sequential":
            x = self.net(x)
        elif self.container == "twice":  # block 1 applied twice: a chain that cannot be split
            x = self.net[1](self.net[1](self.net[0](x)))
            for block in list(self.net)[2:]:
                x = block(x)
        else:
            for block in self.net:
                x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.signal_dir is not None and self.global_step == 3:  # the test signals this rank by its PID
            (self.signal_dir / f"pid_rank{self.global_rank}").write_text(str(os.getpid()))
        if self.kill and [int(v) for v in self.kill.split(":")[:2]] == [self.global_rank, self.global_step]:
            how = signal.SIGSTOP if self.kill.endswith(":freeze") else signal.SIGKILL
            os.kill(os.getpid(), how)
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=self.sync_dist)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss, sync_dist=self.sync_dist)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=self.sync_dist)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        if self.optimizer_name == "adagrad":  # (its state is made for every parameter when it is built)
            return torch.optim.Adagrad(self.parameters(), lr=0.05)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


TOKENS, VOCABULARY, SEQUENCES = 16, 50, 48


def token_dataset() -> TensorDataset:
    """Sequences of random token ids, for the transformers models."""
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, VOCABULARY, (SEQUENCES, TOKENS), generator=generator))


def transformers_model(kind: str) -> tuple[nn.Module, str]:
    """A small GPT-2 or Llama from ``transformers``, built from its config (dropout off), and its chain's path."""
    import transformers

    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCABULARY,
            n_positions=TOKENS,
            n_embd=32,
            n_layer=4,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(config), "model.transformer.h"
    assert kind == "llama", kind
    config = transformers.LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=TOKENS,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config), "model.model.layers"


class LanguageModel(LightningModule):
    """A causal language model from ``transformers``; its loss is the model's own (next-token cross-entropy)."""

    def __init__(self, kind: str, optimizer: str = "sgd") -> None:
        super().__init__()
        self.model, self.chain = transformers_model(kind)
        self.optimizer_name = optimizer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss

    def training_step(self, batch, batch_idx):
        loss = self(batch[0])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, samples: TensorDataset) -> None:
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


class Losses:
    def __init__(self) -> None:
        self.values: list[float] = []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--boundaries", default=None)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--micro-batches", type=int, default=None)
    parser.add_argument("--virtual-stages", type=int, default=None, help="with --schedule interleaved")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--container", default="sequential")
    parser.add_argument("--speeds", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=12, help="the loader's batch (per pipeline)")
    parser.add_argument("--blocks", default="net", help="the chain's attribute as given to the strategy")
    parser.add_argument("--checkpointing", action="store_true", help="Lightning's default ModelCheckpoint on")
    parser.add_argument("--kill", default="", help="RANK:STEP[:freeze]: that rank SIGKILLs (SIGSTOPs) itself there")
    parser.add_argument("--peer-timeout", type=float, default=30.0)
    parser.add_argument("--save-every", type=int, default=0, help="ModelCheckpoint every N steps into OUT/ckpt")
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--val-every", type=int, default=0, help="validate on 2 batches every N steps")
    parser.add_argument("--sync-dist", action="store_true", help="self.log(..., sync_dist=True)")
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--speed-schedule", help="JSON {step: speeds}: emulated speeds that drift")
    parser.add_argument("--rebalance-window", type=int, default=20)
    parser.add_argument("--monitor", action="store_true", help="HeteroMonitor with a CSVLogger in OUT/logs")
    parser.add_argument("--device-precision", help="comma-separated, one per rank")
    parser.add_argument("--signal-test", action="store_true", help="PIDs at step 3, every rank's exit code in OUT")
    parser.add_argument("--iterable", action="store_true", help="train on an IterableDataset")
    parser.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--inf-step", type=int, default=None, help="block 0's first weight gets an inf gradient there")
    parser.add_argument("--zero-stage", type=int, default=None, help="HeteroStrategy(stage=...)")
    parser.add_argument("--shards", default=None, help="HeteroStrategy(shards=...)")
    parser.add_argument("--transformers", choices=["gpt2", "llama"], help="train that transformers model instead")
    parser.add_argument(
        "--evaluate",
        action="store_true",
        help="after the fit, validate, test and predict on the whole dataset: with the fit's Trainer, then with a"
        " freshly built model and a new strategy (blocks placed without boundaries) from the last checkpoint in"
        " OUT/ckpt; each rank's results in OUT/evaluated_rank{r}.pt",
    )
    args = parser.parse_args()
    seed_everything(1, verbose=False)
    if args.transformers:
        model = LanguageModel(args.transformers, args.optimizer)
        args.blocks = model.chain
    else:
        model = ChainModel(args.optimizer, args.container, args.kill, args.width)
        model.sync_dist = args.sync_dist
    if (
        args.inf_step is not None
    ):  # (on the rank whose stage holds block 0 only: the other stages' gradients are finite)
        inf_step = args.inf_step
        model.net[0][0].weight.register_hook(lambda g: g * float("inf") if model.trainer.global_step == inf_step else g)
    pipeline = {"stages": args.stages, "blocks": args.blocks, "schedule": args.schedule}
    if args.boundaries:
        pipeline["boundaries"] = [int(b) for b in args.boundaries.split(",")]
    if args.micro_batches:
        pipeline["micro_batches"] = args.micro_batches
    if args.virtual_stages:
        pipeline["virtual_stages"] = args.virtual_stages
    speeds = [float(s) for s in args.speeds.split(",")] if args.speeds else None
    if args.speed_schedule:
        speeds = {int(k): v for k, v in json.loads(args.speed_schedule).items()}
    callbacks = []
    logger = False
    if args.monitor:
        callbacks.append(HeteroMonitor())
        logger = CSVLogger(str(args.out / "logs"), name="monitor")
    if args.save_every:
        callbacks.append(ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=args.save_every, save_top_k=-1))
    # (--stages 0: data parallel, no pipeline, as a reference)
    strategy = HeteroStrategy(
        stage=args.zero_stage,
        shards=args.shards,
        pipeline=pipeline if args.stages else None,
        emulate_speeds=speeds,
        peer_timeout=args.peer_timeout,
        rebalance_window=args.rebalance_window,
        device_precision=args.device_precision.split(",") if args.device_precision else None,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        gradient_clip_val=args.clip,
        accumulate_grad_batches=args.accumulate,
        enable_checkpointing=args.checkpointing or bool(callbacks),
        callbacks=callbacks,
        logger=logger,
        enable_progress_bar=False,
        default_root_dir=str(args.out),
        enable_model_summary=False,
        limit_val_batches=2 if args.val_every else 0,
        val_check_interval=args.val_every or None,
        num_sanity_val_steps=0,
    )
    data = Stream(dataset()) if args.iterable else token_dataset() if args.transformers else dataset()
    loader = DataLoader(data, batch_size=args.batch, shuffle=False)
    validation = DataLoader(dataset(), batch_size=args.batch, shuffle=False) if args.val_every else None
    if args.signal_test:
        args.out.mkdir(parents=True, exist_ok=True)
        model.signal_dir = args.out
    try:
        trainer.fit(model, loader, validation, ckpt_path=args.ckpt_path)
    except SystemExit as stop:
        if args.signal_test:
            (args.out / f"exit_rank{os.environ.get('LOCAL_RANK', 0)}").write_text(str(stop.code))
        raise
    rank = trainer.global_rank
    args.out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    torch.save(state, args.out / f"rank{rank}.pt")
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    stage = strategy.pipeline.stage if strategy.pipeline else None
    record = {"stage": stage, "metrics": metrics, "replans": strategy.pipeline_replans}
    summary = getattr(trainer.strategy.precision_plugin, "summary", None)  # (a HeteroPrecision's: device_precision)
    record.update(skipped_steps=strategy.skipped_steps, precision=summary() if summary else None)
    names = {id(p): n for n, p in model.named_parameters()}
    record["optimizer_state_names"] = sorted(names[id(p)] for p in trainer.optimizers[0].state if id(p) in names)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    if args.evaluate:
        evaluated = {"after_fit": evaluate(trainer, model, None)}
        (saved,) = sorted((args.out / "ckpt").iterdir())[-1:]
        fresh_model = ChainModel(args.optimizer, args.container, width=args.width)
        fresh_model.sync_dist = args.sync_dist
        fresh = Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=HeteroStrategy(pipeline={"stages": args.stages, "blocks": args.blocks, "schedule": args.schedule}),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(args.out),
        )
        evaluated["from_checkpoint"] = evaluate(fresh, fresh_model, saved)
        torch.save(evaluated, args.out / f"evaluated_rank{rank}.pt")


def evaluate(trainer: Trainer, model: ChainModel, ckpt_path: Path | None) -> dict:
    """validate, test and predict on the whole dataset in the loader's order: what they returned on this rank, and
    the metrics it saw."""
    loader = DataLoader(dataset(), batch_size=12, shuffle=False)
    trainer.limit_val_batches = 1.0
    validated = trainer.validate(model, loader, ckpt_path=ckpt_path, verbose=False)
    validated_seen = {k: float(v) for k, v in trainer.callback_metrics.items()}
    tested = trainer.test(model, loader, ckpt_path=ckpt_path, verbose=False)
    tested_seen = {k: float(v) for k, v in trainer.callback_metrics.items()}
    predicted = trainer.predict(model, loader, ckpt_path=ckpt_path)
    return {
        "validate": validated,
        "validate_seen": validated_seen,
        "test": tested,
        "test_seen": tested_seen,
        "predict": predicted,
        "stage": trainer.strategy.pipeline.stage,
    }


if __name__ == "__main__":
    main()
