"""How one sequence picks its tokens: one frozen type from the HTTP layer to the worker.

Torch-free, so the front process, the messages and the worker share it; the worker's
`engine/generation.py` applies it to logits.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20
"""Most alternatives per token that `logprobs` may ask for (OpenAI allows 20 on chat)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated on construction, so bad input fails before it reaches a worker."""

    max_tokens: int = 16
    """Generated tokens (not counting the prompt) after which the sequence finishes with "length"."""
    temperature: float = 1.0
    """0 means greedy (argmax), like OpenAI; otherwise logits are divided by it before softmax."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches top_p."""
    seed: int | None = None
    """Seeds a per-sequence torch.Generator, so the same seed gives the same tokens whatever
    else is in the batch. None draws a seed from torch's default RNG."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that finish the sequence with "stop", in addition to the model's EOS ids."""
    top_k: int = 0
    """Keep only the k most likely tokens before top_p; 0 (or -1, vLLM's spelling) keeps all."""
    min_tokens: int = 0
    """EOS and stop_token_ids cannot be sampled before this many tokens (vLLM's min_tokens)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS (benchmarks fix output lengths with it); stop_token_ids still stop."""
    repetition_penalty: float = 1.0
    """CTRL-style: logits of tokens in the prompt or the output are divided (if > 0) or
    multiplied (if < 0) by it; 1 changes nothing."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time it is already in the output."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) added to that token's logit before sampling (OpenAI's logit_bias)."""
    logprobs: int | None = None
    """None: no log-probabilities; k >= 0: each token's log-probability under the model (its raw
    log-softmax, before temperature and penalties) and the k most likely alternatives."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1: off), got {self.top_k!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if any(not -100.0 <= bias <= 100.0 or token < 0 for token, bias in self.logit_bias):
            raise ValueError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100], got {self.logit_bias!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax (temperature 0); such sequences need no generator."""
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log-probability and the most likely alternatives at its step."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability), most likely first."""
