//! Group plumbing for the norm proof: generators, the Fiat–Shamir transcript,
//! multilinear tables, a multiscalar multiplication for small integers, and
//! an accumulator that checks many group equations as one.

use curve25519_dalek::ristretto::{CompressedRistretto, RistrettoPoint};
use curve25519_dalek::scalar::Scalar;
use curve25519_dalek::traits::{Identity, VartimeMultiscalarMul};
use merlin::Transcript;
use rand_core::CryptoRng;

use super::ValidationError;

/// Independent generators: one per column, H for blindings, V for committed
/// scalars. Each is SHA-512 of a label and its index mapped to the group
/// (`RistrettoPoint::from_uniform_bytes`), so nobody knows a discrete
/// logarithm between any two.
pub(crate) struct Generators {
    pub columns: Vec<RistrettoPoint>,
    pub h: RistrettoPoint,
    pub v: RistrettoPoint,
}

impl Generators {
    /// The generators for `columns`, derived once per process and size
    /// (they are public and fixed).
    pub fn cached(columns: usize) -> std::sync::Arc<Self> {
        use std::collections::BTreeMap;
        use std::sync::{Arc, Mutex, OnceLock};
        static CACHE: OnceLock<Mutex<BTreeMap<usize, Arc<Generators>>>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(BTreeMap::new()));
        let mut cache = match cache.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        Arc::clone(cache.entry(columns).or_insert_with(|| Arc::new(Self::new(columns))))
    }

    pub fn new(columns: usize) -> Self {
        let point = |kind: &[u8], index: u64| {
            let mut input = b"cohort/validation/v1/generator/".to_vec();
            input.extend_from_slice(kind);
            input.extend_from_slice(&index.to_le_bytes());
            let digest = ring::digest::digest(&ring::digest::SHA512, &input);
            let mut bytes = [0u8; 64];
            bytes.copy_from_slice(digest.as_ref());
            RistrettoPoint::from_uniform_bytes(&bytes)
        };
        Self {
            columns: (0..columns as u64).map(|j| point(b"column", j)).collect(),
            h: point(b"blinding", 0),
            v: point(b"value", 0),
        }
    }
}

/// The proof's transcript (merlin's STROBE construction).
pub(crate) struct Fiat(Transcript);

impl Fiat {
    pub fn new(label: &'static [u8]) -> Self {
        Self(Transcript::new(label))
    }

    pub fn bytes(&mut self, label: &'static [u8], bytes: &[u8]) {
        self.0.append_message(label, bytes);
    }

    pub fn u64(&mut self, label: &'static [u8], value: u64) {
        self.0.append_u64(label, value);
    }

    pub fn point(&mut self, label: &'static [u8], point: &CompressedRistretto) {
        self.0.append_message(label, point.as_bytes());
    }

    pub fn scalar(&mut self, label: &'static [u8], scalar: &Scalar) {
        self.0.append_message(label, scalar.as_bytes());
    }

    pub fn challenge(&mut self, label: &'static [u8]) -> Scalar {
        let mut wide = [0u8; 64];
        self.0.challenge_bytes(label, &mut wide);
        Scalar::from_bytes_mod_order_wide(&wide)
    }

    /// A non-zero challenge (for the inner-product rounds, which invert it).
    pub fn nonzero_challenge(&mut self, label: &'static [u8]) -> Scalar {
        loop {
            let c = self.challenge(label);
            if c != Scalar::ZERO {
                return c;
            }
        }
    }

    pub fn seed(&mut self, label: &'static [u8]) -> [u8; 32] {
        let mut seed = [0u8; 32];
        self.0.challenge_bytes(label, &mut seed);
        seed
    }
}

pub(crate) fn random_scalar<R: CryptoRng + ?Sized>(rng: &mut R) -> Scalar {
    let mut wide = [0u8; 64];
    rng.fill_bytes(&mut wide);
    Scalar::from_bytes_mod_order_wide(&wide)
}

/// An integer as a field element.
pub(crate) fn scalar_i128(value: i128) -> Scalar {
    let magnitude = Scalar::from(value.unsigned_abs());
    if value < 0 { -magnitude } else { magnitude }
}

/// eq(r, b) for every b in {0,1}^len(r), the first variable the lowest bit:
/// the weights with which a multilinear extension is evaluated at r.
pub(crate) fn eq_table(r: &[Scalar]) -> Vec<Scalar> {
    let mut table = Vec::with_capacity(1 << r.len());
    table.push(Scalar::ONE);
    for (k, rk) in r.iter().enumerate() {
        let half = 1usize << k;
        let one_minus = Scalar::ONE - rk;
        for idx in 0..half {
            let value = table[idx];
            table.push(value * rk);
            table[idx] = value * one_minus;
        }
        debug_assert_eq!(table.len(), half * 2);
    }
    table
}

/// Σ v_j·P_j for small integers v_j: each point is added once into the bucket
/// of |v_j| (negated for negative v_j), and the buckets are summed by running
/// sums, about n + 2·max|v| additions instead of a 253-bit multiplication per
/// point. Falls back to Straus/Pippenger for large values. Variable time in
/// the values (see the module's note on side channels).
pub(crate) fn small_msm(values: &[i128], points: &[RistrettoPoint]) -> RistrettoPoint {
    const BUCKETS: u128 = 1 << 12;
    debug_assert_eq!(values.len(), points.len());
    let max = values.iter().map(|v| v.unsigned_abs()).max().unwrap_or(0);
    if max >= BUCKETS {
        // A negative value as a scalar is ℓ − |v|, 253 bits wide: negate the
        // point instead, so that every scalar stays as short as |v| and
        // Pippenger's windows above it are empty.
        let signed: Vec<RistrettoPoint> =
            values.iter().zip(points).map(|(&v, p)| if v < 0 { -p } else { *p }).collect();
        return RistrettoPoint::vartime_multiscalar_mul(
            values.iter().map(|v| Scalar::from(v.unsigned_abs())),
            &signed,
        );
    }
    let mut buckets = vec![RistrettoPoint::identity(); max as usize + 1];
    for (&value, point) in values.iter().zip(points) {
        match value {
            0 => {}
            v if v > 0 => buckets[v as usize] += point,
            v => buckets[v.unsigned_abs() as usize] -= point,
        }
    }
    let mut running = RistrettoPoint::identity();
    let mut total = RistrettoPoint::identity();
    for bucket in buckets.iter().skip(1).rev() {
        running += bucket;
        total += &running;
    }
    total
}

/// Group equations Σ s_i·P_i = 0, each scaled by a fresh random weight and
/// summed, checked with one multiscalar multiplication. A false equation
/// survives only if the weights cancel it, with probability 1/ℓ. The
/// generators' coefficients are merged across equations and proofs.
pub(crate) struct Equations {
    pub columns: Vec<Scalar>,
    pub h: Scalar,
    pub v: Scalar,
    scalars: Vec<Scalar>,
    points: Vec<RistrettoPoint>,
}

impl Equations {
    pub fn new(columns: usize) -> Self {
        Self {
            columns: vec![Scalar::ZERO; columns],
            h: Scalar::ZERO,
            v: Scalar::ZERO,
            scalars: Vec::new(),
            points: Vec::new(),
        }
    }

    pub fn term(&mut self, scalar: Scalar, point: RistrettoPoint) {
        self.scalars.push(scalar);
        self.points.push(point);
    }

    /// Adds another set of equations (another proof's).
    pub fn absorb(&mut self, other: &Equations) {
        self.columns.iter_mut().zip(&other.columns).for_each(|(a, b)| *a += b);
        self.h += other.h;
        self.v += other.v;
        self.scalars.extend_from_slice(&other.scalars);
        self.points.extend_from_slice(&other.points);
    }

    /// Whether every equation added holds (with overwhelming probability).
    pub fn hold(self, generators: &Generators) -> bool {
        let scalars = self.columns.iter().chain([&self.h, &self.v]).chain(&self.scalars);
        let points = generators.columns.iter().chain([&generators.h, &generators.v]).chain(&self.points);
        RistrettoPoint::vartime_multiscalar_mul(scalars, points) == RistrettoPoint::identity()
    }
}

pub(crate) fn decompress(point: &CompressedRistretto) -> Result<RistrettoPoint, ValidationError> {
    point.decompress().ok_or(ValidationError::Malformed("a group element does not decode"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::{Rng, SeedableRng};

    #[test]
    fn small_msm_equals_the_general_multiplication() {
        let mut rng = ChaCha20Rng::from_seed([7; 32]);
        let generators = Generators::new(64);
        for scale in [1i128, 5, 300, 4095, 4096, 1 << 40] {
            let values: Vec<i128> =
                (0..64).map(|_| (rng.next_u64() as i128 % (2 * scale + 1)) - scale).collect();
            let expected = RistrettoPoint::vartime_multiscalar_mul(
                values.iter().map(|&v| scalar_i128(v)),
                &generators.columns,
            );
            assert_eq!(small_msm(&values, &generators.columns), expected, "scale {scale}");
        }
        assert_eq!(small_msm(&[0; 4], &generators.columns[..4]), RistrettoPoint::identity());
    }

    #[test]
    fn eq_table_evaluates_the_multilinear_extension() {
        // f̃(r) = Σ_b f(b)·eq(r, b) agrees with f on the cube, and with a
        // direct evaluation off it: f = b0 + 2·b1 + 4·b0·b1 extends to itself.
        let r = [Scalar::from(3u8), Scalar::from(5u8)];
        let table = eq_table(&r);
        let f = [0u64, 1, 2, 7];
        let value: Scalar = table.iter().zip(f).map(|(w, f)| w * Scalar::from(f)).sum();
        assert_eq!(value, Scalar::from(3u8 + 10 + 60));
        let cube = eq_table(&[Scalar::ONE, Scalar::ZERO]);
        assert_eq!(cube, vec![Scalar::ZERO, Scalar::ONE, Scalar::ZERO, Scalar::ZERO]);
    }

    #[test]
    fn generators_are_distinct_and_fixed() {
        let a = Generators::new(8);
        let b = Generators::new(16);
        assert_eq!(a.columns[..], b.columns[..8]);
        let mut all: Vec<_> = b.columns.iter().chain([&b.h, &b.v]).map(|p| p.compress().to_bytes()).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 18);
    }
}
