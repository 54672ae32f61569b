"""The OpenAI request bodies the server accepts, and the error body it answers with.

Mirrors vLLM ``vllm/entrypoints/openai/protocol.py`` (a small subset of its fields).

Inputs
    a JSON body of ``/v1/completions`` (``CompletionRequest``; its ``prompt`` in any of
    OpenAI's four forms, ``split_prompts``), ``/v1/chat/completions``
    (``ChatCompletionRequest``), ``/tokenize`` (``TokenizeCompletionRequest`` or
    ``TokenizeChatRequest``) or ``/detokenize`` (``DetokenizeRequest``). Types are strict
    (``"5"`` is not an int) and unknown fields are refused, so a typo is a 400 rather than a
    silently ignored knob.
Outputs
    ``to_sampling_kwargs()``: keyword arguments for ``SamplingParams`` under vLLM's names.
    OpenAI fields the engine's ``SamplingParams`` does not have (yet) are refused with a
    400 naming the field when set to anything but their neutral value.
Failure mode
    ``ValueError`` naming the field (``PromptError.param``: which prompt); the server turns it into ``error_body(...)``, the
    OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import dataclasses
from http import HTTPStatus
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from minipaged.sampling_params import SamplingParams

# fields of a request -> SamplingParams under the same vLLM name, passed on only where the
# engine's SamplingParams has them; the value that means "off" for each.
PASSTHROUGH_NEUTRAL = {
    "stop": None,
    "logprobs": None,
    "min_tokens": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


def sampling_params_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(SamplingParams)}


def error_body(message: str, status: int, param: Optional[str] = None) -> dict:
    """The OpenAI error shape; ``type`` is the status's name as vLLM writes it
    (``BadRequestError``, ``NotFoundError``; ``InternalServerError``, not ...ErrorError)."""
    phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    kind = phrase if phrase.endswith("Error") else f"{phrase}Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None  # vLLM extension: 0 or -1 = off
    seed: Optional[int] = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False  # vLLM extension
    min_tokens: int = 0  # vLLM extension
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extension
    user: Optional[str] = None  # accepted and ignored, as by vLLM

    def _logprobs(self) -> Optional[int]:
        return None

    def to_sampling_kwargs(self, default_max_tokens: int) -> dict:
        """``SamplingParams`` keyword arguments; ``ValueError`` names an unsupported field."""
        top_k = self.top_k if self.top_k not in (None, -1) else 0
        kw = dict(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=top_k,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        wanted = {
            "stop": stop or None,
            "logprobs": self._logprobs(),
            "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        have = sampling_params_fields()
        for name, value in wanted.items():
            if value == PASSTHROUGH_NEUTRAL[name]:
                continue
            if name not in have:
                raise ValueError(
                    f"{name} is not supported by this engine yet (SamplingParams has no field {name!r})"
                )
            kw[name] = value
        return kw


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt or several (``split_prompts``)."""

    prompt: Union[str, list[Any]]  # NOTE: the four forms are told apart by split_prompts
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False

    def _logprobs(self) -> Optional[int]:
        return self.logprobs


class PromptError(ValueError):
    """A bad ``prompt``; ``param`` names it (``prompt``, ``prompt[2]``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def _kind(x) -> str:
    if isinstance(x, bool):
        return "bool"
    return {int: "int", str: "str", list: "list"}.get(type(x), type(x).__name__)


def split_prompts(prompt) -> list[tuple[str, Union[str, list]]]:
    """OpenAI's four forms of ``prompt`` -> ``[(name, one prompt)]``, the name for errors.

    ``"text"`` and ``[1, 2, 3]`` are one prompt, named ``prompt``; ``["a", "b"]`` and
    ``[[1, 2], [3]]`` are several, named ``prompt[0]``, ``prompt[1]``... A list mixing
    the forms, or of anything else, is a ``PromptError`` naming the first odd element.
    The prompts themselves (empty, too long, ids outside the vocabulary) are checked by
    ``LLMEngine.tokenize`` under these names.
    """
    if isinstance(prompt, str):
        return [("prompt", prompt)]
    if not prompt:
        raise PromptError("prompt is an empty list: send at least one prompt", "prompt")
    kinds = [_kind(x) for x in prompt]
    for i, k in enumerate(kinds):
        if k not in ("int", "str", "list") or k != kinds[0]:
            raise PromptError(
                f"prompt[{i}] is a {k} (prompt[0] is a {kinds[0]}): prompt must be {PROMPT_FORMS}",
                f"prompt[{i}]",
            )
    if kinds[0] == "int":
        return [("prompt", list(prompt))]
    return [(f"prompt[{i}]", p) for i, p in enumerate(prompt)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: a list of messages, rendered by a chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    max_completion_tokens: Optional[int] = None

    def _logprobs(self) -> Optional[int]:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
            return None
        return self.top_logprobs or 0

    def to_sampling_kwargs(self, default_max_tokens: int) -> dict:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree; send one")
            self.max_tokens = self.max_completion_tokens
        return super().to_sampling_kwargs(default_max_tokens)


# The course model has no chat template of its own: a plain one, as a story model reads it.
COURSE_CHAT_TEMPLATE = "{turns}Assistant:"


def render_chat(
    messages: list[ChatMessage],
    tokenizer,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt for ``messages``: the tokenizer's own chat template where it has one,
    else ``Role: text`` lines followed by ``Assistant:`` (``add_generation_prompt``);
    ``continue_final_message``: the last message left open, for the model to go on with
    (vLLM's two options; both at once is a ``ValueError``)."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    template = getattr(tokenizer, "chat_template", None)
    if template:
        msgs = [{"role": m.role, "content": m.text()} for m in messages]
        kw = {"continue_final_message": True} if continue_final_message else {}
        return tokenizer.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt, tokenize=False, **kw
        )
    turns = "".join(f"{m.role.capitalize()}: {m.text()}\n" for m in messages)
    if continue_final_message:
        return turns[:-1]
    return COURSE_CHAT_TEMPLATE.format(turns=turns) if add_generation_prompt else turns


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a ``prompt`` (vLLM's ``TokenizeCompletionRequest``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with ``messages``, rendered as ``/v1/chat/completions`` renders
    them (vLLM's ``TokenizeChatRequest``; its other template options are refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's ``DetokenizeRequest``): token ids -> ``{"prompt": text}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: Optional[str] = None
    tokens: list[int]
