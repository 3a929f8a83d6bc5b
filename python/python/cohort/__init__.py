"""Cohort: federated learning with secure aggregation, for Python and
PyTorch.

A client trains the task's model on its own data and sends only a masked,
quantized update; the coordinator learns the sum of at least ``t``
clients' updates and nothing about any one. Everything from clipping to
the last request is the Rust core's (``cohort._native``)::

    import cohort

    client = cohort.Client(server=URL, task=TASK, enrollment_token=TOKEN, state_dir=".cohort")

    @client.train
    def train(model: cohort.Model, round: cohort.Round) -> cohort.Update:
        net.load_state_dict(model.torch())
        loss = fit_one_epoch(net, data)          # the application's own loop
        return cohort.Update(net.state_dict(), examples=len(data), metrics={"loss": loss})

    client.run()

Flower ``NumPyClient`` objects run unchanged through :mod:`cohort.flower`.
"""

from . import _errors
from ._errors import *  # noqa: F401,F403 (one class per kind of error, listed in _errors.__all__)
from ._client import METRICS, Client, Model, Round, RoundResult, Update
from . import flower

from ._native import PROTOCOL_VERSION as __version__

__all__ = [
    "Client",
    "Model",
    "Round",
    "Update",
    "RoundResult",
    "METRICS",
    "flower",
    *_errors.__all__,
]
