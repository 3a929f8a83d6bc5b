//! The OpenAPI 3.1 description of the HTTP API, served at `/openapi.json`.

use serde_json::{Value, json};

fn error_responses(codes: &[&str]) -> Value {
    let mut map = serde_json::Map::new();
    for code in codes {
        map.insert((*code).to_string(), json!({ "$ref": "#/components/responses/Error" }));
    }
    Value::Object(map)
}

fn op(summary: &str, security: &str, ok: Value, errors: &[&str]) -> Value {
    let mut responses = error_responses(errors);
    if let (Value::Object(map), Value::Object(ok)) = (&mut responses, ok) {
        map.extend(ok);
    }
    let mut operation = json!({ "summary": summary, "responses": responses });
    if !security.is_empty() {
        operation["security"] = json!([{ security: [] }]);
    }
    operation
}

fn json_ok(status: &str, description: &str) -> Value {
    json!({ status: { "description": description, "content": { "application/json": {} } } })
}

fn binary_ok(status: &str, content_type: &str, description: &str) -> Value {
    json!({ status: { "description": description, "content": { content_type: { "schema": { "type": "string", "format": "binary" } } } } })
}

/// The document.
pub fn document() -> Value {
    // The refusal codes of the shared contract (a newer server's unknown
    // ones parse as `unknown` on the client; this one sends none).
    let error_codes: Vec<&str> = cohort_client::api::ErrorCode::all()
        .filter(|code| *code != cohort_client::api::ErrorCode::Unknown)
        .map(|code| code.as_str())
        .collect();
    let id = json!({ "name": "id", "in": "path", "required": true, "schema": { "type": "string" } });
    let task_action = |summary: &str| {
        let mut o = op(summary, "admin", json_ok("200", "New status"), &["401", "404", "409"]);
        o["parameters"] = json!([id.clone()]);
        json!({ "post": o })
    };
    let mut check_in = op(
        "Check in; says whether the client is selected for the round in progress, or, in an async task, \
         whether to train (Train) and whether a finished update joins a group (Selected), waits, or is too stale (Stale)",
        "client",
        json_ok("200", "Wait, Selected, Train, Stale or Finished"),
        &["400", "401", "404", "429", "503"],
    );
    check_in["parameters"] = json!([{
        "name": "trained_on", "in": "query", "required": false,
        "description": "Async tasks: the model version a finished update was trained from",
        "schema": { "type": "integer", "format": "int64", "minimum": 0 }
    }]);
    let pause = task_action("Pause a task");
    let resume = task_action("Resume a task");
    let stop = task_action("Stop a task (final)");
    let token = json!({ "name": "token", "in": "path", "required": true, "schema": { "type": "string" } });
    let mut create_token = op(
        "Create an enrollment token for an application ({name, rate?: {per_minute, burst}}); the token is shown only here",
        "admin",
        json_ok("201", "Created"),
        &["400", "401", "404", "409", "503"],
    );
    create_token["parameters"] = json!([id.clone()]);
    let mut list_tokens = op(
        "The task's enrollment tokens, with their enrollments (never the tokens)",
        "admin",
        json_ok("200", "Tokens"),
        &["401", "404"],
    );
    list_tokens["parameters"] = json!([id.clone()]);
    let mut revoke = op(
        "Revoke an enrollment token: it enrolls nobody more, and the credentials it issued end",
        "admin",
        json_ok("200", "Revoked"),
        &["401", "404", "503"],
    );
    revoke["parameters"] = json!([id.clone(), token]);
    json!({
        "openapi": "3.1.0",
        "info": { "title": "Cohort coordinator", "version": env!("CARGO_PKG_VERSION"),
                  "description": "Federated learning rounds with secure aggregation." },
        "paths": {
            "/healthz": { "get": op("Liveness: the process answers", "", json!({ "200": { "description": "ok" } }), &[]) },
            "/readyz": { "get": op("Readiness: the database answers", "", json_ok("200", "Ready"), &["503"]) },
            "/metrics": { "get": op("Prometheus metrics", "", json!({ "200": { "description": "text exposition" } }), &[]) },
            "/admin/tasks": {
                "post": op("Create a task from a TaskSpec; returns its id and enrollment token", "admin", json_ok("201", "Created"), &["400", "401", "408", "413", "422", "503"]),
                "get": op("List tasks", "admin", json_ok("200", "Tasks"), &["401"]),
            },
            "/admin/tasks/{id}": { "get": { "parameters": [id.clone()], "summary": "One task with its live state", "security": [{ "admin": [] }],
                                            "responses": { "200": { "description": "Task" }, "401": { "$ref": "#/components/responses/Error" }, "404": { "$ref": "#/components/responses/Error" } } } },
            "/admin/tasks/{id}/pause": pause,
            "/admin/tasks/{id}/resume": resume,
            "/admin/tasks/{id}/stop": stop,
            "/admin/tasks/{id}/rounds": { "get": { "parameters": [id.clone()], "summary": "Completed rounds with metrics", "security": [{ "admin": [] }],
                                                   "responses": { "200": { "description": "Rounds" }, "401": { "$ref": "#/components/responses/Error" }, "404": { "$ref": "#/components/responses/Error" } } } },
            "/admin/tasks/{id}/attempts": { "get": { "parameters": [id.clone(), { "name": "limit", "in": "query", "required": false, "schema": { "type": "integer", "minimum": 1, "maximum": 500 } }],
                                                     "summary": "Attempts that ended without a new model (aborted, abandoned), newest first, with the stage they stopped in and why", "security": [{ "admin": [] }],
                                                     "responses": { "200": { "description": "Attempts" }, "400": { "$ref": "#/components/responses/Error" }, "401": { "$ref": "#/components/responses/Error" }, "404": { "$ref": "#/components/responses/Error" } } } },
            "/admin/tasks/{id}/tokens": { "post": create_token, "get": list_tokens },
            "/admin/tasks/{id}/tokens/{token}/revoke": { "post": revoke },
            "/admin/tasks/{id}/checkpoints/{round}": { "get": {
                "parameters": [id.clone(), { "name": "round", "in": "path", "required": true, "schema": { "type": "string" }, "description": "round number or \"latest\"" }],
                "summary": "Download a checkpoint (safetensors)", "security": [{ "admin": [] }],
                "responses": binary_ok("200", "application/vnd.safetensors", "Checkpoint") } },
            "/v1/tasks/{id}/enroll": { "post": { "parameters": [id], "summary": "Enroll with the task's enrollment token and an Ed25519 identity key (identity_key, identity_proof: its signature over the enrollment); returns a client credential",
                                                 "responses": { "201": { "description": "Enrolled" }, "400": { "$ref": "#/components/responses/Error" }, "401": { "$ref": "#/components/responses/Error" }, "404": { "$ref": "#/components/responses/Error" }, "408": { "$ref": "#/components/responses/Error" }, "409": { "$ref": "#/components/responses/Error" }, "413": { "$ref": "#/components/responses/Error" }, "429": { "$ref": "#/components/responses/Error" }, "503": { "$ref": "#/components/responses/Error" } } } },
            "/v1/checkin": { "post": check_in },
            "/v1/leave": { "post": op("Leave: no longer selected, and no stage of a round the client is in waits for it (check in again to come back)", "client", json!({ "204": { "description": "Left" } }), &["401", "404", "429", "503"]) },
            "/v1/model": { "get": op("The current global model (safetensors)", "client", binary_ok("200", "application/vnd.safetensors", "Model"), &["401", "404"]) },
            "/v1/round/message": {
                "get": op("The server message for the client's current stage (204: wait, 410: dropped)", "client",
                          binary_ok("200", "application/x-cohort-secagg", "Stage message"), &["401", "409", "410"]),
                "post": op("Send the client's stage message", "client", json!({ "202": { "description": "Accepted" } }),
                           &["400", "401", "408", "409", "413", "415", "422", "503"]),
            },
            "/v1/metrics": { "post": op("Report local metrics in the clear, for a semi-honest task with client_metrics.plaintext only (403 otherwise: every task gets the means from the masked sums), for a round the client took part in (the round in progress or one of the last two): known numeric fields only, at most 4 KiB, once per round and kind", "client", json!({ "201": { "description": "Recorded" } }), &["400", "401", "403", "404", "408", "409", "413", "429", "503"]) },
        },
        "components": {
            "securitySchemes": {
                "admin": { "type": "http", "scheme": "bearer", "description": "The coordinator's admin token" },
                "client": { "type": "http", "scheme": "bearer", "description": "A credential from /v1/tasks/{id}/enroll" },
            },
            "responses": {
                "Error": { "description": "Refused", "content": { "application/json": { "schema": {
                    "type": "object", "required": ["error", "message"],
                    "properties": { "error": { "type": "string", "enum": error_codes }, "message": { "type": "string" },
                                    "retry_after_ms": { "type": "integer", "description": "With 429 and 503: wait this long (also in Retry-After, in seconds)" } } } } } }
            }
        }
    })
}
