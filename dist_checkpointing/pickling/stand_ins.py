"""Inert stand-ins for the Megatron-Core and Transformer Engine classes checkpoints hold.

Megatron-LM training checkpoints pickle some of Megatron's and TE's own classes (the
``args`` enums, the rerun state machine's enums and named tuples, optimizer configs, FP8
recipes). Without those packages, the safe loader rebuilds them as stand-ins registered
under the same names (:data:`STAND_INS`):

* an enum stand-in is a real :class:`enum.Enum` with the class's name, members and values;
  a value it does not know is refused (:class:`StandInMismatch`);
* a named-tuple stand-in has the class's fields; another number of values is refused;
* a config (dataclass) stand-in keeps every stored field as an attribute; fields outside
  the class's known list are kept but flagged (a warning, and :meth:`StandInConfig.unknown_fields`).

Nothing here runs code from the checkpoint or imports Megatron / Transformer Engine.
"""

from __future__ import annotations

import collections
import enum
import logging
from typing import Any, ClassVar, Dict, List, Sequence, Tuple

from ..core import CheckpointingException

logger = logging.getLogger(__name__)


class StandInMismatch(CheckpointingException):
    """Stored data that the stand-in of a Megatron / TE class cannot represent."""


def _split(full_name: str) -> Tuple[str, str]:
    module, _, name = full_name.rpartition(".")
    return module, name


class StandInEnum(enum.Enum):
    """Base of enum stand-ins: an unknown value is refused, naming the class."""

    @classmethod
    def _missing_(cls, value: Any) -> Any:
        raise StandInMismatch(
            f"{cls.__module__}.{cls.__qualname__} has no member with value {value!r} "
            f"(its stand-in knows {', '.join(m.name for m in cls)})")


class StandInStrEnum(str, StandInEnum):
    """Base of stand-ins for ``(str, Enum)`` classes."""


class StandInConfig:
    """Base of config (dataclass) stand-ins: the stored fields become attributes."""

    known_fields: ClassVar[Tuple[str, ...]] = ()

    def __setstate__(self, state: Any) -> None:
        full_name = f"{type(self).__module__}.{type(self).__qualname__}"
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]  # pickle's (dict, slots) form without slots
        if not isinstance(state, dict) or not all(
                isinstance(k, str) and k.isidentifier() and not hasattr(type(self), k) for k in state):
            raise StandInMismatch(f"{full_name}: the stored state is not a dict of field names "
                                  f"(got {type(state).__name__}: {list(state)[:5] if isinstance(state, dict) else ''})")
        self.__dict__.update(state)
        unknown = self.unknown_fields()
        if unknown:
            logger.warning("%s: stored fields %s are not fields of the class this library knows; kept "
                           "as attributes of its stand-in", full_name, ", ".join(unknown))

    def unknown_fields(self) -> List[str]:
        """Stored fields that are not in the class's known field list."""
        return sorted(set(vars(self)) - set(self.known_fields))

    def __eq__(self, other: Any) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment] - mutable, like a dataclass

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def _enum(full_name: str, members: Dict[str, Any], str_valued: bool = False) -> type:
    module, name = _split(full_name)
    base = StandInStrEnum if str_valued else StandInEnum
    return base(name, members, module=module, qualname=name)


def _named_tuple(full_name: str, fields: Sequence[str]) -> type:
    module, name = _split(full_name)
    base = collections.namedtuple(name, fields)  # type: ignore[misc]

    def __new__(cls: type, *values: Any) -> Any:
        if len(values) != len(fields):
            raise StandInMismatch(f"{full_name} holds {len(values)} values; its stand-in has the "
                                  f"{len(fields)} fields {', '.join(fields)}")
        return base.__new__(cls, *values)

    return type(name, (base,), {"__new__": __new__, "__slots__": (), "__module__": module, "__qualname__": name})


def _config(full_name: str, fields: Sequence[str]) -> type:
    module, name = _split(full_name)
    return type(name, (StandInConfig,), {"known_fields": tuple(fields), "__module__": module, "__qualname__": name})


def _str_members(*values: str) -> Dict[str, str]:
    return {v.upper(): v for v in values}


_MODEL_TYPE = {"encoder_or_decoder": 1, "encoder_and_decoder": 2, "retro_encoder": 3, "retro_decoder": 4}
_TE = "transformer_engine.common.recipe"
_FormatHelper = _named_tuple(f"{_TE}._FormatHelper", ("max_fwd", "max_bwd"))
_OPTIMIZER_FIELDS = (
    "lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "weight_decay", "apply_wd_to_qk_layernorm",
    "fp8_recipe", "fp16", "bf16", "reuse_grad_buf_for_mxfp8_param_ag", "params_dtype",
    "use_precision_aware_optimizer", "store_param_remainders", "main_grads_dtype", "main_params_dtype",
    "exp_avg_dtype", "exp_avg_sq_dtype", "optimizer", "loss_scale", "initial_loss_scale", "min_loss_scale",
    "loss_scale_window", "hysteresis", "adam_beta1", "adam_beta2", "adam_eps", "decoupled_weight_decay",
    "sgd_momentum", "muon_momentum", "muon_split_qkv", "muon_nesterov", "muon_scale_mode",
    "muon_fp32_matmul_prec", "muon_coefficient_type", "muon_num_ns_steps", "muon_tp_mode",
    "muon_extra_scale_factor", "soap_shampoo_beta", "soap_precondition_frequency", "soap_use_kl_shampoo",
    "adaptive_muon_moment2_method", "adaptive_muon_beta2", "adaptive_muon_eps", "muon_scalar_optimizer",
    "lion_beta1", "lion_beta2", "use_distributed_optimizer", "use_layer_wise_distributed_optimizer",
    "overlap_param_gather", "overlap_param_gather_with_optimizer_step", "optimizer_cpu_offload",
    "optimizer_offload_fraction", "use_torch_optimizer_for_cpu_offload", "overlap_cpu_optimizer_d2h_h2d",
    "pin_cpu_grads", "pin_cpu_params", "offload_optimizer_states", "clip_grad", "log_num_zeros_in_grad",
    "barrier_with_L1_time", "timers", "config_logger_dir", "optimizer_cuda_graph",
    "use_precision_aware_optimizer_no_fp8_or_ds_fp8",  # set by __post_init__
)
_DELAYED_SCALING_FIELDS = ("margin", "fp8_format", "amax_history_len", "amax_compute_algo",
                           "scaling_factor_compute_algo", "reduce_amax", "fp8_dpa", "fp8_mha",
                           "interval", "override_linear_precision")  # the last two: TE < 1.8
_FP8_GEMMS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")
_FP8_QUANT = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")

_CLASSES: List[type] = [
    _enum("megatron.core.enums.ModelType", _MODEL_TYPE),
    _enum("megatron.core.transformer.enums.ModelType", _MODEL_TYPE),  # before it moved
    _enum("megatron.core.enums.Fp8Recipe", {v: v for v in ("delayed", "tensorwise", "mxfp8", "blockwise",
                                                           "nvfp4", "custom")}, str_valued=True),
    _enum("megatron.core.transformer.enums.LayerType",
          {"embedding": 1, "loss": 2, "encoder": 3, "decoder": 4, "mtp": 5}),
    _enum("megatron.core.transformer.enums.AttnType", {"self_attn": 1, "cross_attn": 2}),
    _enum("megatron.core.transformer.enums.AttnMaskType",
          {"padding": 1, "causal": 2, "no_mask": 3, "padding_causal": 4, "arbitrary": 5,
           "causal_bottom_right": 6}),
    _enum("megatron.core.transformer.enums.AttnBackend",
          {"flash": 1, "fused": 2, "unfused": 3, "local": 4, "auto": 5}),
    _enum("megatron.core.transformer.enums.CudaGraphScope",
          {"full_iteration": 1, "attn": 2, "mlp": 3, "moe": 4, "moe_router": 5, "moe_preprocess": 6,
           "mamba": 7, "full_iteration_inference": 8}),
    _enum("megatron.core.rerun_state_machine.RerunDiagnostic",
          _str_members("correct_result", "transient_error", "persistent_error"), str_valued=True),
    _enum("megatron.core.rerun_state_machine.RerunMode",
          _str_members("disabled", "validate_results", "report_determinism_stats"), str_valued=True),
    _enum("megatron.core.rerun_state_machine.RerunState",
          {"NOT_RUNNING_YET": 0, "INITIAL_RUN": 1, "RERUNNING_IN_PLACE": 2, "WILL_RERUN_FROM_CHECKPOINT": 3,
           "RERUNNING_FROM_CHECKPOINT": 4, "RERUNNING_AGAIN_FROM_CHECKPOINT": 5}),
    _enum("megatron.core.rerun_state_machine.RerunValidationStatus",
          _str_members("rerun_disabled", "initial_run", "first_rerun_not_reproducible",
                       "first_rerun_reproducible", "second_rerun_not_reproducible",
                       "second_rerun_reproducible"), str_valued=True),
    _named_tuple("megatron.core.rerun_state_machine.Caller", ("message", "rank")),
    _named_tuple("megatron.core.rerun_state_machine.Call", ("caller", "sequence")),
    _config("megatron.core.optimizer.optimizer_config.OptimizerConfig", _OPTIMIZER_FIELDS),
    # separate classes before Megatron-Core 0.16, aliases of OptimizerConfig since
    _config("megatron.core.optimizer.optimizer_config.AdamOptimizerConfig", _OPTIMIZER_FIELDS),
    _config("megatron.core.optimizer.optimizer_config.SGDOptimizerConfig", _OPTIMIZER_FIELDS),
    _FormatHelper,
    _enum(f"{_TE}.Format", {"E4M3": _FormatHelper(448, 448), "E5M2": _FormatHelper(57344, 57344),
                            "HYBRID": _FormatHelper(448, 57344), "E2M1": _FormatHelper(6, 6)}),
    _config(f"{_TE}.MMParams", ("use_split_accumulator",)),
    _config(f"{_TE}.QParams", ("power_2_scale", "amax_epsilon", "random_hadamard_transform",
                               "stochastic_rounding", "fp4_2d_quantization")),
    _config(f"{_TE}.DelayedScaling", _DELAYED_SCALING_FIELDS),
    _config("megatron.core.extensions.transformer_engine.TEDelayedScaling", _DELAYED_SCALING_FIELDS),
    _config(f"{_TE}.Float8CurrentScaling", ("fp8_format",) + _FP8_QUANT + _FP8_GEMMS + ("fp8_dpa", "fp8_mha")),
    _config(f"{_TE}.Float8BlockScaling",
            ("fp8_format",) + _FP8_QUANT + ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
            + _FP8_GEMMS + ("fp8_dpa", "fp8_mha")),
    _config(f"{_TE}.MXFP8BlockScaling", ("margin", "fp8_format", "fp8_dpa", "fp8_mha")),
    _config(f"{_TE}.NVFP4BlockScaling",
            ("fp4_format", "fp8_format", "fp4_quant_fwd_inp", "fp4_quant_fwd_weight", "fp4_quant_bwd_grad",
             "disable_rht", "disable_stochastic_rounding", "disable_2d_quantization", "fp8_dpa", "fp8_mha")),
]

# "module.Name" as a pickle writes it -> the stand-in
STAND_INS: Dict[str, type] = {f"{c.__module__}.{c.__qualname__}": c for c in _CLASSES}
