"""Request and response bodies of the OpenAI-compatible API, validated by pydantic.

Every field has limits. The API's request bodies keep unknown fields aside instead of failing
(clients send other servers' extensions): the route lists them in the `x-selftune-ignored-fields`
header and logs each name once, as vLLM does. Parameters that ask for something this server
cannot do (tools, structured output) are declared, so that asking for them is a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from engine.sampling import MAX_LOGPROBS

MAX_TEXT_CHARS = 1_000_000
MAX_TOKENS_LIMIT = 1_000_000
MAX_CHOICES = 16


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Lenient(BaseModel):
    """An API request body: unknown fields land in `model_extra` (see `ignored_fields`)."""

    model_config = ConfigDict(extra="allow")


def ignored_fields(body: BaseModel) -> list[str]:
    return sorted(body.model_extra or ())


TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
Text = Annotated[StrictStr, Field(max_length=MAX_TEXT_CHARS)]
Name = Annotated[StrictStr, Field(max_length=256)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class EmbeddingRequest(Lenient):
    input: Union[Text, list[Text], list[TokenId], list[list[TokenId]]]
    model: Name
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    user: Name | None = None


class StreamOptions(Lenient):
    include_usage: bool = False


StopString = Annotated[StrictStr, Field(min_length=1, max_length=256)]
Stop = Union[StopString, Annotated[list[StopString], Field(max_length=16)], None]


class SamplingFields(Lenient):
    """What /v1/completions and /v1/chat/completions share: OpenAI's parameters and vLLM's
    extensions that benchmark clients send (ignore_eos, min_tokens, top_k, ...). A null means
    the default, as OpenAI's own server takes it."""

    model: Name
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    """OpenAI's current name for the limit; wins over max_tokens."""
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Stop = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]], Field(max_length=300)] | None = None
    ignore_eos: bool | None = False
    min_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    user: Name | None = None
    # Declared so that asking for them is a clear 400 (see completions.refuse_unsupported).
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: Union[Text, Annotated[list[TokenId], Field(min_length=1)]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = False
    suffix: StrictStr | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None


class ContentPart(Lenient):
    """One part of a message's content; only `text` parts are served (see completions.py)."""

    type: Name
    text: Text | None = None


class ChatMessage(BaseModel):
    # Assistant turns replayed by SDKs carry fields such as `refusal` or `tool_calls: null`.
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: Union[Text, Annotated[list[ContentPart], Field(max_length=1024)], None] = None
    name: Name | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(Lenient):
    """vLLM's POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: Name | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Lenient):
    model: Name | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1_000_000)]


class KnobsPatch(Strict):
    """Knobs to set (and pin) through the admin API; omitted knobs stay as they are."""

    process_count: StrictInt | None = None
    threads_per_process: StrictInt | None = None
    io_threads: StrictInt | None = None
    batch_timeout: Annotated[float, Field(allow_inf_nan=False)] | None = None
    max_batch_size: StrictInt | None = None
    max_batch_tokens: StrictInt | None = None
    kv_tokens: StrictInt | None = None
