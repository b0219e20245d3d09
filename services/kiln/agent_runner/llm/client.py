"""An async client for the OpenAI-compatible Chat Completions API (``POST
{base_url}/chat/completions``; the completion is ``choices[0].message.content``). 429, 5xx and
connection failures are retried with exponential backoff a bounded number of times; any other
4xx, a body that is not JSON or a reply without choices raises at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from kiln.agent_runner.llm.errors import LLMReplyError, LLMRequestError, LLMUnavailable
from kiln.common.logging import get_logger

log = get_logger("kiln.agent_runner.llm")

Message = dict[str, str]
"""A chat message: ``{"role": "system" | "user" | "assistant", "content": text}``."""


@dataclass(frozen=True)
class Completion:
    """The first choice of a chat completion: its text, the answering model (else the requested
    one), ``finish_reason`` ("" if absent) and token usage (0 when not reported).
    """

    text: str
    model: str
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Retryable(Exception):
    """A failure worth another try (429, 5xx, connection error)."""


def _excerpt(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def parse_reply(data: Any, requested_model: str) -> Completion:
    """A :class:`Completion` from a decoded response body; LLMReplyError without a string
    ``choices[0].message.content``.
    """
    if not isinstance(data, dict):
        raise LLMReplyError(f"LLM reply is not a JSON object: {_excerpt(repr(data))}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise LLMReplyError(f"LLM reply has no choices: {_excerpt(repr(data))}")
    first = choices[0] if isinstance(choices[0], dict) else {}
    message = first.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise LLMReplyError(f"LLM reply's first choice has no message content: {first!r:.300}")
    raw_usage = data.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    return Completion(
        text=content,
        model=str(data.get("model") or requested_model),
        finish_reason=str(first.get("finish_reason") or ""),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
    )


class ChatClient:
    """Chat Completions over HTTP (``async with`` or :meth:`close`).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000/v1``.
        api_key: bearer token, or None for no ``Authorization`` header.
        timeout_s: deadline of one HTTP request, seconds.
        attempts: tries per request on retryable failures (>= 1).
        backoff_s: first pause between tries, seconds; doubling, at most 30 s.
        transport: an httpx transport (tests); None = the network.

    Raises:
        ValueError: an empty ``base_url`` or ``model``, or ``attempts`` < 1.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_tokens: int = 4096,
        temperature: float = 0.2,
        attempts: int = 4,
        backoff_s: float = 1.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not base_url.strip() or not model.strip():
            raise ValueError("the LLM client needs a base URL and a model name")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.url = base_url.strip().rstrip("/") + "/chat/completions"
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.attempts = attempts
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), headers=headers, transport=transport
        )

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def complete(self, messages: list[Message]) -> Completion:
        """Ask for one completion of ``messages``.

        Raises:
            LLMUnavailable: every one of ``attempts`` tries failed retryably.
            LLMRequestError: a 4xx other than 429.
            LLMReplyError: a 2xx without JSON or a usable first choice.
        """
        body = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(_Retryable),
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=self.backoff_s, max=30.0),
            reraise=False,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    response = await self._post(body, attempt.retry_state.attempt_number)
        except RetryError as exc:
            last = exc.last_attempt.exception()
            raise LLMUnavailable(
                f"LLM endpoint {self.url} failed {self.attempts} time(s); last: {last}"
            ) from last
        try:
            data = response.json()
        except ValueError:
            raise LLMReplyError(
                f"LLM endpoint {self.url} answered non-JSON: {_excerpt(response.text)}"
            ) from None
        return parse_reply(data, self.model)

    async def _post(self, body: dict[str, Any], attempt: int) -> httpx.Response:
        try:
            response = await self._http.post(self.url, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
            log.warning("llm connection failed", url=self.url, attempt=attempt, error=str(exc))
            raise _Retryable(f"connection failed: {exc!r}") from exc
        except httpx.TimeoutException as exc:
            raise LLMUnavailable(f"LLM endpoint {self.url} timed out: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise LLMUnavailable(f"LLM endpoint {self.url} failed: {exc!r}") from exc
        status = response.status_code
        if status == 429 or status >= 500:
            log.warning(
                "llm endpoint busy or failing", url=self.url, status=status, attempt=attempt
            )
            raise _Retryable(f"HTTP {status}: {_excerpt(response.text)}")
        if status >= 400:
            raise LLMRequestError(
                f"LLM endpoint {self.url} refused the request: HTTP {status}: "
                f"{_excerpt(response.text)}"
            )
        return response
