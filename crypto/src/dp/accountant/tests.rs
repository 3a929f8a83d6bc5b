use super::*;

fn gaussian(z: f64, q: f64) -> RoundPrivacy {
    RoundPrivacy { mechanism: RoundMechanism::Gaussian { noise_multiplier: z }, sample_rate: q }
}

/// ε of the Poisson-sampled Gaussian at points computed with Google's
/// `dp-accounting` 0.6 RDP accountant (`RdpAccountant()` with its default
/// orders, `PoissonSampledDpEvent(q, GaussianDpEvent(z))` composed T times,
/// `get_epsilon(δ)`). Ours tries more orders, so it may only be lower;
/// it agrees to 10⁻⁶ at every point here (CI also compares against the
/// package itself).
#[test]
fn sampled_gaussian_matches_dp_accounting() {
    let points = [
        (0.01, 1.1, 1_000, 1e-5, 1.7117701662429012),
        (1.0 / 6.0, 0.8, 30, 1e-5, 11.528760017389608),
        (1.0, 3.0, 30, 1e-5, 9.600926095302064),
        (0.001, 0.6, 100_000, 1e-6, 7.756428309732335),
        (0.5, 5.0, 10, 1e-3, 0.9576867489978164),
        (1.0, 50.0, 1, 1e-5, 0.07020481624803404),
        (0.05, 2.0, 200, 1e-5, 1.7213067947507872),
        (1.0 / 6.0, 1.5, 30, 1e-5, 3.8178701150983576),
    ];
    // dp-accounting's default orders.
    let mut theirs: Vec<f64> = (11..110).map(|x| f64::from(x) / 10.0).collect();
    theirs.extend((11..64).map(f64::from));
    theirs.extend([128.0, 256.0, 512.0, 1024.0]);
    for (q, z, rounds, delta, expected) in points {
        let rdp: Vec<f64> = gaussian(z, q).rdp(&theirs).into_iter().map(|r| r * rounds as f64).collect();
        let same_orders = epsilon_from_rdp(&theirs, &rdp, delta).epsilon;
        assert!(
            (same_orders / expected - 1.0).abs() < 1e-9,
            "q {q} z {z} T {rounds}: {same_orders} vs {expected}"
        );
        let got = gaussian(z, q).epsilon(rounds, delta).epsilon;
        assert!(got <= expected * (1.0 + 1e-12), "q {q} z {z} T {rounds}: {got} > {expected}");
        assert!(got >= expected * 0.9, "q {q} z {z} T {rounds}: {got} far below {expected}");
    }
}

/// Solving for z inverts the accountant: dp-accounting's ε at z = 0.97130
/// (q = 1/6, 30 rounds, δ = 10⁻⁵) is 8.
#[test]
fn the_noise_multiplier_for_a_budget_matches_dp_accounting() {
    let z = noise_multiplier_for(8.0, 1e-5, 30, |z| gaussian(z, 1.0 / 6.0)).unwrap();
    assert!((z / 0.9712952693076736 - 1.0).abs() < 1e-4, "{z}");
    assert!(gaussian(z, 1.0 / 6.0).epsilon(30, 1e-5).epsilon <= 8.0);
    // A budget nothing meets.
    assert_eq!(noise_multiplier_for(1e-9, 1e-5, 1_000_000, |z| gaussian(z, 1.0)), None);
}

/// Integer and fractional orders of the exact computation agree with the
/// closed form at q = 1, and the fractional series approaches its integer
/// neighbours.
#[test]
fn fractional_and_integer_orders_agree() {
    for alpha in [2.0, 3.0, 7.0, 32.0] {
        let exact = sampled_gaussian_rdp(0.3, 1.2, alpha);
        let near = sampled_gaussian_rdp(0.3, 1.2, alpha + 1e-7);
        assert!((exact - near).abs() < 1e-5 * exact.max(1e-3), "α {alpha}: {exact} vs {near}");
    }
    assert_eq!(sampled_gaussian_rdp(1.0, 2.0, 3.5), 3.5 / 8.0);
    assert_eq!(sampled_gaussian_rdp(0.0, 2.0, 3.5), 0.0);
}

/// The general subsampling bound, applied to the Gaussian, is never below
/// the exact sampled-Gaussian RDP (it is a bound) and never above the
/// unamplified RDP after the min.
#[test]
fn the_general_subsampling_bound_bounds_the_exact_one() {
    for (q, z) in [(0.01, 1.0), (0.1, 0.7), (0.5, 2.0)] {
        let mechanism = RoundMechanism::Gaussian { noise_multiplier: z };
        let plain: Vec<f64> = (0..=64).map(|l| mechanism.rdp(f64::from(l.max(2)))).collect();
        for alpha in [2u32, 3, 5, 16, 64] {
            let bound = subsampled_upper_bound(alpha, q, &plain);
            let exact = sampled_gaussian_rdp(q, z, f64::from(alpha));
            assert!(bound >= exact * (1.0 - 1e-9), "q {q} z {z} α {alpha}: {bound} < {exact}");
        }
    }
}

/// Skellam at large variance is the Gaussian plus a vanishing term; its
/// RDP at q = 1 is the closed form of Agarwal, Kairouz and Liu (2021).
#[test]
fn skellam_known_answers() {
    let sensitivity = Sensitivity { l2: 100.0, l1: 1_000.0 };
    let skellam = RoundMechanism::Skellam { sensitivity, stddev: 100.0 };
    // α = 2: 2·10⁴/(2·10⁴) + min((3·10⁴ + 6·10³)/(4·10⁸), 3·10³/(2·10⁴)) = 1 + 9·10⁻⁵.
    assert!((skellam.rdp(2.0) - 1.00009).abs() < 1e-12);
    let with_z = |z: f64| RoundPrivacy {
        mechanism: RoundMechanism::Skellam { sensitivity, stddev: z * 100.0 },
        sample_rate: 1.0,
    };
    let (s, g) = (with_z(1.0).epsilon(30, 1e-5).epsilon, gaussian(1.0, 1.0).epsilon(30, 1e-5).epsilon);
    assert!(s >= g && s < g * 1.001, "{s} vs {g}");
    // Sampled: the general bound costs something over the exact Gaussian,
    // never less, and stays far below no amplification.
    let sampled = RoundPrivacy { sample_rate: 0.1, ..with_z(1.0) }.epsilon(30, 1e-5).epsilon;
    let exact = gaussian(1.0, 0.1).epsilon(30, 1e-5).epsilon;
    assert!(sampled >= exact && sampled < s / 2.0, "{sampled} vs {exact} and {s}");
}

/// The distributed discrete Gaussian with many well-spread shares is the
/// Gaussian (τ vanishes); with shares of tiny variance τ charges for the
/// sum's distance from a discrete Gaussian.
#[test]
fn distributed_discrete_gaussian_known_answers() {
    let sensitivity = Sensitivity { l2: 100.0, l1: 1_000.0 };
    let wide = RoundMechanism::DiscreteGaussian { sensitivity, stddev: 100.0, shares: 10, dimension: 100 };
    assert!((wide.rdp(4.0) - 2.0).abs() < 1e-12, "{}", wide.rdp(4.0));
    // 1 000 shares of variance 0.01: τ = 10 Σ e^(−2π²·0.01·k/(k+1)) is large.
    let narrow = RoundMechanism::DiscreteGaussian {
        sensitivity: Sensitivity { l2: 1.0, l1: 1.0 },
        stddev: 10f64.sqrt(),
        shares: 1_000,
        dimension: 100,
    };
    assert!(narrow.rdp(4.0) > 4.0 / (2.0 * 10.0) * 1.5, "{}", narrow.rdp(4.0));
}

#[test]
fn composition_grows_and_delta_trades_against_epsilon() {
    let p = gaussian(1.0, 0.05);
    let e10 = p.epsilon(10, 1e-5).epsilon;
    let e100 = p.epsilon(100, 1e-5).epsilon;
    assert!(e100 > e10 && e10 > 0.0);
    assert!(p.epsilon(100, 1e-3).epsilon < e100);
    assert_eq!(p.epsilon(0, 1e-5).epsilon, 0.0);
}
