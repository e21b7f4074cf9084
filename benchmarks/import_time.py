"""How long `import zero_lab`, `zero-lab --help` and `zero-lab ask` take, against `import torch`.

    python benchmarks/import_time.py [--repeats 5] [--before DIR]

Each command runs as a fresh process, `--repeats` times, the commands taking turns so that
machine load hits all alike; the table gives the median wall-clock seconds and the goals
(issue 21: `import zero_lab` within 0.3 s of `import torch`, `zero-lab ask` under 2 s,
`zero-lab --help` under 1 s). `--before DIR` adds the same commands run from another tree
(e.g. `git archive <commit> zero_lab solutions/08_interview | tar -x -C DIR`), in the same run.
Then `python -X importtime` names the slowest imports of `import zero_lab` and of the command
line. Wall-clock on a shared machine: the load average is printed with the figures. No GPU needed,
none used: nothing here runs a rank or touches CUDA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = "import sys; from zero_lab.course_tools.cli import main; sys.argv[0] = 'zero-lab'; sys.exit(main({}))"
COMMANDS = {
    "import torch": "import torch",
    "import zero_lab": "import zero_lab",
    "import zero_lab; zero_lab.prepare": "import zero_lab; zero_lab.prepare",
    "zero-lab --help": CLI.format("['--help']"),
    "zero-lab ask stage 3 bandwidth": CLI.format("['ask', 'stage', '3', 'bandwidth']"),
}


def run(code: str, tree: Path, importtime: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # ahead of the editable install: that tree's zero_lab
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=tree, env=env, capture_output=True, text=True)


def timed(code: str, tree: Path) -> float:
    start = time.perf_counter()
    result = run(code, tree)
    if result.returncode != 0:
        raise RuntimeError(f"{code!r} failed in {tree}:\n{result.stderr}")
    return time.perf_counter() - start


def slowest_imports(code: str, tree: Path, count: int) -> list[tuple[float, str]]:
    """(cumulative seconds, module) of the `count` slowest top-level imports python -X importtime lists."""
    rows = []
    for line in run(code, tree, importtime=True).stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            name = parts[2].rstrip()
            depth = (len(name) - len(name.lstrip())) // 2
            if depth <= 1:
                rows.append((int(parts[1]) / 1e6, name.strip()))
    return sorted(rows, reverse=True)[:count]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="No GPU needed, none used: nothing here runs a rank or touches CUDA.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", type=Path, help="another tree to measure in the same run")
    args = parser.parse_args(argv)
    trees = {"now": REPO, **({"before": args.before.resolve()} if args.before else {})}
    times = {(tree, name): [] for tree in trees for name in COMMANDS}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for tree, name in times:
            times[tree, name].append(timed(COMMANDS[name], trees[tree]))
    load_after = os.getloadavg()
    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"median of {args.repeats} fresh processes, seconds; load average (1, 5, 15 min) "
          f"{', '.join(f'{x:.1f}' for x in load_before)} before, {', '.join(f'{x:.1f}' for x in load_after)} after")
    print(f"{'command':>36} " + " ".join(f"{tree:>8}" for tree in trees))
    for name in COMMANDS:
        print(f"{name:>36} " + " ".join(f"{median[tree, name]:>8.2f}" for tree in trees))
    for tree in trees:
        torch_s = median[tree, "import torch"]
        goals = [("import zero_lab <= import torch + 0.3 s", median[tree, "import zero_lab"] <= torch_s + 0.3),
                 ("import zero_lab; zero_lab.prepare <= import torch + 0.3 s",
                  median[tree, "import zero_lab; zero_lab.prepare"] <= torch_s + 0.3),
                 ("zero-lab ask < 2 s", median[tree, "zero-lab ask stage 3 bandwidth"] < 2),
                 ("zero-lab --help < 1 s", median[tree, "zero-lab --help"] < 1)]
        print(f"{tree}: " + "; ".join(f"{goal}: {'yes' if met else 'NO'}" for goal, met in goals))
    for tree in trees:
        for name in ("import zero_lab", "zero-lab ask stage 3 bandwidth"):
            imports = slowest_imports(COMMANDS[name], trees[tree], 6)
            print(f"{tree}, `{name}`, slowest imports (python -X importtime, cumulative s): "
                  + ", ".join(f"{module} {seconds:.2f}" for seconds, module in imports))


if __name__ == "__main__":
    main()
