"""How the UI's API answers over many long runs: `python benchmarks/ui_scale.py [--runs 200] [--steps 100000]`.

Writes RUNS run folders of STEPS logged steps each (a config, metrics.jsonl; nothing trained) under a scratch
folder, or reuses them with --keep FOLDER, then times, through the app itself (Starlette's test client, no
network), what the page asks: the runs table, one run's page and curves, the curves again (cached), a zoomed
range, a compare of 2, 20 and every run's configs and curves, and one run's events. Prints one row per request:
first and repeated seconds, and the response's size.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path


def write_runs(root: Path, runs: int, steps: int) -> None:
    rng = random.Random(0)
    for index in range(runs):
        run = root / f"run-{index:03d}"
        if (run / "metrics.jsonl").is_file():
            continue
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.yaml").write_text(f"stage: diffusion\nmode: lora\nmodel: {{family: flux}}\nseed: {index}\n"
                                         f"train: {{max_steps: {steps}}}\n")
        lines = (json.dumps({"step": s, "loss": 1.0 / s + rng.random() * 0.01, "lr": 1e-4, "img_per_s": 20.0,
                             "samples": 4 * s, "grad_norm": 1.0}) for s in range(1, steps + 1))
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def timed(client, url: str, repeats: int = 3) -> tuple[float, float, int]:
    """Seconds of the first request, median of `repeats` more, and the body's bytes."""
    began = time.perf_counter()
    response = client.get(url)
    first = time.perf_counter() - began
    assert response.status_code == 200, (url, response.status_code, response.text[:200])
    again = []
    for _ in range(repeats):
        began = time.perf_counter()
        client.get(url)
        again.append(time.perf_counter() - began)
    return first, statistics.median(again), len(response.content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--keep", type=Path, help="write (or reuse) the run folders here")
    args = parser.parse_args()

    from starlette.testclient import TestClient

    from sdtrain.ui.app import create_app

    with tempfile.TemporaryDirectory(prefix="sdtrain-ui-scale-") as scratch:
        root = args.keep or Path(scratch)
        began = time.perf_counter()
        write_runs(root, args.runs, args.steps)
        print(f"{args.runs} runs of {args.steps:,} steps under {root} ({time.perf_counter() - began:.0f} s to write)")
        names = [f"run-{i:03d}" for i in range(args.runs)]
        requests = [
            ("runs table", "/api/runs"),
            ("a run's page", f"/api/runs/{names[0]}"),
            ("its curves (loss, lr, img/s)", f"/api/runs/{names[1]}/metrics?keys=loss,lr,img_per_s"),
            ("its curves zoomed to 1,000 steps", f"/api/runs/{names[1]}/metrics?keys=loss&from=5000&to=6000"),
            ("its events", f"/api/runs/{names[1]}/events?after=0"),
            ("compare 2: configs", f"/api/compare?runs={','.join(names[:2])}"),
            ("compare 20: configs", f"/api/compare?runs={','.join(names[:20])}"),
            (f"compare {args.runs}: configs", f"/api/compare?runs={','.join(names)}"),
        ]
        with TestClient(create_app(root, poll=False), base_url="http://127.0.0.1") as client:
            print(f"{'request':<40} {'first s':>8} {'again s':>8} {'bytes':>10}")
            for label, url in requests:
                first, again, size = timed(client, url)
                print(f"{label:<40} {first:8.3f} {again:8.3f} {size:10,}")
            # The compare page asks each run's curves: the cost of 20 runs' loss, none cached yet.
            began = time.perf_counter()
            for name in names[2:22]:
                client.get(f"/api/runs/{name}/metrics?keys=loss")
            print(f"{'20 more runs curves (loss), uncached':<40} {time.perf_counter() - began:8.3f}")


if __name__ == "__main__":
    main()
