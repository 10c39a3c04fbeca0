"""The run configuration: the typed schema (schema.py), its loader (load.py), the cross-field rules (checks.py) and
`_target_` resolution of swappable stages (targets.py). It imports no driver module; the driver and its helpers
(tasks/, observe/, sim/) import it."""

from pipeline.config.load import CONF_DIR, DEFAULT_CONFIG, load_config, to_yaml
from pipeline.config.schema import ConfigError, RolloutConfig, RunConfig, monitor_names
from pipeline.config.targets import bind, check_signature, import_target, stage_class, stage_kwargs

__all__ = [
    "CONF_DIR",
    "DEFAULT_CONFIG",
    "ConfigError",
    "RolloutConfig",
    "RunConfig",
    "bind",
    "check_signature",
    "import_target",
    "load_config",
    "monitor_names",
    "stage_class",
    "stage_kwargs",
    "to_yaml",
]
