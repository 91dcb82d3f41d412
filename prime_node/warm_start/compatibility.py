"""When a forked child would differ from a fresh process, and must therefore start cold.

Libraries read some environment variables once, at import (thread pools, CPU kernels, device lists,
cache directories, the interpreter's own settings): a child forked from a server that imported them
under other values would silently run with the server's. A request whose values for those variables,
or whose Python, differ from the server's is refused with a reason, and the owner starts it fresh.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container, Mapping, Sequence

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

RUNTIME_READ = frozenset({"GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
RUNTIME_READ_PREFIXES = ("TORCHELASTIC_",)
"""What torchrun sets for its ranks under the prefixes above that torch reads only when it is used (the
gloo/NCCL process group's construction, the elastic error file and agent store), never at import
(checked in torch 2.13's sources): a warm rank reads them from its own environment as a cold one does."""

SET_BY_TORCH_AT_IMPORT = {"TORCHINDUCTOR_CACHE_DIR": "torch._dynamo.package"}
"""Variables torch writes into its own process's environment when it imports the named module (its
default cache directory), so that every process started after it inherits them. They are import-time
variables of that module only: while the server has not imported it, a child reads the variable from
its own environment when it imports the module itself, as a fresh process would. (Without this, a test
process or launcher that had imported torch._dynamo started every child cold.)"""

ENTRY_MODULES = frozenset(
    {
        "prime_node",
        "prime_node.cli.main",
        "prime_node.ml.inference_worker",
        "prime_node.ml.dist_entry",
        "prime_node.roles.trainer_ranks",
    }
)
"""What a warm child may run, as ``python -m MODULE``: the CLI, the inference child that
``run-trainer --local`` starts, and the trainer ranks torchrun starts through ``rank_stub.py``."""


def import_time_view(env: Mapping[str, str]) -> dict[str, str]:
    return {
        key: value
        for key, value in env.items()
        if key.startswith(IMPORT_TIME_PREFIXES)
        and key not in CHILD_APPLIED
        and key not in RUNTIME_READ
        and not key.startswith(RUNTIME_READ_PREFIXES)
    }


STARTUP_HOOKS = ("sitecustomize.py", "usercustomize.py", "sitecustomize", "usercustomize")
"""What Python's ``site`` runs at interpreter start from the import path (benchmarks/scale.py's probe is
a sitecustomize on its children's PYTHONPATH): the server ran only its own."""


def startup_hook_reason(
    sys_path: Sequence[str], server_sys_path: Sequence[str], exists: Callable[[str], bool]
) -> str | None:
    """Why a request whose import path holds a startup hook the server never ran must start cold."""
    for entry in sys_path:
        if entry in server_sys_path:
            continue
        for hook in STARTUP_HOOKS:
            if exists(os.path.join(entry, hook)):
                return f"{hook} on its import path ({entry})"
    return None


def cold_reason(
    server_env: Mapping[str, str],
    server_executable: str,
    env: Mapping[str, str],
    executable: str,
    server_modules: Container[str] = (),
) -> str | None:
    """Why a request cannot be forked from this server (None: it can). ``server_modules``: the modules
    the server has imported (``sys.modules``)."""
    if executable != server_executable:
        return f"another Python ({executable})"
    ours, theirs = import_time_view(server_env), import_time_view(env)
    for name, module in SET_BY_TORCH_AT_IMPORT.items():
        if module not in server_modules:
            ours.pop(name, None)
            theirs.pop(name, None)
    if ours != theirs:
        differing = sorted(key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key))
        return "import-time variables differ: " + ", ".join(differing[:8])
    return None
