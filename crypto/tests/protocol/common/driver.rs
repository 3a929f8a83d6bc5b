//! Drives one round stage by stage with every message visible as bytes, so
//! tests can drop, duplicate, replay, alter or redirect them.

#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

use cohort_crypto::signature::IdentityKey;
use cohort_crypto::{
    Advanced, Aggregate, Client, ClientId, ClientMessage, ProtocolError, QuantizedInput, RoundConfig,
    ServerMessage, ServerRound,
};
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

use super::{id, input_for};

pub struct Driver {
    pub config: RoundConfig,
    pub server: Option<ServerRound>,
    pub clients: Vec<Option<Client>>,
    pub rngs: Vec<ChaCha20Rng>,
    /// Encoded messages waiting to reach the server, by client index.
    pub outbox: Vec<Option<Vec<u8>>>,
    pub seed: u64,
}

impl Driver {
    /// Every client starts; their AdvertiseKeys wait in the outbox.
    pub fn start(config: &RoundConfig, identities: &[Arc<IdentityKey>], seed: u64) -> Self {
        let server = ServerRound::new(config.clone()).unwrap();
        let setup = server.setup_message().encode();
        let n = config.clients as usize;
        let mut rngs: Vec<ChaCha20Rng> =
            (0..n).map(|i| ChaCha20Rng::seed_from_u64(seed * 7919 + i as u64)).collect();
        let mut clients = Vec::new();
        let mut outbox = Vec::new();
        for (i, rng) in rngs.iter_mut().enumerate() {
            let me = id(i as u32 + 1);
            let (state, message) = Client::start(
                ServerMessage::decode(&setup).unwrap(),
                me,
                identities.get(i).cloned(),
                input_for(config, seed, me),
                rng,
            )
            .unwrap();
            clients.push(Some(state));
            outbox.push(Some(message.encode()));
        }
        Self { config: config.clone(), server: Some(server), clients, rngs, outbox, seed }
    }

    /// Client `i` starts the round afresh with `input` (its first message
    /// dropped); the key stage closes, and its answer to the peers' keys
    /// (its ShareKeys, or why it refuses) comes back.
    pub fn share_keys_with(&mut self, i: u32, input: QuantizedInput) -> Result<ClientMessage, ProtocolError> {
        let index = i as usize - 1;
        let setup = self.server().setup_message();
        let (state, _) = Client::start(setup, id(i), None, input, &mut self.rngs[index])?;
        self.flush();
        self.advance()?;
        let peers = self.server().message_for(id(i)).ok_or(ProtocolError::Finished)?;
        state.handle(peers, &mut self.rngs[index]).1
    }

    pub fn server(&mut self) -> &mut ServerRound {
        self.server.as_mut().unwrap()
    }

    /// The server receives `bytes` from client `from`.
    pub fn send(&mut self, from: u32, bytes: &[u8]) -> Result<(), ProtocolError> {
        let message = ClientMessage::decode(bytes)?;
        self.server().receive(id(from), message)
    }

    /// The server receives everything in the outbox.
    pub fn flush(&mut self) {
        for i in 0..self.outbox.len() {
            if let Some(bytes) = self.outbox[i].take() {
                self.send(i as u32 + 1, &bytes).unwrap();
            }
        }
    }

    /// Client `i` vanishes.
    pub fn vanish(&mut self, i: u32) {
        self.clients[i as usize - 1] = None;
        self.outbox[i as usize - 1] = None;
    }

    pub fn advance(&mut self) -> Result<Option<Aggregate>, ProtocolError> {
        match self.server.take().unwrap().advance()? {
            Advanced::Next(next) => {
                self.server = Some(next);
                Ok(None)
            }
            Advanced::Done(aggregate) => Ok(Some(aggregate)),
        }
    }

    /// Hands server message `message` to client `i`; its reply goes to the outbox.
    pub fn deliver(&mut self, i: u32, message: ServerMessage) -> Result<(), ProtocolError> {
        let index = i as usize - 1;
        let state = self.clients[index].take().unwrap();
        let (next, reply) = state.handle(message, &mut self.rngs[index]);
        self.clients[index] = Some(next);
        self.outbox[index] = Some(reply?.encode());
        Ok(())
    }

    /// Every remaining client gets its message from the server.
    pub fn deliver_all(&mut self) {
        for i in 1..=self.clients.len() as u32 {
            if self.clients[i as usize - 1].is_none() {
                continue;
            }
            match self.server.as_ref().unwrap().message_for(ClientId::new(i).unwrap()) {
                Some(message) => self.deliver(i, message).unwrap(),
                None => self.vanish(i),
            }
        }
    }

    /// Flush, advance, deliver: one whole stage.
    pub fn stage(&mut self) -> Option<Aggregate> {
        self.flush();
        let done = self.advance().unwrap();
        if done.is_none() {
            self.deliver_all();
        }
        done
    }

    /// Runs the remaining stages to the aggregate.
    pub fn finish(&mut self) -> Aggregate {
        loop {
            if let Some(aggregate) = self.stage() {
                return aggregate;
            }
        }
    }
}
