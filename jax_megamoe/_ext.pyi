# Type stub of the compiled extension (cuda/ffi/registrations.cc): what the Python side calls on it.
from typing import Any

with_cuda: bool

def registrations() -> dict[str, Any]: ...
def __getattr__(name: str) -> Any: ...  # the workspace queries and the nvlink workspace functions (CUDA builds)
