"""What a streamed request may send now: the tokens whose text is settled.

A streamed request's chunks are parts of its checkpoint (engine_worker/checkpoints.py): what a
reader was sent is what a worker that takes the entry after a death continues from. So a chunk
ends only where the text is settled, and the tokens after that point wait, unsaved and unsent:

* an incomplete UTF-8 character (a byte-level tokenizer splits one over several tokens; the
  decoded text then ends in U+FFFD) waits until it is whole;
* text that may be the start of a stop string waits until it is not (or the record comes: a
  sample that ended on a stop string has its text cut there, and no chunk ever showed it);
* a stop string already in the text (the engine has not reported its finish yet) is never sent:
  its tokens come with the record;
* a decode that does not extend what was sent (a tokenizer that tidies spaces around a later
  token) waits for more tokens.

A continuation after the saved tokens then sees every stop string whole in its own output, and its
text begins on a character boundary. The text of a chunk is ``decode(ids[:end]) - decode(ids[:start])``,
a function of the token ids alone: any worker that continues makes the same cuts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from redroll.engine_worker.engines.text import find_stop
from redroll.shared.types import GenerationRequest

LOOK_BACK = 8
"""How many shorter cuts are tried before waiting for more tokens."""


@dataclass(frozen=True)
class Cut:
    """Where a chunk may end."""

    tokens: int
    """Tokens (of all made so far, saved ones included) that are settled."""
    text: str | None
    """Their decoded text (None when the request wants none and has no stop strings)."""


def wants_decoding(request: GenerationRequest, tokenizer: Any) -> bool:
    """Whether chunks of ``request`` carry text or wait on stop strings (a tokenizer needed)."""
    return tokenizer is not None and (request.wants_text or bool(request.sampling_params.stop))


def held_back(text: str, stops: Sequence[str]) -> bool:
    """Whether ``text`` may not end a chunk: an incomplete character, a stop string in it, or an
    end that a stop string may go on from."""
    if text.endswith("\ufffd"):
        return True
    if stops:
        if find_stop(text, stops) is not None:
            return True
        for stop in stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    return True
    return False


def settled(tokenizer: Any, request: GenerationRequest, ids: Sequence[int], sent_tokens: int,
            sent_text: str) -> Cut:
    """The longest prefix of ``ids`` (all tokens made so far) that may be sent, given that the
    first ``sent_tokens`` were, with text ``sent_text``. ``Cut.tokens == sent_tokens``: nothing yet."""
    if not wants_decoding(request, tokenizer):
        return Cut(len(ids), None)
    params = request.sampling_params
    stops = params.stop or ()
    end = len(ids)
    while end > sent_tokens and len(ids) - end <= LOOK_BACK:
        text = tokenizer.decode(list(ids[:end]), skip_special_tokens=params.skip_special_tokens)
        if text.startswith(sent_text) and not held_back(text, stops):
            return Cut(end, text)
        end -= 1
    return Cut(sent_tokens, sent_text)


__all__ = ["Cut", "LOOK_BACK", "held_back", "settled", "wants_decoding"]
