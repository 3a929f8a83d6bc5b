//! A validated round's layout: what a client commits to and proves, and how
//! the blindings of its commitments ride in its masked vector.
//!
//! The masked vector of a validated round is the quantized vector (the part
//! that is committed and proven, [`NormCheck::dimension`] values in [0, L])
//! followed by a tail: each input row's blinding ρ_i ∈ Z_ℓ written as d-bit
//! digits, with 2^d − 1 ≤ L. The tail is masked with everything else, so
//! unmasking yields Σ_u of every digit, and Σ_k digitsum_k·2^(dk) mod ℓ is
//! Σ_u ρ_(u,i), without a second masking channel (the digits, like the
//! values, cannot overflow the ring's headroom).
//!
//! A client proves the norm of its vector centred and doubled: each value v
//! is read as 2v − L ([`crate::Quantizer::norm_bound_sq`]).

use curve25519_dalek::scalar::Scalar;

use super::{NormBound, ValidationError};
use crate::config::RoundConfig;
use crate::quantize::{NormCheck, QuantizationSpec, Quantizer};

/// Bits of a blinding (ℓ < 2^253).
const BLINDING_BITS: u32 = 253;

/// The validation of one round, as its config fixes it.
#[derive(Debug, Clone)]
pub struct RoundValidation {
    bound: NormBound,
    levels: u64,
    digit_bits: u32,
    private: Option<Private>,
}

/// A private round's validation: values are read as signed integers of the
/// ring, the bound is the sensitivity Δ₂, and the noise rides on edges
/// ([`super::noise`]).
#[derive(Debug, Clone, Copy)]
struct Private {
    modulus_bits: u8,
    edge_variance: f64,
}

impl RoundValidation {
    /// The validation `config` asks for (`None` when it asks for none).
    /// Derives the proof's generators: build it once per round.
    pub fn new(config: &RoundConfig) -> Result<Option<Self>, ValidationError> {
        if config.quantization.validation.is_none() {
            return Ok(None);
        }
        Self::new_for(&config.quantization, config.modulus_bits, config.clients).map(Some)
    }

    /// The validation of rounds quantized by `spec` in a ring of
    /// `modulus_bits` with `clients` clients (the spec must ask for one).
    pub fn new_for(spec: &QuantizationSpec, modulus_bits: u8, clients: u32) -> Result<Self, ValidationError> {
        let check = spec.validation.ok_or(ValidationError::Parameters("the round asks for no validation"))?;
        let quantizer = Quantizer::new(*spec, modulus_bits, clients)
            .map_err(|_| ValidationError::Parameters("the round's quantization is invalid"))?;
        match &spec.privacy {
            None => Self::for_quantizer(&quantizer, check),
            Some(privacy) => Self::private(privacy, check, modulus_bits, quantizer.levels()),
        }
    }

    /// Under differential privacy: the proof is of the rounded vector
    /// before its noise, ‖x‖₂² ≤ ⌊Δ₂²⌋ (the rounding is redrawn until it
    /// holds, [`crate::dp`]), and each of the [`super::noise::NOISE_EDGES`]
    /// edges carries an equal part of the client's noise. The quantizer
    /// (`QuantizationSpec::validate`) has refused any mechanism but Skellam.
    fn private(
        privacy: &crate::dp::DpParams,
        check: NormCheck,
        modulus_bits: u8,
        levels: u64,
    ) -> Result<Self, ValidationError> {
        let dimension = check.dimension as usize;
        let bound_sq = privacy.sensitivity(dimension).l2_squared_floor();
        if !(1..1u128 << 100).contains(&bound_sq) {
            return Err(ValidationError::Parameters("the sensitivity does not fit the proof"));
        }
        let digit_bits = 63 - (levels + 1).leading_zeros();
        if digit_bits == 0 {
            return Err(ValidationError::Parameters("the ring has no room for the blindings"));
        }
        let edge_variance = privacy.local_variance(dimension) / super::noise::NOISE_EDGES as f64;
        Ok(Self {
            bound: NormBound::new(dimension, bound_sq)?,
            levels,
            digit_bits,
            private: Some(Private { modulus_bits, edge_variance }),
        })
    }

    /// The variance of each noise edge's values, in a private round.
    pub fn edge_variance(&self) -> Option<f64> {
        self.private.map(|p| p.edge_variance)
    }

    fn for_quantizer(quantizer: &Quantizer, check: NormCheck) -> Result<Self, ValidationError> {
        let bound_sq = quantizer
            .norm_bound_sq()
            .ok_or(ValidationError::Parameters("the norm bound does not fit the proof"))?;
        let levels = quantizer.levels();
        let digit_bits = 63 - (levels + 1).leading_zeros();
        if digit_bits == 0 {
            return Err(ValidationError::Parameters("the ring has no room for the blindings"));
        }
        Ok(Self {
            bound: NormBound::new(check.dimension as usize, bound_sq)?,
            levels,
            digit_bits,
            private: None,
        })
    }

    /// The statement every client of the round proves.
    pub fn bound(&self) -> &NormBound {
        &self.bound
    }

    /// Coordinates of the committed, proven part.
    pub fn dimension(&self) -> usize {
        self.bound.dimension()
    }

    fn digits_per_blinding(&self) -> usize {
        BLINDING_BITS.div_ceil(self.digit_bits) as usize
    }

    /// Coordinates of the blindings' tail.
    pub fn tail_len(&self) -> usize {
        self.bound.input_rows() * self.digits_per_blinding()
    }

    /// The masked vector's length: the committed part and the tail.
    pub fn vector_len(&self) -> usize {
        self.dimension() + self.tail_len()
    }

    /// The proof's context: the round and the client.
    pub fn context(round: &crate::RoundContext, client: crate::ClientId) -> Vec<u8> {
        let mut context = round.0.to_vec();
        context.extend_from_slice(&client.get().to_le_bytes());
        context
    }

    /// A client's values as the proof sees them: centred and doubled,
    /// 2v − L; in a private round, the ring's values read as signed
    /// integers ([`crate::quantize::lift`]).
    pub fn centred(&self, values: &[u32]) -> Vec<i64> {
        if let Some(private) = self.private {
            return values.iter().map(|&v| crate::quantize::lift(v, private.modulus_bits)).collect();
        }
        let levels = self.levels as i64;
        values.iter().map(|&v| 2 * i64::from(v) - levels).collect()
    }

    /// The sum of `summands` clients' centred vectors from the sum of their
    /// values (read as integers below 2^b): 2·sum − summands·L; in a
    /// private round the sum read as signed integers (its noise is sized
    /// not to wrap, and a sum that wraps fails the sum check).
    pub fn centred_sum(&self, sum: &[u32], summands: usize) -> Vec<i128> {
        if let Some(private) = self.private {
            return sum.iter().map(|&s| i128::from(crate::quantize::lift(s, private.modulus_bits))).collect();
        }
        let offset = i128::from(self.levels) * summands as i128;
        sum.iter().map(|&s| 2 * i128::from(s) - offset).collect()
    }

    /// Appends the blindings' digits to a client's values.
    pub fn append_blindings(&self, values: &mut Vec<u32>, blindings: &[Scalar]) {
        let mask = (1u64 << self.digit_bits) - 1;
        for blinding in blindings {
            let bytes = blinding.to_bytes();
            for k in 0..self.digits_per_blinding() {
                let bit = k * self.digit_bits as usize;
                // Eight bytes from bit's byte cover any digit of up to 56 bits.
                let mut word = [0u8; 8];
                let from = bit / 8;
                let available = (32 - from).min(8);
                word[..available].copy_from_slice(&bytes[from..from + available]);
                values.push(((u64::from_le_bytes(word) >> (bit % 8)) & mask) as u32);
            }
        }
    }

    /// Σ_u ρ_(u,i) for every input row, from the unmasked tail.
    pub fn blinding_sums(&self, tail: &[u32]) -> Vec<Scalar> {
        let radix = Scalar::from(1u64 << self.digit_bits);
        tail.chunks(self.digits_per_blinding())
            .map(|digits| digits.iter().rev().fold(Scalar::ZERO, |acc, &d| acc * radix + Scalar::from(d)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validation::group::random_scalar;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    fn validation(modulus_bits: u8, clients: u32, dimension: u32) -> RoundValidation {
        let spec = QuantizationSpec {
            clip: 1.0,
            max_weight: 1,
            transform: crate::Transform::None,
            metrics: crate::MetricSet::NONE,
            privacy: None,
            validation: Some(NormCheck { l2_clip: 1.0, dimension }),
            scale: None,
        };
        let quantizer = Quantizer::new(spec, modulus_bits, clients).unwrap();
        RoundValidation::for_quantizer(&quantizer, spec.validation.unwrap()).unwrap()
    }

    #[test]
    fn blindings_summed_digit_by_digit_are_the_sum_of_the_blindings() {
        let mut rng = ChaCha20Rng::from_seed([3; 32]);
        for (bits, clients) in [(18, 1000), (32, 10), (12, 100), (4, 7)] {
            let v = validation(bits, clients, 100);
            let blindings: Vec<Vec<Scalar>> = (0..clients.min(50))
                .map(|_| (0..v.bound.input_rows()).map(|_| random_scalar(&mut rng)).collect())
                .collect();
            let mut sum = vec![0u32; v.tail_len()];
            for own in &blindings {
                let mut tail = Vec::new();
                v.append_blindings(&mut tail, own);
                assert_eq!(tail.len(), v.tail_len());
                assert!(tail.iter().all(|&d| u64::from(d) <= v.levels), "a digit exceeds L");
                sum.iter_mut().zip(&tail).for_each(|(s, d)| *s += d);
            }
            let expected: Vec<Scalar> =
                (0..v.bound.input_rows()).map(|i| blindings.iter().map(|b| b[i]).sum()).collect();
            assert_eq!(v.blinding_sums(&sum), expected, "{bits} bits, {clients} clients");
        }
    }

    #[test]
    fn centring_the_sum_is_the_sum_of_the_centred_values() {
        let v = validation(18, 1000, 3);
        let a = [0u32, 7, v.levels as u32];
        let b = [5u32, 0, 1];
        let sum: Vec<u32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let expected: Vec<i128> =
            v.centred(&a).iter().zip(v.centred(&b)).map(|(x, y)| i128::from(x + y)).collect();
        assert_eq!(v.centred_sum(&sum, 2), expected);
    }
}
