"""Does a bf16 Linear slow down when the row counts it sees outnumber oneDNN's primitive cache?

    python benchmarks/onednn_shapes.py [--rows 300] [--passes 4] [--padded]
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=8192 python benchmarks/onednn_shapes.py

SmolLM2-135M's five Linear shapes (q/o, k/v, gate/up, down, the LM head) in bf16 on one thread,
over the row counts 1..--rows in a shuffled order, --passes times: the mean time per row count of
each pass. oneDNN compiles a kernel per shape and keeps ONEDNN_PRIMITIVE_CACHE_CAPACITY of them
(1,024 by default): past it every pass compiles again. --padded runs each count at
engine.ragged.padded_tokens' size instead, as a bf16 generation step does.
"""

from __future__ import annotations

import argparse
import os
import random
import time

HIDDEN, INTERMEDIATE, KV, VOCAB = 576, 1536, 192, 49152
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE), (VOCAB, HIDDEN)]
"""(out, in) of SmolLM2-135M's Linear layers."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300, help="row counts 1..ROWS, as a step's running rows plus prompt tokens")
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--padded", action="store_true", help="each count at engine.ragged.padded_tokens' size")
    args = parser.parse_args()

    import torch

    from engine.ragged import padded_tokens

    torch.set_num_threads(1)
    weights = [torch.randn(out, inp, dtype=torch.bfloat16) for out, inp in SHAPES]
    counts = sorted({padded_tokens(m) if args.padded else m for m in range(1, args.rows + 1)})
    inputs = {(m, inp): torch.randn(m, inp, dtype=torch.bfloat16) for m in counts for inp in (HIDDEN, INTERMEDIATE)}
    capacity = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024 (default)")
    print(f"{len(counts)} row counts × {len(SHAPES)} shapes = {len(counts) * len(SHAPES)} kernels; cache capacity {capacity}", flush=True)
    for n in range(args.passes):
        order = list(range(1, args.rows + 1))
        random.Random(n).shuffle(order)
        start = time.perf_counter()
        with torch.inference_mode():
            for m in order:
                size = padded_tokens(m) if args.padded else m
                for weight, (_, inp) in zip(weights, SHAPES):
                    torch.nn.functional.linear(inputs[(size, inp)], weight)
        print(f"pass {n}: {(time.perf_counter() - start) / args.rows * 1000:.2f} ms per row count", flush=True)


if __name__ == "__main__":
    main()
