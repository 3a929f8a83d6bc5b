//! The OpenAPI 3.1 description of the HTTP API, served at `/openapi.json`.
//!
//! Generated from the code: every operation comes from the `#[utoipa::path]`
//! attribute of the handler that serves it (the router registers each
//! handler at the path its attribute names, see [`super::app`]), and every
//! schema from the Rust type the handler reads or writes, so a field, a
//! default or a variant added to a type is in the document. What the
//! attributes add by hand is what types cannot say: the status codes a
//! handler answers with, and the links from a created task to the
//! operations on it (the stateful API fuzzer in `tests/` follows them).

use utoipa::openapi::OpenApi;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};

use cohort_client::api::ErrorBody;

/// A refusal: the status says which kind, `error` which reason.
#[derive(utoipa::ToResponse)]
#[response(description = "Refused: `error` is the stable reason, `message` explains it")]
#[allow(dead_code)] // Only its schema is used.
pub struct Refused(#[to_schema] ErrorBody);

/// A refusal to come back later from: a `429` (rate limited) or a `503`
/// (the database cannot be reached, or the coordinator is shutting down).
#[derive(utoipa::ToResponse)]
#[response(
    description = "Come back later: `retry_after_ms` (and the `Retry-After` header, in seconds) says when, where known",
    headers(("Retry-After" = u64, description = "Seconds to wait, where the server knows"))
)]
#[allow(dead_code)] // Only its schema is used.
pub struct RetryLater(#[to_schema] ErrorBody);

/// The `{id}` of a path about a task: as [`super::extract::TaskId`] takes
/// it (any other form is an unknown task, `404`).
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // Only its description is used.
pub struct TaskPath {
    /// The task's id.
    #[param(pattern = "^[0-9a-f]{32}$")]
    id: String,
}

/// The body of a binary media type (a stage message, a checkpoint): bytes,
/// not JSON.
pub struct Binary;

impl utoipa::PartialSchema for Binary {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .into()
    }
}

impl utoipa::ToSchema for Binary {}

/// One Server-Sent Event as an event stream's schema describes it (OpenAPI
/// 3.1 has no `itemSchema` yet; tools that read a `text/event-stream`
/// schema, Schemathesis among them, take it for each event): its name,
/// one of `names`, and its `data`, one line of JSON.
fn server_sent_event(names: &[&str]) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("event", ObjectBuilder::new().schema_type(Type::String).enum_values(Some(names.to_vec())))
        .required("event")
        .property(
            "data",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .content_media_type("application/json")
                .description(Some("The event's body: one line of JSON, as the matching GET answers")),
        )
        .required("data")
        .into()
}

/// An event of a task's stream (`GET /admin/tasks/{id}/events`).
pub struct TaskEvent;

impl utoipa::PartialSchema for TaskEvent {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        server_sent_event(&["task", "rounds", "attempts", "tokens", "moved", "reauthenticate", "unavailable"])
    }
}

impl utoipa::ToSchema for TaskEvent {}

/// An event of the task list's stream (`GET /admin/events`).
pub struct TaskListEvent;

impl utoipa::PartialSchema for TaskListEvent {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        server_sent_event(&["tasks", "reauthenticate", "unavailable"])
    }
}

impl utoipa::ToSchema for TaskListEvent {}

/// What the handlers' attributes cannot say: the document's title, its
/// security schemes and its shared responses.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Cohort coordinator",
        description = "Federated learning rounds with secure aggregation. The admin API creates and runs \
                       tasks; the client API enrolls participants and carries their secure-aggregation \
                       stage messages (`application/x-cohort-secagg`, the versioned binary encoding of \
                       `cohort-crypto`)."
    ),
    // StatusChanged: named by `admin::StatusChangeResponses`, whose schemas
    // the router does not collect as it does a handler's `body`.
    components(responses(Refused, RetryLater), schemas(super::admin::StatusChanged)),
    modifiers(&SecuritySchemes),
    tags(
        (name = "admin", description = "Tasks, their enrollment tokens, rounds and checkpoints (the admin token, or a \
            project's key: its project's tasks only, as its role allows)"),
        (name = "projects", description = "Projects, their keys with roles, quotas and audit log"),
        (name = "client", description = "What a participant calls (its credential from enrollment)"),
        (name = "operations", description = "Liveness, readiness and metrics")
    )
)]
pub struct Document;

struct SecuritySchemes;

impl utoipa::Modify for SecuritySchemes {
    fn modify(&self, document: &mut OpenApi) {
        let components = document.components.get_or_insert_with(Default::default);
        let bearer = |description: &str| {
            SecurityScheme::Http(
                HttpBuilder::new().scheme(HttpAuthScheme::Bearer).description(Some(description)).build(),
            )
        };
        components.add_security_scheme(
            "admin",
            bearer(
                "The deployment's admin token (every project), or a project's key (`cohort_key_` and 64 hex \
                 digits): its project only; a `viewer` reads, an `operator` also runs tasks and their tokens, \
                 an `owner` also manages keys and reads the audit log",
            ),
        );
        components.add_security_scheme("client", bearer("A credential from /v1/tasks/{id}/enroll"));
    }
}

/// The request types that are internally tagged enums refusing unknown
/// fields (`#[serde(tag = "kind", deny_unknown_fields)]`): utoipa closes a
/// struct's object schema but not an enum variant's, so [`document`]
/// closes each variant of these (a test checks each refuses a field it
/// does not know).
pub const CLOSED_ENUMS: [&str; 2] = ["ServerOptimizer", "ModelInit"];

/// The document, put together by [`super::app`] from [`Document`] and the
/// routes.
pub fn document(routes: OpenApi) -> serde_json::Value {
    let mut document = <Document as utoipa::OpenApi>::openapi().merge_from(routes);
    document.info.version = env!("CARGO_PKG_VERSION").to_string();
    let mut document =
        serde_json::to_value(&document).unwrap_or_else(|e| panic!("the OpenAPI document serializes: {e}"));
    link_fields_in_camel_case(&mut document);
    integer_ranges(&mut document);
    for name in CLOSED_ENUMS {
        if let Some(variants) = document["components"]["schemas"][name]["oneOf"].as_array_mut() {
            for variant in variants.iter_mut().filter(|v| v["type"] == "object") {
                variant["additionalProperties"] = false.into();
            }
        }
    }
    document
}

/// Gives every integer schema the range of the Rust integer behind it
/// (`format`: `uint32` is a `u32`, from utoipa's `non_strict_integers`),
/// narrowed by any bound a field states itself: JSON Schema knows no
/// integer widths, and a generator that reads `uint32` as "any integer"
/// writes numbers a `u32` cannot hold.
fn integer_ranges(value: &mut serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::Object(fields) => {
            // utoipa 5.5 spells the unsigned formats `u-int32`.
            let range: Option<(&str, i128, i128)> = match fields.get("format").and_then(Value::as_str) {
                Some("int8") => Some(("int8", i8::MIN.into(), i8::MAX.into())),
                Some("int16") => Some(("int16", i16::MIN.into(), i16::MAX.into())),
                Some("int32") => Some(("int32", i32::MIN.into(), i32::MAX.into())),
                Some("int64") => Some(("int64", i64::MIN.into(), i64::MAX.into())),
                Some("uint8" | "u-int8") => Some(("uint8", 0, u8::MAX.into())),
                Some("uint16" | "u-int16") => Some(("uint16", 0, u16::MAX.into())),
                Some("uint32" | "u-int32") => Some(("uint32", 0, u32::MAX.into())),
                Some("uint64" | "u-int64") => Some(("uint64", 0, u64::MAX.into())),
                _ => None,
            };
            if let Some((format, low, high)) = range {
                fields.insert("format".into(), format.into());
                let stated = |fields: &serde_json::Map<String, Value>, key: &str| {
                    fields
                        .get(key)
                        .and_then(|v| v.as_i64().map(i128::from).or_else(|| v.as_u64().map(i128::from)))
                };
                let low = stated(fields, "minimum").map_or(low, |m| m.max(low));
                let high = stated(fields, "maximum").map_or(high, |m| m.min(high));
                let number = |n: i128| {
                    u64::try_from(n)
                        .map(Value::from)
                        .unwrap_or_else(|_| Value::from(i64::try_from(n).unwrap_or(i64::MIN)))
                };
                fields.insert("minimum".into(), number(low));
                fields.insert("maximum".into(), number(high));
            }
            fields.values_mut().for_each(integer_ranges);
        }
        Value::Array(items) => items.iter_mut().for_each(integer_ranges),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => {}
    }
}

/// utoipa 5 writes a Link Object's fields as the Rust fields are named
/// (`operation_id`); OpenAPI names them `operationId`, `operationRef` and
/// `requestBody`, and a client that follows links reads only those.
fn link_fields_in_camel_case(document: &mut serde_json::Value) {
    let Some(paths) = document["paths"].as_object_mut() else { return };
    let responses = paths
        .values_mut()
        .filter_map(|item| item.as_object_mut())
        .flat_map(|item| item.values_mut())
        .filter_map(|operation| operation.get_mut("responses")?.as_object_mut())
        .flat_map(|responses| responses.values_mut());
    for response in responses {
        let Some(links) = response.get_mut("links").and_then(|l| l.as_object_mut()) else { continue };
        for link in links.values_mut().filter_map(|l| l.as_object_mut()) {
            for (from, to) in [
                ("operation_id", "operationId"),
                ("operation_ref", "operationRef"),
                ("request_body", "requestBody"),
            ] {
                if let Some(value) = link.remove(from) {
                    link.insert(to.to_string(), value);
                }
            }
        }
    }
}
