//! Runs a whole round in memory: one server and n clients exchanging
//! encoded messages, with clients vanishing at chosen stages.
//!
//! Used by the tests and by `cohort bench secagg`. Every message goes through
//! the binary encoding, so byte counts are those a transport would carry.
//! The core has no clock: callers that want timings pass a [`Stopwatch`].

use std::sync::Arc;

use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

use crate::client::Client;
use crate::config::RoundConfig;
use crate::error::ProtocolError;
use crate::ids::ClientId;
use crate::messages::{ClientMessage, ServerMessage};
use crate::quantize::QuantizedInput;
use crate::server::{Advanced, Aggregate, ServerRound};
use crate::signature::IdentityKey;

/// Measures how long a closure takes, in milliseconds.
pub trait Stopwatch: Sync {
    /// Runs `f` and returns its result and the elapsed milliseconds.
    fn time<T>(&self, f: impl FnOnce() -> T) -> (T, f64);
}

/// A stopwatch that measures nothing (always 0 ms).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoStopwatch;

impl Stopwatch for NoStopwatch {
    fn time<T>(&self, f: impl FnOnce() -> T) -> (T, f64) {
        (f(), 0.0)
    }
}

/// Which clients vanish, and when.
#[derive(Debug, Clone, Default)]
pub struct DropoutPlan {
    /// Never advertise keys.
    pub before_keys: Vec<ClientId>,
    /// Advertise keys, then vanish.
    pub after_keys: Vec<ClientId>,
    /// Send their shares, then vanish (the server must recover their masks).
    pub after_shares: Vec<ClientId>,
    /// Send their masked input, then vanish before unmasking.
    pub after_masked_input: Vec<ClientId>,
    /// Sign the survivor list, then vanish (active variant).
    pub after_consistency: Vec<ClientId>,
}

/// What one client sent, received and spent.
#[derive(Debug, Clone, Default)]
pub struct ClientReport {
    /// The client.
    pub id: Option<ClientId>,
    /// Encoded bytes sent.
    pub bytes_up: u64,
    /// Encoded bytes received.
    pub bytes_down: u64,
    /// Time spent decoding, computing and encoding, from the client's
    /// quantized input on (making the input is not counted).
    pub busy_ms: f64,
    /// Whether the client completed the round.
    pub finished: bool,
}

/// The result of a simulated round.
#[derive(Debug)]
pub struct SimulationOutcome {
    /// The unmasked sum and its contributors.
    pub aggregate: Aggregate,
    /// Per-client reports, in id order.
    pub clients: Vec<ClientReport>,
    /// Server time: decoding, state transitions, unmasking and encoding.
    pub server_ms: f64,
    /// The part of `server_ms` spent closing the last stage: reconstructing
    /// the secrets and removing the masks.
    pub unmasking_ms: f64,
    /// Time to close each stage, in order (the ShareKeys one verifies the
    /// norm proofs of a validated round; the last one is `unmasking_ms`).
    pub advance_ms: Vec<f64>,
}

/// A round to simulate.
pub struct Simulation<'a> {
    /// The round parameters.
    pub config: RoundConfig,
    /// Identity keys of clients `1..=n` (active variant), else empty.
    pub identities: Vec<Arc<IdentityKey>>,
    /// Who drops out when.
    pub plan: DropoutPlan,
    /// Each client's quantized input; called once per starting client.
    pub inputs: &'a (dyn Fn(ClientId) -> QuantizedInput + Sync),
    /// Seed of the clients' random generators.
    pub seed: u64,
    /// Changes a client's reply before it is sent (a simulated cheater:
    /// `cohort simulate --malicious`); `None` for honest clients.
    pub tamper: Option<Tamper<'a>>,
}

/// A simulated cheater's change to its reply of a stage.
pub type Tamper<'a> = &'a (dyn Fn(ClientId, &mut ClientMessage) + Sync);

/// What a cheating client adds to its masked input after proving its
/// honest update: the attacks `cohort simulate --malicious` and the
/// participant's `adversary` feature measure input validation with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attack {
    /// Half the ring on every coordinate: the largest shift of the sum one
    /// input can make, as an update scaled far past the clip would (no
    /// honest quantizer can produce it).
    Scaled,
    /// A uniformly random element of the ring on every coordinate: a
    /// random update of any size.
    Random,
}

impl core::str::FromStr for Attack {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Attack::Scaled, Attack::Random]
            .into_iter()
            .find(|attack| attack.name() == s)
            .ok_or_else(|| format!("unknown attack {s:?} (scaled, random)"))
    }
}

impl Attack {
    /// The attack's name, as parsed from the command line.
    pub fn name(self) -> &'static str {
        match self {
            Attack::Scaled => "scaled",
            Attack::Random => "random",
        }
    }

    /// Changes `message` if it is a masked input.
    pub fn apply(self, message: &mut ClientMessage, rng: &mut impl rand_core::Rng) {
        let ClientMessage::MaskedInput { vector, .. } = message else { return };
        let mask = if vector.bits >= 32 { u32::MAX } else { (1u32 << vector.bits) - 1 };
        for value in &mut vector.values {
            let shift = match self {
                Attack::Scaled => (mask >> 1) + 1,
                Attack::Random => rng.next_u32(),
            };
            *value = value.wrapping_add(shift) & mask;
        }
    }
}

struct Slot {
    id: ClientId,
    state: Option<Client>,
    rng: ChaCha20Rng,
    outgoing: Option<Vec<u8>>,
    report: ClientReport,
}

#[cfg(feature = "parallel")]
fn for_each_slot(slots: &mut [Slot], f: impl Fn(&mut Slot) + Sync + Send) {
    use rayon::prelude::*;
    slots.par_iter_mut().for_each(f);
}

#[cfg(not(feature = "parallel"))]
fn for_each_slot(slots: &mut [Slot], f: impl Fn(&mut Slot) + Sync + Send) {
    slots.iter_mut().for_each(f);
}

/// Where [`Simulation::drive`] stopped.
enum Stopped {
    Finished(SimulationOutcome),
    ReadyToUnmask(ServerRound),
}

impl Simulation<'_> {
    /// Runs the round to completion.
    pub fn run(&self, stopwatch: &impl Stopwatch) -> Result<SimulationOutcome, ProtocolError> {
        match self.drive(stopwatch, false)? {
            Stopped::Finished(outcome) => Ok(outcome),
            Stopped::ReadyToUnmask(_) => unreachable!("drive stops early only when asked to"),
        }
    }

    /// Runs the round until the server holds every unmasking share and
    /// returns it; its [`ServerRound::advance`] then performs the unmasking.
    pub fn run_to_unmasking(&self) -> Result<ServerRound, ProtocolError> {
        match self.drive(&NoStopwatch, true)? {
            Stopped::ReadyToUnmask(server) => Ok(server),
            Stopped::Finished(_) => unreachable!("the unmasking stage always precedes the end"),
        }
    }

    fn drive(
        &self,
        stopwatch: &impl Stopwatch,
        stop_before_unmasking: bool,
    ) -> Result<Stopped, ProtocolError> {
        let n = self.config.clients as usize;
        let (server, mut server_ms) = stopwatch.time(|| ServerRound::new(self.config.clone()));
        let mut server = server?;
        let mut slots: Vec<Slot> = (0..n)
            .map(|index| {
                let id = ClientId::from_index(index);
                Slot {
                    id,
                    state: None,
                    rng: ChaCha20Rng::seed_from_u64(self.seed ^ (u64::from(id.get()) << 32)),
                    outgoing: None,
                    report: ClientReport { id: Some(id), ..ClientReport::default() },
                }
            })
            .collect();
        let setup = server.setup_message().encode();
        let failures = std::sync::Mutex::new(Vec::new());
        for_each_slot(&mut slots, |slot| {
            if self.plan.before_keys.contains(&slot.id) {
                return;
            }
            let identity = self.identities.get(slot.id.index()).cloned();
            let input = (self.inputs)(slot.id);
            let (started, ms) = stopwatch.time(|| {
                let message = ServerMessage::decode(&setup)?;
                let (state, reply) = Client::start(message, slot.id, identity, input, &mut slot.rng)?;
                Ok::<_, ProtocolError>((state, reply.encode()))
            });
            slot.report.busy_ms += ms;
            slot.report.bytes_down += setup.len() as u64;
            match started {
                Ok((state, reply)) => {
                    slot.report.bytes_up += reply.len() as u64;
                    slot.state = Some(state);
                    slot.outgoing = Some(reply);
                }
                Err(error) => push(&failures, error),
            }
        });
        take_failure(&failures)?;
        let drops = [
            &self.plan.after_keys,
            &self.plan.after_shares,
            &self.plan.after_masked_input,
            &self.plan.after_consistency,
        ];
        let mut stage = 0;
        let mut advance_ms = Vec::new();
        let (aggregate, unmasking_ms) = loop {
            // The server reads everything that was sent.
            // The messages are the clients' buffers: freeing them after the
            // server read them is not the server's work.
            let outgoing: Vec<(ClientId, Vec<u8>)> =
                slots.iter_mut().filter_map(|slot| Some((slot.id, slot.outgoing.take()?))).collect();
            let (received, ms) = stopwatch.time(|| {
                for (id, bytes) in &outgoing {
                    server.receive_encoded(*id, bytes)?;
                }
                Ok::<_, ProtocolError>(())
            });
            server_ms += ms;
            drop(outgoing);
            received?;
            if stop_before_unmasking && server.stage() == crate::error::Stage::Unmasking {
                return Ok(Stopped::ReadyToUnmask(server));
            }
            if let Some(vanishing) = drops.get(stage) {
                for slot in slots.iter_mut().filter(|slot| vanishing.contains(&slot.id)) {
                    slot.state = None;
                }
            }
            stage += 1;
            let (advanced, ms) = stopwatch.time(|| server.advance());
            server_ms += ms;
            advance_ms.push(ms);
            let next = match advanced? {
                Advanced::Done(aggregate) => break (aggregate, ms),
                Advanced::Next(next) => next,
            };
            server = next;
            let (deliveries, ms) = stopwatch.time(|| {
                slots
                    .iter()
                    .map(|slot| {
                        slot.state.as_ref().and_then(|_| server.message_for(slot.id)).map(|m| m.encode())
                    })
                    .collect::<Vec<_>>()
            });
            server_ms += ms;
            for (slot, delivery) in slots.iter_mut().zip(&deliveries) {
                if delivery.is_none() {
                    slot.state = None;
                }
            }
            let deliveries = &deliveries;
            for_each_slot(&mut slots, |slot| {
                let (Some(state), Some(bytes)) = (slot.state.take(), &deliveries[slot.id.index()]) else {
                    return;
                };
                let ((next, reply), ms) = stopwatch.time(|| match ServerMessage::decode(bytes) {
                    Ok(message) => {
                        let (next, reply) = state.handle(message, &mut slot.rng);
                        let reply = reply.map(|mut reply| {
                            if let Some(tamper) = self.tamper {
                                tamper(slot.id, &mut reply);
                            }
                            reply.encode()
                        });
                        (next, reply)
                    }
                    Err(error) => (state, Err(ProtocolError::from(error))),
                });
                slot.report.busy_ms += ms;
                slot.report.bytes_down += bytes.len() as u64;
                match reply {
                    Ok(reply) => {
                        slot.report.bytes_up += reply.len() as u64;
                        slot.report.finished = matches!(next, Client::Finished);
                        slot.state = Some(next);
                        slot.outgoing = Some(reply);
                    }
                    Err(error) => push(&failures, error),
                }
            });
            take_failure(&failures)?;
        };
        Ok(Stopped::Finished(SimulationOutcome {
            aggregate,
            clients: slots.into_iter().map(|slot| slot.report).collect(),
            server_ms,
            unmasking_ms,
            advance_ms,
        }))
    }
}

fn push(failures: &std::sync::Mutex<Vec<ProtocolError>>, error: ProtocolError) {
    if let Ok(mut list) = failures.lock() {
        list.push(error);
    }
}

fn take_failure(failures: &std::sync::Mutex<Vec<ProtocolError>>) -> Result<(), ProtocolError> {
    match failures.lock() {
        Ok(mut list) if !list.is_empty() => Err(list.remove(0)),
        _ => Ok(()),
    }
}

/// Σ inputs(u) over `contributors`, modulo 2^bits: what the aggregate must equal.
pub fn plain_sum(
    config: &RoundConfig,
    contributors: &[ClientId],
    inputs: &(dyn Fn(ClientId) -> QuantizedInput + Sync),
) -> Vec<u32> {
    // A validated round's aggregate holds the committed part only.
    let len = match crate::validation::RoundValidation::new(config) {
        Ok(Some(validation)) => validation.dimension(),
        _ => config.vector_len as usize,
    };
    let mut sum = vec![0u32; len];
    for &id in contributors {
        for (total, value) in sum.iter_mut().zip(inputs(id).values()) {
            *total = total.wrapping_add(*value);
        }
    }
    let modulus = config.modulus_mask();
    sum.iter().map(|v| v & modulus).collect()
}

#[cfg(test)]
mod tests {
    use super::Attack;

    #[test]
    fn an_attack_is_parsed_from_its_name_and_nothing_else() {
        for attack in [Attack::Scaled, Attack::Random] {
            assert_eq!(attack.name().parse::<Attack>(), Ok(attack));
        }
        assert!("Scaled".parse::<Attack>().is_err());
        assert!("".parse::<Attack>().is_err());
    }
}
