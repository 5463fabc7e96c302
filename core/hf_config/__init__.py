"""Hugging Face `config.json` <-> `ModelSpec`, both directions, and the checks of every field
read: `fields` (the table of fields and the one checked accessor `HFConfig.get`), `to_spec`
(config.json -> spec, per family), `from_spec` (spec -> config.json), `runtime` (what the real
model runs beyond the spec, and refusals of what it does not implement), `coverage` (every field
transformers' classes take, classified).

Usage: `read_hf_config(ckpt_dir)`, `spec_from_hf_config(ckpt_dir)`, `spec_to_hf_config(spec)`.
"""

from core.hf_config.fields import (
    FIELDS,
    ROPE_FIELDS,
    HFConfig,
    Rule,
    hf_config_file,
    read_hf_config,
)
from core.hf_config.from_spec import mla_dims, spec_mla_fields, spec_to_hf_config
from core.hf_config.runtime import HFRuntime, fp8_block, hf_runtime
from core.hf_config.to_spec import (
    DTYPE_BYTES,
    FAMILIES,
    hf_config_to_spec,
    hf_dtype_name,
    rope_theta_of,
    spec_from_hf_config,
)

__all__ = [
    "DTYPE_BYTES",
    "FAMILIES",
    "FIELDS",
    "ROPE_FIELDS",
    "HFConfig",
    "HFRuntime",
    "Rule",
    "hf_config_file",
    "hf_config_to_spec",
    "hf_dtype_name",
    "fp8_block",
    "hf_runtime",
    "mla_dims",
    "read_hf_config",
    "rope_theta_of",
    "spec_from_hf_config",
    "spec_mla_fields",
    "spec_to_hf_config",
]
