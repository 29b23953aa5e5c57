"""Typed, frozen configuration: one TOML file maps one-to-one onto these dataclasses.

Precedence (lowest first): dataclass defaults < TOML file < environment variables
(``COMMRT_<SECTION>_<FIELD>``, e.g. ``COMMRT_COMM_BACKEND=gloo``) < explicit overrides
(CLI flags or keyword arguments). Environment variables are read in ``load.py`` and nowhere
else. The package's files: ``checks`` (validation every section shares), one file per group of
sections (``comm``, ``ps``, ``quant_log``), ``tree`` (the whole Config and its digest),
``load`` (file, environment, overrides, with each value's source), ``env`` (the variable
table) and ``render`` (TOML output for ``commrt config``).
"""
from commrt.runtime.config.checks import MAX_HEARTBEAT_S, MAX_TIMEOUT_S, FieldError
from commrt.runtime.config.comm import (BACKEND_NAMES, HIERARCHICAL_MODES, INTRA_NODE_MODES, SECURITY_MODES,
                                        ClusterConfig, CommConfig, SecurityConfig)
from commrt.runtime.config.env import OTHER_VARIABLES, env_table, env_var, markdown_env_table, unknown_variables
from commrt.runtime.config.load import load_config, load_with_sources, read_file
from commrt.runtime.config.ps import PS_MODES, PS_OPTIMIZERS, PsConfig
from commrt.runtime.config.quant_log import QUANT_ROUNDINGS, QUANT_SCALE_DTYPES, LogConfig, QuantConfig
from commrt.runtime.config.tree import DIGESTED, OTHER_SECTIONS, SECTION_TYPES, Config
from commrt.runtime.errors import ConfigError

__all__ = ["Config", "CommConfig", "ClusterConfig", "SecurityConfig", "PsConfig", "QuantConfig", "LogConfig",
           "ConfigError", "FieldError", "load_config", "load_with_sources", "read_file", "env_var", "env_table",
           "markdown_env_table", "unknown_variables", "OTHER_VARIABLES", "DIGESTED", "OTHER_SECTIONS",
           "SECTION_TYPES", "BACKEND_NAMES", "HIERARCHICAL_MODES", "INTRA_NODE_MODES", "SECURITY_MODES",
           "PS_MODES", "PS_OPTIMIZERS", "QUANT_SCALE_DTYPES", "QUANT_ROUNDINGS", "MAX_TIMEOUT_S", "MAX_HEARTBEAT_S"]
