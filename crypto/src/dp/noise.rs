//! Integer noise samplers: Skellam and the discrete Gaussian.
//!
//! Both draw every random bit from the client's cryptographic generator.
//! Acceptance tests compare a uniform double (53 bits) against a double
//! computed with `exp`; exact rational samplers would remove the last
//! floating-point doubt (Canonne, Kamath and Steinke, 2020, Section 5), at a
//! large cost per coordinate. `docs/THREAT_MODEL.md` states this.

use rand_core::CryptoRng;
use rand_distr::{Distribution, Poisson};

use super::uniform;

/// Largest Poisson mean drawn; a Skellam variance above twice this is out
/// of any sensible range (the validated parameters stay far below).
const MAX_POISSON_MEAN: f64 = 1.0e15;

/// One Skellam variate of variance `variance`: the difference of two
/// Poisson variates of mean `variance / 2`.
pub fn sample_skellam<R: CryptoRng + ?Sized>(variance: f64, rng: &mut R) -> i64 {
    let mut one = [0i64];
    add_skellam(&mut one, variance, rng);
    one[0]
}

/// Adds independent Skellam noise of variance `variance` to every value.
pub(crate) fn add_skellam<R: CryptoRng + ?Sized>(values: &mut [i64], variance: f64, rng: &mut R) {
    let mean = (variance / 2.0).min(MAX_POISSON_MEAN);
    let Ok(poisson) = Poisson::new(mean) else {
        // Only a zero or non-finite variance, which validation refuses.
        return;
    };
    for value in values {
        let a: f64 = poisson.sample(rng);
        let b: f64 = poisson.sample(rng);
        *value += a as i64 - b as i64;
    }
}

/// Whether a Bernoulli(e^(−x)) trial succeeds.
fn bernoulli_exp<R: CryptoRng + ?Sized>(x: f64, rng: &mut R) -> bool {
    uniform(rng) < (-x).exp()
}

/// A uniform integer in [0, bound) (bound ≥ 1), by a 64 × 64-bit widening
/// multiply: the bias is at most bound / 2⁶⁴.
fn below<R: CryptoRng + ?Sized>(bound: u64, rng: &mut R) -> u64 {
    ((u128::from(rng.next_u64()) * u128::from(bound)) >> 64) as u64
}

/// One discrete Gaussian variate N_Z(0, σ²) with σ² = `variance`, by
/// rejection from a discrete Laplace of scale ⌊σ⌋ + 1 (Canonne, Kamath and
/// Steinke, 2020, Algorithm 3).
pub fn sample_discrete_gaussian<R: CryptoRng + ?Sized>(variance: f64, rng: &mut R) -> i64 {
    let t = variance.sqrt().floor() as u64 + 1;
    let tf = t as f64;
    loop {
        // A discrete Laplace variate: P(x) ∝ e^(−|x|/t).
        let u = below(t, rng);
        if !bernoulli_exp(u as f64 / tf, rng) {
            continue;
        }
        let mut v = 0u64;
        while bernoulli_exp(1.0, rng) {
            v += 1;
        }
        let x = u + t * v;
        let negative = rng.next_u32() & 1 == 1;
        if negative && x == 0 {
            continue;
        }
        let excess = x as f64 - variance / tf;
        if bernoulli_exp(excess * excess / (2.0 * variance), rng) {
            let x = x as i64;
            return if negative { -x } else { x };
        }
    }
}

/// Adds independent discrete Gaussian noise of variance `variance` to every
/// value.
pub(crate) fn add_discrete_gaussian<R: CryptoRng + ?Sized>(values: &mut [i64], variance: f64, rng: &mut R) {
    if !(variance.is_finite() && variance > 0.0) {
        return;
    }
    for value in values {
        *value += sample_discrete_gaussian(variance, rng);
    }
}
