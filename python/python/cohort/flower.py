"""Runs a Flower-style ``NumPyClient`` as a Cohort participant, without
importing Flower.

An object with ``get_parameters(config)`` and
``fit(parameters, config) -> (parameters, num_examples, metrics)`` (what
Flower's ``NumPyClient`` subclasses define) takes part in a Cohort task
unchanged::

    from cohort.flower import run_numpy_client
    run_numpy_client(FlowerClient(), server=URL, task=TASK, enrollment_token=TOKEN)

``parameters`` are NumPy arrays in the order of the task's model layout
(the order of PyTorch's ``state_dict``, as Flower's examples use). The
``config`` that ``fit`` receives holds ``server_round`` (the round number)
and what was given as ``config`` here. Of the returned metrics, those
Cohort aggregates (``loss``, ``accuracy`` and the names in
:data:`cohort.METRICS`) are sent, masked like the update; the others are
dropped with one warning each (an individual metric in the clear would
bypass secure aggregation). ``evaluate`` is not called: evaluation is the
coordinator's, on the aggregate.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Mapping, Optional

import numpy as np

from ._client import _ALIASES, METRICS, Client, Model, Round, TrainFn, Update, _metric_problem
from ._errors import InvalidUpdateError

__all__ = ["from_numpy_client", "run_numpy_client"]

logger = logging.getLogger("cohort.flower")


def from_numpy_client(numpy_client: Any, config: Optional[Mapping[str, Any]] = None) -> TrainFn:
    """A training function for :meth:`cohort.Client.train` that calls
    ``numpy_client.fit``. Before the first round, the arrays of
    ``numpy_client.get_parameters`` are checked against the task's layout,
    so a model of another architecture fails with a clear error."""
    for method in ("get_parameters", "fit"):
        if not callable(getattr(numpy_client, method, None)):
            raise TypeError(f"{type(numpy_client).__name__} has no {method} method")
    extra = dict(config or {})
    checked = False
    dropped: set = set()

    def train(model: Model, round: Round) -> Update:
        nonlocal checked
        if not checked:
            _check_layout(numpy_client.get_parameters(config={}), model)
            checked = True
        parameters = list(model.numpy().values())
        result = numpy_client.fit(parameters, {**extra, "server_round": round.number})
        if not (isinstance(result, tuple) and len(result) == 3):
            raise InvalidUpdateError("fit must return (parameters, num_examples, metrics)")
        new_parameters, examples, metrics = result
        kept: Dict[str, float] = {}
        for name, value in dict(metrics or {}).items():
            key = _ALIASES.get(name, name)
            if key not in METRICS:
                problem = "not one Cohort aggregates securely"
            elif key in {_ALIASES.get(k, k) for k in kept}:
                problem = "given twice"
            else:
                problem = _metric_problem(key, value)
            if problem is None:
                kept[name] = float(value)
            elif name not in dropped:
                dropped.add(name)
                logger.warning("metric %r is not sent: %s", name, problem)
        return Update(list(new_parameters), examples=int(examples), metrics=kept)

    return train


def _check_layout(parameters: Any, model: Model) -> None:
    arrays = [np.asarray(p) for p in parameters]
    expected = [shape for _, shape in model.layout]
    actual = [tuple(a.shape) for a in arrays]
    if actual != expected:
        raise InvalidUpdateError(
            f"the client's parameters have shapes {actual}, the task's model {expected} "
            f"(tensors {', '.join(model.names)})"
        )


def run_numpy_client(
    numpy_client: Any,
    server: str,
    task: str,
    enrollment_token: str,
    state_dir: str = ".cohort",
    *,
    config: Optional[Mapping[str, Any]] = None,
    rounds: Optional[int] = None,
    **options: Any,
):
    """Takes part in the task with ``numpy_client`` until the task is over
    (or ``rounds`` rounds ended for it); ``options`` are
    :class:`cohort.Client`'s (``ca_cert``, ``policy``, ``progress``).
    Returns how each round ended."""
    client = Client(server, task, enrollment_token, state_dir, **options)
    client.train(from_numpy_client(numpy_client, config))
    return client.run(rounds)
