"""Which way a checkpoint is resumed: every combination of what the job is and what the manifest says."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.recover.resume import Route, file_route, resume_route

CHOSEN = Path("/checkpoints/step=10")


def route(manifest, pipeline=False, local=None, world_size=2, zero_stage=0, stage_is_automatic=False):
    return resume_route(
        CHOSEN,
        manifest,
        pipeline=pipeline,
        local=local,
        world_size=world_size,
        zero_stage=zero_stage,
        stage_is_automatic=stage_is_automatic,
    )


@pytest.mark.parametrize(
    ("saved_pipeline", "pipeline", "saved_world", "world_size", "local", "saved_sync"),
    list(itertools.product([False, True], [False, True], [2, 4, None], [2, 4], [None, "diloco"], [None, "local_sgd"])),
)
def test_every_job_and_manifest_gets_one_route_or_one_refusal(
    saved_pipeline, pipeline, saved_world, world_size, local, saved_sync
):
    manifest = {"zero_stage": 0, **({"pipeline": {"stages": 2}} if saved_pipeline else {})}
    if saved_sync is not None and not saved_pipeline:  # (local training's manifest says its mode)
        manifest["sync"] = saved_sync
    if saved_world is not None:
        manifest["world_size"] = saved_world
    same = saved_world in (None, world_size)
    if pipeline and not saved_pipeline:  # (data parallel into a pipeline, by name; not local training's state)
        expected = Route.INTO_PIPELINE if saved_sync is None else "saved with `sync='local_sgd'`"
    elif saved_pipeline and not pipeline:  # (the whole model by name, at any world size; not into local training)
        expected = Route.FROM_PIPELINE if local is None else "`sync='diloco'` needs each rank's own optimizer state"
    elif pipeline:
        expected = Route.PIPELINE
    elif same:
        expected = Route.SAME_WORLD_SIZE
    elif local is not None:
        expected = f"trained on {saved_world} ranks with `sync='diloco'`"
    else:
        expected = Route.ANOTHER_WORLD_SIZE
    if isinstance(expected, Route):
        assert route(manifest, pipeline, local, world_size) is expected
    else:
        with pytest.raises(ResumeRefused, match=expected):
            route(manifest, pipeline, local, world_size)


def test_a_stage_that_differs_from_the_checkpoints_is_refused_and_an_automatic_one_says_so():
    manifest = {"zero_stage": 2, "world_size": 2}
    with pytest.raises(ResumeRefused, match=r"ZeRO stage 2, and this run is at ZeRO stage 3: .* Pass `stage=2`"):
        route(manifest, zero_stage=3)
    with pytest.raises(ResumeRefused, match="chosen automatically"):
        route(manifest, zero_stage=3, stage_is_automatic=True)
    assert route(manifest, zero_stage=2) is Route.SAME_WORLD_SIZE


def test_a_lightning_checkpoint_file_is_refused_by_a_pipeline_only():
    assert file_route(Path("last.ckpt"), pipeline=False) is Route.LIGHTNING_FILE
    with pytest.raises(ResumeRefused, match="a Lightning checkpoint file"):
        file_route(Path("last.ckpt"), pipeline=True)
