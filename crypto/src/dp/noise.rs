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

/// Adds independent Skellam noise of variance `variance` to every value,
/// drawn so that the same generator state gives the same noise on every
/// platform: only IEEE-754 arithmetic (exactly rounded everywhere) and the
/// pure-Rust `libm` functions, never the platform's own `exp` or `ln`.
///
/// The noise of a private, validated round is drawn from a seed two clients
/// share, and the one that verifies it must draw exactly what the other
/// added (one may run in a browser, the other on a phone), which
/// [`add_skellam`] (`rand_distr`'s Poisson, on the platform's `libm`) does
/// not promise. Poisson variates come from PTRS (Hörmann, 1993: transformed
/// rejection with squeeze) from mean 10 up, and by multiplying uniforms
/// below.
pub(crate) fn add_skellam_portable<R: CryptoRng + ?Sized>(values: &mut [i64], variance: f64, rng: &mut R) {
    if !(variance.is_finite() && variance > 0.0) {
        return;
    }
    let poisson = PortablePoisson::new((variance / 2.0).min(MAX_POISSON_MEAN));
    for value in values {
        let a = poisson.sample(rng);
        let b = poisson.sample(rng);
        *value += a - b;
    }
}

/// A Poisson sampler whose draws depend on the generator alone.
pub(crate) struct PortablePoisson {
    mean: f64,
    /// e^(−mean), for the multiplication method (mean < 10).
    exp_minus_mean: f64,
    /// PTRS's constants (mean ≥ 10).
    ln_mean: f64,
    b: f64,
    a: f64,
    ln_inv_alpha: f64,
    vr: f64,
}

impl PortablePoisson {
    pub(crate) fn new(mean: f64) -> Self {
        let slam = mean.sqrt();
        let b = 0.931 + 2.53 * slam;
        Self {
            mean,
            exp_minus_mean: libm::exp(-mean),
            ln_mean: libm::log(mean),
            b,
            a: -0.059 + 0.02483 * b,
            ln_inv_alpha: libm::log(1.1239 + 1.1328 / (b - 3.4)),
            vr: 0.9277 - 3.6224 / (b - 2.0),
        }
    }

    pub(crate) fn sample<R: CryptoRng + ?Sized>(&self, rng: &mut R) -> i64 {
        if self.mean < 10.0 {
            let mut product = 1.0f64;
            let mut count = 0i64;
            loop {
                product *= uniform(rng);
                if product <= self.exp_minus_mean {
                    return count;
                }
                count += 1;
            }
        }
        loop {
            let u = uniform(rng) - 0.5;
            let v = uniform(rng);
            let us = 0.5 - u.abs();
            let k = ((2.0 * self.a / us + self.b) * u + self.mean + 0.43).floor();
            if us >= 0.07 && v <= self.vr {
                return k as i64;
            }
            if k < 0.0 || (us < 0.013 && v > us) {
                continue;
            }
            let left = libm::log(v) + self.ln_inv_alpha - libm::log(self.a / (us * us) + self.b);
            let right = -self.mean + k * self.ln_mean - libm::lgamma(k + 1.0);
            if left <= right {
                return k as i64;
            }
        }
    }
}
