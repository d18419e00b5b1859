"""An elastic torchrun job loses a node: how long the survivor takes to finish, or to give up when it cannot resume.

    python benchmarks/elastic_resume.py                                  # SGD with momentum, ZeRO-2 (issue 29)
    python benchmarks/elastic_resume.py --optimizer nadam                # refused: NAdam's mu_product is no tensor
    python benchmarks/elastic_resume.py --rdzv-conf last_call_timeout=5 --out /tmp/elastic.json
    python benchmarks/elastic_resume.py --runs 3                         # the same job 3 times, one after another

Two torchrun agents on 127.0.0.1 (c10d rendezvous, ``--nnodes=1:2 --nproc-per-node=1 --max-restarts=3``, torchrun's
default rendezvous timeouts unless ``--rdzv-conf``) train ``tests/workers/fit.py`` (global batch 16, a checkpoint
every 5 steps, ``fit(ckpt_path="last")``, 40 steps). Once the 2-rank checkpoint of step 5 is published (the ranks wait
there), the second agent and its worker are SIGKILLed (a lost node). The first agent re-rendezvouses alone and its
worker resumes on 1 rank. Reported: the seconds from the kill to the survivor's exit, its exit code, the exit code of
each worker that failed after the kill (in order: the first lost its peer), and (when the job finished) the largest
parameter difference from one process trained on the same global batches. Each of ``--runs`` jobs is a round.
Results are printed and written to ``--out`` (default ``benchmarks/results/elastic_resume.json``): every round's
figures, with the command, the commit, the machine and the date; a run worth keeping is committed as
``benchmarks/measured/elastic_resume_<what>.json`` and rendered by ``python benchmarks/render.py``
(``docs/results/elastic_resume.md``). The workers import the package beside this script (``PYTHONPATH``), so a run
from a git worktree measures that worktree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKERS = REPO / "tests" / "workers"
sys.path.insert(0, str(WORKERS))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))  # benchmarks/jobs.py (benchmarks/ is no package: its scripts run as files)
from jobs import checkout_first, run_facts  # noqa: E402

SAMPLES, GLOBAL_BATCH, EPOCHS = 160, 16, 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_tree(pid: int) -> None:
    try:
        processes = [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def run(optimizer: str, stage: int, rdzv_conf: str, timeout: float, root: Path) -> dict:
    from lightning_hetero.recover import checkpoint

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--max-restarts=3",
        "--monitor-interval=0.5",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=elastic-resume",
        *([f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []),
        str(WORKERS / "fit.py"),
        "--out",
        str(root),
        "--launched-layout",
        "--global-batch-size",
        str(GLOBAL_BATCH),
        "--samples",
        str(SAMPLES),
        "--max-epochs",
        str(EPOCHS),
        "--checkpoint-every",
        "5",
        "--save-last",
        "--ckpt-path",
        "last",
        "--optimizer",
        optimizer,
        "--stage",
        str(stage),
        "--hold-at",
        f"5:{root.parent / 'go_on'}",
    ]
    # The package beside this script before an installed one, in the workers too (tests/workers/fit.py puts only its
    # own folder on sys.path): a run from a worktree measures the worktree.
    environment = checkout_first(REPO, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    agents = []
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(open(root.parent / f"agent{i}.log", "w")) for i in range(2)]
        try:
            for log in logs:  # the first hosts the rendezvous store
                agents.append(
                    subprocess.Popen(
                        command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=environment
                    )
                )
                time.sleep(1.0)
            last = root / "ckpt" / "last.ckpt"
            deadline = time.monotonic() + timeout
            while checkpoint.incompleteness(last) is not None:
                if any(agent.poll() is not None for agent in agents) or time.monotonic() > deadline:
                    output = (root.parent / "agent0.log").read_text()
                    raise RuntimeError(f"no checkpoint was published:\n{output[-3000:]}")
                time.sleep(0.1)
            kill_tree(agents[1].pid)
            killed_at = time.monotonic()
            (root.parent / "go_on").touch()
            code = agents[0].wait(timeout=timeout)
            seconds = time.monotonic() - killed_at
        finally:
            for agent in agents:
                kill_tree(agent.pid)
    output = (root.parent / "agent0.log").read_text()
    result = {
        "optimizer": optimizer,
        "stage": stage,
        "rdzv_conf": rdzv_conf or "torchrun's defaults",
        "seconds_after_kill": round(seconds, 1),
        "survivor_exit_code": code,
        # Each worker that failed, in order, as the agent logged it: the first is the one that lost its peer (75).
        "worker_failures": [int(c) for c in re.findall(r"failed \(exitcode: (-?\d+)\)", output)],
    }
    if code == 0:
        from common import IndexedRegression, max_param_difference, reference_training

        steps = [list(range(k, k + GLOBAL_BATCH)) for k in range(0, SAMPLES, GLOBAL_BATCH)] * EPOCHS
        reference = reference_training(IndexedRegression(SAMPLES), steps, optimizer_name=optimizer)
        final = json.loads((root / "result.json").read_text())
        result["global_step"] = final["global_step"]
        result["max_param_difference"] = max_param_difference(final, reference)
    else:
        errors = re.findall(r"^\[rank0\]: (\S*(?:Error|Refused): .*)$", output, re.MULTILINE)
        result["error"] = errors[-1][:600] if errors else output[-1500:]  # the last attempt's
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--rdzv-conf", default="", help="torchrun's --rdzv-conf (default: its defaults)")
    parser.add_argument("--runs", type=int, default=1, help="jobs, one after another (each a round)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "elastic_resume.json")
    parser.add_argument("--logs", type=Path, help="keep the two agents' output here (run<N>/ for each job)")
    args = parser.parse_args()
    facts = run_facts("benchmarks/elastic_resume.py", sys.argv[1:], HERE)
    results = []
    for round_ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="elastic-resume-") as directory:
            try:
                result = run(args.optimizer, args.stage, args.rdzv_conf, args.timeout, Path(directory) / "run")
            finally:
                if args.logs is not None:
                    logs = args.logs if args.runs == 1 else args.logs / f"run{round_}"
                    logs.mkdir(parents=True, exist_ok=True)
                    for log in Path(directory).glob("agent*.log"):
                        (logs / log.name).write_text(log.read_text())
        results.append(result)
        print(json.dumps(result, indent=2), flush=True)
    setting = {
        "optimizer": args.optimizer,
        "stage": args.stage,
        "rdzv_conf": args.rdzv_conf or "torchrun's defaults",
        "nnodes": "1:2",
        "nproc_per_node": 1,
        "max_restarts": 3,
        "samples": SAMPLES,
        "global_batch": GLOBAL_BATCH,
        "epochs": EPOCHS,
        "steps": SAMPLES // GLOBAL_BATCH * EPOCHS,
        "checkpoint_every": 5,
        "killed_after_step": 5,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**facts, "setting": setting, "runs": results}, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
