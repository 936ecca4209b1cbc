"""Request bodies, as TGI's router deserializes them (router/src/lib.rs). Unknown fields are ignored.

Responses are built as plain dicts in `responses.py`; only what clients send is modelled here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

NonNegative = Annotated[int, Field(ge=0, le=2**32 - 1)]  # u32 in TGI
Seed = Annotated[int, Field(ge=0, le=2**64 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Parameters(_Body):
    """TGI's `GenerateParameters`. Nulls mean "not given", as most clients send every key."""

    best_of: NonNegative | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: NonNegative | None = None
    return_full_text: bool | None = None
    stop: list[str] = Field(default_factory=list)
    truncate: NonNegative | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: Seed | None = None
    top_n_tokens: NonNegative | None = None
    grammar: dict[str, Any] | None = None
    adapter_id: str | None = None

    @field_validator("do_sample", "watermark", "details", "decoder_input_details", mode="before")
    @classmethod
    def _null_is_false(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("stop", mode="before")
    @classmethod
    def _null_is_empty(cls, value: Any) -> Any:
        return [] if value is None else value


def _default_parameters() -> Parameters:
    return Parameters(do_sample=True)  # TGI: a request without "parameters" samples


class GenerateRequest(_Body):
    inputs: str
    parameters: Parameters = Field(default_factory=_default_parameters)


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


class ImageUrl(_Body):
    url: str


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


class VideoPart(_Body):
    """vLLM's shape: `{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..." | "https://..."}}`."""

    type: Literal["video_url"]
    video_url: ImageUrl


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; TGI clients an object


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None  # a `tool` message: which call it answers
    name: str | None = None

    def text(self) -> str:
        """TGI's `TextMessage`: parts joined, each image as markdown `![](url)` in its place (a clip as
        `![video](url)`, api/images.py)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(_part_text(p) for p in self.content)


def _part_text(part: TextPart | ImagePart | VideoPart) -> str:
    if isinstance(part, TextPart):
        return part.text
    if isinstance(part, VideoPart):
        return f"![video]({part.video_url.url})"
    return f"![]({part.image_url.url})"


class FunctionDefinition(_Body):
    # OpenAI's documented rule (a-z, A-Z, 0-9, `_`, `-`; at most 64), which its API enforces; TGI takes any name
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    # OpenAI's `parameters`; TGI's own clients send `arguments`
    parameters: dict[str, Any] | None = Field(None, validation_alias=AliasChoices("parameters", "arguments"))
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: FunctionName


class StreamOptions(_Body):
    include_usage: bool = False


class _StopList(_Body):
    @field_validator("stop", mode="before", check_fields=False)
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # OpenAI allows a single string


class ChatRequest(_StopList):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: NonNegative | None = None
    max_tokens: NonNegative | None = Field(None, validation_alias=AliasChoices("max_tokens", "max_completion_tokens"))
    n: int | None = Field(None, ge=1, le=128)  # OpenAI's range; --max-client-batch-size bounds it further
    presence_penalty: float | None = None
    stop: list[str] | None = None
    stream: bool = False
    seed: Seed | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Tool] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; TGI also takes a bare name
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | str | None = None
    tool_prompt: str | None = None  # TGI's: the instruction put after the tools when the template cannot take them
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    stream_options: StreamOptions | None = None


class CompletionRequest(_StopList):
    model: str | None = None
    prompt: str | list[str]
    max_tokens: NonNegative | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    seed: Seed | None = None
    suffix: str | None = None
    n: int | None = Field(None, ge=1, le=128)
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | None = None

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt
