//! Distributed differential privacy under secure aggregation.
//!
//! Each client adds its share of integer noise to its update inside the
//! ring, before masking, so the coordinator only ever unmasks a noisy sum
//! (Kairouz, Liu and Steinke, ICML 2021, the distributed discrete Gaussian;
//! Agarwal, Kairouz and Liu, NeurIPS 2021, the Skellam mechanism). A
//! client's encoding under [`DpParams`]:
//!
//! 1. clip the update to L2 norm `clip_norm` (C);
//! 2. pad it to a whole number of rotation blocks and apply the round's
//!    randomized Hadamard rotation, which spreads it evenly over the
//!    coordinates (its norm is unchanged);
//! 3. scale by `scale` (s) and round each coordinate to an integer,
//!    stochastically and without bias, drawing again until the rounded
//!    vector's norm is at most the bound Δ₂ ([`Sensitivity`]; conditional
//!    randomized rounding with β = e^(−1/2));
//! 4. add integer noise of variance (z·Δ₂)² / m to every coordinate, where z
//!    is the `noise_multiplier` and m is `noise_shares`, at most the round's
//!    threshold: the coordinator can only unmask a sum of at least
//!    threshold + 1 inputs, so every sum it learns carries noise of
//!    variance at least (z·Δ₂)²;
//! 5. reduce modulo 2^b. The sum wraps only where it strays beyond ±2^(b−1)
//!    (modular clipping): the ring is sized for the spread of the noisy,
//!    rotated sum ([`scale_for`]), not for n worst-case values, so the
//!    upload shrinks too.
//!
//! The per-round privacy of the sum is that of the mechanism at noise
//! multiplier z with the integer sensitivities Δ₂ and Δ₁
//! ([`accountant`]); neighbouring data sets differ in one client's whole
//! contribution (add or remove one client).
//!
//! The server decodes by lifting the sum to (−2^(b−1), 2^(b−1)], dividing
//! by s, undoing the rotation and dividing by the number of summands (every
//! client counts once: under DP there are no example weights, which would
//! reveal data sizes, and no client metrics, which would bypass the noise).

pub mod accountant;
mod noise;

use rand_core::CryptoRng;
use zeroize::Zeroizing;

use crate::compress::Rotation;
use crate::error::{ConfigError, QuantizeError};

#[cfg(test)]
pub(crate) use noise::PortablePoisson;
pub(crate) use noise::add_skellam_portable;
pub use noise::{sample_discrete_gaussian, sample_skellam};

/// The noise each client adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, strum::IntoStaticStr, strum::EnumString)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[strum(serialize_all = "snake_case")]
pub enum Mechanism {
    /// The difference of two Poisson variates: sums of Skellam shares are
    /// exactly Skellam (Agarwal, Kairouz and Liu, 2021).
    Skellam,
    /// The discrete Gaussian (Canonne, Kamath and Steinke, 2020); sums of
    /// shares are close to one (Kairouz, Liu and Steinke, 2021).
    #[strum(serialize = "discrete-gaussian", to_string = "discrete_gaussian")]
    DiscreteGaussian,
}

impl Mechanism {
    /// The mechanism's name in task specs and reports.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Parses [`as_str`](Self::as_str)'s names (and `discrete-gaussian`).
    pub fn parse(name: &str) -> Option<Self> {
        name.parse().ok()
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            Mechanism::Skellam => 0,
            Mechanism::DiscreteGaussian => 1,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Mechanism::Skellam),
            1 => Some(Mechanism::DiscreteGaussian),
            _ => None,
        }
    }
}

/// The differential-privacy parameters of a round: part of its
/// [`crate::QuantizationSpec`], so of the round context every client checks.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct DpParams {
    /// The noise.
    pub mechanism: Mechanism,
    /// Updates are clipped to this L2 norm (C).
    pub clip_norm: f32,
    /// z: the standard deviation of the noise in every unmasked sum over
    /// the L2 sensitivity Δ₂ of one client's rounded contribution.
    pub noise_multiplier: f64,
    /// s: integer steps per unit of the clipped, rotated update.
    pub scale: f64,
    /// m: the noise is split into this many shares (at most the round's
    /// threshold); any m clients' shares add up to the full noise.
    pub noise_shares: u32,
}

/// Largest z accepted: more noise than this drowns any update.
pub const MAX_NOISE_MULTIPLIER: f64 = 1.0e4;
/// Largest s·C accepted, so that every rounded and noised coordinate stays
/// far inside an `i64`.
const MAX_SCALED_CLIP: f64 = 1.0e12;
/// Conditional randomized rounding retries before giving up (each succeeds
/// with probability at least 1 − β ≈ 0.39).
const MAX_ROUNDING_TRIES: u32 = 1_000;

/// Standard deviations of the aggregate that the ring holds on each side
/// of zero when [`scale_for`] sizes the scale (k = 4: a coordinate of a
/// sub-Gaussian sum wraps with probability below 2e^(−8) ≈ 7·10⁻⁴).
pub const DEFAULT_K_STDDEVS: f64 = 4.0;

/// The same for a validated round, whose sum check needs the integer sum:
/// a wrapped coordinate would fail it and make suspects of honest clients.
/// k = 9: a coordinate wraps with probability below 2e^(−40.5) ≈ 5·10⁻¹⁸,
/// so a round of the largest vector (2^24 coordinates) wraps anywhere
/// with probability below 10⁻¹⁰.
pub const VALIDATED_K_STDDEVS: f64 = 9.0;

/// The L2 and L1 sensitivity of one client's rounded contribution, in
/// integer steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sensitivity {
    /// Δ₂: the rounded vector's norm never exceeds it (the rounding is
    /// redrawn until it holds).
    pub l2: f64,
    /// Δ₁ = min(Δ₂², √D·Δ₂): an integer vector's L1 norm is at most both.
    pub l1: f64,
}

impl Sensitivity {
    /// ⌊Δ₂²⌋: the integer bound on a rounded vector's squared norm, the
    /// one the rounding holds and a validated round's proof states.
    pub fn l2_squared_floor(&self) -> u128 {
        self.l2.powi(2).floor() as u128
    }
}

/// The sensitivity of a vector of L2 norm at most `scaled_norm` (s·C),
/// of `dimension` coordinates, after conditional randomized rounding with
/// β = e^(−1/2) (Kairouz, Liu and Steinke, 2021, Theorem 1 and
/// Proposition 22): Δ₂² = min{(sC + √D)², (sC)² + D/4 + √(2 ln(1/β))·(sC + √D/2)},
/// and √(2 ln(1/β)) = 1 for this β.
pub fn sensitivity(scaled_norm: f64, dimension: usize) -> Sensitivity {
    let d = dimension as f64;
    let loose = (scaled_norm + d.sqrt()).powi(2);
    let tight = scaled_norm * scaled_norm + d / 4.0 + (scaled_norm + d.sqrt() / 2.0);
    let l2 = loose.min(tight).sqrt();
    Sensitivity { l2, l1: (l2 * l2).min(d.sqrt() * l2) }
}

/// The rotation block for a `dimension`-coordinate update: the largest
/// power of two from 2^10 to 2^16 (never above the dimension's own next
/// power of two) whose padding is at most a sixteenth of the dimension,
/// else the one with the least padding.
pub fn block_for(dimension: usize) -> u32 {
    let top = dimension.max(2).next_power_of_two().min(1 << 16);
    let mut best = (usize::MAX, top);
    let mut block = top;
    while block >= 2 && (block >= 1 << 10 || block == top) {
        let padding = padded_len(dimension, block as u32) - dimension;
        if padding * 16 <= dimension {
            return block as u32;
        }
        if padding < best.0 {
            best = (padding, block);
        }
        block /= 2;
    }
    best.1 as u32
}

/// `dimension` rounded up to a whole number of `block`s.
pub fn padded_len(dimension: usize, block: u32) -> usize {
    let block = block.max(1) as usize;
    dimension.div_ceil(block) * block
}

impl DpParams {
    /// Checks the parameters on their own and against the round.
    pub fn validate(&self, modulus_bits: u8, threshold: u32) -> Result<(), ConfigError> {
        if !(self.clip_norm.is_finite() && self.clip_norm > 0.0) {
            return Err(ConfigError::BadQuantization("the clip norm must be finite and positive"));
        }
        if !(self.noise_multiplier.is_finite()
            && self.noise_multiplier > 0.0
            && self.noise_multiplier <= MAX_NOISE_MULTIPLIER)
        {
            return Err(ConfigError::BadQuantization("the noise multiplier must be in (0, 10⁴]"));
        }
        if !(self.scale.is_finite() && self.scale > 0.0)
            || self.scale * f64::from(self.clip_norm) > MAX_SCALED_CLIP
        {
            return Err(ConfigError::BadQuantization("the DP scale must be positive and s·C at most 10¹²"));
        }
        if self.noise_shares == 0 || self.noise_shares > threshold {
            return Err(ConfigError::BadQuantization(
                "the noise must be split into 1..=threshold shares: a sum of fewer would carry too little",
            ));
        }
        if !(2..=32).contains(&modulus_bits) {
            return Err(ConfigError::BadModulusBits(modulus_bits));
        }
        Ok(())
    }

    /// Δ₂ and Δ₁ for a vector of `padded` coordinates.
    pub fn sensitivity(&self, padded: usize) -> Sensitivity {
        sensitivity(self.scale * f64::from(self.clip_norm), padded)
    }

    /// The standard deviation of the noise in a sum of `noise_shares`
    /// clients' inputs, in integer steps: z·Δ₂.
    pub fn central_stddev(&self, padded: usize) -> f64 {
        self.noise_multiplier * self.sensitivity(padded).l2
    }

    /// The variance of one client's noise share, in integer steps².
    pub fn local_variance(&self, padded: usize) -> f64 {
        self.central_stddev(padded).powi(2) / f64::from(self.noise_shares)
    }

    /// The update as a client sends it before masking: clipped, rotated,
    /// scaled, rounded, noised (unless `noise` is false: a validated round
    /// adds its noise from its edges) and reduced into Z_{2^modulus_bits}.
    /// The rounded vector's squared norm is at most ⌊Δ₂²⌋, an integer
    /// bound a proof can state.
    pub(crate) fn encode<R: CryptoRng + ?Sized>(
        &self,
        rotation: &Rotation,
        block: u32,
        update: &[f32],
        modulus_bits: u8,
        noise: bool,
        rng: &mut R,
    ) -> Result<Zeroizing<Vec<u32>>, QuantizeError> {
        if let Some(bad) = update.iter().position(|v| !v.is_finite()) {
            return Err(QuantizeError::NonFinite(bad));
        }
        let padded = padded_len(update.len(), block);
        let norm = update.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt();
        let clip = f64::from(self.clip_norm);
        let shrink = if norm > clip { clip / norm } else { 1.0 };
        let mut x = Zeroizing::new(vec![0.0f32; padded]);
        for (x, &v) in x.iter_mut().zip(update) {
            *x = (f64::from(v) * shrink) as f32;
        }
        let rotated = Zeroizing::new(rotation.forward(&x));
        let scaled: Zeroizing<Vec<f64>> = Zeroizing::new(
            // Rounding in f32 may leave the clipped norm a hair above C;
            // shrinking by 1 − 2⁻²⁰ keeps it under.
            rotated
                .iter()
                .map(|&v| f64::from(v) * self.scale * (1.0 - 1.0 / f64::from(1u32 << 20)))
                .collect(),
        );
        let bound_sq = self.sensitivity(padded).l2_squared_floor();
        let mut rounded = Zeroizing::new(vec![0i64; padded]);
        let mut tries = 0;
        loop {
            tries += 1;
            if tries > MAX_ROUNDING_TRIES {
                return Err(QuantizeError::Rounding);
            }
            // In integers: the bound a proof states is exact.
            let mut squared = 0u128;
            for (r, &v) in rounded.iter_mut().zip(scaled.iter()) {
                let floor = v.floor();
                let up = uniform(rng) < v - floor;
                let value = if up { floor + 1.0 } else { floor } as i64;
                squared += u128::from(value.unsigned_abs()).pow(2);
                *r = value;
            }
            if squared <= bound_sq {
                break;
            }
        }
        let variance = self.local_variance(padded);
        match (noise, self.mechanism) {
            (false, _) => {}
            (true, Mechanism::Skellam) => noise::add_skellam(&mut rounded, variance, rng),
            (true, Mechanism::DiscreteGaussian) => noise::add_discrete_gaussian(&mut rounded, variance, rng),
        }
        let mask = if modulus_bits >= 32 { u32::MAX } else { (1u32 << modulus_bits) - 1 };
        Ok(Zeroizing::new(rounded.iter().map(|&v| (v as u32) & mask).collect()))
    }

    /// The mean of `summands` clipped updates from their noisy sum in the
    /// ring (`sum` of `padded` coordinates): lifted to signed values,
    /// unscaled, rotated back and cut to `dimension` coordinates.
    pub(crate) fn decode(
        &self,
        rotation: &Rotation,
        sum: &[u32],
        summands: u32,
        modulus_bits: u8,
        dimension: usize,
    ) -> Vec<f32> {
        let modulus = 1i64 << modulus_bits;
        let half = modulus / 2;
        let factor = 1.0 / (self.scale * f64::from(summands));
        let lifted: Vec<f32> = sum
            .iter()
            .map(|&v| {
                let v = i64::from(v) & (modulus - 1);
                let signed = if v >= half { v - modulus } else { v };
                (signed as f64 * factor) as f32
            })
            .collect();
        rotation.inverse_padded(&lifted, dimension)
    }
}

/// A uniform double in [0, 1) from 53 random bits.
pub(crate) fn uniform<R: CryptoRng + ?Sized>(rng: &mut R) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The largest scale s (integer steps per unit) whose aggregate stays
/// within ±2^(b−1) for `k_stddevs` standard deviations, for a group of
/// `clients` whose noise is split into `noise_shares` shares at noise
/// multiplier `noise_multiplier`, with updates clipped to `clip_norm` and
/// `padded` coordinates after rotation. The aggregate's spread per
/// coordinate is bounded as if all clipped updates pointed the same way:
/// (s·n·C)²/D for the signal, n·(z·Δ₂(s))²/m for the noise and n/4 for the
/// rounding (Kairouz, Liu and Steinke, 2021, Section 4.2). `None` when even
/// the smallest scale does not fit: the ring cannot carry the mechanism.
pub fn scale_for(
    modulus_bits: u8,
    clients: u32,
    noise_shares: u32,
    clip_norm: f64,
    noise_multiplier: f64,
    padded: usize,
    k_stddevs: f64,
) -> Option<f64> {
    if !(2..=32).contains(&modulus_bits) || clients == 0 || noise_shares == 0 || padded == 0 {
        return None;
    }
    let n = f64::from(clients);
    let half_range = f64::from(1u32 << (modulus_bits - 1));
    let spread = |s: f64| {
        let l2 = sensitivity(s * clip_norm, padded).l2;
        let signal = (s * n * clip_norm).powi(2) / padded as f64;
        let noise = n * (noise_multiplier * l2).powi(2) / f64::from(noise_shares);
        k_stddevs * (signal + noise + n / 4.0).sqrt()
    };
    let smallest = 1.0e-9 / clip_norm;
    if spread(smallest) >= half_range {
        return None;
    }
    let (mut low, mut high) = (smallest, smallest);
    while spread(high) < half_range {
        low = high;
        high *= 2.0;
        if high * clip_norm > MAX_SCALED_CLIP {
            return Some(low);
        }
    }
    for _ in 0..100 {
        let mid = (low + high) / 2.0;
        if spread(mid) < half_range { low = mid } else { high = mid }
    }
    Some(low)
}

#[cfg(test)]
mod tests;
