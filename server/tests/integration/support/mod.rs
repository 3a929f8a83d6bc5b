//! What the coordinator's integration tests share beyond the workspace's
//! test kit (`cohort_tests::Serve`, `cohort_tests::AdminClient`): a
//! trainer with a fixed update, and a tampering proxy.

#![allow(dead_code, clippy::unwrap_used)]

/// A client that hands in the same update every round, whatever the model.
pub struct Steady {
    pub delta: Vec<f32>,
    pub examples: u32,
    pub metrics: cohort_client::participant::MetricValues,
}

impl cohort_client::runtime::Trainer for Steady {
    fn train(
        &mut self,
        _: cohort_client::runtime::Contribution,
        _: &cohort_client::checkpoint::Checkpoint,
    ) -> Result<cohort_client::runtime::LocalUpdate, cohort_client::runtime::UpdateError> {
        Ok(cohort_client::runtime::LocalUpdate {
            delta: self.delta.clone(),
            examples: self.examples,
            metrics: self.metrics,
        })
    }
}
