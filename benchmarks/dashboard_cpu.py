"""Dashboard cost: CPU of the page in headless chromium, and of the server answering it.

One idle server (the default model, autotuning on). Windows alternate: the dashboard open, the
browser open on a blank page (the browser's own floor), no browser; again and again (this VM's
speed drifts), each `--seconds` long. In each window it reads the CPU time of the server's
front process and of every chromium process. Reports every window and the means, as % of one
core: the page costs the server (dashboard - no browser) and the browser (dashboard - blank).

    python benchmarks/dashboard_cpu.py [--rounds 3] [--seconds 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import psutil

from autotune.bench.browser import headless_chromium
from autotune.bench.server import ServerProcess, cpu_seconds


def open_page(url: str):
    driver = headless_chromium()
    driver.get(url)
    return driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    srv = ServerProcess(tempfile.mkdtemp(prefix="dashboard-cpu-"), {})
    front = psutil.Process(srv.proc.pid)
    modes = ("dashboard", "blank page", "no browser")
    runs = {mode: {"server": [], "browser": []} for mode in modes}
    try:
        for round_ in range(args.rounds):
            for mode in modes:
                driver = None if mode == "no browser" else open_page(srv.url + "/dashboard" if mode == "dashboard" else "about:blank")
                time.sleep(3)  # past the page's first load
                browser = [psutil.Process(driver.service.process.pid), *psutil.Process(driver.service.process.pid).children(recursive=True)] if driver else []
                s0, b0, t0 = cpu_seconds([front]), cpu_seconds(browser), time.monotonic()
                time.sleep(args.seconds)
                wall = time.monotonic() - t0
                server, page = (cpu_seconds([front]) - s0) / wall * 100, (cpu_seconds(browser) - b0) / wall * 100
                if driver:
                    driver.quit()
                runs[mode]["server"].append(server)
                runs[mode]["browser"].append(page)
                print(f"round {round_ + 1}/{args.rounds} {mode}: server front {server:.2f} % of a core, browser {page:.2f} %", file=sys.stderr, flush=True)
    finally:
        srv.stop()
    summary = {mode: {k: {"runs": v, "mean": statistics.fmean(v)} for k, v in parts.items()} for mode, parts in runs.items()}
    print("| window | server front, % of a core (runs; mean) | chromium, % of a core (runs; mean) |\n|---|---|---|")
    for mode, parts in summary.items():
        cells = [f"{', '.join(f'{x:.2f}' for x in parts[k]['runs'])}; **{parts[k]['mean']:.2f}**" for k in ("server", "browser")]
        print(f"| {mode} | {cells[0]} | {cells[1]} |")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
