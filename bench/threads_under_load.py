"""The README's main job while another CPU job runs: torch's default threads against flowrl's one thread.

torch starts one intra-op thread per core. On a machine whose cores are busy with something else (a second run, a
reward server, a browser), the embedded model's tiny kernels then wait on each other at every operation. flowrl runs
the embedded and toy models on one thread (``PipelineSection.default_num_threads``); this measures what that is
worth: the same ``flowrl train digits/grpo`` (shortened to ``--iterations``), once with ``train.num_threads`` set to
the core count (what torch would choose) and once with flowrl's own choice, each while another CPU job runs (a torch
loop on torch's default threads, or ``--other python``: a pure-Python loop on one core), in one run, alternating. Prints the wall times and ``ratio_default_over_flowrl``.

    python bench/threads_under_load.py [--iterations 5] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# "Another CPU job": a torch job with torch's default threads (another run, an evaluation, a reward model), the common
# case on a shared machine; ``--other python`` makes it a single-threaded pure-Python loop instead.
OTHER = {
    "torch": "import torch\na = torch.randn(256, 256)\nwhile True:\n    a = torch.tanh(a @ a)\n",
    "python": "while True:\n    sum(i * i for i in range(10000))\n",
    # another training of the embedded model on torch's default threads, as flowrl ran it before it chose its threads
    "flowrl": "import sys, tempfile\nfrom flowrl.cli import main\nmain(['train', 'digits/grpo', 'train.iterations=100000', 'eval.every=0', "
    "'log.trackers=[]', 'log.progress=false', 'log.checkpoint_every=0', 'train.num_threads=%d', 'output_dir=' + tempfile.mkdtemp()])\n",
}


def train(iterations: int, threads: int | None, out: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}  # let torch choose
    env["PYTHONPATH"] = str(REPO)
    extra = [f"train.num_threads={threads}"] if threads else []
    cmd = [sys.executable, "-m", "flowrl.cli", "train", "digits/grpo", f"train.iterations={iterations}", "eval.every=0", "log.trackers=[]",
           "log.progress=false", f"output_dir={out}", *extra]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--other", choices=sorted(OTHER), default="torch", help="the other CPU job running meanwhile")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(REPO)
    other = OTHER[args.other] % cores if args.other == "flowrl" else OTHER[args.other]
    busy = subprocess.Popen([sys.executable, "-c", other], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(10)  # let it start its work
    times: dict[str, list[float]] = {"default": [], "flowrl": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                times["default"].append(train(args.iterations, cores, Path(tmp) / f"default{r}"))
                times["flowrl"].append(train(args.iterations, None, Path(tmp) / f"flowrl{r}"))
    finally:
        busy.kill()
    result = {"cores": cores, "iterations": args.iterations, "other_job": args.other, "seconds_default_threads": times["default"],
              "seconds_flowrl_threads": times["flowrl"],
              "ratio_default_over_flowrl": round(min(times["default"]) / min(times["flowrl"]), 2)}  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
