"""`specwire generate`: one completion, streamed, then the speculative statistics."""

from __future__ import annotations

import argparse
import json
import sys

from specwire.cli.args import (
    CliError,
    add_emulation_args,
    add_lookup_cache_arg,
    add_model_args,
    add_sampling_args,
    draft_params,
    sampling_params,
)
from specwire.cli.commands import compat
from specwire.config import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding",
                       description="Generate a completion with the target model, a draft "
                       "proposing tokens (bundled pair by default).")
    p.add_argument("prompt", nargs="?", help="prompt text (or --file / --messages)")
    p.add_argument("-f", "--file", help="read the prompt from a file")
    p.add_argument("--messages", help="chat messages as JSON (a list of {role, content}) "
                   "or @FILE; rendered with the model's chat template")
    p.add_argument("--chat-template", default=None,
                   help="template name for a GGUF without one (llama.cpp names)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--context-shift", dest="context_shift", action="store_true", default=False,
                   help="when the context fills, keep the first --keep prompt tokens, drop "
                   "half of the rest and go on (llama.cpp's; lossless under speculation)")
    p.add_argument("--no-context-shift", dest="context_shift", action="store_false",
                   help="stop at the context's end (the default)")
    p.add_argument("--keep", type=int, default=0, metavar="N",
                   help="prompt tokens a context shift keeps (default 0, -1: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_model_args(p)
    add_lookup_cache_arg(p)
    add_sampling_args(p)
    compat.add_rpc_arg(p)
    add_emulation_args(p)
    p.set_defaults(func=run)


def read_prompt(a: argparse.Namespace) -> str | list[dict]:
    given = [x for x in (a.prompt, a.file, a.messages) if x is not None]
    if len(given) != 1:
        raise CliError("give exactly one of: a prompt argument, --file, --messages")
    if a.file is not None:
        try:
            with open(a.file, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise CliError(f"--file: cannot read {a.file}: {e.strerror}") from None
    if a.messages is not None:
        text = a.messages
        if text.startswith("@"):
            try:
                with open(text[1:], encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise CliError(f"--messages: cannot read {text[1:]}: {e.strerror}") from None
        try:
            msgs = json.loads(text)
        except json.JSONDecodeError as e:
            raise CliError(f"--messages: not valid JSON: {e}") from None
        if not (isinstance(msgs, list) and msgs
                and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs)):
            raise CliError("--messages: expected a non-empty list of {role, content} objects")
        return msgs
    return a.prompt


def run(a: argparse.Namespace) -> int:
    from specwire.build import build_engine
    from specwire.cli.settings import engine_settings

    compat.check_rpc(a)
    if a.n_predict < 0:
        raise CliError(f"-n: must be >= 0, got {a.n_predict}")
    if a.keep < -1:
        raise CliError(f"--keep: must be >= -1 (-1: the whole prompt), got {a.keep}")
    prompt = read_prompt(a)
    sp, dp = sampling_params(a), draft_params(a)
    engine = build_engine(engine_settings(a))
    if a.context_shift:
        try:
            engine.enable_context_shift()
        except ConfigError as e:
            raise CliError(str(e)) from None
    try:
        return complete(a, engine, prompt, sp, dp)
    finally:
        if engine.lookup_file is not None:
            engine.lookup_file.close()


def complete(a: argparse.Namespace, engine, prompt: str | list[dict], sp, dp) -> int:  # noqa: ANN001
    """Generate and print the completion and its statistics."""
    from specwire.engine.engine import Request
    from specwire.text.stream import TextStream

    target = engine.target
    if isinstance(prompt, list):
        from specwire.text.chat import render_for
        text = render_for(target, prompt, a.chat_template)
        tokens = target.tokenize(text, add_special=False, parse_special=True)
    else:
        tokens = target.tokenize(prompt, add_special=True, parse_special=False)
    shifting = getattr(a, "context_shift", False)
    if shifting and len(tokens) + 1 > target.n_ctx:
        raise CliError(f"prompt ({len(tokens)} tokens) does not fit the context size -c "
                       f"{target.n_ctx}")
    if not shifting and len(tokens) + a.n_predict > target.n_ctx:
        raise CliError(f"prompt ({len(tokens)} tokens) plus -n {a.n_predict} exceeds the "
                       f"context size -c {target.n_ctx} (--context-shift goes on past it)")
    try:
        gen = engine.generate(Request(tokens, a.n_predict, sp, dp, a.ignore_eos,
                                      n_keep=getattr(a, "keep", 0)))
    except ConfigError as e:
        raise CliError(str(e)) from None
    stream = TextStream(target.detokenize)
    for new in gen:
        piece = stream.push(new)
        if not a.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    text = stream.text()
    st = gen.stats
    if a.json:
        emu = getattr(target, "emulation", None)
        print(json.dumps({"tokens": gen.tokens, "text": text, "stop_type": gen.stop_type,
                          "truncated": gen.truncated,
                          "timings": st.timings(), "stats": st.to_dict(),
                          "draft": engine.drafter.name,
                          **({"emulation": {**emu.to_dict(),
                                            "target": target.counters.snapshot(),
                                            "draft": target.draft_counters.snapshot()}}
                             if emu else {})}))
        return 0
    sys.stdout.write(stream.flush() + "\n")
    print(format_stats(st, engine.drafter.name), file=sys.stderr)
    print(*emulation_lines(target), sep="\n", file=sys.stderr)
    return 0


def emulation_lines(target) -> list[str]:
    """--emulate: the regime at its scale and how many decodes overran their emulated time."""
    emu = getattr(target, "emulation", None)
    if emu is None:
        return []
    out = [emu.describe()]
    for name, c in (("target", target.counters), ("draft", target.draft_counters)):
        if c.decodes:
            verdict = "" if c.valid else " - not a valid emulation"
            out.append(f"{name} decodes over their emulated time: {c.over} of {c.decodes} "
                       f"({100 * c.over_share:.1f}%){verdict}")
    return out


def format_stats(st, drafter: str) -> str:
    hist = " ".join(f"{i}:{c}" for i, c in enumerate(st.hist) if c)
    return "\n".join([
        "",
        f"drafter          {drafter}",
        f"prompt           {st.prompt_n} tokens, {st.prompt_ms:.1f} ms, {st.cache_n} cached",
        *([f"draft prompt     {st.draft_prompt_n} tokens evaluated, {st.draft_cache_n} cached"]
          if st.draft_cache_n is not None else []),
        f"generated        {st.predicted_n} tokens, {st.predicted_ms:.1f} ms, "
        f"{st.predicted_per_second:.2f} tokens/s",
        f"draft_n          {st.draft_n}",
        f"draft_n_accepted {st.draft_n_accepted} ({100 * st.acceptance:.1f}%)",
        f"rounds           {st.rounds}, mean accepted length {st.mean_accepted:.2f}",
        f"accepted-length histogram  {hist or '-'}",
        *overhead_line(st),
    ])


def overhead_line(st) -> list[str]:
    """Share of decoding time spent outside llama.cpp, where target and draft alternate."""
    if "decode_ms" not in st.drafter and st.draft_n:
        return []          # the draft runs on its own thread or machine: not additive
    inside = st.target_decode_ms + st.drafter.get("decode_ms", 0.0)
    if st.predicted_ms <= 0 or inside <= 0:
        return []
    return [f"outside llama.cpp {100 * (1 - inside / st.predicted_ms):.1f}% of decoding time"]
