//! The secure-aggregation round as the participant runs it: the stage
//! messages, the policy and pinning checks of a round's setup, and the
//! round's end.

use std::sync::Arc;

use chacha20::ChaCha20Rng;
use cohort_crypto::client::{Deferred, PendingStep};
use cohort_crypto::signature::IdentityKey;
use cohort_crypto::{Client, ClientId, ClientMessage, ProtocolError, Quantizer, ServerMessage};
use rand_core::SeedableRng;
use zeroize::Zeroizing;

pub use cohort_crypto::MetricValues;
pub use cohort_crypto::policy::{PolicyViolation, TaskSecurity};

use super::outcome::*;
use super::state::*;
use super::{Participant, Phase, Protocol};

impl Participant {
    pub(super) fn on_server_message(
        &mut self,
        round: u64,
        client_id: u32,
        protocol: Protocol,
        bytes: &[u8],
    ) -> Result<(), ParticipantError> {
        let message = match ServerMessage::decode(bytes) {
            Ok(message) => message,
            Err(e) => {
                self.abandon(format!("undecodable server message: {e}"));
                return Ok(());
            }
        };
        let step = match protocol {
            Protocol::Pending { update, examples } => {
                if let Err(violation) = self.admit(round, client_id, &message) {
                    drop(update);
                    if violation.round_only() {
                        self.end_round(RoundOutcome::Refused { report: self.report, violation });
                        return Ok(());
                    }
                    self.round_rng = None;
                    self.metrics = MetricValues::new();
                    return Err(ParticipantError::Policy(violation));
                }
                // Every round starts from a fresh generator.
                self.round_rng = None;
                let seeder = &mut self.seeder;
                let rng = self.round_rng.get_or_insert_with(|| round_generator(seeder));
                let identity = self.saved.as_ref().and_then(SavedState::identity);
                start(message, client_id, identity, (&update, examples, &self.metrics), rng)
            }
            Protocol::Running(client) => {
                let seeder = &mut self.seeder;
                let rng = self.round_rng.get_or_insert_with(|| round_generator(seeder));
                let deferred = if self.host_crypto {
                    client.handle_deferred(message, rng)
                } else {
                    Deferred::Done(client.handle(message, rng))
                };
                match deferred {
                    Deferred::Done(step) => done(step),
                    Deferred::Pending(pending) => {
                        self.host_steps += 1;
                        self.phase = Phase::HostWork { round, client_id, pending: Box::new(pending) };
                        return Ok(());
                    }
                }
            }
        };
        self.after_step(round, client_id, step);
        Ok(())
    }

    /// Takes the pending step on with `work` (the driver's results, or its
    /// completion).
    pub(super) fn continue_host_work(
        &mut self,
        work: impl FnOnce(PendingStep, &mut ChaCha20Rng) -> Deferred,
    ) -> Result<(), ParticipantError> {
        let Phase::HostWork { round, client_id, pending } =
            std::mem::replace(&mut self.phase, Phase::Finished)
        else {
            return Err(ParticipantError::OutOfOrder("no host work is pending"));
        };
        let seeder = &mut self.seeder;
        let rng = self.round_rng.get_or_insert_with(|| round_generator(seeder));
        match work(*pending, rng) {
            Deferred::Done(step) => self.after_step(round, client_id, done(step)),
            Deferred::Pending(pending) => {
                self.host_steps += 1;
                self.phase = Phase::HostWork { round, client_id, pending: Box::new(pending) };
            }
        }
        Ok(())
    }

    /// The reply of a step taken: posted next, or the round abandoned.
    fn after_step(
        &mut self,
        round: u64,
        client_id: u32,
        step: Result<(Box<Client>, ClientMessage), StepError>,
    ) {
        match step {
            #[allow(unused_mut)] // Changed only by a cheating participant.
            Ok((client, mut reply)) => {
                #[cfg(feature = "adversary")]
                if let (Some(attack), Some(rng)) = (self.attack, self.round_rng.as_mut()) {
                    attack.apply(&mut reply, rng);
                }
                if matches!(reply, ClientMessage::MaskedInput { .. })
                    && let Some(saved) = &mut self.saved
                {
                    // Recorded (and saved by the driver) before it is sent.
                    saved.record_contribution(round, self.trained_on.take(), self.spending.take());
                }
                let body = Zeroizing::new(reply.encode());
                self.phase = Phase::Post { round, client_id, protocol: Protocol::Running(client), body };
            }
            Err(e) => self.abandon(format!("protocol: {e}")),
        }
    }

    /// Checks a round's setup against the selection, the contributions
    /// made so far, the parameters pinned at enrollment and the policy,
    /// before anything of the round is drawn or revealed. A state saved
    /// before pinning pins this round's parameters.
    fn admit(&mut self, round: u64, client_id: u32, message: &ServerMessage) -> Result<(), PolicyViolation> {
        let ServerMessage::Setup(config) = message else {
            return Ok(()); // `start` refuses anything but a setup.
        };
        if config.round != round {
            return Err(PolicyViolation::WrongRound { expected: round, got: config.round });
        }
        if self.selected_session.is_some_and(|session| session != config.session) {
            return Err(PolicyViolation::WrongSession);
        }
        let Some(saved) = &mut self.saved else {
            return Err(PolicyViolation::Invalid("a round before enrollment".into()));
        };
        let last = saved.last_contributed_round;
        if last > 0 && config.round <= last {
            return Err(PolicyViolation::Replayed { round: config.round, last });
        }
        // A round that names its model names the one this client trained
        // from; one that names none is refused below if the task pinned it.
        if let Some(announced) = config.model
            && self.trained_on != Some(announced)
        {
            return Err(PolicyViolation::WrongModel {
                announced: hex::encode(announced),
                served: self.trained_on.map_or_else(|| "none".into(), hex::encode),
            });
        }
        let announced = TaskSecurity::of_round(config)?;
        saved.security.get_or_insert(announced).compare(&announced)?;
        self.config.policy.check(&announced)?;
        if config.variant == cohort_crypto::Variant::Active {
            let listed = (client_id as usize).checked_sub(1).and_then(|i| config.identities.get(i));
            let ours = saved.identity().map(|key| key.public_key());
            if ours.is_none() || listed != ours.as_ref() {
                return Err(PolicyViolation::NotOurIdentity);
            }
        }
        Ok(())
    }

    pub(super) fn after_post(&mut self, round: u64, client_id: u32, protocol: Protocol) {
        if matches!(&protocol, Protocol::Running(client) if matches!(**client, Client::Finished)) {
            if let Some(saved) = &mut self.saved {
                saved.last_completed_round = round;
                saved.last_session.clone_from(&self.last_joined);
            }
            self.end_round(RoundOutcome::Completed(self.report));
        } else {
            self.phase = Phase::Fetch { round, client_id, protocol, since: None };
        }
    }

    pub(super) fn abandon(&mut self, reason: String) {
        self.end_round(RoundOutcome::Abandoned { report: self.report, reason });
    }

    /// Queues the outcome, then the plaintext metrics report if the round
    /// asked for one, ran the semi-honest variant, and the update went
    /// through.
    pub(super) fn end_round(&mut self, outcome: RoundOutcome) {
        // The round's generator goes with it (zeroized on drop).
        self.round_rng = None;
        self.trained_on = None;
        self.spending = None;
        let report = *outcome.report();
        let metrics = std::mem::take(&mut self.metrics);
        let semi_honest = self
            .saved
            .as_ref()
            .and_then(|saved| saved.security)
            .is_some_and(|security| security.variant == cohort_crypto::Variant::SemiHonest);
        self.phase = match &outcome {
            RoundOutcome::Completed(_) if self.plaintext_metrics && semi_honest && !metrics.is_empty() => {
                let mut fields = match serde_json::to_value(metrics) {
                    Ok(serde_json::Value::Object(fields)) => fields,
                    _ => serde_json::Map::new(),
                };
                fields.insert("bytes_up".into(), report.bytes_up.into());
                fields.insert("bytes_down".into(), report.bytes_down.into());
                let body = serde_json::json!({ "round": report.round, "kind": "train", "metrics": fields });
                Phase::Report { body: body.to_string().into_bytes() }
            }
            _ => Phase::CheckIn,
        };
        self.plaintext_metrics = false;
        self.events.push_back(Action::RoundEnded(outcome));
    }
}

/// Why a stage of the round could not be taken; the participant abandons
/// the round with this reason.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error("expected the setup, got the {0} message")]
    NotSetup(cohort_crypto::Stage),
    #[error("the coordinator assigned client id 0")]
    ZeroClientId,
    #[error(transparent)]
    Config(#[from] cohort_crypto::ConfigError),
    #[error(transparent)]
    Quantize(#[from] cohort_crypto::quantize::QuantizeError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
}

/// Quantizes the update for the round's parameters and opens the protocol.
fn start(
    setup: ServerMessage,
    client_id: u32,
    identity: Option<Arc<IdentityKey>>,
    (update, examples, metrics): (&[f32], u32, &MetricValues),
    rng: &mut ChaCha20Rng,
) -> Result<(Box<Client>, ClientMessage), StepError> {
    let ServerMessage::Setup(config) = &setup else {
        return Err(StepError::NotSetup(setup.stage()));
    };
    let quantizer = Quantizer::new(config.quantization, config.modulus_bits, config.clients)?;
    let input = quantizer.encode_with_metrics(update, examples, metrics, rng)?;
    let me = ClientId::new(client_id).ok_or(StepError::ZeroClientId)?;
    let (client, reply) = Client::start(setup, me, identity, input, rng)?;
    Ok((Box::new(client), reply))
}

/// A step done: the next state and the reply, or why the round ends.
fn done(
    (client, reply): cohort_crypto::client::ClientStep,
) -> Result<(Box<Client>, ClientMessage), StepError> {
    reply.map(|reply| (Box::new(client), reply)).map_err(StepError::from)
}

/// A fresh generator for a round (see [`fresh_seed`]).
fn round_generator(seeder: &mut Option<ChaCha20Rng>) -> ChaCha20Rng {
    ChaCha20Rng::from_seed(*fresh_seed(seeder))
}
