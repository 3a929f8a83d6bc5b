//! Distributed differential privacy of a task: what the administrator asks
//! for ([`PrivacySpec`]) and what the coordinator derives from it and
//! enforces ([`PrivacyPlan`]): the noise multiplier that meets the budget
//! over the task's rounds, the scale that fits the ring, and ε spent after
//! any number of rounds (the accountant of [`cohort_crypto::dp::accountant`]).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cohort_crypto::dp::accountant::{RoundMechanism, RoundPrivacy, noise_multiplier_for};
use cohort_crypto::dp::{
    DEFAULT_K_STDDEVS, DpParams, Mechanism, VALIDATED_K_STDDEVS, block_for, padded_len, scale_for,
};
use serde::{Deserialize, Serialize};

use crate::spec::SpecError;

/// The differential privacy a task promises (`privacy` in a task spec).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PrivacySpec {
    /// The noise every client adds: `skellam` or `discrete_gaussian`.
    pub mechanism: Mechanism,
    /// The budget ε over the whole task. With `noise_multiplier` left out,
    /// the coordinator solves for the least noise that spends at most this
    /// over `rounds` rounds; with both, it runs rounds while the next one
    /// fits the budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epsilon: Option<f64>,
    /// δ of the (ε, δ) guarantee; well below one over the population.
    pub delta: f64,
    /// Each client's update is clipped to this L2 norm.
    pub clip_norm: f32,
    /// The noise multiplier z (noise standard deviation over sensitivity)
    /// instead of solving for it from `epsilon`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise_multiplier: Option<f64>,
    /// The probability q with which each client of the population takes
    /// part in a round, for amplification by sampling. Left out: 1, no
    /// amplification (see `docs/THREAT_MODEL.md`: the coordinator chooses
    /// who takes part, so sampling amplifies only against others).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_rate: Option<f64>,
    /// Bits of the ring the noisy updates live in (8 to 32; default 16).
    #[serde(default = "default_bits")]
    pub bits: u8,
}

fn default_bits() -> u8 {
    16
}

/// Largest ε a task may ask for: beyond it the guarantee means nothing.
pub const MAX_EPSILON: f64 = 100.0;
/// Largest δ a task may ask for.
pub const MAX_DELTA: f64 = 0.1;
/// Largest clip norm.
pub const MAX_CLIP_NORM: f32 = 1.0e4;

/// What the coordinator derived from a task's [`PrivacySpec`] for rounds
/// of one group size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrivacyPlan {
    /// The parameters every round announces and every client checks.
    pub params: DpParams,
    /// The ring's bits.
    pub modulus_bits: u8,
    /// Coordinates after padding to whole rotation blocks.
    pub padded: usize,
    /// The rotation block.
    pub block: u32,
    /// One round's privacy, for the accountant.
    pub round: RoundPrivacy,
    /// δ.
    pub delta: f64,
    /// The budget, if the task set one.
    pub budget: Option<f64>,
}

impl PrivacyPlan {
    /// ε spent once `releases` noisy sums were released.
    pub fn epsilon_after(&self, releases: u64) -> f64 {
        self.round.epsilon(releases, self.delta).epsilon
    }

    /// Whether one more release stays within the budget.
    pub fn allows(&self, releases: u64) -> bool {
        self.budget.is_none_or(|budget| self.epsilon_after(releases + 1) <= budget * (1.0 + 1e-9))
    }
}

/// A task's privacy as the admin API shows it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PrivacyView {
    /// The noise.
    pub mechanism: Mechanism,
    /// The noise multiplier every round carries.
    pub noise_multiplier: f64,
    /// Updates are clipped to this L2 norm.
    pub clip_norm: f32,
    /// The sampling rate the accountant assumes (1: none).
    pub sample_rate: f64,
    /// δ.
    pub delta: f64,
    /// The budget ε, if the task set one.
    pub budget: Option<f64>,
    /// ε spent so far.
    pub epsilon_spent: f64,
}

impl PrivacyView {
    /// The view of `plan` after `releases` noisy sums.
    pub fn of(plan: &PrivacyPlan, releases: u64) -> Self {
        Self {
            mechanism: plan.params.mechanism,
            noise_multiplier: plan.params.noise_multiplier,
            clip_norm: plan.params.clip_norm,
            sample_rate: plan.round.sample_rate,
            delta: plan.delta,
            budget: plan.budget,
            epsilon_spent: plan.epsilon_after(releases),
        }
    }
}

impl PrivacySpec {
    /// Checks the fields on their own.
    pub fn validate(&self) -> Result<(), SpecError> {
        if let Some(epsilon) = self.epsilon
            && !(epsilon.is_finite() && epsilon > 0.0 && epsilon <= MAX_EPSILON)
        {
            return Err(SpecError::field(
                "privacy.epsilon",
                format!("epsilon must be in (0, {MAX_EPSILON}]"),
            ));
        }
        if !(self.delta.is_finite() && self.delta > 0.0 && self.delta <= MAX_DELTA) {
            return Err(SpecError::field("privacy.delta", format!("delta must be in (0, {MAX_DELTA}]")));
        }
        if !(self.clip_norm.is_finite() && self.clip_norm > 0.0 && self.clip_norm <= MAX_CLIP_NORM) {
            return Err(SpecError::field(
                "privacy.clip_norm",
                format!("clip_norm must be finite, positive and at most {MAX_CLIP_NORM}"),
            ));
        }
        match (self.epsilon, self.noise_multiplier) {
            (None, None) => {
                return Err(SpecError::field("privacy", "privacy needs epsilon, noise_multiplier or both"));
            }
            (_, Some(z)) if !(z.is_finite() && z > 0.0 && z <= cohort_crypto::dp::MAX_NOISE_MULTIPLIER) => {
                return Err(SpecError::field(
                    "privacy.noise_multiplier",
                    "noise_multiplier must be in (0, 10⁴]",
                ));
            }
            _ => {}
        }
        if let Some(q) = self.sample_rate
            && !(q.is_finite() && q > 0.0 && q <= 1.0)
        {
            return Err(SpecError::field("privacy.sample_rate", "sample_rate must be in (0, 1]"));
        }
        if !(8..=32).contains(&self.bits) {
            return Err(SpecError::field("privacy.bits", "bits must be between 8 and 32"));
        }
        Ok(())
    }

    /// The plan for rounds of `clients` per group with threshold
    /// `threshold`, `dimension` model parameters and `rounds` rounds (the
    /// noise is split into `threshold` shares: any sum the coordinator can
    /// unmask carries all of it). Memoized: the solve takes a while and
    /// every replica and group owner asks for the same plans.
    ///
    /// A `validated` task's sums must not wrap at all (its sum check needs
    /// the integer sum): its scale leaves [`VALIDATED_K_STDDEVS`] standard
    /// deviations on each side instead of [`DEFAULT_K_STDDEVS`].
    pub fn plan(
        &self,
        clients: u32,
        threshold: u32,
        dimension: usize,
        rounds: u32,
        validated: bool,
    ) -> Result<PrivacyPlan, SpecError> {
        type Key = (PrivacySpecKey, u32, u32, usize, u32, bool);
        static PLANS: OnceLock<Mutex<HashMap<Key, PrivacyPlan>>> = OnceLock::new();
        let key = (PrivacySpecKey::of(self), clients, threshold, dimension, rounds, validated);
        let plans = PLANS.get_or_init(Default::default);
        if let Some(plan) = plans.lock().ok().and_then(|p| p.get(&key).copied()) {
            return Ok(plan);
        }
        let plan = self.derive(clients, threshold, dimension, rounds, validated)?;
        if let Ok(mut plans) = plans.lock() {
            if plans.len() > 1_000 {
                plans.clear();
            }
            plans.insert(key, plan);
        }
        Ok(plan)
    }

    fn derive(
        &self,
        clients: u32,
        threshold: u32,
        dimension: usize,
        rounds: u32,
        validated: bool,
    ) -> Result<PrivacyPlan, SpecError> {
        self.validate()?;
        let k = if validated { VALIDATED_K_STDDEVS } else { DEFAULT_K_STDDEVS };
        let block = block_for(dimension);
        let padded = padded_len(dimension, block);
        let shares = threshold.max(1);
        let clip = f64::from(self.clip_norm);
        let q = self.sample_rate.unwrap_or(1.0);
        let scale = |z: f64| scale_for(self.bits, clients, shares, clip, z, padded, k);
        let params = |z: f64, scale: f64| DpParams {
            mechanism: self.mechanism,
            clip_norm: self.clip_norm,
            noise_multiplier: z,
            scale,
            noise_shares: shares,
        };
        let privacy = |z: f64| {
            // Where the ring cannot carry z the scale is moot: account as
            // if it could (the check below refuses such a z).
            let s = scale(z).unwrap_or(1.0 / clip);
            RoundPrivacy { mechanism: RoundMechanism::of(&params(z, s), padded), sample_rate: q }
        };
        let z = match (self.noise_multiplier, self.epsilon) {
            (Some(z), _) => z,
            (None, Some(epsilon)) => {
                noise_multiplier_for(epsilon, self.delta, u64::from(rounds), privacy).ok_or_else(|| {
                    SpecError::field(
                        "privacy.epsilon",
                        format!(
                            "the budget ε = {epsilon} is too small for {rounds} rounds at δ = {}: no noise multiplier up to 10⁴ meets it",
                            self.delta
                        ),
                    )
                })?
            }
            (None, None) => return Err(SpecError::field("privacy", "privacy needs epsilon or noise_multiplier")),
        };
        let Some(s) = scale(z) else {
            return Err(SpecError::field(
                "privacy.bits",
                format!(
                    "a {}-bit ring cannot carry the noise of {clients} clients at noise multiplier {z:.3}: raise privacy.bits",
                    self.bits
                ),
            ));
        };
        let params = params(z, s);
        let round = RoundPrivacy { mechanism: RoundMechanism::of(&params, padded), sample_rate: q };
        let plan = PrivacyPlan {
            params,
            modulus_bits: self.bits,
            padded,
            block,
            round,
            delta: self.delta,
            budget: self.epsilon,
        };
        if let Some(budget) = self.epsilon
            && !plan.allows(0)
        {
            return Err(SpecError::field(
                "privacy.epsilon",
                format!(
                    "the budget ε = {budget} is too small for a single round at noise multiplier {z} (one round spends {:.4})",
                    plan.epsilon_after(1)
                ),
            ));
        }
        Ok(plan)
    }
}

/// A [`PrivacySpec`] as a hashable key (floats by their bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PrivacySpecKey(Mechanism, Option<u64>, u64, u32, Option<u64>, Option<u64>, u8);

impl PrivacySpecKey {
    fn of(spec: &PrivacySpec) -> Self {
        Self(
            spec.mechanism,
            spec.epsilon.map(f64::to_bits),
            spec.delta.to_bits(),
            spec.clip_norm.to_bits(),
            spec.noise_multiplier.map(f64::to_bits),
            spec.sample_rate.map(f64::to_bits),
            spec.bits,
        )
    }
}

#[cfg(test)]
mod tests;
