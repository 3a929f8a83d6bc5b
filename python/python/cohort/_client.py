"""The participant for Python applications: :class:`Client` and the values
its training function sees and returns."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from ._errors import InvalidArgumentError, InvalidUpdateError

__all__ = ["Client", "Model", "Round", "Update", "RoundResult", "METRICS"]

logger = logging.getLogger("cohort")

#: Largest loss a metric carries (the core's fixed-point range); an
#: accuracy is a fraction in [0, 1].
MAX_LOSS = 4096.0

#: The metrics a round can aggregate (securely, as the update is): a
#: training function may report any of them by name. ``loss`` and
#: ``accuracy`` stand for ``train_loss`` and ``train_accuracy``.
METRICS = ("train_loss", "train_accuracy", "global_loss", "global_accuracy", "eval_loss", "eval_accuracy")
_ALIASES = {"loss": "train_loss", "accuracy": "train_accuracy"}

Layout = List[Tuple[str, Tuple[int, ...]]]


@dataclass(frozen=True)
class Round:
    """What a training function is told about the round it trains for.

    ``number`` is the round (for an asynchronous task, the model's version)
    as the coordinator numbers it: show it, never seed anything with it.
    ``nonce`` counts the updates this client sent before: a value of its
    own that never repeats, to seed local training's randomness with (a
    coordinator could replay a round number, never this).
    """

    number: int
    nonce: int


class Model:
    """The global model of a round: named tensors, laid out as the task's
    model layout says (names as in PyTorch's ``state_dict``).

    The weights arrive as one NumPy array; :meth:`numpy` and :meth:`torch`
    return views of it, without copies. Changing them changes nothing the
    client sends: the update is computed against the client's own copy.
    """

    def __init__(self, weights: np.ndarray, layout: Layout, round: Optional[Round] = None):
        if weights.dtype != np.float32 or weights.ndim != 1:
            raise InvalidArgumentError("the weights must be a one-dimensional float32 array")
        total = sum(int(np.prod(shape, dtype=np.int64)) for _, shape in layout)
        if total != weights.size:
            raise InvalidArgumentError(f"the layout has {total} values, the weights {weights.size}")
        self._weights = weights
        self._layout = [(name, tuple(int(d) for d in shape)) for name, shape in layout]
        self.round = round

    @property
    def layout(self) -> Layout:
        """``[(name, shape), ...]`` in the order of the flat weights."""
        return list(self._layout)

    @property
    def names(self) -> List[str]:
        """The tensors' names, in order."""
        return [name for name, _ in self._layout]

    @property
    def flat(self) -> np.ndarray:
        """All weights as one ``float32`` vector."""
        return self._weights

    def __len__(self) -> int:
        return int(self._weights.size)

    def __repr__(self) -> str:
        return f"Model({len(self._layout)} tensors, {self._weights.size} parameters)"

    def _views(self) -> Iterator[Tuple[str, np.ndarray]]:
        offset = 0
        for name, shape in self._layout:
            size = int(np.prod(shape, dtype=np.int64))
            yield name, self._weights[offset : offset + size].reshape(shape)
            offset += size

    def numpy(self) -> "OrderedDict[str, np.ndarray]":
        """The tensors as NumPy arrays (views of :attr:`flat`), by name."""
        return OrderedDict(self._views())

    def torch(self, device: Any = None) -> "OrderedDict[str, Any]":
        """The tensors as PyTorch tensors, by name: what
        ``module.load_state_dict`` takes. On the CPU they share memory with
        :attr:`flat`; on another ``device`` they are copies there."""
        import torch

        tensors = OrderedDict((name, torch.from_numpy(view)) for name, view in self._views())
        if device is not None:
            tensors = OrderedDict((name, t.to(device)) for name, t in tensors.items())
        return tensors


Tensors = Union[Mapping[str, Any], Sequence[Any]]


class Update:
    """What a training function returns: the local weights after training
    (a ``state_dict``, a dict of arrays, or a list in the layout's order),
    the number of local examples (the weight in the average), and
    optionally the round's metrics by name (see :data:`METRICS`).

    The client sends ``weights - global`` (clipped, quantized, masked); a
    state dict's entries that are not in the model's layout (a BatchNorm's
    ``num_batches_tracked``) are not sent.
    """

    def __init__(self, weights: Tensors, examples: int, metrics: Optional[Mapping[str, float]] = None):
        if isinstance(examples, bool) or not isinstance(examples, (int, np.integer)):
            raise InvalidUpdateError(f"examples must be an integer, not {type(examples).__name__}")
        if not 1 <= int(examples) <= 0xFFFF_FFFF:
            raise InvalidUpdateError(f"examples must be from 1 to 4294967295, not {examples}")
        self.weights = weights
        self.examples = int(examples)
        self.metrics = _metrics(metrics or {})

    def __repr__(self) -> str:
        return f"Update(examples={self.examples}, metrics={sorted(self.metrics)})"

    def tensors(self, layout: Layout) -> List[np.ndarray]:
        """The local weights as C-contiguous ``float32`` arrays in the
        layout's order (no copy where they already are)."""
        weights = self.weights
        if isinstance(weights, Mapping):
            missing = [name for name, _ in layout if name not in weights]
            if missing:
                extra = sorted(set(weights) - {name for name, _ in layout})
                raise InvalidUpdateError(
                    f"the update has no tensor {', '.join(missing)}"
                    + (f" (it has {', '.join(extra)})" if extra else "")
                )
            ordered = [weights[name] for name, _ in layout]
        else:
            ordered = list(weights)
            if len(ordered) != len(layout):
                raise InvalidUpdateError(f"{len(ordered)} tensors for a model of {len(layout)}")
        arrays = []
        for value, (name, shape) in zip(ordered, layout):
            array = _as_float32(value, name)
            if array.shape != tuple(shape):
                raise InvalidUpdateError(f"tensor {name} has shape {array.shape}, the model's is {tuple(shape)}")
            arrays.append(array)
        return arrays


def _as_float32(value: Any, name: str) -> np.ndarray:
    """A C-contiguous float32 array of a tensor or array-like; copies only
    what is on another device, of another dtype, or not contiguous."""
    module = type(value).__module__
    if module.startswith("torch"):
        import torch

        tensor = value.detach()
        if tensor.is_complex():
            raise InvalidUpdateError(f"tensor {name} is of {tensor.dtype}, not real numbers")
        if tensor.dtype != torch.float32:
            tensor = tensor.to(torch.float32)
        value = tensor.cpu().resolve_conj().resolve_neg().numpy()
    array = np.asarray(value)
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise InvalidUpdateError(f"tensor {name} is of {array.dtype}, not real numbers")
    # Keeps a 0-d tensor 0-d (np.ascontiguousarray would make it 1-d).
    return np.asarray(array, dtype=np.float32, order="C")


def _metrics(metrics: Mapping[str, float]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for name, value in metrics.items():
        key = _ALIASES.get(name, name)
        if key not in METRICS:
            raise InvalidUpdateError(f"unknown metric {name!r}: the metrics are {', '.join(METRICS)}")
        if key in out:
            raise InvalidUpdateError(f"metric {key} is given twice ({name!r} stands for it)")
        out[key] = float(value)
    return out


def _metric_problem(key: str, value: Any) -> Optional[str]:
    """Why a metric's value cannot be sent (the core's ranges), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        return "not a number"
    value = float(value)
    top = 1.0 if key.endswith("accuracy") else MAX_LOSS
    if not 0.0 <= value <= top:
        return f"{value} is outside [0, {top:g}]"
    return None


@dataclass(frozen=True)
class RoundResult:
    """How one round ended for this client.

    ``outcome`` is ``completed`` (the update is in the aggregate),
    ``dropped`` (the coordinator went on without it), ``abandoned`` (this
    client gave up; see ``reason``), ``refused`` (this client refused the
    round before revealing anything: a replay, or not the round it was
    selected for; ``reason`` names the policy rule) or ``task_finished``.
    """

    outcome: str
    round: int
    bytes_up: int
    bytes_down: int
    reason: Optional[str] = None
    seconds: float = field(default=0.0, compare=False)

    @property
    def completed(self) -> bool:
        return self.outcome == "completed"


TrainFn = Callable[[Model, Round], Update]


class Client:
    """A participant of one Cohort task.

    ``server`` is the coordinator's URL, ``task`` the task id and
    ``enrollment_token`` the task's enrollment token; ``state_dir`` keeps
    the enrollment (and a pause) across restarts, readable by its owner
    only. ``ca_cert`` is a PEM file (or its bytes) to trust instead of the
    web PKI. ``policy`` is the client policy: a dict of the fields of
    ``cohort_crypto::policy::Policy`` (those left out keep the defaults,
    which are for a coordinator the client does not trust). ``max_attempts``
    is how many times a request is sent before :class:`UnreachableError`
    (default 8, with 22.6 s of waits between the tries: each twice the
    last, from 0.2 s up to 10 s; each try itself may take up to 10 s to
    connect and 30 s for an answer). ``progress`` prints a line per round on standard
    error (default: when it is a terminal).

    Give it a training function with :meth:`train` (a decorator) and call
    :meth:`run`. Ctrl-C (``KeyboardInterrupt``) leaves the round under way,
    tells the coordinator that this client leaves, and is raised again.
    """

    def __init__(
        self,
        server: str,
        task: str,
        enrollment_token: str,
        state_dir: Union[str, "os.PathLike[str]"] = ".cohort",
        *,
        ca_cert: Union[None, str, bytes, "os.PathLike[str]"] = None,
        policy: Optional[Mapping[str, Any]] = None,
        max_attempts: Optional[int] = None,
        progress: Optional[bool] = None,
    ):
        import json

        if max_attempts is not None and (
            isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or not 1 <= max_attempts < 2**32
        ):
            raise InvalidArgumentError(f"max_attempts must be a whole number of at least 1, not {max_attempts!r}")
        pem = ca_cert
        if pem is not None and not isinstance(pem, bytes):
            with open(pem, "rb") as f:
                pem = f.read()
        self._native = _native.NativeClient(
            server,
            task,
            enrollment_token,
            os.fspath(state_dir),
            pem,
            None if policy is None else json.dumps(dict(policy)),
            max_attempts,
        )
        self.server = server
        self.task = task
        self._train: Optional[TrainFn] = None
        self._progress = sys.stderr.isatty() if progress is None else progress

    def __repr__(self) -> str:
        return f"Client(server={self.server!r}, task={self.task!r}, participant={self.participant_id!r})"

    def train(self, fn: TrainFn) -> TrainFn:
        """Sets the training function, ``fn(model, round) -> Update``;
        usable as a decorator."""
        if not callable(fn):
            raise InvalidArgumentError("the training function must be callable")
        self._train = fn
        return fn

    def run_round(self) -> RoundResult:
        """Takes part in the next round this client is selected for, and
        returns how it ended (``task_finished`` when the task is over)."""
        if self._train is None:
            raise InvalidArgumentError("no training function: decorate one with @client.train")
        train = self._train

        def native_train(number: int, nonce: int, weights: np.ndarray, layout: Layout):
            model = Model(weights, layout, Round(int(number), int(nonce)))
            update = train(model, model.round)
            if not isinstance(update, Update):
                raise InvalidUpdateError(f"the training function returned {type(update).__name__}, not cohort.Update")
            return update.tensors(model.layout), update.examples, update.metrics

        started = time.monotonic()
        outcome, number, up, down, reason = self._native.participate(native_train)
        result = RoundResult(outcome, number, up, down, reason, time.monotonic() - started)
        self._report(result)
        return result

    def run(self, rounds: Optional[int] = None) -> List[RoundResult]:
        """Takes part in rounds until the task is over (or ``rounds`` of
        them ended for this client); returns how each ended."""
        results: List[RoundResult] = []
        while rounds is None or len(results) < rounds:
            try:
                result = self.run_round()
            except KeyboardInterrupt:
                logger.info("interrupted: left the task %s", self.task)
                raise
            if result.outcome == "task_finished":
                break
            results.append(result)
        return results

    def _report(self, result: RoundResult) -> None:
        if result.outcome == "task_finished":
            logger.info("task %s is over", self.task)
            line = "task finished"
        else:
            level = logging.INFO if result.outcome == "completed" else logging.WARNING
            logger.log(
                level,
                "round %d %s (%.1f s, %d bytes up, %d down)%s",
                result.round,
                result.outcome,
                result.seconds,
                result.bytes_up,
                result.bytes_down,
                f": {result.reason}" if result.reason else "",
            )
            line = (
                f"round {result.round}: {result.outcome} in {result.seconds:.1f} s, "
                f"{_size(result.bytes_up)} up, {_size(result.bytes_down)} down"
            )
        if self._progress:
            print(f"\r\x1b[2Kcohort · {self.task} · {line}", end="" if result.outcome != "task_finished" else "\n",
                  file=sys.stderr, flush=True)

    def pause(self) -> None:
        """Pauses: a running round is left once the request in flight
        returns (at most 5 s; a training function that is running
        finishes first) and raises
        :class:`PausedError`; the client takes part in none until
        :meth:`resume`, also after a restart."""
        self._native.pause()

    def resume(self) -> None:
        """Lifts a pause."""
        self._native.resume()

    @property
    def paused(self) -> bool:
        return bool(self._native.paused)

    def leave(self) -> bool:
        """Leaves a running round (which raises :class:`PausedError` in the
        thread that runs it) and tells the coordinator that this client
        leaves (it is not selected until it takes part again); whether the
        coordinator acknowledged it."""
        return bool(self._native.leave())

    @property
    def participant_id(self) -> Optional[str]:
        """The id the coordinator gave this client, once enrolled."""
        return self._native.participant_id

    @property
    def last_completed_round(self) -> int:
        """The last round this client completed (0 before any)."""
        return int(self._native.last_completed_round)

    @property
    def privacy_spent(self) -> Optional[float]:
        """In a task with differential privacy, the ε this client's
        contributions have spent by its own accounting against the policy's
        privacy budget (``policy={"budget": {"epsilon": E, "delta": D}}``;
        the default policy's is ε 30 at δ = 10⁻⁶): at the budget's δ and
        with no amplification by sampling, so it is never below what the
        coordinator reports at the same δ. Kept in ``state_dir``. ``None``
        before the first contribution to such a task, and when the policy
        has no budget."""
        return self._native.privacy_spent

    def global_model(self) -> Optional[np.ndarray]:
        """The flat global model of the last round this client trained in."""
        return self._native.global_model()


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
