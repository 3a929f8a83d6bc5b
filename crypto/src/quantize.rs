//! Fixed-point quantization of model updates into the ring Z_{2^b}, with
//! room for the sum of n inputs and the example count as an extra coordinate.
//!
//! Encoding, for an update Δ with example count w (at most `max_weight` W):
//! 1. clip every coordinate to [−c, c];
//! 2. scale by w / W, so that the sum of inputs is Σ w_k Δ_k / W;
//! 3. map [−c, c] affinely onto [0, L] with L = ⌊(2^b − 1) / n⌋ and round
//!    stochastically (up with probability equal to the fractional part, so the
//!    rounding is unbiased);
//! 4. append w itself (exact, at most W ≤ L) as the last coordinate.
//!
//! Every coordinate lies in [0, L], so the sum of up to n inputs stays below
//! 2^b: it never wraps, and the server decodes the weighted mean
//! Σ w_k Δ_k / Σ w_k without ever seeing a single w_k.

use rand_core::CryptoRng;
use zeroize::Zeroizing;

use crate::error::ConfigError;

/// Quantization parameters (part of the round configuration).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantizationSpec {
    /// Coordinates are clipped to [−clip, clip].
    pub clip: f32,
    /// Largest example count a client may report (W).
    pub max_weight: u32,
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
        let levels = levels(modulus_bits, clients);
        if levels < 2 {
            return Err(ConfigError::BadQuantization("the ring is too small for this many clients"));
        }
        if self.max_weight == 0 || u64::from(self.max_weight) > levels {
            return Err(ConfigError::BadQuantization(
                "max_weight must be between 1 and (2^bits - 1) / clients",
            ));
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

/// Why an update could not be quantized or a sum decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QuantizeError {
    /// The update contains NaN or an infinity.
    #[error("update contains a non-finite value at coordinate {0}")]
    NonFinite(usize),
    /// The example count exceeds the round's `max_weight`.
    #[error("example count {got} exceeds the round's maximum of {max}")]
    WeightTooLarge {
        /// The round's maximum.
        max: u32,
        /// The reported count.
        got: u32,
    },
    /// The vector has the wrong length.
    #[error("expected {expected} coordinates, got {got}")]
    Length {
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// More summands than the headroom was sized for, or none.
    #[error("cannot decode a sum of {summands} inputs (headroom is for 1..={max})")]
    Summands {
        /// Inputs in the sum.
        summands: u32,
        /// The headroom.
        max: u32,
    },
    /// The summed example count is zero: there is nothing to average.
    #[error("the aggregate carries no examples")]
    NoExamples,
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

    pub(crate) fn values(&self) -> &[u32] {
        &self.0
    }
}

/// The decoded aggregate: the weighted mean update and the total weight.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightedMean {
    /// Σ w_k Δ_k / Σ w_k, per coordinate.
    pub mean: Vec<f32>,
    /// Σ w_k.
    pub total_weight: u64,
}

/// Quantizes updates for one round and decodes the aggregate.
#[derive(Debug, Clone, Copy)]
pub struct Quantizer {
    spec: QuantizationSpec,
    clients: u32,
    levels: u64,
}

impl Quantizer {
    /// A quantizer for `clients` summands in Z_{2^modulus_bits}.
    pub fn new(spec: QuantizationSpec, modulus_bits: u8, clients: u32) -> Result<Self, ConfigError> {
        spec.validate(modulus_bits, clients)?;
        Ok(Self { spec, clients, levels: levels(modulus_bits, clients) })
    }

    /// Length of an encoded vector for an update of `dimension` coordinates.
    pub fn encoded_len(dimension: usize) -> usize {
        dimension + 1
    }

    /// Largest value of any encoded coordinate (L).
    pub fn max_value(&self) -> u64 {
        self.levels
    }

    /// Quantizes `update` with example count `weight`.
    pub fn encode<R: CryptoRng + ?Sized>(
        &self,
        update: &[f32],
        weight: u32,
        rng: &mut R,
    ) -> Result<QuantizedInput, QuantizeError> {
        if weight > self.spec.max_weight {
            return Err(QuantizeError::WeightTooLarge { max: self.spec.max_weight, got: weight });
        }
        if let Some(bad) = update.iter().position(|v| !v.is_finite()) {
            return Err(QuantizeError::NonFinite(bad));
        }
        let clip = f64::from(self.spec.clip);
        let scale = f64::from(weight) / f64::from(self.spec.max_weight);
        let levels = self.levels as f64;
        let to_unit = levels / (2.0 * clip);
        let mut out = Zeroizing::new(Vec::with_capacity(update.len() + 1));
        for &value in update {
            let scaled = f64::from(value).clamp(-clip, clip) * scale;
            let position = ((scaled + clip) * to_unit).clamp(0.0, levels);
            let floor = position.floor();
            // 53 random bits give a uniform double in [0, 1).
            let uniform = (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
            let rounded = if uniform < position - floor { floor + 1.0 } else { floor };
            out.push(rounded.min(levels) as u32);
        }
        out.push(weight);
        Ok(QuantizedInput(out))
    }

    /// Decodes the sum of `summands` encoded inputs into the weighted mean.
    pub fn decode(&self, sum: &[u32], summands: u32) -> Result<WeightedMean, QuantizeError> {
        if summands == 0 || summands > self.clients {
            return Err(QuantizeError::Summands { summands, max: self.clients });
        }
        let Some((&total_weight, coordinates)) = sum.split_last() else {
            return Err(QuantizeError::Length { expected: 1, got: 0 });
        };
        if total_weight == 0 {
            return Err(QuantizeError::NoExamples);
        }
        let clip = f64::from(self.spec.clip);
        let from_unit = 2.0 * clip / self.levels as f64;
        let offset = f64::from(summands) * clip;
        // Σ v_k = Σ q_k · 2c / L − n·c, and v_k = (w_k / W) Δ_k.
        let factor = f64::from(self.spec.max_weight) / f64::from(total_weight);
        let mean =
            coordinates.iter().map(|&q| ((f64::from(q) * from_unit - offset) * factor) as f32).collect();
        Ok(WeightedMean { mean, total_weight: u64::from(total_weight) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    fn spec() -> QuantizationSpec {
        QuantizationSpec { clip: 1.0, max_weight: 1_000 }
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
        let decoded = q.decode(&sum, clients).unwrap();
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
            let spec = QuantizationSpec { clip: 2.0, max_weight: 1 };
            let q = Quantizer::new(spec, bits, clients).unwrap();
            let mut rng = ChaCha20Rng::seed_from_u64(u64::from(bits));
            let encoded = q.encode(&[2.0, 5.0, -9.0], 1, &mut rng).unwrap();
            let max = u64::from(*encoded.values().iter().max().unwrap());
            assert!(max * u64::from(clients) < 1u64 << bits);
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        let q = Quantizer::new(QuantizationSpec { clip: 1.0, max_weight: 1 }, 8, 2).unwrap();
        let mut rng = ChaCha20Rng::seed_from_u64(33);
        // With 127 levels over [−1, 1], 0.003 falls between two levels.
        let trials = 20_000;
        let mut total = 0.0;
        for _ in 0..trials {
            let encoded = q.encode(&[0.003], 1, &mut rng).unwrap();
            let decoded = q.decode(encoded.values(), 1).unwrap();
            total += f64::from(decoded.mean[0]);
        }
        assert!((total / f64::from(trials) - 0.003).abs() < 0.0005);
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
        assert_eq!(q.decode(&[0, 0], 5).err(), Some(QuantizeError::Summands { summands: 5, max: 4 }));
        assert_eq!(q.decode(&[0, 0], 1).err(), Some(QuantizeError::NoExamples));
        assert!(Quantizer::new(QuantizationSpec { clip: 1.0, max_weight: 10 }, 8, 100).is_err());
        assert_eq!(Quantizer::new(spec(), 40, 4).err(), Some(ConfigError::BadModulusBits(40)));
    }
}
