"""The OpenAI API's request and response bodies as pydantic models (the server's OpenAPI schema).

Field names, defaults and shapes follow OpenAI's API reference; the extras vLLM users rely on
(`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens`, `include_stop_str_in_output`) are accepted the same way. Range checks live
here, so a bad value is a 400 naming the field before anything reaches the engine. Unknown fields
are ignored (OpenAI's clients send some), as vLLM does.
"""
from __future__ import annotations

import time
import uuid
from typing import Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

SEED_MAX = 2**63 - 1024  # sample i of a seeded request draws with seed + i: stay inside int64


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# ---------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[int, str]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    include_usage: Optional[bool] = False


class _SamplingRequest(BaseModel):
    """Fields both endpoints share. A field sent as null takes its default, as OpenAI's API does."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=512)
    n: Optional[int] = Field(1, ge=1)
    temperature: Optional[float] = Field(1.0, ge=0.0)
    top_p: Optional[float] = Field(1.0, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(-1, ge=-1, description="-1 or 0: all tokens")
    min_p: Optional[float] = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(1.0, gt=0.0)
    seed: Optional[int] = Field(None, ge=0, le=SEED_MAX)
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[int] = Field(0, ge=0)
    skip_special_tokens: Optional[bool] = True
    include_stop_str_in_output: Optional[bool] = False
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[Dict[str, float]] = None  # not supported: a non-empty one is a 400
    user: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0)
    echo: Optional[bool] = False
    best_of: Optional[int] = Field(None, ge=1)  # only best_of == n (no ranking of extra samples)
    suffix: Optional[str] = None  # not supported: a 400


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[TextPart]]] = None
    name: Optional[str] = None


class ResponseFormat(BaseModel):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingRequest):
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[List[dict]] = None  # not supported: a non-empty list is a 400


# ---------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(BaseModel):
    tokens: List[str] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)
    text_offset: List[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None  # the stop string or token id that ended it (vLLM's extra)


class _Response(BaseModel):
    """The envelope every completion body and chunk shares (subclasses narrow `object` and `choices`)."""

    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: List[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[List[TokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: List[ChatChoice]


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):  # OpenAI's deltas name only what they carry
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: List[ChatStreamChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moe_infer"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class VersionResponse(BaseModel):
    version: str
