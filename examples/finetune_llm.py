"""Train a small GPT-2-architecture model as a 2-stage pipeline on 2 CPU ranks, rank 1 emulated slower.

    pip install -e ".[llm]"                 # transformers, for the model
    python examples/finetune_llm.py          # 40 steps placed by speed, then 40 on equal blocks
    python examples/finetune_llm.py --steps 80 --speeds 1.0 0.4 --no-baseline

The model is built from a config (6 GPT-2 blocks, no download) and trained on a corpus generated here (sentences of a
small grammar, one token per character), with what an LLM recipe uses: AdamW, a warm-up and cosine learning-rate
schedule, gradient clipping at 1.0 and 2 accumulated batches per optimizer step. The strategy measures each block on
both ranks and places the blocks so that the slower rank takes fewer; rank 0 prints the placement, the loss every few
steps, and at the end the tokens per second against the same training on equal blocks (``boundaries`` at the half,
as a pipeline that ignores the speeds would place them).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere in a clone

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.utilities import rank_zero_only  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_hetero import HeteroStrategy  # noqa: E402

try:
    from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup
    from transformers.utils import logging as transformers_logging
except ImportError:  # (the example's one extra)
    sys.exit('examples/finetune_llm.py needs transformers: pip install -e ".[llm]"')

transformers_logging.set_verbosity_error()  # (its notes on a config built in code are not the reader's concern)

CONTEXT = 64  # tokens per sequence
SUBJECTS = ["the fox", "a dog", "the old cat", "my friend", "the river", "a small bird", "the farmer", "her brother"]
VERBS = ["sees", "follows", "finds", "watches", "crosses", "carries", "meets", "remembers"]
OBJECTS = ["the hill", "a bright lamp", "the long road", "an open door", "the red boat", "a quiet town", "the garden"]
ENDINGS = ["at dawn", "in the rain", "before noon", "without a word", "again and again", "near the sea", ""]


def generated_corpus(sentences: int, seed: int = 0) -> str:
    """Sentences of a small grammar: structure a model learns within a few dozen steps, made here (no download)."""
    pick = random.Random(seed).choice
    lines = []
    for _ in range(sentences):
        ending = pick(ENDINGS)
        lines.append(f"{pick(SUBJECTS)} {pick(VERBS)} {pick(OBJECTS)}{' ' + ending if ending else ''}.")
    return " ".join(lines)


class CharacterSequences(Dataset):
    """The corpus cut into sequences of ``CONTEXT`` characters, each character a token."""

    def __init__(self, text: str) -> None:
        self.vocabulary = sorted(set(text))
        index = {character: i for i, character in enumerate(self.vocabulary)}
        tokens = torch.tensor([index[character] for character in text], dtype=torch.long)
        self.sequences = tokens[: len(tokens) // CONTEXT * CONTEXT].view(-1, CONTEXT)

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.sequences[i]


class SmallGPT(LightningModule):
    """A GPT-2-architecture language model built from its config; its blocks are ``model.transformer.h``."""

    def __init__(self, vocabulary: int, layers: int = 6, width: int = 96, steps: int = 40, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = GPT2Config(
            vocab_size=vocabulary,
            n_positions=CONTEXT,
            n_embd=width,
            n_layer=layers,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,  # (GPT-2's own, 50256, is outside this vocabulary)
            eos_token_id=0,
        )
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup = max(1, self.hparams.steps // 10)
        schedule = get_cosine_schedule_with_warmup(optimizer, warmup, self.hparams.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Progress(Callback):
    """Rank 0 (the last stage, where the loss is): every few optimizer steps the mean loss of those steps (one batch's
    loss is noisy: 16 sequences), and each batch's wall time."""

    def __init__(self, every: int, tokens_per_batch: int) -> None:
        self.every, self.tokens_per_batch = every, tokens_per_batch
        self.batch_seconds: list[float] = []
        self.losses: list[float] = []  # each optimizer step's (its last batch's, as Lightning logs it)
        self.printed: list[float] = []  # the means printed
        self._last: float | None = None
        self._last_step = 0  # the optimizer steps done at the last batch's end

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs: Any, batch: Any, i: int) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.batch_seconds.append(now - self._last)
        self._last = now
        step = trainer.global_step
        ended, self._last_step = step != self._last_step, step  # (an optimizer step ended with this batch)
        if not ended or not trainer.is_global_zero or "train_loss" not in trainer.callback_metrics:
            return  # (this batch did not end an optimizer step, or this rank has no loss: a first stage)
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        if step % self.every == 0 or step == trainer.max_steps:
            mean = statistics.mean(self.losses[-self.every :])
            self.printed.append(mean)
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            print(f"  steps {max(1, step - self.every + 1):3d}-{step:3d}  loss {mean:.3f}  lr {lr:.2e}", flush=True)

    def tokens_per_second(self) -> float:
        measured = self.batch_seconds[4:] or self.batch_seconds  # (the first batches warm up)
        return self.tokens_per_batch / statistics.median(measured)


@rank_zero_only
def say(line: str) -> None:
    print(f"\n{line}", flush=True)


def fit(args: argparse.Namespace, data: CharacterSequences, boundaries: list[int] | None) -> Progress:
    """One fit of ``args.steps`` optimizer steps; ``boundaries`` None: placed by the blocks' measured speeds."""
    seed_everything(0, verbose=False)
    model = SmallGPT(len(data.vocabulary), args.layers, args.width, args.steps)
    pipeline: dict[str, Any] = {"stages": 2, "blocks": "model.transformer.h"}
    if boundaries is not None:
        pipeline["boundaries"] = boundaries
    progress = Progress(every=max(2, args.steps // 8), tokens_per_batch=args.batch * CONTEXT)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=HeteroStrategy(pipeline=pipeline, emulate_speeds=args.speeds, rebalance=boundaries is None),
        max_steps=args.steps,
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        callbacks=[progress],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch, shuffle=True))
    return progress


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per fit (2 batches each)")
    parser.add_argument("--batch", type=int, default=16, help="sequences of 64 tokens per batch")
    parser.add_argument("--layers", type=int, default=6, help="GPT-2 blocks")
    parser.add_argument("--width", type=int, default=96, help="the model's width (n_embd)")
    parser.add_argument("--speeds", type=float, nargs=2, default=[1.0, 0.5], help="emulated speed of rank 0 and 1")
    parser.add_argument("--no-baseline", action="store_true", help="skip the fit on equal blocks")
    args = parser.parse_args()
    data = CharacterSequences(generated_corpus(4000))
    say(f"{len(data)} sequences of {CONTEXT} tokens; fit 1: the blocks placed by their measured speed on each rank")
    placed = fit(args, data, None)
    baseline = None
    if not args.no_baseline:
        say(f"fit 2: the same training on equal blocks (boundaries [{args.layers // 2}])")
        baseline = fit(args, data, [args.layers // 2])
    if not placed.printed:  # (ranks other than 0: rank 0 prints)
        return
    first, last = placed.printed[0], placed.printed[-1]
    print(f"\nplaced by speed: loss {first:.3f} -> {last:.3f}, {placed.tokens_per_second():.0f} tokens/s")
    if baseline is not None:
        equal = baseline.tokens_per_second()
        print(
            f"equal blocks ({args.layers // 2} + {args.layers - args.layers // 2}): loss {baseline.printed[-1]:.3f},"
            f" {equal:.0f} tokens/s; placed by speed is {placed.tokens_per_second() / equal:.2f}x"
        )


if __name__ == "__main__":
    main()
