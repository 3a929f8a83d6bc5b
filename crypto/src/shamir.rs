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
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

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
        let mut chosen = distinct_points(shares);
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

/// The outcome of [`Reconstructor::reconstruct_checked`].
pub struct Checked {
    /// The secret, which passed the caller's check.
    pub secret: Secret32,
    /// Points of the shares that disagree with it, ascending; empty when the
    /// first `threshold` shares already gave a secret that passed.
    pub faulty: Vec<u32>,
}

impl Reconstructor {
    /// Reconstructs a secret the caller can verify (against a commitment or
    /// a public key), correcting wrong shares when there are enough.
    ///
    /// The first `threshold` shares are tried first. If their secret fails
    /// `check`, the shares are decoded as a Reed–Solomon codeword (Gao's
    /// algorithm, limb by limb), which corrects up to ⌊(m − t) / 2⌋ wrong
    /// shares out of m; the decoded secret must pass `check` too, and the
    /// points whose shares disagree with the decoded polynomial are returned
    /// as `faulty`. Fails when no secret passes: too many wrong shares, or a
    /// dealer who shared something else than it committed to.
    pub fn reconstruct_checked(
        &mut self,
        shares: &[&Share],
        threshold: usize,
        check: impl Fn(&Secret32) -> bool,
    ) -> Result<Checked, CryptoError> {
        if let Ok(secret) = self.reconstruct(shares, threshold)
            && check(&secret)
        {
            return Ok(Checked { secret, faulty: Vec::new() });
        }
        let chosen = distinct_points(shares);
        // Correcting anything takes more than t shares; with exactly t the
        // first attempt already used them all.
        if threshold == 0 || chosen.len() <= threshold {
            return Err(CryptoError);
        }
        let xs: Vec<u64> = chosen.iter().map(|share| u64::from(share.x)).collect();
        let decoder = Decoder::new(&xs);
        let mut bytes = Zeroizing::new([0u8; 32]);
        let mut faulty = Vec::new();
        for limb in 0..LIMBS {
            let ys = Poly(chosen.iter().map(|share| share.y[limb]).collect());
            let f = decoder.decode(&ys.0, threshold).ok_or(CryptoError)?;
            let word = u32::try_from(f.coefficient(0)).map_err(|_| CryptoError)?;
            bytes[limb * 4..limb * 4 + 4].copy_from_slice(&word.to_le_bytes());
            faulty.extend(xs.iter().zip(&ys.0).filter(|&(&x, &y)| f.eval(x) != y).map(|(&x, _)| x as u32));
        }
        let secret = Secret32::from_bytes(&mut bytes);
        if !check(&secret) {
            return Err(CryptoError);
        }
        faulty.sort_unstable();
        faulty.dedup();
        Ok(Checked { secret, faulty })
    }
}

/// The shares in ascending point order, one per point (the first given).
fn distinct_points<'a>(shares: &[&'a Share]) -> Vec<&'a Share> {
    let mut chosen = shares.to_vec();
    chosen.sort_by_key(|share| share.x);
    chosen.dedup_by_key(|share| share.x);
    chosen
}

/// A polynomial over GF(p), coefficients from the constant term up, with no
/// trailing zeros (the zero polynomial is empty). Its coefficients derive
/// from shares, so it is wiped on drop.
#[derive(Zeroize, ZeroizeOnDrop)]
struct Poly(Vec<u64>);

impl Poly {
    fn trimmed(mut coefficients: Vec<u64>) -> Self {
        while coefficients.last() == Some(&0) {
            coefficients.pop();
        }
        Poly(coefficients)
    }

    /// The degree, with −1 for the zero polynomial.
    fn degree(&self) -> isize {
        self.0.len() as isize - 1
    }

    fn coefficient(&self, i: usize) -> u64 {
        self.0.get(i).copied().unwrap_or(0)
    }

    fn eval(&self, x: u64) -> u64 {
        self.0.iter().rev().fold(0, |acc, &c| add(mul(acc, x), c))
    }

    fn mul(&self, other: &Poly) -> Poly {
        let mut out = vec![0; (self.0.len() + other.0.len()).saturating_sub(1)];
        for (i, &a) in self.0.iter().enumerate() {
            for (j, &b) in other.0.iter().enumerate() {
                out[i + j] = add(out[i + j], mul(a, b));
            }
        }
        Poly::trimmed(out)
    }

    fn sub(&self, other: &Poly) -> Poly {
        let len = self.0.len().max(other.0.len());
        Poly::trimmed((0..len).map(|i| sub(self.coefficient(i), other.coefficient(i))).collect())
    }

    /// Quotient and remainder of the division by a non-zero `divisor`.
    fn div_rem(&self, divisor: &Poly) -> (Poly, Poly) {
        let d = divisor.0.len();
        debug_assert!(d > 0, "division by the zero polynomial");
        if self.0.len() < d {
            return (Poly(Vec::new()), Poly(self.0.clone()));
        }
        let lead = inverse(divisor.0[d - 1]);
        let mut rem = self.0.clone();
        let mut quotient = vec![0; rem.len() - d + 1];
        for i in (0..quotient.len()).rev() {
            let q = mul(rem[i + d - 1], lead);
            quotient[i] = q;
            for (j, &c) in divisor.0.iter().enumerate() {
                rem[i + j] = sub(rem[i + j], mul(q, c));
            }
        }
        // Every coefficient from d − 1 up is now exactly zero.
        (Poly::trimmed(quotient), Poly::trimmed(rem))
    }
}

/// Reed–Solomon decoding for one set of evaluation points (Gao, "A new
/// algorithm for decoding Reed–Solomon codes", 2003).
struct Decoder<'a> {
    xs: &'a [u64],
    /// g0 = Π (x − x_i).
    vanishing: Poly,
    /// w_i = 1 / Π_{j≠i} (x_i − x_j), the barycentric weights.
    weights: Vec<u64>,
}

impl<'a> Decoder<'a> {
    /// `xs` must be distinct.
    fn new(xs: &'a [u64]) -> Self {
        let mut vanishing = Poly(vec![1]);
        for &x in xs {
            vanishing = vanishing.mul(&Poly(vec![sub(0, x), 1]));
        }
        let denominators: Vec<u64> = xs
            .iter()
            .enumerate()
            .map(|(i, &xi)| {
                xs.iter().enumerate().filter(|&(j, _)| j != i).fold(1, |acc, (_, &xj)| mul(acc, sub(xi, xj)))
            })
            .collect();
        Self { xs, vanishing, weights: batch_inverse(&denominators) }
    }

    /// The polynomial through all the points (degree below their number).
    fn interpolate(&self, ys: &[u64]) -> Poly {
        let n = self.xs.len();
        let mut out = vec![0; n];
        let mut quotient = vec![0; n];
        for ((&x, &y), &w) in self.xs.iter().zip(ys).zip(&self.weights) {
            // g0 / (X − x) by synthetic division, scaled by y·w.
            let scale = mul(y, w);
            let mut carry = 0;
            for k in (0..n).rev() {
                carry = add(self.vanishing.0[k + 1], mul(carry, x));
                quotient[k] = carry;
            }
            for (o, &q) in out.iter_mut().zip(&quotient) {
                *o = add(*o, mul(q, scale));
            }
        }
        quotient.zeroize();
        Poly::trimmed(out)
    }

    /// The polynomial of degree below `k` that agrees with all but at most
    /// ⌊(n − k) / 2⌋ of the points, if there is one.
    fn decode(&self, ys: &[u64], k: usize) -> Option<Poly> {
        let n = self.xs.len();
        // Stop at the first remainder of degree below (n + k) / 2.
        let mut r0 = Poly(self.vanishing.0.clone());
        let mut r1 = self.interpolate(ys);
        let mut v0 = Poly(Vec::new());
        let mut v1 = Poly(vec![1]);
        while 2 * r1.degree() >= (n + k) as isize {
            let (q, r) = r0.div_rem(&r1);
            let v = v0.sub(&q.mul(&v1));
            r0 = core::mem::replace(&mut r1, r);
            v0 = core::mem::replace(&mut v1, v);
        }
        if v1.0.is_empty() {
            return None;
        }
        let (f, remainder) = r1.div_rem(&v1);
        (remainder.0.is_empty() && f.degree() < k as isize).then_some(f)
    }
}

/// Inverts every (non-zero) element with one field inversion (Montgomery's trick).
fn batch_inverse(values: &[u64]) -> Vec<u64> {
    let mut prefix = Vec::with_capacity(values.len());
    let mut acc = 1;
    for &v in values {
        prefix.push(acc);
        acc = mul(acc, v);
    }
    let mut inv = inverse(acc);
    let mut out = vec![0; values.len()];
    for i in (0..values.len()).rev() {
        out[i] = mul(inv, prefix[i]);
        inv = mul(inv, values[i]);
    }
    out
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
    batch_inverse(&denominators).into_iter().map(|inv| mul(numerator, inv)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::{Rng, SeedableRng};

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

    fn checked(shares: &[Share], threshold: usize, secret: &Secret32) -> Result<Checked, CryptoError> {
        let refs: Vec<&Share> = shares.iter().collect();
        Reconstructor::new().reconstruct_checked(&refs, threshold, |candidate| candidate == secret)
    }

    #[test]
    fn polynomial_arithmetic_known_answers() {
        // (x² + 2x + 3)(x + 4) = x³ + 6x² + 11x + 12
        let product = Poly(vec![3, 2, 1]).mul(&Poly(vec![4, 1]));
        assert_eq!(product.0, vec![12, 11, 6, 1]);
        let (q, r) = Poly(vec![13, 11, 6, 1]).div_rem(&Poly(vec![4, 1]));
        assert_eq!((q.0.clone(), r.0.clone()), (vec![3, 2, 1], vec![1]));
        // Equal degrees, and a dividend of lower degree than the divisor.
        let (q, r) = Poly(vec![3, 2]).div_rem(&Poly(vec![1, 1]));
        assert_eq!((q.0.clone(), r.0.clone()), (vec![2], vec![1]));
        let (q, r) = Poly(vec![5]).div_rem(&Poly(vec![1, 1]));
        assert_eq!((q.0.clone(), r.0.clone()), (vec![], vec![5]));
        assert_eq!(Poly(vec![]).mul(&Poly(vec![1, 2])).degree(), -1);
        assert_eq!(Poly(vec![5, 0, 0]).sub(&Poly(vec![5])).degree(), -1);
        assert_eq!(Poly(vec![1, 2, 3]).eval(MODULUS - 1), 2);
        // Through (1, 6), (2, 11), (3, 18): x² + 2x + 3.
        let decoder = Decoder::new(&[1, 2, 3]);
        assert_eq!(decoder.interpolate(&[6, 11, 18]).0, vec![3, 2, 1]);
    }

    /// The decoder returns a polynomial only when one of degree below k is
    /// within the correction bound: not for a word of degree exactly k, not
    /// for noise.
    #[test]
    fn the_decoder_refuses_words_it_cannot_explain() {
        let xs: Vec<u64> = (1..=9).collect();
        let decoder = Decoder::new(&xs);
        // 1 + x + x² + x³ has degree 3: no codeword of dimension 3 explains it.
        let cubic: Vec<u64> = xs.iter().map(|&x| Poly(vec![1, 1, 1, 1]).eval(x)).collect();
        assert!(decoder.decode(&cubic, 3).is_none());
        assert!(decoder.decode(&cubic, 4).is_some_and(|f| f.0 == vec![1, 1, 1, 1]));
        let mut rng = ChaCha20Rng::seed_from_u64(27);
        let noise: Vec<u64> = xs.iter().map(|_| random_element(&mut rng)).collect();
        assert!(decoder.decode(&noise, 3).is_none());
    }

    #[test]
    fn checked_reconstruction_names_every_wrong_share_it_can_correct() {
        let mut rng = ChaCha20Rng::seed_from_u64(23);
        for (holders, threshold) in [(5usize, 3usize), (9, 5), (12, 4), (40, 21), (101, 51)] {
            let correctable = (holders - threshold) / 2;
            for wrong in 0..=correctable {
                let secret = Secret32::random(&mut rng);
                let points: Vec<u32> = (1..=holders as u32).map(|x| 3 * x + 1).collect();
                let mut shares = split(&secret, threshold, &points, &mut rng);
                let mut holders_list: Vec<usize> = (0..holders).collect();
                let (bad, _) =
                    rand::seq::SliceRandom::partial_shuffle(&mut holders_list[..], &mut rng, wrong);
                for &i in bad.iter() {
                    // One limb or all of them, by any non-zero amount.
                    let limb = (rng.next_u64() % LIMBS as u64) as usize;
                    shares[i].y[limb] = add(shares[i].y[limb], 1 + rng.next_u64() % (MODULUS - 1));
                    if rng.next_u64() % 2 == 0 {
                        for y in &mut shares[i].y {
                            *y = random_element(&mut rng);
                        }
                    }
                }
                let result = checked(&shares, threshold, &secret).unwrap();
                assert!(result.secret == secret);
                let mut expected: Vec<u32> = bad.iter().map(|&i| points[i]).collect();
                expected.sort_unstable();
                // The fast path names nothing when the lowest t points are good.
                if expected.iter().any(|&x| x <= points[threshold - 1]) {
                    assert_eq!(result.faulty, expected, "{holders} holders, t = {threshold}, {wrong} wrong");
                } else {
                    assert!(result.faulty.is_empty());
                }
            }
        }
    }

    #[test]
    fn checked_reconstruction_fails_beyond_its_correction_bound() {
        let mut rng = ChaCha20Rng::seed_from_u64(24);
        let secret = Secret32::random(&mut rng);
        let points: Vec<u32> = (1..=9).collect();
        let mut shares = split(&secret, 5, &points, &mut rng);
        // (9 − 5) / 2 = 2 can be corrected; three cannot.
        for share in shares.iter_mut().take(3) {
            share.y[0] = add(share.y[0], 7);
        }
        assert!(checked(&shares, 5, &secret).is_err());
    }

    #[test]
    fn fewer_than_t_shares_reconstruct_nothing_even_unchecked() {
        let mut rng = ChaCha20Rng::seed_from_u64(26);
        let secret = Secret32::random(&mut rng);
        // Three shares of a degree-2 polynomial, offered as shares of a
        // 4-of-n secret: interpolating them would give a well-formed secret,
        // but fewer than t shares must give nothing.
        let shares = split(&secret, 3, &[1, 2, 3], &mut rng);
        let refs: Vec<&Share> = shares.iter().collect();
        assert!(Reconstructor::new().reconstruct_checked(&refs, 4, |_| true).is_err());
        assert!(Reconstructor::new().reconstruct_checked(&refs, 0, |_| true).is_err());
    }

    #[test]
    fn a_dealer_that_shared_another_secret_is_refused() {
        let mut rng = ChaCha20Rng::seed_from_u64(25);
        let committed = Secret32::random(&mut rng);
        let dealt = Secret32::random(&mut rng);
        let shares = split(&dealt, 3, &[1, 2, 3, 4, 5, 6, 7], &mut rng);
        assert!(checked(&shares, 3, &committed).is_err());
        // Shares from two polynomials, the lowest points on the wrong one:
        // neither is within the correction bound, so no secret passes.
        let mut mixed = split(&dealt, 3, &[1, 2, 3], &mut rng);
        mixed.extend(split(&committed, 3, &[4, 5, 6, 7], &mut rng));
        assert!(checked(&mixed, 3, &committed).is_err());
    }
}
