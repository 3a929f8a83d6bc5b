"""Schemathesis hooks for the coordinator's API (see schemathesis.toml).

The stage messages and checkpoints are binary media types of their own
(`application/x-cohort-secagg`, `application/vnd.safetensors`): their
bodies are sent and read as the bytes they are.
"""

import schemathesis

BINARY = ("application/x-cohort-secagg", "application/vnd.safetensors")


@schemathesis.serializer(*BINARY)
def as_bytes(ctx, value):
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return str(value).encode()


@schemathesis.deserializer(*BINARY)
def as_text(ctx, response):
    # One character per byte: the document types these bodies as a string
    # of binary format, which is what is checked.
    return response.content.decode("latin-1")


# The refusals a schema-valid enrollment may get with 400 (see
# schemathesis.toml): an active task's missing identity, or a key and
# proof that are well-formed hex but not a signature of the enrollment.
ENROLLMENT_RULES = ("identity_required", "invalid_identity")


@schemathesis.check
def enrollment_refused_only_for_its_identity(ctx, response, case):
    """A schema-valid enrollment answered 400 names an identity rule."""
    if case.operation.definition.raw.get("operationId") != "enroll":
        return None
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code != 400:
        return None
    error = response.json().get("error")
    if error not in ENROLLMENT_RULES:
        raise AssertionError(f"a schema-valid enrollment was refused with 400 {error!r}")
    return None


# A check-in or a stage message's GET or POST with `wait_ms` is held while its
# answer is "wait" (up to 20 s): the fuzzer's participant, alone in its
# task, would wait out each one. The parameter is still generated and
# sent (and malformed values refused); a number is held at most 100 ms.
HELD_AT_MOST_MS = 100


def _held_ms(value):
    """The wait a generated `wait_ms` asks for, if it is a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    query = case.query
    if not query:
        return
    held = _held_ms(query.get("wait_ms"))
    if held is not None and held > HELD_AT_MOST_MS:
        query["wait_ms"] = HELD_AT_MOST_MS
