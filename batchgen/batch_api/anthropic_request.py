"""Anthropic Message Batches request lines:

    {"custom_id": "r1", "params": {"model": "...", "max_tokens": 64, "system": "...",
                                   "messages": [{"role": "user", "content": "..."}]}}

As the Messages API: max_tokens and messages are required, roles are user and assistant,
the system prompt is its own key (a string or text blocks)."""

from __future__ import annotations

from batchgen.batch_api.batch_request import CHAT, BatchRequest
from batchgen.batch_api.request_params import RequestError, described
from batchgen.conversation import ANTHROPIC_ROLES, Message, content_text, parse_messages

LINE_KEYS = ("custom_id", "params")
ENDPOINT = "/v1/messages"
# params key -> canonical parameter
PARAMETERS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop_sequences": "stop",
}
_IGNORED = ("model", "metadata")


def parse_anthropic_line(line: dict) -> BatchRequest:
    unknown = sorted(k for k in line if k not in LINE_KEYS)
    if unknown:
        raise RequestError(unknown[0], "unknown key in the request line")
    params = line.get("params")
    if not isinstance(params, dict):
        raise RequestError("params", f"expected an object, {described(params)}")
    for key, value in params.items():
        if key == "stream":
            if value not in (False, None):
                raise RequestError("params.stream", "a batch request cannot stream")
        elif key not in PARAMETERS and key not in _IGNORED and key not in ("messages", "system"):
            raise RequestError(f"params.{key}", "unknown parameter")
    model = params.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("params.model", f"expected a string, {described(model)}")
    for required in ("max_tokens", "messages"):
        if params.get(required) is None:
            raise RequestError(f"params.{required}", "missing (required by the Messages API)")
    messages = parse_messages("params.messages", params["messages"], ANTHROPIC_ROLES)
    system = params.get("system")
    if system is not None:
        text = content_text("params.system", system)
        if text:
            messages.insert(0, Message("system", text))
    request = BatchRequest(CHAT, messages=messages)
    request.params = [
        (PARAMETERS[k], v, f"params.{k}") for k, v in params.items() if k in PARAMETERS
    ]
    return request


def request_model(line: dict) -> str | None:
    params = line.get("params")
    model = params.get("model") if isinstance(params, dict) else None
    return model if isinstance(model, str) else None


def request_endpoint(line: dict) -> str | None:
    return ENDPOINT
