"""Token ids to text and back for the front end: prompts, incremental output, stop strings.

`Detokenizer` wraps a quicktok encoding (None: a server without text, which takes token-id
prompts only). `TextStream` turns one choice's tokens into text as they come: each token's
bytes go through an incremental UTF-8 decoder, so a character split across tokens is
emitted once, when its last byte arrives (a token that completes no character adds no
text), and only bytes that can never form a character become U+FFFD. With stop strings it
holds back the last (longest stop - 1) characters until they cannot begin a stop string,
and ends the text at the first stop string found (kept with include_stop_str_in_output),
as vLLM's detokenizer does; stop strings are not looked for before min_tokens.
"""

from __future__ import annotations

import codecs

BOS = "<|begin_of_text|>"  # the llama3 encoding's beginning of text


class Detokenizer:
    """Text <-> token ids with a quicktok encoding (None: token ids only)."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self.bos_id = None
        if tokenizer is not None:
            try:
                self.bos_id = int(tokenizer.encode_single_token(BOS))
            except (KeyError, ValueError, RuntimeError):
                self.bos_id = None

    @property
    def has_text(self) -> bool:
        return self.tokenizer is not None

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt"
               ) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids (as a Hugging
        Face tokenizer parses them) and, with add_special_tokens, the encoding's BOS leads
        (as Llama-3's tokenizer adds it)."""
        from serving_core.server.protocol import BadRequest

        if self.tokenizer is None:
            raise BadRequest(f"{param}: this server has no tokenizer; send token ids", param)
        ids = list(self.tokenizer.encode_with_special(text))
        if add_special_tokens and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def token_bytes(self, token: int, skip_special: bool = True) -> bytes:
        if self.tokenizer is None:
            return b""
        tok = self.tokenizer
        try:
            if skip_special and tok.is_special_token(int(token)):
                return b""
            return tok.decode_single_token_bytes(int(token))
        except (KeyError, ValueError, RuntimeError, IndexError):  # outside the text vocabulary
            return b""

    def token_text(self, token: int) -> str:
        """One token's own text (logprobs' `tokens`), special tokens included."""
        return self.token_bytes(token, skip_special=False).decode("utf-8", "replace")

    def decode(self, ids, skip_special: bool = True) -> str:
        return b"".join(self.token_bytes(t, skip_special) for t in ids).decode("utf-8", "replace")


class TextStream:
    """One choice's output text, decoded incrementally (see the module docstring)."""

    def __init__(self, text: Detokenizer, *, stop: tuple[str, ...] = (),
                 include_stop: bool = False, skip_special: bool = True,
                 min_tokens: int = 0) -> None:
        self.text = text
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.skip_special = skip_special
        self.min_tokens = min_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.decoded = ""  # the output text so far (complete characters)
        self.emitted = 0  # characters of `decoded` handed out
        self.num_tokens = 0
        self.stop_hit: str | None = None

    def add(self, token: int) -> str:
        """The text to emit after `token` ('' while a character or a possible stop string
        is incomplete); after a stop string is found, `stop_hit` names it and the rest of
        the text is final."""
        if self.stop_hit is not None:
            return ""
        self.num_tokens += 1
        new = self._utf8.decode(self.text.token_bytes(token, self.skip_special))
        if not new:
            return ""
        start = max(0, len(self.decoded) - self._hold)
        self.decoded += new
        if self.stop and self.num_tokens > self.min_tokens:
            found = min(((i, s) for s in self.stop
                         if (i := self.decoded.find(s, start)) >= 0), default=None)
            if found is not None:
                i, s = found
                self.decoded = self.decoded[: i + len(s) if self.include_stop else i]
                self.stop_hit = s
                return self._take(len(self.decoded))
        return self._take(len(self.decoded) - (self._hold if self.stop else 0))

    def finish(self) -> str:
        """The held text at the end (and U+FFFD for a character that never completed)."""
        if self.stop_hit is None:
            self.decoded += self._utf8.decode(b"", final=True)
        return self._take(len(self.decoded))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.decoded[self.emitted:upto]
        self.emitted = upto
        return out
