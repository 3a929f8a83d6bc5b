"""The exceptions: one class per kind of error of the Rust core, raised
from the native module with the kind's fields, each also the built-in
exception a Python programmer would catch."""

import json

import pytest

import cohort
from cohort import _native


def test_every_kind_is_a_cohort_error_and_the_builtin_it_resembles():
    expected = {
        cohort.InvalidArgumentError: ValueError,
        cohort.UnreachableError: ConnectionError,
        cohort.UnauthorizedError: PermissionError,
        cohort.TaskNotFoundError: LookupError,
        cohort.InvalidUpdateError: ValueError,
        cohort.StorageError: OSError,
    }
    for name in cohort._errors.__all__:
        cls = getattr(cohort, name)
        assert issubclass(cls, cohort.CohortError), name
        if cls in expected:
            assert issubclass(cls, expected[cls]), name
    assert cohort.PolicyError("x").rule is None
    assert cohort.RejectedError("x").status == 0


def test_bad_arguments_are_refused_by_the_core(tmp_path):
    for args in (
        ("ftp://coordinator", "task", "token"),
        ("http://127.0.0.1:9", " ", "token"),
        ("http://127.0.0.1:9", "task", ""),
    ):
        with pytest.raises(cohort.InvalidArgumentError):
            cohort.Client(*args, state_dir=tmp_path / "state")
    with pytest.raises(cohort.InvalidArgumentError, match="policy"):
        cohort.Client("http://127.0.0.1:9", "task", "token", tmp_path / "state", policy={"min_clients": "ten"})
    with pytest.raises(cohort.InvalidArgumentError, match="CA certificate"):
        cohort.Client("http://127.0.0.1:9", "task", "token", tmp_path / "state", ca_cert=b"not a certificate")


def test_max_attempts_is_a_positive_whole_number(tmp_path):
    for bad in (0, -1, 2**32, 2.5, "3", True):
        with pytest.raises(cohort.InvalidArgumentError, match="max_attempts"):
            cohort.Client("http://127.0.0.1:9", "task", "token", tmp_path / "state", max_attempts=bad)


def test_a_coordinator_that_never_answers_is_unreachable_after_max_attempts(tmp_path):
    # Port 9 on loopback: nothing listens, each attempt is refused at once.
    client = cohort.Client("http://127.0.0.1:9", "task", "token", tmp_path / "state", max_attempts=2, progress=False)
    client.train(lambda model, round: cohort.Update([], 0))
    with pytest.raises(ConnectionError, match="after 2 attempts") as raised:
        client.run_round()
    assert isinstance(raised.value, cohort.UnreachableError)


def test_a_state_directory_of_another_task_is_refused(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "cohort-state.json").write_text(json.dumps({"task_id": "other"}))
    with pytest.raises((cohort.InvalidArgumentError, cohort.StorageError)):
        cohort.Client("http://127.0.0.1:9", "task", "token", state)
    (state / "cohort-state.json").write_text("{ not json")
    with pytest.raises(cohort.StorageError, match="corrupt"):
        cohort.Client("http://127.0.0.1:9", "task", "token", state)


def test_pause_and_leave(tmp_path):
    client = cohort.Client("http://127.0.0.1:9", "task", "token", tmp_path / "state", progress=False)
    client.train(lambda model, round: cohort.Update([], 0))
    client.pause()
    assert client.paused
    with pytest.raises(cohort.PausedError):
        client.run_round()
    # The pause is kept in the state directory.
    assert cohort.Client("http://127.0.0.1:9", "task", "token", tmp_path / "state").paused
    client.resume()
    assert not client.paused
    # Not enrolled: nothing to tell the coordinator, and no pause left behind.
    assert client.leave() is False
    assert not client.paused


def test_a_client_without_a_training_function_says_so(tmp_path):
    client = cohort.Client("http://127.0.0.1:9", "task", "token", tmp_path / "state")
    with pytest.raises(cohort.InvalidArgumentError, match="@client.train"):
        client.run_round()
    with pytest.raises(cohort.InvalidArgumentError):
        client.train("not a function")


def test_the_native_module_is_an_abi3_build():
    assert _native.__file__.endswith(".abi3.so")
    assert cohort.__version__ == _native.PROTOCOL_VERSION
