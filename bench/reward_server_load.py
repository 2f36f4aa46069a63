"""Load on the reward server over loopback: throughput and latency with 1, 4 and 16 concurrent clients.

A real server process (``python -m flowrl.reward_server``, 127.0.0.1, one torch thread) serves the
embedded digit classifier + ink; each client is a thread of this process with its own ``RemoteReward``,
sending requests of ``--batch`` samples back to back for ``--seconds`` (after one warm-up request each);
every cell runs ``--repeats`` times, the cells interleaved, and its numbers pool the repeats.
Every client count runs against dynamic batching (``coalesce: true``) at each ``--max-wait-ms`` and with
batching off (one request per reward call). The baseline is the same reward called in this process on the same batches.
Per row: requests/s, samples/s, p50/p99 request latency and the mean samples per reward call (from the
server's /health counters). Prints a Markdown table, then one JSON line.

    python bench/reward_server_load.py [--clients 1 4 16] [--seconds 4] [--repeats 2] [--batch 16] [--max-wait-ms 0 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.request import urlopen

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.config import RewardConfig  # noqa: E402
from flowrl.reward_models import build_reward_from_config  # noqa: E402
from flowrl.reward_models.remote import RemoteReward  # noqa: E402

COMPONENTS = {"digit_classifier": 1.0, "ink": 0.5}
TOKEN = "bench-token"


def batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=g), [f"a handwritten {i % 10}" for i in range(n)], [{"digit": i % 10} for i in range(n)]


def summary(latencies: list[float], wall: float, samples: int, calls: int) -> dict:
    ms = np.array(latencies) * 1000
    return {
        "requests_per_s": len(latencies) / wall,
        "samples_per_s": samples / wall,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "requests": len(latencies),
        "samples_per_call": samples / max(calls, 1),
    }


def in_process(n: int, seconds: float) -> tuple[list[float], float, int]:
    """(call latencies, wall seconds, samples scored) of the reward called in this process."""
    reward = build_reward_from_config(RewardConfig(components=COMPONENTS))
    x = batch(n, 0)
    reward(*x)
    latencies, start = [], time.monotonic()
    while time.monotonic() < start + seconds:
        t0 = time.monotonic()
        with torch.no_grad():
            reward(*x)
        latencies.append(time.monotonic() - t0)
    return latencies, time.monotonic() - start, n * len(latencies)


class Server:
    def __init__(self, tmp: Path, **config) -> None:
        path = tmp / "server.yaml"
        path.write_text(yaml.safe_dump({"reward": {"components": COMPONENTS}, "port": 0, "device": "cpu", **config}))
        env = dict(os.environ, FLOWRL_REWARD_TOKEN=TOKEN, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        self.log = open(tmp / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowrl.reward_server", str(path)], stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=REPO
        )
        line = self.proc.stdout.readline().strip()
        match = re.fullmatch(r"flowrl reward server listening on (http://\S+)", line)
        if not match:
            self.stop()
            raise SystemExit(f"the server did not start: {line!r}; see {tmp / 'server.log'}")
        self.url = match.group(1)

    def health(self) -> dict:
        with urlopen(self.url + "/health", timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def load(server: Server, clients: int, n: int, seconds: float) -> tuple[list[float], float, int, int]:
    """(request latencies, wall seconds, samples scored, reward calls) of ``clients`` threads for ``seconds``."""
    rewards = [RemoteReward(server.url, token=TOKEN, timeout=60) for _ in range(clients)]
    batches = [batch(n, i) for i in range(clients)]
    for reward, x in zip(rewards, batches):  # warm-up: first connection, first model call
        reward(*x)
    before = server.health()
    latencies: list[list[float]] = [[] for _ in range(clients)]
    go = threading.Barrier(clients + 1)
    end = [0.0]

    def client(i: int) -> None:
        go.wait()
        while time.monotonic() < end[0]:
            t0 = time.monotonic()
            rewards[i](*batches[i])
            latencies[i].append(time.monotonic() - t0)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start = time.monotonic()
    end[0] = start + seconds
    go.wait()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    after = server.health()
    return [x for per in latencies for x in per], wall, after["samples"] - before["samples"], after["batches"] - before["batches"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--seconds", type=float, default=4.0, help="per cell and repeat")
    p.add_argument("--repeats", type=int, default=2, help="rounds over every cell, interleaved (a shared machine drifts)")
    p.add_argument("--batch", type=int, default=16, help="samples per request")
    p.add_argument("--max-wait-ms", type=float, nargs="+", default=[0.0, 5.0])
    args = p.parse_args()
    torch.set_num_threads(1)
    waits = [*args.max_wait_ms, None]  # None: batching off
    name = {w: f"server, batching, max_wait_ms {w:g}" if w is not None else "server, batching off" for w in waits}
    cells: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        try:
            for i, wait in enumerate(waits):
                folder = Path(tmp) / str(i)
                folder.mkdir()
                servers[wait] = Server(folder, coalesce=wait is not None, max_wait_ms=wait or 0.0, max_batch=max(256, args.batch * 16))
            for _ in range(args.repeats):
                base = in_process(args.batch, args.seconds)
                cell = cells.setdefault(("in-process reward", 1), [[], 0.0, 0, 0])
                cell[0] += base[0]
                cell[1] += base[1]
                cell[2] += base[2]
                cell[3] += len(base[0])
                for clients in args.clients:
                    for wait in waits:
                        lat, wall, samples, calls = load(servers[wait], clients, args.batch, args.seconds)
                        cell = cells.setdefault((name[wait], clients), [[], 0.0, 0, 0])
                        cell[0] += lat
                        cell[1] += wall
                        cell[2] += samples
                        cell[3] += calls
                        print(f"{name[wait]}, {clients} clients: {samples / wall:.0f} samples/s", file=sys.stderr, flush=True)
        finally:
            for server in servers.values():
                server.stop()
    rows = [dict(setting=k[0], clients=k[1], **summary(lat, wall, samples, calls)) for k, (lat, wall, samples, calls) in cells.items()]
    print("| setting | clients | requests/s | samples/s | p50 ms | p99 ms | samples per reward call |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['setting']} | {r['clients']} | {r['requests_per_s']:.0f} | {r['samples_per_s']:.0f} | "
            f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['samples_per_call']:.1f} |"
        )
    print(json.dumps({"batch": args.batch, "seconds": args.seconds, "repeats": args.repeats, "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
