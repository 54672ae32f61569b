"""Incremental detokenization and stop strings: text grows one token at a time.

Mirrors vLLM v1 ``vllm/v1/engine/detokenizer.py`` (``IncrementalDetokenizer``, the slow
path's ``prefix_offset`` / ``read_offset`` windows) and ``StopChecker.check_stop_strings``.

Inputs
    the tokenizer, the prompt's token ids, the request's ``SamplingParams``
    (``stop``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``min_tokens``);
    then ``update(token_id, stop_terminated)`` once per generated token.
Outputs
    ``output_text`` (the text so far), and from ``update`` the stop string that the new
    token completed, or None. ``get_next_output_text(finished, delta)`` is the text a
    streaming client may see: while unfinished, the last ``len(longest stop) - 1``
    characters are held back, so a stop string is never half-shown.

How the text grows
    A token's text can depend on its neighbours (a byte-level token may hold half of a
    UTF-8 character; SentencePiece drops a word's leading space at a window's start), so
    each step decodes a small window: ``decode(ids[prefix_offset:])`` minus
    ``decode(ids[prefix_offset:read_offset])``; a delta that ends in U+FFFD (an unfinished
    character) is held back until the next token completes it, for at most
    ``MAX_PENDING_TOKENS`` tokens (then the U+FFFD is real: invalid bytes), so the window,
    and the cost of a token, stays bounded. The window starts at the
    first output token, so the text is ``tokenizer.decode(output_token_ids)``, the text
    minipaged returns for every request. (vLLM starts it on the last 5 prompt tokens; with
    a tokenizer that joins tokens by spaces that adds a leading space.)

Stop strings (vLLM's rules)
    After each token (once more than ``min_tokens`` tokens were generated), the stop
    strings are searched in the text that *ends* in the characters the token added, so a
    stop string split across tokens is found at the token that completes it; that token is
    the last one kept. The first occurrence wins (earliest start; ties: order in ``stop``).
    The text is cut before it (after it with ``include_stop_str_in_output``). A token that
    ended the request as EOS or a stop token id adds no text, unless
    ``include_stop_str_in_output``, and no stop string is searched then.

Failure mode
    none of its own: ``update`` after a stop string hit raises ``RuntimeError`` (a bug:
    the engine must have finished the request).
"""

from __future__ import annotations

from typing import Optional

from minipaged.sampling_params import SamplingParams


def find_stop_string(
    text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> Optional[tuple[str, int]]:
    """The stop string that ends within the last ``new_char_count`` characters of ``text``
    and starts first, and the length to cut ``text`` to; None if there is none.

    NOTE: only occurrences that end in the new characters count (older text was searched
    before), so each stop string is looked for in a window of ``new_char_count +
    len(s) - 1`` characters at the end of ``text``: the cost per token is bounded by the
    stop strings' total length (capped in ``SamplingParams``), not by the text's."""
    if not new_char_count or not stop:
        return None
    n = len(text)
    longest = max(len(s) for s in stop)
    base = max(0, n - new_char_count - longest + 1)
    window = text[base:]  # the only text any occurrence that ends in the new characters touches
    best: Optional[tuple[int, str]] = None
    for s in stop:
        start = max(0, n - new_char_count - len(s) + 1) - base
        idx = window.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    idx += base
    return s, idx + len(s) if include_in_output else idx


# NOTE: a UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens; a window that
# still ends in U+FFFD after this many tokens holds a real replacement character (invalid
# bytes) and is emitted, so the decode window stays bounded.
MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._raw_decode = self._fast_decode(tokenizer)
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.skip_special_tokens = params.skip_special_tokens
        self.min_tokens = params.min_tokens
        # NOTE: the window starts at the first output token (see the module docstring);
        # prompt_token_ids are kept for a tokenizer-specific start later.
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.num_output_tokens = 0
        self.output_text = ""
        self.stop_string: Optional[str] = None
        # characters a stream holds back while unfinished (a stop string may be starting)
        self.stop_buffer_length = (
            0 if self.include_stop_str_in_output or not self.stop else max(map(len, self.stop)) - 1
        )
        self._last_output_text_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._raw_decode(ids, skip_special_tokens=self.skip_special_tokens)

    @staticmethod
    def _fast_decode(tokenizer):
        """The Rust ``tokenizers.Tokenizer.decode`` behind a transformers fast tokenizer when
        its ``decode`` is exactly that (no ``clean_up_tokenization_spaces``), else
        ``tokenizer.decode``. NOTE: the Python wrapper costs ~10x the decode itself, and a
        window is decoded twice per token of every streamed sequence."""
        raw = getattr(tokenizer, "_tokenizer", None)
        if (
            raw is not None
            and hasattr(raw, "decode")
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
        ):
            return raw.decode
        return tokenizer.decode

    def _decode_next(self) -> str:
        """The text the newest token adds ("" while it ends in an unfinished character)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        pending = len(self.token_ids) - self.read_offset
        ready = len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd")
        if ready or (pending >= MAX_PENDING_TOKENS and len(new_text) >= len(prefix_text)):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return new_text[len(prefix_text) :]
        return ""

    def update(self, token_id: int, stop_terminated: bool = False) -> Optional[str]:
        """Add one generated token; return the stop string it completed, if any."""
        if self.stop_string is not None:
            raise RuntimeError("update() after a stop string ended the request")
        self.num_output_tokens += 1
        self.token_ids.append(int(token_id))
        if stop_terminated and not self.include_stop_str_in_output:
            return None  # NOTE: an EOS / stop token adds no text
        before = len(self.output_text)
        self.output_text += self._decode_next()
        if stop_terminated or not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        hit = find_stop_string(
            self.output_text, len(self.output_text) - before, self.stop, self.include_stop_str_in_output
        )
        if hit is None:
            return None
        self.stop_string, cut = hit
        self.output_text = self.output_text[:cut]
        return self.stop_string

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text so far (``delta``: only what is new since the last call), less the
        held-back tail while unfinished."""
        hold = 0 if finished else self.stop_buffer_length
        length = max(0, len(self.output_text) - hold)
        if not delta:
            return self.output_text[:length]
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return self.output_text[last:length]
        return ""
