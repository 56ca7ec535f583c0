"""A naive generation server, the baseline a team writes first: FastAPI + `model.generate`, one
request at a time, each token streamed as generate() makes it; a closed stream stops its generation (else a cut request would hold the lock to the end). A peer for
`selftune bench --task generate --url` (docs/BENCHMARKS.md), not part of selftune.

    python benchmarks/naive_generate_server.py MODEL_DIR [--port 8030] [--threads 2]

OpenAI-shaped enough for the bench: POST /v1/completions (prompt as text or token ids,
max_tokens, temperature, ignore_eos, stream) and GET /v1/models.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_app(model_dir: str, threads: int, dtype: str = "float32"):
    import torch
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    class TokenQueue(BaseStreamer):
        """generate()'s tokens, one by one, to the event stream (the first put is the prompt)."""

        def __init__(self):
            self.tokens: queue.Queue = queue.Queue()
            self.prompt_seen = False

        def put(self, value):
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            for token in value.reshape(-1).tolist():
                self.tokens.put(token)

        def end(self):
            self.tokens.put(None)

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    name = os.path.basename(os.path.normpath(model_dir))
    one_at_a_time = threading.Lock()  # what makes it naive: generate() serves one request
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "naive"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        prompt = body.get("prompt", "")
        ids = prompt if isinstance(prompt, list) else tokenizer(prompt).input_ids
        streamer = TokenQueue()
        max_tokens = int(body.get("max_tokens") or 16)
        gone = threading.Event()  # the client closed the stream: stop generating for it
        kwargs = {"input_ids": torch.tensor([ids]), "max_new_tokens": max_tokens, "streamer": streamer, "do_sample": False,
                  "stopping_criteria": StoppingCriteriaList([lambda input_ids, scores, **kw: gone.is_set()])}
        if body.get("ignore_eos"):
            kwargs["min_new_tokens"] = max_tokens

        def generate():
            with one_at_a_time, torch.inference_mode():
                model.generate(**kwargs)

        threading.Thread(target=generate, daemon=True).start()
        if not body.get("stream"):
            tokens = []
            while (token := await asyncio.to_thread(streamer.tokens.get)) is not None:
                tokens.append(token)
            return JSONResponse({"object": "text_completion", "model": name, "choices": [{"index": 0, "text": tokenizer.decode(tokens), "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}})

        async def events():
            created, made = int(time.time()), 0
            try:
                while (token := await asyncio.to_thread(streamer.tokens.get)) is not None:
                    made += 1  # one chunk per token, as the bench's load generator counts them
                    chunk = {"object": "text_completion", "created": created, "model": name, "choices": [{"index": 0, "text": tokenizer.decode([token]), "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                usage = {"prompt_tokens": len(ids), "completion_tokens": made, "total_tokens": len(ids) + made}
                yield f"data: {json.dumps({'object': 'text_completion', 'model': name, 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                gone.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--port", type=int, default=8030)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(build_app(args.model_dir, args.threads, args.dtype), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
