//! The round in progress: selecting its clients, its state, and the
//! deadlines of its stages.

use std::collections::HashMap;

use cohort_crypto::policy::TaskSecurity;
use cohort_crypto::{ClientId, Quantizer, ServerRound, Stage, Variant};
use rand::seq::SliceRandom;
use rand_chacha::ChaCha20Rng;

use super::builder::{BuiltRound, RoundBuilder};
use super::records::RoundMetrics;
use crate::spec::TaskSpec;

/// Where the round in progress is.
#[allow(clippy::large_enum_variant)] // Collecting is the state nearly always; no box per stage.
pub(super) enum RoundState {
    /// A stage is collecting client messages.
    Collecting(ServerRound),
    /// The final stage closed with a quorum; its server state is with the
    /// [`PendingUnmask`](super::completion::PendingUnmask) off the runtime.
    Unmasking,
}

impl RoundState {
    /// The protocol state of the collecting stage.
    pub(super) fn collecting(&self) -> Option<&ServerRound> {
        match self {
            RoundState::Collecting(server) => Some(server),
            RoundState::Unmasking => None,
        }
    }

    /// The stage the round is in.
    pub(super) fn stage(&self) -> Stage {
        match self {
            RoundState::Collecting(server) => server.stage(),
            RoundState::Unmasking => Stage::Unmasking,
        }
    }
}

/// The round in progress.
pub(super) struct ActiveRound {
    pub(super) number: u64,
    pub(super) session: [u8; 16],
    pub(super) started_at: i64,
    pub(super) stage_started_at: i64,
    pub(super) deadline: i64,
    pub(super) roster: Vec<String>,
    pub(super) ids: HashMap<String, ClientId>,
    pub(super) state: RoundState,
    pub(super) metrics: RoundMetrics,
    /// This round's quantizer (its transform seed is the round's).
    pub(super) quantizer: Quantizer,
    pub(super) bytes_up: u64,
    pub(super) bytes_down: u64,
}

impl ActiveRound {
    /// Opens round `number` (its `attempt`) for the `selected` clients, in
    /// roster order, with fresh session and transform seeds; `None` when
    /// the task's parameters make no valid round.
    pub(super) fn open(
        number: u64,
        attempt: u32,
        selected: Vec<(String, Option<[u8; 32]>)>,
        spec: &TaskSpec,
        security: &TaskSecurity,
        rng: &mut ChaCha20Rng,
        now: i64,
    ) -> Option<Self> {
        let n = selected.len() as u32;
        let identities = match security.variant {
            Variant::Active => selected.iter().filter_map(|(_, identity)| *identity).collect(),
            Variant::SemiHonest => Vec::new(),
        };
        let roster: Vec<String> = selected.into_iter().map(|(id, _)| id).collect();
        let BuiltRound { config, quantizer } =
            RoundBuilder::for_task(spec, security).build(number, n, identities, rng).ok()?;
        let (session, modulus_bits) = (config.session, config.modulus_bits);
        let server = ServerRound::new(config).ok()?;
        let ids =
            roster.iter().enumerate().filter_map(|(i, p)| Some((p.clone(), ClientId::new(i as u32 + 1)?)));
        Some(Self {
            number,
            session,
            started_at: now,
            stage_started_at: now,
            deadline: now + deadline_for(spec, Stage::AdvertiseKeys),
            ids: ids.collect(),
            roster,
            state: RoundState::Collecting(server),
            quantizer,
            metrics: RoundMetrics {
                modulus_bits,
                attempt,
                degree: security.degree,
                threshold: security.threshold,
                ..RoundMetrics::default()
            },
            bytes_up: 0,
            bytes_down: 0,
        })
    }
}

/// `n` of the `candidates`, drawn uniformly at random (an unbiased
/// partial Fisher–Yates shuffle), in random order.
pub(super) fn select(
    mut candidates: Vec<(String, Option<[u8; 32]>)>,
    n: usize,
    rng: &mut ChaCha20Rng,
) -> Vec<(String, Option<[u8; 32]>)> {
    let (chosen, _) = candidates.partial_shuffle(rng, n);
    chosen.to_vec()
}

/// How long `stage` may collect messages.
pub(super) fn deadline_for(spec: &TaskSpec, stage: Stage) -> i64 {
    let d = spec.deadlines;
    let ms = match stage {
        Stage::AdvertiseKeys => d.advertise_keys_ms,
        Stage::ShareKeys => d.share_keys_ms,
        Stage::MaskedInputCollection => d.masked_input_ms,
        _ => d.unmasking_ms,
    };
    // Specs bound deadlines to a day; never let a stored value overflow.
    i64::try_from(ms).unwrap_or(i64::MAX / 4).min(crate::spec::MAX_DEADLINE_MS as i64)
}
