"""Errors of the code-writing agent's LLM calls, as :class:`~kiln.common.errors.KilnError`\\ s."""

from __future__ import annotations

import grpc

from kiln.common.errors import KilnError


class LLMError(KilnError):
    """Base: something went wrong asking the LLM or reading its answer."""


class LLMUnavailable(LLMError):
    """The endpoint could not be reached, or kept answering 429/5xx after every retry."""

    code = grpc.StatusCode.UNAVAILABLE


class LLMRequestError(LLMError):
    """The endpoint refused the request (a 4xx other than 429: bad key, unknown model, ...);
    retrying the same request cannot help."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class LLMReplyError(LLMError):
    """The reply is unusable: not JSON, no choices, or a completion that is not a valid code
    module for the op asked for (the message says why)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
