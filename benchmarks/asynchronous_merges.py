"""Asynchronous merges by speed against the synchronous merge, with a rank slowed 3x mid-run.

    python benchmarks/asynchronous_merges.py                 # 5 seeds, a pair of fits each (about 8 minutes)
    python benchmarks/asynchronous_merges.py --runs 3 --no-drift   # the same pairs at the speeds they started with

The setting of ``benchmarks/local_sgd.py``: two ranks at emulated speeds [1.0, 0.4], each its own emulated node, a
1 Gbit/s link with 0.5 ms latency, the wide spiral classifier (2.1 M parameters), Adam, 8192 training samples in
micro-batches of 64, DiLoCo with H=8. The drift: rank 1 slows 3x (to 0.133) after its 110th micro-batch, about the
middle of 6 epochs in both modes (a rank's training step holds one micro-batch of the slowest rank in both). Run r
seeds both of its fits with r (initial weights, sample order), in alternating order:

    synchronous    DiLoCo H=8, inner steps planned from the profiles and re-planned from what the ranks measure
    asynchronous   the same with sync_options={"asynchronous": True}: each rank trains the micro-batches it has time
                   for, a merge every 8 x 2 micro-batches claimed, weighted by what each rank trained

The figures, per run:
- the final validation loss of the asynchronous fit over the synchronous one's;
- the wait for the slowest rank after the drift, over the slowed rank's time for one of its steps then (a
  micro-batch with its optimizer step; its median): synchronous, the fast rank's time in each training step beyond
  its compute (the run report's ``wait_seconds``: its wait, its own optimizer steps and a merge's exchange);
  asynchronous, each rank's time in each merge less the least any rank spent in it (the last to arrive waits for
  nobody); the most and the median; and for the asynchronous fit the most over the slowed rank's median time from one
  micro-batch to the next (its step and the loop's own time between steps), and for the merges the slowed rank
  reached last, merge by merge over the micro-batch waited for (the slowed rank's, from the start of its last
  micro-batch to the merge: what the claims bound a wait by);
- each fit's training time, and the samples each epoch trained (the run report's batch sizes).

The JSON (``--out``, default ``benchmarks/results/asynchronous_merges.json``) holds every run: the command, the
commit, the machine and the date, the setting, and every round's figures for both fits (their validation curves
included). A run worth keeping is committed as ``benchmarks/measured/asynchronous_merges_<what>.json`` and rendered by
``python benchmarks/render.py`` (``docs/results/asynchronous_merges.md``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
# The package beside this script, not an installed one: a run measures the checkout it is run from (a worktree);
# the fits started by local_sgd.launch get it first on their PYTHONPATH.
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from jobs import run_facts  # noqa: E402
from local_sgd import LINK, MICRO_BATCH, SPEEDS, TRAIN_SAMPLES, launch  # noqa: E402

from lightning_hetero.local.claim_decisions import merge_summary  # noqa: E402

DEFAULT_OUT = HERE / "results" / "asynchronous_merges.json"
SYNC_EVERY = 8
DRIFT_AFTER = 110  # rank 1's micro-batches before it slows down
MIN_EPOCHS = 4  # the fewest with steps and epoch ends after the drift (found by trying: 3 crashed on an empty median)
SLOWDOWN = 3.0
SLOW_RANK = 1


def drift_speeds() -> dict[str, list[float]]:
    slowed = [speed / SLOWDOWN if rank == SLOW_RANK else speed for rank, speed in enumerate(SPEEDS)]
    return {"0": list(SPEEDS), str(DRIFT_AFTER): slowed}


FITS = {
    "synchronous": {"emulate_speeds": drift_speeds()},
    "asynchronous": {"emulate_speeds": drift_speeds(), "sync_options": {"asynchronous": True}},
}
WITHOUT_DRIFT = {
    name: {key: value for key, value in options.items() if key != "emulate_speeds"} for name, options in FITS.items()
}


# ---------------------------------------------------------------------------------------------- analysis (pure)


def slow_step_seconds(report: dict[str, Any]) -> float:
    """The slowed rank's median time for one of its steps after the drift: a micro-batch's compute, its optimizer
    step and the loop around them (the rank's compute plus its wait in the run report; the median leaves out the
    steps that held a merge)."""
    times = [
        step["compute_seconds"][SLOW_RANK] + step["wait_seconds"][SLOW_RANK]
        for index, step in enumerate(report["steps"])
        if index >= DRIFT_AFTER and step["batch_sizes"][SLOW_RANK] > 0
    ]
    return statistics.median(times)


def synchronous_waits(report: dict[str, Any]) -> list[float]:
    """The fast rank's time in each training step after the drift beyond its compute (its wait for the slowed rank,
    with its own optimizer steps and a merge's exchange: an upper bound on its wait)."""
    return [step["wait_seconds"][0] for index, step in enumerate(report["steps"]) if index >= DRIFT_AFTER]


def after_the_drift(merges: list[list[dict[str, Any]]]) -> list[int]:
    """The merges after the slowed rank's first micro-batch at its new speed."""
    slow_done, after = 0, []
    for index, record in enumerate(merges[SLOW_RANK]):
        slow_done += record["micro_batches"]
        if slow_done > DRIFT_AFTER:
            after.append(index)
    return after


def merges_after_the_drift(merges: list[list[dict[str, Any]]], epoch_ends: bool) -> list[dict[str, Any]]:
    """The run report's summary of each merge after the drift
    (:func:`lightning_hetero.local.claim_decisions.merge_summary`): the merges inside the epochs, or (``epoch_ends``)
    each epoch's last."""
    per_merge = merge_summary(merges)["per_merge"]
    last = {merge["epoch"]: index for index, merge in enumerate(per_merge)}  # each epoch's last merge
    return [per_merge[i] for i in after_the_drift(merges) if (i == last[per_merge[i]["epoch"]]) == epoch_ends]


def asynchronous_waits(merges: list[list[dict[str, Any]]], epoch_ends: bool = False) -> list[float]:
    """Each rank's wait in each merge after the drift for the last rank to reach it (the run report's: its time in
    the merge less the least any rank spent in it). The merges inside the epochs, or (``epoch_ends``) each epoch's
    last."""
    return [wait for merge in merges_after_the_drift(merges, epoch_ends) for wait in merge["wait_seconds"]]


def waits_for_the_slowed_rank(merges: list[list[dict[str, Any]]], epoch_ends: bool = False) -> list[float]:
    """Each wait for the slowed rank after the drift (the merges it reached last) over the micro-batch waited for: the
    slowed rank's time from the start of its last micro-batch (its decision to train it) to the merge (the run
    report's ``last_step_seconds``). At most 1 (to the measurement's precision: a wait is a difference of times in
    the merge) when a rank waits for no more than the micro-batch the slowed rank is in. Inside the epochs, or
    (``epoch_ends``) each epoch's last merge. A merge inside the epoch that the slowed rank joins only after its last
    micro-batch of the epoch counts as inside (the wait is still for that micro-batch), and the epoch's last merge
    counts only where the slowed rank trained since the merge before. (The slowed rank's own waits for a faster rank,
    by the claims' rule at most that rank's micro-batch, are in :func:`asynchronous_waits`.)"""
    ratios = []
    for merge in merges_after_the_drift(merges, epoch_ends):
        waits, step = merge["wait_seconds"], merge["last_step_seconds"][SLOW_RANK]
        if step and min(waits) == waits[SLOW_RANK]:  # (None: it trained nothing since, or an older version's records)
            ratios += [wait / step for rank, wait in enumerate(waits) if rank != SLOW_RANK]
    return ratios


def slow_cycle_seconds(merges: list[list[dict[str, Any]]]) -> Optional[float]:
    """The slowed rank's median time from one micro-batch to the next after the drift (its step and the loop's own
    time between steps): a typical inner step of it, which the micro-batch another rank waits for can exceed."""
    cycles = [merges[SLOW_RANK][i].get("cycle_seconds") for i in after_the_drift(merges)]
    known = [cycle for cycle in cycles if cycle is not None]
    return statistics.median(known) if known else None  # (none in the records of an older version)


def samples_per_epoch(report: dict[str, Any], epochs: int) -> int:
    return sum(sum(step["batch_sizes"]) for step in report["steps"]) // epochs


def analyse(fits: dict[str, dict[str, Any]], epochs: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for name, fit in fits.items():
        report = fit["report"]
        waits = asynchronous_waits(fit["merges"]) if name == "asynchronous" else synchronous_waits(report)
        micro = slow_step_seconds(report)
        cycle = slow_cycle_seconds(fit["merges"]) if name == "asynchronous" else None
        extra: dict[str, Any] = dict.fromkeys(
            [
                "slow_cycle_seconds",
                "most_wait_over_slow_cycle",
                "most_wait_at_epoch_ends_over_slow_cycle",
                "most_wait_over_step_waited_for",
                "most_wait_at_epoch_ends_over_step_waited_for",
                "claims_taken_over",
            ]
        )
        if cycle is not None:
            at_ends = asynchronous_waits(fit["merges"], epoch_ends=True)
            extra.update(
                {
                    "slow_cycle_seconds": cycle,
                    "most_wait_over_slow_cycle": max(waits) / cycle,
                    "most_wait_at_epoch_ends_over_slow_cycle": max(at_ends) / cycle,
                }
            )
            inside, at_end = (waits_for_the_slowed_rank(fit["merges"], ends) for ends in (False, True))
            if inside:  # (none in the records of a version before last_step_seconds)
                extra["most_wait_over_step_waited_for"] = max(inside)
                # (none at an epoch's end: the slowed rank reached no epoch's last merge last, so none waited for it)
                extra["most_wait_at_epoch_ends_over_step_waited_for"] = max(at_end, default=0.0)
            merged = fit["report"].get("asynchronous") or {}
            extra["claims_taken_over"] = merged.get("claims_taken_over")
        figures[name] = {
            **extra,
            "final_val_loss": fit["curve"][-1]["val_loss"],
            "last3_val_loss": statistics.mean(point["val_loss"] for point in fit["curve"][-3:]),
            "train_seconds": fit["curve"][-1]["seconds"],
            "slow_step_seconds": micro,
            "most_wait_over_slow_step": max(waits) / micro,
            "median_wait_over_slow_step": statistics.median(waits) / micro,
            "samples_per_epoch": samples_per_epoch(report, epochs),
            "curve": fit["curve"],  # (every validation: seconds from the start of training, loss, accuracy)
        }
    figures["loss_ratio"] = figures["asynchronous"]["final_val_loss"] / figures["synchronous"]["final_val_loss"]
    figures["last3_ratio"] = figures["asynchronous"]["last3_val_loss"] / figures["synchronous"]["last3_val_loss"]
    return figures


# ---------------------------------------------------------------------------------------------- driver


def read_fit(out: Path) -> dict[str, Any]:
    """What a fit left in ``out``: its curve, its run report and (asynchronous) each rank's merge records."""
    merges = (
        [json.loads((out / f"merges_rank{r}.json").read_text()) for r in range(2)]
        if (out / "merges_rank0.json").exists()
        else None
    )
    return {
        "curve": json.loads((out / "curve.json").read_text()),
        "report": json.loads((out / "hetero" / "report.json").read_text()),
        "merges": merges,
    }


def run_all(
    runs: int, epochs: int, work: Path, drift: bool = True, again: bool = False, anneal: bool = False
) -> list[dict[str, Any]]:
    """``again``: analyse the fits an earlier invocation left in ``work`` instead of running them; ``anneal``: a
    cosine learning rate over the epochs in both fits (``benchmarks/local_sgd.py --anneal``)."""
    fit_options = FITS if drift else WITHOUT_DRIFT
    results = []
    for run in range(runs):
        started = time.perf_counter()
        order = list(FITS) if run % 2 == 0 else list(reversed(FITS))
        fits = {}
        for name in order:
            out = work / f"run{run}" / name
            if not again:
                launch(name, "diloco", SYNC_EVERY, epochs, out, fit_options[name], seed=run, anneal=anneal)
            fits[name] = read_fit(out)
        figures = analyse(fits, epochs)
        results.append(figures)
        print(
            f"run {run + 1}/{runs} (seed {run}, {time.perf_counter() - started:.0f} s): async/sync final loss"
            f" {figures['loss_ratio']:.3f}"
        )
        for name in FITS:
            f = figures[name]
            cycle = ""
            if f["slow_cycle_seconds"]:
                cycle = (
                    f", the most {f['most_wait_over_slow_cycle']:.2f} of its micro-batch cycle"
                    f" ({f['slow_cycle_seconds'] * 1e3:.0f} ms) inside an epoch and"
                    f" {f['most_wait_at_epoch_ends_over_slow_cycle']:.2f} at an epoch's end"
                )
            if f["most_wait_over_step_waited_for"] is not None:
                cycle += (
                    f"; for it, over its micro-batch waited for, the most"
                    f" {f['most_wait_over_step_waited_for']:.3f} inside an epoch,"
                    f" {f['most_wait_at_epoch_ends_over_step_waited_for']:.3f} at an epoch's end"
                )
            if f.get("claims_taken_over") is not None:
                cycle += f"; claims taken over by each rank {f['claims_taken_over']}"
            print(
                f"  {name}: final val loss {f['final_val_loss']:.4f} (last 3 epochs {f['last3_val_loss']:.4f}),"
                f" {f['train_seconds']:.1f} s; after the drift the most wait for the slowest rank"
                f" {f['most_wait_over_slow_step']:.2f} of its step ({f['slow_step_seconds'] * 1e3:.0f} ms), median"
                f" {f['median_wait_over_slow_step']:.2f}{cycle}; {f['samples_per_epoch']} samples an"
                " epoch"
            )
    return results


def table(results: list[dict[str, Any]]) -> str:
    def values(name: str, key: str, form: str) -> str:
        found = [run[name][key] if name in FITS else run[key] for run in results]
        if any(value is None for value in found):
            return "-"
        return ", ".join(form % v for v in found) + f" (median {form % statistics.median(found)})"

    lines = [
        "| fit | final val loss | mean val loss, last 3 epochs | training seconds | most wait / slowed rank's step"
        " | median wait / slowed rank's step | most wait / slowed rank's micro-batch cycle, inside an epoch"
        " | the same, at an epoch's end | most wait for the slowed rank / its micro-batch waited for, inside an epoch"
        " | the same, at an epoch's end | samples an epoch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in FITS:
        lines.append(
            f"| {name} | {values(name, 'final_val_loss', '%.4f')} | {values(name, 'last3_val_loss', '%.4f')}"
            f" | {values(name, 'train_seconds', '%.1f')} | {values(name, 'most_wait_over_slow_step', '%.2f')}"
            f" | {values(name, 'median_wait_over_slow_step', '%.2f')}"
            f" | {values(name, 'most_wait_over_slow_cycle', '%.2f')}"
            f" | {values(name, 'most_wait_at_epoch_ends_over_slow_cycle', '%.2f')}"
            f" | {values(name, 'most_wait_over_step_waited_for', '%.3f')}"
            f" | {values(name, 'most_wait_at_epoch_ends_over_step_waited_for', '%.3f')}"
            f" | {values(name, 'samples_per_epoch', '%d')} |"
        )
    lines.append(f"\nasynchronous / synchronous final loss: {values('loss_ratio', 'loss_ratio', '%.3f')}")
    lines.append(f"the same, mean of the last 3 epochs: {values('last3_ratio', 'last3_ratio', '%.3f')}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--no-drift",
        action="store_true",
        help=f"no rank slows down (the waits are then measured from the {DRIFT_AFTER + 1}th step on all the same)",
    )
    parser.add_argument("--anneal", action="store_true", help="a cosine learning rate over the epochs in both fits")
    parser.add_argument("--again", action="store_true", help="analyse the fits of an earlier run with this --out")
    args = parser.parse_args(argv)
    assert TRAIN_SAMPLES % MICRO_BATCH == 0
    if args.epochs < MIN_EPOCHS:  # (fewer leave no step or epoch's end after the drift to measure: an empty median)
        parser.error(
            f"--epochs {args.epochs}: at least {MIN_EPOCHS} are needed, since rank 1 slows after its"
            f" {DRIFT_AFTER}th micro-batch and the waits are measured after that; pass --epochs {MIN_EPOCHS} or more"
        )
    facts = run_facts("benchmarks/asynchronous_merges.py", argv if argv is not None else sys.argv[1:], HERE)
    results = run_all(
        args.runs, args.epochs, args.out.parent / "asynchronous_merges_runs", not args.no_drift, args.again, args.anneal
    )
    text = table(results)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setting = {
        "rounds": args.runs,
        "epochs": args.epochs,
        "seeds": list(range(args.runs)),
        "drift": not args.no_drift,
        "anneal": args.anneal,
        "again": args.again,  # (the fits of an earlier invocation analysed again: their code may be older)
        "speeds": SPEEDS,
        "slow_rank": SLOW_RANK,
        "slowdown": SLOWDOWN,
        "drift_after": DRIFT_AFTER,
        "sync_every": SYNC_EVERY,
        "link": LINK,
        "train_samples": TRAIN_SAMPLES,
        "micro_batch": MICRO_BATCH,
    }
    record = {**facts, "setting": setting, "runs": results, "table": text}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
