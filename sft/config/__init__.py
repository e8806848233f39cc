"""The run configuration: one tree of dataclasses (`schema`), loaded from YAML plus dotted
command-line overrides (`load`) and validated (`checks`).

The field docstrings (the string literal under each field) are the documentation of every key;
`python -m sft.config` prints them as the config reference (`reference`). Precedence: command-line
overrides > YAML file > defaults. Everything is validated before any process group, model or
output directory exists, and all problems are reported in one `ConfigError` naming the file.
"""

from sft.config.ac_modes import AC_MODES, ACMode
from sft.config.checks import ConfigError, check_machine
from sft.config.load import load_config, parse_args, read_resolved_config, to_yaml
from sft.config.paths import DATA_FILE_SUFFIXES, is_local_path
from sft.config.schema import (DTYPES, LOGITS_PER_CHUNK, ACConfig,
                               CheckpointConfig, CompileConfig, Config, CPConfig, DataConfig, DistConfig, EvalConfig,
                               FSDPConfig, LoggingConfig, LoRAConfig, MoEConfig, ModelConfig, OptimConfig, PlanConfig,
                               PrecisionConfig, TrainConfig)
from sft.config.state_bytes import STATE_BYTES, StateBytes, state_bytes

__all__ = ["AC_MODES", "DATA_FILE_SUFFIXES", "DTYPES", "LOGITS_PER_CHUNK", "STATE_BYTES", "ACConfig", "ACMode",
           "CheckpointConfig", "CompileConfig", "Config", "ConfigError", "CPConfig", "DataConfig", "DistConfig",
           "EvalConfig", "FSDPConfig", "LoggingConfig", "LoRAConfig", "MoEConfig", "ModelConfig", "OptimConfig",
           "PlanConfig", "PrecisionConfig", "StateBytes", "TrainConfig", "check_machine", "is_local_path",
           "load_config", "parse_args", "read_resolved_config", "state_bytes", "to_yaml"]
