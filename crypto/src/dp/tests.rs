use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

use super::*;

fn params(mechanism: Mechanism) -> DpParams {
    DpParams { mechanism, clip_norm: 1.0, noise_multiplier: 1.0, scale: 200.0, noise_shares: 5 }
}

/// Δ₂ at known points: the tight bound (sC)² + D/4 + sC + √D/2 where it is
/// smaller, (sC + √D)² where that is; Δ₁ = min(Δ₂², √D·Δ₂).
#[test]
fn sensitivity_known_answers() {
    // sC = 100, D = 64: 10 000 + 16 + 100 + 4 = 10 120 < 108² = 11 664.
    let s = sensitivity(100.0, 64);
    assert!((s.l2 - 10_120f64.sqrt()).abs() < 1e-9);
    assert!((s.l1 - 8.0 * 10_120f64.sqrt()).abs() < 1e-9);
    // sC = 0, D = 1: min(1, 0.25 + 0 + 0.5) = 0.75; Δ₁ = min(0.75, √0.75).
    let s = sensitivity(0.0, 1);
    assert!((s.l2 - 0.75f64.sqrt()).abs() < 1e-12);
    assert!((s.l1 - 0.75).abs() < 1e-12);
}

#[test]
fn blocks_pad_little_and_stay_powers_of_two() {
    assert_eq!(block_for(7_850), 8_192);
    assert_eq!(padded_len(7_850, 8_192), 8_192);
    // 100 000: 2^16 would pad 31 %; 2^13 pads 106 (0.1 %).
    let block = block_for(100_000);
    assert!(block.is_power_of_two() && block >= 1 << 10);
    assert!(padded_len(100_000, block) - 100_000 <= 100_000 / 16, "block {block}");
    assert_eq!(block_for(3), 4);
    assert_eq!(padded_len(3, block_for(3)), 4);
    assert_eq!(block_for(1), 2);
}

#[test]
fn parameters_are_checked() {
    let p = params(Mechanism::Skellam);
    assert_eq!(p.validate(16, 5), Ok(()));
    assert!(p.validate(16, 4).is_err(), "more shares than the threshold");
    assert!(DpParams { noise_shares: 0, ..p }.validate(16, 5).is_err());
    for z in [0.0, -1.0, f64::NAN, MAX_NOISE_MULTIPLIER * 2.0] {
        assert!(DpParams { noise_multiplier: z, ..p }.validate(16, 5).is_err(), "z {z}");
    }
    for clip in [0.0, f32::INFINITY, -1.0] {
        assert!(DpParams { clip_norm: clip, ..p }.validate(16, 5).is_err(), "clip {clip}");
    }
    assert!(DpParams { scale: 0.0, ..p }.validate(16, 5).is_err());
    assert!(DpParams { scale: 1e13, ..p }.validate(16, 5).is_err());
    assert!(p.validate(33, 5).is_err());
}

/// The sample variance of both samplers is the asked variance, and the
/// mean is zero, within a few standard errors.
#[test]
fn noise_has_the_asked_variance() {
    let mut rng = ChaCha20Rng::seed_from_u64(8);
    for variance in [0.5, 3.0, 400.0, 250_000.0] {
        for mechanism in [Mechanism::Skellam, Mechanism::DiscreteGaussian] {
            let n = 40_000;
            let samples: Vec<f64> = (0..n)
                .map(|_| match mechanism {
                    Mechanism::Skellam => sample_skellam(variance, &mut rng) as f64,
                    Mechanism::DiscreteGaussian => sample_discrete_gaussian(variance, &mut rng) as f64,
                })
                .collect();
            let mean = samples.iter().sum::<f64>() / n as f64;
            let var = samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n as f64 - 1.0);
            assert!(
                mean.abs() < 5.0 * (variance / n as f64).sqrt() + 0.01,
                "{mechanism:?} {variance}: mean {mean}"
            );
            // The discrete Gaussian's variance is below σ² for tiny σ (it is
            // σ² only in the limit); at σ² ≥ 3 it is within 10⁻⁵ relative.
            let tolerance = if variance < 1.0 { 0.35 } else { 0.05 };
            assert!((var / variance - 1.0).abs() < tolerance, "{mechanism:?} {variance}: variance {var}");
        }
    }
}

/// The discrete Gaussian's probabilities at 0, ±1, ±2 for σ² = 1 match
/// e^(−x²/2) / Σ_y e^(−y²/2).
#[test]
fn discrete_gaussian_matches_its_mass_function() {
    let mut rng = ChaCha20Rng::seed_from_u64(9);
    let n = 200_000;
    let mut counts = [0u32; 5];
    for _ in 0..n {
        let x = sample_discrete_gaussian(1.0, &mut rng);
        if (-2..=2).contains(&x) {
            counts[(x + 2) as usize] += 1;
        }
    }
    let norm: f64 = (-40..=40).map(|y: i32| (-f64::from(y * y) / 2.0).exp()).sum();
    for (i, &count) in counts.iter().enumerate() {
        let x = i as f64 - 2.0;
        let p = (-x * x / 2.0).exp() / norm;
        let observed = f64::from(count) / f64::from(n);
        let se = (p * (1.0 - p) / f64::from(n)).sqrt();
        assert!((observed - p).abs() < 5.0 * se, "P({x}) = {observed}, expected {p}");
    }
}

/// n clients' encodings, summed in the ring, decode to the mean of their
/// clipped updates, within the noise and rounding the parameters promise.
#[test]
fn noisy_sum_decodes_to_the_mean_of_clipped_updates() {
    for mechanism in [Mechanism::Skellam, Mechanism::DiscreteGaussian] {
        let (clients, dim) = (100u32, 300usize);
        let block = block_for(dim);
        let padded = padded_len(dim, block);
        let scale = scale_for(16, clients, 50, 1.0, 0.3, padded, DEFAULT_K_STDDEVS).unwrap();
        let p = DpParams { mechanism, clip_norm: 1.0, noise_multiplier: 0.3, scale, noise_shares: 50 };
        let rotation = Rotation::new([3; 32], block as usize).unwrap();
        let mut rng = ChaCha20Rng::seed_from_u64(10);
        // Updates of norm 0.5 (kept) and 3 (clipped to 1).
        let updates: Vec<Vec<f32>> = (0..clients)
            .map(|k| {
                let v: Vec<f32> = (0..dim)
                    .map(|i| (i as f32 * 0.1).sin() + 0.5 * ((i * 7 + k as usize) as f32 * 0.1).sin())
                    .collect();
                let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
                let target = if k % 2 == 0 { 0.5 } else { 3.0 };
                v.iter().map(|x| x / norm * target).collect()
            })
            .collect();
        let mut sum = vec![0u32; padded];
        for update in &updates {
            let encoded = p.encode(&rotation, block, update, 16, true, &mut rng).unwrap();
            assert_eq!(encoded.len(), padded);
            assert!(encoded.iter().all(|&v| v < 1 << 16));
            for (s, v) in sum.iter_mut().zip(encoded.iter()) {
                *s = s.wrapping_add(*v) & 0xffff;
            }
        }
        let mean = p.decode(&rotation, &sum, clients, 16, dim);
        assert_eq!(mean.len(), dim);
        let expected: Vec<f64> = (0..dim)
            .map(|i| {
                updates
                    .iter()
                    .map(|u| {
                        let norm = u.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
                        f64::from(u[i]) * (1.0 / norm).min(1.0)
                    })
                    .sum::<f64>()
                    / f64::from(clients)
            })
            .collect();
        let error: f64 =
            mean.iter().zip(&expected).map(|(m, e)| (f64::from(*m) - e).powi(2)).sum::<f64>().sqrt();
        // The noise in the sum has standard deviation √(n/m)·z·Δ₂ per
        // coordinate, so its norm over the mean is about that · √D / (s·n).
        let noise =
            (f64::from(clients) / 50.0).sqrt() * 0.3 * p.sensitivity(padded).l2 * (padded as f64).sqrt()
                / (scale * f64::from(clients));
        let signal = expected.iter().map(|e| e * e).sum::<f64>().sqrt();
        assert!(error < 2.0 * noise, "{mechanism:?}: error {error}, noise {noise}");
        assert!(error < signal / 3.0, "{mechanism:?}: error {error}, signal {signal}");
    }
}

/// Rounding never yields a vector above Δ₂: the sensitivity the accountant
/// uses holds for every encoding, even of an update exactly at the clip.
#[test]
fn rounded_vectors_stay_within_the_sensitivity() {
    let dim = 1_000;
    let block = block_for(dim);
    let padded = padded_len(dim, block);
    let p = DpParams { noise_multiplier: 1e-3, scale: 30.0, ..params(Mechanism::Skellam) };
    let rotation = Rotation::new([5; 32], block as usize).unwrap();
    let update: Vec<f32> = (0..dim).map(|i| if i % 3 == 0 { 1.0 } else { -0.5 }).collect();
    let mut rng = ChaCha20Rng::seed_from_u64(11);
    // With z tiny the noise is a few units; check the rounded norm by
    // decoding the vector itself: its norm in steps stays ≤ Δ₂ + noise.
    for _ in 0..50 {
        let encoded = p.encode(&rotation, block, &update, 32, true, &mut rng).unwrap();
        let squared: f64 = encoded.iter().map(|&v| (v as i32 as f64).powi(2)).sum();
        let noise = (p.local_variance(padded) * padded as f64).sqrt();
        assert!(squared.sqrt() <= p.sensitivity(padded).l2 + 6.0 * noise + 1.0, "{}", squared.sqrt());
    }
    assert!(matches!(
        p.encode(&rotation, block, &[f32::NAN], 32, true, &mut rng),
        Err(QuantizeError::NonFinite(0))
    ));
}

#[test]
fn the_scale_fills_the_ring_and_a_ring_too_small_is_refused() {
    // n = 1 000, D = 8 192, z = 1, m = 500: fits 16 bits.
    let s = scale_for(16, 1_000, 500, 1.0, 1.0, 8_192, 4.0).unwrap();
    let l2 = sensitivity(s, 8_192).l2;
    let spread = 4.0 * ((s * 1_000.0).powi(2) / 8_192.0 + 1_000.0 * l2 * l2 / 500.0 + 250.0).sqrt();
    assert!((spread / 32_768.0 - 1.0).abs() < 1e-6, "{spread}");
    // Rounding alone of 1 000 clients needs 4·√250 ≈ 63 > 2^5.
    assert_eq!(scale_for(6, 1_000, 500, 1.0, 1.0, 8_192, 4.0), None);
    assert_eq!(scale_for(16, 0, 1, 1.0, 1.0, 8, 4.0), None);
}

/// Through the round's quantizer: a DP round's vectors are the padded
/// rotation's length with no weight or metric coordinates; a sum of fewer
/// inputs than the noise was split into is not decoded (it would carry
/// less than the promised noise); DP needs the rotation, no metrics and
/// unit weights.
#[test]
fn the_quantizer_carries_dp_rounds() {
    use crate::quantize::{QuantizationSpec, Quantizer, Transform};
    let p = DpParams { noise_shares: 3, ..params(Mechanism::DiscreteGaussian) };
    let spec = QuantizationSpec {
        clip: 1.0,
        max_weight: 1,
        transform: Transform::Rotate { block: 64, seed: [7; 32] },
        metrics: crate::MetricSet::NONE,
        privacy: Some(p),
        validation: None,
        scale: None,
    };
    let q = Quantizer::new(spec, 16, 5).unwrap();
    assert_eq!(q.encoded_len(100), 128);
    let mut rng = ChaCha20Rng::seed_from_u64(12);
    // The example count plays no part: every client counts once.
    let encoded = q.encode(&[0.1; 100], 1_000, &mut rng).unwrap();
    assert_eq!(encoded.len(), 128);
    let sum: Vec<u32> = encoded.values().to_vec();
    assert_eq!(q.decode(&sum, 2, 100).err(), Some(QuantizeError::TooLittleNoise { summands: 2, shares: 3 }));
    let decoded = q.decode(&sum, 3, 100).unwrap();
    assert_eq!((decoded.mean.len(), decoded.total_weight), (100, 3));
    assert_eq!(decoded.metrics, crate::MetricSums::default());
    for bad in [
        QuantizationSpec { transform: Transform::None, ..spec },
        QuantizationSpec { metrics: crate::MetricSet::ALL, ..spec },
        QuantizationSpec { max_weight: 2, ..spec },
    ] {
        assert!(Quantizer::new(bad, 16, 5).is_err());
    }
}

#[test]
fn mechanisms_keep_their_names_and_read_the_kebab_spelling_too() {
    assert_eq!(Mechanism::Skellam.as_str(), "skellam");
    assert_eq!(Mechanism::DiscreteGaussian.as_str(), "discrete_gaussian");
    for (name, mechanism) in [
        ("skellam", Mechanism::Skellam),
        ("discrete_gaussian", Mechanism::DiscreteGaussian),
        ("discrete-gaussian", Mechanism::DiscreteGaussian),
    ] {
        assert_eq!(Mechanism::parse(name), Some(mechanism), "{name}");
    }
    assert_eq!(Mechanism::parse("gaussian"), None);
}

/// The portable sampler draws each Poisson mean's mass function (a
/// chi-square test over its central values, small and large means), adds
/// Skellam noise of the asked variance, and pins its draws: the same seed
/// gives these values on every platform (its verifiers recompute them).
#[test]
fn the_portable_sampler_draws_poisson_and_skellam_and_is_pinned() {
    use super::PortablePoisson;
    for (mean, seed) in [(0.7f64, 1u64), (4.5, 2), (10.0, 3), (37.5, 4), (2_000.0, 5)] {
        let poisson = PortablePoisson::new(mean);
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let draws = 200_000usize;
        let mut counts = std::collections::BTreeMap::<i64, u64>::new();
        for _ in 0..draws {
            *counts.entry(poisson.sample(&mut rng)).or_default() += 1;
        }
        // Bins with an expected count of at least 50; ln P(k) by lgamma.
        let ln_p = |k: i64| -mean + k as f64 * mean.ln() - libm::lgamma(k as f64 + 1.0);
        let (mut chi2, mut bins) = (0.0, 0usize);
        let centre = mean.floor() as i64;
        let spread = (6.0 * mean.sqrt()).ceil() as i64 + 6;
        for k in (centre - spread).max(0)..=centre + spread {
            let expected = ln_p(k).exp() * draws as f64;
            if expected < 50.0 {
                continue;
            }
            let seen = *counts.get(&k).unwrap_or(&0) as f64;
            chi2 += (seen - expected).powi(2) / expected;
            bins += 1;
        }
        // Far above the 99.99th percentile of χ² with `bins` degrees of
        // freedom would be a broken sampler: mean k, spread √(2k).
        let limit = bins as f64 + 6.0 * (2.0 * bins as f64).sqrt();
        assert!(chi2 < limit, "mean {mean}: χ² = {chi2:.1} over {bins} bins (limit {limit:.1})");
    }
    let variance = 450.0;
    let mut values = vec![0i64; 100_000];
    noise::add_skellam_portable(&mut values, variance, &mut ChaCha20Rng::seed_from_u64(9));
    let mean = values.iter().sum::<i64>() as f64 / values.len() as f64;
    let seen = values.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / (values.len() - 1) as f64;
    assert!((seen / variance - 1.0).abs() < 0.03, "variance {seen}");
    assert!(mean.abs() < 0.3, "mean {mean}");
    let mut pinned = vec![0i64; 8];
    noise::add_skellam_portable(&mut pinned, 450.0, &mut ChaCha20Rng::from_seed([42; 32]));
    let mut small = vec![0i64; 8];
    noise::add_skellam_portable(&mut small, 3.0, &mut ChaCha20Rng::from_seed([42; 32]));
    assert_eq!(pinned, [-41, -9, -23, 24, -14, 0, -2, 20]);
    assert_eq!(small, [-2, 2, -1, 0, -2, -1, -3, 3]);
}
