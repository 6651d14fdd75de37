"""POST /infill: llama-server's fill-in-the-middle prompt, the way editor plugins send it.

The request gives the text before the cursor (input_prefix), after it (input_suffix),
other files (input_extra) and an optional `prompt` continuing the prefix. The prompt uses
the GGUF's FIM tokens (`[<fim_rep>project, <fim_sep>filename text...] [BOS] <fim_pre> prefix
prompt <fim_suf> suffix <fim_mid>`; --spm-infill puts the suffix first; without <fim_sep>
a plain-text snippet marker joins the files) and llama-server's budget: the prefix keeps
at most 3/4 of a batch (its end), the suffix the rest (its start), the extra context what
the context has room for. Texts are tokenized as plain text: a special token stays text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specwire.server.errors import bad_request

#: what separates extra files when the vocabulary has no <fim_sep>.
SNIPPET = "\n\n--- snippet ---\n\n"
REQUIRED = ("pre", "suf", "mid")


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

    context: list[int] = []
    if "rep" in fim:
        context += [fim["rep"], *tok("myproject\n")]
    for chunk in extra:
        if "sep" in fim:
            context += [fim["sep"], *tok(chunk.filename + "\n")]
        else:
            context += tok(SNIPPET)
        context += tok(chunk.text)
    if "sep" in fim:
        context += [fim["sep"], *tok("filename\n")]
    before, after, typed = tok(prefix), tok(suffix), tok(prompt)
    keep_before = min(len(before), 3 * (n_batch // 4))
    keep_after = min(len(after), max(0, n_batch // 4 - (2 + len(typed))))
    keep_context = min(len(context), max(0, n_ctx - n_batch - 2 * n_predict))
    head = [fim["pre"], *before[len(before) - keep_before:], *typed]
    tail = [fim["suf"], *after[:keep_after]]
    first, second = (tail, head) if spm else (head, tail)
    bos = [fim["bos"]] if "bos" in fim else []
    return [*context[len(context) - keep_context:], *bos, *first, *second, fim["mid"]]
