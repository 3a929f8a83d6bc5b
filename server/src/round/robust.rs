//! Robust rules across a round's group sums (a task's
//! `validation.group_rule`): a cheap first layer beside the norm proofs.
//! A round of several secure-aggregation groups gives the coordinator each
//! group's mean, never a client's update; these rules combine the means so
//! that one group holding a poisoned update moves the model less.
//!
//! - [`GroupRule::Norm`]: a group whose mean update is longer (L2) than the
//!   rule's `max` is left out of the round's sum.
//! - [`GroupRule::Median`]: the coordinate-wise median of the groups' means.
//! - [`GroupRule::TrimmedMean`]: per coordinate, the mean of the groups'
//!   means after the `trim` fraction at each end is dropped.
//!
//! The median and the trimmed mean ignore the groups' example counts (a
//! count is what a poisoned group could inflate); with fewer than three
//! groups there is nothing to outvote, and the weighted mean is used.

pub use crate::spec::GroupRule;

/// The L2 norm of a mean update.
pub fn norm(mean: &[f32]) -> f64 {
    mean.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt()
}

/// Per coordinate, the median of `means` (the mean of the two middle values
/// for an even number).
pub fn coordinate_median(means: &[&[f32]]) -> Vec<f32> {
    combine(means, |column| {
        let n = column.len();
        if n % 2 == 1 { column[n / 2] } else { (column[n / 2 - 1] + column[n / 2]) / 2.0 }
    })
}

/// Per coordinate, the mean of `means` after ⌊trim·g⌋ of the g values are
/// dropped at each end (`trim` in [0, ½)).
pub fn trimmed_mean(means: &[&[f32]], trim: f32) -> Vec<f32> {
    let drop =
        ((f64::from(trim) * means.len() as f64).floor() as usize).min(means.len().saturating_sub(1) / 2);
    combine(means, |column| {
        let kept = &column[drop..column.len() - drop];
        kept.iter().sum::<f64>() / kept.len() as f64
    })
}

/// Applies `statistic` to each coordinate's values across `means`, sorted.
fn combine(means: &[&[f32]], statistic: impl Fn(&[f64]) -> f64) -> Vec<f32> {
    let Some(first) = means.first() else { return Vec::new() };
    let mut column = Vec::with_capacity(means.len());
    (0..first.len())
        .map(|j| {
            column.clear();
            column.extend(means.iter().map(|m| f64::from(m[j])));
            column.sort_by(f64::total_cmp);
            statistic(&column) as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_and_the_trimmed_mean_known_answers() {
        let a = [1.0, -4.0, 0.0];
        let b = [2.0, 5.0, 0.0];
        let c = [100.0, 6.0, 0.0];
        let d = [3.0, -1000.0, 8.0];
        assert_eq!(coordinate_median(&[&a, &b, &c]), vec![2.0, 5.0, 0.0]);
        assert_eq!(coordinate_median(&[&a, &b, &c, &d]), vec![2.5, 0.5, 0.0]);
        // Five groups, a fifth trimmed: one value dropped at each end.
        let e = [4.0, 7.0, 1.0];
        assert_eq!(trimmed_mean(&[&a, &b, &c, &d, &e], 0.2), vec![3.0, 7.0 / 3.0, 1.0 / 3.0]);
        // Nothing trimmed: the plain mean.
        assert_eq!(trimmed_mean(&[&a, &b], 0.0), vec![1.5, 0.5, 0.0]);
        // A trim that would drop everything keeps the middle.
        assert_eq!(trimmed_mean(&[&a, &b, &c], 0.49), vec![2.0, 5.0, 0.0]);
        assert_eq!(norm(&[3.0, 4.0]), 5.0);
    }

    #[test]
    fn one_poisoned_group_moves_the_median_by_less_than_the_mean() {
        let honest: Vec<Vec<f32>> = (0..6).map(|k| vec![0.1 * k as f32; 4]).collect();
        let poisoned = vec![1.0e6f32; 4];
        let mut means: Vec<&[f32]> = honest.iter().map(Vec::as_slice).collect();
        means.push(&poisoned);
        let median = coordinate_median(&means);
        let trimmed = trimmed_mean(&means, 0.2);
        assert!(median.iter().all(|v| (0.0..=0.5).contains(v)), "{median:?}");
        assert!(trimmed.iter().all(|v| (0.0..=0.5).contains(v)), "{trimmed:?}");
    }
}
