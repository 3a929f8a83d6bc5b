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
            if self.privacy.is_some() {
                return Err(ConfigError::BadQuantization(
                    "input validation does not yet bound the noise of differential privacy",
                ));
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
}

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
        self.transformed_len(dimension) + self.weight_digits() + self.metric_coordinates()
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
            let values = privacy.encode(&rotation, self.block(), update, self.modulus_bits, rng)?;
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
        // The rounding's random words are drawn 64 at a time (the same
        // words, in the same order, as one draw per coordinate), and each
        // coordinate is written in place: a loop without calls or pushes.
        let mut random = Zeroizing::new([0u8; 8 * ROUNDING_BATCH]);
        for (chunk, rounded) in values.chunks(ROUNDING_BATCH).zip(out.chunks_mut(ROUNDING_BATCH)) {
            let random = &mut random[..8 * chunk.len()];
            rng.fill_bytes(random);
            for ((&value, word), rounded) in chunk.iter().zip(random.chunks_exact(8)).zip(rounded) {
                // Finite (checked above), so plain comparisons clamp it.
                let value = f64::from(value);
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
                // baseline); it and the 53 random bits below fit an i64,
                // whose conversions are single instructions too.
                let floor = (position as i64) as f64;
                // 53 random bits give a uniform double in [0, 1).
                let bits = u64::from_le_bytes([
                    word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
                ]);
                let uniform = ((bits >> 11) as i64) as f64 * (1.0 / (1u64 << 53) as f64);
                let up = if uniform < position - floor { floor + 1.0 } else { floor };
                *rounded = (if up > levels { levels } else { up }) as u32;
            }
        }
        self.push_digits(&mut out, u64::from(weight), self.weight_digits());
        for metric in self.spec.metrics.iter() {
            self.push_digits(&mut out, metrics.fixed(metric), self.digits_for(metric.max_fixed()));
            out.push(u32::from(metrics.get(metric).is_some()));
        }
        Ok(QuantizedInput(out))
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
        let clip = f64::from(self.spec.clip);
        let from_unit = 2.0 * clip / self.levels as f64;
        let offset = f64::from(summands) * clip;
        // Σ v_k = Σ q_k · 2c / L − n·c, and v_k = (w_k / W) Δ_k.
        let factor = f64::from(self.spec.max_weight) / total_weight as f64;
        let mean: Vec<f32> =
            coordinates.iter().map(|&q| ((f64::from(q) * from_unit - offset) * factor) as f32).collect();
        let mean = match (self.rotation(), self.sketch()) {
            (Some(rotation), _) => rotation.inverse(&mean, dimension),
            (_, Some((sketch, 0))) => sketch.estimate(&mean, dimension),
            (_, Some((sketch, top_k))) => sketch.top_k(&mean, dimension, top_k as usize),
            _ => mean,
        };
        Ok(WeightedMean { mean, total_weight, metrics })
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
        };
        let rotated = QuantizationSpec {
            clip: 0.2,
            max_weight: 100,
            transform: Transform::Rotate { block: 1_024, seed: [9; 32] },
            metrics: crate::MetricSet::NONE,
            privacy: None,
            validation: None,
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
                },
                32,
                2
            )
            .is_err()
        );
    }
}
