"""The engine: runs models. The :class:`~vlmbind.engine.vlm.VLM` wrapper and ``load``, batches, hooks and
interventions, the patching methods, capture to disk, decoding, the TransformerLens / nnsight hand-off and the rank
group of data-parallel runs. It knows no analysis and no command line."""
