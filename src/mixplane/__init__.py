"""mixplane: a disaggregated multisource data plane for foundation-model training."""

__version__ = "0.1.0"
