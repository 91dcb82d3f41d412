"""When a forked child would differ from a fresh process, and must therefore start cold.

Libraries read some environment variables once, at import (thread pools, CPU kernels, device lists,
cache directories, the interpreter's own settings): a child forked from a server that imported them
under other values would silently run with the server's. A request whose values for those variables,
or whose Python, differ from the server's is refused with a reason, and the owner starts it fresh.
"""

from __future__ import annotations

from collections.abc import Mapping

IMPORT_TIME_PREFIXES = (
    "ATEN_",
    "CUDA",
    "CUBLAS",
    "GLOO_",
    "GOMP_",
    "HF_",
    "HIP_",
    "KMP_",
    "LD_",
    "MALLOC_",
    "MKL_",
    "NCCL_",
    "NUMEXPR_",
    "NVIDIA_",
    "OMP_",
    "OPENBLAS_",
    "PYTHON",
    "PYTORCH_",
    "ROCM_",
    "TOKENIZERS_",
    "TORCH",
    "TRANSFORMERS_",
    "XDG_CACHE_HOME",
)
"""Variable-name prefixes that torch, transformers, tokenizers, OpenMP/BLAS or Python read at import
or at interpreter start. PYTHONUNBUFFERED is honoured by the child itself (``child.py``)."""

CHILD_APPLIED = frozenset({"PYTHONUNBUFFERED", "PYTHONPATH"})
"""Applied by the child itself: buffering of its streams, and its import path (``sys_path`` of the
request is built from the request's PYTHONPATH as a fresh interpreter would build it)."""

ENTRY_MODULES = frozenset({"prime_node", "prime_node.cli.main", "prime_node.ml.inference_worker"})
"""What a warm child may run, as ``python -m MODULE``: the CLI, and the inference child that
``run-trainer --local`` starts. Anything else starts cold (trainer ranks are torchrun's children)."""


def import_time_view(env: Mapping[str, str]) -> dict[str, str]:
    return {
        key: value
        for key, value in env.items()
        if key.startswith(IMPORT_TIME_PREFIXES) and key not in CHILD_APPLIED
    }


def cold_reason(
    server_env: Mapping[str, str], server_executable: str, env: Mapping[str, str], executable: str
) -> str | None:
    """Why a request cannot be forked from this server (None: it can)."""
    if executable != server_executable:
        return f"another Python ({executable})"
    ours, theirs = import_time_view(server_env), import_time_view(env)
    if ours != theirs:
        differing = sorted(key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key))
        return "import-time variables differ: " + ", ".join(differing[:8])
    return None
