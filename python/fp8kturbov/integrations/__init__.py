"""Integrations of the compressed cache with model libraries, each an optional extra.

``fp8kturbov.integrations.transformers``: a Hugging Face transformers ``Cache`` and the
``attn_implementation="fp8kturbov"`` attention (``pip install "fp8kturbov[transformers]"``).
Nothing here is imported by ``import fp8kturbov``.
"""
