//! What survives a restart (the enrollment, never round secrets), and the
//! secret seeds the participant draws.

use chacha20::ChaCha20Rng;
use cohort_crypto::Secret32;
use cohort_crypto::signature::IdentityKey;
use rand_core::Rng;
use serde::{Deserialize, Serialize};
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

use std::sync::Arc;

use super::TaskSecurity;

/// What survives a restart: the enrollment, never round secrets.
#[derive(Clone, Serialize, Deserialize, Zeroize, ZeroizeOnDrop)]
pub struct SavedState {
    /// Task id.
    pub task_id: String,
    /// Participant id the coordinator assigned.
    pub participant_id: String,
    /// Bearer credential of the client API.
    pub(super) credential: String,
    /// Credential expiry (Unix ms).
    pub expires_at: i64,
    /// The last round this participant completed.
    pub last_completed_round: u64,
    /// That round's session, so that a restarted client does not join it
    /// again (it may join a re-run of the same round number).
    #[serde(default)]
    pub last_session: Option<String>,
    /// The RFC 8032 seed of this participant's Ed25519 identity key (hex),
    /// whose public half it registered at enrollment: it signs the round
    /// keys and the survivor list in the active variant. Zeroized on drop,
    /// never printed. Absent only in states saved before identities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) identity_seed: Option<String>,
    /// The task's security parameters as announced at enrollment: every
    /// round must repeat them. Absent only in states saved before pinning;
    /// those pin the first round they see.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[zeroize(skip)]
    pub security: Option<TaskSecurity>,
    /// The last round this participant sent a masked input for; it never
    /// takes part in that round or an earlier one again.
    #[serde(default)]
    pub last_contributed_round: u64,
    /// How many masked inputs this participant sent (across enrollments):
    /// the built-in trainers seed local training's randomness from it,
    /// so no two contributions draw the same shuffles, whatever the
    /// coordinator numbers its rounds.
    #[serde(default)]
    pub contributions: u64,
    /// The digests ([`model_digest`](cohort_crypto::policy::model_digest),
    /// hex) of the last `MODEL_LEDGER` models this participant sent an
    /// update of: it never trains on one of them again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub contributed_models: Vec<String>,
    /// A task with differential privacy: the ε this participant's
    /// contributions spent, by its own accounting at its policy's budget δ
    /// ([`Policy::check_budget`](cohort_crypto::policy::Policy::check_budget)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privacy_spent: Option<f64>,
}

/// How many models a participant remembers having sent an update of
/// (16 bytes each).
pub const MODEL_LEDGER: usize = 1024;

impl SavedState {
    /// Whether this participant already sent an update of the model with
    /// `digest`.
    pub fn contributed_to(&self, digest: &[u8; 16]) -> bool {
        let digest = hex::encode(digest);
        self.contributed_models.contains(&digest)
    }

    /// Records a masked input of an update of the model with `digest`
    /// (if known) for round or group `round`, which brings the ε spent to
    /// `epsilon` (a task with differential privacy).
    pub(super) fn record_contribution(&mut self, round: u64, digest: Option<[u8; 16]>, epsilon: Option<f64>) {
        self.last_contributed_round = self.last_contributed_round.max(round);
        self.contributions += 1;
        if epsilon.is_some() {
            self.privacy_spent = epsilon;
        }
        if let Some(digest) = digest {
            if self.contributed_models.len() >= MODEL_LEDGER {
                self.contributed_models.remove(0);
            }
            self.contributed_models.push(hex::encode(digest));
        }
    }

    /// The identity key, if this enrollment has one.
    pub(super) fn identity(&self) -> Option<Arc<IdentityKey>> {
        let mut seed = Zeroizing::new([0u8; 32]);
        hex::decode_to_slice(self.identity_seed.as_deref()?, &mut *seed).ok()?;
        Some(Arc::new(identity_from_seed(*seed)))
    }
}

impl std::fmt::Debug for SavedState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedState")
            .field("task_id", &self.task_id)
            .field("participant_id", &self.participant_id)
            .field("expires_at", &self.expires_at)
            .field("last_completed_round", &self.last_completed_round)
            .field("contributions", &self.contributions)
            .field("privacy_spent", &self.privacy_spent)
            .finish_non_exhaustive()
    }
}

/// 32 fresh secret bytes: from the operating system, or from `seeder`
/// where one was set.
pub(super) fn fresh_seed(seeder: &mut Option<ChaCha20Rng>) -> Zeroizing<[u8; 32]> {
    let mut seed = Zeroizing::new([0u8; 32]);
    match seeder {
        Some(seeder) => seeder.fill_bytes(&mut *seed),
        None => fill_from_os(&mut seed),
    }
    seed
}

/// The Ed25519 identity key of an RFC 8032 seed (the copy is wiped).
pub(super) fn identity_from_seed(mut seed: [u8; 32]) -> IdentityKey {
    match IdentityKey::from_seed(&Secret32::from_bytes(&mut seed)) {
        Ok(key) => key,
        Err(_) => unreachable!("every 32-byte string is a valid Ed25519 seed"),
    }
}

fn fill_from_os(seed: &mut [u8; 32]) {
    // Without the operating system's randomness no mask can be secret.
    getrandom::fill(seed).unwrap_or_else(|e| panic!("no operating-system randomness: {e}"));
}

/// The 16-byte session of a selection (hex), if it names one.
pub(super) fn session_id(instance: &str) -> Option<[u8; 16]> {
    let mut session = [0u8; 16];
    hex::decode_to_slice(instance, &mut session).ok().map(|()| session)
}
