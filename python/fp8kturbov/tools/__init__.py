"""The tools around the library: the command line (`cli`, run as ``python -m fp8kturbov``), the
benchmark harness (`bench`), the demo, the comparison of benchmark runs, the library's report
(`info`) and the V quantisation report (`quality`, with the NumPy model of `model_kv`).

The library never imports this package; these modules import the library's public names.
"""
