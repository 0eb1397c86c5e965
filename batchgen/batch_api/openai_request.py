"""OpenAI Batch API request lines (the format `vllm run-batch` reads too):

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 64, ...}}

A line's custom_id was checked with the whole file; everything else is the request's own
and a wrong value is a RequestError for that row."""

from __future__ import annotations

from typing import Any

from batchgen.batch_api.batch_request import CHAT, COMPLETION, BatchRequest
from batchgen.batch_api.request_params import GUIDED_PARAMETERS, RequestError, described
from batchgen.conversation import OPENAI_ROLES, parse_messages

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = {CHAT_URL: CHAT, COMPLETIONS_URL: COMPLETION}
LINE_KEYS = ("custom_id", "method", "url", "body")

_SHARED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "stop",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "response_format",
    *GUIDED_PARAMETERS,
)
# body key -> canonical parameter (job_spec.ROW_PARAMETERS)
CHAT_PARAMETERS = {
    **{k: k for k in _SHARED},
    "top_logprobs": "top_logprobs",
    "max_completion_tokens": "max_tokens",
}
COMPLETION_PARAMETERS = {k: k for k in _SHARED}
# Keys accepted with no effect on the output: metadata of the caller, and streaming off.
_IGNORED = ("model", "user", "metadata")


def parse_openai_line(line: dict) -> BatchRequest:
    unknown = sorted(k for k in line if k not in LINE_KEYS)
    if unknown:
        raise RequestError(unknown[0], "unknown key in the request line")
    method = line.get("method", "POST")
    if method != "POST":
        raise RequestError("method", f"only POST is supported, {described(method)}")
    url = line.get("url")
    if url not in URLS:
        raise RequestError(
            "url", f"unsupported url, expected {CHAT_URL} or {COMPLETIONS_URL}, {described(url)}"
        )
    body = line.get("body")
    if not isinstance(body, dict):
        raise RequestError("body", f"expected an object, {described(body)}")
    endpoint = URLS[url]
    known = CHAT_PARAMETERS if endpoint == CHAT else COMPLETION_PARAMETERS
    content_key = "messages" if endpoint == CHAT else "prompt"
    for key, value in body.items():
        if key == "stream":
            if value not in (False, None):
                raise RequestError("body.stream", "a batch request cannot stream")
        elif key not in known and key not in _IGNORED and key != content_key:
            raise RequestError(f"body.{key}", f"unknown parameter for {url}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("body.model", f"expected a string, {described(model)}")
    request = BatchRequest(endpoint)
    if content_key not in body:
        raise RequestError(f"body.{content_key}", "missing")
    if endpoint == CHAT:
        request.messages = parse_messages("body.messages", body["messages"], OPENAI_ROLES)
    else:
        request.prompt = _prompt(body["prompt"])
    request.params = [(known[k], v, f"body.{k}") for k, v in body.items() if k in known]
    return request


def _prompt(value: Any) -> str | list[int]:
    """A completion prompt: text, or one prompt as token ids. (A list of prompts in one
    request is a batch inside the batch: give each its own line and custom_id.)"""
    if isinstance(value, str):
        if not value:
            raise RequestError("body.prompt", "empty")
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        return list(value)
    raise RequestError(
        "body.prompt",
        f"expected a string or a list of token ids (one prompt per line), {described(value)}",
    )


def request_model(line: dict) -> str | None:
    """The model a request names (recorded with its results, not used to pick a model)."""
    body = line.get("body")
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def request_endpoint(line: dict) -> str | None:
    url = line.get("url")
    return url if isinstance(url, str) else None
