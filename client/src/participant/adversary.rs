//! A participant that cheats, for the tests and measurements of input
//! validation (feature `adversary`, never in a default build).
//!
//! It plays every stage as an honest participant does, proves its honest
//! (clipped) update at ShareKeys, and then changes its masked vector before
//! it is sent: the sum then holds another input than the one it committed
//! to. Without validation that input goes into the model unchecked; with
//! validation the group's sum check fails and the coordinator's group
//! testing isolates and excludes the participant.

use cohort_crypto::ClientMessage;
use rand_core::Rng;

/// What a cheating participant adds to its masked input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attack {
    /// Adds half the ring to every coordinate: the largest shift of the
    /// sum one input can make, as an update scaled far past the clip
    /// would (no honest quantizer can produce it).
    Scaled,
    /// Adds a uniformly random element of the ring to every coordinate: a
    /// random update of any size.
    Random,
}

impl std::str::FromStr for Attack {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "scaled" => Ok(Attack::Scaled),
            "random" => Ok(Attack::Random),
            other => Err(format!("unknown attack {other:?} (scaled, random)")),
        }
    }
}

impl Attack {
    /// Changes `message` if it is a masked input.
    pub(super) fn apply(self, message: &mut ClientMessage, rng: &mut impl Rng) {
        let ClientMessage::MaskedInput { vector, .. } = message else { return };
        let mask = if vector.bits >= 32 { u32::MAX } else { (1u32 << vector.bits) - 1 };
        for value in &mut vector.values {
            let shift = match self {
                Attack::Scaled => (mask >> 1) + 1,
                Attack::Random => rng.next_u32(),
            };
            *value = value.wrapping_add(shift) & mask;
        }
    }
}
