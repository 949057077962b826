"""The neutral core the two kernel twins stand on.

`kernels_cuda` and `kernels_triton` implement the same contract; what they
share lives here once, importing neither CuPy nor Triton: the contract (ops,
dtypes, argument checks), the search-space type, the float64 and native-torch
references, the timing helper, the provenance columns and the registry that
maps a backend name to its package. The tuner and the trainer import this
package, never a twin by name.
"""
