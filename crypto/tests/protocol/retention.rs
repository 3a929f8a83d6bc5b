//! Claim 3: the server keeps the running sum of the masked inputs, never
//! an individual vector. Measured with a counting global allocator: as the
//! masked inputs are received, the server must free them (all but the one
//! it may keep as the sum's first term), not hold or copy them.
//!
//! This file holds one test only, so that no other test allocates while it
//! measures.

use std::alloc::System;

use crate::common::config;
use crate::common::driver::Driver;
use cohort_crypto::graph::GraphSpec;
use cohort_crypto::{ClientId, ClientMessage};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[test]
fn the_server_keeps_the_running_sum_not_the_masked_inputs() {
    const CLIENTS: u32 = 24;
    const LEN: u32 = 50_000;
    let vector_bytes = 4 * LEN as i64;
    let config = config(CLIENTS, 13, GraphSpec::Complete, LEN, 32);
    let mut driver = Driver::start(&config, &[], 4);
    // Keys, then shares: every client's masked input is now in the outbox.
    driver.stage();
    driver.stage();
    let inputs: Vec<(ClientId, ClientMessage)> = (0..CLIENTS as usize)
        .map(|i| {
            let bytes = driver.outbox[i].take().unwrap();
            (ClientId::new(i as u32 + 1).unwrap(), ClientMessage::decode(&bytes).unwrap())
        })
        .collect();
    let server = driver.server.as_mut().unwrap();
    let region = Region::new(GLOBAL);
    for (from, message) in inputs {
        server.receive(from, message).unwrap();
    }
    let change = region.change();
    let retained = change.bytes_allocated as i64 - change.bytes_deallocated as i64;
    // Correct: every received vector freed, at most one vector's worth
    // allocated for the sum: retained ≈ −(CLIENTS − 1) vectors.
    assert!(
        retained < -(i64::from(CLIENTS) - 2) * vector_bytes,
        "the server retained {retained} bytes over {CLIENTS} masked inputs of {vector_bytes} bytes"
    );
    // And the round still completes with the exact sum.
    let aggregate = driver.finish();
    assert_eq!(aggregate.contributors.len(), CLIENTS as usize);
}
