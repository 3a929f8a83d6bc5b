"""Type hints of the native module (src/lib.rs); applications use
:class:`cohort.Client` instead."""

from os import PathLike
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

PROTOCOL_VERSION: str

Layout = List[Tuple[str, Tuple[int, ...]]]
TrainCallback = Callable[
    [int, int, npt.NDArray[np.float32], Layout],
    Tuple[List[npt.NDArray[np.float32]], int, Optional[Dict[str, float]]],
]

class NativeClient:
    def __init__(
        self,
        server_url: str,
        task_id: str,
        enrollment_token: str,
        storage_dir: Union[str, PathLike[str]],
        ca_certificate_pem: Optional[bytes] = None,
        policy_json: Optional[str] = None,
        max_attempts: Optional[int] = None,
    ) -> None: ...
    def participate(self, train: TrainCallback) -> Tuple[str, int, int, int, Optional[str]]: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    @property
    def paused(self) -> bool: ...
    def leave(self) -> bool: ...
    @property
    def participant_id(self) -> Optional[str]: ...
    @property
    def last_completed_round(self) -> int: ...
    @property
    def privacy_spent(self) -> Optional[float]: ...
    def global_model(self) -> Optional[npt.NDArray[np.float32]]: ...
