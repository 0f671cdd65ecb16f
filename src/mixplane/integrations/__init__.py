"""Adapters that feed a training framework's own loop from a mixture.

Each framework has its module, which alone imports the framework (install the extra of the same name):

* :mod:`mixplane.integrations.hf` — the Hugging Face Trainer and accelerate (``mixplane[hf]``);
* :mod:`mixplane.integrations.lightning` — Lightning's ``LightningDataModule`` (``mixplane[lightning]``);
* :mod:`mixplane.integrations.megatron` — Megatron-Core's data iterator and ``get_batch`` (``mixplane[megatron]``);
* :mod:`mixplane.integrations.torchtitan` — torchtitan's ``BaseDataLoader`` (``mixplane[torchtitan]``);

and :mod:`mixplane.integrations.steps` holds what they share (torch only): the per-rank stream of a
mixture's microbatches with an exact state at every microbatch, and the learning-rate scale applied
to an optimizer's step. See docs/integrations.md.
"""
