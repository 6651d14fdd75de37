"""POST /infill: llama-server's fill-in-the-middle prompt, the way editor plugins send it.

The request gives the text before the cursor (input_prefix), after it (input_suffix),
other files (input_extra) and an optional `prompt` continuing the prefix. The prompt uses
the GGUF's FIM tokens (`[<fim_rep>project, <fim_sep>filename text...] [BOS] <fim_pre> prefix
prompt <fim_suf> suffix <fim_mid>`; --spm-infill puts the suffix first; without <fim_sep>
a plain-text snippet marker joins the files) and llama-server's budget: the prefix keeps
at most 3/4 of a batch (its end), the suffix the rest (its start), the extra context what
the context has room for. Texts are tokenized as plain text: a special token stays text.

What falls outside those budgets is cut off before it is tokenized, with a margin
(`MARGIN` tokens, each at most the vocabulary's longest token): a request's megabytes of
input_extra cost the tokenizer only what the context could keep, and the prompt is the one
from the whole texts (a cut changes the tokens at most next to it, inside the margin).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specwire.server import limits
from specwire.server.errors import bad_request

#: what separates extra files when the vocabulary has no <fim_sep>.
SNIPPET = "\n\n--- snippet ---\n\n"
REQUIRED = ("pre", "suf", "mid")
#: Tokens kept beyond a budget when a text is cut before tokenizing.
MARGIN = 64


@dataclass(frozen=True, slots=True)
class Extra:
    filename: str
    text: str


def parse_extra(value: Any) -> list[Extra]:
    """input_extra: a list of {"filename": str, "text": str} (filename optional)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("input_extra: must be a list of {\"filename\", \"text\"} objects")
    out = []
    for i, chunk in enumerate(value):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str) or \
                not isinstance(chunk.get("filename", ""), str):
            raise bad_request(f"input_extra[{i}]: must be {{\"filename\": string, \"text\": "
                              "string}")
        out.append(Extra(chunk.get("filename") or "tmp", chunk.get("text", "")))
    return out


def fim_tokens(backend: Any) -> dict[str, int]:
    """The model's FIM tokens; 400 when it lacks the three /infill needs."""
    fim = backend.fim_tokens() if hasattr(backend, "fim_tokens") else {}
    missing = [f"<fim_{name}>" for name in REQUIRED if name not in fim]
    if missing:
        raise bad_request(f"/infill: the model {backend.name} has no {', '.join(missing)} "
                          "token (a code model with fill-in-the-middle tokens is needed)")
    return fim


def prompt_tokens(backend: Any, prefix: str, suffix: str, prompt: str,
                  extra: Sequence[Extra], n_batch: int, n_ctx: int, n_predict: int,
                  spm: bool = False) -> list[int]:
    """The /infill prompt's tokens (see the module's docstring)."""
    fim = fim_tokens(backend)

    def tok(text: str) -> list[int]:
        return backend.tokenize(text, add_special=False, parse_special=False)

    typed = tok(prompt)
    room_before, room_after = 3 * (n_batch // 4), max(0, n_batch // 4 - (2 + len(typed)))
    room_context = max(0, n_ctx - n_batch - 2 * n_predict)
    pieces: list[int | str] = []           # the extra context: tokens and texts, in order
    if "rep" in fim:
        pieces += [fim["rep"], "myproject\n"]
    for chunk in extra:
        pieces += [fim["sep"], chunk.filename + "\n"] if "sep" in fim else [SNIPPET]
        pieces.append(chunk.text)
    if "sep" in fim:
        pieces += [fim["sep"], "filename\n"]
    context: list[int] = []
    for piece in _last(pieces, room_context, backend):
        context += [piece] if isinstance(piece, int) else tok(piece)
    before = tok(_tail(prefix, room_before, backend))
    after = tok(_head(suffix, room_after, backend))
    keep_before = min(len(before), room_before)
    keep_after = min(len(after), room_after)
    keep_context = min(len(context), room_context)
    head = [fim["pre"], *before[len(before) - keep_before:], *typed]
    tail = [fim["suf"], *after[:keep_after]]
    first, second = (tail, head) if spm else (head, tail)
    bos = [fim["bos"]] if "bos" in fim else []
    return [*context[len(context) - keep_context:], *bos, *first, *second, fim["mid"]]


def _chars(tokens: int, backend: Any) -> int:
    """Characters that make at least `tokens` + MARGIN tokens, whatever they are (each
    character is a byte or more, each token at most the vocabulary's longest)."""
    return (tokens + MARGIN) * limits.longest_token_bytes(backend)


def _short(n_chars: int, tokens: int, backend: Any) -> bool:
    """Whether n_chars need no cut: too few to pass `tokens` + MARGIN, or a backend that
    cannot list its vocabulary (no longest token to bound by: tokenized whole)."""
    return n_chars <= tokens + MARGIN or not hasattr(backend, "n_vocab")


def _tail(text: str, tokens: int, backend: Any) -> str:
    """The end of text that holds its last `tokens` tokens (text itself when short)."""
    if _short(len(text), tokens, backend):
        return text
    return text[-_chars(tokens, backend):]


def _head(text: str, tokens: int, backend: Any) -> str:
    """The start of text that holds its first `tokens` tokens."""
    if _short(len(text), tokens, backend):
        return text
    return text[:_chars(tokens, backend)]


def _last(pieces: list[int | str], tokens: int, backend: Any) -> list[int | str]:
    """The pieces (token ids and texts) that hold the last `tokens` tokens of them all:
    those before are dropped unread, the first kept text cut to its end."""
    if _short(sum(len(p) for p in pieces if isinstance(p, str)), tokens, backend):
        return pieces
    room = _chars(tokens, backend)
    kept: list[int | str] = []
    for piece in reversed(pieces):
        if room <= 0:
            break
        if isinstance(piece, str):
            piece = piece[-room:]
            room -= len(piece)
        else:
            room -= 1
        kept.append(piece)
    return kept[::-1]
