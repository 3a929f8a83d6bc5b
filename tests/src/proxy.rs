//! A malicious coordinator for the hostile-coordinator suites: a proxy in
//! front of a real coordinator that rewrites its answers as scripted and
//! records every request each client makes. Shared by the native suite
//! (`server/tests/integration/malicious_coordinator.rs`) and the browser and
//! JVM one
//! (`tests/tests/e2e/hostile_clients.rs`).

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, Uri};
use cohort_client::participant::{Method, Request, Response, TaskSecurity};
use cohort_client::protocol::{ClientMessage, RoundConfig, ServerMessage, Stage};
use cohort_client::runtime::Transport;
use cohort_client::runtime::http::HttpTransport;
use serde_json::{Value, json};

/// One request a client made through the proxy, and the answer it got.
pub struct Exchange {
    pub bearer: Option<String>,
    pub method: axum::http::Method,
    /// The path, without its query (a held request's `wait_ms`).
    pub path: String,
    pub body: Vec<u8>,
    pub status: u16,
    pub reply: Vec<u8>,
}

/// Rewrites the coordinator's answer to a request before the client sees it.
pub type Tamper = Box<dyn FnMut(&Exchange, &mut Response) + Send>;

pub struct Script {
    upstream: String,
    tamper: Tamper,
    /// Every exchange, in order.
    pub log: Vec<Exchange>,
}

/// The malicious coordinator: forwards the client API to a real one and
/// tampers with the answers as scripted.
pub struct Proxy {
    runtime: Option<tokio::runtime::Runtime>,
    /// The URL clients are given.
    pub url: String,
    /// The script and its recording.
    pub script: Arc<Mutex<Script>>,
}

async fn forward(
    axum::extract::State(script): axum::extract::State<Arc<Mutex<Script>>>,
    method: axum::http::Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, Vec<u8>) {
    let bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_string);
    let content_type = match headers.get("content-type").and_then(|v| v.to_str().ok()) {
        Some("application/x-cohort-secagg") => Some("application/x-cohort-secagg"),
        _ => Some("application/json"),
    };
    let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let request = Request {
        method: if method == axum::http::Method::POST { Method::Post } else { Method::Get },
        path: path.clone(),
        body: body.to_vec(),
        content_type,
        bearer: bearer.clone(),
    };
    let upstream = script.lock().unwrap().upstream.clone();
    let answer =
        tokio::task::spawn_blocking(move || HttpTransport::new(&upstream).send(&request)).await.unwrap();
    let Ok(mut response) = answer else { return (StatusCode::BAD_GATEWAY, Vec::new()) };
    let mut script = script.lock().unwrap();
    let path = uri.path().to_string();
    let mut exchange =
        Exchange { bearer, method, path, body: body.to_vec(), status: response.status, reply: Vec::new() };
    (script.tamper)(&exchange, &mut response);
    exchange.reply = response.body.clone();
    script.log.push(exchange);
    (StatusCode::from_u16(response.status).unwrap(), response.body)
}

impl Proxy {
    pub fn start(upstream: &str, tamper: Tamper) -> Self {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let script = Arc::new(Mutex::new(Script { upstream: upstream.into(), tamper, log: Vec::new() }));
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = axum::Router::new().fallback(forward).with_state(script.clone());
        runtime.spawn(async move { axum::serve(listener, app).await });
        Self { runtime: Some(runtime), url, script }
    }

    /// What each client (by credential) posted to the round, per round, as
    /// stages.
    pub fn posted(&self) -> BTreeMap<String, Vec<Stage>> {
        let script = self.script.lock().unwrap();
        let mut posted: BTreeMap<String, Vec<Stage>> = BTreeMap::new();
        for exchange in &script.log {
            if exchange.method == axum::http::Method::POST && exchange.path == "/v1/round/message" {
                let stage = ClientMessage::decode(&exchange.body).unwrap().stage();
                posted.entry(exchange.bearer.clone().unwrap_or_default()).or_default().push(stage);
            }
        }
        posted
    }

    /// Every credential the coordinator handed out through the proxy.
    pub fn credentials(&self) -> Vec<String> {
        let script = self.script.lock().unwrap();
        script
            .log
            .iter()
            .filter(|e| e.path.ends_with("/enroll") && e.status == 201)
            .map(|e| {
                serde_json::from_slice::<Value>(&e.reply).unwrap()["credential"].as_str().unwrap().into()
            })
            .collect()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // The server task goes with the runtime.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Rewrites the setup of every round (`GET /v1/round/message` answered
/// with a setup) with `change`.
pub fn rewrite_setup(mut change: impl FnMut(&mut RoundConfig) + Send + 'static) -> Tamper {
    Box::new(move |exchange, response| {
        if exchange.path != "/v1/round/message" || response.status != 200 {
            return;
        }
        if let Ok(ServerMessage::Setup(mut config)) = ServerMessage::decode(&response.body) {
            change(&mut config);
            response.body = ServerMessage::Setup(config).encode();
        }
    })
}

/// Rewrites the `security` the enrollment reply announces.
pub fn rewrite_enrollment(change: impl Fn(&mut TaskSecurity) + Send + 'static) -> Tamper {
    Box::new(move |exchange, response| {
        if exchange.path.ends_with("/enroll") && response.status == 201 {
            let mut reply: Value = serde_json::from_slice(&response.body).unwrap();
            let mut security: TaskSecurity = serde_json::from_value(reply["security"].take()).unwrap();
            change(&mut security);
            reply["security"] = serde_json::to_value(security).unwrap();
            response.body = reply.to_string().into_bytes();
        }
    })
}

/// Rewrites the peer keys that `target` (the first client to fetch them)
/// receives with `change`.
pub fn rewrite_peer_keys(change: fn(&mut cohort_client::protocol::messages::AdvertisedKeys)) -> Tamper {
    let mut target: Option<String> = None;
    Box::new(move |exchange, response| {
        if exchange.path != "/v1/round/message" || response.status != 200 {
            return;
        }
        if let Ok(ServerMessage::PeerKeys { context, mut peers }) = ServerMessage::decode(&response.body) {
            let target = target.get_or_insert_with(|| exchange.bearer.clone().unwrap_or_default());
            if exchange.bearer.as_deref() == Some(target.as_str()) {
                change(&mut peers[0]);
                response.body = ServerMessage::PeerKeys { context, peers }.encode();
            }
        }
    })
}

/// The both-shares attack: tells the first client to fetch the survivor
/// list that another survivor dropped out, so that it would reveal that
/// client's mask-key shares while the others reveal its self-mask shares.
pub fn split_survivors() -> Tamper {
    let mut target: Option<String> = None;
    let mut ids: BTreeMap<String, u64> = BTreeMap::new();
    Box::new(move |exchange, response| {
        let bearer = exchange.bearer.clone().unwrap_or_default();
        if exchange.path == "/v1/checkin" && response.status == 200 {
            let reply: Value = serde_json::from_slice(&response.body).unwrap();
            if let Some(id) = reply["client_id"].as_u64() {
                ids.insert(bearer.clone(), id);
            }
        }
        if exchange.path != "/v1/round/message" || response.status != 200 {
            return;
        }
        if let Ok(ServerMessage::Survivors { context, mut survivors }) = ServerMessage::decode(&response.body)
        {
            let target = target.get_or_insert_with(|| bearer.clone());
            if &bearer == target {
                let own = ids[&bearer];
                let other = survivors.iter().position(|id| u64::from(id.get()) != own).unwrap();
                survivors.remove(other);
                response.body = ServerMessage::Survivors { context, survivors }.encode();
            }
        }
    })
}

/// The client the survivor list of [`split_survivors`] was cut for.
pub fn split_target(proxy: &Proxy, clients: usize) -> String {
    let script = proxy.script.lock().unwrap();
    let cut = script.log.iter().find(|e| {
        matches!(ServerMessage::decode(&e.reply), Ok(ServerMessage::Survivors { ref survivors, .. }) if survivors.len() < clients)
    });
    cut.unwrap().bearer.clone().unwrap()
}

/// Runs round 1 honestly, keeps its setup and, from round 2 on, announces
/// a re-run of round 1 (a fresh session, the same round and roster): the
/// sum of a re-run that lacks one client, subtracted from the first, would
/// be that client's update.
pub fn replay_round_one() -> Tamper {
    let mut first: Option<RoundConfig> = None;
    Box::new(move |exchange, response| {
        if exchange.path == "/v1/round/message" && response.status == 200 {
            if let Ok(ServerMessage::Setup(config)) = ServerMessage::decode(&response.body) {
                match &first {
                    None => first = Some(config),
                    Some(old) => {
                        let rerun = RoundConfig { session: config.session, ..old.clone() };
                        response.body = ServerMessage::Setup(rerun).encode();
                    }
                }
            }
        }
        if exchange.path == "/v1/checkin" && response.status == 200 && first.is_some() {
            let mut reply: Value = serde_json::from_slice(&response.body).unwrap();
            if reply["status"] == "selected" {
                reply["round"] = json!(1);
                response.body = reply.to_string().into_bytes();
            }
        }
    })
}
