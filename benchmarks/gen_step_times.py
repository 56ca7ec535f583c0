"""Where a generation step's time goes: the engine's GenerationRunner in-process, one thread,
some rows decoding while a long prompt is prefilled in chunks beside them.

    python benchmarks/gen_step_times.py [--rows 3] [--prompt 256] [--chunks 32,64,128] [--dtypes float32,bfloat16] [--rounds 2]

For each (dtype, chunk), in rotating order, `--rounds` times: the median step with only the rows
decoding, every step while the prompt prefills (the chunk beside the rows' decode, one model call
since engine/ragged.py; two before), and the first step after it joined (engine/gen_chunk.py's timing,
what `max_batch_tokens: auto` measures at start-up). A call of a small model on
a CPU reads all its weights once, so each extra model call in a step costs about one decode step.
"""

from __future__ import annotations

import argparse
import statistics

from engine.gen_chunk import time_chunk_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--rows", type=int, default=3, help="sequences decoding while the prompt prefills")
    parser.add_argument("--prompt", type=int, default=256, help="tokens of the prompt prefilled in chunks")
    parser.add_argument("--chunks", default="32,64,128", help="max_batch_tokens values")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.model_source import resolve_model

    torch.set_num_threads(1)
    path = resolve_model(args.model, EngineConfig().cache_dir).path
    models = {name: AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, name)).eval() for name in args.dtypes.split(",")}
    cells = [(dtype, int(chunk)) for chunk in args.chunks.split(",") for dtype in models]
    for r in range(args.rounds):
        for dtype, chunk in cells[r % len(cells):] + cells[: r % len(cells)]:  # a rotating start, so drift spreads over the cells
            got = time_chunk_steps(models[dtype], args.rows, args.prompt, chunk)
            steps = got["prefill_steps_ms"]
            print(f"round {r + 1} {dtype:8s} chunk {chunk:4d}: decode {got['decode_ms']:.0f} ms ({args.rows} rows); while prefilling "
                  f"{len(steps)} steps, median {statistics.median(steps):.0f} ms, max {max(steps)} ms; joined {got['joined_ms']:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
