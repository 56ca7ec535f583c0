"""Request and response bodies of the OpenAI-compatible API, validated by pydantic.

Every field has limits; unknown fields are rejected (a typo should not be silently ignored),
except the few that OpenAI clients send and that change nothing here (`user`).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

MAX_TEXT_CHARS = 1_000_000
MAX_TOKENS_LIMIT = 1_000_000


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
Text = Annotated[StrictStr, Field(max_length=MAX_TEXT_CHARS)]


class EmbeddingRequest(Strict):
    input: Union[Text, list[Text], list[TokenId], list[list[TokenId]]]
    model: Annotated[StrictStr, Field(max_length=256)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    user: Annotated[StrictStr, Field(max_length=256)] | None = None


class StreamOptions(Strict):
    include_usage: bool = False


Stop = Union[Annotated[StrictStr, Field(min_length=1, max_length=256)], Annotated[list[Annotated[StrictStr, Field(min_length=1, max_length=256)]], Field(max_length=4)], None]


class SamplingFields(Strict):
    model: Annotated[StrictStr, Field(max_length=256)]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    user: Annotated[StrictStr, Field(max_length=256)] | None = None


class CompletionRequest(SamplingFields):
    prompt: Union[Text, Annotated[list[TokenId], Field(min_length=1)]]


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text
    name: Annotated[StrictStr, Field(max_length=256)] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]


class KnobsPatch(Strict):
    """Knobs to set (and pin) through the admin API; omitted knobs stay as they are."""

    process_count: StrictInt | None = None
    threads_per_process: StrictInt | None = None
    io_threads: StrictInt | None = None
    batch_timeout: Annotated[float, Field(allow_inf_nan=False)] | None = None
    max_batch_size: StrictInt | None = None
