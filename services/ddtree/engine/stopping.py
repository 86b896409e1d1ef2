"""When a generation ends, and what text it streams: stop ids, EOS, max_tokens, stop strings.

A decode step commits several tokens at once; `StopChecker.feed` takes them one by one so the
output ends exactly at the first stop condition, whatever the step size. Stop strings are found
across chunk boundaries: the search covers the tail of the text already streamed plus the new
text, and the streamed text is cut right after the match (the match is part of the output, so
nothing ever has to be held back or retracted).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ddtree.engine.request import FinishReason, SamplingOptions
from ddtree.tokenizer import IncrementalDecoder


@dataclass
class Emitted:
    token_ids: list[int]
    text: str
    finish: FinishReason | None


class StopChecker:
    def __init__(self, sampling: SamplingOptions, decoder: IncrementalDecoder, *,
                 eos_token_ids: Sequence[int], max_new_tokens: int):
        self._stop_ids = frozenset(sampling.stop_token_ids)
        self._eos_ids = frozenset(() if sampling.ignore_eos else eos_token_ids)
        self._stop_strings = sampling.stop_strings
        self._window = max((len(s) for s in self._stop_strings), default=1) - 1
        self._decoder = decoder
        self._max_new = max_new_tokens  # min(max_tokens, room left in the context)
        self._tail = ""                 # last `_window` characters streamed so far
        self.generated = 0
        self.finish: FinishReason | None = None

    def feed(self, token_ids: Sequence[int]) -> Emitted:
        """Consumes committed tokens up to the first stop; returns what to stream."""
        out_ids: list[int] = []
        text = ""
        for tok in token_ids:
            if self.finish is not None:
                break
            out_ids.append(int(tok))
            self.generated += 1
            piece = self._decoder.push((int(tok),))
            if self._stop_strings and piece:
                cut = self._match_end(piece)
                if cut is not None:
                    piece = piece[:cut]
                    self.finish = FinishReason.STOP
            text += piece
            self._tail = (self._tail + piece)[-self._window:] if self._window else ""
            if self.finish is not None:
                break
            if tok in self._stop_ids:
                self.finish = FinishReason.STOP
            elif tok in self._eos_ids:
                self.finish = FinishReason.EOS
            elif self.generated >= self._max_new:
                self.finish = FinishReason.LENGTH
        return Emitted(out_ids, text, self.finish)

    def _match_end(self, piece: str) -> int | None:
        """End offset in `piece` of the earliest-ending stop string match that ends inside it."""
        haystack = self._tail + piece
        best = None
        for s in self._stop_strings:
            i = haystack.find(s, max(0, len(self._tail) - len(s) + 1))
            if i >= 0:
                end = i + len(s) - len(self._tail)
                best = end if best is None else min(best, end)
        return best
