"""llama-server's and ik_llama.cpp's flags that specwire does not implement, each handled.

A user's llama-server command line should start `specwire serve` unchanged, so every flag
of both servers is implemented or listed here: IGNORED (a one-line warning saying why it
does nothing here: a kernel speed switch, a logging or memory-layout option, a drafting
knob) or REFUSED (a one-line error, since accepting it would silently change the output;
given its neutral value, such as `--mirostat 0`, it is only warned about). `nargs` is how
many values the flag takes (0, 1, or "?").
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from specwire.backend.base import BackendError
from specwire.cli.args import CliError

log = logging.getLogger("specwire.flags")


@dataclass(frozen=True, slots=True)
class Flag:
    names: tuple[str, ...]
    nargs: int | str
    why: str
    neutral: tuple[str, ...] = ()   # REFUSED only: values that change nothing

    @property
    def dest(self) -> str:
        return "compat_" + max(self.names, key=len).lstrip("-").replace("-", "_")


def _f(names: str, nargs: int | str, why: str, neutral: tuple[str, ...] = ()) -> Flag:
    return Flag(tuple(names.split()), nargs, why, neutral)


_IK = "ik_llama.cpp's own kernels"
_NOT_IK = ("specwire runs mainline llama.cpp, which has no such kernel switch; output "
           "does not depend on it")
_SPEC = "specwire's drafter decides this, and no drafting setting can change the output"

#: accepted with a warning: no meaning here, no effect on the output.
IGNORED: tuple[Flag, ...] = (
    # ik_llama.cpp's kernels and graph options
    _f("-fmoe --fused-moe", "?", f"{_IK}: fuses the MoE up/gate/down matmuls; {_NOT_IK}"),
    _f("-no-fmoe --no-fused-moe", 0, f"{_IK}: turns the fused MoE off; {_NOT_IK}"),
    _f("-amb --attention-max-batch", 1,
       f"{_IK}: caps the batch its attention computes at once, to bound the compute "
       f"buffer of MLA models; {_NOT_IK}"),
    _f("-mla --mla-use", 1, f"{_IK}: picks DeepSeek's MLA attention variant; llama.cpp "
       "chooses its MLA path from the GGUF"),
    _f("-no-ooae --no-offload-only-active-experts", "?",
       f"{_IK}: with CPU-held experts, copies every expert to the GPU for a large batch "
       f"instead of only the active ones; {_NOT_IK}"),
    _f("-ger --grouped-expert-routing", 0, f"{_IK}: its grouped expert routing kernel; "
       "llama.cpp routes as the GGUF's expert groups say"),
    _f("-no-fug --no-fused-up-gate", 0, f"{_IK}: turns the fused up/gate matmul off; {_NOT_IK}"),
    _f("-no-mmad --no-fused-mul-multiadd", 0, f"{_IK}: turns a fused op off; {_NOT_IK}"),
    _f("-gr --graph-reuse", 0, f"{_IK}: reuses the compute graph between steps; llama.cpp "
       "does so by itself"),
    _f("-no-gr --no-graph-reuse", 0, f"{_IK}: rebuilds the graph each step; {_NOT_IK}"),
    _f("-rtr --run-time-repack", "?", f"{_IK}: repacks weights at load into its interleaved "
       "layouts; llama.cpp repacks for the CPU by itself"),
    _f("-thp --transparent-huge-pages", "?", f"{_IK}: maps the weights with huge pages; "
       f"{_NOT_IK}"),
    _f("-vq --validate-quants", "?", f"{_IK}: checks quantized blocks at load; {_NOT_IK}"),
    _f("-mqkv --merge-qkv", "?", f"{_IK}: merges the Q, K, V matmuls at load; {_NOT_IK}"),
    _f("-muge --merge-up-gate-experts --merge-up-gate-exps", "?",
       f"{_IK}: merges the experts' up and gate weights at load; {_NOT_IK}"),
    _f("-khad --k-cache-hadamard", 0, f"{_IK}: Hadamard-rotates K before quantizing the "
       "cache; llama.cpp quantizes -ctk as it is"),
    _f("-vhad --v-cache-hadamard", 0, f"{_IK}: Hadamard-rotates V before quantizing the "
       "cache; llama.cpp quantizes -ctv as it is"),
    _f("-smgs --split-mode-graph-scheduling", 0, f"{_IK}: schedules -sm graph; {_NOT_IK}"),
    _f("-sas --scheduler-async", "?", f"{_IK}: evaluates graphs asynchronously; {_NOT_IK}"),
    _f("-smf16 --split-mode-f16", 0, f"{_IK}: f16 data between GPUs; {_NOT_IK}"),
    _f("-smf32 --split-mode-f32", 0, f"{_IK}: f32 data between GPUs; {_NOT_IK}"),
    _f("-grt --graph-reduce-type", 1, f"{_IK}: type of data between GPUs; {_NOT_IK}"),
    _f("-gap --graph-attn-precision", 1, f"{_IK}: attention precision under -sm graph; "
       f"{_NOT_IK}"),
    _f("-cuda --cuda-params", 1, f"{_IK}: tunes its CUDA kernels; {_NOT_IK}"),
    _f("--max-gpu", 1, f"{_IK}: caps the GPUs -sm graph uses; {_NOT_IK}"),
    _f("-op --offload-policy", 1, f"{_IK}: which ops run on the GPU; {_NOT_IK}"),
    _f("-mea --max-extra-alloc", 1, f"{_IK}: extra compute-buffer room; {_NOT_IK}"),
    _f("-wgt --worst-graph-tokens", 1, f"{_IK}: sizes the reserved graph; {_NOT_IK}"),
    _f("--defer-experts", 0, f"{_IK}: loads experts on first use; {_NOT_IK}"),
    _f("-rcache --rope-cache", 0, "ik_llama.cpp no longer supports it either"),
    _f("-fdn --fused-delta-net", 1, "deprecated in ik_llama.cpp"),
    _f("--fit-margin -gfm --gpu-fit-margin", 1, "ik_llama.cpp's margin for --fit, which "
       "specwire does not do (-ngl and -c are used as given)"),
    _f("-ctk-first --cache-type-k-first -ctk-last --cache-type-k-last -ctv-first "
       "--cache-type-v-first -ctv-last --cache-type-v-last", 1,
       "ik_llama.cpp's per-layer KV cache types; the cache here is -ctk/-ctv throughout"),
    # memory and device fitting
    _f("-fit --fit", "?", "llama.cpp lowers unset -ngl/-c to fit device memory; specwire "
       "uses -ngl and -c as given"),
    _f("-fitt --fit-target", 1, "the margin for --fit, which specwire does not do"),
    _f("-fitc --fit-ctx", 1, "the floor for --fit, which specwire does not do"),
    _f("-kvu --kv-unified", 0, "each slot holds -c/-np tokens here, as llama.cpp splits "
       "the context without -kvu; slots cannot grow into one shared pool of cells"),
    _f("-no-kvu --no-kv-unified", 0, "already so here: each slot holds -c/-np tokens"),
    _f("--swa-full", 0, "always on here: rolling back rejected draft tokens needs the "
       "full sliding-window cache"),
    _f("-dt --defrag-thold", 1, "deprecated in llama.cpp; the cache defragments by itself"),
    _f("-nkvo --no-kv-offload -kvo --kv-offload", 0, "the KV cache follows its layer's "
       "device (-ngl) here"),
    _f("--no-host", 0, "host buffers are left at llama.cpp's default"),
    _f("--op-offload --no-op-offload", 0, "left at llama.cpp's default (on)"),
    _f("--check-tensors", 0, "tensor data is not scanned at load"),
    _f("-lm --load-mode", 1, "loading follows --no-mmap / --mlock here"),
    _f("-lzm --lazy-mode", 1, "tensors are read as llama.cpp's default does"),
    _f("--moe-cache-mib", 1, "no GPU cache of CPU-held experts here (-ot/--cpu-moe place "
       "them)"),
    _f("-ncffn --n-cpu-ffn", 1, "place dense FFN weights with -ot instead"),
    _f("-C --cpu-mask -Cr --cpu-range --cpu-strict --prio --poll -Cb --cpu-mask-batch "
       "-Crb --cpu-range-batch --cpu-strict-batch --prio-batch --poll-batch", 1,
       "thread affinity and priority are left to the OS (-t / -tb set the counts)"),
    _f("-Cd --cpu-mask-draft -Crd --cpu-range-draft --cpu-strict-draft --prio-draft "
       "--poll-draft -Cbd --cpu-mask-batch-draft --cpu-strict-batch-draft "
       "--prio-batch-draft --poll-batch-draft --spec-draft-cpu-mask --spec-draft-cpu-range "
       "--spec-draft-cpu-strict --spec-draft-prio --spec-draft-poll "
       "--spec-draft-cpu-mask-batch --spec-draft-cpu-strict-batch --spec-draft-prio-batch "
       "--spec-draft-poll-batch", 1,
       "the draft's thread affinity is left to the OS (-td / -tbd set the counts)"),
    _f("-tm --threads-mtmd", 1, "no multimodal projector here"),
    # batching, caches and slots
    _f("-cb --cont-batching", 0, "always on: requests join and leave the batch between "
       "steps"),
    _f("-nocb --no-cont-batching", 0, "continuous batching is always on here; each "
       "request's tokens do not depend on it"),
    _f("--cache-prompt", 0, "always on: each slot keeps its last prompt's cache"),
    _f("--no-cache-prompt", 0, "the prompt cache cannot change the output here, so it "
       "stays on"),
    _f("--cache-idle-slots --no-cache-idle-slots", 0, "idle slots keep their cache in the "
       "context here"),
    _f("-cram --cache-ram", 1, "serve keeps prompt caches in the slots' KV cache, not in "
       "RAM (`specwire draft -cram` sizes the draft node's)"),
    _f("-crs --cache-ram-similarity -cram-n-min --cache-ram-n-min", 1,
       "serve has no RAM prompt cache (see -cram)"),
    _f("-ctxcp --ctx-checkpoints --swa-checkpoints", 1, "no context checkpoints: the "
       "sliding-window cache is kept whole (--swa-full)"),
    _f("-cms --checkpoint-min-step --ctx-checkpoints-interval --ctx-checkpoints-tolerance",
       1, "no context checkpoints here"),
    _f("-lcs --lookup-cache-static", 1, "lookup decoding's n-gram file built from a corpus; "
       "specwire's n-gram drafter learns from requests (-lcd keeps that in a file)"),
    _f("--props", 0, "POST /props is not implemented; GET /props is served"),
    _f("--sse-ping-interval", 1, "streams send every token at once; no keep-alive pings"),
    _f("--sleep-idle-seconds", 1, "the models stay loaded"),
    # logging and output
    _f("--log-enable", 0, "logging is on (old llama.cpp's flag)"),
    _f("-ld --logdir", 1, "ik_llama.cpp's YAML dump of each run; specwire logs to stderr"),
    _f("--log-new --log-append", 0, "old llama.cpp's log-file modes"),
    _f("--log-colors", "?", "specwire's log lines are plain"),
    _f("--log-prefix --no-log-prefix --log-timestamps --no-log-timestamps", 0,
       "specwire's log lines always carry a time and a level"),
    _f("--log-jsonl --no-log-jsonl", 0, "specwire logs text lines"),
    _f("--log-format", 1, "specwire logs text lines"),
    _f("--log-prompts-dir", 1, "requests are not written to files"),
    _f("--perf --no-perf", 0, "llama.cpp's internal timings are off; `timings` in each "
       "response carries specwire's"),
    _f("-e --escape --no-escape", 0, "escapes apply to prompts given on llama-cli's command "
       "line; the server takes its prompts as JSON"),
    _f("--minilog", 0, "ik_llama.cpp's short log"),
    _f("--send-done", 0, "streams end with data: [DONE] on the OpenAI endpoints already"),
    _f("--offline", 0, "specwire never downloads"),
    # HTTP front end
    _f("--reuse-port", 0, "the port is bound once"),
    _f("--path", 1, "the live page is built in; no static directory"),
    _f("--ui-config --webui-config --ui-config-file --webui-config-file", 1,
       "specwire's live page has no settings to preset"),
    _f("--ui-mcp-proxy --webui-mcp-proxy --no-ui-mcp-proxy --no-webui-mcp-proxy", 0,
       "no MCP proxy here"),
    _f("--tags", 1, "informational in llama-server too"),
    _f("--media-path", 1, "no multimodal input here"),
    _f("-hft --hf-token", 1, "specwire never downloads models"),
    _f("--sql-save-file --sqlite-zstd-ext-file", 1, "ik_llama.cpp's saved conversations"),
    # chat
    _f("--no-jinja", 0, "templates are always rendered with Jinja here"),
    _f("--peg", 0, "ik_llama.cpp's parser switch; tool calls are parsed per template here"),
    _f("--reasoning-tokens", 1, "slots are chosen by the whole prompt here"),
    _f("--reasoning-preserve --no-reasoning-preserve", 0, "the template decides what "
       "history keeps"),
    _f("-r --reverse-prompt", 1, "llama-cli's interactive stop; server requests give "
       "`stop`"),
    _f("--no-mmproj --no-mmproj-auto --mmproj-auto --no-mmproj-offload --mmproj-offload",
       0, "no multimodal projector here"),
    _f("--image-min-tokens --image-max-tokens --mtmd-batch-max-tokens --video-fps "
       "--video-timestamp-interval --video-ffmpeg-dir -mmdev --mmproj-device "
       "--mtmd-kq-type", 1, "no multimodal projector here"),
    # drafting knobs (lossless: they only change the speed)
    _f("-ps --p-split --draft-p-split --spec-draft-p-split", 1,
       f"llama.cpp's tree-split probability; {_SPEC}"),
    _f("--spec-draft-sampling", 1, f"how the draft samples; {_SPEC} (see --verify)"),
    _f("--spec-draft-backend-sampling --no-spec-draft-backend-sampling", 0, _SPEC),
    _f("-bs --backend-sampling", 0, "llama.cpp's experimental GPU sampling; sampling is "
       "done here, and is the same either way"),
    _f("--spec-ngram-mod-n-min --spec-ngram-mod-n-max --spec-ngram-mod-n-match "
       "--spec-ngram-simple-size-n --spec-ngram-simple-size-m --spec-ngram-simple-min-hits "
       "--spec-ngram-map-k-size-n --spec-ngram-map-k-size-m --spec-ngram-map-k-min-hits "
       "--spec-ngram-map-k4v-size-n --spec-ngram-map-k4v-size-m "
       "--spec-ngram-map-k4v-min-hits --spec-ngram-size-n --spec-ngram-size-m "
       "--spec-ngram-min-hits", 1,
       f"llama.cpp's n-gram lookup sizes; specwire's n-gram drafter learns its own; {_SPEC}"),
    _f("--spec-synth-len --spec-synth-rates", 1, "llama.cpp's synthetic acceptance for "
       "benchmarks; `specwire bench --modes random` measures a useless drafter"),
    _f("--spec-replace", 2, f"maps target text to draft text for unlike vocabularies; "
       f"specwire needs one tokenizer for both; {_SPEC}"),
    _f("--spec-autotune", 0, f"ik_llama.cpp's draft-length tuning; --draft-policy adaptive "
       f"does that here; {_SPEC}"),
    _f("-draft --draft-params", 1, f"ik_llama.cpp's draft settings string; {_SPEC}"),
    _f("--recurrent-ckpt-mode", 1, "ik_llama.cpp's checkpoints of recurrent models"),
)

#: refused: accepting them would change the output without saying so.
REFUSED: tuple[Flag, ...] = (
    _f("--samplers", 1, "specwire samples in llama.cpp's default order (penalties, "
       "top-k, top-p, min-p, temperature); another order would differ"),
    _f("--sampling-seq --sampler-seq", 1, "specwire samples in llama.cpp's default order "
       "(penalties, top-k, top-p, min-p, temperature)"),
    _f("--top-nsigma --top-n-sigma", 1, "top-n-sigma sampling is not implemented",
       ("-1", "-1.0", "-1.00", "0", "0.0")),
    _f("--xtc-probability", 1, "XTC sampling is not implemented", ("0", "0.0", "0.00")),
    _f("--xtc-threshold", 1, "XTC sampling is not implemented", ("0.1", "0.10", "1", "1.0")),
    _f("--typical --typical-p", 1, "locally typical sampling is not implemented",
       ("1", "1.0", "1.00")),
    _f("--dry-multiplier", 1, "DRY sampling is not implemented", ("0", "0.0", "0.00")),
    _f("--dry-base --dry-allowed-length --dry-penalty-last-n --dry-sequence-breaker", 1,
       "DRY sampling is not implemented"),
    _f("--dynatemp-range", 1, "dynamic temperature is not implemented", ("0", "0.0")),
    _f("--dynatemp-exp", 1, "dynamic temperature is not implemented", ("1", "1.0")),
    _f("--mirostat", 1, "Mirostat sampling is not implemented", ("0",)),
    _f("--mirostat-lr --mirostat-ent", 1, "Mirostat sampling is not implemented"),
    _f("--adaptive-target", 1, "adaptive-p sampling is not implemented", ("-1", "-1.0")),
    _f("--adaptive-decay", 1, "adaptive-p sampling is not implemented"),
    _f("--adaptive-updt-w-cur", 0, "adaptive-p sampling is not implemented"),
    _f("--tfs", 1, "tail-free sampling is not implemented", ("1", "1.0")),
    _f("--penalize-nl", 0, "newline penalties are not implemented"),
    _f("--cfg-negative-prompt --cfg-negative-prompt-file --cfg-scale", 1,
       "classifier-free guidance is not implemented"),
    _f("--banned-string-file --banned-n --allowlist-unicode-rule --allowlist-pieces "
       "--allowlist-keyword --allowlist-keyword-delay --expiring-logit-bias-file", 1,
       "ik_llama.cpp's banned strings and allow-lists are not implemented"),
    _f("-l --logit-bias", 1, "a server-wide logit bias is not implemented; give "
       "logit_bias in the request"),
    _f("--ignore-eos", 0, "a server-wide ignore-eos is not implemented; give ignore_eos in "
       "the request"),
    _f("--presence-penalty", 1, "a server-wide default is not implemented; give "
       "presence_penalty in the request", ("0", "0.0", "0.00")),
    _f("--frequency-penalty", 1, "a server-wide default is not implemented; give "
       "frequency_penalty in the request", ("0", "0.0", "0.00")),
    _f("--control-vector --control-vector-scaled", 1, "control vectors are not "
       "implemented"),
    _f("--control-vector-layer-range", 2, "control vectors are not implemented"),
    _f("--override-kv", 1, "overriding the GGUF's metadata is not implemented"),
    _f("-mm --mmproj -mmu --mmproj-url", 1, "multimodal input is not implemented"),
    _f("--embedding --embeddings --rerank --reranking", 0, "embeddings and reranking are "
       "not implemented; this server generates text"),
    _f("--pooling --attention --embd-normalize", 1, "embeddings are not implemented"),
    _f("-hf -hfr --hf-repo -hff --hf-file -mu --model-url -dr --docker-repo -hfd -hfrd "
       "--hf-repo-draft --spec-draft-hf", 1, "specwire does not download models; give "
       "the file with -m / -md"),
    _f("--embd-gemma-default --fim-qwen-1.5b-default --fim-qwen-3b-default "
       "--fim-qwen-7b-default --fim-qwen-7b-spec --fim-qwen-14b-spec --fim-qwen-30b-default "
       "--gpt-oss-20b-default --gpt-oss-120b-default --vision-gemma-4b-default "
       "--vision-gemma-12b-default --spec-default", 0,
       "these download models; give the files with -m / -md"),
    _f("--models-dir --models-preset --models-max", 1, "router mode is not implemented: "
       "one target per server"),
    _f("--models-autoload --no-models-autoload", 0, "router mode is not implemented"),
    _f("--tools --tools-runtime --mcp-servers-config --mcp-servers-json", 1,
       "llama-server's built-in agent tools are not implemented; clients run their tools"),
    _f("-ag --agent -no-ag --no-agent", 0, "llama-server's built-in agent tools are not "
       "implemented"),
    _f("--skip-chat-parsing --no-skip-chat-parsing", 0, "tool calls and reasoning are "
       "always parsed out of the content here"),
    _f("--reasoning-effort", 1, "not passed to the template yet; use "
       "--chat-template-kwargs", ("default",)),
    _f("--reasoning-budget-message", 1, "a reasoning budget other than -1 or 0 is not "
       "implemented"),
    _f("-rea --reasoning", 1, "use --reasoning-budget 0 (off) or -1 (on)", ("auto",)),
)


class _Seen(argparse.Action):
    """Records (the spelling given, its values), so that a warning names what was typed."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        seen = list(getattr(namespace, self.dest, None) or [])
        if values is None or values == []:
            values = ()
        elif isinstance(values, str):
            values = (values,)
        seen.append((option_string, tuple(values)))
        setattr(namespace, self.dest, seen)


def add_compat_args(p: argparse.ArgumentParser) -> None:
    """Add every IGNORED and REFUSED flag that `p` does not already take."""
    taken = set(p._option_string_actions)
    g = p.add_argument_group("llama-server flags with no effect here (each warns or refuses)")
    for flag in IGNORED + REFUSED:
        names = [n for n in flag.names if n not in taken]
        if names:
            nargs = None if flag.nargs == 1 else flag.nargs
            g.add_argument(*names, dest=flag.dest, action=_Seen, nargs=nargs, default=None,
                           help=argparse.SUPPRESS)


def check_compat(a: argparse.Namespace) -> None:
    """Warn once for each ignored flag given; refuse the first refused one given."""
    for flag in REFUSED:
        for name, values in getattr(a, flag.dest, None) or ():
            shown = " ".join((name, *values))
            if flag.neutral and values and all(v in flag.neutral for v in values):
                log.warning("%s: ignored (%s; this value turns it off)", shown, flag.why)
                continue
            raise CliError(f"{name}: {flag.why}")
    for flag in IGNORED:
        for name in dict.fromkeys(n for n, _ in getattr(a, flag.dest, None) or ()):
            log.warning("%s: ignored: %s", name, flag.why)


#: the in-process draft model's flags (dest, flag, default): with --draft-url the draft runs
#: on the node, which takes them under its own names.
DRAFT_MODEL_FLAGS = (("ctx_size_draft", "-cd", 0), ("threads_draft", "-td", 1),
                     ("threads_batch_draft", "-tbd", 0), ("n_gpu_layers_draft", "-ngld", 0),
                     ("cache_type_k_draft", "-ctkd", "f16"),
                     ("cache_type_v_draft", "-ctvd", "f16"), ("flash_attn_draft", "-fad", "auto"),
                     ("override_tensor_draft", "-otd", []), ("cpu_moe_draft", "-cmoed", False),
                     ("n_cpu_moe_draft", "-ncmoed", 0), ("device_draft", "-devd", None))


def warn_remote_draft_flags(a: argparse.Namespace) -> None:
    """With --draft-url, the draft model's flags given here do nothing: say so once."""
    if not getattr(a, "draft_url", None):
        return
    given = [flag for dest, flag, default in DRAFT_MODEL_FLAGS
             if getattr(a, dest, default) != default]
    if given:
        log.warning("%s: ignored with --draft-url: the draft model runs on the draft node; "
                    "give these to `specwire draft` (-c, -t, -tb, -ngl, -ctk, -ctv, ...)",
                    ", ".join(given))


#: how to build llama-cpp-python with llama.cpp's RPC backend (docs/deployment.md).
RPC_BUILD = ('CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir '
             'llama-cpp-python')


def add_rpc_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rpc", metavar="HOST:PORT[,...]", default=None,
                   help="llama.cpp rpc-servers whose devices take layers of the model as "
                   "local GPUs do (-ngl, -dev); needs a llama.cpp built with its RPC backend")


def check_rpc(a: argparse.Namespace) -> None:
    """--rpc: each rpc-server registered as a device before any model loads (llama.cpp's
    meaning); one line where this llama.cpp has no RPC backend or a server is not there."""
    from specwire.backend import placement

    servers = getattr(a, "rpc", None)
    if not servers:
        return
    hint = (f"; build it with {RPC_BUILD} (docs/deployment.md) and run llama.cpp's "
            "rpc-server on each box")
    try:
        added = placement.add_rpc_servers([s.strip() for s in servers.split(",") if s.strip()],
                                          hint)
    except BackendError as e:
        raise CliError(str(e)) from None
    log.info("--rpc: devices %s", ", ".join(added) or "already registered")

