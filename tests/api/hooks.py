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
