//! A Rényi-DP accountant: the privacy of a task's rounds, composed, as
//! (ε, δ).
//!
//! * The Poisson-subsampled Gaussian mechanism exactly, at integer and
//!   fractional orders (Mironov, Talwar and Zhang, "Rényi Differential
//!   Privacy of the Sampled Gaussian Mechanism", 2019; the computation of
//!   Google's `dp-accounting` RDP accountant).
//! * The Skellam mechanism (Agarwal, Kairouz and Liu, 2021, Theorem 3.5) and
//!   the distributed discrete Gaussian (Kairouz, Liu and Steinke, 2021,
//!   Theorem 1 and Proposition 14), at integer orders; subsampled with the
//!   general upper bound for Poisson subsampling (Zhu and Wang, ICML 2019,
//!   Theorem 6), or without amplification, whichever is smaller.
//! * Composition adds RDP over rounds; conversion to (ε, δ) takes the best
//!   order with ε = RDP(α) + ln(1 − 1/α) − (ln δ + ln α)/(α − 1) (Canonne,
//!   Kamath and Steinke, 2020, Proposition 12; Asoodeh et al. 2020).
//!
//! Pure arithmetic: no clock, no I/O, the same result everywhere.

use std::f64::consts::PI;

use super::{DpParams, Mechanism, Sensitivity};

/// One round's mechanism, as the accountant sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RoundMechanism {
    /// The Gaussian mechanism with noise multiplier z (σ / Δ₂).
    Gaussian {
        /// z.
        noise_multiplier: f64,
    },
    /// The Skellam mechanism: central noise of standard deviation `stddev`
    /// on integer vectors of sensitivities `sensitivity`.
    Skellam {
        /// Δ₂ and Δ₁ in integer steps.
        sensitivity: Sensitivity,
        /// The central noise's standard deviation, in integer steps.
        stddev: f64,
    },
    /// The distributed discrete Gaussian: `shares` discrete Gaussian
    /// shares of standard deviation `stddev / √shares` each.
    DiscreteGaussian {
        /// Δ₂ and Δ₁ in integer steps.
        sensitivity: Sensitivity,
        /// The summed noise's standard deviation, in integer steps.
        stddev: f64,
        /// How many shares make up the noise.
        shares: u32,
        /// Coordinates.
        dimension: usize,
    },
}

impl RoundMechanism {
    /// The mechanism a round with `params` and `padded` coordinates runs.
    pub fn of(params: &DpParams, padded: usize) -> Self {
        let sensitivity = params.sensitivity(padded);
        let stddev = params.noise_multiplier * sensitivity.l2;
        match params.mechanism {
            Mechanism::Skellam => RoundMechanism::Skellam { sensitivity, stddev },
            Mechanism::DiscreteGaussian => RoundMechanism::DiscreteGaussian {
                sensitivity,
                stddev,
                shares: params.noise_shares,
                dimension: padded,
            },
        }
    }

    /// The mechanism's RDP at order `alpha` (> 1), without subsampling.
    pub fn rdp(&self, alpha: f64) -> f64 {
        match *self {
            RoundMechanism::Gaussian { noise_multiplier } => alpha / (2.0 * noise_multiplier.powi(2)),
            RoundMechanism::Skellam { sensitivity: Sensitivity { l2, l1 }, stddev } => {
                let var = stddev * stddev;
                alpha * l2 * l2 / (2.0 * var)
                    + (((2.0 * alpha - 1.0) * l2 * l2 + 6.0 * l1) / (4.0 * var * var))
                        .min(3.0 * l1 / (2.0 * var))
            }
            RoundMechanism::DiscreteGaussian {
                sensitivity: Sensitivity { l2, l1 },
                stddev,
                shares,
                dimension,
            } => {
                let local_var = stddev * stddev / f64::from(shares.max(1));
                let tau = 10.0
                    * (1..shares.max(1))
                        .map(|k| {
                            let k = f64::from(k);
                            (-2.0 * PI * PI * local_var * k / (k + 1.0)).exp()
                        })
                        .sum::<f64>();
                let (l2, l1, d) = (l2 / stddev, l1 / stddev, dimension as f64);
                let first = alpha / 2.0 * l2 * l2 + tau * d;
                let second = alpha / 2.0 * (l2 * l2 + 2.0 * l1 * tau + tau * tau * d);
                let third = alpha / 2.0 * (l2 + d.sqrt() * tau).powi(2);
                first.min(second).min(third)
            }
        }
    }
}

/// The privacy of a task's rounds: each round runs `mechanism` on a
/// Poisson sample of the population with probability `sample_rate`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundPrivacy {
    /// Each round's mechanism.
    pub mechanism: RoundMechanism,
    /// q in (0, 1]: 1 is no amplification by sampling.
    pub sample_rate: f64,
}

/// ε with the order that achieved it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Epsilon {
    /// ε for the δ asked.
    pub epsilon: f64,
    /// The best Rényi order.
    pub order: f64,
}

/// The orders the accountant tries: 1.1 to 10.9 by tenths, the integers 11
/// to 256 and a few larger (Google's `dp-accounting` uses the first two
/// ranges up to 63, then 128, 256 and 512).
pub fn orders() -> Vec<f64> {
    let mut orders: Vec<f64> = (11..110).map(|x| f64::from(x) / 10.0).collect();
    orders.extend((11..=256).map(f64::from));
    orders.extend([320.0, 384.0, 512.0, 768.0, 1024.0]);
    orders
}

impl RoundPrivacy {
    /// The RDP of one round at each of `orders`.
    pub fn rdp(&self, orders: &[f64]) -> Vec<f64> {
        let q = self.sample_rate;
        match self.mechanism {
            RoundMechanism::Gaussian { noise_multiplier } => {
                orders.iter().map(|&alpha| sampled_gaussian_rdp(q, noise_multiplier, alpha)).collect()
            }
            mechanism if q >= 1.0 => orders.iter().map(|&alpha| mechanism.rdp(alpha)).collect(),
            mechanism => {
                // The general bound holds at integer orders and needs the
                // plain RDP at 2..=α; RDP grows with the order, so a
                // fractional order is bounded by the integer above it.
                let top = orders.iter().fold(2.0f64, |top, &a| top.max(a.ceil())) as usize;
                let plain: Vec<f64> = (0..=top).map(|l| mechanism.rdp(l.max(2) as f64)).collect();
                orders
                    .iter()
                    .map(|&alpha| {
                        let whole = (alpha.ceil() as u32).max(2);
                        subsampled_upper_bound(whole, q, &plain).min(plain[whole as usize])
                    })
                    .collect()
            }
        }
    }

    /// ε after `rounds` rounds for `delta`.
    pub fn epsilon(&self, rounds: u64, delta: f64) -> Epsilon {
        let orders = orders();
        let rdp: Vec<f64> = self.rdp(&orders).into_iter().map(|r| r * rounds as f64).collect();
        epsilon_from_rdp(&orders, &rdp, delta)
    }
}

/// What one client's own `contributions` masked inputs to a task spend,
/// by the client's accounting: each is one run of the round's mechanism
/// with `params` (the noise the client pinned; a round may only add noise)
/// on its update of `padded` coordinates, composed, with no amplification
/// by sampling: the coordinator chose the client, so sampling hides nothing
/// from it. Zero contributions spend nothing.
pub fn client_epsilon(params: &DpParams, padded: usize, contributions: u64, delta: f64) -> Epsilon {
    if contributions == 0 {
        return Epsilon { epsilon: 0.0, order: f64::NAN };
    }
    RoundPrivacy { mechanism: RoundMechanism::of(params, padded), sample_rate: 1.0 }
        .epsilon(contributions, delta)
}

/// The least ε over `orders` for composed RDP values `rdp` and `delta`.
pub fn epsilon_from_rdp(orders: &[f64], rdp: &[f64], delta: f64) -> Epsilon {
    let mut best = Epsilon { epsilon: f64::INFINITY, order: f64::NAN };
    for (&alpha, &r) in orders.iter().zip(rdp) {
        if !(r.is_finite() && r >= 0.0) || alpha <= 1.0 {
            continue;
        }
        let epsilon = if delta * delta + (-r).exp_m1() > 0.0 {
            // δ ≥ √(1 − e^(−KL)): nothing to pay.
            0.0
        } else if alpha > 1.01 {
            r + (-1.0 / alpha).ln_1p() - (delta * alpha).ln() / (alpha - 1.0)
        } else {
            f64::INFINITY
        };
        if epsilon < best.epsilon {
            best = Epsilon { epsilon: epsilon.max(0.0), order: alpha };
        }
    }
    best
}

/// The RDP at order `alpha` of the Gaussian mechanism with noise
/// multiplier `z` on a Poisson sample with probability `q`.
pub fn sampled_gaussian_rdp(q: f64, z: f64, alpha: f64) -> f64 {
    if q <= 0.0 {
        return 0.0;
    }
    if z <= 0.0 {
        return f64::INFINITY;
    }
    if q >= 1.0 {
        return alpha / (2.0 * z * z);
    }
    if alpha.is_infinite() {
        return f64::INFINITY;
    }
    let log_a = if alpha.fract() == 0.0 {
        log_a_int(q, z, alpha as u32)
    } else {
        // An order whose series does not settle is left out.
        log_a_frac(q, z, alpha).unwrap_or(f64::INFINITY)
    };
    log_a / (alpha - 1.0)
}

/// ln(e^a + e^b).
fn log_add(a: f64, b: f64) -> f64 {
    let (high, low) = if a > b { (a, b) } else { (b, a) };
    if low == f64::NEG_INFINITY {
        return high;
    }
    high + (low - high).exp().ln_1p()
}

/// ln C(n, k) for integers.
fn log_binomial(n: u32, k: u32) -> f64 {
    let (n, k) = (f64::from(n), f64::from(k));
    libm::lgamma(n + 1.0) - libm::lgamma(k + 1.0) - libm::lgamma(n - k + 1.0)
}

/// ln erfc(x), accurate where erfc underflows.
fn log_erfc(x: f64) -> f64 {
    if x < 20.0 {
        return libm::erfc(x).ln();
    }
    // erfc(x) = e^(−x²) / (x√π) · (1 − 1/(2x²) + 3/(4x⁴) − 15/(8x⁶) + …).
    let r = 1.0 / (x * x);
    -x * x - (x * PI.sqrt()).ln() + (1.0 - r / 2.0 + 0.75 * r * r - 1.875 * r * r * r).ln()
}

/// ln A_α for integer α: A_α = Σ_i C(α, i) (1 − q)^(α−i) q^i e^((i² − i)/(2σ²)).
fn log_a_int(q: f64, sigma: f64, alpha: u32) -> f64 {
    let mut log_a = f64::NEG_INFINITY;
    for i in 0..=alpha {
        let fi = f64::from(i);
        let term = log_binomial(alpha, i)
            + fi * q.ln()
            + f64::from(alpha - i) * (-q).ln_1p()
            + (fi * fi - fi) / (2.0 * sigma * sigma);
        log_a = log_add(log_a, term);
    }
    log_a
}

/// An upper bound on ln A_α for fractional α, as the two integrals split at
/// z₀ (Mironov, Talwar and Zhang, 2019, Section 3.3), adding the terms'
/// magnitudes (past i = α the binomial coefficients alternate in sign;
/// adding them all only raises the bound, as `dp-accounting` does); `None`
/// when the series has not settled within 1 000 terms.
fn log_a_frac(q: f64, sigma: f64, alpha: f64) -> Option<f64> {
    let (mut log_a0, mut log_a1) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    let z0 = sigma * sigma * (1.0 / q - 1.0).ln() + 0.5;
    let (log_q, log_1q) = (q.ln(), (-q).ln_1p());
    let (mut last_s0, mut last_s1) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    for i in 0..1_000u32 {
        let fi = f64::from(i);
        let j = alpha - fi;
        // ln |C(α, i)| = ln Γ(α + 1) − ln Γ(i + 1) − ln |Γ(α − i + 1)|.
        let log_coef = libm::lgamma_r(alpha + 1.0).0 - libm::lgamma_r(fi + 1.0).0 - libm::lgamma_r(j + 1.0).0;
        let log_t0 = log_coef + fi * log_q + j * log_1q;
        let log_t1 = log_coef + j * log_q + fi * log_1q;
        let log_e0 = 0.5f64.ln() + log_erfc((fi - z0) / (2.0f64.sqrt() * sigma));
        let log_e1 = 0.5f64.ln() + log_erfc((z0 - j) / (2.0f64.sqrt() * sigma));
        let log_s0 = log_t0 + (fi * fi - fi) / (2.0 * sigma * sigma) + log_e0;
        let log_s1 = log_t1 + (j * j - j) / (2.0 * sigma * sigma) + log_e1;
        log_a0 = log_add(log_a0, log_s0);
        log_a1 = log_add(log_a1, log_s1);
        let total = log_add(log_a0, log_a1);
        if log_s0 < last_s0 && log_s1 < last_s1 && log_s0.max(log_s1) < total - 30.0 {
            return Some(total);
        }
        last_s0 = log_s0;
        last_s1 = log_s1;
    }
    None
}

/// The general upper bound on the RDP at integer order `alpha` of a
/// mechanism with RDP `plain[l]` at order l, run on a Poisson sample with
/// probability `q` (Zhu and Wang, 2019, Theorem 6):
/// (α − 1)·ε ≤ ln[(1 − q)^(α−1)(αq − q + 1) + C(α,2) q² (1 − q)^(α−2) e^(ε(2))
///             + 3 Σ_{l=3..α} C(α,l) q^l (1 − q)^(α−l) e^((l−1) ε(l))].
fn subsampled_upper_bound(alpha: u32, q: f64, plain: &[f64]) -> f64 {
    let a = f64::from(alpha);
    let log_1q = (-q).ln_1p();
    let mut total = (a - 1.0) * log_1q + (a * q - q + 1.0).ln();
    total = log_add(total, log_binomial(alpha, 2) + 2.0 * q.ln() + (a - 2.0) * log_1q + plain[2]);
    for l in 3..=alpha {
        let fl = f64::from(l);
        total = log_add(
            total,
            3.0f64.ln()
                + log_binomial(alpha, l)
                + fl * q.ln()
                + (a - fl) * log_1q
                + (fl - 1.0) * plain[l as usize],
        );
    }
    total / (a - 1.0)
}

/// The least noise multiplier whose `rounds` rounds cost at most `epsilon`
/// at `delta`, where `privacy(z)` is a round's privacy at noise multiplier
/// z (non-increasing in z); `None` when even z = 10⁴ is not enough.
pub fn noise_multiplier_for(
    epsilon: f64,
    delta: f64,
    rounds: u64,
    privacy: impl Fn(f64) -> RoundPrivacy,
) -> Option<f64> {
    let spent = |z: f64| privacy(z).epsilon(rounds, delta).epsilon;
    let (mut low, mut high) = (1.0e-3, super::MAX_NOISE_MULTIPLIER);
    if spent(high) > epsilon {
        return None;
    }
    if spent(low) <= epsilon {
        return Some(low);
    }
    for _ in 0..60 {
        let mid = (low * high).sqrt();
        if spent(mid) <= epsilon {
            high = mid
        } else {
            low = mid
        }
        if high / low < 1.0 + 1.0e-6 {
            break;
        }
    }
    Some(high)
}

#[cfg(test)]
mod tests;
