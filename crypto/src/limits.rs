//! The largest round the protocol takes, shared by the round configuration,
//! the quantizer and the wire decoders (which size nothing beyond them).

/// Most clients one round may have.
pub const MAX_CLIENTS: u32 = 1 << 20;
/// Longest vector one round may aggregate (coordinates, including the
/// example-count coordinate).
pub const MAX_VECTOR_LEN: u32 = 1 << 27;
