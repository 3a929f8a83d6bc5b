//! The admin API for tests: one client, typed over the server's own
//! response types ([`TaskView`], [`RoundView`], [`FailedAttempt`], …), so
//! that a test reads the fields the API documents and a change to them
//! breaks the test at compile time, not at a JSON lookup.
//!
//! Plain HTTP goes over a fresh connection per call (the `try_*` calls
//! answer `None` when it closes without a response: a replica killed
//! mid-request, a balancer cutting a marked-down server's sessions, which
//! a client retries); `https` goes through the client library's transport,
//! trusting the test CA.

use cohort_client::participant::{Method, Request};
use cohort_client::runtime::Transport;
use cohort_client::runtime::http::HttpTransport;
use cohort_server::api::{CreatedTask, RoundView, StatusChanged, TaskView, TokenView};
use cohort_server::round::FailedAttempt;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::process::try_exchange;

/// An admin client of one coordinator (or of a balancer in front of
/// several).
#[derive(Debug, Clone)]
pub struct AdminClient {
    wire: Wire,
    token: String,
}

#[derive(Debug, Clone)]
enum Wire {
    /// Plain HTTP/1.1 on a loopback port.
    Plain(u16),
    /// HTTPS, GET and POST only.
    Tls(HttpTransport),
}

/// A reply: its status and body.
pub type Reply = (u16, Vec<u8>);

impl AdminClient {
    /// A client of the coordinator (or balancer) on loopback `port`.
    pub fn new(port: u16, token: &str) -> Self {
        Self { wire: Wire::Plain(port), token: token.into() }
    }

    /// A client over `transport` (an `https` coordinator).
    pub fn over(transport: HttpTransport, token: &str) -> Self {
        Self { wire: Wire::Tls(transport), token: token.into() }
    }

    /// The token or key this client presents.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// One call with `headers` added, or `None` when the connection closed
    /// without a response.
    pub fn try_send_with(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Option<(u16, String, Vec<u8>)> {
        match &self.wire {
            Wire::Plain(port) => {
                try_exchange(*port, method, path, Some(&self.token), "application/json", headers, body)
            }
            Wire::Tls(transport) => {
                assert!(headers.is_empty(), "extra headers are sent over plain HTTP only");
                let method = match method {
                    "GET" => Method::Get,
                    "POST" => Method::Post,
                    other => panic!("{other} is sent over plain HTTP only"),
                };
                let request = Request {
                    method,
                    path: path.into(),
                    body: body.to_vec(),
                    content_type: Some("application/json"),
                    bearer: Some(self.token.clone()),
                };
                let response = transport.clone().send(&request).ok()?;
                Some((response.status, String::new(), response.body))
            }
        }
    }

    /// One call with a raw body, or `None` when the connection closed
    /// without a response.
    pub fn try_send(&self, method: &str, path: &str, body: &[u8]) -> Option<Reply> {
        self.try_send_with(method, path, &[], body).map(|(status, _, body)| (status, body))
    }

    /// One call with a raw body.
    pub fn send(&self, method: &str, path: &str, body: &[u8]) -> Reply {
        self.try_send(method, path, body).unwrap_or_else(|| panic!("no HTTP response to {method} {path}"))
    }

    /// One call with an optional JSON body: its status and its JSON body
    /// (`null` when it has none).
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        self.try_call(method, path, body).unwrap_or_else(|| panic!("no HTTP response to {method} {path}"))
    }

    /// [`call`](Self::call), or `None` when the connection closed without
    /// a response.
    pub fn try_call(&self, method: &str, path: &str, body: Option<&Value>) -> Option<(u16, Value)> {
        let bytes = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
        let (status, body) = self.try_send(method, path, &bytes)?;
        Some((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
    }

    /// A `GET` that must answer `200`, its body read as `T`.
    pub fn get<T: DeserializeOwned>(&self, path: &str) -> T {
        let (status, body) = self.send("GET", path, &[]);
        assert_eq!(status, 200, "GET {path}: {}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// [`get`](Self::get), or `None` when there was no `200` answer (the
    /// connection closed, or a replica between leaders answered `503`).
    pub fn try_get<T: DeserializeOwned>(&self, path: &str) -> Option<T> {
        match self.try_send("GET", path, &[])? {
            (200, body) => Some(serde_json::from_slice(&body).unwrap_or_else(|e| panic!("GET {path}: {e}"))),
            _ => None,
        }
    }

    /// Creates a task from `spec`, which must be accepted.
    pub fn create_task(&self, spec: &Value) -> CreatedTask {
        let (status, body) = self.send("POST", "/admin/tasks", spec.to_string().as_bytes());
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).unwrap()
    }

    /// The task `id`.
    pub fn task(&self, id: &str) -> TaskView {
        self.get(&format!("/admin/tasks/{id}"))
    }

    /// Every task.
    pub fn tasks(&self) -> Vec<TaskView> {
        self.get("/admin/tasks")
    }

    /// The completed rounds of task `id`, oldest first.
    pub fn rounds(&self, id: &str) -> Vec<RoundView> {
        self.get(&format!("/admin/tasks/{id}/rounds"))
    }

    /// [`rounds`](Self::rounds), or `None` without a `200` answer.
    pub fn try_rounds(&self, id: &str) -> Option<Vec<RoundView>> {
        self.try_get(&format!("/admin/tasks/{id}/rounds"))
    }

    /// The failed attempts of task `id`, newest first.
    pub fn attempts(&self, id: &str) -> Vec<FailedAttempt> {
        self.get(&format!("/admin/tasks/{id}/attempts"))
    }

    /// The enrollment tokens of task `id`.
    pub fn tokens(&self, id: &str) -> Vec<TokenView> {
        self.get(&format!("/admin/tasks/{id}/tokens"))
    }

    /// Pauses, resumes or stops task `id` (`action`: `pause`, `resume`,
    /// `stop`), which must succeed.
    pub fn set_status(&self, id: &str, action: &str) -> StatusChanged {
        let (status, body) = self.send("POST", &format!("/admin/tasks/{id}/{action}"), &[]);
        assert_eq!(status, 200, "{action}: {}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).unwrap()
    }

    /// The client policy for task `id` (see [`crate::policy_json`]), from
    /// the spec in its view.
    pub fn policy_json(&self, id: &str) -> String {
        crate::policy_json(&serde_json::to_value(self.task(id).spec).unwrap())
    }
}
