from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFY_GREEDY: _ClassVar[VerifyMode]
    VERIFY_COUPLED: _ClassVar[VerifyMode]
    VERIFY_REJECTION: _ClassVar[VerifyMode]
VERIFY_GREEDY: VerifyMode
VERIFY_COUPLED: VerifyMode
VERIFY_REJECTION: VerifyMode

class HelloRequest(_message.Message):
    __slots__ = ("protocol_version", "vocab_fingerprint", "n_vocab", "target_model")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    vocab_fingerprint: str
    n_vocab: int
    target_model: str
    def __init__(self, protocol_version: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., n_vocab: _Optional[int] = ..., target_model: _Optional[str] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("protocol_version", "vocab_fingerprint", "n_vocab", "draft_model", "modes", "n_ctx", "max_sessions", "sync_port")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SYNC_PORT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    vocab_fingerprint: str
    n_vocab: int
    draft_model: str
    modes: _containers.RepeatedScalarFieldContainer[str]
    n_ctx: int
    max_sessions: int
    sync_port: int
    def __init__(self, protocol_version: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., n_vocab: _Optional[int] = ..., draft_model: _Optional[str] = ..., modes: _Optional[_Iterable[str]] = ..., n_ctx: _Optional[int] = ..., max_sessions: _Optional[int] = ..., sync_port: _Optional[int] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed", "presence_penalty", "frequency_penalty", "logit_bias_ids", "logit_bias_values")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPEAT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPEAT_LAST_N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repeat_last_n: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repeat_penalty: _Optional[float] = ..., repeat_last_n: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("history", "sampling", "mode", "pipelined", "lookahead", "want", "p_min", "top_k_q", "timing", "calibrated", "keep_min", "alternates", "alternate_len", "cache_scope", "no_store", "tree", "second_choices")
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    P_MIN_FIELD_NUMBER: _ClassVar[int]
    TOP_K_Q_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_FIELD_NUMBER: _ClassVar[int]
    KEEP_MIN_FIELD_NUMBER: _ClassVar[int]
    ALTERNATES_FIELD_NUMBER: _ClassVar[int]
    ALTERNATE_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    NO_STORE_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SECOND_CHOICES_FIELD_NUMBER: _ClassVar[int]
    history: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    mode: VerifyMode
    pipelined: bool
    lookahead: int
    want: int
    p_min: float
    top_k_q: int
    timing: bool
    calibrated: bool
    keep_min: float
    alternates: int
    alternate_len: int
    cache_scope: str
    no_store: bool
    tree: int
    second_choices: bool
    def __init__(self, history: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., mode: _Optional[_Union[VerifyMode, str]] = ..., pipelined: _Optional[bool] = ..., lookahead: _Optional[int] = ..., want: _Optional[int] = ..., p_min: _Optional[float] = ..., top_k_q: _Optional[int] = ..., timing: _Optional[bool] = ..., calibrated: _Optional[bool] = ..., keep_min: _Optional[float] = ..., alternates: _Optional[int] = ..., alternate_len: _Optional[int] = ..., cache_scope: _Optional[str] = ..., no_store: _Optional[bool] = ..., tree: _Optional[int] = ..., second_choices: _Optional[bool] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("position", "accepted", "tokens", "gen", "want", "keep_min", "alternate")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GEN_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    KEEP_MIN_FIELD_NUMBER: _ClassVar[int]
    ALTERNATE_FIELD_NUMBER: _ClassVar[int]
    position: int
    accepted: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    gen: int
    want: int
    keep_min: float
    alternate: bool
    def __init__(self, position: _Optional[int] = ..., accepted: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., gen: _Optional[int] = ..., want: _Optional[int] = ..., keep_min: _Optional[float] = ..., alternate: _Optional[bool] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetMessage(_message.Message):
    __slots__ = ("open", "verdict", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: Open
    verdict: Verdict
    close: Close
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ...) -> None: ...

class DraftChunk(_message.Message):
    __slots__ = ("gen", "start", "tokens", "q_k", "q_ids", "q_probs", "done", "busy_us", "cache_n", "prompt_n", "alternates", "step_sessions", "step_alternates")
    GEN_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_K_FIELD_NUMBER: _ClassVar[int]
    Q_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    BUSY_US_FIELD_NUMBER: _ClassVar[int]
    CACHE_N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_N_FIELD_NUMBER: _ClassVar[int]
    ALTERNATES_FIELD_NUMBER: _ClassVar[int]
    STEP_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STEP_ALTERNATES_FIELD_NUMBER: _ClassVar[int]
    gen: int
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q_k: int
    q_ids: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    done: bool
    busy_us: int
    cache_n: int
    prompt_n: int
    alternates: _containers.RepeatedCompositeFieldContainer[Alternate]
    step_sessions: int
    step_alternates: int
    def __init__(self, gen: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., q_k: _Optional[int] = ..., q_ids: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ..., done: _Optional[bool] = ..., busy_us: _Optional[int] = ..., cache_n: _Optional[int] = ..., prompt_n: _Optional[int] = ..., alternates: _Optional[_Iterable[_Union[Alternate, _Mapping]]] = ..., step_sessions: _Optional[int] = ..., step_alternates: _Optional[int] = ...) -> None: ...

class Alternate(_message.Message):
    __slots__ = ("at", "tokens")
    AT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    at: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, at: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftError(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class DraftMessage(_message.Message):
    __slots__ = ("chunk", "error")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chunk: DraftChunk
    error: DraftError
    def __init__(self, chunk: _Optional[_Union[DraftChunk, _Mapping]] = ..., error: _Optional[_Union[DraftError, _Mapping]] = ...) -> None: ...

class PingMessage(_message.Message):
    __slots__ = ("seq", "hold_us")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HOLD_US_FIELD_NUMBER: _ClassVar[int]
    seq: int
    hold_us: int
    def __init__(self, seq: _Optional[int] = ..., hold_us: _Optional[int] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...
