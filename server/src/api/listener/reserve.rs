//! What a connection over a cap gets: its request head is read within
//! [`HEAD_TIMEOUT`]; a probe (`GET` or `HEAD` of `/healthz` or `/readyz`)
//! is answered as usual, anything else with a canned `503` and
//! `Retry-After`, and the connection is closed.
//!
//! At most [`RESERVED`] connections are held here at once, at most
//! [`RESERVED_PER_GROUP`] of them per address ([`PeerGroup`]); beyond that a
//! connection is closed unanswered. Each one lives at most [`LIFETIME`].

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Method, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

use super::peers::{PeerCounts, PeerGroup, PeerSlot};

/// Connections over a cap held at once.
pub(super) const RESERVED: usize = 256;
/// Of those, how many one address may hold.
pub(super) const RESERVED_PER_GROUP: usize = 8;
/// Time to send the request head (or the connection's header timeout, if
/// shorter). A probe sends its request at once.
pub(super) const HEAD_TIMEOUT: Duration = Duration::from_secs(1);
/// The most a reserved connection lives: the head, the answer (readiness
/// waits up to 2 s for the database) and draining what the client sent.
pub(super) const LIFETIME: Duration = Duration::from_secs(5);
/// Time given to a client to read the answer while what it sent is drained.
const DRAIN: Duration = Duration::from_secs(1);

/// The paths answered over the cap.
const PROBES: [&str; 2] = ["/healthz", "/readyz"];

/// The answer to anything but a probe over the cap.
const OVERLOADED: &str = r#"{"error":"overloaded","message":"too many connections; retry shortly"}"#;

/// Slots for connections over a cap.
#[derive(Debug)]
pub(super) struct Reserve {
    permits: Arc<Semaphore>,
    groups: Arc<PeerCounts>,
}

/// A connection's place in the [`Reserve`].
#[derive(Debug)]
pub(super) struct Reserved {
    _permit: OwnedSemaphorePermit,
    _slot: PeerSlot,
}

impl Reserve {
    pub(super) fn new() -> Self {
        Self { permits: Arc::new(Semaphore::new(RESERVED)), groups: Arc::default() }
    }

    /// A place for a connection from `group`, if one is free.
    pub(super) fn admit(&self, group: PeerGroup) -> Option<Reserved> {
        let slot = self.groups.admit(group, RESERVED_PER_GROUP)?;
        let permit = self.permits.clone().try_acquire_owned().ok()?;
        Some(Reserved { _permit: permit, _slot: slot })
    }

    /// A place for a connection whose address is not known yet (a trusted
    /// balancer's, before its PROXY protocol header), if one is free: it
    /// counts against the reserve's total now and against its client's
    /// share once the header names the client ([`Reserve::admit_held`]).
    pub(super) fn hold(&self) -> Option<OwnedSemaphorePermit> {
        self.permits.clone().try_acquire_owned().ok()
    }

    /// The place `held` (from [`Reserve::hold`]) for a connection from
    /// `group`, if the group has room.
    pub(super) fn admit_held(&self, held: OwnedSemaphorePermit, group: PeerGroup) -> Option<Reserved> {
        let slot = self.groups.admit(group, RESERVED_PER_GROUP)?;
        Some(Reserved { _permit: held, _slot: slot })
    }
}

/// Whether `request` is a health or readiness probe.
fn is_probe<B>(request: &hyper::Request<B>) -> bool {
    matches!(*request.method(), Method::GET | Method::HEAD) && PROBES.contains(&request.uri().path())
}

/// The `503` over the cap.
fn overloaded() -> Response<Body> {
    let mut response = Response::new(Body::from(OVERLOADED));
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Serves one request of a connection over a cap (see the module doc),
/// within `header_timeout` for its head if that is shorter than
/// [`HEAD_TIMEOUT`].
pub(super) async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    header_timeout: Duration,
    reserved: Reserved,
) {
    let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
        let router = router.clone();
        async move {
            if !is_probe(&request) {
                return Ok::<_, Infallible>(overloaded());
            }
            request.extensions_mut().insert(ConnectInfo(peer));
            let response = router.oneshot(request.map(Body::new)).await.unwrap_or_else(|e| match e {});
            Ok(response)
        }
    });
    let _ = tokio::time::timeout(LIFETIME, async move {
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEAD_TIMEOUT.min(header_timeout))
            .keep_alive(false)
            .serve_connection(TokioIo::new(stream), service)
            .without_shutdown();
        let Ok(parts) = connection.await else { return };
        // Closing with unread bytes would reset the connection, and the
        // client could lose the answer: drain them first.
        let mut stream = parts.io.into_inner();
        let _ = tokio::time::timeout(DRAIN, async {
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<_, std::io::Error>(())
        })
        .await;
    })
    .await;
    drop(reserved);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_gets_and_heads_of_the_two_probes_are_probes() {
        let request =
            |method: Method, path: &str| hyper::Request::builder().method(method).uri(path).body(());
        assert!(is_probe(&request(Method::GET, "/healthz").unwrap()));
        assert!(is_probe(&request(Method::HEAD, "/readyz").unwrap()));
        assert!(is_probe(&request(Method::GET, "/readyz?verbose=1").unwrap()));
        assert!(!is_probe(&request(Method::POST, "/healthz").unwrap()));
        assert!(!is_probe(&request(Method::GET, "/healthz/x").unwrap()));
        assert!(!is_probe(&request(Method::GET, "/metrics").unwrap()));
        assert!(!is_probe(&request(Method::GET, "/admin/tasks").unwrap()));
    }

    #[test]
    fn the_reserve_holds_a_few_per_address_and_a_bounded_number_in_all() {
        let reserve = Reserve::new();
        let one = PeerGroup::of("192.0.2.1".parse().unwrap());
        let held: Vec<Reserved> = (0..RESERVED_PER_GROUP).map(|_| reserve.admit(one).unwrap()).collect();
        assert!(reserve.admit(one).is_none(), "one address over its share of the reserve");
        let mut others = Vec::new();
        for host in 0..RESERVED {
            let group =
                PeerGroup::of(std::net::IpAddr::from([198, 51, (host / 256) as u8, (host % 256) as u8]));
            match reserve.admit(group) {
                Some(reserved) => others.push(reserved),
                None => break,
            }
        }
        assert_eq!(held.len() + others.len(), RESERVED, "the reserve holds {RESERVED} in all");
        drop(held);
        assert!(reserve.admit(one).is_some(), "places given back are free again");
    }
}
