use super::*;

fn spec() -> PrivacySpec {
    PrivacySpec {
        mechanism: Mechanism::Skellam,
        epsilon: Some(8.0),
        delta: 1e-5,
        clip_norm: 1.0,
        noise_multiplier: None,
        sample_rate: Some(1.0 / 6.0),
        bits: 16,
    }
}

/// The noise solved for a budget spends at most the budget over the
/// task's rounds, and one round more would exceed it.
#[test]
fn the_solved_noise_spends_the_budget_over_the_rounds() {
    for mechanism in [Mechanism::Skellam, Mechanism::DiscreteGaussian] {
        let plan = PrivacySpec { mechanism, ..spec() }.plan(1_000, 400, 7_850, 30, false).unwrap();
        assert!(plan.epsilon_after(30) <= 8.0 * (1.0 + 1e-9), "{}", plan.epsilon_after(30));
        assert!(plan.epsilon_after(30) > 7.99, "{}", plan.epsilon_after(30));
        assert!(plan.allows(29) && !plan.allows(30));
        assert_eq!((plan.padded, plan.block, plan.modulus_bits), (8_192, 8_192, 16));
        assert_eq!(plan.params.noise_shares, 400);
        // Close to the Gaussian's z for the same budget (0.971); the
        // general subsampling bound costs a little.
        let z = plan.params.noise_multiplier;
        assert!((0.97..1.3).contains(&z), "{mechanism:?}: z {z}");
        plan.params.validate(16, 400).unwrap();
    }
    // Without amplification the same budget needs more noise.
    let plain = PrivacySpec { sample_rate: None, ..spec() }.plan(1_000, 400, 7_850, 30, false).unwrap();
    let sampled = spec().plan(1_000, 400, 7_850, 30, false).unwrap();
    assert!(plain.params.noise_multiplier > 2.0 * sampled.params.noise_multiplier);
}

/// With both a noise multiplier and a budget, rounds run while the next
/// fits; a budget below one round is refused at creation.
#[test]
fn a_given_noise_multiplier_runs_until_the_budget() {
    let given = PrivacySpec { noise_multiplier: Some(2.0), epsilon: Some(3.0), sample_rate: None, ..spec() };
    let plan = given.plan(100, 40, 1_000, 1_000, false).unwrap();
    assert_eq!(plan.params.noise_multiplier, 2.0);
    let last = (0..1_000).find(|&r| !plan.allows(r)).unwrap();
    assert!(plan.epsilon_after(last) <= 3.0 && plan.epsilon_after(last + 1) > 3.0, "stops after {last}");
    assert!(last >= 1);
    let tiny = PrivacySpec { epsilon: Some(0.01), ..given };
    let Err(error) = tiny.plan(100, 40, 1_000, 10, false) else { panic!("a budget below one round") };
    assert!(error.to_string().contains("too small for a single round"), "{error}");
    let Err(error) = PrivacySpec { epsilon: Some(1e-6), noise_multiplier: None, ..spec() }
        .plan(100, 40, 1_000, 100, false)
    else {
        panic!("an unreachable budget")
    };
    assert!(error.to_string().contains("no noise multiplier"), "{error}");
}

#[test]
fn fields_out_of_range_are_refused_with_their_name() {
    let cases: Vec<(PrivacySpec, &str)> = vec![
        (PrivacySpec { epsilon: Some(0.0), ..spec() }, "privacy.epsilon"),
        (PrivacySpec { epsilon: Some(f64::NAN), ..spec() }, "privacy.epsilon"),
        (PrivacySpec { epsilon: Some(MAX_EPSILON * 2.0), ..spec() }, "privacy.epsilon"),
        (PrivacySpec { delta: 0.0, ..spec() }, "privacy.delta"),
        (PrivacySpec { delta: 0.5, ..spec() }, "privacy.delta"),
        (PrivacySpec { clip_norm: 0.0, ..spec() }, "privacy.clip_norm"),
        (PrivacySpec { clip_norm: f32::INFINITY, ..spec() }, "privacy.clip_norm"),
        (PrivacySpec { epsilon: None, noise_multiplier: None, ..spec() }, "privacy"),
        (PrivacySpec { noise_multiplier: Some(-1.0), ..spec() }, "privacy.noise_multiplier"),
        (PrivacySpec { sample_rate: Some(0.0), ..spec() }, "privacy.sample_rate"),
        (PrivacySpec { sample_rate: Some(1.5), ..spec() }, "privacy.sample_rate"),
        (PrivacySpec { bits: 7, ..spec() }, "privacy.bits"),
        (PrivacySpec { bits: 33, ..spec() }, "privacy.bits"),
    ];
    for (bad, field) in cases {
        match bad.validate() {
            Err(SpecError::Field { field: named, .. }) => assert_eq!(named, field, "{bad:?}"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    assert!(spec().validate().is_ok());
}

/// A ring too narrow for the noise of the group is refused: the mechanism
/// cannot be carried.
#[test]
fn a_ring_too_small_for_the_mechanism_is_refused() {
    let narrow = PrivacySpec { bits: 8, epsilon: Some(0.5), sample_rate: None, ..spec() };
    let Err(error) = narrow.plan(1_000, 10, 100_000, 100, false) else {
        panic!("8 bits for 1 000 noisy clients")
    };
    assert!(error.to_string().contains("privacy.bits"), "{error}");
}
