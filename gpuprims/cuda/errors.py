"""The one error type for CUDA statuses, and the checks every CUDA call goes through (CONTRIBUTING.md, house style 2).

Native code raises :class:`CudaError` from its single ``check()`` (``native/src/cuda_bind.cpp``);
Python code that holds a raw status calls :func:`check_status`. A ``CudaError`` carries the status
number, its name (``cudaErrorMemoryAllocation``), the runtime's message and the call that failed, and
it pickles, so it crosses process boundaries intact.
"""

from __future__ import annotations

#: cudaErrorMemoryAllocation: the one status callers may retry on (after freeing something).
CUDA_ERROR_MEMORY_ALLOCATION = 2
#: cudaErrorInsufficientDriver / cudaErrorNoDevice: what a machine without a GPU reports.
CUDA_ERROR_INSUFFICIENT_DRIVER = 35
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_NOT_READY = 600
#: Statuses that corrupt the CUDA context ("sticky"): every later call in the process returns them and
#: the process must exit to use the device again (illegal address, hardware stack error, illegal
#: instruction, misaligned address, invalid address space, invalid pc, launch failure, launch timeout
#: is not among them). See the CUDA runtime API's error types.
STICKY_STATUSES = frozenset({700, 714, 715, 716, 717, 718, 719})


class CudaError(RuntimeError):
    """A CUDA runtime call returned an error status.

    Attributes: ``status`` (int, the cudaError_t value), ``name`` (e.g. ``cudaErrorNoDevice``),
    ``message`` (cudaGetErrorString) and ``call`` (the API call or operation that failed).
    """

    def __init__(self, status: int, name: str, message: str, call: str = "") -> None:
        self.status = int(status)
        self.name = name
        self.message = message
        self.call = call
        where = f"{call}: " if call else ""
        super().__init__(f"{where}{name} ({self.status}): {message}")

    def __reduce__(self) -> tuple[type, tuple[int, str, str, str]]:
        return (type(self), (self.status, self.name, self.message, self.call))

    @property
    def is_sticky(self) -> bool:
        """True if the context is lost (the status is one of STICKY_STATUSES): nothing more will run."""
        return self.status in STICKY_STATUSES

    @property
    def is_out_of_memory(self) -> bool:
        """True for cudaErrorMemoryAllocation, the status worth a narrow retry (CONTRIBUTING.md, house style 3)."""
        return self.status == CUDA_ERROR_MEMORY_ALLOCATION


class CudaUnavailableError(RuntimeError):
    """CUDA cannot be used from this process: kernels not built, or a forked child (use spawn)."""


def check_status(status: int, call: str = "") -> None:
    """Raise :class:`CudaError` for a non-zero cudaError_t ``status`` (names and messages from the
    runtime's cudaGetErrorName/cudaGetErrorString); return for cudaSuccess."""
    if status == 0:
        return
    # The names come from the extension, which never touches the GPU to give them.
    from gpuprims import _native

    raise CudaError(status, _native.cuda_error_name(status), _native.cuda_error_string(status), call)


#: The statuses of stream capture and graphs that a CUDA library may report only as text (torch raises
#: ``RuntimeError("CUDA error: <cudaGetErrorString>")``): cudaGetErrorString's text -> (status, name).
#: Used by :func:`raise_from_message` so those errors, too, reach callers as :class:`CudaError`.
CAPTURE_STATUSES: dict[str, tuple[int, str]] = {
    "operation not permitted when stream is capturing": (900, "cudaErrorStreamCaptureUnsupported"),
    "operation failed due to a previous error during capture": (901, "cudaErrorStreamCaptureInvalidated"),
    "operation would result in a merge of two independent captures": (902, "cudaErrorStreamCaptureMerge"),
    "capture was not initiated in this stream": (903, "cudaErrorStreamCaptureUnmatched"),
    "capturing stream has unjoined work": (904, "cudaErrorStreamCaptureUnjoined"),
    "dependency created on uncaptured work in another stream": (905, "cudaErrorStreamCaptureIsolation"),
    "operation would make the legacy stream depend on a capturing blocking stream":
        (906, "cudaErrorStreamCaptureImplicit"),
    "operation not permitted on an event last recorded in a capturing stream": (907, "cudaErrorCapturedEvent"),
    "attempt to terminate a thread-local capture sequence from another thread":
        (908, "cudaErrorStreamCaptureWrongThread"),
    "out of memory": (CUDA_ERROR_MEMORY_ALLOCATION, "cudaErrorMemoryAllocation"),
    "operation not permitted": (800, "cudaErrorNotPermitted"),
}


def raise_from_message(exc: BaseException, call: str) -> None:
    """Re-raise ``exc`` (an error a CUDA library reported as text, such as torch's ``CUDA error: ...``)
    as :class:`CudaError` when its message carries a known cudaGetErrorString text; otherwise raise
    ``exc`` itself. Always raises. A CudaError passes through unchanged."""
    if isinstance(exc, CudaError):
        raise exc
    text = str(exc)
    for message, (status, name) in sorted(CAPTURE_STATUSES.items(), key=lambda kv: -len(kv[0])):
        if message in text:
            raise CudaError(status, name, message, call) from exc
    raise exc
