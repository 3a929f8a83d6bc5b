//! Training metrics that travel inside the masked vector, so that the
//! coordinator learns only their sums over a round's survivors.
//!
//! A round announces a [`MetricSet`]: the metrics every client's vector has
//! room for. For each one the client appends, after the example count,
//! its value in fixed point ([`FRACTION_BITS`] fractional bits) as
//! base-(L + 1) digits, exactly as the example count is carried, and one
//! presence coordinate (1 if it reports the metric, 0 if not). After
//! unmasking, the coordinator has for each metric the sum of the reported
//! values and the number of survivors that reported it, and publishes
//! their quotient, the mean: never one client's value.
//!
//! A metric that only some clients report is averaged over those that do,
//! and their number is part of what the coordinator learns; clients of one
//! application report the same metrics, so the number is the survivors'.

use crate::error::QuantizeError;

/// Fractional bits of a metric in fixed point: a resolution of about 10⁻⁶.
pub const FRACTION_BITS: u32 = 20;

/// Largest loss carried; a larger loss counts as this (a diverged client's
/// loss is not worth a wider encoding).
pub const MAX_LOSS: f64 = 4096.0;

/// A number a client reports with its update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Metric {
    /// Mean training loss over the local epochs.
    TrainLoss,
    /// Training accuracy.
    TrainAccuracy,
    /// Loss of the global model on local data, before training.
    GlobalLoss,
    /// Accuracy of the global model on local data, before training.
    GlobalAccuracy,
    /// Loss on local held-out data.
    EvalLoss,
    /// Accuracy on local held-out data.
    EvalAccuracy,
}

impl Metric {
    /// Every metric, in the order of the vector.
    pub const ALL: [Metric; 6] = [
        Metric::TrainLoss,
        Metric::TrainAccuracy,
        Metric::GlobalLoss,
        Metric::GlobalAccuracy,
        Metric::EvalLoss,
        Metric::EvalAccuracy,
    ];

    /// The metric's name in reports and task specs.
    pub fn name(self) -> &'static str {
        match self {
            Metric::TrainLoss => "train_loss",
            Metric::TrainAccuracy => "train_accuracy",
            Metric::GlobalLoss => "global_loss",
            Metric::GlobalAccuracy => "global_accuracy",
            Metric::EvalLoss => "eval_loss",
            Metric::EvalAccuracy => "eval_accuracy",
        }
    }

    /// The metric of a name.
    pub fn from_name(name: &str) -> Option<Metric> {
        Metric::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Whether the metric is an accuracy (in [0, 1]) rather than a loss.
    pub fn is_accuracy(self) -> bool {
        matches!(self, Metric::TrainAccuracy | Metric::GlobalAccuracy | Metric::EvalAccuracy)
    }

    /// Largest value carried: 1 for an accuracy, [`MAX_LOSS`] for a loss.
    pub fn max(self) -> f64 {
        if self.is_accuracy() { 1.0 } else { MAX_LOSS }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// Largest fixed-point value.
    pub(crate) fn max_fixed(self) -> u64 {
        (self.max() * f64::from(1u32 << FRACTION_BITS)) as u64
    }
}

/// A fixed-point value (or a sum of them) as a number.
pub(crate) fn from_fixed(value: u128) -> f64 {
    value as f64 / f64::from(1u32 << FRACTION_BITS)
}

/// The metrics a round's vectors carry (part of the round configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MetricSet(u8);

impl MetricSet {
    /// No metrics: the vector is the update and the example count.
    pub const NONE: MetricSet = MetricSet(0);
    /// Every metric.
    pub const ALL: MetricSet = MetricSet((1 << Metric::ALL.len()) - 1);

    /// The set's wire encoding: one bit per metric, in [`Metric::ALL`]'s order.
    pub fn bits(self) -> u8 {
        self.0
    }

    /// The set of a wire encoding; `None` if a bit names no metric.
    pub fn from_bits(bits: u8) -> Option<MetricSet> {
        (bits & !Self::ALL.0 == 0).then_some(MetricSet(bits))
    }

    /// Whether the set holds `metric`.
    pub fn contains(self, metric: Metric) -> bool {
        self.0 & (1 << metric.index()) != 0
    }

    /// The set with `metric` added.
    #[must_use]
    pub fn with(self, metric: Metric) -> MetricSet {
        MetricSet(self.0 | 1 << metric.index())
    }

    /// The metrics of the set, in the order of the vector.
    pub fn iter(self) -> impl Iterator<Item = Metric> {
        Metric::ALL.into_iter().filter(move |m| self.contains(*m))
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl FromIterator<Metric> for MetricSet {
    fn from_iter<I: IntoIterator<Item = Metric>>(iter: I) -> Self {
        iter.into_iter().fold(MetricSet::NONE, MetricSet::with)
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for MetricSet {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for MetricSet {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let metrics = Vec::<Metric>::deserialize(deserializer)?;
        Ok(metrics.into_iter().collect())
    }
}

/// A set reads and writes as the array of its metrics' names.
#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for MetricSet {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ArrayBuilder::new()
            .items(<Metric as utoipa::PartialSchema>::schema())
            .unique_items(true)
            .max_items(Some(Metric::ALL.len()))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for MetricSet {}

/// One client's metrics for a round: individual values, so they have no
/// `Debug` that shows them. With the `serde` feature they read and write
/// as a JSON object of metric names and numbers (`{"train_loss": 0.4}`),
/// each value checked as [`set`](Self::set) checks it.
#[derive(Clone, Copy, Default, PartialEq)]
pub struct MetricValues([Option<f64>; Metric::ALL.len()]);

impl std::fmt::Debug for MetricValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let reported: Vec<&str> =
            Metric::ALL.iter().filter(|m| self.get(**m).is_some()).map(|m| m.name()).collect();
        f.debug_struct("MetricValues").field("reported", &reported).finish_non_exhaustive()
    }
}

impl MetricValues {
    /// No metric reported.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reports `value` for `metric`: finite and not negative, and an
    /// accuracy at most 1; a loss above [`MAX_LOSS`] counts as `MAX_LOSS`.
    pub fn set(&mut self, metric: Metric, value: f64) -> Result<(), QuantizeError> {
        if !value.is_finite() || value < 0.0 {
            return Err(QuantizeError::Metric {
                metric: metric.name(),
                reason: "must be finite and not negative",
            });
        }
        if metric.is_accuracy() && value > 1.0 {
            return Err(QuantizeError::Metric { metric: metric.name(), reason: "an accuracy is at most 1" });
        }
        self.0[metric.index()] = Some(value.min(metric.max()));
        Ok(())
    }

    /// The value reported for `metric`.
    pub fn get(&self, metric: Metric) -> Option<f64> {
        self.0[metric.index()]
    }

    /// Whether no metric is reported.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(Option::is_none)
    }

    /// `metric`'s value in fixed point, 0 when not reported.
    pub(crate) fn fixed(&self, metric: Metric) -> u64 {
        self.get(metric).map_or(0, |v| (v * f64::from(1u32 << FRACTION_BITS)).round() as u64)
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for MetricValues {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(Metric::ALL.into_iter().filter_map(|m| Some((m.name(), self.get(m)?))))
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for MetricValues {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let reported = std::collections::BTreeMap::<Metric, f64>::deserialize(deserializer)?;
        let mut values = MetricValues::new();
        for (metric, value) in reported {
            values.set(metric, value).map_err(serde::de::Error::custom)?;
        }
        Ok(values)
    }
}

/// What the coordinator learns of the metrics: per metric, the sum of the
/// survivors' values and how many of them reported it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MetricSums([Option<(f64, u32)>; Metric::ALL.len()]);

impl MetricSums {
    /// Sets `metric`'s sum and its number of reporters: how a sum that
    /// was decoded elsewhere (a group's, on another coordinator replica)
    /// is put back together.
    pub fn insert(&mut self, metric: Metric, sum: f64, reporters: u32) {
        self.0[metric.index()] = Some((sum, reporters));
    }

    /// The sum of `metric` over the survivors that reported it and their
    /// number; `None` when the round's vectors had no room for it.
    pub fn sum(&self, metric: Metric) -> Option<(f64, u32)> {
        self.0[metric.index()]
    }

    /// The mean of `metric` over the survivors that reported it; `None`
    /// when none did.
    pub fn mean(&self, metric: Metric) -> Option<f64> {
        self.sum(metric).filter(|(_, n)| *n > 0).map(|(sum, n)| sum / f64::from(n))
    }

    /// Adds `other`'s sums and reporters into these: the metrics of a
    /// round whose clients were aggregated in several groups. A metric
    /// one side has no room for keeps the other's sum.
    pub fn merge(&mut self, other: &MetricSums) {
        for (mine, theirs) in self.0.iter_mut().zip(other.0) {
            *mine = match (*mine, theirs) {
                (Some((a, m)), Some((b, n))) => Some((a + b, m.saturating_add(n))),
                (mine, theirs) => mine.or(theirs),
            };
        }
    }

    /// Each metric with a mean, its mean and its number of reporters.
    pub fn means(&self) -> impl Iterator<Item = (Metric, f64, u32)> + '_ {
        Metric::ALL.into_iter().filter_map(|m| Some((m, self.mean(m)?, self.sum(m)?.1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_sums_add_values_and_reporters() {
        let mut one = MetricSums::default();
        one.insert(Metric::TrainLoss, 3.0, 2);
        one.insert(Metric::EvalAccuracy, 0.5, 1);
        let mut two = MetricSums::default();
        two.insert(Metric::TrainLoss, 1.0, 2);
        two.insert(Metric::GlobalLoss, 4.0, 4);
        one.merge(&two);
        assert_eq!(one.sum(Metric::TrainLoss), Some((4.0, 4)));
        assert_eq!(one.mean(Metric::TrainLoss), Some(1.0));
        assert_eq!(one.sum(Metric::EvalAccuracy), Some((0.5, 1)));
        assert_eq!(one.sum(Metric::GlobalLoss), Some((4.0, 4)));
        assert_eq!(one.sum(Metric::TrainAccuracy), None);
    }

    #[test]
    fn names_and_bits_round_trip() {
        for metric in Metric::ALL {
            assert_eq!(Metric::from_name(metric.name()), Some(metric));
            assert!(MetricSet::ALL.contains(metric));
            assert!(!MetricSet::NONE.contains(metric));
        }
        assert_eq!(Metric::from_name("loss"), None);
        assert_eq!(MetricSet::ALL.bits(), 0b11_1111);
        assert_eq!(MetricSet::from_bits(0b100_0000), None);
        let set: MetricSet = [Metric::EvalAccuracy, Metric::TrainLoss].into_iter().collect();
        assert_eq!(set.iter().collect::<Vec<_>>(), [Metric::TrainLoss, Metric::EvalAccuracy]);
        assert_eq!(MetricSet::from_bits(set.bits()), Some(set));
    }

    #[test]
    fn values_are_checked_and_losses_capped() {
        let mut values = MetricValues::new();
        assert!(values.is_empty());
        assert!(values.set(Metric::TrainLoss, f64::NAN).is_err());
        assert!(values.set(Metric::TrainLoss, -0.1).is_err());
        assert!(values.set(Metric::EvalAccuracy, 1.01).is_err());
        values.set(Metric::EvalAccuracy, 1.0).unwrap();
        values.set(Metric::TrainLoss, 1e9).unwrap();
        assert_eq!(values.get(Metric::TrainLoss), Some(MAX_LOSS));
        assert_eq!(values.fixed(Metric::TrainLoss), Metric::TrainLoss.max_fixed());
        assert_eq!(values.fixed(Metric::EvalAccuracy), 1 << FRACTION_BITS);
        assert_eq!(values.fixed(Metric::GlobalLoss), 0);
        // The values never reach a log line.
        let debug = format!("{values:?}");
        assert!(debug.contains("train_loss") && !debug.contains("4096"), "{debug}");
    }

    #[test]
    fn means_are_over_the_reporters() {
        let mut sums = MetricSums::default();
        sums.insert(Metric::TrainLoss, 3.0, 4);
        sums.insert(Metric::EvalLoss, 0.0, 0);
        assert_eq!(sums.mean(Metric::TrainLoss), Some(0.75));
        assert_eq!(sums.mean(Metric::EvalLoss), None);
        assert_eq!(sums.sum(Metric::EvalLoss), Some((0.0, 0)));
        assert_eq!(sums.mean(Metric::GlobalLoss), None);
        assert_eq!(sums.means().collect::<Vec<_>>(), [(Metric::TrainLoss, 0.75, 4)]);
    }
}
