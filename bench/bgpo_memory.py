"""Peak memory of one policy update as the number of ELBO Monte Carlo samples grows: BGPO vs naive ELBO-GRPO.

Each (method, n) runs in a fresh process: load the embedded masked-diffusion LM, build a batch of recorded
generations, run the objective's losses with a backward after each LossOutput, and report how far the
process's peak resident memory rose during that update (MB). Naive ELBO-GRPO keeps every sample's graph
alive until its single backward, so its peak grows with n; BGPO backpropagates each sample on its own.

    python bench/bgpo_memory.py [--batch 256] [--samples 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(naive: bool, n: int, batch: int) -> dict:
    sys.path.insert(0, str(REPO))
    import torch

    from flowrl.config import BGPOConfig
    from flowrl.data.arith import PROMPT_LEN, problems
    from flowrl.pipelines.dllm import load_masked_lm
    from flowrl.samplers.masked import generate

    torch.manual_seed(0)
    torch.set_num_threads(1)
    lm = load_masked_lm(str(REPO / "flowrl" / "assets" / "arith_mdlm"))
    tok = lm.tokenizer
    tok.padding_side = "left"
    prompts = [p for p, _ in problems("train", batch, seed=1)]
    enc = tok(prompts, padding="max_length", max_length=PROMPT_LEN, return_tensors="pt")
    traj = generate(lm, enc.input_ids, enc.attention_mask.bool(), 16, 8, 16, temperature=1.0, generator=torch.Generator().manual_seed(0))
    traj.group_ids = torch.arange(batch) // 8
    traj.rewards = torch.rand(batch, generator=torch.Generator().manual_seed(1))
    traj.mask_seeds = torch.randint(0, 2**62, (batch, 1), generator=torch.Generator().manual_seed(2))
    objective = BGPOConfig(num_mc_samples=n, naive=naive).build()
    objective.old_and_ref(lm, traj)
    traj = objective.prepare(traj)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for out in objective.losses(lm, None, traj, torch.Generator()):
        out.loss.backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"method": "naive ELBO-GRPO" if naive else "BGPO", "n": n, "peak_rise_mb": round((after - before) / 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--samples", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--one", nargs=2, metavar=("NAIVE", "N"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.one[0] == "1", int(a.one[1]), a.batch)))
        return
    rows = []
    for naive in (True, False):
        for n in a.samples:
            out = subprocess.run(
                [sys.executable, __file__, "--batch", str(a.batch), "--one", str(int(naive)), str(n)],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"peak memory rise during one update, batch {a.batch}, completion 16 + prompt 24 tokens (MB)")
    print(f"{'n MC samples':<14}" + "".join(f"{n:>8}" for n in a.samples))
    for method in ("naive ELBO-GRPO", "BGPO"):
        print(f"{method:<14}" + "".join(f"{r['peak_rise_mb']:>8}" for r in rows if r["method"] == method))
    naive = [r["peak_rise_mb"] for r in rows if r["method"] == "naive ELBO-GRPO"]
    bgpo = [r["peak_rise_mb"] for r in rows if r["method"] == "BGPO"]
    print(
        f"growth from n={a.samples[0]} to n={a.samples[-1]}: naive x{naive[-1] / max(naive[0], 1e-9):.2f}, BGPO x{bgpo[-1] / max(bgpo[0], 1e-9):.2f}"
    )


if __name__ == "__main__":
    main()
