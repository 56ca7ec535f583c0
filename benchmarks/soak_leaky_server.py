"""The soak's positive control: `selftune serve` plus a thread that leaks MB_PER_MIN.

    python benchmarks/soak_leaky_server.py MB_PER_MIN serve --config FILE
"""

import sys
import threading
import time

from autotune.cli import main

hoard = []


def leak(mb_per_min: float) -> None:
    while True:
        hoard.append(bytearray(int(mb_per_min * 2**20 / 6)))  # touched pages: real RSS
        for chunk in hoard[-1:]:
            chunk[::4096] = b"x" * len(chunk[::4096])
        time.sleep(10)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    threading.Thread(target=leak, args=(float(sys.argv[1]),), daemon=True).start()
    sys.exit(main(sys.argv[2:]))
