//! Fixed-point quantization of model updates into the ring Z_{2^b}, with
//! room for the sum of n inputs and the example count as an extra coordinate.
//!
//! Encoding, for an update Δ with example count w (at most `max_weight` W):
//! 1. clip every coordinate to [−c, c];
//! 2. scale by w / W, so that the sum of inputs is Σ w_k Δ_k / W;
//! 3. map [−c, c] affinely onto [0, L] with L = ⌊(2^b − 1) / n⌋ and round
//!    stochastically (up with probability equal to the fractional part, so the
//!    rounding is unbiased);
//! 4. append w itself, exactly, as base-(L + 1) digits (one coordinate when
//!    W ≤ L, more in small rings);
//! 5. append the round's metrics ([`crate::metrics`]) the same way, each
//!    with a coordinate that says whether the client reported it.
//!
//! Every coordinate lies in [0, L], so the sum of up to n inputs stays below
//! 2^b: it never wraps, and the server decodes the weighted mean
//! Σ w_k Δ_k / Σ w_k without ever seeing a single w_k.
//!
//! A [`Transform`] may come first: a randomized Hadamard rotation or a count
//! sketch ([`crate::compress`]). Both are linear, so the decoded sum is the
//! transformed sum, which [`Quantizer::decode`] maps back.
//!
//! With `b` bits per client value and n clients the ring needs
//! b + ⌈log₂ n⌉ bits ([`modulus_bits_for`]); the masked input travels
//! bit-packed, so the upload shrinks with b.
//!
//! A fitted ring ([`QuantizationSpec::scale`], with the rotation) drops
//! that headroom: each rotated coordinate, clipped and weighted, becomes
//! round(s·v) mod 2^b, and the server lifts each coordinate of the sum to
//! (−2^(b−1), 2^(b−1)]. After a fresh random rotation a coordinate of the
//! sum is close to Gaussian, with the deviation of its block
//! ([`SumSpread`]); the coordinator fits s to the last sum it decoded so
//! that about a [`TARGET_WRAP_RATE`] of the coordinates stray beyond the ring
//! and wrap (modular clipping, as [`crate::dp`] does for its noisy sums).
//! A wrap moves one rotated coordinate by 2^b/s, which the inverse rotation
//! spreads over its block. The first round, with no sum to fit, runs at
//! [`safe_scale`], where no sum can wrap. The example count's digits and
//! the metrics keep the exact headroom in either ring.

use rand_core::CryptoRng;
use zeroize::Zeroizing;

use crate::compress::{CountSketch, Rotation};
use crate::dp::{DpParams, padded_len};
use crate::error::ConfigError;
pub use crate::error::QuantizeError;
use crate::metrics::{MetricSet, MetricSums, MetricValues};

/// Largest rotation block and sketch dimensions accepted.
const MAX_BLOCK: u32 = 1 << 16;
const MAX_SKETCH_ROWS: u32 = 15;

/// Largest s·c of a fitted ring: a scaled coordinate then fits an i64
/// exactly, whatever the weight.
const MAX_SCALED_CLIP: f64 = (1u64 << 40) as f64;

/// Smallest s·c of a fitted ring: decoding divides by s.
const MIN_SCALED_CLIP: f64 = 1.0 / (1u64 << 20) as f64;

/// A linear map applied to every update before quantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transform {
    /// None: the update is quantized as it is.
    #[default]
    None,
    /// Randomized Hadamard rotation in blocks of `block` (a power of two).
    Rotate {
        /// Block size.
        block: u32,
        /// Public seed of the random signs, fresh per round.
        seed: [u8; 32],
    },
    /// Count sketch of `rows` × `columns` buckets.
    Sketch {
        /// Rows (an odd number up to 15: the estimate is their median).
        rows: u32,
        /// Buckets per row.
        columns: u32,
        /// Coordinates the server keeps, the largest estimates (0: all).
        top_k: u32,
        /// Public seed of the hashes, fresh per round.
        seed: [u8; 32],
    },
}

/// Ring bits for `bits`-bit client values summed over `clients`:
/// b + ⌈log₂ n⌉, at most 32.
pub fn modulus_bits_for(bits: u8, clients: u32) -> Option<u8> {
    let headroom = 32 - clients.max(1).saturating_sub(1).leading_zeros();
    let total = u32::from(bits) + headroom;
    (total <= 32).then_some(total as u8)
}

/// The fraction of a sum's coordinates that [`fitted_scale`] expects to
/// wrap, under the Gaussian model of the rotated sum ([`SumSpread`]): one
/// in 400 000, half a coordinate a round at 200 000 parameters. A rate, not
/// a count, so that the wraps' share of the sum's norm is the same for
/// every model size, and a sum that fits its scale has about 0.3 % of its
/// coordinates beyond half the ring ([`OVERFLOW_LIMIT`]).
pub const TARGET_WRAP_RATE: f64 = 2.5e-6;

/// How much larger than the last sum's spread the next sum's may be, in
/// [`SumSpread::scale_for`].
pub const SPREAD_GROWTH: f64 = 1.25;

/// The most clients per group a fitted ring of `modulus_bits` bits holds:
/// ⌊(2^(b−1) − 1) / 2⌋, the most at which [`safe_scale`] leaves each input
/// a step.
pub fn max_fitted_clients(modulus_bits: u8) -> u32 {
    if !(2..=32).contains(&modulus_bits) {
        return 0;
    }
    ((1u32 << (modulus_bits - 1)) - 1) / 2
}

/// The first round's scale of a fitted ring, before any sum was seen:
/// the largest s at which `clients` inputs, each clipped to [−c, c] and
/// rounded up by at most one step, can never wrap (n·(s·c + 1) ≤ 2^(b−1) − 1).
/// `None` when the ring has room for less than one step per input.
pub fn safe_scale(modulus_bits: u8, clients: u32, clip: f32) -> Option<f64> {
    if !(2..=32).contains(&modulus_bits) || clients == 0 || !(clip.is_finite() && clip > 0.0) {
        return None;
    }
    let half = f64::from(1u32 << (modulus_bits - 1));
    let steps = (half - 1.0) / f64::from(clients) - 1.0;
    (steps >= 1.0).then(|| steps / f64::from(clip))
}

/// How many times the scale the last sum was measured at a fitted ring's
/// next scale may be: a sum that rounded to almost nothing says little
/// about the next one, so the scale climbs towards the ring in steps.
pub const MAX_SCALE_STEP: f64 = 8.0;

/// The scale of a fitted ring of `modulus_bits` bits for a round of
/// `clients` inputs clipped to [−c, c]: fitted to `last`, the spread of a
/// previous sum, for a [`TARGET_WRAP_RATE`] of wraps at [`SPREAD_GROWTH`],
/// and at most [`MAX_SCALE_STEP`] times the scale that sum was measured
/// at; without one (or when it leaves no room), the [`safe_scale`].
pub fn fitted_scale(last: Option<&SumSpread>, modulus_bits: u8, clients: u32, clip: f32) -> Option<f64> {
    let ceiling = MAX_SCALED_CLIP / f64::from(clip);
    let safe = safe_scale(modulus_bits, clients, clip);
    let fitted = last.and_then(|s| {
        let max = s.measured_at.map_or(ceiling, |at| (at * MAX_SCALE_STEP).min(ceiling));
        let target = TARGET_WRAP_RATE * s.len() as f64;
        s.for_group(clients).scale_for(modulus_bits, clients, SPREAD_GROWTH, target, max)
    });
    // A fitted scale below the safe one would be the worse of the two.
    match (fitted, safe) {
        (Some(fitted), Some(safe)) => Some(fitted.max(safe)),
        (fitted, safe) => fitted.or(safe),
    }
}

/// How far the coordinates of a rotated sum spread, block by block: what a
/// fitted ring ([`QuantizationSpec::scale`]) is sized for. The rotation
/// keeps each block's norm, and with fresh random signs each coordinate of
/// a rotated block is close to Gaussian with deviation ‖block‖/√size (the
/// tail's small blocks are bounded the same way, less tightly).
#[derive(Debug, Clone, PartialEq)]
pub struct SumSpread {
    /// (size, root mean square) of every rotation block.
    blocks: Vec<(u32, f64)>,
    /// The inputs the sum is of.
    summands: u32,
    /// The scale the sum was quantized at (a fitted ring's), if known.
    measured_at: Option<f64>,
}

impl SumSpread {
    /// The spread of `sum`, the weighted sum Σ (w_k / W)·Δ_k of `summands`
    /// inputs in the update's basis (the decoded mean times Σ w_k / W), for
    /// rotation blocks of `block` coordinates.
    pub fn of(sum: &[f32], block: u32, summands: u32) -> Option<Self> {
        let rotation = Rotation::new([0; 32], block as usize)?;
        let blocks = rotation
            .blocks(sum.len())
            .map(|(start, size)| {
                let energy: f64 = sum[start..start + size].iter().map(|&v| f64::from(v).powi(2)).sum();
                (size as u32, (energy / size as f64).sqrt())
            })
            .collect();
        Some(Self { blocks, summands: summands.max(1), measured_at: None })
    }

    /// The same spread, measured on a sum quantized at `scale`.
    pub fn measured_at(self, scale: Option<f64>) -> Self {
        Self { measured_at: scale, ..self }
    }

    /// The scale the sum was quantized at, if known.
    pub fn scale(&self) -> Option<f64> {
        self.measured_at
    }

    /// The coordinates of the sum.
    pub fn len(&self) -> usize {
        self.blocks.iter().map(|&(size, _)| size as usize).sum()
    }

    /// Whether the sum has no coordinates.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The spread to expect of a sum of `clients` inputs like these,
    /// erring wide: the sum of more inputs may point one way, so it grows
    /// with their number (×n/m); the sum of fewer may be mostly the
    /// clients' own parts, which shrink only as the square root (×√(n/m)).
    pub fn for_group(&self, clients: u32) -> Self {
        let ratio = f64::from(clients.max(1)) / f64::from(self.summands);
        let factor = if ratio >= 1.0 { ratio } else { ratio.sqrt() };
        Self {
            blocks: self.blocks.iter().map(|&(size, rms)| (size, rms * factor)).collect(),
            summands: clients.max(1),
            measured_at: self.measured_at,
        }
    }

    /// Block by block, the wider of two spreads of vectors of one length,
    /// both taken to the larger group (`None` if their blocks differ).
    pub fn widest(&self, other: &Self) -> Option<Self> {
        let summands = self.summands.max(other.summands);
        let (a, b) = (self.for_group(summands), other.for_group(summands));
        (a.blocks.len() == b.blocks.len() && a.blocks.iter().zip(&b.blocks).all(|(a, b)| a.0 == b.0)).then(
            || Self {
                blocks: a.blocks.iter().zip(&b.blocks).map(|(a, b)| (a.0, a.1.max(b.1))).collect(),
                summands,
                // The lower scale: the next one steps from there.
                measured_at: match (self.measured_at, other.measured_at) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                },
            },
        )
    }

    /// The expected number of coordinates that wrap in a sum of `summands`
    /// inputs at scale `scale` in Z_{2^b}, if the sum spreads `growth` times
    /// as far as this one: Σ over blocks of size·erfc(2^(b−1) / (√2·σ)),
    /// with σ² = (growth·s·rms)² + summands/4 (the stochastic rounding adds
    /// at most ¼ step² per input).
    pub fn expected_wraps(&self, scale: f64, modulus_bits: u8, summands: u32, growth: f64) -> f64 {
        // b within 1 to 32, the rings a round may have.
        let half = f64::from(1u32 << (modulus_bits.clamp(1, 32) - 1));
        let rounding = f64::from(summands) / 4.0;
        self.blocks
            .iter()
            .map(|&(size, rms)| {
                let sigma = ((growth * scale * rms).powi(2) + rounding).sqrt();
                f64::from(size) * libm::erfc(half / (std::f64::consts::SQRT_2 * sigma))
            })
            .sum()
    }

    /// The largest scale, up to `max`, at which a sum of `summands` inputs
    /// in Z_{2^b} is expected to wrap at most `target` coordinates if it
    /// spreads `growth` times as far as this one; `None` when the rounding
    /// alone wraps more.
    pub fn scale_for(
        &self,
        modulus_bits: u8,
        summands: u32,
        growth: f64,
        target: f64,
        max: f64,
    ) -> Option<f64> {
        let wraps = |s: f64| self.expected_wraps(s, modulus_bits, summands, growth);
        if !(2..=32).contains(&modulus_bits) || !max.is_finite() || max <= 0.0 || wraps(max * 1e-12) > target
        {
            return None;
        }
        if wraps(max) <= target {
            return Some(max);
        }
        // The expected wraps grow with the scale: bisect on its logarithm.
        let (mut low, mut high) = ((max * 1e-12).ln(), max.ln());
        for _ in 0..80 {
            let mid = (low + high) / 2.0;
            if wraps(mid.exp()) <= target { low = mid } else { high = mid }
        }
        Some(low.exp())
    }
}

/// Quantization parameters (part of the round configuration).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantizationSpec {
    /// Coordinates are clipped to [−clip, clip].
    pub clip: f32,
    /// Largest example count a client may report (W).
    pub max_weight: u32,
    /// Applied before quantization.
    pub transform: Transform,
    /// Metrics every client's vector has room for, after the example count.
    pub metrics: MetricSet,
    /// Distributed differential privacy ([`crate::dp`]): each client clips
    /// its update in L2 norm, adds its share of noise and wraps modulo the
    /// ring; `clip` and the level headroom then play no part, the transform
    /// must be the rotation, and there are no weights or metrics.
    pub privacy: Option<DpParams>,
    /// Input validation ([`crate::validation`]): each client clips its
    /// update to an L2 norm and proves that the vector it masks is within
    /// the bound that follows ([`Quantizer::norm_bound_sq`]).
    pub validation: Option<NormCheck>,
    /// A fitted ring (modular clipping): each transformed coordinate,
    /// clipped and weighted, is multiplied by this scale s (steps per unit)
    /// and rounded to a signed integer, reduced modulo 2^b; the server
    /// lifts each coordinate of the sum to (−2^(b−1), 2^(b−1)]. The ring is
    /// then sized for the spread of the rotated sum ([`SumSpread`]), not
    /// for n worst-case values: a coordinate of the sum wraps only where it
    /// strays beyond ±2^(b−1)/s. `None`: the exact ring of the module's
    /// introduction, which never wraps. Public, per round (like the
    /// transform's seed): it sets the sum's precision, never what the masks
    /// hide.
    pub scale: Option<f64>,
}

/// The norm every input of a validated round is proven within.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormCheck {
    /// Each update, transformed and clipped per coordinate, is scaled down
    /// to at most this L2 norm before it is quantized.
    pub l2_clip: f32,
    /// Coordinates of the quantized vector that are committed and proven:
    /// the transformed update, the example count's digits and the
    /// metrics' coordinates ([`Quantizer::encoded_len`]).
    pub dimension: u32,
}

impl QuantizationSpec {
    /// Checks the parameters against the ring size and the number of clients.
    pub fn validate(&self, modulus_bits: u8, clients: u32) -> Result<(), ConfigError> {
        if !(self.clip.is_finite() && self.clip > 0.0) {
            return Err(ConfigError::BadQuantization("clip must be finite and positive"));
        }
        if !(2..=32).contains(&modulus_bits) {
            return Err(ConfigError::BadModulusBits(modulus_bits));
        }
        if let Some(privacy) = &self.privacy {
            // The sum wraps by design (modular clipping): no level headroom.
            privacy.validate(modulus_bits, clients)?;
            if !matches!(self.transform, Transform::Rotate { .. }) {
                return Err(ConfigError::BadQuantization("differential privacy needs the rotation"));
            }
            if !self.metrics.is_empty() || self.max_weight != 1 {
                return Err(ConfigError::BadQuantization(
                    "under differential privacy every client counts once and reports no metrics",
                ));
            }
        } else if levels(modulus_bits, clients) < 2 {
            return Err(ConfigError::BadQuantization("the ring is too small for this many clients"));
        }
        if let Some(scale) = self.scale {
            let scaled_clip = scale * f64::from(self.clip);
            if !(scale.is_finite() && (MIN_SCALED_CLIP..=MAX_SCALED_CLIP).contains(&scaled_clip)) {
                return Err(ConfigError::BadQuantization(
                    "a fitted ring's scale·clip must be between 2^-20 and 2^40",
                ));
            }
            if self.privacy.is_some() {
                return Err(ConfigError::BadQuantization(
                    "differential privacy fits its ring itself: no separate scale",
                ));
            }
            if !matches!(self.transform, Transform::Rotate { .. }) {
                return Err(ConfigError::BadQuantization(
                    "a fitted ring needs the rotation (its sum is then close to Gaussian)",
                ));
            }
            if self.validation.is_some() {
                return Err(ConfigError::BadQuantization(
                    "input validation needs the exact ring: its sum check opens the commitments to a sum that never wraps",
                ));
            }
        }
        if self.max_weight == 0 {
            return Err(ConfigError::BadQuantization("max_weight must be at least 1"));
        }
        if let Some(check) = &self.validation {
            if !(check.l2_clip.is_finite() && check.l2_clip > 0.0) {
                return Err(ConfigError::BadQuantization(
                    "the validation's L2 clip must be finite and positive",
                ));
            }
            if check.dimension == 0 || check.dimension as usize > crate::validation::MAX_DIMENSION {
                return Err(ConfigError::BadQuantization(
                    "the validated dimension must be between 1 and 2^24",
                ));
            }
            if let Some(privacy) = &self.privacy {
                // The proof bounds the vector before its noise by the
                // sensitivity, and the noise rides on verified edges
                // (`validation::noise`), whose Skellam parts add up exactly.
                if privacy.mechanism != crate::dp::Mechanism::Skellam {
                    return Err(ConfigError::BadQuantization(
                        "input validation under differential privacy needs the Skellam mechanism",
                    ));
                }
                if check.l2_clip != privacy.clip_norm {
                    return Err(ConfigError::BadQuantization(
                        "under differential privacy the validation's L2 clip is the privacy clip",
                    ));
                }
            }
            if matches!(self.transform, Transform::Sketch { .. }) {
                return Err(ConfigError::BadQuantization(
                    "input validation needs a norm-preserving transform (none or the rotation), not a sketch",
                ));
            }
        }
        match self.transform {
            Transform::None => {}
            Transform::Rotate { block, .. } => {
                if !(2..=MAX_BLOCK).contains(&block) || !block.is_power_of_two() {
                    return Err(ConfigError::BadQuantization(
                        "the rotation block must be a power of two up to 2^16",
                    ));
                }
            }
            Transform::Sketch { rows, columns, .. } => {
                if rows % 2 == 0 || rows > MAX_SKETCH_ROWS || columns == 0 {
                    return Err(ConfigError::BadQuantization(
                        "a sketch needs an odd number of rows up to 15 and columns",
                    ));
                }
                if u64::from(rows) * u64::from(columns) > u64::from(crate::limits::MAX_VECTOR_LEN) {
                    return Err(ConfigError::BadQuantization("the sketch is larger than a vector may be"));
                }
            }
        }
        Ok(())
    }
}

/// L = ⌊(2^b − 1) / n⌋: the largest per-client value that keeps the sum of
/// n values below 2^b.
fn levels(modulus_bits: u8, clients: u32) -> u64 {
    if !(1..=32).contains(&modulus_bits) || clients == 0 {
        return 0;
    }
    ((1u64 << modulus_bits) - 1) / u64::from(clients)
}

/// Writes `round(value, uniform)` for every value into `out`, with a fresh
/// uniform double in [0, 1) (53 random bits) per coordinate. The random
/// words are drawn 64 at a time (the same words, in the same order, as one
/// draw per coordinate), and each coordinate is written in place: a loop
/// without calls or pushes once `round` is inlined.
#[inline(always)]
fn round_each<R: CryptoRng + ?Sized>(
    values: &[f32],
    out: &mut [u32],
    rng: &mut R,
    round: impl Fn(f64, f64) -> u32,
) {
    let mut random = Zeroizing::new([0u8; 8 * ROUNDING_BATCH]);
    for (chunk, rounded) in values.chunks(ROUNDING_BATCH).zip(out.chunks_mut(ROUNDING_BATCH)) {
        let random = &mut random[..8 * chunk.len()];
        rng.fill_bytes(random);
        for ((&value, word), rounded) in chunk.iter().zip(random.chunks_exact(8)).zip(rounded) {
            let bits =
                u64::from_le_bytes([word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7]]);
            let uniform = ((bits >> 11) as i64) as f64 * (1.0 / (1u64 << 53) as f64);
            *rounded = round(f64::from(value), uniform);
        }
    }
}

/// 2^b − 1: the ring's values as a bit mask.
fn ring_mask(modulus_bits: u8) -> u64 {
    (1u64 << modulus_bits) - 1
}

/// A coordinate of Z_{2^b} as the integer in (−2^(b−1), 2^(b−1)] it
/// stands for (b is taken within 1 to 32, the rings a round may have).
pub fn lift(value: u32, modulus_bits: u8) -> i64 {
    let modulus_bits = modulus_bits.clamp(1, 32);
    let value = i64::from(value) & ring_mask(modulus_bits) as i64;
    let half = 1i64 << (modulus_bits - 1);
    if value > half { value - (1i64 << modulus_bits) } else { value }
}

/// A quantized input vector in Z_{2^b}: an individual client's update, so it
/// is zeroized on drop and has no `Debug`.
pub struct QuantizedInput(Zeroizing<Vec<u32>>);

impl QuantizedInput {
    /// Wraps values an application quantized itself. Each must be below
    /// 2^b and respect the round's headroom for the sum not to wrap.
    pub fn from_values(values: Vec<u32>) -> Self {
        Self(Zeroizing::new(values))
    }

    /// Number of coordinates.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the vector is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The values (the application's own input: never log it).
    pub fn values(&self) -> &[u32] {
        &self.0
    }

    /// The values themselves, zeroized when dropped.
    pub(crate) fn into_values(self) -> Zeroizing<Vec<u32>> {
        self.0
    }
}

/// The decoded aggregate: the weighted mean update, the total weight and
/// the metrics' sums.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightedMean {
    /// Σ w_k Δ_k / Σ w_k, per coordinate.
    pub mean: Vec<f32>,
    /// Σ w_k.
    pub total_weight: u64,
    /// Per metric of the round, its sum over the survivors that reported
    /// it and their number.
    pub metrics: MetricSums,
    /// In a fitted ring, the fraction of the sum's update coordinates that
    /// lifted beyond half the ring, ±2^(b−2) (0 at or below the safe scale,
    /// where no sum wraps). About 0.3 % when the scale fits the sum, half
    /// when it overshot and the sum wrapped throughout: above
    /// [`OVERFLOW_LIMIT`] the sum is not to be used. `None` in the exact
    /// ring.
    pub overflow: Option<f64>,
}

impl WeightedMean {
    /// Whether a fitted ring's sum wrapped too often to be used.
    pub fn overflowed(&self) -> bool {
        self.overflow.is_some_and(|fraction| fraction > OVERFLOW_LIMIT)
    }
}

/// The fraction of a fitted sum's coordinates beyond half the ring above
/// which the sum is taken to have wrapped throughout ([`WeightedMean::overflow`]):
/// a sum that spreads as its scale expects has about 0.3 % there, one that
/// spreads 1.5 times as far 5 %, one that wrapped throughout 50 %.
pub const OVERFLOW_LIMIT: f64 = 0.05;

/// Coordinates rounded per draw of random words in [`Quantizer::encode`].
const ROUNDING_BATCH: usize = 64;

/// Quantizes updates for one round and decodes the aggregate.
#[derive(Debug, Clone, Copy)]
pub struct Quantizer {
    spec: QuantizationSpec,
    clients: u32,
    levels: u64,
    modulus_bits: u8,
}

impl Quantizer {
    /// A quantizer for `clients` summands in Z_{2^modulus_bits}.
    pub fn new(spec: QuantizationSpec, modulus_bits: u8, clients: u32) -> Result<Self, ConfigError> {
        spec.validate(modulus_bits, clients)?;
        Ok(Self { spec, clients, levels: levels(modulus_bits, clients), modulus_bits })
    }

    /// Length of an encoded vector for an update of `dimension`
    /// coordinates: the transformed length, the weight's digits and the
    /// metrics' digits and presence coordinates.
    pub fn encoded_len(&self, dimension: usize) -> usize {
        if self.spec.privacy.is_some() {
            return padded_len(dimension, self.block());
        }
        self.transformed_len(dimension) + self.tail_len()
    }

    /// B² for a validated round: the largest squared L2 norm of a client's
    /// quantized vector, centred and doubled (each value v read as 2v − L,
    /// so that [0, L] maps onto [−L, L] in integers). An update clipped to
    /// [−c, c], scaled to norm at most the L2 clip c₂ and by w/W ≤ 1, lands
    /// at 2·pos − L = Δ·L/c per coordinate before rounding, and the rounding
    /// moves each value by less than 2: the update's part is at most
    /// (L/c)·c₂ + 2·√d; every other coordinate (the example count's digits,
    /// the metrics) is at most L. `None` without validation, or when the
    /// bound does not fit the proof (2^100).
    pub fn norm_bound_sq(&self) -> Option<u128> {
        let check = self.spec.validation?;
        let extra = self.weight_digits() + self.metric_coordinates();
        let update = (check.dimension as usize).checked_sub(extra)?;
        let levels = self.levels as f64;
        // A relative margin for the f32 arithmetic of clipping and scaling.
        let part = levels / f64::from(self.spec.clip) * f64::from(check.l2_clip) * (1.0 + 1e-6)
            + 2.0 * (update as f64).sqrt()
            + 1.0;
        let bound_sq = part.ceil().powi(2) + extra as f64 * levels * levels;
        (bound_sq < (1u128 << 100) as f64).then_some(bound_sq.ceil() as u128)
    }

    /// The spread of the weighted sum of `summands` inputs that `mean` was
    /// decoded from, for the next round's fitted ring; `None` without the
    /// rotation.
    pub fn spread(&self, mean: &WeightedMean, summands: u32) -> Option<SumSpread> {
        let factor = mean.total_weight as f64 / f64::from(self.spec.max_weight);
        let sum: Vec<f32> = mean.mean.iter().map(|&v| (f64::from(v) * factor) as f32).collect();
        SumSpread::of(&sum, self.block(), summands).map(|spread| spread.measured_at(self.spec.scale))
    }

    /// The largest per-client value, L.
    pub fn levels(&self) -> u64 {
        self.levels
    }

    /// The rotation's block (0 without one).
    fn block(&self) -> u32 {
        match self.spec.transform {
            Transform::Rotate { block, .. } => block,
            _ => 0,
        }
    }

    fn metric_coordinates(&self) -> usize {
        self.spec.metrics.iter().map(|m| self.digits_for(m.max_fixed()) + 1).sum()
    }

    fn transformed_len(&self, dimension: usize) -> usize {
        match self.spec.transform {
            Transform::None => dimension,
            Transform::Rotate { .. } => dimension,
            Transform::Sketch { rows, columns, .. } => rows as usize * columns as usize,
        }
    }

    /// Base-(L + 1) digits needed for example counts up to W.
    fn weight_digits(&self) -> usize {
        self.digits_for(u64::from(self.spec.max_weight))
    }

    /// Base-(L + 1) digits needed for values up to `max`.
    fn digits_for(&self, max: u64) -> usize {
        let base = self.levels + 1;
        let mut digits = 1;
        let mut reach = base;
        while reach <= max {
            reach = reach.saturating_mul(base);
            digits += 1;
        }
        digits
    }

    /// Appends `value` as `digits` base-(L + 1) digits, least significant first.
    fn push_digits(&self, out: &mut Vec<u32>, mut value: u64, digits: usize) {
        for _ in 0..digits {
            out.push((value % (self.levels + 1)) as u32);
            value /= self.levels + 1;
        }
    }

    /// The number whose base-(L + 1) digits (least significant first) are
    /// `digits`; the digits are sums, so may exceed the base.
    fn digits_value(&self, digits: &[u32]) -> u128 {
        digits
            .iter()
            .rev()
            .fold(0u128, |total, &digit| total * u128::from(self.levels + 1) + u128::from(digit))
    }

    fn rotation(&self) -> Option<Rotation> {
        match self.spec.transform {
            Transform::Rotate { block, seed } => Rotation::new(seed, block as usize),
            _ => None,
        }
    }

    fn sketch(&self) -> Option<(CountSketch, u32)> {
        match self.spec.transform {
            Transform::Sketch { rows, columns, top_k, seed } => {
                CountSketch::new(seed, rows as usize, columns as usize).map(|s| (s, top_k))
            }
            _ => None,
        }
    }

    /// Quantizes `update` with example count `weight` and no metrics.
    pub fn encode<R: CryptoRng + ?Sized>(
        &self,
        update: &[f32],
        weight: u32,
        rng: &mut R,
    ) -> Result<QuantizedInput, QuantizeError> {
        self.encode_with_metrics(update, weight, &MetricValues::new(), rng)
    }

    /// Quantizes `update` with example count `weight` and the round's
    /// metrics from `metrics` (those it does not report are absent; those
    /// the round has no room for are left out).
    pub fn encode_with_metrics<R: CryptoRng + ?Sized>(
        &self,
        update: &[f32],
        weight: u32,
        metrics: &MetricValues,
        rng: &mut R,
    ) -> Result<QuantizedInput, QuantizeError> {
        if let (Some(privacy), Some(rotation)) = (&self.spec.privacy, self.rotation()) {
            // Every client counts once; weights and metrics stay home.
            // A validated round's noise is added by the secure-aggregation
            // client, from its noise edges (`validation::noise`).
            let noise = self.spec.validation.is_none();
            let values = privacy.encode(&rotation, self.block(), update, self.modulus_bits, noise, rng)?;
            return Ok(QuantizedInput(values));
        }
        if weight > self.spec.max_weight {
            return Err(QuantizeError::WeightTooLarge { max: self.spec.max_weight, got: weight });
        }
        if let Some(bad) = update.iter().position(|v| !v.is_finite()) {
            return Err(QuantizeError::NonFinite(bad));
        }
        let transformed = match (self.rotation(), self.sketch()) {
            (Some(rotation), _) => Some(Zeroizing::new(rotation.forward(update))),
            (_, Some((sketch, _))) => Some(Zeroizing::new(sketch.sketch(update))),
            _ => None,
        };
        let values = transformed.as_deref().map_or(update, Vec::as_slice);
        let clip = f64::from(self.spec.clip);
        if let Some(scale) = self.spec.scale {
            let steps = f64::from(weight) / f64::from(self.spec.max_weight) * scale;
            let mut out = self.encode_fitted(values, clip, steps, rng);
            self.push_tail(&mut out, weight, metrics);
            return Ok(QuantizedInput(out));
        }
        // Under validation the vector, once clipped per coordinate, is
        // scaled down to the L2 clip, so the quantized vector is within the
        // bound the round's proofs show. An L2 clip of clip·√d never scales
        // anything (a vector clipped to [−c, c]^d is no longer than c·√d).
        let shrink = self.spec.validation.map_or(1.0, |check| {
            let norm = values.iter().map(|&v| f64::from(v).clamp(-clip, clip).powi(2)).sum::<f64>().sqrt();
            let l2 = f64::from(check.l2_clip);
            if norm > l2 { l2 / norm } else { 1.0 }
        });
        let scale = f64::from(weight) / f64::from(self.spec.max_weight);
        let levels = self.levels as f64;
        let to_unit = levels / (2.0 * clip);
        let mut out = Zeroizing::new(Vec::with_capacity(self.encoded_len(update.len())));
        out.resize(values.len(), 0);
        round_each(values, &mut out, rng, |value, uniform| {
            // Finite (checked above), so plain comparisons clamp it.
            let clipped = if value < -clip {
                -clip
            } else if value > clip {
                clip
            } else {
                value
            };
            let position = (clipped * shrink * scale + clip) * to_unit;
            let position = if position < 0.0 {
                0.0
            } else if position > levels {
                levels
            } else {
                position
            };
            // The position is not negative, so truncation is its floor
            // (one instruction, where `floor` is a libm call on x86-64's
            // baseline); it fits an i64, whose conversions are single
            // instructions too.
            let floor = (position as i64) as f64;
            let up = if uniform < position - floor { floor + 1.0 } else { floor };
            (if up > levels { levels } else { up }) as u32
        });
        self.push_tail(&mut out, weight, metrics);
        Ok(QuantizedInput(out))
    }

    /// The example count's digits and the metrics' coordinates, exact in
    /// either ring: each is at most L, so their sums never wrap.
    fn push_tail(&self, out: &mut Vec<u32>, weight: u32, metrics: &MetricValues) {
        self.push_digits(out, u64::from(weight), self.weight_digits());
        for metric in self.spec.metrics.iter() {
            self.push_digits(out, metrics.fixed(metric), self.digits_for(metric.max_fixed()));
            out.push(u32::from(metrics.get(metric).is_some()));
        }
    }

    /// A fitted ring's coordinates: each value clipped to [−c, c], times
    /// `steps` (w/W·s), rounded stochastically and without bias to an
    /// integer, reduced modulo 2^b.
    fn encode_fitted<R: CryptoRng + ?Sized>(
        &self,
        values: &[f32],
        clip: f64,
        steps: f64,
        rng: &mut R,
    ) -> Zeroizing<Vec<u32>> {
        let mask = ring_mask(self.modulus_bits);
        let mut out = Zeroizing::new(Vec::with_capacity(values.len() + self.tail_len()));
        out.resize(values.len(), 0);
        round_each(values, &mut out, rng, |value, uniform| {
            // Finite (checked by the caller); |position| ≤ 2^40, so its
            // truncation fits an i64, and one step down from it is the floor
            // of a negative position.
            let position = value.clamp(-clip, clip) * steps;
            let truncated = (position as i64) as f64;
            let floor = if truncated > position { truncated - 1.0 } else { truncated };
            let up = if uniform < position - floor { floor + 1.0 } else { floor };
            ((up as i64) as u64 & mask) as u32
        });
        out
    }

    /// Coordinates after the transformed update: the weight's digits and
    /// the metrics'.
    pub(crate) fn tail_len(&self) -> usize {
        self.weight_digits() + self.metric_coordinates()
    }

    /// Decodes the sum of `summands` encoded inputs of `dimension`-coordinate
    /// updates into the weighted mean.
    pub fn decode(
        &self,
        sum: &[u32],
        summands: u32,
        dimension: usize,
    ) -> Result<WeightedMean, QuantizeError> {
        if summands == 0 || summands > self.clients {
            return Err(QuantizeError::Summands { summands, max: self.clients });
        }
        if sum.len() != self.encoded_len(dimension) {
            return Err(QuantizeError::Length { expected: self.encoded_len(dimension), got: sum.len() });
        }
        if let (Some(privacy), Some(rotation)) = (&self.spec.privacy, self.rotation()) {
            if summands < privacy.noise_shares {
                return Err(QuantizeError::TooLittleNoise { summands, shares: privacy.noise_shares });
            }
            let mean = privacy.decode(&rotation, sum, summands, self.modulus_bits, dimension);
            return Ok(WeightedMean {
                mean,
                total_weight: u64::from(summands),
                metrics: MetricSums::default(),
                overflow: None,
            });
        }
        let (coordinates, rest) = sum.split_at(self.transformed_len(dimension));
        let (weight, mut rest) = rest.split_at(self.weight_digits());
        // Digit sums are below 2^b, so the totals are exact.
        let total_weight = self.digits_value(weight);
        let mut metrics = MetricSums::default();
        for metric in self.spec.metrics.iter() {
            let (digits, after) = rest.split_at(self.digits_for(metric.max_fixed()));
            let (presence, after) = after.split_at(1);
            rest = after;
            let value = crate::metrics::from_fixed(self.digits_value(digits));
            // More reporters than summands only comes from a client that
            // lied about itself; the statistic is then left out.
            if presence[0] <= summands {
                metrics.insert(metric, value, presence[0]);
            }
        }
        let total_weight = u64::try_from(total_weight).map_err(|_| QuantizeError::NoExamples)?;
        if total_weight == 0 {
            return Err(QuantizeError::NoExamples);
        }
        let factor = f64::from(self.spec.max_weight) / total_weight as f64;
        let mut overflow = None;
        let mean: Vec<f32> = if let Some(scale) = self.spec.scale {
            // Σ q_k ≡ s·Σ v_k (mod 2^b): lifted to (−2^(b−1), 2^(b−1)].
            let factor = factor / scale;
            let quarter = 1i64 << (self.modulus_bits - 2);
            let beyond = coordinates.iter().filter(|&&q| lift(q, self.modulus_bits).abs() > quarter).count();
            let safe = safe_scale(self.modulus_bits, self.clients, self.spec.clip).unwrap_or(0.0);
            overflow =
                Some(if scale <= safe { 0.0 } else { beyond as f64 / coordinates.len().max(1) as f64 });
            coordinates.iter().map(|&q| (lift(q, self.modulus_bits) as f64 * factor) as f32).collect()
        } else {
            let clip = f64::from(self.spec.clip);
            let from_unit = 2.0 * clip / self.levels as f64;
            let offset = f64::from(summands) * clip;
            // Σ v_k = Σ q_k · 2c / L − n·c, and v_k = (w_k / W) Δ_k.
            coordinates.iter().map(|&q| ((f64::from(q) * from_unit - offset) * factor) as f32).collect()
        };
        let mean = match (self.rotation(), self.sketch()) {
            (Some(rotation), _) => rotation.inverse(&mean, dimension),
            (_, Some((sketch, 0))) => sketch.estimate(&mean, dimension),
            (_, Some((sketch, top_k))) => sketch.top_k(&mean, dimension, top_k as usize),
            _ => mean,
        };
        Ok(WeightedMean { mean, total_weight, metrics, overflow })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::{Rng, SeedableRng};

    fn spec() -> QuantizationSpec {
        QuantizationSpec {
            clip: 1.0,
            max_weight: 1_000,
            transform: Transform::None,
            metrics: crate::MetricSet::NONE,
            privacy: None,
            validation: None,
            scale: None,
        }
    }

    /// Under validation: the default L2 clip (clip·√d) changes no update,
    /// however spiky; a tighter one scales the clipped update down; and
    /// every encoded vector, centred and doubled, is within the bound the
    /// round's proofs show, for the 8-bit and the 32-bit ring.
    #[test]
    fn the_l2_clip_scales_only_what_exceeds_it_and_the_bound_holds() {
        let d = 200;
        let mut rng = ChaCha20Rng::seed_from_u64(5);
        let spiky: Vec<f32> =
            (0..d).map(|i| if i % 7 == 0 { 40.0 } else { (i as f32 * 0.3).sin() }).collect();
        let validated = |l2_clip: f32| QuantizationSpec {
            validation: Some(NormCheck { l2_clip, dimension: d as u32 + 1 }),
            ..spec()
        };
        for (bits, clients) in [(18, 1000), (32, 10)] {
            let plain = Quantizer::new(spec(), bits, clients).unwrap();
            let default = Quantizer::new(validated((d as f32).sqrt()), bits, clients).unwrap();
            let a = plain.encode(&spiky, 700, &mut ChaCha20Rng::seed_from_u64(9)).unwrap();
            let b = default.encode(&spiky, 700, &mut ChaCha20Rng::seed_from_u64(9)).unwrap();
            assert_eq!(a.values(), b.values(), "the default clip changed an update");
            let tight = Quantizer::new(validated(2.0), bits, clients).unwrap();
            for _ in 0..20 {
                let update: Vec<f32> =
                    (0..d).map(|_| (rng.next_u32() as f32 / u32::MAX as f32) * 6.0 - 3.0).collect();
                for q in [&default, &tight] {
                    let encoded = q.encode(&update, 1000, &mut rng).unwrap();
                    let levels = q.levels() as i128;
                    let norm_sq: u128 = encoded
                        .values()
                        .iter()
                        .map(|&v| (2 * i128::from(v) - levels).unsigned_abs().pow(2))
                        .sum();
                    assert!(norm_sq <= q.norm_bound_sq().unwrap(), "{bits} bits: {norm_sq} over the bound");
                }
            }
            // The tight clip halves a vector twice its length (up to rounding).
            let long: Vec<f32> = vec![4.0 / (d as f32).sqrt(); d];
            let decoded = {
                let encoded = tight.encode(&long, 1000, &mut rng).unwrap();
                tight.decode(encoded.values(), 1, d).unwrap().mean
            };
            let norm = decoded.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
            assert!((norm - 2.0).abs() < 0.05, "{bits} bits: {norm}");
        }
    }

    #[test]
    fn weighted_mean_is_recovered_within_quantization_error() {
        let clients = 10u32;
        let q = Quantizer::new(spec(), 32, clients).unwrap();
        let mut rng = ChaCha20Rng::seed_from_u64(31);
        let updates: Vec<Vec<f32>> = (0..clients)
            .map(|k| (0..50).map(|i| ((k * 7 + i) as f32 * 0.13).sin() * 0.9).collect())
            .collect();
        let weights: Vec<u32> = (0..clients).map(|k| 10 + 37 * k).collect();
        let mut sum = vec![0u32; 51];
        for (update, &weight) in updates.iter().zip(&weights) {
            let encoded = q.encode(update, weight, &mut rng).unwrap();
            for (s, v) in sum.iter_mut().zip(encoded.values()) {
                *s = s.checked_add(*v).unwrap();
            }
        }
        let decoded = q.decode(&sum, clients, 50).unwrap();
        let total: u32 = weights.iter().sum();
        assert_eq!(decoded.total_weight, u64::from(total));
        for i in 0..50 {
            let expected: f64 =
                updates.iter().zip(&weights).map(|(u, &w)| f64::from(u[i]) * f64::from(w)).sum::<f64>()
                    / f64::from(total);
            assert!((f64::from(decoded.mean[i]) - expected).abs() < 1e-5, "coordinate {i}");
        }
    }

    #[test]
    fn headroom_prevents_wrapping_at_the_extremes() {
        let clients = 1_000u32;
        for bits in [16u8, 24, 32] {
            let spec = QuantizationSpec {
                clip: 2.0,
                max_weight: 1,
                transform: Transform::None,
                metrics: crate::MetricSet::NONE,
                privacy: None,
                validation: None,
                scale: None,
            };
            let q = Quantizer::new(spec, bits, clients).unwrap();
            let mut rng = ChaCha20Rng::seed_from_u64(u64::from(bits));
            let encoded = q.encode(&[2.0, 5.0, -9.0], 1, &mut rng).unwrap();
            let max = u64::from(*encoded.values().iter().max().unwrap());
            assert!(max * u64::from(clients) < 1u64 << bits);
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        let q = Quantizer::new(
            QuantizationSpec {
                clip: 1.0,
                max_weight: 1,
                transform: Transform::None,
                metrics: crate::MetricSet::NONE,
                privacy: None,
                validation: None,
                scale: None,
            },
            8,
            2,
        )
        .unwrap();
        let mut rng = ChaCha20Rng::seed_from_u64(33);
        // With 127 levels over [−1, 1], 0.003 falls between two levels.
        let trials = 20_000;
        let mut total = 0.0;
        for _ in 0..trials {
            let encoded = q.encode(&[0.003], 1, &mut rng).unwrap();
            let decoded = q.decode(encoded.values(), 1, 1).unwrap();
            total += f64::from(decoded.mean[0]);
        }
        assert!((total / f64::from(trials) - 0.003).abs() < 0.0005);
    }

    /// L = ⌊(2^b − 1) / n⌋, at known points: the bound is on 2^b − 1, so
    /// four clients in 8 bits get 63 (four times 64 would wrap to 0).
    #[test]
    fn levels_known_answers() {
        assert_eq!(levels(8, 4), 63);
        assert_eq!(levels(8, 5), 51);
        assert_eq!(levels(32, 1), u64::from(u32::MAX));
        assert_eq!(levels(3, 3), 2);
        assert_eq!(levels(0, 4), 0);
        assert_eq!(levels(33, 4), 0);
        assert_eq!(levels(8, 0), 0);
    }

    /// Each rule of the quantization settings at its boundary.
    #[test]
    fn quantization_settings_are_checked_at_their_boundaries() {
        let with = |clip: f32, transform: Transform| QuantizationSpec {
            clip,
            max_weight: 1,
            transform,
            metrics: crate::MetricSet::NONE,
            privacy: None,
            validation: None,
            scale: None,
        };
        let none = Transform::None;
        for clip in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert!(with(clip, none).validate(16, 4).is_err(), "clip {clip}");
        }
        assert_eq!(with(f32::MIN_POSITIVE, none).validate(16, 4), Ok(()));
        // ⌊7 / 3⌋ = 2 levels is the least that quantizes anything; ⌊7 / 4⌋ = 1 is refused.
        assert_eq!(with(1.0, none).validate(3, 3), Ok(()));
        assert!(with(1.0, none).validate(3, 4).is_err());
        assert!(QuantizationSpec { max_weight: 0, ..with(1.0, none) }.validate(16, 4).is_err());
        let sketch =
            |rows: u32, columns: u32| with(1.0, Transform::Sketch { rows, columns, top_k: 1, seed: [0; 32] });
        assert_eq!(sketch(MAX_SKETCH_ROWS, 4).validate(16, 4), Ok(()));
        assert_eq!(sketch(1, 1).validate(16, 4), Ok(()));
        for (rows, columns) in [(MAX_SKETCH_ROWS + 2, 4), (2, 4), (3, 0)] {
            assert!(sketch(rows, columns).validate(16, 4).is_err(), "{rows} × {columns}");
        }
        let max = crate::limits::MAX_VECTOR_LEN;
        assert_eq!(sketch(1, max).validate(16, 4), Ok(()));
        assert!(sketch(1, max + 1).validate(16, 4).is_err());
        assert!(sketch(3, max / 2).validate(16, 4).is_err());
        assert_eq!(sketch(3, max / 3).validate(16, 4), Ok(()));
    }

    #[test]
    fn bad_inputs_are_rejected() {
        let q = Quantizer::new(spec(), 32, 4).unwrap();
        let mut rng = ChaCha20Rng::seed_from_u64(34);
        assert_eq!(q.encode(&[f32::NAN], 1, &mut rng).err(), Some(QuantizeError::NonFinite(0)));
        assert_eq!(
            q.encode(&[0.0], 1_001, &mut rng).err(),
            Some(QuantizeError::WeightTooLarge { max: 1_000, got: 1_001 })
        );
        assert_eq!(q.decode(&[0, 0], 5, 1).err(), Some(QuantizeError::Summands { summands: 5, max: 4 }));
        assert_eq!(q.decode(&[0, 0], 1, 1).err(), Some(QuantizeError::NoExamples));
        assert!(matches!(q.decode(&[0, 0, 0], 1, 1), Err(QuantizeError::Length { .. })));
        assert!(
            Quantizer::new(
                QuantizationSpec {
                    clip: 1.0,
                    max_weight: 10,
                    transform: Transform::None,
                    metrics: crate::MetricSet::NONE,
                    privacy: None,
                    validation: None,
                    scale: None,
                },
                8,
                200
            )
            .is_err()
        );
        let bad_block = Transform::Rotate { block: 100, seed: [0; 32] };
        assert!(
            Quantizer::new(
                QuantizationSpec {
                    clip: 1.0,
                    max_weight: 1,
                    transform: bad_block,
                    metrics: crate::MetricSet::NONE,
                    privacy: None,
                    validation: None,
                    scale: None,
                },
                16,
                4
            )
            .is_err()
        );
        assert_eq!(Quantizer::new(spec(), 40, 4).err(), Some(ConfigError::BadModulusBits(40)));
    }

    /// Metrics travel as digits and a presence coordinate: the sum over
    /// the reporters is exact to the fixed-point resolution, and a metric
    /// some clients leave out is averaged over those that report it.
    #[test]
    fn metrics_decode_to_sums_over_their_reporters() {
        use crate::metrics::{Metric, MetricSet};
        let clients = 10u32;
        let bits = modulus_bits_for(8, clients).unwrap();
        let set: MetricSet = [Metric::TrainLoss, Metric::EvalAccuracy].into_iter().collect();
        let spec = QuantizationSpec { metrics: set, ..spec() };
        let q = Quantizer::new(spec, bits, clients).unwrap();
        // L = 409 in a 12-bit ring: 2^32 needs four base-410 digits, 2^20 three.
        assert_eq!(q.encoded_len(3), 3 + 2 + (4 + 1) + (3 + 1));
        let mut rng = ChaCha20Rng::seed_from_u64(5);
        let mut sum = vec![0u32; q.encoded_len(3)];
        let mut losses = 0.0;
        for k in 0..clients {
            let mut values = MetricValues::new();
            let loss = 0.25 + f64::from(k) * 0.3;
            losses += loss;
            values.set(Metric::TrainLoss, loss).unwrap();
            if k < 4 {
                values.set(Metric::EvalAccuracy, 0.5 + f64::from(k) * 0.1).unwrap();
            }
            values.set(Metric::GlobalLoss, 9.0).unwrap(); // no room: left out
            let encoded = q.encode_with_metrics(&[0.1, 0.2, 0.3], 700, &values, &mut rng).unwrap();
            for (s, v) in sum.iter_mut().zip(encoded.values()) {
                *s += v;
            }
        }
        let decoded = q.decode(&sum, clients, 3).unwrap();
        assert_eq!(decoded.total_weight, 7_000);
        let (loss_sum, reporters) = decoded.metrics.sum(Metric::TrainLoss).unwrap();
        assert_eq!(reporters, 10);
        assert!((loss_sum - losses).abs() < 1e-5, "{loss_sum} vs {losses}");
        let accuracy = decoded.metrics.mean(Metric::EvalAccuracy).unwrap();
        assert!((accuracy - 0.65).abs() < 1e-6, "{accuracy}");
        assert_eq!(decoded.metrics.sum(Metric::EvalAccuracy).map(|s| s.1), Some(4));
        assert_eq!(decoded.metrics.sum(Metric::GlobalLoss), None);
        assert!((decoded.mean[2] - 0.3).abs() < 0.01);
    }

    /// Sums at the top of every metric's range fit the ring's headroom.
    #[test]
    fn metrics_at_their_maximum_do_not_wrap() {
        use crate::metrics::{Metric, MetricSet};
        let clients = 1_000u32;
        for bits in [11u8, 16, 32] {
            let spec = QuantizationSpec { metrics: MetricSet::ALL, ..spec() };
            let q = Quantizer::new(spec, bits, clients).unwrap();
            let mut values = MetricValues::new();
            for metric in Metric::ALL {
                values.set(metric, metric.max()).unwrap();
            }
            let encoded =
                q.encode_with_metrics(&[0.0], 1, &values, &mut ChaCha20Rng::seed_from_u64(1)).unwrap();
            let max = u64::from(*encoded.values().iter().max().unwrap());
            assert!(max * u64::from(clients) < 1u64 << bits, "{bits} bits");
            let sum: Vec<u32> = encoded.values().iter().map(|v| v * clients).collect();
            let decoded = q.decode(&sum, clients, 1).unwrap();
            for metric in Metric::ALL {
                assert_eq!(decoded.metrics.mean(metric), Some(metric.max()), "{metric:?} in {bits} bits");
            }
        }
    }

    /// Sums `clients` encodings of `updates` with weights, as the server
    /// would after unmasking, and decodes them.
    fn aggregate(q: &Quantizer, updates: &[Vec<f32>], weights: &[u32], seed: u64) -> WeightedMean {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let mut sum = vec![0u64; q.encoded_len(updates[0].len())];
        for (update, &weight) in updates.iter().zip(weights) {
            let encoded = q.encode(update, weight, &mut rng).unwrap();
            assert_eq!(encoded.len(), sum.len());
            for (s, v) in sum.iter_mut().zip(encoded.values()) {
                *s += u64::from(*v);
            }
        }
        let sum: Vec<u32> = sum.into_iter().map(|s| u32::try_from(s).unwrap()).collect();
        q.decode(&sum, updates.len() as u32, updates[0].len()).unwrap()
    }

    fn mse(decoded: &[f32], updates: &[Vec<f32>], weights: &[u32]) -> f64 {
        let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        (0..decoded.len())
            .map(|i| {
                let exact: f64 =
                    updates.iter().zip(weights).map(|(u, &w)| f64::from(u[i]) * f64::from(w)).sum();
                (f64::from(decoded[i]) - exact / total).powi(2)
            })
            .sum::<f64>()
            / decoded.len() as f64
    }

    /// A rotated spec at a fitted ring's scale.
    fn fitted(scale: f64, max_weight: u32) -> QuantizationSpec {
        QuantizationSpec {
            clip: 1.0,
            max_weight,
            transform: Transform::Rotate { block: 64, seed: [4; 32] },
            scale: Some(scale),
            ..spec()
        }
    }

    /// The ring's sum of encodings, wrapping as the masks' sum does.
    fn ring_sum(q: &Quantizer, inputs: &[QuantizedInput], bits: u8) -> Vec<u32> {
        let mut sum = vec![0u32; inputs[0].len()];
        for input in inputs {
            for (s, v) in sum.iter_mut().zip(input.values()) {
                *s = s.wrapping_add(*v) & ring_mask(bits) as u32;
            }
        }
        assert_eq!(sum.len(), q.encoded_len(100));
        sum
    }

    #[test]
    fn lift_known_answers() {
        assert_eq!(lift(0, 9), 0);
        assert_eq!(lift(255, 9), 255);
        assert_eq!(lift(256, 9), 256);
        assert_eq!(lift(257, 9), -255);
        assert_eq!(lift(511, 9), -1);
        assert_eq!(lift(512 + 3, 9), 3, "bits above the ring are ignored");
        assert_eq!(lift(u32::MAX, 32), -1);
        assert_eq!(lift(1 << 31, 32), 1 << 31);
        // Bits outside the rings a round may have are taken to the nearest.
        assert_eq!(lift(3, 0), lift(3, 1));
        assert_eq!(lift(u32::MAX, 64), -1);
        let spread = SumSpread { blocks: vec![(8, 1.0)], summands: 1, measured_at: None };
        assert_eq!(spread.expected_wraps(1.0, 0, 1, 1.0), spread.expected_wraps(1.0, 1, 1, 1.0));
        assert_eq!(spread.expected_wraps(1.0, 64, 1, 1.0), spread.expected_wraps(1.0, 32, 1, 1.0));
    }

    /// A fitted ring decodes the weighted mean, the example count and the
    /// metrics exactly as the exact ring does while the sum stays within
    /// ±2^(b−1) steps, and a coordinate beyond it comes back 2^b/s lower:
    /// the wrap, and nothing else.
    #[test]
    fn a_fitted_ring_decodes_the_weighted_mean_and_wraps_beyond_half_the_ring() {
        let (bits, clients, d) = (9u8, 20u32, 100usize);
        let scale = 40.0;
        let q = Quantizer::new(
            QuantizationSpec { metrics: crate::MetricSet::ALL, ..fitted(scale, 64) },
            bits,
            clients,
        )
        .unwrap();
        let updates: Vec<Vec<f32>> = (0..clients)
            .map(|k| (0..d).map(|i| ((k * 13 + i as u32) as f32 * 0.37).sin() * 0.2).collect())
            .collect();
        let weights: Vec<u32> = (0..clients).map(|k| 1 + (k * 7) % 64).collect();
        let mut rng = ChaCha20Rng::seed_from_u64(3);
        let mut metrics = MetricValues::new();
        metrics.set(crate::Metric::TrainLoss, 0.5).unwrap();
        let inputs: Vec<QuantizedInput> = updates
            .iter()
            .zip(&weights)
            .map(|(u, &w)| q.encode_with_metrics(u, w, &metrics, &mut rng).unwrap())
            .collect();
        assert!(inputs.iter().flat_map(|i| i.values()).all(|&v| v < 1 << bits), "a value outside the ring");
        let decoded = q.decode(&ring_sum(&q, &inputs, bits), clients, d).unwrap();
        assert_eq!(decoded.total_weight, weights.iter().map(|&w| u64::from(w)).sum::<u64>());
        assert_eq!(decoded.metrics.mean(crate::Metric::TrainLoss), Some(0.5));
        // The rounding adds at most ¼ step² per input to the sum: its
        // error in the mean is about √n/2 steps times W/(s·Σw) per
        // coordinate, well within 5 such deviations.
        let tolerance =
            5.0 * (f64::from(clients)).sqrt() / 2.0 * 64.0 / (scale * decoded.total_weight as f64);
        let error = mse(&decoded.mean, &updates, &weights).sqrt();
        assert!(error < tolerance, "rms error {error} against {tolerance}");
        assert!(error > tolerance / 100.0, "no rounding at all: the test checks nothing");

        // Two inputs whose rotated coordinate 5 is 200 steps each: their
        // sum, 400, is past the ring's half (256), and that coordinate, and
        // only it, wraps to 400 − 512 = −112.
        let big = Quantizer::new(fitted(200.0, 1), bits, 2).unwrap();
        let mut rng = ChaCha20Rng::seed_from_u64(4);
        let x: Vec<f32> = vec![0.0; d];
        let a = big.encode(&x, 1, &mut rng).unwrap();
        assert!(a.values()[..d].iter().all(|&v| v == 0), "zero encodes as zero");
        let rotation = Rotation::new([4; 32], 64).unwrap();
        let mut target = vec![0.0f32; d];
        target[5] = 1.0; // rotated coordinate 5 is 1.0: 200 steps
        let input = rotation.inverse(&target, d);
        let b = big.encode(&input, 1, &mut rng).unwrap();
        let c = big.encode(&input, 1, &mut rng).unwrap();
        let sum: Vec<u32> =
            b.values().iter().zip(c.values()).map(|(x, y)| (x + y) & ring_mask(bits) as u32).collect();
        assert_eq!(lift(sum[5], bits), -112);
        let wrapped = big.decode(&sum, 2, d).unwrap();
        let rotated_back = rotation.forward(&wrapped.mean);
        assert!((rotated_back[5] - (-112.0 / 200.0 / 2.0)).abs() < 0.02, "{}", rotated_back[5]);
        for (i, v) in rotated_back.iter().enumerate().filter(|(i, _)| *i != 5) {
            assert!(v.abs() < 0.02, "coordinate {i} moved: {v}");
        }
    }

    /// The safe scale never wraps, whatever the inputs within the clip:
    /// `clients` inputs all at +c (or all at −c), at the largest weight.
    #[test]
    fn the_safe_scale_never_wraps_at_the_extremes() {
        for (bits, clients) in [(9u8, 100u32), (9, 2), (12, 1000), (32, 10_000)] {
            let scale = safe_scale(bits, clients, 0.5).unwrap();
            let q =
                Quantizer::new(QuantizationSpec { clip: 0.5, ..fitted(scale, 1) }, bits, clients).unwrap();
            let rotation = Rotation::new([4; 32], 64).unwrap();
            for sign in [1.0f32, -1.0] {
                // Every rotated coordinate at the clip (and beyond it).
                let input = rotation.inverse(&vec![sign * 0.9; 64], 64);
                let mut rng = ChaCha20Rng::seed_from_u64(u64::from(bits));
                let one = q.encode(&input, 1, &mut rng).unwrap();
                let total: i64 = (0..clients).map(|_| lift(one.values()[7], bits)).sum();
                assert!(total.abs() < 1 << (bits - 1), "{bits} bits, {clients} clients: {total}");
            }
        }
        assert_eq!(safe_scale(9, 255, 1.0), None, "less than one step per input");
        // The largest group a ring holds is the last with a safe scale.
        for bits in 2..=32u8 {
            let most = max_fitted_clients(bits);
            assert!(most == 0 || safe_scale(bits, most, 0.5).is_some(), "{bits} bits");
            assert_eq!(safe_scale(bits, most + 1, 0.5), None, "{bits} bits");
        }
        assert_eq!(max_fitted_clients(9), 127);
        assert!(safe_scale(9, 127, 1.0).is_some());
        assert_eq!(safe_scale(9, 128, 1.0), None);
        assert_eq!(safe_scale(9, 0, 1.0), None);
        assert_eq!(safe_scale(9, 10, 0.0), None);
    }

    /// The scale fitted to one round's sum keeps the next round's wraps
    /// near the target when the sum spreads as far: here 200 rounds of 50
    /// correlated Gaussian updates of 4096 coordinates, in blocks of
    /// unequal energy, whose fitted scale expects 0.5 wraps a round.
    #[test]
    fn a_scale_fitted_to_the_last_sum_wraps_about_as_often_as_it_expects() {
        let (bits, clients, d) = (9u8, 50u32, 4096usize);
        let mut rng = ChaCha20Rng::seed_from_u64(12);
        let mut gaussian = move || {
            let u = (f64::from(rng.next_u32()) + 0.5) / 4_294_967_296.0;
            let v = f64::from(rng.next_u32()) / 4_294_967_296.0;
            (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
        };
        // A shared direction and each client's own part; the second half
        // of the vector carries four times the energy of the first.
        let energy = |i: usize| if i < d / 2 { 0.01 } else { 0.04 };
        let shared: Vec<f64> = (0..d).map(|i| gaussian() * energy(i)).collect();
        let mut round = || -> Vec<Vec<f32>> {
            (0..clients)
                .map(|_| (0..d).map(|i| (shared[i] + gaussian() * energy(i)) as f32).collect())
                .collect()
        };
        let exact_sum = |updates: &[Vec<f32>]| -> Vec<f32> {
            (0..d).map(|i| updates.iter().map(|u| f64::from(u[i])).sum::<f64>() as f32).collect()
        };
        let first = round();
        let spread = SumSpread::of(&exact_sum(&first), 1024, clients).unwrap();
        let target = 0.5;
        let scale = spread.scale_for(bits, clients, 1.0, target, 1e9).unwrap();
        let expected = spread.expected_wraps(scale, bits, clients, 1.0);
        assert!((expected - target).abs() < 1e-6, "the bisection missed: {expected}");
        assert!(spread.expected_wraps(scale * 1.5, bits, clients, 1.0) > 10.0 * target);
        // The fitted scale is where the widest block just fits: well below
        // what the average block's spread would allow.
        let even = SumSpread {
            blocks: vec![(d as u32, spread.blocks.iter().map(|b| b.1).sum::<f64>() / 4.0)],
            summands: clients,
            measured_at: None,
        };
        assert!(even.scale_for(bits, clients, 1.0, target, 1e9).unwrap() > 1.2 * scale);

        let rotated_spec = |seed: u8| QuantizationSpec {
            transform: Transform::Rotate { block: 1024, seed: [seed; 32] },
            ..fitted(scale, 1)
        };
        let mut wraps = 0usize;
        let rounds = 200;
        for r in 0..rounds {
            let updates = round();
            let q = Quantizer::new(rotated_spec(r as u8), bits, clients).unwrap();
            let mut rng = ChaCha20Rng::seed_from_u64(r as u64);
            let mut exact = vec![0i64; d];
            for update in &updates {
                let encoded = q.encode(update, 1, &mut rng).unwrap();
                for (e, &v) in exact.iter_mut().zip(encoded.values()) {
                    *e += lift(v, bits);
                }
            }
            wraps += exact.iter().filter(|e| e.abs() > 1 << (bits - 1)).count();
        }
        // Expected 0.5 a round: 100 in 200 rounds, Poisson; far from 0
        // (the scale is not timid) and from 10× (the model holds).
        assert!((30..=250).contains(&wraps), "{wraps} wrapped coordinates in {rounds} rounds");
    }

    /// Without a sum to fit, the fitted scale is the safe one; with one,
    /// never below it.
    #[test]
    fn the_fitted_scale_falls_back_to_the_safe_one() {
        let safe = safe_scale(9, 100, 0.1).unwrap();
        assert_eq!(fitted_scale(None, 9, 100, 0.1), Some(safe));
        let huge = SumSpread { blocks: vec![(4096, 1e6)], summands: 100, measured_at: None };
        assert_eq!(fitted_scale(Some(&huge), 9, 100, 0.1), Some(safe));
        let small = SumSpread { blocks: vec![(4096, 1e-3)], summands: 100, measured_at: None };
        assert!(fitted_scale(Some(&small), 9, 100, 0.1).unwrap() > 100.0 * safe);
        let nothing = SumSpread { blocks: vec![(4096, 0.0)], summands: 100, measured_at: None };
        assert_eq!(fitted_scale(Some(&nothing), 9, 100, 0.1), Some(MAX_SCALED_CLIP / f64::from(0.1f32)));
        // Measured at a scale, the next is at most MAX_SCALE_STEP times it:
        // a sum that rounded to nothing does not send the scale to the top.
        let nothing = nothing.measured_at(Some(safe));
        assert_eq!(fitted_scale(Some(&nothing), 9, 100, 0.1), Some(MAX_SCALE_STEP * safe));
        let small = small.measured_at(Some(1e9));
        let unbounded = fitted_scale(Some(&small.clone().measured_at(None)), 9, 100, 0.1);
        assert_eq!(fitted_scale(Some(&small), 9, 100, 0.1), unbounded, "far below the step: no cap");
        // The widest of two spreads steps from the lower of their scales.
        let a = SumSpread { blocks: vec![(8, 1.0), (2, 3.0)], summands: 10, measured_at: Some(5.0) };
        let b = SumSpread { blocks: vec![(8, 2.0), (2, 1.0)], summands: 10, measured_at: Some(4.0) };
        assert_eq!(
            a.widest(&b),
            Some(SumSpread { blocks: vec![(8, 2.0), (2, 3.0)], summands: 10, measured_at: Some(4.0) })
        );
        assert_eq!(a.widest(&SumSpread { blocks: vec![(8, 1.0)], summands: 10, measured_at: None }), None);
        // A larger group's sum is expected to spread as its number, a smaller
        // one's as its square root; the widest of two groups is at the larger.
        assert_eq!(a.for_group(40).blocks, vec![(8, 4.0), (2, 12.0)]);
        assert_eq!(a.for_group(40).summands, 40);
        assert_eq!(a.for_group(10), a);
        let quarter = SumSpread { blocks: vec![(8, 4.0), (2, 4.0)], summands: 40, measured_at: None };
        assert_eq!(quarter.for_group(10).blocks, vec![(8, 2.0), (2, 2.0)]);
        assert_eq!(a.widest(&quarter).map(|w| (w.blocks, w.summands)), Some((vec![(8, 4.0), (2, 12.0)], 40)));
        // A round of groups of 10 after groups of 100: a scale fitted to the
        // larger sum scaled down linearly would wrap the smaller one.
        let big = SumSpread { blocks: vec![(4096, 0.05)], summands: 100, measured_at: None };
        let scale = fitted_scale(Some(&big), 9, 10, 0.1).unwrap();
        let wraps = big.for_group(10).expected_wraps(scale, 9, 10, SPREAD_GROWTH);
        assert!((wraps / (TARGET_WRAP_RATE * 4096.0) - 1.0).abs() < 1e-3, "{wraps}");
        let linear = SumSpread { blocks: vec![(4096, 0.005)], summands: 10, measured_at: None };
        assert!(linear.expected_wraps(scale, 9, 10, SPREAD_GROWTH) < 1e-6, "the square root errs wide");
    }

    /// A sum that wrapped throughout is told apart from one that fits its
    /// ring: at the safe scale nothing is counted, at a scale that fits
    /// about 0.3 % of the coordinates lie beyond half the ring, at 30 times
    /// that scale about half of them, past [`OVERFLOW_LIMIT`].
    #[test]
    fn a_sum_that_wrapped_throughout_is_told_apart() {
        let (bits, clients, d) = (9u8, 20u32, 4096usize);
        let mut rng = ChaCha20Rng::seed_from_u64(21);
        let updates: Vec<Vec<f32>> = (0..clients)
            .map(|k| (0..d).map(|i| ((k as usize * d + i) as f32 * 0.61).sin() * 0.01).collect())
            .collect();
        let sum_of = |scale: f64, rng: &mut ChaCha20Rng| {
            let q =
                Quantizer::new(QuantizationSpec { clip: 0.1, ..fitted(scale, 1) }, bits, clients).unwrap();
            let inputs: Vec<QuantizedInput> = updates.iter().map(|u| q.encode(u, 1, rng).unwrap()).collect();
            let mut sum = vec![0u32; q.encoded_len(d)];
            for input in &inputs {
                for (s, v) in sum.iter_mut().zip(input.values()) {
                    *s = s.wrapping_add(*v) & ring_mask(bits) as u32;
                }
            }
            let exact: Vec<f32> = (0..d).map(|i| updates.iter().map(|u| u[i]).sum()).collect();
            (q.decode(&sum, clients, d).unwrap(), exact)
        };
        let safe = safe_scale(bits, clients, 0.1).unwrap();
        let (at_safe, exact) = sum_of(safe, &mut rng);
        assert_eq!(at_safe.overflow, Some(0.0));
        let spread = SumSpread::of(&exact, 64, clients).unwrap();
        let scale = spread.scale_for(bits, clients, SPREAD_GROWTH, TARGET_WRAP_RATE * d as f64, 1e9).unwrap();
        assert!(scale > 4.0 * safe, "{scale} against {safe}");
        let (fits, _) = sum_of(scale, &mut rng);
        let fraction = fits.overflow.unwrap();
        assert!(fraction < 0.02 && !fits.overflowed(), "{fraction}");
        let (wrapped, _) = sum_of(30.0 * scale, &mut rng);
        let fraction = wrapped.overflow.unwrap();
        assert!(fraction > 0.3 && wrapped.overflowed(), "{fraction}");
        // The exact ring has nothing to tell.
        let exact_ring = Quantizer::new(spec(), 16, clients).unwrap();
        let encoded = exact_ring.encode(&updates[0][..8], 1, &mut rng).unwrap();
        assert_eq!(exact_ring.decode(encoded.values(), 1, 8).unwrap().overflow, None);
    }

    /// A fitted ring needs the rotation, a positive scale, and neither DP
    /// nor input validation.
    #[test]
    fn a_fitted_ring_is_checked() {
        assert_eq!(fitted(10.0, 1).validate(9, 100), Ok(()));
        for scale in [0.0, -1.0, f64::NAN, f64::INFINITY, 2e12, 1e-7, f64::MIN_POSITIVE] {
            assert!(fitted(scale, 1).validate(9, 100).is_err(), "scale {scale}");
        }
        assert_eq!(fitted(1e-6, 1).validate(9, 100), Ok(()));
        assert!(QuantizationSpec { transform: Transform::None, ..fitted(10.0, 1) }.validate(9, 100).is_err());
        let check = Some(NormCheck { l2_clip: 1.0, dimension: 10 });
        assert!(QuantizationSpec { validation: check, ..fitted(10.0, 1) }.validate(9, 100).is_err());
        // The exact tail still needs two levels: 9 bits carry 255 clients.
        assert_eq!(fitted(10.0, 1).validate(9, 255), Ok(()));
        assert!(fitted(10.0, 1).validate(9, 256).is_err());
    }

    #[test]
    fn ring_bits_leave_headroom_for_the_clients() {
        assert_eq!(modulus_bits_for(8, 10), Some(12));
        assert_eq!(modulus_bits_for(8, 16), Some(12));
        assert_eq!(modulus_bits_for(8, 17), Some(13));
        assert_eq!(modulus_bits_for(16, 1), Some(16));
        assert_eq!(modulus_bits_for(30, 10), None);
    }

    #[test]
    fn small_rings_carry_large_example_counts_exactly() {
        // 4-bit values for 10 clients: a 8-bit ring, L = 25, so counts up
        // to 10 000 need three base-26 digits.
        let (clients, bits) = (10u32, modulus_bits_for(4, 10).unwrap());
        let spec = QuantizationSpec {
            clip: 1.0,
            max_weight: 10_000,
            transform: Transform::None,
            metrics: crate::MetricSet::NONE,
            privacy: None,
            validation: None,
            scale: None,
        };
        let q = Quantizer::new(spec, bits, clients).unwrap();
        assert_eq!(q.encoded_len(5), 5 + 3);
        let updates: Vec<Vec<f32>> = (0..clients).map(|k| vec![0.5 - k as f32 * 0.1; 5]).collect();
        let weights: Vec<u32> = (0..clients).map(|k| 9_000 + 111 * k).collect();
        let decoded = aggregate(&q, &updates, &weights, 1);
        assert_eq!(decoded.total_weight, weights.iter().map(|&w| u64::from(w)).sum::<u64>());
    }

    #[test]
    fn rotation_decodes_to_the_mean_and_cuts_the_error_of_spiky_updates() {
        let clients = 10u32;
        let bits = modulus_bits_for(8, clients).unwrap();
        // Updates with a few large coordinates: the clip must cover them,
        // which wastes levels on the many small ones unless rotated.
        let updates: Vec<Vec<f32>> = (0..clients)
            .map(|k| {
                (0..2_048)
                    .map(|i| if i % 512 == 7 { 0.8 } else { ((k as f32 + i as f32) * 0.37).sin() * 0.01 })
                    .collect()
            })
            .collect();
        let weights = vec![100u32; clients as usize];
        let plain = QuantizationSpec {
            clip: 1.0,
            max_weight: 100,
            transform: Transform::None,
            metrics: crate::MetricSet::NONE,
            privacy: None,
            validation: None,
            scale: None,
        };
        let rotated = QuantizationSpec {
            clip: 0.2,
            max_weight: 100,
            transform: Transform::Rotate { block: 1_024, seed: [9; 32] },
            metrics: crate::MetricSet::NONE,
            privacy: None,
            validation: None,
            scale: None,
        };
        let a = aggregate(&Quantizer::new(plain, bits, clients).unwrap(), &updates, &weights, 2);
        let b = aggregate(&Quantizer::new(rotated, bits, clients).unwrap(), &updates, &weights, 2);
        assert_eq!(b.mean.len(), 2_048);
        let (error_plain, error_rotated) =
            (mse(&a.mean, &updates, &weights), mse(&b.mean, &updates, &weights));
        assert!(error_rotated < error_plain / 4.0, "rotated {error_rotated:e} vs plain {error_plain:e}");
    }

    #[test]
    fn a_sketched_update_decodes_to_estimates_of_the_mean() {
        let clients = 5u32;
        let mut updates = vec![vec![0.0f32; 10_000]; clients as usize];
        for (k, update) in updates.iter_mut().enumerate() {
            update[42] = 0.5 + k as f32 * 0.01;
            update[4_242] = -0.4;
        }
        let weights = vec![10u32; clients as usize];
        let transform = Transform::Sketch { rows: 5, columns: 500, top_k: 2, seed: [4; 32] };
        let spec = QuantizationSpec {
            clip: 1.0,
            max_weight: 10,
            transform,
            metrics: crate::MetricSet::NONE,
            privacy: None,
            validation: None,
            scale: None,
        };
        let q = Quantizer::new(spec, 32, clients).unwrap();
        assert_eq!(q.encoded_len(10_000), 2_500 + 1);
        let decoded = aggregate(&q, &updates, &weights, 3);
        assert!((decoded.mean[42] - 0.52).abs() < 1e-3, "{}", decoded.mean[42]);
        assert!((decoded.mean[4_242] + 0.4).abs() < 1e-3, "{}", decoded.mean[4_242]);
        assert_eq!(decoded.mean.iter().filter(|v| **v != 0.0).count(), 2);
        let even = Transform::Sketch { rows: 4, columns: 10, top_k: 0, seed: [0; 32] };
        assert!(
            Quantizer::new(
                QuantizationSpec {
                    clip: 1.0,
                    max_weight: 1,
                    transform: even,
                    metrics: crate::MetricSet::NONE,
                    privacy: None,
                    validation: None,
                    scale: None,
                },
                32,
                2
            )
            .is_err()
        );
    }
}
