"""GPT-2 and Llama from `transformers`, built from small configs, as 2-stage pipelines against one process: what an LLM
recipe runs (AdamW, clipping at 1.0, accumulated batches), the blocks placed by measured speed with rank 1 emulated at
0.4. Skipped where the `llm` extra is not installed."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO
from lightning.pytorch import seed_everything

pytest.importorskip("transformers", reason='GPT-2 and Llama need transformers: pip install -e ".[llm]"')

sys.path.insert(0, str(REPO / "tests" / "workers"))

from pipeline_fit import LanguageModel, token_dataset  # noqa: E402
from test_pipeline_multiprocess import largest_difference, run_pipeline  # noqa: E402

STEPS, BATCH, ACCUMULATE, CLIP = 3, 12, 2, 1.0
MICRO_BATCHES = 4  # the pipeline's per batch (twice the stages)


def one_process(kind: str, optimizer_name: str, micro_batches: int = 1) -> dict[str, torch.Tensor]:
    """The whole model in one process on the loader's batches in order: each batch's mean loss divided by the
    accumulation, the whole model's gradient clipped, the optimizer's step. ``micro_batches``: each batch's gradient
    summed over that many equal parts (the same update; another order of the float sums)."""
    seed_everything(1, verbose=False)
    model = LanguageModel(kind, optimizer_name)
    optimizer = model.configure_optimizers()
    (ids,) = token_dataset().tensors
    batches = [ids[start : start + BATCH] for start in range(0, len(ids), BATCH)]
    for step in range(STEPS):
        optimizer.zero_grad()
        for index in range(step * ACCUMULATE, (step + 1) * ACCUMULATE):
            for part in batches[index % len(batches)].split(BATCH // micro_batches):
                (model(part) / ACCUMULATE / micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("kind", "optimizer_name"), [("gpt2", "adam"), ("llama", "adam"), ("llama", "sgd")])
def test_a_transformers_model_trains_as_a_pipeline_as_one_process(tmp_path, kind, optimizer_name):
    """GPT-2 split over `model.transformer.h` (its embedding tied to the head, on different stages), Llama over
    `model.model.layers` (rotary position embeddings passed to each layer as a keyword).

    With SGD the reference is one process on each whole batch. AdamW maps a gradient entry near its `eps` to about
    `lr` whatever its size, so the order of the float sums shows: one process alone, summing each batch's gradient
    over the pipeline's 4 micro-batches instead of at once, moves Llama's weights by 2.1e-5 and GPT-2's by 1.1e-5
    after 3 steps (SGD: 7e-9). With AdamW the reference sums the same micro-batches."""
    ranks = run_pipeline(
        tmp_path,
        *("--transformers", kind, "--optimizer", optimizer_name, "--speeds", "1.0,0.4", "--steps", str(STEPS)),
        *("--batch", str(BATCH), "--clip", str(CLIP), "--accumulate", str(ACCUMULATE)),
    )
    micro_batches = MICRO_BATCHES if optimizer_name == "adam" else 1
    assert largest_difference(one_process(kind, optimizer_name, micro_batches), ranks) <= 1e-5
