//! Shamir t-of-n secret sharing of 32-byte secrets over the prime field
//! GF(2^61 − 1).
//!
//! A secret is split into eight 32-bit limbs; each limb is shared with its
//! own random polynomial of degree t − 1, so a share is the evaluation point
//! plus eight field elements. Any t shares with distinct points reconstruct
//! the secret; any t − 1 reveal nothing about it (each limb is perfectly
//! hidden). The Mersenne prime keeps multiplication to one 128-bit product
//! and a shift, and admits up to 2^61 − 2 shareholders.

use std::collections::HashMap;

use rand_core::CryptoRng;
use zeroize::{Zeroize, ZeroizeOnDrop};

use crate::error::CryptoError;
use crate::secret::Secret32;

/// The field modulus, the Mersenne prime 2^61 − 1.
pub const MODULUS: u64 = (1 << 61) - 1;

/// Number of field elements per share.
pub const LIMBS: usize = 8;

/// Encoded size of one share: the point (4 bytes) and the limbs (8 bytes each).
pub const SHARE_LEN: usize = 4 + 8 * LIMBS;

fn add(a: u64, b: u64) -> u64 {
    let sum = a + b;
    if sum >= MODULUS { sum - MODULUS } else { sum }
}

fn sub(a: u64, b: u64) -> u64 {
    if a >= b { a - b } else { a + MODULUS - b }
}

fn mul(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    // 2^61 ≡ 1 (mod p): fold the high bits onto the low ones.
    let low = (product as u64) & MODULUS;
    let high = (product >> 61) as u64;
    add(low, high)
}

fn pow(mut base: u64, mut exponent: u64) -> u64 {
    let mut result = 1;
    while exponent > 0 {
        if exponent & 1 == 1 {
            result = mul(result, base);
        }
        base = mul(base, base);
        exponent >>= 1;
    }
    result
}

fn inverse(a: u64) -> u64 {
    debug_assert!(a != 0);
    pow(a, MODULUS - 2)
}

fn random_element<R: CryptoRng + ?Sized>(rng: &mut R) -> u64 {
    loop {
        // Uniform in [0, 2^61); rejecting 2^61 − 1 leaves [0, p) uniform.
        let candidate = rng.next_u64() & MODULUS;
        if candidate != MODULUS {
            return candidate;
        }
    }
}

/// One share of a [`Secret32`]: the evaluation point and eight field elements.
///
/// Shares are secret: zeroized on drop, no `Debug`, no `Clone`.
#[derive(Zeroize, ZeroizeOnDrop)]
pub struct Share {
    x: u32,
    y: [u64; LIMBS],
}

impl Share {
    /// The evaluation point (the holder's client id).
    pub fn point(&self) -> u32 {
        self.x
    }

    /// Serialises the share as `x (u32 LE) ‖ y_0 … y_7 (u64 LE)`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.x.to_le_bytes());
        for limb in &self.y {
            out.extend_from_slice(&limb.to_le_bytes());
        }
    }

    /// Parses a share, rejecting a zero point and limbs outside the field.
    pub fn decode(bytes: &[u8; SHARE_LEN]) -> Option<Self> {
        let (point, limbs) = bytes.split_at(4);
        let x = u32::from_le_bytes(point.try_into().ok()?);
        if x == 0 {
            return None;
        }
        let mut share = Share { x, y: [0; LIMBS] };
        for (limb, chunk) in share.y.iter_mut().zip(limbs.chunks_exact(8)) {
            *limb = u64::from_le_bytes(chunk.try_into().ok()?);
            if *limb >= MODULUS {
                return None;
            }
        }
        Some(share)
    }
}

/// Splits `secret` into one share per point in `points`, any `threshold` of
/// which reconstruct it.
///
/// # Panics
/// If `threshold` is 0 or exceeds the number of points, or a point is 0 or
/// repeated: callers validate these against the round configuration first.
pub fn split<R: CryptoRng + ?Sized>(
    secret: &Secret32,
    threshold: usize,
    points: &[u32],
    rng: &mut R,
) -> Vec<Share> {
    assert!(threshold >= 1 && threshold <= points.len(), "invalid threshold");
    assert!(points.iter().all(|&x| x != 0), "share points must be non-zero");
    let mut coefficients = vec![[0u64; LIMBS]; threshold];
    for (limb, chunk) in secret.expose().chunks_exact(4).enumerate() {
        let mut word = [0u8; 4];
        word.copy_from_slice(chunk);
        coefficients[0][limb] = u64::from(u32::from_le_bytes(word));
        word.zeroize();
    }
    for row in coefficients.iter_mut().skip(1) {
        for coefficient in row.iter_mut() {
            *coefficient = random_element(rng);
        }
    }
    let shares = points
        .iter()
        .map(|&x| {
            let point = u64::from(x);
            let mut y = [0u64; LIMBS];
            for (limb, value) in y.iter_mut().enumerate() {
                // Horner's rule from the highest coefficient down.
                let mut acc = 0;
                for row in coefficients.iter().rev() {
                    acc = add(mul(acc, point), row[limb]);
                }
                *value = acc;
            }
            Share { x, y }
        })
        .collect();
    coefficients.zeroize();
    shares
}

/// Reconstructs secrets from shares, caching the Lagrange coefficients of
/// each distinct set of points (with the complete graph, most secrets are
/// reconstructed from the same survivors).
#[derive(Default)]
pub struct Reconstructor {
    coefficients: HashMap<Vec<u32>, Vec<u64>>,
}

impl Reconstructor {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reconstructs the secret from the first `threshold` shares with
    /// distinct points (in ascending point order). Fails with fewer than
    /// `threshold` distinct points or if the shares are inconsistent with a
    /// 32-byte secret.
    pub fn reconstruct(&mut self, shares: &[&Share], threshold: usize) -> Result<Secret32, CryptoError> {
        if threshold == 0 {
            return Err(CryptoError);
        }
        let mut chosen: Vec<&Share> = shares.to_vec();
        chosen.sort_by_key(|share| share.x);
        chosen.dedup_by_key(|share| share.x);
        if chosen.len() < threshold {
            return Err(CryptoError);
        }
        chosen.truncate(threshold);
        let points: Vec<u32> = chosen.iter().map(|share| share.x).collect();
        let lambdas = self.coefficients.entry(points).or_insert_with_key(|points| lagrange_at_zero(points));
        let mut bytes = [0u8; 32];
        for limb in 0..LIMBS {
            let mut value = 0;
            for (share, &lambda) in chosen.iter().zip(lambdas.iter()) {
                value = add(value, mul(share.y[limb], lambda));
            }
            let word = u32::try_from(value).map_err(|_| {
                bytes.zeroize();
                CryptoError
            })?;
            bytes[limb * 4..limb * 4 + 4].copy_from_slice(&word.to_le_bytes());
        }
        Ok(Secret32::from_bytes(&mut bytes))
    }
}

/// λ_i = Π_{j≠i} x_j / (x_j − x_i), the weights that evaluate the
/// interpolating polynomial at 0. Distinct non-zero points are assumed.
fn lagrange_at_zero(points: &[u32]) -> Vec<u64> {
    let xs: Vec<u64> = points.iter().map(|&x| u64::from(x)).collect();
    let numerator = xs.iter().fold(1, |acc, &x| mul(acc, x));
    let denominators: Vec<u64> = xs
        .iter()
        .enumerate()
        .map(|(i, &xi)| {
            let mut d = xi;
            for (j, &xj) in xs.iter().enumerate() {
                if i != j {
                    d = mul(d, sub(xj, xi));
                }
            }
            d
        })
        .collect();
    // Montgomery's trick: one inversion for all denominators.
    let mut prefix = Vec::with_capacity(denominators.len());
    let mut acc = 1;
    for &d in &denominators {
        prefix.push(acc);
        acc = mul(acc, d);
    }
    let mut inv = inverse(acc);
    let mut lambdas = vec![0; denominators.len()];
    for i in (0..denominators.len()).rev() {
        lambdas[i] = mul(numerator, mul(inv, prefix[i]));
        inv = mul(inv, denominators[i]);
    }
    lambdas
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    #[test]
    fn field_arithmetic() {
        assert_eq!(mul(MODULUS - 1, MODULUS - 1), 1);
        assert_eq!(add(MODULUS - 1, 1), 0);
        assert_eq!(sub(0, 1), MODULUS - 1);
        for a in [1u64, 2, 12345, MODULUS - 2] {
            assert_eq!(mul(a, inverse(a)), 1);
        }
    }

    #[test]
    fn share_encoding_round_trips_and_rejects_out_of_field_limbs() {
        let mut rng = ChaCha20Rng::seed_from_u64(21);
        let secret = Secret32::random(&mut rng);
        let shares = split(&secret, 2, &[1, 2, 3], &mut rng);
        let mut bytes = Vec::new();
        shares[1].encode_into(&mut bytes);
        let mut fixed: [u8; SHARE_LEN] = bytes.as_slice().try_into().unwrap();
        let decoded = Share::decode(&fixed).unwrap();
        assert_eq!(decoded.point(), 2);
        assert_eq!(decoded.y, shares[1].y);
        fixed[4..12].copy_from_slice(&MODULUS.to_le_bytes());
        assert!(Share::decode(&fixed).is_none());
        fixed[0..4].copy_from_slice(&0u32.to_le_bytes());
        assert!(Share::decode(&fixed).is_none());
    }

    #[test]
    fn altered_share_changes_or_rejects_the_secret() {
        let mut rng = ChaCha20Rng::seed_from_u64(22);
        let secret = Secret32::random(&mut rng);
        let mut shares = split(&secret, 3, &[1, 2, 3, 4], &mut rng);
        shares[0].y[0] = add(shares[0].y[0], 1);
        let refs: Vec<&Share> = shares.iter().collect();
        let result = Reconstructor::new().reconstruct(&refs, 3);
        assert!(result.map(|s| s != secret).unwrap_or(true));
    }
}
