"""Worker for the multi-process tests: one HeteroStrategy fit on CPU, launched by Lightning on each rank.

Rank 0 writes `result.json` into --out: final parameters (gathered under ZeRO-3), and every rank's sample indices.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    OPTIMIZERS,
    ConfiguredRegressionModule,
    IndexedRegression,
    PaddedTokens,
    RegressionModule,
    TokenModule,
    cpu_deepspeed_strategy,
)
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

from lightning_hetero import HeteroMonitor, HeteroStrategy, launched_layout  # noqa: E402
from lightning_hetero.train.lr_scaling import base_optimizer  # noqa: E402


class ShardedStream(IterableDataset):
    """A stream that shards itself by rank, as an IterableDataset under DDP does: rank r yields the samples whose
    index is r modulo the world size, in order."""

    def __init__(self, dataset, rank: int, world_size: int) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size

    def __iter__(self):
        return (self.dataset[i] for i in range(self.rank, len(self.dataset), self.world_size))


def make_logger(args):
    if args.mlflow is not None:
        from lightning.pytorch.loggers import MLFlowLogger

        return MLFlowLogger(experiment_name="hetero-test", tracking_uri=f"file:{args.mlflow}")
    if args.wandb is not None:
        from lightning.pytorch.loggers import WandbLogger

        return WandbLogger(project="hetero-test", save_dir=str(args.wandb), offline=True)
    return CSVLogger(args.out, name="csv") if args.monitor else False


def failing_step(batch, batch_idx):
    raise RuntimeError("training_step failed on this rank only")


def stalled_collate(collate, seconds):
    """The loader's collate_fn, ``seconds`` late on every batch: a loader that cannot keep up (a sleep, not compute)."""

    def collate_fn(samples):
        time.sleep(seconds)
        return collate(samples)

    return collate_fn


def failing_collate(collate):
    """The loader's collate_fn, raising from the second batch on."""
    calls = []

    def collate_fn(samples):
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("collate_fn failed on this rank only")
        return collate(samples)

    return collate_fn


class LoaderInHook(RegressionModule):
    """Builds its training loader in `train_dataloader()` and counts the calls (BoringModel builds data there)."""

    def __init__(self, loader, **kwargs) -> None:
        super().__init__(**kwargs)
        self.loader = loader
        self.train_dataloader_calls = 0

    def train_dataloader(self):
        self.train_dataloader_calls += 1
        return self.loader


class WritePidWhenTraining(Callback):
    """Each rank writes its PID to `pid_rank<r>` once training has run a few steps (for signal tests)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 3:
            (self.out / f"pid_rank{trainer.global_rank}").write_text(str(os.getpid()))


class HoldUntilFile(Callback):
    """Every rank waits before the batch that begins at global step ``step`` until ``file`` exists (at most 300 s): a
    test can act on a job whose checkpoint of that step is published and whose ranks are idle (kill a node, then let
    the survivors go on). Once the file exists, that step (again, after a resume) passes."""

    def __init__(self, step: int, file: Path) -> None:
        self.step, self.file = step, file

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        deadline = time.monotonic() + 300
        while trainer.global_step == self.step and not self.file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


class FaultInjection(Callback):
    """Rank ``rank`` SIGKILLs itself at global step ``step`` (first attempt only, under torchrun): after the step, or
    while saving that step's checkpoint (after writing its own part, before the checkpoint is published)."""

    def __init__(self, rank: int, step: int, where: str) -> None:
        self.rank, self.step, self.where = rank, step, where

    def applies(self, trainer) -> bool:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        return first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step

    def kill(self) -> None:
        print(f"fault injection: rank {self.rank} SIGKILLs itself at step {self.step} ({self.where})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.where == "step" and self.applies(trainer):
            self.kill()

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.where != "checkpoint":
            return
        engine = trainer.strategy.deepspeed_engine
        save = engine.save_checkpoint

        def save_then_die(*args, **kwargs):
            result = save(*args, **kwargs)
            if self.applies(trainer):
                self.kill()
            return result

        engine.save_checkpoint = save_then_die


class DiskFullFrom(Callback):
    """From global step ``step`` on, this rank's torch.save writes half its bytes and fails as a full disk does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_fit_start(self, trainer, pl_module) -> None:
        save = torch.save

        def save_until_the_disk_is_full(obj, f, *args, **kwargs):
            if trainer.global_step < self.step:
                return save(obj, f, *args, **kwargs)
            with open(f, "wb") as handle:
                handle.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")

        torch.save = save_until_the_disk_is_full


class RecordSteps(Callback):
    """Every rank appends (attempt, step, its sample indices) to `steps.jsonl`: what a killed attempt trained."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        record = {
            "attempt": attempt,
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "indices": batch[2].tolist(),
        }
        with open(self.out / "steps.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")


class RecordEmulatedDelay(Callback):
    """The emulator's delay paid so far, after every training step (to see a drift schedule take effect)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        job = getattr(trainer.strategy, "job", None)  # (None under DDP)
        emulator = job.emulation.emulator if job is not None else None
        pl_module.emulated_delay.append(emulator.added_seconds if emulator is not None else None)


class RecordEveryStep(Callback):
    """After every training step rank 0 appends to `per_step.jsonl`: the largest difference between any rank's
    parameters and its own (gathered under ZeRO-3), its parameters, and the loss scale of per-device precision."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import deepspeed

        parts = []
        for p in pl_module.parameters():
            with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                parts.append(p.detach().double().reshape(-1).clone())
        flat = torch.cat(parts)
        gathered = [torch.empty_like(flat) for _ in range(trainer.world_size)]
        torch.distributed.all_gather(gathered, flat)
        if trainer.is_global_zero:
            plugin = trainer.strategy.precision_plugin
            scale = getattr(plugin, "loss_scale", None)
            record = {
                "step": trainer.global_step,
                "spread": max((other - flat).abs().max().item() for other in gathered),
                "params": flat.tolist(),
                "loss_scale": scale.scale if scale is not None else None,
                "skipped_steps": trainer.strategy.deepspeed_engine.skipped_steps,
            }
            with open(self.out / "per_step.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")


def recording_autocast(model, out: Path, device_type: str):
    """``model.training_step`` that writes, once per rank, whether autocast was on inside it and with which dtype."""
    training_step = model.training_step

    def step_that_records(batch, batch_idx):
        path = out / f"autocast_rank{model.global_rank}.json"
        if not model.trainer.sanity_checking and not path.exists() and model.trainer.global_step >= 1:
            dtype = str(torch.get_autocast_dtype(device_type))
            state = {"enabled": torch.is_autocast_enabled(device_type), "dtype": dtype}
            path.write_text(json.dumps(state))
        return training_step(batch, batch_idx)

    return step_that_records


def non_finite_from(model, step: int, until: int = 1 << 30):
    """``model.training_step`` whose loss is NaN from global step ``step`` on, before ``until`` (a data or numerics bug
    on one rank)."""
    training_step = model.training_step

    def step_that_goes_nan(batch, batch_idx):
        loss = training_step(batch, batch_idx)
        return loss * float("nan") if step <= model.trainer.global_step < until else loss

    return step_that_goes_nan


def overflowing(model, step: int):
    """``model.training_step`` with its loss multiplied by inf at global step ``step`` (an fp16 overflow)."""
    training_step = model.training_step

    def step_that_overflows(batch, batch_idx):
        loss = training_step(batch, batch_idx)
        return loss * float("inf") if model.trainer.global_step == step else loss

    return step_that_overflows


def noisy(model, sigma: float, rank: int):
    """``model.training_step`` with its loss scaled by e^N(0, sigma), drawn anew for every step and rank: a loss whose
    level varies a lot between batches (the scale is a constant to autograd)."""
    training_step = model.training_step

    def step_with_noise(batch, batch_idx):
        generator = torch.Generator().manual_seed(1000 * model.trainer.global_step + rank)
        return training_step(batch, batch_idx) * float(torch.exp(sigma * torch.randn((), generator=generator)))

    return step_with_noise


def param_group_rates(optimizer) -> list[dict]:
    return [{key: group.get(key) for key in ("lr", "weight_decay")} for group in base_optimizer(optimizer).param_groups]


class WriteResult(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.batchnorm_types: list[str] = []
        self.first_batch_param_groups = None

    def on_train_start(self, trainer, pl_module) -> None:
        # The layers as they train: teardown (which runs before on_fit_end) reverts SyncBatchNorm, as DDP's does.
        self.batchnorm_types = [type(m).__name__ for m in pl_module.modules() if "BatchNorm" in type(m).__name__]
        self.first_batch_param_groups = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The rates before this fit's first optimizer step: what a checkpoint saved then (a SIGTERM) would record.
        if self.first_batch_param_groups is None and trainer.optimizers:
            self.first_batch_param_groups = param_group_rates(trainer.optimizers[0])

    def on_test_end(self, trainer, pl_module) -> None:
        seen = [None] * trainer.world_size
        torch.distributed.all_gather_object(seen, pl_module.test_seen)
        if trainer.is_global_zero:
            result = {"test_seen": seen, "test_loss": float(trainer.callback_metrics["test_loss"])}
            (self.out / "test_result.json").write_text(json.dumps(result))

    def on_fit_end(self, trainer, pl_module) -> None:
        import deepspeed

        params = {}
        for name, p in pl_module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                params[name] = p.detach().double().tolist()
        seen = [None] * trainer.world_size
        torch.distributed.all_gather_object(seen, pl_module.seen)
        eval_seen = [None] * trainer.world_size
        torch.distributed.all_gather_object(eval_seen, pl_module.eval_seen)
        emulated_delay = [None] * trainer.world_size
        torch.distributed.all_gather_object(emulated_delay, pl_module.emulated_delay)
        buffer_traces = [None] * trainer.world_size
        torch.distributed.all_gather_object(buffer_traces, pl_module.buffer_trace)
        mode = getattr(getattr(trainer.strategy, "job", None), "mode", None)
        claims = getattr(mode, "claims", None)  # (asynchronous merges' training mode)
        merges = [None] * trainer.world_size
        torch.distributed.all_gather_object(merges, claims.merges.records if claims is not None else None)
        # Which parameters each rank keeps optimizer state for (memory-sized shards: each on exactly one rank).
        names = {id(p): n for n, p in pl_module.named_parameters()}
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        held = sorted(names[id(p)] for p in optimizer.state if id(p) in names) if optimizer is not None else None
        state_names = [None] * trainer.world_size
        torch.distributed.all_gather_object(state_names, held)
        if trainer.is_global_zero:
            result = {
                "params": params,
                "seen": seen,
                "eval_seen": eval_seen,
                "emulated_delay": emulated_delay,
                "buffer_traces": buffer_traces,
                "merges": merges,
                "optimizer_state_names": state_names,
                "batchnorm_types": self.batchnorm_types,
                "running_statistics": {
                    name: b.double().tolist()
                    for name, b in pl_module.named_buffers()
                    if name.endswith(("running_mean", "running_var"))
                },
                "global_step": trainer.global_step,
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                "metric_dtypes": {k: str(v.dtype) for k, v in trainer.callback_metrics.items()},
                "train_dataloader_calls": getattr(pl_module, "train_dataloader_calls", None),
                "param_groups": param_group_rates(trainer.optimizers[0]) if trainer.optimizers else None,
                "first_batch_param_groups": self.first_batch_param_groups,
            }
            (self.out / "result.json").write_text(json.dumps(result))


def main() -> None:
    if os.environ.get("FIT_DUMP_STACKS_AFTER"):  # debugging a hang: every thread's stack after that many seconds
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["FIT_DUMP_STACKS_AFTER"]))
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--record-autocast", action="store_true", help="autocast.json: what training_step ran under")
    parser.add_argument(
        "--stage",
        type=lambda v: None if v == "auto" else int(v),
        default=2,
        help="ZeRO stage; auto: HeteroStrategy's default (no stage given)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="*")
    parser.add_argument("--global-batch-size", type=int)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--max-epochs", type=int, default=1)
    parser.add_argument("--reload-every", type=int, default=0, help="Trainer(reload_dataloaders_every_n_epochs=...)")
    parser.add_argument("--loader-batch-size", type=int, default=8)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches (manual: done in the step)")
    parser.add_argument(
        "--loss-reduction", choices=["mean", "sum", "token_mean"], help="HeteroStrategy(loss_reduction=...)"
    )
    parser.add_argument("--model-reduction", choices=["mean", "sum"], help="the model's loss (default: as above)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--val-samples", type=int, default=0)
    parser.add_argument("--test-samples", type=int, default=0, help="run trainer.test after fit on this many")
    parser.add_argument("--predict-samples", type=int, default=0, help="run trainer.predict after fit on this many")
    parser.add_argument("--gather-in-eval", action="store_true", help="self.all_gather in the evaluation steps")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--ckpt-path")
    parser.add_argument("--weights-only", choices=["true", "false"], help="Trainer.fit's weights_only (default: None)")
    parser.add_argument("--save-last", action="store_true", help="ModelCheckpoint(save_last=True)")
    parser.add_argument("--checkpoint-dir", type=Path, help="ModelCheckpoint's dirpath (default: OUT/ckpt)")
    parser.add_argument("--disk-full-at", type=int, help="rank 1's checkpoint writes fail (ENOSPC) from this step on")
    parser.add_argument("--kill", help="RANK:STEP:WHERE (step|checkpoint): that rank SIGKILLs itself there")
    parser.add_argument("--record-steps", action="store_true", help="append every rank's step indices to steps.jsonl")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--save-after-fit", type=Path, help="trainer.save_checkpoint(PATH) once the fit ends")
    parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d first; buffer traces in the result")
    parser.add_argument("--sync-batchnorm", action="store_true", help="Trainer(sync_batchnorm=True)")
    parser.add_argument("--hidden-on-rank-1", type=int, help="a model whose width depends on the rank")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--emulate-speeds", type=float, nargs="*")
    parser.add_argument("--emulate-schedule", help="JSON {step: speeds}: a drift schedule")
    parser.add_argument("--fail-on-rank", type=int, help="training_step raises on this rank (a one-rank failure)")
    parser.add_argument("--monitor", action="store_true", help="HeteroMonitor with a CSVLogger in --out")
    parser.add_argument("--mlflow", type=Path, help="an MLFlowLogger with its file store in this directory")
    parser.add_argument("--wandb", type=Path, help="a WandbLogger, offline, saving its runs in this directory")
    parser.add_argument("--signal-test", action="store_true", help="write PIDs at step 3 and every rank's exit code")
    parser.add_argument("--fail-in", choices=["training_step", "collate_fn"], default="training_step")
    parser.add_argument("--stall-on-rank-1", type=float, help="SECONDS: rank 1's collate_fn sleeps that long per batch")
    parser.add_argument("--iterable", action="store_true", help="train on an IterableDataset")
    parser.add_argument("--two-loaders", action="store_true", help="a dict of two training loaders")
    parser.add_argument("--tokens", action="store_true", help="padded token sequences and a token-mean loss")
    parser.add_argument("--ddp", action="store_true", help="train with Lightning's DDPStrategy instead (a reference)")
    parser.add_argument(
        "--deepspeed-strategy",
        action="store_true",
        help="train with Lightning's DeepSpeedStrategy (made to run on CPU) at --stage instead",
    )
    parser.add_argument("--configure-model", action="store_true", help="the network is built in configure_model()")
    parser.add_argument("--test-first", action="store_true", help="trainer.test on --test-samples before the fit")
    parser.add_argument("--loader-in-hook", action="store_true", help="the model's train_dataloader() builds it")
    parser.add_argument("--samples-on-rank-1", type=int, help="a different training set length on rank 1")
    parser.add_argument("--seed-per-rank", action="store_true", help="seed_everything(7 + rank)")
    parser.add_argument("--strategy-args", help="JSON: more HeteroStrategy arguments (every rank)")
    parser.add_argument("--rank-1-strategy-args", help="JSON: strategy arguments that rank 1 alone is given")
    parser.add_argument("--record-every-step", action="store_true", help="per_step.jsonl: params on every rank")
    parser.add_argument("--overflow", help="RANK:STEP: that rank's loss is inf at that global step (step >= 1)")
    parser.add_argument("--nan-from", help="RANK:STEP: that rank's loss is NaN from that global step on")
    parser.add_argument("--noisy-loss", type=float, help="SIGMA: each step's loss scaled by e^N(0, SIGMA) per rank")
    parser.add_argument("--nan-until", type=int, default=1 << 30, help="... and before this global step")
    parser.add_argument("--config-by-rank", help="JSON list: rank r's DeepSpeed config (to provoke a mismatch)")
    parser.add_argument("--hold-at", help="STEP:FILE: every rank waits at that global step until FILE exists")
    parser.add_argument(
        "--launched-layout",
        action="store_true",
        help="devices and num_nodes from torchrun, as an elastic job's script takes them",
    )
    parser.add_argument(
        "--each",
        help="JSON list of argument lists: one fit after another in these ranks, each with"
        " its arguments added to the others (several cases in one job)",
    )
    args = parser.parse_args()
    if args.each is None:
        return fit(args)
    at = sys.argv.index("--each")
    common = sys.argv[1:at] + sys.argv[at + 2 :]
    for more in json.loads(args.each):
        fit(parser.parse_args(common + more))


def fit(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)

    rank = int(os.environ.get("LOCAL_RANK", 0))
    seed_everything(7 + rank if args.seed_per_rank else 7)
    samples = args.samples_on_rank_1 if args.samples_on_rank_1 and rank == 1 else args.samples
    dataset = PaddedTokens(samples) if args.tokens else IndexedRegression(samples)
    if args.iterable:
        dataset = ShardedStream(dataset, rank, args.devices)
    train = DataLoader(dataset, batch_size=args.loader_batch_size, shuffle=args.shuffle, drop_last=args.drop_last)
    val = DataLoader(IndexedRegression(args.val_samples, seed=99), batch_size=4) if args.val_samples else None

    strategy_kwargs = {"stage": args.stage}
    if args.batch_sizes:
        strategy_kwargs["batch_sizes"] = args.batch_sizes
    if args.global_batch_size:
        strategy_kwargs["global_batch_size"] = args.global_batch_size
    if args.emulate_speeds:
        strategy_kwargs["emulate_speeds"] = args.emulate_speeds
    if args.emulate_schedule:
        strategy_kwargs["emulate_speeds"] = {int(k): v for k, v in json.loads(args.emulate_schedule).items()}
    if args.loss_reduction:
        strategy_kwargs["loss_reduction"] = args.loss_reduction
    if args.config_by_rank:
        strategy_kwargs["config"] = json.loads(args.config_by_rank)[rank]
    if args.strategy_args:
        strategy_kwargs.update(json.loads(args.strategy_args))
    if args.rank_1_strategy_args and rank == 1:
        strategy_kwargs.update(json.loads(args.rank_1_strategy_args))
    callbacks = [WriteResult(args.out), RecordEmulatedDelay()]
    if args.signal_test:
        callbacks.append(WritePidWhenTraining(args.out))
    if args.monitor:
        callbacks.append(HeteroMonitor())
    if args.checkpoint_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.checkpoint_dir or args.out / "ckpt",
                every_n_train_steps=args.checkpoint_every,
                save_top_k=-1,
                save_last=args.save_last,
            )
        )
    if args.kill:
        kill_rank, kill_step, where = args.kill.split(":")
        callbacks.append(FaultInjection(int(kill_rank), int(kill_step), where))
    if args.record_steps:
        callbacks.append(RecordSteps(args.out))
    if args.hold_at:
        hold_step, hold_file = args.hold_at.split(":", 1)
        callbacks.append(HoldUntilFile(int(hold_step), Path(hold_file)))
    if args.disk_full_at is not None and rank == 1:
        callbacks.append(DiskFullFrom(args.disk_full_at))
    if args.record_every_step:
        callbacks.append(RecordEveryStep(args.out))
    if args.ddp:  # the gloo exit race (see lightning_hetero/runtime/shutdown.py) hits a DDP reference run as well
        from lightning_hetero.runtime.shutdown import register_exit_cleanup

        register_exit_cleanup()
    devices, num_nodes = launched_layout(args.devices) if args.launched_layout else (args.devices, 1)
    strategy = "ddp" if args.ddp else HeteroStrategy(**strategy_kwargs)
    if args.deepspeed_strategy:
        strategy = cpu_deepspeed_strategy(stage=args.stage)
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        reload_dataloaders_every_n_epochs=args.reload_every,
        accumulate_grad_batches=1 if args.manual else args.accumulate,
        callbacks=callbacks,
        logger=make_logger(args),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        sync_batchnorm=args.sync_batchnorm,
        default_root_dir=args.out,
        gradient_clip_val=args.clip,
    )
    model_class = ConfiguredRegressionModule if args.configure_model else RegressionModule
    model_kwargs = {}
    if args.loader_in_hook:
        model_class, model_kwargs = LoaderInHook, {"loader": train}
    model = model_class(
        **model_kwargs,
        manual=args.manual,
        hidden=args.hidden_on_rank_1 if args.hidden_on_rank_1 and rank == 1 else args.hidden,
        dropout=args.dropout,
        depth=args.depth,
        manual_accumulation=args.accumulate if args.manual else 1,
        reduction=args.model_reduction or args.loss_reduction or "mean",
        optimizer=args.optimizer,
        batchnorm=args.batchnorm,
    )
    if args.tokens:
        model = TokenModule()
    model._trace_buffers = args.batchnorm
    model.gather_in_eval = args.gather_in_eval
    if args.fail_on_rank is not None and rank == args.fail_on_rank:
        if args.fail_in == "training_step":
            model.training_step = failing_step
        else:
            train.collate_fn = failing_collate(train.collate_fn)
    if args.stall_on_rank_1 and rank == 1:
        train.collate_fn = stalled_collate(train.collate_fn, args.stall_on_rank_1)
    if args.record_autocast:
        model.training_step = recording_autocast(model, args.out, args.accelerator)
    if args.overflow:
        overflow_rank, overflow_step = map(int, args.overflow.split(":"))
        if rank == overflow_rank:
            model.training_step = overflowing(model, overflow_step)
    if args.nan_from:
        nan_rank, nan_step = map(int, args.nan_from.split(":"))
        if rank == nan_rank:
            model.training_step = non_finite_from(model, nan_step, args.nan_until)
    if args.noisy_loss:
        model.training_step = noisy(model, args.noisy_loss, rank)
    if args.two_loaders:
        train = {"first": train, "second": DataLoader(IndexedRegression(samples, seed=8), batch_size=4)}
    test = DataLoader(IndexedRegression(args.test_samples, seed=5), batch_size=4) if args.test_samples else None
    if args.test_first:
        trainer.test(model, test, verbose=False)
    weights_only = None if args.weights_only is None else args.weights_only == "true"
    trainer.fit(model, None if args.loader_in_hook else train, val, ckpt_path=args.ckpt_path, weights_only=weights_only)
    if args.save_after_fit:
        trainer.save_checkpoint(args.save_after_fit)
    if args.test_samples and not args.test_first:
        trainer.test(model, test, verbose=False)
    if args.predict_samples:
        trainer.predict(model, DataLoader(IndexedRegression(args.predict_samples, seed=6), batch_size=3))
    if args.gather_in_eval and trainer.is_global_zero:
        (args.out / "gathered_shapes.json").write_text(json.dumps(model.gathered_shapes))


def entry() -> None:
    """What the script runs after its imports (also in a rank forked by warm_ranks.py)."""
    try:
        main()
    except SystemExit as stop:  # the code this rank exits with (Lightning's launcher ignores the other ranks' codes)
        if "--signal-test" in sys.argv:
            out = Path(sys.argv[sys.argv.index("--out") + 1])
            (out / f"exit_rank{os.environ.get('LOCAL_RANK', 0)}").write_text(str(stop.code))
        raise


if __name__ == "__main__":
    entry()
