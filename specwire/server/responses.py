"""Engine results -> the JSON each API answers with, whole or as stream chunks.

Dialects share one generation: llama-server's /completion, OpenAI's text completions
and chat completions here, Anthropic's messages (anthropic_output.py) and OpenAI's
responses (oai_responses_output.py). Each is a Dialect object that knows its opening
chunks, its content chunks and its closing chunks, so the streaming code in app.py is
written once. Every final body and every last
stream chunk carries llama-server's `timings` (an extra top-level field in the
OpenAI dialects, which OpenAI clients ignore).
"""

from __future__ import annotations

import json
import time
import uuid

from specwire import __version__
from specwire.server import chat_output
from specwire.server import probs as probs_json
from specwire.server.chat_output import ChatOutput, ChatPlan
from specwire.server.errors import ApiError
from specwire.server.schemas import Completion
from specwire.server.slots import Progress, Result, TextChunk

#: OpenAI's system_fingerprint: the build that answered (llama-server's "b<build>-<commit>").
FINGERPRINT = f"specwire-{__version__}"


def finish_reason(stop_type: str) -> str:
    return "length" if stop_type == "limit" else "stop"


def usage(r: Result) -> dict:
    return {"prompt_tokens": r.tokens_evaluated, "completion_tokens": r.tokens_predicted,
            "total_tokens": r.tokens_evaluated + r.tokens_predicted}


class Dialect:
    """One API's response shapes for one request."""

    #: whether the stream ends with `data: [DONE]` (OpenAI does, llama-server's /completion not)
    done_marker = True
    #: whether each event is named by an `event:` line, its object's "type" (Anthropic's
    #: and the Responses API's streams are; their clients dispatch on the name)
    named_events = False

    def __init__(self, spec: Completion, model: str) -> None:
        self.spec, self.model = spec, model
        self.created = int(time.time())

    def opening(self) -> list[dict]:
        return []

    def chunk(self, c: TextChunk) -> dict | None:
        raise NotImplementedError

    def chunks(self, c: TextChunk) -> list[dict]:
        """The stream objects for one piece of text (chunk's, if any)."""
        obj = self.chunk(c)
        return [] if obj is None else [obj]

    def error_event(self, e: ApiError) -> dict:
        """A failure after the stream has begun, as this API's clients read it."""
        return e.body()

    def sse_line(self, obj: dict | str) -> str:
        """One server-sent event."""
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                          separators=(",", ":"))
        if self.named_events and isinstance(obj, dict):
            return f"event: {obj.get('type', 'message')}\ndata: {data}\n\n"
        return f"data: {data}\n\n"

    def progress(self, p: Progress) -> dict:
        """return_progress: llama-server's chunk with prompt_progress and no text."""
        return {"content": "", "tokens": [], "stop": False, "prompt_progress": p.to_dict()}

    def closing(self, r: Result) -> list[dict]:
        raise NotImplementedError

    def whole(self, r: Result) -> dict:
        raise NotImplementedError


class LlamaCompletion(Dialect):
    """llama-server's POST /completion."""

    done_marker = False

    def _probs(self, probs: list) -> dict:
        spec = self.spec.request.logprobs
        if spec is None:
            return {}
        return {"completion_probabilities": probs_json.llama(probs, self.spec.piece,
                                                             spec.post_sampling)}

    def chunk(self, c: TextChunk) -> dict | None:
        return {"index": 0, "content": c.text,
                "tokens": c.tokens if self.spec.return_tokens else [], "stop": False,
                **self._probs(c.probs)}

    def closing(self, r: Result) -> list[dict]:
        last = {**self.whole(r), "content": "", "tokens": []}
        last.pop("completion_probabilities", None)
        return [last]

    def whole(self, r: Result) -> dict:
        return {**self._probs(r.probs),
            "index": 0,
            "content": r.content,
            "tokens": r.tokens if self.spec.return_tokens else [],
            "id_slot": r.slot,
            "stop": True,
            "model": self.model,
            "tokens_predicted": r.tokens_predicted,
            "tokens_evaluated": r.tokens_evaluated,
            "generation_settings": self.spec.settings(),
            "has_new_line": "\n" in r.content,
            "truncated": r.truncated,
            "stop_type": r.stop_type,
            "stopping_word": r.stopping_word,
            "tokens_cached": r.tokens_evaluated + r.tokens_predicted,
            "drafter": r.drafter,
            "timings": r.timings,
        }


class OpenAICompletion(Dialect):
    """OpenAI's POST /v1/completions."""

    object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, spec: Completion, model: str) -> None:
        super().__init__(spec, model)
        self.id = self.id_prefix + uuid.uuid4().hex

    def _envelope(self, choices: list[dict], **extra: object) -> dict:
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model, "system_fingerprint": FINGERPRINT, "choices": choices,
                **extra}

    def progress(self, p: Progress) -> dict:
        return self._envelope([], prompt_progress=p.to_dict())

    def _choice(self, text: str, finish: str | None, probs: list | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": self._logprobs(probs),
                "finish_reason": finish}

    def _logprobs(self, probs: list | None) -> dict | None:
        if self.spec.request.logprobs is None or probs is None:
            return None
        return probs_json.completions(probs, self.spec.piece)

    def chunk(self, c: TextChunk) -> dict | None:
        if not c.text and not (c.probs and self.spec.request.logprobs):
            return None
        return self._envelope([self._choice(c.text, None, c.probs)])

    def closing(self, r: Result) -> list[dict]:
        out = [self._envelope([self._choice("", finish_reason(r.stop_type))],
                              timings=r.timings)]
        if self.spec.include_usage:
            out.append(self._envelope([], usage=usage(r), timings=r.timings))
        return out

    def whole(self, r: Result) -> dict:
        return self._envelope([self._choice(r.content, finish_reason(r.stop_type), r.probs)],
                              usage=usage(r), timings=r.timings)


class OpenAIChat(OpenAICompletion):
    """OpenAI's POST /v1/chat/completions: content, reasoning_content and tool_calls."""

    object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, spec: Completion, model: str) -> None:
        super().__init__(spec, model)
        self.plan = spec.chat or ChatPlan()
        self.out = ChatOutput(self.plan)

    def _choice(self, delta: dict, finish: str | None,  # type: ignore[override]
                probs: list | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": self._logprobs(probs),
                "finish_reason": finish}

    def _logprobs(self, probs: list | None) -> dict | None:
        if self.spec.request.logprobs is None or probs is None:
            return None
        return probs_json.chat(probs, self.spec.piece)

    def opening(self) -> list[dict]:
        return [self._envelope([self._choice({"role": "assistant", "content": ""}, None)])]

    def chunk(self, c: TextChunk) -> dict | None:
        deltas = self.out.push(c.text)
        wants_probs = bool(c.probs and self.spec.request.logprobs)
        if not deltas and not wants_probs:
            return None
        delta: dict = {}
        for d in deltas:                      # at most one reasoning and one content part
            for k, v in d.items():
                delta[k] = delta.get(k, "") + v
        if wants_probs and not delta:
            delta = {"content": ""}
        return self._envelope([self._choice(delta, None, c.probs)])

    def closing(self, r: Result) -> list[dict]:
        out = [self._envelope([self._choice(d, None)]) for d in self.out.finish()]
        finish = "tool_calls" if self.out.calls else finish_reason(r.stop_type)
        out.append(self._envelope([self._choice({}, finish)], timings=r.timings))
        if self.spec.include_usage:
            out.append(self._envelope([], usage=usage(r), timings=r.timings))
        return out

    def whole(self, r: Result) -> dict:
        msg = chat_output.whole(self.plan, r.content)
        finish = "tool_calls" if msg.calls else finish_reason(r.stop_type)
        choice = {"index": 0, "message": msg.openai(), "logprobs": self._logprobs(r.probs),
                  "finish_reason": finish}
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": FINGERPRINT, "choices": [choice],
                "usage": usage(r), "timings": r.timings}
