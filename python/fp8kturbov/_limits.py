"""The library's defaults and limits that Python needs without loading it.

Each mirrors one macro of ``cuda/include/fp8kturbov.h`` (tests/test_limits.py compares them), except
``ROTATION_HEAD_DIMS``, which FORMAT.md §6 fixes. Launches never pass these defaults: a parameter
left at None keeps the value ``fp8kturbov_*_params_init`` gave it.
"""

#: ``FP8KTURBOV_MAX_QUERY_LEN``: the most query rows of one sequence in a multi-token decode
#: (``max_q_len``).
MAX_Q_LEN = 16
#: ``FP8KTURBOV_DEFAULT_SPARSE_V_THRESHOLD``: the decode's ``sparse_v_threshold`` when none is given.
DEFAULT_SPARSE_V_THRESHOLD = 1e-3
#: ``FP8KTURBOV_DEFAULT_V_BITS``: the V code width of a layout when none is given.
DEFAULT_V_BITS = 3
#: The head dims that ``VRotation.HADAMARD`` is defined for (those FORMAT.md §6 gives signs for).
ROTATION_HEAD_DIMS = (128, 256, 512)
