//! Client identifiers within one round.

/// A client's position in the round's roster, counted from 1.
///
/// It doubles as the client's Shamir evaluation point, which is why it is
/// never 0 (the secret lives at x = 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClientId(u32);

impl ClientId {
    /// Wraps a roster position; returns `None` for 0.
    pub const fn new(id: u32) -> Option<Self> {
        if id == 0 { None } else { Some(Self(id)) }
    }

    /// The numeric value (1-based).
    pub const fn get(self) -> u32 {
        self.0
    }

    /// The zero-based index into roster-sized arrays.
    pub const fn index(self) -> usize {
        self.0 as usize - 1
    }

    /// The id of the client at zero-based roster index `index`.
    pub fn from_index(index: usize) -> Self {
        // Roster sizes are bounded by `MAX_CLIENTS`, far below u32::MAX.
        Self(index as u32 + 1)
    }

    /// Placeholder used in errors that concern the server's messages.
    pub(crate) const SERVER: ClientId = ClientId(0);
}

impl core::fmt::Display for ClientId {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}", self.0)
    }
}
