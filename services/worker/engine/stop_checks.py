"""Whether a request stops on the token it just accepted (the scheduler asks, token by token).

EOS and stop tokens count only from min_tokens on; max_tokens always. A constrained request's
matcher consumes every accepted token, and a complete grammar is a stop even at max_tokens.
Stop strings are not here: they live in the text, which only the output processor sees.
"""

from __future__ import annotations

import logging

from services.worker.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)


def check_stop(request: Request, token: int) -> RequestStatus | None:
    """After request.append_output(token): the status it finishes with, or None to go on. A
    constrained request's matcher consumes the token even when the token alone is a stop, and
    the grammar's status comes first. (One call for most requests: this runs per token.)"""
    grammar = None if request.matcher is None else _check_grammar(request, token)
    p = request.params
    num_output = len(request.output_token_ids)
    if num_output >= p.min_tokens:
        if (token in request.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            request.stop_reason = token
            return grammar or RequestStatus.FINISHED_STOPPED
    if num_output >= request.max_tokens:
        return grammar or RequestStatus.FINISHED_LENGTH
    return grammar


def _check_grammar(request: Request, token: int) -> RequestStatus | None:
    matcher = request.matcher
    if not matcher.accept(token):   # the masks make this impossible: a bug, not the caller's
        log.error("request %s: sampled token %d outside its grammar: %s", request.request_id, token, matcher.error)
        return RequestStatus.FINISHED_ABORTED
    return RequestStatus.FINISHED_STOPPED if matcher.is_finished else None
