"""Count how many of Lightning 2.6.5's DeepSpeed tests (adapted to CPU, lightning_tests.py) pass for a strategy.

    python benchmarks/lightning_compat/count.py hetero      # HeteroStrategy (the package of this checkout)
    python benchmarks/lightning_compat/count.py deepspeed   # Lightning's DeepSpeedStrategy, the reference

The CPU tests run in one pytest process; each moved (GPU) test in a process of its own, as Lightning's standalone
tests do (two-rank ones start their second rank themselves). About 10 minutes on 2 cores. Prints one line per moved
test, the counts, and writes every outcome to --out (JSON), with the command, the commit, the machine, the date and
the versions of Lightning, DeepSpeed and torch. A failing second rank kills the first before it reports: that is
counted as a failure. The tests import the package of the checkout this script is in (first on PYTHONPATH), so a run
from a git worktree counts that worktree, and the commit it records is the one counted. The committed counts
(``benchmarks/measured/lightning_compat_<strategy>.json``) are rendered by ``benchmarks/render.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the benchmarks' shared helpers (jobs.py)
from jobs import checkout_first, run_facts  # noqa: E402

TESTS = HERE / "lightning_tests.py"
OUTCOME = r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\S* \S*::{}(?:\s|$)"
WORST_FIRST = ("FAILED", "ERROR", "XPASS", "XFAIL", "SKIPPED", "PASSED")


def run(arguments: list[str], env: dict[str, str], timeout: float) -> str:
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *arguments]
    process = subprocess.Popen(
        command, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output = process.communicate()[0] + "\nTIMEOUT"
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # a second rank left behind
        except ProcessLookupError:
            pass
    return output


def outcome(output: str, test: str) -> str:
    found = set(re.findall(OUTCOME.format(re.escape(test)), output, re.M))
    if re.search(r"Child process with PID \d+ terminated with code [1-9]", output) or "TIMEOUT" in output:
        found.add("FAILED")
    return next((o for o in WORST_FIRST if o in found), "FAILED")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy", choices=["hetero", "deepspeed"])
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/lightning_compat_<strategy>.json")
    args = parser.parse_args()
    args.out = args.out or HERE.parent / "results" / f"lightning_compat_{args.strategy}.json"
    facts = run_facts("benchmarks/lightning_compat/count.py", sys.argv[1:], HERE)
    versions = library_versions()  # (before the 10 minutes of tests: a missing library fails at once)
    env = checkout_first(HERE.parents[1], LT_STRATEGY=args.strategy, PYTHONWARNINGS="ignore")
    env.pop("LT_STANDALONE", None)
    output = run([str(TESTS)], env, 900)
    tests = re.findall(r"^(?:PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\S* \S*::(\S+)", output, re.M)
    cpu = {test: outcome(output, test) for test in tests if outcome(output, test) != "SKIPPED"}
    collected = run(["--collect-only", str(TESTS)], {**env, "LT_STANDALONE": "1"}, 300)
    moved = [line.split("::", 1)[1] for line in collected.splitlines() if "::" in line]
    moved = [test for test in moved if test not in cpu]
    results = {}
    for test in moved:
        started = time.perf_counter()
        results[test] = outcome(run([f"{TESTS}::{test}"], {**env, "LT_STANDALONE": "1"}, 420), test)
        print(f"{results[test]:8s} {time.perf_counter() - started:5.0f}s {test}", flush=True)
    print(
        f"{args.strategy}: CPU tests {dict(Counter(cpu.values()))} of {len(cpu)}; moved tests"
        f" {dict(Counter(results.values()))} of {len(results)}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {**facts, "versions": versions, "strategy": args.strategy, "cpu": cpu, "moved": results}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written to {args.out}")


def library_versions() -> dict[str, str]:
    """The versions the counts were taken with (Lightning's tests are those of its 2.6.5 release)."""
    from importlib.metadata import version

    return {name: version(name) for name in ("lightning", "deepspeed", "torch")}


if __name__ == "__main__":
    main()
