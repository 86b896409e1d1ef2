from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_DDTREE: _ClassVar[Mode]
    MODE_CHAIN: _ClassVar[Mode]
    MODE_AR: _ClassVar[Mode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
MODE_UNSPECIFIED: Mode
MODE_DDTREE: Mode
MODE_CHAIN: Mode
MODE_AR: Mode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop_strings", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("mode", "budget")
    MODE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    budget: int
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., budget: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "sampling", "speculation", "client_request_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    speculation: SpeculationParams
    client_request_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., client_request_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "steps", "target_forwards", "mean_acceptance_length", "finish_reason", "ttft_ms", "mode")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    steps: int
    target_forwards: int
    mean_acceptance_length: float
    finish_reason: FinishReason
    ttft_ms: float
    mode: Mode
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., target_forwards: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., ttft_ms: _Optional[float] = ..., mode: _Optional[_Union[Mode, str]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "accepted_length", "usage", "degradation")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DEGRADATION_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    accepted_length: int
    usage: Usage
    degradation: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., accepted_length: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., degradation: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "model_type", "vocab_size", "max_context", "tp_size", "drafter", "block_size", "eos_token_ids", "modes", "max_budget", "max_tokens_limit", "tokenizer", "version", "budget_policy")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUDGET_POLICY_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_type: str
    vocab_size: int
    max_context: int
    tp_size: int
    drafter: str
    block_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    modes: _containers.RepeatedScalarFieldContainer[Mode]
    max_budget: int
    max_tokens_limit: int
    tokenizer: str
    version: str
    budget_policy: BudgetPolicyInfo
    def __init__(self, model: _Optional[str] = ..., model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., tp_size: _Optional[int] = ..., drafter: _Optional[str] = ..., block_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., modes: _Optional[_Iterable[_Union[Mode, str]]] = ..., max_budget: _Optional[int] = ..., max_tokens_limit: _Optional[int] = ..., tokenizer: _Optional[str] = ..., version: _Optional[str] = ..., budget_policy: _Optional[_Union[BudgetPolicyInfo, _Mapping]] = ...) -> None: ...

class BudgetPolicyInfo(_message.Message):
    __slots__ = ("kind", "tokens_per_step", "min_budget", "max_budget", "confidence", "main_factor", "side_factor", "other_ms", "verify_costs", "last_width", "last_chain")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    MAIN_FACTOR_FIELD_NUMBER: _ClassVar[int]
    SIDE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    OTHER_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COSTS_FIELD_NUMBER: _ClassVar[int]
    LAST_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LAST_CHAIN_FIELD_NUMBER: _ClassVar[int]
    kind: str
    tokens_per_step: int
    min_budget: int
    max_budget: int
    confidence: float
    main_factor: float
    side_factor: float
    other_ms: float
    verify_costs: _containers.RepeatedCompositeFieldContainer[VerifyCost]
    last_width: int
    last_chain: bool
    def __init__(self, kind: _Optional[str] = ..., tokens_per_step: _Optional[int] = ..., min_budget: _Optional[int] = ..., max_budget: _Optional[int] = ..., confidence: _Optional[float] = ..., main_factor: _Optional[float] = ..., side_factor: _Optional[float] = ..., other_ms: _Optional[float] = ..., verify_costs: _Optional[_Iterable[_Union[VerifyCost, _Mapping]]] = ..., last_width: _Optional[int] = ..., last_chain: _Optional[bool] = ...) -> None: ...

class VerifyCost(_message.Message):
    __slots__ = ("batch", "width", "ms")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    batch: int
    width: int
    ms: float
    def __init__(self, batch: _Optional[int] = ..., width: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...
