//! The HTTP API without sockets: every endpoint and its error paths, and
//! a full secure-aggregation round driven by real protocol clients through
//! the router.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use cohort_crypto::Metric;
use cohort_crypto::testing::{ProtocolClient, weighted_mean};
use cohort_server::api::auth::token_hash;
use cohort_server::api::{SECAGG_CONTENT_TYPE, app};
use cohort_server::checkpoint;
use cohort_server::cluster::Replica;
use cohort_server::coordinator::Coordinator;
use cohort_server::metrics::Metrics;
use cohort_server::service::{ServiceConfig, app_state};
use cohort_server::store::{ParticipantRecord, SqlStore};
use cohort_tests::identity::{self as keys, Enrollment};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;

const ADMIN: &str = "admin-token-for-tests-0123456789";
const WASM_HEADER: &[u8] = b"\0asm\x01\0\0\0";

struct Api {
    router: Router,
    store: SqlStore,
    path: std::path::PathBuf,
}

impl Api {
    fn path(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("cohort-api-{name}-{}.db", std::process::id()))
    }

    async fn new(name: &str) -> Self {
        let _ = std::fs::remove_file(Self::path(name));
        Self::reopen(name).await
    }

    /// The API on the database `name` as it is (see [`Api::path`]).
    async fn reopen(name: &str) -> Self {
        let path = Self::path(name);
        let url = format!("sqlite://{}", path.display());
        let store = SqlStore::connect(&url).await.unwrap();
        // As a service does: on SQLite the credential cache opens at once.
        assert!(store.keep_credentials(&url).unwrap().is_none() && store.credentials().is_open());
        let metrics = Metrics::default();
        metrics.count_credential_lookups(store.credentials());
        let replica = Replica { id: format!("api-{name}"), url: "http://127.0.0.1:9".into(), started_at: 0 };
        let coordinator =
            Coordinator::start(store.clone(), store.clone(), metrics.clone(), replica).await.unwrap();
        // The production state for a service with these settings.
        let mut config = ServiceConfig::new(([127, 0, 0, 1], 0).into(), "unused", ADMIN);
        config.max_message_bytes = 1 << 16;
        config.credential_ttl_ms = 3_600_000;
        config.web_assets = path.with_extension("web");
        // A browser client "build" of one file: the wasm module's header.
        std::fs::create_dir_all(path.with_extension("web")).unwrap();
        std::fs::write(path.with_extension("web").join("cohort_web_bg.wasm"), WASM_HEADER).unwrap();
        let router = app(app_state(store.clone(), coordinator, metrics, &config, None));
        Self { router, store, path }
    }

    async fn send(&self, request: Request<Body>) -> (StatusCode, Vec<u8>, axum::http::HeaderMap) {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.unwrap().to_bytes().to_vec();
        (status, body, headers)
    }

    async fn call(
        &self,
        method: &str,
        uri: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut builder = Request::builder().method(method).uri(uri);
        if let Some(token) = token {
            builder = builder.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = match body {
            Some(json) => {
                builder.header(header::CONTENT_TYPE, "application/json").body(Body::from(json.to_string()))
            }
            None => builder.body(Body::empty()),
        }
        .unwrap();
        let (status, bytes, _) = self.send(request).await;
        (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    async fn create_task(&self, spec: Value) -> (String, String) {
        let (status, body) = self.call("POST", "/admin/tasks", Some(ADMIN), Some(spec)).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        (body["id"].as_str().unwrap().to_string(), body["enrollment_token"].as_str().unwrap().to_string())
    }

    /// Enrolls under a fresh identity key; returns the credential.
    async fn enroll(&self, task: &str, token: &str) -> String {
        self.enroll_with(task, keys::fresh_enrollment(task, token)).await
    }

    /// Enrolls with `body`; returns the credential.
    async fn enroll_with(&self, task: &str, body: Value) -> String {
        let (status, body) = self.call("POST", &format!("/v1/tasks/{task}/enroll"), None, Some(body)).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        body["credential"].as_str().unwrap().to_string()
    }

    async fn post_message(
        &self,
        credential: &str,
        bytes: Vec<u8>,
        content_type: &str,
    ) -> (StatusCode, Value) {
        let request = Request::post("/v1/round/message")
            .header(header::AUTHORIZATION, format!("Bearer {credential}"))
            .header(header::CONTENT_TYPE, content_type)
            .body(Body::from(bytes))
            .unwrap();
        let (status, body, _) = self.send(request).await;
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    async fn fetch_message(&self, credential: &str) -> (StatusCode, Vec<u8>) {
        let request = Request::get("/v1/round/message")
            .header(header::AUTHORIZATION, format!("Bearer {credential}"))
            .body(Body::empty())
            .unwrap();
        let (status, body, _) = self.send(request).await;
        (status, body)
    }

    async fn finish(self) {
        self.store.close().await;
        let _ = std::fs::remove_dir_all(self.path.with_extension("web"));
        let _ = std::fs::remove_file(self.path);
    }
}

fn spec(rounds: u32) -> Value {
    json!({
        "name": "api test",
        "rounds": rounds,
        "clients_per_round": 6,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [2, 2] } ] } },
        "secure_aggregation": { "graph": "complete", "threshold": 4 },
        "deadlines": { "advertise_keys_ms": 20000, "share_keys_ms": 20000, "masked_input_ms": 20000, "unmasking_ms": 20000 }
    })
}

/// What the OpenAPI document promises beyond its paths: every link
/// names an operation that exists, in OpenAPI's field names; every refusal
/// code a coordinator sends is listed; the client library's routes are
/// documented with the methods it calls them with; the enums of a task
/// spec that refuse unknown fields say so.
fn the_document_is_whole(doc: &Value) {
    use cohort_client::api::{ErrorCode, routes};
    // Every schema-valid enrollment fits the client API's 4 KiB JSON limit
    // (a fuzzer's long token drew 413, not the 401 it is).
    let token = &doc["components"]["schemas"]["EnrollRequest"]["properties"]["enrollment_token"];
    assert_eq!((&token["maxLength"], &token["pattern"]), (&json!(64), &json!("^[0-9a-f]{64}$")), "{token}");
    let operations: std::collections::HashSet<&str> = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|item| item.as_object().unwrap().values())
        .filter_map(|operation| operation["operationId"].as_str())
        .collect();
    let mut links = 0;
    for item in doc["paths"].as_object().unwrap().values() {
        for operation in item.as_object().unwrap().values() {
            for response in operation["responses"].as_object().unwrap().values() {
                for (name, link) in response["links"].as_object().into_iter().flatten() {
                    let target =
                        link["operationId"].as_str().unwrap_or_else(|| panic!("link {name}: {link}"));
                    assert!(operations.contains(target), "link {name} names no operation: {target}");
                    assert!(link.get("operation_id").is_none(), "{link}");
                    links += 1;
                }
            }
        }
    }
    assert!(links >= 12, "a created task links to the operations on it ({links} links)");
    let created = &doc["paths"]["/admin/tasks"]["post"]["responses"]["201"]["links"];
    for operation in ["getTask", "pauseTask", "stopTask", "listRounds", "createToken", "enroll"] {
        assert!(created.as_object().unwrap().values().any(|l| l["operationId"] == operation), "{operation}");
    }
    let codes: Vec<&str> = doc["components"]["schemas"]["ErrorCode"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|code| code.as_str().unwrap())
        .collect();
    let sent: Vec<&str> =
        ErrorCode::all().filter(|c| *c != ErrorCode::Unknown).map(ErrorCode::as_str).collect();
    assert_eq!(codes, sent);
    for (path, method) in [
        (routes::ENROLL, "post"),
        (routes::CHECK_IN, "post"),
        (routes::LEAVE, "post"),
        (routes::MODEL, "get"),
        (routes::ROUND_MESSAGE, "get"),
        (routes::ROUND_MESSAGE, "post"),
        (routes::METRICS, "post"),
    ] {
        assert!(doc["paths"][path][method].is_object(), "{method} {path} is not documented");
    }
    for name in cohort_server::api::openapi::CLOSED_ENUMS {
        let variants = doc["components"]["schemas"][name]["oneOf"].as_array().unwrap();
        assert!(variants.iter().all(|v| v["additionalProperties"] == false), "{name}");
    }
    // ... and each of them does refuse a field it does not know.
    let refused = [
        serde_json::from_value::<cohort_server::optimizer::ServerOptimizer>(
            json!({"kind": "fedavg", "learning_rate": 1.0, "beta1": 0.9}),
        )
        .is_err(),
        serde_json::from_value::<cohort_server::spec::ModelInit>(json!({"kind": "zeros", "seed": 1}))
            .is_err(),
        serde_json::from_value::<cohort_server::spec::ModelInit>(
            json!({"kind": "fan_in", "seed": 1, "scale": 1}),
        )
        .is_err(),
    ];
    assert_eq!(refused, [true; 3]);
    assert_eq!(
        serde_json::to_value(cohort_server::spec::ModelInit::default()).unwrap(),
        json!({"kind": "zeros"})
    );
    // Binary bodies are bytes, not arrays of numbers.
    let message = &doc["paths"][routes::ROUND_MESSAGE]["post"]["requestBody"]["content"][SECAGG_CONTENT_TYPE];
    assert_eq!(message["schema"]["$ref"], "#/components/schemas/Binary");
    assert_eq!(doc["components"]["schemas"]["Binary"], json!({"type": "string", "format": "binary"}));
    for scheme in ["admin", "client"] {
        assert_eq!(doc["components"]["securitySchemes"][scheme]["scheme"], "bearer");
    }
}

#[tokio::test]
async fn health_and_metrics_are_served_in_their_formats() {
    let api = Api::new("service").await;
    let (status, bytes, _) = api.send(Request::get("/healthz").body(Body::empty()).unwrap()).await;
    assert_eq!((status, bytes.as_slice()), (StatusCode::OK, b"ok".as_slice()));
    let (status, bytes, headers) = api.send(Request::get("/metrics").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[header::CONTENT_TYPE], cohort_server::metrics::CONTENT_TYPE);
    let text = String::from_utf8(bytes).unwrap();
    assert!(text.contains("cohort_rounds_completed_total 0") && text.ends_with("# EOF\n"), "{text}");
    let (status, body) = api.call("GET", "/readyz", None, None).await;
    assert_eq!((status, body["status"].as_str()), (StatusCode::OK, Some("ready")));
    api.finish().await;
}

/// Every answer carries its request's id: the one the request came with
/// when it is a short token (a balancer's, or a forwarding replica's), a
/// fresh one otherwise; refusals and unknown paths too.
#[tokio::test]
async fn every_answer_carries_its_request_id() {
    let api = Api::new("request-id").await;
    let id_of = |headers: &axum::http::HeaderMap| {
        headers.get("x-request-id").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default()
    };
    let (_, _, headers) = api.send(Request::get("/healthz").body(Body::empty()).unwrap()).await;
    let first = id_of(&headers);
    assert!(first.len() == 16 && first.bytes().all(|b| b.is_ascii_hexdigit()), "{first:?}");
    let (_, _, headers) = api.send(Request::get("/healthz").body(Body::empty()).unwrap()).await;
    assert_ne!(id_of(&headers), first, "two requests, one id");
    let request = Request::get("/admin/tasks").header("x-request-id", "balancer-7f3a.1").body(Body::empty());
    let (status, _, headers) = api.send(request.unwrap()).await;
    assert_eq!((status, id_of(&headers).as_str()), (StatusCode::UNAUTHORIZED, "balancer-7f3a.1"));
    for unfit in ["two words".to_string(), "x".repeat(65)] {
        let request = Request::get("/nowhere").header("x-request-id", unfit.as_str()).body(Body::empty());
        let (status, _, headers) = api.send(request.unwrap()).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(id_of(&headers).len(), 16, "{unfit:?} was kept");
    }
    api.finish().await;
}

#[tokio::test]
async fn the_openapi_document_lists_every_route_and_its_example_task_is_created() {
    let api = Api::new("openapi").await;
    let (status, doc) = api.call("GET", "/openapi.json", None, None).await;
    assert_eq!(status, StatusCode::OK);
    the_document_is_whole(&doc);
    // The document names the media type /metrics answers with.
    let content = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"].as_object().unwrap();
    assert_eq!(content.keys().collect::<Vec<_>>(), [cohort_server::metrics::CONTENT_TYPE]);
    // The document's example task is one the server creates.
    let example =
        doc["paths"]["/admin/tasks"]["post"]["requestBody"]["content"]["application/json"]["example"].clone();
    let (status, created) = api.call("POST", "/admin/tasks", Some(ADMIN), Some(example)).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    for path in [
        "/readyz",
        "/admin/tasks",
        "/admin/tasks/{id}",
        "/admin/tasks/{id}/pause",
        "/admin/tasks/{id}/resume",
        "/admin/tasks/{id}/stop",
        "/admin/tasks/{id}/rounds",
        "/admin/tasks/{id}/attempts",
        "/admin/tasks/{id}/checkpoints/{round}",
        "/admin/tasks/{id}/tokens",
        "/admin/tasks/{id}/tokens/{token}/revoke",
        "/v1/tasks/{id}/enroll",
        "/v1/checkin",
        "/v1/leave",
        "/v1/model",
        "/v1/round/message",
        "/v1/metrics",
    ] {
        assert!(doc["paths"][path].is_object(), "{path} missing from the OpenAPI document");
    }
    api.finish().await;
}

#[tokio::test]
async fn unknown_paths_and_ids_that_cannot_be_ours_are_json_404s() {
    let api = Api::new("unknown").await;
    let (status, body) = api.call("GET", "/nowhere", None, None).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
    // Task ids that cannot be ours are not looked up.
    let (status, body) = api.call("GET", "/admin/tasks/%00", Some(ADMIN), None).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
    assert_eq!(api.call("GET", "/admin/tasks/nope", Some(ADMIN), None).await.0, StatusCode::NOT_FOUND);
    api.finish().await;
}

/// Clients that leave: `POST /v1/leave` needs the client's own
/// credential; two of three selected clients leaving before their keys
/// end the attempt at once (no deadline passes), and the attempt is kept
/// with its reason: in the attempts list, the task view, the `410` the
/// client that stayed gets, and, once the round completes at its next
/// attempt, beside the round in `/rounds`.
#[tokio::test]
async fn clients_that_leave_end_an_attempt_at_once_and_it_is_kept_with_its_reason() {
    let api = Api::new("leave").await;
    let mut small = spec(1);
    small["clients_per_round"] = json!(3);
    small["secure_aggregation"]["threshold"] = json!(2);
    let (id, token) = api.create_task(small).await;
    let (status, body) = api.call("POST", "/v1/leave", None, None).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")));
    let (status, attempts) = api.call("GET", &format!("/admin/tasks/{id}/attempts"), Some(ADMIN), None).await;
    assert_eq!((status, attempts), (StatusCode::OK, json!([])));
    for query in ["?limit=0", "?limit=501", "?limit=x", "?colour=red"] {
        let (status, body) =
            api.call("GET", &format!("/admin/tasks/{id}/attempts{query}"), Some(ADMIN), None).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_query")),
            "{query}"
        );
    }
    let mut clients = Vec::new();
    for i in 0..3u32 {
        let participant = ProtocolClient::new(u64::from(i), vec![0.1 * i as f32, -0.25, 0.5, 0.0], i + 1);
        let credential = api.enroll_with(&id, participant.enrollment(&id, &token)).await;
        clients.push(HttpClient { credential, participant, selected: Value::Null });
    }
    for client in &clients {
        api.call("POST", "/v1/checkin", Some(&client.credential), None).await;
    }
    let (_, body) = api.call("POST", "/v1/checkin", Some(&clients[0].credential), None).await;
    assert_eq!(body["status"], "selected", "{body}");
    let started = std::time::Instant::now();
    for client in &clients[1..] {
        let (status, body) = api.call("POST", "/v1/leave", Some(&client.credential), None).await;
        assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    }
    let (status, body) = api.fetch_message(&clients[0].credential).await;
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((status, body["error"].as_str()), (StatusCode::GONE, Some("dropped")), "{body}");
    let told = body["message"].as_str().unwrap();
    assert!(told.starts_with("round 1 (attempt 1) was aborted: advertise-keys: 0 of 3"), "{told}");
    assert!(started.elapsed() < Duration::from_secs(20), "the advertise-keys deadline passed");
    let (_, attempts) =
        api.call("GET", &format!("/admin/tasks/{id}/attempts?limit=5"), Some(ADMIN), None).await;
    let attempt = &attempts[0];
    assert_eq!(
        (
            &attempt["round"],
            &attempt["attempt"],
            &attempt["outcome"],
            &attempt["stage"],
            &attempt["selected"]
        ),
        (&json!(1), &json!(1), &json!("aborted"), &json!("advertise-keys"), &json!(3)),
        "{attempts}"
    );
    let reason = attempt["reason"].as_str().unwrap();
    assert!(told.ends_with(reason), "{told} / {reason}");
    assert!(reason.contains("(2 left)") && reason.contains("the threshold is 2"), "{reason}");
    let (_, task) = api.call("GET", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await;
    assert_eq!(task["last_failure"]["reason"], reason, "{task}");
    // The two that left are not selectable until they check in again.
    assert_eq!(task["available_clients"], 1, "{task}");
    // They do, and the round's next attempt completes; /rounds shows the
    // failed one beside it.
    let mut rounds = Value::Null;
    for _ in 0..200 {
        for client in clients.iter_mut() {
            client.step(&api).await;
        }
        let (_, body) = api.call("GET", &format!("/admin/tasks/{id}/rounds"), Some(ADMIN), None).await;
        if body.as_array().is_some_and(|r| !r.is_empty()) {
            rounds = body;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!((&rounds[0]["round"], &rounds[0]["metrics"]["attempt"]), (&json!(1), &json!(2)), "{rounds}");
    let failed = &rounds[0]["failed_attempts"];
    assert_eq!(
        (failed[0]["attempt"].as_i64(), failed[0]["reason"].as_str()),
        (Some(1), Some(reason)),
        "{rounds}"
    );
    assert_eq!(failed.as_array().unwrap().len(), 1, "{rounds}");
    api.finish().await;
}

#[tokio::test]
async fn browser_pages_are_served_under_a_strict_content_security_policy() {
    let api = Api::new("pages").await;
    let get = |uri: &str| Request::get(uri).body(Body::empty()).unwrap();
    for (uri, content_type) in [
        ("/admin", "text/html; charset=utf-8"),
        ("/demo", "text/html; charset=utf-8"),
        ("/web/admin.js", "text/javascript"),
        ("/web/worker.js", "text/javascript"),
        ("/web/driver.js", "text/javascript"),
        ("/web/webcrypto.js", "text/javascript"),
        ("/web/style.css", "text/css"),
        ("/web/pkg/cohort_web_bg.wasm", "application/wasm"),
    ] {
        let (status, body, headers) = api.send(get(uri)).await;
        assert_eq!(status, StatusCode::OK, "{uri}");
        assert_eq!(headers[header::CONTENT_TYPE], content_type, "{uri}");
        let policy = headers[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
        for directive in [
            "default-src 'none'",
            "script-src 'self' 'wasm-unsafe-eval'",
            "connect-src 'self'",
            "frame-ancestors 'none'",
        ] {
            assert!(policy.contains(directive), "{uri}: {policy}");
        }
        assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff", "{uri}");
        assert_eq!(headers[header::REFERRER_POLICY], "no-referrer", "{uri}");
        assert!(!body.is_empty(), "{uri}");
    }
    let (_, wasm, headers) = api.send(get("/web/pkg/cohort_web_bg.wasm")).await;
    assert_eq!(wasm, WASM_HEADER, "served from the build directory");
    // Revalidation: the same build is not sent twice.
    let tag = headers[header::ETAG].clone();
    let again = |tag: &str| {
        Request::get("/web/pkg/cohort_web_bg.wasm")
            .header(header::IF_NONE_MATCH, tag)
            .body(Body::empty())
            .unwrap()
    };
    let (status, body, _) = api.send(again(tag.to_str().unwrap())).await;
    assert_eq!((status, body.len()), (StatusCode::NOT_MODIFIED, 0));
    let (status, body, _) = api.send(again("\"another-build\"")).await;
    assert_eq!((status, body.as_slice()), (StatusCode::OK, WASM_HEADER));
    // The pages never put server data into markup.
    for script in ["/web/admin.js", "/web/demo.js", "/web/chart.js"] {
        let (_, body, _) = api.send(get(script)).await;
        let text = String::from_utf8(body).unwrap();
        assert!(!text.contains("innerHTML") && !text.contains("insertAdjacentHTML"), "{script}");
    }
    // Only the build's known files, and a clear word when one is missing.
    let (status, body, _) = api.send(get("/web/pkg/cohort_web.js")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(String::from_utf8(body).unwrap().contains("scripts/build-web.sh"));
    for uri in ["/web/pkg/..%2Fapi.db", "/web/pkg/%2e%2e", "/web/nothing.js", "/web/pkg/Cargo.toml"] {
        let (status, _, _) = api.send(get(uri)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{uri}");
    }
    let (status, body) = api.call("GET", "/demo/task", None, None).await;
    assert_eq!((status, body), (StatusCode::NO_CONTENT, Value::Null), "no public demo task unless asked for");
    let (status, _, headers) = api.send(get("/")).await;
    assert!(status.is_redirection());
    assert_eq!(headers[header::LOCATION], "/admin");
    api.finish().await;
}

#[tokio::test]
async fn the_admin_api_refuses_bad_tokens_and_bad_bodies() {
    let api = Api::new("admin").await;
    for token in [None, Some("wrong-token")] {
        let (status, body) = api.call("GET", "/admin/tasks", token, None).await;
        assert_eq!((status, body["error"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")));
    }
    let request = Request::post("/admin/tasks")
        .header(header::AUTHORIZATION, format!("Bearer {ADMIN}"))
        .body(Body::from("{not json"))
        .unwrap();
    let (status, body, _) = api.send(request).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(&body));
    let mut bad = spec(2);
    bad["rounds"] = json!(0);
    let (status, body) = api.call("POST", "/admin/tasks", Some(ADMIN), Some(bad)).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_task")));
    assert!(body["message"].as_str().unwrap().contains("rounds"));
    let huge = Request::post("/admin/tasks")
        .header(header::AUTHORIZATION, format!("Bearer {ADMIN}"))
        .body(Body::from(vec![b' '; 2 << 20]))
        .unwrap();
    assert_eq!(api.send(huge).await.0, StatusCode::PAYLOAD_TOO_LARGE);

    api.finish().await;
}

#[tokio::test]
async fn a_task_is_listed_paused_resumed_and_stopped_once() {
    let api = Api::new("lifecycle").await;
    let (id, _) = api.create_task(spec(2)).await;
    let (status, tasks) = api.call("GET", "/admin/tasks", Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(tasks.as_array().unwrap().len(), 1);
    assert_eq!(tasks[0]["status"], "active");
    let (status, task) = api.call("GET", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await;
    assert_eq!(
        (status, task["rounds"].as_u64(), task["completed_rounds"].as_u64()),
        (StatusCode::OK, Some(2), Some(0))
    );
    assert_eq!(api.call("GET", "/admin/tasks/nope", Some(ADMIN), None).await.0, StatusCode::NOT_FOUND);

    for (action, status) in [("pause", "paused"), ("resume", "active"), ("stop", "stopped")] {
        let (code, body) = api.call("POST", &format!("/admin/tasks/{id}/{action}"), Some(ADMIN), None).await;
        assert_eq!((code, body["status"].as_str()), (StatusCode::OK, Some(status)));
    }
    let (status, body) = api.call("POST", &format!("/admin/tasks/{id}/resume"), Some(ADMIN), None).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::CONFLICT, Some("conflict")));
    assert_eq!(api.call("POST", "/admin/tasks/nope/pause", Some(ADMIN), None).await.0, StatusCode::NOT_FOUND);
    let (_, task) = api.call("GET", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await;
    assert_eq!(task["status"], "stopped");

    api.finish().await;
}

#[tokio::test]
async fn a_task_s_rounds_and_checkpoints_are_served_by_round() {
    let api = Api::new("checkpoints").await;
    let (id, _) = api.create_task(spec(2)).await;
    let (status, rounds) = api.call("GET", &format!("/admin/tasks/{id}/rounds"), Some(ADMIN), None).await;
    assert_eq!((status, rounds), (StatusCode::OK, json!([])));
    assert_eq!(api.call("GET", "/admin/tasks/nope/rounds", Some(ADMIN), None).await.0, StatusCode::NOT_FOUND);
    let request = Request::get(format!("/admin/tasks/{id}/checkpoints/0"))
        .header(header::AUTHORIZATION, format!("Bearer {ADMIN}"))
        .body(Body::empty())
        .unwrap();
    let (status, bytes, headers) = api.send(request).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[header::CONTENT_TYPE], "application/vnd.safetensors");
    assert_eq!(checkpoint::decode(&bytes).unwrap().weights, vec![0.0; 4]);
    for (round, expected) in
        [("latest", StatusCode::OK), ("7", StatusCode::NOT_FOUND), ("x", StatusCode::BAD_REQUEST)]
    {
        let request = Request::get(format!("/admin/tasks/{id}/checkpoints/{round}"))
            .header(header::AUTHORIZATION, format!("Bearer {ADMIN}"))
            .body(Body::empty())
            .unwrap();
        assert_eq!(api.send(request).await.0, expected, "checkpoint {round}");
    }
    api.finish().await;
}

/// A number the schema allows but f32 arithmetic does not (a τ whose
/// square is infinite) is refused before anything is stored, and a task
/// whose stored state does not load (written by an older or broken
/// coordinator) says so in its view, and is stopped and deleted through
/// the API; a running task is not deleted.
#[tokio::test]
async fn a_task_that_cannot_load_is_refused_or_stopped_and_deleted() {
    use cohort_server::round::TaskEngine;
    use cohort_server::store::{TaskRecord, TaskStatus};
    const BROKEN: &str = "b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0";
    let name = "unloadable";
    let _ = std::fs::remove_file(Api::path(name));
    // A task whose optimizer state does not read back, stored as a
    // coordinator that let τ = 10²⁰ through did (τ² = ∞ is stored as null).
    let store = SqlStore::connect(&format!("sqlite://{}", Api::path(name).display())).await.unwrap();
    let mut broken = spec(3);
    broken["optimizer"] =
        json!({ "kind": "fedadam", "learning_rate": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e20 });
    let parsed: cohort_server::spec::TaskSpec = serde_json::from_value(broken.clone()).unwrap();
    let initial = TaskEngine::initial_checkpoint(BROKEN, &parsed, 1).unwrap();
    assert!(String::from_utf8_lossy(&initial.optimizer_state).contains("null"));
    let record = TaskRecord {
        id: BROKEN.into(),
        name: "broken".into(),
        spec: broken.to_string(),
        status: TaskStatus::Active,
        enrollment_token_hash: token_hash("broken-token"),
        created_at: 1,
        updated_at: 1,
        project_id: "default".into(),
    };
    store.create_task(&record, &initial, None).await.unwrap();
    store.close().await;

    let api = Api::reopen(name).await;
    // Created today, the same spec is refused whole: nothing is stored.
    let (status, body) = api.call("POST", "/admin/tasks", Some(ADMIN), Some(broken)).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_task")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("tau"), "{body}");
    let (_, tasks) = api.call("GET", "/admin/tasks", Some(ADMIN), None).await;
    assert_eq!(tasks.as_array().unwrap().len(), 1, "{tasks}");
    // The stored one says why it does not run.
    let (status, view) = api.call("GET", &format!("/admin/tasks/{BROKEN}"), Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::OK, "{view}");
    let stalled = view["stalled"].as_str().unwrap_or_default();
    assert!(stalled.contains("could not load the task"), "{view}");
    // Pausing needs a leader; stopping and deleting do not.
    let (status, body) = api.call("POST", &format!("/admin/tasks/{BROKEN}/pause"), Some(ADMIN), None).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")));
    let (status, body) = api.call("DELETE", &format!("/admin/tasks/{BROKEN}"), Some(ADMIN), None).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::CONFLICT, Some("conflict")), "stop it first");
    let (status, body) = api.call("POST", &format!("/admin/tasks/{BROKEN}/stop"), Some(ADMIN), None).await;
    assert_eq!((status, body["status"].as_str()), (StatusCode::OK, Some("stopped")), "{body}");
    let (_, view) = api.call("GET", &format!("/admin/tasks/{BROKEN}"), Some(ADMIN), None).await;
    assert!(view.get("stalled").is_none(), "a stopped task is not stalled: {view}");
    assert_eq!(
        api.call("DELETE", &format!("/admin/tasks/{BROKEN}"), Some(ADMIN), None).await.0,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        api.call("GET", &format!("/admin/tasks/{BROKEN}"), Some(ADMIN), None).await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        api.call("DELETE", &format!("/admin/tasks/{BROKEN}"), Some(ADMIN), None).await.0,
        StatusCode::NOT_FOUND
    );
    // A running task is not deleted, and its clients keep their credentials.
    let (id, token) = api.create_task(spec(3)).await;
    let credential = api.enroll(&id, &token).await;
    let (status, _) = api.call("DELETE", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::CONFLICT);
    let (status, _) = api.call("POST", "/v1/checkin", Some(&credential), None).await;
    assert_eq!(status, StatusCode::OK);
    // Stopped and deleted, its clients' credentials are gone with it.
    api.call("POST", &format!("/admin/tasks/{id}/stop"), Some(ADMIN), None).await;
    assert_eq!(
        api.call("DELETE", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await.0,
        StatusCode::NO_CONTENT
    );
    let (status, _) = api.call("POST", "/v1/checkin", Some(&credential), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    api.finish().await;
}

/// A task that waits for clients says why in its view: how many are
/// available against what a round selects.
#[tokio::test]
async fn a_task_waiting_for_clients_says_how_many_it_needs() {
    let api = Api::new("stalled").await;
    let (id, token) = api.create_task(spec(3)).await;
    for _ in 0..2 {
        let credential = api.enroll(&id, &token).await;
        assert_eq!(api.call("POST", "/v1/checkin", Some(&credential), None).await.0, StatusCode::OK);
    }
    let (_, view) = api.call("GET", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await;
    assert_eq!(view["available_clients"], 2, "{view}");
    assert_eq!(
        view["stalled"].as_str(),
        Some("waiting for clients: 2 available, round 1 selects 6"),
        "{view}"
    );
    api.call("POST", &format!("/admin/tasks/{id}/pause"), Some(ADMIN), None).await;
    let (_, view) = api.call("GET", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await;
    assert!(view.get("stalled").is_none(), "a paused task waits by design: {view}");
    api.finish().await;
}

#[tokio::test]
async fn enrollment_refuses_bad_tokens_and_unproven_or_reused_identities() {
    let api = Api::new("client").await;
    let (id, token) = api.create_task(spec(2)).await;
    let path = format!("/v1/tasks/{id}/enroll");
    let (status, _) = api.call("POST", &path, None, Some(json!({ "enrollment_token": "wrong" }))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) =
        api.call("POST", "/v1/tasks/nope/enroll", None, Some(json!({ "enrollment_token": token }))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = api.call("POST", &path, None, Some(json!({ "token": token }))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // An active task (the default) takes only enrollments that prove they
    // hold the identity key they register, and each key once.
    let (status, body) = api.call("POST", &path, None, Some(json!({ "enrollment_token": token }))).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("identity_required")),
        "{body}"
    );
    let identity = keys::fresh_identity();
    let mut keyless_proof = keys::enrollment(&id, &token, &identity);
    keyless_proof["identity_proof"] = Value::Null;
    let mut foreign_proof = keys::enrollment("another task", &token, &identity);
    foreign_proof["identity_key"] = keys::enrollment(&id, &token, &identity)["identity_key"].clone();
    let mut stolen_key = keys::enrollment(&id, &token, &keys::fresh_identity());
    stolen_key["identity_key"] = keys::enrollment(&id, &token, &identity)["identity_key"].clone();
    let mut short_key = keys::enrollment(&id, &token, &identity);
    short_key["identity_key"] = json!("abcd");
    for body in [keyless_proof, foreign_proof, stolen_key, short_key] {
        let (status, reply) = api.call("POST", &path, None, Some(body.clone())).await;
        assert_eq!(
            (status, reply["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_identity")),
            "{body}"
        );
    }
    api.enroll_with(&id, keys::enrollment(&id, &token, &identity)).await;
    let (status, body) = api.call("POST", &path, None, Some(keys::enrollment(&id, &token, &identity))).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    api.finish().await;
}

#[tokio::test]
async fn check_in_refuses_missing_and_expired_credentials_and_serves_the_model() {
    let api = Api::new("checkin").await;
    let (id, token) = api.create_task(spec(2)).await;
    let credential = api.enroll(&id, &token).await;

    for credential in [None, Some("not-a-credential")] {
        let (status, body) = api.call("POST", "/v1/checkin", credential, None).await;
        assert_eq!((status, body["error"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")));
    }
    api.store
        .add_participant(&ParticipantRecord {
            id: "old".into(),
            task_id: id.clone(),
            credential_hash: token_hash("expired-credential"),
            enrolled_at: 0,
            last_seen_at: 0,
            expires_at: 1,
            identity_key: None,
            token_id: None,
        })
        .await
        .unwrap();
    let (status, body) = api.call("POST", "/v1/checkin", Some("expired-credential"), None).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::UNAUTHORIZED, Some("credential_expired")));

    let (status, body) = api.call("POST", "/v1/checkin", Some(&credential), None).await;
    assert_eq!((status, body["status"].as_str()), (StatusCode::OK, Some("wait")));
    let request = Request::get("/v1/model")
        .header(header::AUTHORIZATION, format!("Bearer {credential}"))
        .body(Body::empty())
        .unwrap();
    let (status, bytes, headers) = api.send(request).await;
    assert_eq!((status, headers["x-cohort-round"].to_str().unwrap()), (StatusCode::OK, "0"));
    assert_eq!(checkpoint::decode(&bytes).unwrap().weights.len(), 4);

    api.finish().await;
}

#[tokio::test]
async fn stage_messages_of_a_client_not_selected_are_refused_before_their_body() {
    let api = Api::new("messages").await;
    let (id, token) = api.create_task(spec(2)).await;
    let credential = api.enroll(&id, &token).await;
    let (status, body) = api.fetch_message(&credential).await;
    assert_eq!(status, StatusCode::CONFLICT, "{}", String::from_utf8_lossy(&body));
    let (status, body) = api.post_message(&credential, vec![1, 2, 3], "application/json").await;
    assert_eq!(
        (status, body["error"].as_str()),
        (StatusCode::UNSUPPORTED_MEDIA_TYPE, Some("unsupported_media_type"))
    );
    // A client that is not selected is refused before its body is read,
    // however large it says it is.
    let (status, body) = api.post_message(&credential, vec![0; 1 << 17], SECAGG_CONTENT_TYPE).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::CONFLICT, Some("not_selected")));
    let (status, body) = api.post_message(&credential, vec![1, 2, 3], SECAGG_CONTENT_TYPE).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::CONFLICT, Some("not_selected")));

    api.finish().await;
}

#[tokio::test]
async fn plaintext_metrics_are_refused_when_malformed_or_not_asked_for() {
    let api = Api::new("metrics").await;
    let (id, token) = api.create_task(spec(2)).await;
    let credential = api.enroll(&id, &token).await;
    // Reports in the clear: this task takes none (it learns clients'
    // metrics only in aggregate); malformed ones are refused first.
    let report =
        |kind: &str, round: i64| json!({ "round": round, "kind": kind, "metrics": { "train_loss": 0.5 } });
    let (status, body) = api.call("POST", "/v1/metrics", Some(&credential), Some(report("train", 1))).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::FORBIDDEN, Some("plaintext_metrics_off")));
    let unknown = json!({ "round": 1, "kind": "train", "metrics": { "loss": 0.5 } });
    assert_eq!(
        api.call("POST", "/v1/metrics", Some(&credential), Some(unknown)).await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        api.call("POST", "/v1/metrics", Some(&credential), Some(report("other", 1))).await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        api.call("POST", "/v1/metrics", Some(&credential), Some(report("eval", 0))).await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        api.call("POST", "/v1/metrics", Some(&credential), Some(json!([1]))).await.0,
        StatusCode::BAD_REQUEST
    );

    api.finish().await;
}

#[tokio::test]
async fn a_stopped_task_refuses_enrollment_and_tells_its_clients_it_finished() {
    let api = Api::new("stopped").await;
    let (id, token) = api.create_task(spec(2)).await;
    let path = format!("/v1/tasks/{id}/enroll");
    let credential = api.enroll(&id, &token).await;
    api.call("POST", &format!("/admin/tasks/{id}/stop"), Some(ADMIN), None).await;
    let (status, body) = api.call("POST", &path, None, Some(json!({ "enrollment_token": token }))).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::CONFLICT, Some("task_inactive")));
    // Its clients are told the task is over, so that they exit cleanly.
    let (status, body) = api.call("POST", "/v1/checkin", Some(&credential), None).await;
    assert_eq!((status, body["status"].as_str()), (StatusCode::OK, Some("finished")), "{body}");
    api.finish().await;
}

/// A client that runs the protocol over the router.
struct HttpClient {
    credential: String,
    participant: ProtocolClient,
    /// The last check-in's answer that selected this client.
    selected: Value,
}

impl HttpClient {
    /// One check-in, fetch and answer.
    async fn step(&mut self, api: &Api) {
        let (_, body) = api.call("POST", "/v1/checkin", Some(&self.credential), None).await;
        if body["status"] != "selected" {
            return;
        }
        self.selected = body.clone();
        let client_id = body["client_id"].as_u64().unwrap() as u32;
        let (status, bytes) = api.fetch_message(&self.credential).await;
        if status != StatusCode::OK {
            return;
        }
        // Malformed bytes first: refused, and the round goes on.
        let (status, body) = api
            .post_message(&self.credential, b"\xc0\x5a\x01\x13garbage".to_vec(), SECAGG_CONTENT_TYPE)
            .await;
        assert_eq!((status, body["error"].as_str()), (StatusCode::BAD_REQUEST, Some("malformed_message")));
        let reply = self.participant.respond(client_id, &bytes);
        let (status, body) = api.post_message(&self.credential, reply.clone(), SECAGG_CONTENT_TYPE).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        // The same message again is refused without harm: a duplicate, out
        // of phase if it completed the stage and the stage moved on, or for
        // an inactive task if it completed the last round.
        let (status, body) = api.post_message(&self.credential, reply, SECAGG_CONTENT_TYPE).await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert!(
            matches!(body["error"].as_str(), Some("duplicate" | "out_of_phase" | "task_inactive")),
            "{body}"
        );
    }
}

#[tokio::test]
async fn a_secure_round_through_the_api_updates_the_model() {
    let api = Api::new("round").await;
    let (id, token) = api.create_task(spec(1)).await;
    // A spec that does not name its variant runs the active one.
    let (_, view) = api.call("GET", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await;
    assert_eq!(view["spec"]["secure_aggregation"]["variant"], "active", "{view}");
    let mut clients = Vec::new();
    for i in 0..6u32 {
        let mut participant =
            ProtocolClient::new(u64::from(i), vec![0.1 * i as f32, -0.25, 0.5, 0.0], 5 * (i + 1));
        // Losses 0.25 to 1.5 (mean 0.875); half the clients also report an
        // accuracy (0.5, 0.6, 0.7: mean 0.6).
        participant.metrics.set(Metric::TrainLoss, 0.25 * f64::from(i + 1)).unwrap();
        if i < 3 {
            participant.metrics.set(Metric::EvalAccuracy, 0.5 + 0.1 * f64::from(i)).unwrap();
        }
        let credential = api.enroll_with(&id, participant.enrollment(&id, &token)).await;
        clients.push(HttpClient { credential, participant, selected: Value::Null });
    }
    let mut rounds = Value::Null;
    let mut progress = Vec::new();
    for _ in 0..200 {
        for client in clients.iter_mut() {
            client.step(&api).await;
        }
        let (_, view) = api.call("GET", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await;
        if !view["progress"].is_null() {
            progress.push(view["progress"].clone());
        }
        let (_, body) = api.call("GET", &format!("/admin/tasks/{id}/rounds"), Some(ADMIN), None).await;
        if body.as_array().is_some_and(|r| !r.is_empty()) {
            rounds = body;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(rounds[0]["round"], 1, "the round did not complete: {rounds}");
    // The live view while the round ran: counts, times and traffic only.
    assert!(progress.iter().any(|p| !p["stages"].as_array().unwrap().is_empty()), "{progress:?}");
    let mut closed = 0;
    for live in &progress {
        let mut fields: Vec<&str> = live.as_object().unwrap().keys().map(String::as_str).collect();
        fields.sort_unstable();
        assert_eq!(
            fields,
            [
                "attempt",
                "awaited",
                "bytes_down",
                "bytes_up",
                "deadline",
                "eligible",
                "groups",
                "groups_completed",
                "groups_failed",
                "left",
                "received",
                "round",
                "selected",
                "stage",
                "stage_started_at",
                "stages",
                "started_at",
                "threshold"
            ]
        );
        assert_eq!((live["round"].as_u64(), live["selected"].as_u64()), (Some(1), Some(6)));
        assert!(live["received"].as_u64() <= live["eligible"].as_u64(), "{live}");
        assert!(live["deadline"].as_i64() > live["stage_started_at"].as_i64(), "{live}");
        let stages = live["stages"].as_array().unwrap();
        assert!(stages.len() >= closed, "stages only close");
        closed = stages.len();
        for stage in stages {
            assert_eq!(stage["received"].as_u64().unwrap() + stage["dropouts"].as_u64().unwrap(), 6);
        }
    }
    assert_eq!(rounds[0]["survivors"], 6);
    // The active variant's five stages, the consistency check included.
    assert_eq!(rounds[0]["metrics"]["stages"].as_array().unwrap().len(), 5);
    let (_, task) = api.call("GET", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await;
    assert_eq!((task["status"].as_str(), task["completed_rounds"].as_u64()), (Some("completed"), Some(1)));
    assert!(task["progress"].is_null(), "no round in progress: {task}");
    let request = Request::get(format!("/admin/tasks/{id}/checkpoints/latest"))
        .header(header::AUTHORIZATION, format!("Bearer {ADMIN}"))
        .body(Body::empty())
        .unwrap();
    let (_, bytes, _) = api.send(request).await;
    let model = checkpoint::decode(&bytes).unwrap();
    let expected = weighted_mean(&clients.iter().map(|c| &c.participant).collect::<Vec<_>>());
    for (w, e) in model.weights.iter().zip(&expected) {
        assert!((w - e).abs() < 1e-4, "{:?} vs {expected:?}", model.weights);
    }
    // The clients' metrics: means over the survivors from their sums under
    // the masks, and nothing per client.
    let means = &rounds[0]["metrics"]["client_means"];
    let close = |value: &Value, expected: f64| (value.as_f64().unwrap() - expected).abs() < 1e-5;
    assert!(close(&means["train_loss"]["mean"], 0.875), "{means}");
    assert_eq!(means["train_loss"]["clients"], 6, "{means}");
    assert!(close(&means["eval_accuracy"]["mean"], 0.6), "{means}");
    assert_eq!(means["eval_accuracy"]["clients"], 3, "{means}");
    assert!(means.get("global_loss").is_none(), "nobody reported it: {means}");
    assert!(rounds[0].get("plaintext_client_metrics").is_none(), "{rounds}");
    // The task's series: to the admin token, labelled with its project and
    // task; never to an anonymous scrape.
    let scrape = |token: Option<&str>| {
        let mut request = Request::get("/metrics");
        if let Some(token) = token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        request.body(Body::empty()).unwrap()
    };
    let (_, bytes, _) = api.send(scrape(Some(ADMIN))).await;
    let text = String::from_utf8(bytes).unwrap();
    let series = format!(
        "cohort_round_client_metric_mean{{project=\"default\",task=\"{id}\",metric=\"train_loss\"}} 0.87"
    );
    assert!(text.contains(&series), "{text}");
    let (_, bytes, _) = api.send(scrape(None)).await;
    let text = String::from_utf8(bytes).unwrap();
    assert!(!text.contains("cohort_round_client_metric_mean{") && !text.contains(&id), "{text}");
    let (status, _, _) = api.send(scrape(Some("not-a-key"))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // A key of the task's project (`default`) reads its series; a key of
    // another project none of them.
    let key_of = |project: String| {
        let api = &api;
        async move {
            let body = json!({ "name": "scraper", "role": "viewer" });
            let (status, key) =
                api.call("POST", &format!("/admin/projects/{project}/keys"), Some(ADMIN), Some(body)).await;
            assert_eq!(status, StatusCode::CREATED, "{key}");
            key["key"].as_str().unwrap().to_string()
        }
    };
    let (_, other) = api.call("POST", "/admin/projects", Some(ADMIN), Some(json!({ "name": "other" }))).await;
    let other_key = key_of(other["id"].as_str().unwrap().to_string()).await;
    let (_, bytes, _) = api.send(scrape(Some(&other_key))).await;
    let text = String::from_utf8(bytes).unwrap();
    assert!(!text.contains(&id) && !text.contains("cohort_bytes_in"), "{text}");
    let own_key = key_of("default".to_string()).await;
    let (_, bytes, _) = api.send(scrape(Some(&own_key))).await;
    let text = String::from_utf8(bytes).unwrap();
    assert!(text.contains(&series), "{text}");
    let report = json!({ "round": 1, "kind": "train", "metrics": { "train_loss": 0.25 } });
    let (status, body) = api.call("POST", "/v1/metrics", Some(&clients[0].credential), Some(report)).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::FORBIDDEN, Some("plaintext_metrics_off")));

    let (_, bytes, _) = api.send(Request::get("/metrics").body(Body::empty()).unwrap()).await;
    let text = String::from_utf8(bytes).unwrap();
    assert!(text.contains("cohort_rounds_completed_total 1"), "{text}");
    // Per client and stage (six clients, five stages): one malformed
    // message and one repeat.
    assert!(text.contains("cohort_client_messages_total{result=\"rejected\"} 60"), "{text}");
    assert!(text.contains("cohort_stage_dropouts_total{stage=\"unmasking\"} 0"), "{text}");
    // Histograms: one observation per stage of the round, one per accepted
    // upload (six clients' masked inputs; keys, shares, and the rest).
    for stage in ["advertise-keys", "share-keys", "masked-input-collection", "unmasking"] {
        let count = format!("cohort_stage_duration_seconds_count{{stage=\"{stage}\"}} 1\n");
        assert!(text.contains(&count), "{count}: {text}");
    }
    assert!(text.contains("cohort_upload_duration_seconds_count{kind=\"masked_input\"} 6\n"), "{text}");
    assert!(
        text.contains("cohort_upload_duration_seconds_bucket{le=\"+Inf\",kind=\"masked_input\"} 6\n"),
        "{text}"
    );
    api.finish().await;
}

/// Plaintext per-client metrics: only a semi-honest task may ask for
/// them, and then a member of a recent round reports once per round and
/// kind, within the schema; the rounds view labels them as plaintext.
#[tokio::test]
async fn plaintext_metrics_only_for_a_semi_honest_task_that_asks() {
    let api = Api::new("plaintext-metrics").await;
    let mut active = spec(1);
    active["client_metrics"] = json!({ "plaintext": true });
    let (status, body) = api.call("POST", "/admin/tasks", Some(ADMIN), Some(active)).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_task")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("semi-honest"), "{body}");
    let mut semi_honest = spec(1);
    semi_honest["client_metrics"] = json!({ "plaintext": true });
    semi_honest["secure_aggregation"]["variant"] = json!("semi-honest");
    let (id, token) = api.create_task(semi_honest).await;
    let mut clients = Vec::new();
    for i in 0..6u32 {
        let participant = ProtocolClient::new(u64::from(i), vec![0.5, -0.25, 0.5, 0.0], 5);
        let credential = api.enroll_with(&id, participant.enrollment(&id, &token)).await;
        clients.push(HttpClient { credential, participant, selected: Value::Null });
    }
    for _ in 0..200 {
        for client in clients.iter_mut() {
            client.step(&api).await;
        }
        let (_, task) = api.call("GET", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await;
        if task["completed_rounds"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(clients[0].selected["plaintext_metrics"], true, "{}", clients[0].selected);
    let credential = clients[0].credential.clone();
    let report = |round: u64, metrics: Value| json!({ "round": round, "kind": "train", "metrics": metrics });
    let good = json!({ "train_loss": 0.25, "global_accuracy": 0.5, "examples": 5, "bytes_up": 100 });
    let (status, body) =
        api.call("POST", "/v1/metrics", Some(&credential), Some(report(1, good.clone()))).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) =
        api.call("POST", "/v1/metrics", Some(&credential), Some(report(1, good.clone()))).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::CONFLICT, Some("conflict")));
    for bad in
        [json!({ "train_loss": 8.3e29 }), json!({ "global_accuracy": 1.5 }), json!({ "train_loss": -1.0 })]
    {
        let (status, body) = api.call("POST", "/v1/metrics", Some(&credential), Some(report(1, bad))).await;
        assert_eq!((status, body["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_metrics")));
    }
    let other = clients[1].credential.clone();
    for round in [2, 1 << 62] {
        let (status, body) =
            api.call("POST", "/v1/metrics", Some(&other), Some(report(round, good.clone()))).await;
        assert_eq!((status, body["error"].as_str()), (StatusCode::CONFLICT, Some("not_in_round")), "{round}");
    }
    // Six reports in a burst is the default per credential; the seventh waits.
    let (status, body) =
        api.call("POST", "/v1/metrics", Some(&credential), Some(report(1, good.clone()))).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::CONFLICT, Some("conflict")));
    let (status, body) =
        api.call("POST", "/v1/metrics", Some(&credential), Some(report(1, good.clone()))).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::TOO_MANY_REQUESTS, Some("rate_limited")));
    assert!(body["retry_after_ms"].as_u64().is_some_and(|ms| ms > 1000), "{body}");
    let (_, rounds) = api.call("GET", &format!("/admin/tasks/{id}/rounds"), Some(ADMIN), None).await;
    assert_eq!(rounds[0]["plaintext_client_metrics"].as_array().unwrap().len(), 1, "{rounds}");
    assert_eq!(rounds[0]["plaintext_client_metrics"][0]["metrics"]["train_loss"], 0.25);
    api.finish().await;
}

/// Enrollment tokens per application: several per task, each named and
/// shown once, each held to its own rate (429 with Retry-After), each
/// revocable; revoking one refuses its enrollments and ends the
/// credentials it issued, and leaves the others alone.
#[tokio::test]
async fn enrollment_tokens_per_application_are_rate_limited_and_revocable() {
    let api = Api::new("tokens").await;
    let (id, default_token) = api.create_task(spec(1)).await;
    let tokens = format!("/admin/tasks/{id}/tokens");
    let (status, list) = api.call("GET", &tokens, Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!((list[0]["id"].as_str(), list[0]["name"].as_str()), (Some(id.as_str()), Some("default")));
    assert!(list[0].get("token").is_none(), "{list}");

    let new = json!({ "name": "android", "rate": { "per_minute": 1, "burst": 2 } });
    let (status, android) = api.call("POST", &tokens, Some(ADMIN), Some(new.clone())).await;
    assert_eq!(status, StatusCode::CREATED, "{android}");
    let android_token = android["token"].as_str().unwrap().to_string();
    assert_eq!(android_token.len(), 64, "a 256-bit token in hex");
    let (status, body) = api.call("POST", &tokens, Some(ADMIN), Some(new)).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (StatusCode::CONFLICT, Some("conflict")),
        "one name per task"
    );
    for bad in [
        json!({ "name": "" }),
        json!({ "name": "a\u{7}b" }),
        json!({ "name": "x".repeat(201) }),
        json!({ "name": "web", "rate": { "per_minute": 0, "burst": 1 } }),
        json!({ "name": "web", "extra": 1 }),
    ] {
        let (status, body) = api.call("POST", &tokens, Some(ADMIN), Some(bad.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
    let (status, _) = api.call("POST", &tokens, None, Some(json!({ "name": "web" }))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, web) = api.call("POST", &tokens, Some(ADMIN), Some(json!({ "name": "web" }))).await;
    assert_eq!((status, web["rate"].clone()), (StatusCode::CREATED, Value::Null), "{web}");
    let web_token = web["token"].as_str().unwrap().to_string();

    // Each token enrolls; the android one twice, then its own rate says wait.
    let android_credential = api.enroll(&id, &android_token).await;
    api.enroll(&id, &android_token).await;
    let enroll = |token: &str| {
        let body = keys::fresh_enrollment(&id, token);
        let path = format!("/v1/tasks/{id}/enroll");
        let api = &api;
        async move {
            let request = Request::post(path)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(body.to_string()))
                .unwrap();
            let (status, bytes, headers) = api.send(request).await;
            (status, serde_json::from_slice::<Value>(&bytes).unwrap_or(Value::Null), headers)
        }
    };
    let (status, body, headers) = enroll(&android_token).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (StatusCode::TOO_MANY_REQUESTS, Some("rate_limited")),
        "{body}"
    );
    let retry: u64 = headers[header::RETRY_AFTER].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    // The others are not held to it.
    let web_credential = api.enroll(&id, &web_token).await;
    api.enroll(&id, &default_token).await;
    // A token of another task does not enroll here.
    let (other, other_token) = api.create_task(spec(1)).await;
    assert_ne!(other, id);
    let (status, body, _) = enroll(&other_token).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")), "{body}");

    let (_, list) = api.call("GET", &tokens, Some(ADMIN), None).await;
    let mut enrolled: Vec<(String, i64)> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["name"].as_str().unwrap().to_string(), t["enrolled"].as_i64().unwrap()))
        .collect();
    // Listed by creation time; two made within one millisecond come in
    // either order.
    assert_eq!(enrolled[0], ("default".into(), 1), "the task's first token comes first");
    enrolled.sort();
    assert_eq!(enrolled, [("android".into(), 2), ("default".into(), 1), ("web".into(), 1)]);

    // Revoking the android token: its enrollments and credentials end, a
    // credential this replica remembers (it checked in) included.
    for _ in 0..2 {
        let (status, _) = api.call("POST", "/v1/checkin", Some(&android_credential), None).await;
        assert_eq!(status, StatusCode::OK);
    }
    let (_, bytes, _) = api.send(Request::get("/metrics").body(Body::empty()).unwrap()).await;
    let exposition = String::from_utf8(bytes.to_vec()).unwrap();
    let remembered = exposition
        .lines()
        .find_map(|line| line.strip_prefix("cohort_credential_lookups_total{source=\"memory\"} "))
        .and_then(|value| value.trim().parse::<f64>().ok());
    assert!(remembered.is_some_and(|n| n >= 1.0), "{exposition}");
    let android_id = android["id"].as_str().unwrap();
    let (status, revoked) =
        api.call("POST", &format!("{tokens}/{android_id}/revoke"), Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::OK, "{revoked}");
    assert!(revoked["revoked_at"].as_i64().is_some() && revoked.get("token").is_none(), "{revoked}");
    let (status, body, _) = enroll(&android_token).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::UNAUTHORIZED, Some("token_revoked")), "{body}");
    let (status, body) = api.call("POST", "/v1/checkin", Some(&android_credential), None).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("credential_expired")),
        "{body}"
    );
    let (status, _) = api.call("POST", "/v1/checkin", Some(&web_credential), None).await;
    assert_eq!(status, StatusCode::OK, "the web app's clients are untouched");
    for path in [format!("{tokens}/{}/revoke", "0".repeat(32)), format!("{tokens}/nope/revoke")] {
        let (status, _) = api.call("POST", &path, Some(ADMIN), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
    }
    // A stopped task takes no new tokens.
    api.call("POST", &format!("/admin/tasks/{id}/stop"), Some(ADMIN), None).await;
    let (status, body) = api.call("POST", &tokens, Some(ADMIN), Some(json!({ "name": "late" }))).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::CONFLICT, Some("task_inactive")));
    api.finish().await;
}

/// An open `text/event-stream` answer, read event by event.
struct Events {
    body: Body,
    buffer: String,
    ended: bool,
    /// The event names the OpenAPI document declares for this stream.
    declared: Vec<Value>,
}

impl Events {
    async fn open(api: &Api, path: &str) -> Self {
        let (_, document) = api.call("GET", "/openapi.json", None, None).await;
        let template = if path.starts_with("/admin/tasks/") { "/admin/tasks/{id}/events" } else { path };
        let mut schema =
            &document["paths"][template]["get"]["responses"]["200"]["content"]["text/event-stream"]["schema"];
        if let Some(name) = schema["$ref"].as_str().and_then(|r| r.strip_prefix("#/components/schemas/")) {
            schema = &document["components"]["schemas"][name];
        }
        assert_eq!(schema["properties"]["data"]["contentMediaType"], "application/json", "{schema}");
        let declared = schema["properties"]["event"]["enum"].as_array().cloned().unwrap_or_default();
        assert!(!declared.is_empty(), "{path}: {schema}");
        let request = Request::get(path)
            .header(header::AUTHORIZATION, format!("Bearer {ADMIN}"))
            .body(Body::empty())
            .unwrap();
        let response = api.router.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        assert_eq!(response.headers()[header::CONTENT_TYPE], "text/event-stream", "{path}");
        Self { body: response.into_body(), buffer: String::new(), ended: false, declared }
    }

    /// The next event (name and JSON data) within `wait`; `None` if none
    /// came or the stream ended (then `ended`).
    async fn next(&mut self, wait: Duration) -> Option<(String, Value)> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let mut name = String::from("message");
                let mut data = String::new();
                for line in block.lines() {
                    if let Some(value) = line.strip_prefix("event: ") {
                        name = value.to_string();
                    } else if let Some(value) = line.strip_prefix("data: ") {
                        data.push_str(value);
                    }
                }
                if data.is_empty() {
                    continue; // a keep-alive comment
                }
                // As the document declares it: a named event, JSON data.
                assert!(self.declared.contains(&Value::from(name.as_str())), "undeclared event {name}");
                return Some((name, serde_json::from_str(&data).unwrap()));
            }
            match tokio::time::timeout_at(deadline, self.body.frame()).await {
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        self.buffer.push_str(std::str::from_utf8(&data).unwrap());
                    }
                }
                Ok(_) => {
                    self.ended = true;
                    return None;
                }
                Err(_) => return None,
            }
        }
    }

    /// Every event that comes within `wait` of the one before.
    async fn drain(&mut self, wait: Duration) -> Vec<(String, Value)> {
        let mut events = Vec::new();
        while let Some(event) = self.next(wait).await {
            events.push(event);
        }
        events
    }
}

/// The admin API's server push: a task's stream sends its view, its
/// rounds and its attempts at once, then each change as the round runs
/// (every stage in order, each with the stages closed before it), and the
/// completed round on its own; the task list's stream follows along;
/// refusals come before a stream starts; a store that goes away ends the
/// stream with an `unavailable` event.
#[tokio::test]
async fn the_event_streams_push_a_round_as_it_happens() {
    let api = Api::new("events").await;
    let (id, token) = api.create_task(spec(1)).await;
    let (status, body) = api.call("GET", &format!("/admin/tasks/{id}/events"), None, None).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")));
    let (status, _) = api.call("GET", "/admin/events", Some("wrong-token-0123456789"), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let unknown = "0123456789abcdef0123456789abcdef";
    let (status, _) = api.call("GET", &format!("/admin/tasks/{unknown}/events"), Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let mut list = Events::open(&api, "/admin/events").await;
    let (name, tasks) = list.next(Duration::from_secs(5)).await.unwrap();
    assert_eq!((name.as_str(), tasks[0]["id"].as_str()), ("tasks", Some(id.as_str())), "{tasks}");
    let mut events = Events::open(&api, &format!("/admin/tasks/{id}/events")).await;
    let first = events.drain(Duration::from_millis(300)).await;
    let names: Vec<&str> = first.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["task", "rounds", "attempts", "tokens"], "{first:?}");
    assert_eq!(
        (first[3].1[0]["name"].as_str(), first[3].1[0]["enrolled"].as_u64()),
        (Some("default"), Some(0))
    );
    assert!(first[3].1[0].get("token").is_none(), "never a token: {}", first[3].1);
    assert_eq!(
        (first[0].1["id"].as_str(), first[0].1["status"].as_str()),
        (Some(id.as_str()), Some("active"))
    );
    assert_eq!((&first[1].1, &first[2].1), (&json!([]), &json!([])));

    let mut clients = Vec::new();
    for i in 0..6u32 {
        let participant =
            ProtocolClient::new(u64::from(i), vec![0.1 * i as f32, -0.25, 0.5, 0.0], 5 * (i + 1));
        let credential = api.enroll_with(&id, participant.enrollment(&id, &token)).await;
        clients.push(HttpClient { credential, participant, selected: Value::Null });
    }
    let mut seen = Vec::new();
    let mut rounds = None;
    let mut tokens = Vec::new();
    for _ in 0..100 {
        for client in clients.iter_mut() {
            client.step(&api).await;
        }
        // Each stage lasts longer than the stream's coalescing: none is missed.
        for (name, data) in events.drain(Duration::from_millis(300)).await {
            match name.as_str() {
                "task" => seen.push(data),
                "rounds" => rounds = Some(data),
                "tokens" => tokens.push(data),
                other => panic!("unexpected {other} event: {data}"),
            }
        }
        if rounds.is_some() {
            break;
        }
    }
    let rounds = rounds.expect("the round's event");
    assert_eq!(rounds.as_array().unwrap().len(), 1, "only the new round: {rounds}");
    assert_eq!((rounds[0]["round"].as_i64(), rounds[0]["survivors"].as_i64()), (Some(1), Some(6)));
    // The stages as the stream showed them: in order, each one, and with
    // the stages closed before it.
    let mut stages: Vec<&str> = seen.iter().filter_map(|task| task["progress"]["stage"].as_str()).collect();
    stages.dedup();
    assert_eq!(
        stages,
        ["advertise-keys", "share-keys", "masked-input-collection", "consistency-check", "unmasking"],
        "{seen:?}"
    );
    for task in seen.iter().filter(|task| !task["progress"].is_null()) {
        let closed = task["progress"]["stages"].as_array().unwrap().len();
        let at = stages.iter().position(|s| *s == task["progress"]["stage"]).unwrap();
        assert_eq!(closed, at, "{task}");
    }
    let last = seen.last().unwrap();
    assert_eq!((last["status"].as_str(), last["completed_rounds"].as_u64()), (Some("completed"), Some(1)));
    assert!(last["progress"].is_null());
    // Nothing is sent twice: consecutive views differ.
    assert!(seen.windows(2).all(|pair| pair[0] != pair[1]));
    // The enrollments, as they changed.
    assert_eq!(tokens.last().map(|t| t[0]["enrolled"].clone()), Some(json!(6)), "{tokens:?}");

    // The list's stream saw the task complete.
    let mut listed = Value::Null;
    while let Some((name, tasks)) = list.next(Duration::from_secs(3)).await {
        assert_eq!(name, "tasks");
        listed = tasks;
        if listed[0]["status"] == "completed" {
            break;
        }
    }
    assert_eq!(listed[0]["completed_rounds"], 1, "{listed}");

    // Without its database, a stream says so and ends (its reader connects
    // again after the hint).
    api.store.close().await;
    let (name, body) = events.next(Duration::from_secs(10)).await.expect("an event before the stream ends");
    assert_eq!(name, "unavailable", "{body}");
    assert!(body["retry_after_ms"].as_u64().unwrap() >= 1, "{body}");
    assert!(events.next(Duration::from_secs(2)).await.is_none() && events.ended);
    api.finish().await;
}

/// A client may ask the coordinator to hold its check-in, or its request
/// for the next stage message, while the answer is "wait" (`wait_ms`): the
/// held request answers once the round starts or the stage closes, and
/// with "nothing yet" when its wait runs out first. Malformed waits are
/// refused.
#[tokio::test]
async fn held_requests_answer_when_the_round_starts_and_when_the_stage_closes() {
    let api = Api::new("held").await;
    let mut small = spec(1);
    small["clients_per_round"] = json!(3);
    small["secure_aggregation"]["threshold"] = json!(2);
    let (id, token) = api.create_task(small).await;
    let mut clients = Vec::new();
    for i in 0..3u32 {
        let participant = ProtocolClient::new(u64::from(i), vec![0.1 * i as f32, -0.25, 0.5, 0.0], i + 1);
        let credential = api.enroll_with(&id, participant.enrollment(&id, &token)).await;
        clients.push(HttpClient { credential, participant, selected: Value::Null });
    }
    for query in ["?wait_ms=x", "?wait_ms=1&wait_ms=2", "?colour=red", "?wait_ms", "?wait_ms=01"] {
        for (method, path) in
            [("POST", "/v1/checkin"), ("GET", "/v1/round/message"), ("POST", "/v1/round/message")]
        {
            let (status, body) =
                api.call(method, &format!("{path}{query}"), Some(&clients[0].credential), None).await;
            assert_eq!(
                (status, body["error"].as_str()),
                (StatusCode::BAD_REQUEST, Some("invalid_round")),
                "{path}{query}"
            );
        }
    }
    let (status, body) =
        api.call("GET", "/v1/round/message?trained_on=1", Some(&clients[0].credential), None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    // Two of the three check in: too few for a round. A held check-in
    // answers "wait" once its wait has run out, not before.
    api.call("POST", "/v1/checkin", Some(&clients[1].credential), None).await;
    let started = std::time::Instant::now();
    let (_, body) = api.call("POST", "/v1/checkin?wait_ms=400", Some(&clients[0].credential), None).await;
    assert_eq!(body["status"], "wait", "{body}");
    assert!(started.elapsed() >= Duration::from_millis(400), "answered after {:?}", started.elapsed());
    // Held for up to 20 s, it answers "selected" once the third client's
    // check-in lets the round start.
    let started = std::time::Instant::now();
    let held = api.call("POST", "/v1/checkin?wait_ms=20000", Some(&clients[0].credential), None);
    let third = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        api.call("POST", "/v1/checkin", Some(&clients[2].credential), None).await
    };
    let ((_, body), _) = tokio::join!(held, third);
    assert_eq!(body["status"], "selected", "{body}");
    assert!(started.elapsed() < Duration::from_secs(15), "held for {:?}", started.elapsed());
    // Every client fetches and answers the first stage's message.
    let mut ids = Vec::new();
    for client in &clients {
        let (_, body) = api.call("POST", "/v1/checkin", Some(&client.credential), None).await;
        assert_eq!(body["status"], "selected", "{body}");
        ids.push(body["client_id"].as_u64().unwrap() as u32);
    }
    let mut replies = Vec::new();
    for (client, id) in clients.iter_mut().zip(&ids) {
        let (status, bytes) = api.fetch_message(&client.credential).await;
        assert_eq!(status, StatusCode::OK);
        replies.push(client.participant.respond(*id, &bytes));
    }
    // The first answer is in, then the second, whose post asks to be held
    // briefly for the next message: accepted, nothing yet (`202`). The
    // stage is open, and a held fetch of the next message answers "nothing
    // yet" when its wait runs out.
    let (status, body) =
        api.post_message(&clients[0].credential, replies[0].clone(), SECAGG_CONTENT_TYPE).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let held_post = |k: usize, wait: u64| {
        let request = Request::post(format!("/v1/round/message?wait_ms={wait}"))
            .header(header::AUTHORIZATION, format!("Bearer {}", clients[k].credential))
            .header(header::CONTENT_TYPE, SECAGG_CONTENT_TYPE)
            .body(Body::from(replies[k].clone()))
            .unwrap();
        api.send(request)
    };
    let started = std::time::Instant::now();
    let (status, bytes, _) = held_post(1, 300).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&bytes));
    assert!(bytes.is_empty());
    assert!(started.elapsed() >= Duration::from_millis(300), "answered after {:?}", started.elapsed());
    // Sent again, it is a duplicate (the first was accepted).
    let (status, bytes, _) = held_post(1, 300).await;
    assert_eq!(status, StatusCode::CONFLICT, "{}", String::from_utf8_lossy(&bytes));
    let fetch = |wait: u64| {
        let request = Request::get(format!("/v1/round/message?wait_ms={wait}"))
            .header(header::AUTHORIZATION, format!("Bearer {}", clients[0].credential))
            .body(Body::empty())
            .unwrap();
        api.send(request)
    };
    let started = std::time::Instant::now();
    let (status, _, _) = fetch(400).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(started.elapsed() >= Duration::from_millis(400), "answered after {:?}", started.elapsed());
    // Held, it brings the next stage's message once the last answer closes
    // the stage.
    let started = std::time::Instant::now();
    let last = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        api.post_message(&clients[2].credential, replies[2].clone(), SECAGG_CONTENT_TYPE).await
    };
    let ((status, bytes, _), (posted, _)) = tokio::join!(fetch(20_000), last);
    assert_eq!((status, posted), (StatusCode::OK, StatusCode::ACCEPTED));
    assert!(!bytes.is_empty());
    assert!(started.elapsed() < Duration::from_secs(15), "held for {:?}", started.elapsed());
    // Every client answers that message. The first post asks to be held:
    // it is answered with its client's next message as soon as the other
    // two close the stage, and that is the message a fetch of that client
    // gets.
    let mut replies = Vec::new();
    for (client, id) in clients.iter_mut().zip(&ids) {
        let (status, bytes) = api.fetch_message(&client.credential).await;
        assert_eq!(status, StatusCode::OK);
        replies.push(client.participant.respond(*id, &bytes));
    }
    let request = Request::post("/v1/round/message?wait_ms=20000")
        .header(header::AUTHORIZATION, format!("Bearer {}", clients[0].credential))
        .header(header::CONTENT_TYPE, SECAGG_CONTENT_TYPE)
        .body(Body::from(replies[0].clone()))
        .unwrap();
    let others = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        for k in 1..3 {
            let (status, body) =
                api.post_message(&clients[k].credential, replies[k].clone(), SECAGG_CONTENT_TYPE).await;
            assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        }
    };
    let started = std::time::Instant::now();
    let ((status, next, headers), ()) = tokio::join!(api.send(request), others);
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&next));
    assert_eq!(headers[header::CONTENT_TYPE], SECAGG_CONTENT_TYPE);
    assert!(started.elapsed() >= Duration::from_millis(300), "answered before the stage closed");
    assert!(started.elapsed() < Duration::from_secs(15), "held for {:?}", started.elapsed());
    let (status, fetched) = api.fetch_message(&clients[0].credential).await;
    assert_eq!((status, &fetched), (StatusCode::OK, &next));
    api.finish().await;
}

/// One held request per participant: a newer one ends the older, and so
/// does the participant's leave, which a held check-in does not undo.
#[tokio::test]
async fn a_newer_held_request_or_a_leave_ends_the_one_held_before() {
    let api = Api::new("held-once").await;
    let mut small = spec(1);
    small["clients_per_round"] = json!(3);
    small["secure_aggregation"]["threshold"] = json!(2);
    let (id, token) = api.create_task(small).await;
    let credential = api.enroll(&id, &token).await;
    let available = async || {
        let (_, task) = api.call("GET", &format!("/admin/tasks/{id}"), Some(ADMIN), None).await;
        task["available_clients"].as_u64().unwrap()
    };
    let started = std::time::Instant::now();
    let first = api.call("POST", "/v1/checkin?wait_ms=20000", Some(&credential), None);
    let second = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        api.call("POST", "/v1/checkin?wait_ms=300", Some(&credential), None).await
    };
    let ((_, first), (_, second)) = tokio::join!(first, second);
    assert_eq!((&first["status"], &second["status"]), (&json!("wait"), &json!("wait")));
    // The first ended at its next wake after the second began, long
    // before its own 20 s.
    assert!(started.elapsed() < Duration::from_secs(10), "held for {:?}", started.elapsed());
    assert_eq!(available().await, 1);
    let started = std::time::Instant::now();
    let held = api.call("POST", "/v1/checkin?wait_ms=20000", Some(&credential), None);
    let leave = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        api.call("POST", "/v1/leave", Some(&credential), None).await
    };
    let ((_, held), (left, _)) = tokio::join!(held, leave);
    assert_eq!((&held["status"], left), (&json!("wait"), StatusCode::NO_CONTENT));
    assert!(started.elapsed() < Duration::from_secs(10), "held for {:?}", started.elapsed());
    // Gone, and not checked in again by the check-in that was held.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(available().await, 0);
    api.finish().await;
}
