"""Torch model files with named tensors: ``torchscript`` (a TorchScript archive, ``model.pt``, through
``torch.jit.load``), ``torch_export`` (a ``torch.export`` program, ``model.pt2``, through
``torch.export.load(...).module()``) and ``compile`` (``torch.compile`` over the program of a ``.pt2``).

Inputs: a TorchScript or exported ``forward`` takes positional tensors, so the signature's inputs are bound
to its parameters by name where the file names them all (the ``forward``'s argument names: a
``torch.export`` program's, or a TorchScript schema's), else by Triton's convention for TorchScript
(``INPUT__0``, ``INPUT__1``... by their index), else in the signature's order. Outputs: a tensor (the
signature's one output), a tuple or list (the signature's outputs in order; ``OUTPUT__<i>`` names by
index), or a dict (by name). BF16 tensors travel as uint16 bits and are reinterpreted both ways
(``torch.from_numpy(u16).view(torch.bfloat16)``). The model runs under ``torch.inference_mode``; torch's
CPU pool has ``Target.threads`` threads when given.

There is nothing to cache for ``torchscript`` and ``torch_export``: the file is loaded as it is
(BuildInfo.cache_hit stays False and ``extra['cached']`` says so). ``compile`` keeps inductor's kernels in
``<engine cache root>/inductor`` and records its warm-up in an entry, so a second start compiles from
inductor's cache. torch refuses to compile a TorchScript module, so ``compile`` takes ``.pt2`` files only.

Options of ``compile``: ``mode`` (torch.compile's: ``default``, ``reduce-overhead`` (cuda only),
``max-autotune``, ``max-autotune-no-cudagraphs``), ``backend`` (``inductor``, or ``aot_eager``: traces and
runs the graph with eager kernels, no compile time, for checking a model) and ``dynamic`` (torch.compile's
``dynamic``: True (default) compiles shape-generic kernels, so a new batch size or a dynamic dimension does
not recompile on the serving path; False specialises on every shape seen). Prepare warms it at batch 1,
2 and max_batch_size (dynamic dimensions at size 1).
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import json
import re
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuprims.cuda.event import stream_handle
from gpuprims.engines.base import BuildInfo, EngineError
from gpuprims.engines.cache import EngineCache
from gpuprims.engines.compile import inductor_cache_dir
from gpuprims.engines.files import FileEngine, first_line
from gpuprims.engines.kinds import FILE_ENGINE_KINDS
from gpuprims.tensors import DataType, ModelSignature, TensorSpec

#: torch dtypes -> datatypes (BF16 travels as uint16 bits).
TORCH_TYPES: dict[torch.dtype, DataType] = {
    torch.bool: DataType.BOOL, torch.uint8: DataType.UINT8, torch.int8: DataType.INT8,
    torch.int16: DataType.INT16, torch.int32: DataType.INT32, torch.int64: DataType.INT64,
    torch.float16: DataType.FP16, torch.bfloat16: DataType.BF16, torch.float32: DataType.FP32,
    torch.float64: DataType.FP64, torch.uint16: DataType.UINT16, torch.uint32: DataType.UINT32,
    torch.uint64: DataType.UINT64,
}
INDUCTOR_DIR = "inductor"
#: Triton's TorchScript naming convention: ``<name>__<index>`` binds by position.
_INDEXED = re.compile(r"^.*__(\d+)$")


def to_torch(arr: np.ndarray, spec: TensorSpec) -> torch.Tensor:
    """A numpy request tensor as a torch tensor sharing its memory where it can (BF16's uint16 bits
    reinterpreted as bfloat16). A read-only array (a zero-copy view of a wire body) is copied: torch
    tensors are writable."""
    if not arr.flags.writeable:
        arr = arr.copy()
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if spec.datatype is DataType.BF16 else t


def to_numpy(t: torch.Tensor, name: str) -> np.ndarray:
    """An output tensor as a numpy array the caller owns (bfloat16 as its uint16 bits)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype is torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16).copy()
    try:
        return t.numpy().copy()
    except TypeError as e:
        raise EngineError(f"output {name!r} has torch dtype {t.dtype}, which numpy cannot hold: {e}") from e


def _index(name: str) -> int | None:
    m = _INDEXED.match(name)
    return int(m.group(1)) if m else None


def bind_inputs(params: list[str], signature: ModelSignature) -> tuple[list[str | None], str]:
    """The signature's input names in the order the model's ``forward`` takes them (None for a
    parameter no input fills), and how they were bound: ``by name`` (every input is a parameter name),
    ``by index`` (Triton's ``INPUT__<i>``) or ``in order`` (the signature's)."""
    names = [s.name for s in signature.inputs]
    if params and set(names) <= set(params):
        last = max(params.index(n) for n in names)
        return [p if p in names else None for p in params[:last + 1]], "by name"
    indices = [_index(n) for n in names]
    if all(i is not None for i in indices) and len(set(indices)) == len(indices):
        slots: list[str | None] = [None] * (max(i for i in indices if i is not None) + 1)
        for n, i in zip(names, indices):
            slots[i] = n  # type: ignore[index]
        return slots, "by index"
    return list(names), "in order"


def map_outputs(result: Any, signature: ModelSignature, kind: str) -> dict[str, torch.Tensor]:
    """The model's return value by the signature's output names: a tensor (one output), a tuple or list
    (in order, or by ``OUTPUT__<i>`` index), a dict (by name)."""
    names = [s.name for s in signature.outputs]
    if isinstance(result, torch.Tensor):
        if len(names) != 1:
            raise EngineError(f"engine {kind!r}: the model returns one tensor; the signature has {len(names)} "
                              f"outputs {names}")
        return {names[0]: result}
    if isinstance(result, Mapping):
        missing = [n for n in names if n not in result]
        if missing:
            raise EngineError(f"engine {kind!r}: the model returns a dict with keys {sorted(map(str, result))}, "
                              f"without the signature's output(s) {missing}")
        return {n: result[n] for n in names}
    if isinstance(result, (tuple, list)):
        items = list(result)
        indices = [_index(n) for n in names]
        if all(i is not None for i in indices) and len(set(indices)) == len(indices):
            if max(i for i in indices if i is not None) >= len(items):
                raise EngineError(f"engine {kind!r}: the model returns {len(items)} tensors; the signature names "
                                  f"outputs up to {names[int(np.argmax(indices))]!r}")
            return {n: items[i] for n, i in zip(names, indices)}  # type: ignore[index]
        if len(items) != len(names):
            raise EngineError(f"engine {kind!r}: the model returns {len(items)} tensors; the signature has "
                              f"{len(names)} outputs {names}")
        return dict(zip(names, items))
    raise EngineError(f"engine {kind!r}: the model returns a {type(result).__name__}; a tensor, a tuple or list "
                      "of tensors or a dict of them is wanted")


class TorchFileEngine(FileEngine):
    """The part the torch kinds share: threads, device, binding, numpy <-> torch, inference mode."""

    libraries = ("torch",)
    #: The file is run by torch itself: the same kernels as loading it directly.
    tolerance = (1e-6, 1e-7)

    def error_text(self, e: BaseException) -> str:
        # TorchScript's first line is always "The following operation failed in the TorchScript
        # interpreter."; what went wrong is its last line ("builtins.ValueError: ...").
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        if len(lines) > 1 and "TorchScript interpreter" in lines[0]:
            return f"{type(e).__name__}: {lines[-1]}"
        return first_line(e)

    def _device(self) -> torch.device:
        if self.target.backend == "cuda":
            return torch.device("cuda", self.target.device_index)
        return torch.device("cpu")

    @abc.abstractmethod
    def _load(self) -> Any:
        """The callable model from the file (raises EngineError naming the file and the reason)."""

    @abc.abstractmethod
    def _params(self, model: Any) -> list[str]:
        """The names of the model's ``forward`` parameters, in order (empty where unknown)."""

    def _file_io(self, model: Any, order: list[str | None]
                 ) -> tuple[dict[str, tuple[DataType | None, tuple[int | None, ...] | None]],
                            dict[str, tuple[DataType | None, tuple[int | None, ...] | None]]] | None:
        """What the file says of its inputs and outputs under the signature's names, or None where the
        format does not say (TorchScript)."""
        return None

    def _prepare(self, cache: EngineCache) -> None:
        t0 = time.perf_counter()
        if self.target.threads:
            torch.set_num_threads(self.target.threads)
        self.device = self._device()
        model = self._load()
        params = self._params(model)
        self.order, self.binding = bind_inputs(params, self.signature)
        if params and len(self.order) > len(params):
            raise EngineError(f"engine {self.kind!r}: {self.path.name}'s forward takes {len(params)} input(s) "
                              f"{params}; the signature has {len(self.signature.inputs)}: "
                              f"{[s.name for s in self.signature.inputs]}")
        io = self._file_io(model, self.order)
        if io is not None:
            self.check_file_signature(*io)
        self.model = model
        self._stream = None
        if self.target.backend == "cuda" and self.target.stream is not None:
            self._stream = torch.cuda.ExternalStream(stream_handle(self.target.stream), device=self.device)
        self._after_load(cache)
        if not self.info.load_ms and not self.info.build_ms:
            self.info.load_ms = (time.perf_counter() - t0) * 1e3
        self.info.fingerprint = self.fingerprint
        self.info.extra.update({"binding": self.binding, "torch": torch.__version__,
                                "threads": torch.get_num_threads()})
        self.info.extra.setdefault("cached", f"nothing: {self.kind} loads the file as it is")
        if self.info.artefact is None:
            self.info.artefact = str(self.path)

    def _after_load(self, cache: EngineCache) -> None:
        """What a kind does once the model is loaded and checked (compile: compile and warm it)."""

    def _args(self, feed: Mapping[str, np.ndarray]) -> list[torch.Tensor | None]:
        args: list[torch.Tensor | None] = []
        for name in self.order:
            if name is None or name not in feed:
                args.append(None)  # a parameter no input fills, or an optional input left out
                continue
            t = to_torch(feed[name], self.signature.input(name))
            args.append(t.to(self.device, non_blocking=False) if self.device.type != "cpu" else t)
        while args and args[-1] is None:
            args.pop()  # trailing optional parameters keep their defaults
        return args

    def _call(self, args: list[torch.Tensor | None]) -> Any:
        return self.model(*args)

    def _run(self, feed: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        # on cuda the copies in, the model and the copies out all go on the target's stream, in order
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            result = self._call(self._args(feed))
            named = map_outputs(result, self.signature, self.kind)
            return {name: to_numpy(named[name], name) for name in outputs}

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if self.prepared:
            d.update(binding=self.binding, call_order=list(self.order))
        return d

    def close(self) -> None:
        for name in ("model", "_stream"):
            self.__dict__.pop(name, None)
        super().close()


def _torch_io(values: list[Any], names: list[str | None]
              ) -> dict[str, tuple[DataType | None, tuple[int | None, ...] | None]]:
    out: dict[str, tuple[DataType | None, tuple[int | None, ...] | None]] = {}
    for name, val in zip(names, values):
        if name is None or not isinstance(val, torch.Tensor):
            continue
        shape = tuple(int(d) if isinstance(d, int) else None for d in val.shape)
        out[name] = (TORCH_TYPES.get(val.dtype), shape)
    return out


class TorchScriptFileEngine(TorchFileEngine):
    """A TorchScript archive through ``torch.jit.load`` (see the module docstring)."""

    kind = "torchscript"
    spec = FILE_ENGINE_KINDS["torchscript"]
    suffixes = (".pt", ".pth")

    def _load(self) -> Any:
        try:
            with warnings.catch_warnings():
                # torch deprecates TorchScript, but Triton repositories carry model.pt files: serving
                # them is this engine's job, and a warning per load would only fill the instance's log
                warnings.simplefilter("ignore", DeprecationWarning)
                model = torch.jit.load(str(self.path), map_location=self.device)
        except Exception as e:
            raise EngineError(f"engine 'torchscript': {self.path.name} is not a TorchScript archive torch can "
                              f"load: {first_line(e)}") from e
        return model.eval()

    def _params(self, model: Any) -> list[str]:
        try:
            args = model.forward.schema.arguments
        except (AttributeError, RuntimeError):
            return []
        return [a.name for a in args][1:]  # the first is self


class TorchExportFileEngine(TorchFileEngine):
    """A ``torch.export`` program through ``torch.export.load(...).module()`` (see the module docstring)."""

    kind = "torch_export"
    spec = FILE_ENGINE_KINDS["torch_export"]
    suffixes = (".pt2",)

    def _load_program(self) -> Any:
        try:
            return torch.export.load(str(self.path))
        except Exception as e:
            raise EngineError(f"engine {self.kind!r}: {self.path.name} is not a torch.export program torch can "
                              f"load: {first_line(e)}") from e

    def _load(self) -> Any:
        self.program = self._load_program()
        try:
            module = self.program.module()
        except Exception as e:
            raise EngineError(f"engine {self.kind!r}: the program in {self.path.name} does not make a module: "
                              f"{first_line(e)}") from e
        return module.to(self.device)

    def _params(self, model: Any) -> list[str]:
        try:
            return [p for p in inspect.signature(model.forward).parameters
                    if inspect.signature(model.forward).parameters[p].kind
                    in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            return []

    def _file_io(self, model: Any, order: list[str | None]
                 ) -> tuple[dict[str, tuple[DataType | None, tuple[int | None, ...] | None]],
                            dict[str, tuple[DataType | None, tuple[int | None, ...] | None]]] | None:
        graph = self.program.graph
        user_inputs = set(self.program.graph_signature.user_inputs)
        placeholders = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder" and n.name in user_inputs]
        ins = _torch_io(placeholders, order)
        if len(placeholders) < len([n for n in order if n is not None]):
            raise EngineError(f"engine {self.kind!r}: {self.path.name} takes {len(placeholders)} tensor input(s); "
                              f"the signature has {len(self.signature.inputs)}")
        out_node = next(n for n in graph.nodes if n.op == "output")
        vals = [a.meta.get("val") if hasattr(a, "meta") else None for a in out_node.args[0]]
        spec = self.program.call_spec.out_spec
        names = [s.name for s in self.signature.outputs]
        if spec is not None and spec.type is dict:
            keys = list(spec.context)
            outs = _torch_io(vals, [k if k in names else None for k in keys])
        elif len(vals) == len(names):
            indices = [_index(n) for n in names]
            if all(i is not None for i in indices) and sorted(indices) == list(range(len(names))):  # type: ignore[type-var]
                slot_names: list[str | None] = [None] * len(names)
                for n, i in zip(names, indices):
                    slot_names[i] = n  # type: ignore[index]
                outs = _torch_io(vals, slot_names)
            else:
                outs = _torch_io(vals, list(names))
        else:
            raise EngineError(f"engine {self.kind!r}: {self.path.name} gives {len(vals)} output tensor(s); the "
                              f"signature has {len(names)}: {names}")
        # inputs the binding leaves unnamed are the file's business; check only what the signature names
        return ins, outs

    def check_file_signature(self, inputs: Any, outputs: Any) -> None:
        # the extra-inputs rule of the base does not apply: the binding already ties names to positions
        known = {s.name for s in self.signature.inputs}
        super().check_file_signature({k: v for k, v in inputs.items() if k in known}, outputs)



class CompileFileEngine(TorchExportFileEngine):
    """``torch.compile`` over a ``torch.export`` program (see the module docstring)."""

    kind = "compile"
    spec = FILE_ENGINE_KINDS["compile"]
    #: inductor fuses and reorders float sums: outputs differ from the program run directly by rounding.
    tolerance = (1e-4, 1e-5)
    suffixes = (".pt2",)

    def __init__(self, path: str | Path, signature: ModelSignature, target: Any,
                 options: Mapping[str, Any] | None = None, fingerprint: str | None = None) -> None:
        if Path(path).suffix.lower() in (".pt", ".pth"):
            raise EngineError(f"engine 'compile' runs torch.export programs (.pt2); {Path(path).name} is a "
                              "TorchScript archive, which torch.compile refuses to compile (use engine "
                              "'torchscript', or export the model with torch.export)")
        super().__init__(path, signature, target, options, fingerprint)

    def warm_sizes(self) -> list[int]:
        """The batch sizes prepare compiles: 1, 2 and max_batch_size (1 for an unbatched model)."""
        top = self.signature.max_batch_size
        return sorted({1, min(2, top), top}) if self.signature.batched else [1]

    def _zeros(self, batch: int) -> dict[str, np.ndarray]:
        def one(s: TensorSpec) -> np.ndarray:
            dims = tuple(1 if d == -1 else d for d in (s.reshape if s.reshape is not None else s.dims))
            return np.zeros(((batch,) if self.signature.batched else ()) + dims, s.datatype.numpy)
        return {s.name: one(s) for s in self.signature.inputs if not s.optional}

    def _after_load(self, cache: EngineCache) -> None:
        inductor_dir = cache.root / INDUCTOR_DIR
        try:
            inductor_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise EngineError(f"engine 'compile': inductor cache directory {inductor_dir} cannot be created: "
                              f"{e}") from e
        mode = self.options["mode"] if self.options["backend"] == "inductor" else None
        self.compiled = torch.compile(self.model, backend=self.options["backend"], mode=mode,
                                      dynamic=self.options["dynamic"])
        t0 = time.perf_counter()
        compile_ms: dict[int, float] = {}
        with inductor_cache_dir(inductor_dir):
            for b in self.warm_sizes():
                t = time.perf_counter()
                try:
                    with torch.inference_mode():
                        self.compiled(*self._args(self._zeros(b)))
                except Exception as e:
                    raise EngineError(f"engine 'compile': {self.path.name} does not compile for batch {b}: "
                                      f"{first_line(e)}") from e
                compile_ms[b] = round((time.perf_counter() - t) * 1e3, 1)
        total_ms = (time.perf_counter() - t0) * 1e3

        def build(tmp: Path) -> dict[str, Any]:
            meta = {"warm_sizes": self.warm_sizes(), "compile_ms": compile_ms}
            (tmp / "compile.json").write_text(json.dumps(meta))
            return meta

        entry = cache.get_or_build(self.cache_key(), build)
        # a hit: inductor's cache under the same root already held these kernels when we compiled
        self.info = BuildInfo(fingerprint=self.fingerprint, cache_hit=entry.hit, build_ms=0.0 if entry.hit else total_ms,
                              load_ms=total_ms if entry.hit else 0.0, artefact=str(inductor_dir),
                              extra={"compile_ms": compile_ms, "cached": "inductor's kernels", "cache_key": entry.key})

    def _call(self, args: list[torch.Tensor | None]) -> Any:
        return self.compiled(*args)

    def close(self) -> None:
        self.__dict__.pop("compiled", None)
        super().close()
