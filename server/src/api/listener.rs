//! Accepting and serving connections, plain or TLS, within limits that a
//! stranger cannot exhaust.
//!
//! * **Connection cap.** At most [`ConnectionLimits::max_connections`]
//!   connections are served at once, a number kept below the process's
//!   descriptor limit.
//! * **Per-address cap.** One client address holds at most
//!   [`ConnectionLimits::max_connections_per_address`] of them (IPv6 counted
//!   by /64, see `peers`), so that one host cannot take the whole cap.
//!   Loopback counts like any address: a local reverse proxy or load
//!   generator is one address, and is configured as such.
//! * **Over a cap.** A connection beyond either cap is not served but
//!   triaged in a small reserve (`reserve`): its request head is read
//!   within a second; `GET /healthz` and `GET /readyz` are answered as
//!   usual, anything else gets a canned `503` with `Retry-After`, instead
//!   of `accept` failing for everybody. So liveness and readiness probes
//!   keep their answers while the cap is full, on the port they already
//!   probe, with nothing to configure: the reserve was chosen over a
//!   separate health listener because a probe on another port says nothing
//!   about the port clients use, and every balancer and orchestrator
//!   config (ours included, see `docs/DEPLOYMENT.md`) would need changing
//!   to gain it. The reserve holds a bounded number of connections, a few
//!   per address, each for at most a few seconds, so one host cannot fill
//!   it either. Over TLS a connection over a cap is closed at once
//!   (answering needs a handshake, which is the expensive part of TLS).
//! * **Trusted balancers.** A connection from a network in
//!   `trusted_proxies` begins with a PROXY protocol header naming its
//!   client ([`proxy`]): it takes its place under the global cap (or, with
//!   the cap full, in the reserve, so that the balancer's health checks
//!   are answered) when accepted, and under its client's per-address cap
//!   once the header, read within the header timeout, has named the
//!   client. Over TLS, the header and the handshake share that one
//!   timeout.
//! * **Trusted HTTP proxies.** On a connection from a network in
//!   `trusted_http_proxies`, each request's client is the last
//!   `X-Forwarded-For` entry ([`forwarded`]). Such a proxy multiplexes
//!   many clients over its connections, so they count under the global cap
//!   only, not under the proxy's address's cap.
//! * **Header timeout.** A client has [`ConnectionLimits::header_timeout`]
//!   to complete the TLS handshake, then as long again to send its first
//!   request head (a connection that sends nothing is closed then, not at
//!   the idle timeout: hyper's header timer starts only once the first
//!   byte has told HTTP/1 from HTTP/2), and each later request head (hyper's
//!   HTTP/1 header timer, also between keep-alive requests).
//! * **Idle timeout.** A connection with no request in flight for
//!   [`ConnectionLimits::idle_timeout`] is shut down gracefully (HTTP/1 and
//!   HTTP/2 alike): a request is in flight from its head until its response
//!   body has been written.
//! * **Minimum body rate.** A request body must arrive at
//!   [`ConnectionLimits::body_min_rate`] bytes per second on average after a
//!   grace period ([`MinRateBody`]); a slower one fails with `408`.
//! * **Shutdown.** [`serve`] stops accepting when told to, asks every
//!   connection to finish its request in flight, and cuts whatever is left
//!   after [`ConnectionLimits::shutdown_grace`].
//! * **Memory.** Once a burst of connections has closed, the allocator is
//!   asked to hand what they used back to the system (`trim`: glibc keeps
//!   it otherwise).

pub mod forwarded;
mod peers;
pub mod proxy;
mod reserve;
mod trim;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

use peers::{PeerCounts, PeerGroup, PeerSlot};
pub use proxy::TrustedProxies;
use reserve::Reserve;

/// Limits applied to every connection of a listener.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConnectionLimits {
    /// Connections served at once; more are refused with a `503`.
    pub max_connections: usize,
    /// Connections served at once from one address (an IPv6 /64); more are
    /// refused like those over `max_connections`. At or above
    /// `max_connections`, no address is held back before the cap.
    pub max_connections_per_address: usize,
    /// Time to complete the TLS handshake and each request head.
    pub header_timeout: Duration,
    /// A connection with no request in flight for this long is closed.
    pub idle_timeout: Duration,
    /// Bytes per second a request body must average after
    /// [`body_grace`](Self::body_grace).
    pub body_min_rate: u64,
    /// Time a request body may take before the minimum rate applies.
    pub body_grace: Duration,
    /// On shutdown, time given to requests in flight before their
    /// connections are cut.
    pub shutdown_grace: Duration,
}

/// Descriptors kept free for the database, files and refusals.
const RESERVED_DESCRIPTORS: u64 = 256;
/// Connections one address may hold by default: room for many clients
/// behind one NAT, a small share of the default cap.
pub const DEFAULT_MAX_CONNECTIONS_PER_ADDRESS: usize = 256;
/// HTTP/2 streams per connection.
const MAX_STREAMS: u32 = 64;

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: default_max_connections(),
            max_connections_per_address: DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            body_min_rate: 1024,
            body_grace: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// Raises the soft descriptor limit to the hard one (once per process)
/// and returns it.
pub fn raise_descriptor_limit() -> u64 {
    static RAISED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *RAISED.get_or_init(|| rlimit::increase_nofile_limit(u64::MAX).unwrap_or(1024))
}

/// 8 192 connections, or fewer if the descriptor limit (raised to its hard
/// maximum first) leaves less room.
pub fn default_max_connections() -> usize {
    let descriptors = raise_descriptor_limit();
    usize::try_from(descriptors.saturating_sub(RESERVED_DESCRIPTORS).clamp(64, 8192)).unwrap_or(8192)
}

/// Why [`ConnectionLimits`] were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitsError {
    /// `max_connections` is zero.
    #[error("max_connections must be positive")]
    NoConnections,
    /// `max_connections_per_address` is zero.
    #[error("max_connections_per_address must be positive")]
    NoConnectionsPerAddress,
    /// `max_connections` leaves too few descriptors for the process.
    #[error(
        "max_connections {max_connections} leaves fewer than {RESERVED_DESCRIPTORS} of the process's \
         {descriptors} file descriptors free; lower it or raise the limit (ulimit -n)"
    )]
    TooManyConnections {
        /// The limit asked for.
        max_connections: usize,
        /// The process's descriptor limit.
        descriptors: u64,
    },
    /// A timeout is zero.
    #[error("{0} must be positive")]
    ZeroTimeout(&'static str),
}

impl ConnectionLimits {
    /// Checks that the limits leave room for descriptors the process needs
    /// and that every time is positive.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let descriptors = raise_descriptor_limit();
        if self.max_connections == 0 {
            return Err(LimitsError::NoConnections);
        }
        if self.max_connections_per_address == 0 {
            return Err(LimitsError::NoConnectionsPerAddress);
        }
        if self.max_connections as u64 + RESERVED_DESCRIPTORS > descriptors {
            return Err(LimitsError::TooManyConnections {
                max_connections: self.max_connections,
                descriptors,
            });
        }
        for (name, value) in [
            ("header_timeout", self.header_timeout),
            ("idle_timeout", self.idle_timeout),
            ("shutdown_grace", self.shutdown_grace),
        ] {
            if value.is_zero() {
                return Err(LimitsError::ZeroTimeout(name));
            }
        }
        Ok(())
    }
}

/// Binds `address` with a listen backlog that can hold a burst of
/// `max_connections` new connections (the kernel caps it at
/// `net.core.somaxconn`): with tokio's default of 1 024, a burst of
/// connections overflows the queue and every client behind it, a health
/// probe included, waits a second for its SYN to be sent again.
pub fn bind(address: SocketAddr, max_connections: usize) -> std::io::Result<TcpListener> {
    let socket =
        if address.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(u32::try_from(max_connections).unwrap_or(u32::MAX).clamp(1024, 65_535))
}

/// The proxies whose word on a client's address is taken.
#[derive(Debug, Clone, Default)]
pub struct Proxies {
    /// Their connections begin with a PROXY protocol header naming the
    /// client (`trusted_proxies`, see [`proxy`]).
    pub protocol: TrustedProxies,
    /// Their requests name the client in `X-Forwarded-For`
    /// (`trusted_http_proxies`, see [`forwarded`]).
    pub http: TrustedProxies,
}

impl From<TrustedProxies> for Proxies {
    fn from(protocol: TrustedProxies) -> Self {
        Self { protocol, http: TrustedProxies::default() }
    }
}

/// Serves `router` on `listener` until `shutdown` fires (or its sender is
/// dropped), then shuts down within [`ConnectionLimits::shutdown_grace`].
/// Connections from `proxies.protocol` begin with a PROXY protocol header
/// naming their client (see [`proxy`]); requests on connections from
/// `proxies.http` name theirs in `X-Forwarded-For` (see [`forwarded`]).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: ConnectionLimits,
    proxies: Proxies,
    mut shutdown: oneshot::Receiver<()>,
) -> std::io::Result<()> {
    let Proxies { protocol: proxies, http: http_proxies } = proxies;
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let trimmer = tokio::spawn(trim::after_bursts(permits.clone(), limits.max_connections));
    let (closing, close) = watch::channel(false);
    let admission = Arc::new(Admission {
        router,
        acceptor: tls.map(tokio_rustls::TlsAcceptor::from),
        limits,
        permits,
        per_address: Arc::new(PeerCounts::default()),
        reserve: Reserve::new(),
        http_proxies,
        close,
    });
    let mut connections = JoinSet::new();
    loop {
        let (mut stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(connection) => connection,
                Err(error) => {
                    // Out of descriptors despite the cap (something else
                    // holds them): back off rather than spin.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        while connections.try_join_next().is_some() {}
        if !proxies.trusts(peer.ip()) {
            if let Some(connection) = admission.admit(stream, peer, None, Arrival::Direct) {
                connections.spawn(connection);
            }
            continue;
        }
        // From a trusted balancer: the connection takes its place under the
        // global cap now, and under its client's address's cap once the
        // header has named the client. Over the global cap it takes a place
        // in the reserve instead (plain HTTP), so that the balancer's health
        // checks are answered while the cap is full.
        let place = match admission.permits.clone().try_acquire_owned() {
            Ok(permit) => Place::Served(permit),
            Err(_) => match admission.reserve.hold() {
                Some(held) if admission.acceptor.is_none() => Place::Reserve(held),
                _ => continue,
            },
        };
        let admission = admission.clone();
        let accepted = Instant::now();
        connections.spawn(async move {
            let within = match place {
                Place::Served(_) => limits.header_timeout,
                Place::Reserve(_) => reserve::HEAD_TIMEOUT.min(limits.header_timeout),
            };
            let client = match tokio::time::timeout(within, proxy::read_header(&mut stream)).await {
                Ok(Ok(client)) => client.unwrap_or(peer),
                Ok(Err(error)) => return refused_header(peer, &error),
                Err(_) => {
                    tracing::debug!(%peer, "no PROXY protocol header within the header timeout");
                    return;
                }
            };
            match place {
                Place::Served(permit) => {
                    // Named by a PROXY protocol header: never a trusted HTTP
                    // proxy, whatever address the header names.
                    let arrival = Arrival::Proxied(accepted);
                    if let Some(connection) = admission.admit(stream, client, Some(permit), arrival) {
                        connection.await;
                    }
                }
                Place::Reserve(held) => {
                    let group = PeerGroup::of(client.ip());
                    if let Some(reserved) = admission.reserve.admit_held(held, group) {
                        let router = admission.router.clone();
                        reserve::serve(stream, client, router, limits.header_timeout, reserved).await;
                    }
                }
            }
        });
    }
    drop(listener);
    trimmer.abort();
    let _ = closing.send(true);
    let drained = tokio::time::timeout(limits.shutdown_grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            cut = connections.len(),
            "connections still open after the shutdown grace; cutting them"
        );
        connections.shutdown().await;
    }
    Ok(())
}

/// How a connection reached [`Admission::admit`].
#[derive(Debug, Clone, Copy)]
enum Arrival {
    /// Straight from its peer.
    Direct,
    /// Through a trusted balancer, accepted at this instant: its PROXY
    /// protocol header and its TLS handshake share one header timeout from
    /// then, as a direct connection's handshake has one of its own.
    Proxied(Instant),
}

/// Where a connection from a trusted balancer waits for its header.
enum Place {
    /// Under the global cap.
    Served(tokio::sync::OwnedSemaphorePermit),
    /// In the reserve: the global cap is full.
    Reserve(tokio::sync::OwnedSemaphorePermit),
}

/// Logs a connection from a trusted balancer closed for its header: at
/// `warn` at most once a minute (a balancer configured without the header
/// would otherwise write a line a connection), at `debug` otherwise.
fn refused_header(peer: SocketAddr, error: &proxy::HeaderError) {
    static LAST_WARNED: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs());
    let last = LAST_WARNED.load(Ordering::Relaxed);
    if now >= last + 60
        && LAST_WARNED.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    {
        tracing::warn!(%peer, %error, "closed a connection from a trusted proxy (logged once a minute)");
    } else {
        tracing::debug!(%peer, %error, "closed a connection from a trusted proxy");
    }
}

/// A connection's serving, once admitted.
type Serving = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// What admitting a connection under the caps needs.
struct Admission {
    router: Router,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    limits: ConnectionLimits,
    permits: Arc<Semaphore>,
    per_address: Arc<PeerCounts>,
    reserve: Reserve,
    http_proxies: TrustedProxies,
    close: watch::Receiver<bool>,
}

impl Admission {
    /// Admits a connection from `peer` under the per-address cap and the
    /// global one (`permit`, if it holds its place already) and returns
    /// its serving; over a cap, its triage in the reserve (plain HTTP, if
    /// the reserve has room for the address), or `None` (it is closed).
    /// `peer` is the connection's own address when it arrived directly,
    /// else the client a PROXY protocol header named: only a direct
    /// connection from a trusted HTTP proxy has its `X-Forwarded-For`
    /// read.
    fn admit(
        &self,
        stream: tokio::net::TcpStream,
        peer: SocketAddr,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
        arrival: Arrival,
    ) -> Option<Serving> {
        let limits = self.limits;
        let group = PeerGroup::of(peer.ip());
        // A trusted HTTP proxy carries many clients: the global cap only.
        let forwarded = matches!(arrival, Arrival::Direct) && self.http_proxies.trusts(peer.ip());
        let cap = if forwarded { usize::MAX } else { limits.max_connections_per_address };
        let admitted = self.per_address.admit(group, cap).and_then(|slot| {
            let permit = match permit {
                Some(permit) => permit,
                None => self.permits.clone().try_acquire_owned().ok()?,
            };
            Some((permit, slot))
        });
        let Some((permit, slot)) = admitted else {
            // Over a cap: probes are answered, the rest refused (plain
            // HTTP), as long as the reserve has room for this address.
            let reserved = if self.acceptor.is_none() { self.reserve.admit(group) } else { None };
            return reserved.map(|reserved| -> Serving {
                Box::pin(reserve::serve(stream, peer, self.router.clone(), limits.header_timeout, reserved))
            });
        };
        let connection = Connection {
            peer,
            forwarded,
            router: self.router.clone(),
            limits,
            close: self.close.clone(),
            _permit: permit,
            _slot: slot,
        };
        let acceptor = self.acceptor.clone();
        Some(Box::pin(async move {
            let _ = stream.set_nodelay(true);
            let handshake_by = match arrival {
                Arrival::Direct => Instant::now() + limits.header_timeout,
                Arrival::Proxied(accepted) => accepted + limits.header_timeout,
            };
            match acceptor {
                None => connection.serve(stream).await,
                Some(acceptor) => {
                    match tokio::time::timeout_at(handshake_by, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => connection.serve(stream).await,
                        Ok(Err(error)) => tracing::debug!(%peer, %error, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
            }
        }))
    }
}

/// One accepted connection and what serving it needs.
struct Connection {
    peer: SocketAddr,
    /// From a trusted HTTP proxy: each request's client is in its
    /// `X-Forwarded-For`.
    forwarded: bool,
    router: Router,
    limits: ConnectionLimits,
    close: watch::Receiver<bool>,
    _permit: tokio::sync::OwnedSemaphorePermit,
    _slot: PeerSlot,
}

impl Connection {
    async fn serve<I>(mut self, io: I)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let limits = self.limits;
        let activity = Arc::new(Activity::new());
        let service = {
            let (router, activity, peer, forwarded) =
                (self.router.clone(), activity.clone(), self.peer, self.forwarded);
            hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                let (router, guard) = (router.clone(), activity.begin());
                async move {
                    let mut request = request.map(|body| {
                        Body::new(MinRateBody::new(body, limits.body_min_rate, limits.body_grace))
                    });
                    let client = if forwarded {
                        match forwarded::client(request.headers()) {
                            Ok(client) => client.map_or(peer, |ip| SocketAddr::new(ip, 0)),
                            Err(error) => {
                                let refusal = (axum::http::StatusCode::BAD_REQUEST, error.to_string());
                                let response = axum::response::IntoResponse::into_response(refusal);
                                return Ok(response.map(|body| Body::new(InFlight { body, _guard: guard })));
                            }
                        }
                    } else {
                        peer
                    };
                    request.extensions_mut().insert(ConnectInfo(client));
                    let response = router.oneshot(request).await.unwrap_or_else(|e: Infallible| match e {});
                    Ok::<_, Infallible>(response.map(|body| Body::new(InFlight { body, _guard: guard })))
                }
            })
        };
        let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(MAX_STREAMS)
            .keep_alive_interval(Some(limits.idle_timeout))
            .keep_alive_timeout(limits.header_timeout);
        let connection = builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(connection);
        let mut closing = false;
        let cut = tokio::time::sleep(Duration::MAX / 4);
        tokio::pin!(cut);
        // hyper's header timer starts once the first bytes have told HTTP/1
        // from HTTP/2: until then, a silent connection would live until the
        // idle timeout. The first request must begin within the header
        // timeout.
        let first_request_by = Instant::now() + limits.header_timeout;
        loop {
            let idle_at = activity.idle_deadline(limits.idle_timeout);
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(error) = result {
                        tracing::debug!(peer = %self.peer, %error, "connection ended with an error");
                    }
                    return;
                }
                changed = self.close.changed(), if !closing => {
                    if changed.is_err() || *self.close.borrow() {
                        connection.as_mut().graceful_shutdown();
                        closing = true;
                        cut.as_mut().reset(Instant::now() + limits.shutdown_grace);
                    }
                }
                _ = tokio::time::sleep_until(idle_at), if !closing => {
                    if activity.idle_for(limits.idle_timeout) {
                        connection.as_mut().graceful_shutdown();
                        closing = true;
                        cut.as_mut().reset(Instant::now() + limits.header_timeout);
                    }
                }
                _ = tokio::time::sleep_until(first_request_by), if !activity.begun() => {
                    if !activity.begun() {
                        tracing::debug!(peer = %self.peer, "no request within the header timeout");
                        return;
                    }
                }
                _ = &mut cut, if closing => return,
            }
        }
    }
}

/// Requests in flight on one connection and when the last one ended.
struct Activity {
    start: Instant,
    /// Whether a request has begun.
    begun: AtomicBool,
    in_flight: AtomicUsize,
    /// Milliseconds after `start` when the connection last became idle.
    idle_since_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            begun: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
        }
    }

    fn begun(&self) -> bool {
        self.begun.load(Ordering::SeqCst)
    }

    fn begin(self: &Arc<Self>) -> ActivityGuard {
        self.begun.store(true, Ordering::SeqCst);
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        ActivityGuard(self.clone())
    }

    fn idle_since(&self) -> Instant {
        self.start + Duration::from_millis(self.idle_since_ms.load(Ordering::SeqCst))
    }

    /// When the connection will have been idle for `timeout`, if nothing
    /// changes (a request in flight: check again after `timeout`).
    fn idle_deadline(&self, timeout: Duration) -> Instant {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            Instant::now() + timeout
        } else {
            self.idle_since() + timeout
        }
    }

    fn idle_for(&self, timeout: Duration) -> bool {
        self.in_flight.load(Ordering::SeqCst) == 0 && self.idle_since().elapsed() >= timeout
    }
}

/// Marks a request in flight until dropped (with its response body).
struct ActivityGuard(Arc<Activity>);

impl Drop for ActivityGuard {
    fn drop(&mut self) {
        let elapsed = u64::try_from(self.0.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.idle_since_ms.store(elapsed, Ordering::SeqCst);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its request in flight until it is written.
struct InFlight {
    body: Body,
    _guard: ActivityGuard,
}

impl HttpBody for InFlight {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body arrived more slowly than the server's minimum rate.
#[derive(Debug, thiserror::Error)]
#[error("the request body arrived more slowly than {min_rate} bytes per second")]
pub struct SlowBody {
    /// The minimum rate.
    pub min_rate: u64,
}

/// A request body that must keep to a minimum average rate: from its first
/// read, it has `grace` plus one second per `min_rate` bytes received so
/// far to deliver its next frame.
pub struct MinRateBody<B> {
    inner: B,
    min_rate: u64,
    grace: Duration,
    started: Option<Instant>,
    received: u64,
    deadline: Pin<Box<Sleep>>,
}

impl<B> MinRateBody<B> {
    /// Wraps `inner`; a `min_rate` of 0 disables the check.
    pub fn new(inner: B, min_rate: u64, grace: Duration) -> Self {
        Self {
            inner,
            min_rate,
            grace,
            started: None,
            received: 0,
            deadline: Box::pin(tokio::time::sleep(Duration::MAX / 4)),
        }
    }

    fn allowed_until(&self, started: Instant) -> Instant {
        let earned = Duration::from_secs_f64(self.received as f64 / self.min_rate.max(1) as f64);
        started + self.grace + earned
    }
}

impl<B> HttpBody for MinRateBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if this.min_rate > 0 && this.started.is_none() {
            let now = Instant::now();
            this.started = Some(now);
            this.deadline.as_mut().reset(now + this.grace);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(started)) = (frame.data_ref(), this.started) {
                    this.received += data.len() as u64;
                    let until = this.allowed_until(started);
                    this.deadline.as_mut().reset(until);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => Poll::Ready(Some(Err(error.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                if this.min_rate > 0 && this.deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Some(Err(Box::new(SlowBody { min_rate: this.min_rate }))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A body that yields `left` data frames of `size` bytes, `every` apart.
    struct Chunks {
        left: usize,
        size: usize,
        every: Duration,
        next: Pin<Box<Sleep>>,
    }

    fn trickle(left: usize, size: usize, every: Duration) -> Chunks {
        Chunks { left, size, every, next: Box::pin(tokio::time::sleep(every)) }
    }

    impl HttpBody for Chunks {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if self.left == 0 {
                return Poll::Ready(None);
            }
            if self.next.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.left -= 1;
            let every = self.every;
            self.next.as_mut().reset(Instant::now() + every);
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![0u8; self.size])))))
        }
    }

    async fn collect(body: MinRateBody<Chunks>) -> Result<usize, axum::BoxError> {
        Ok(body.collect().await?.to_bytes().len())
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_at_the_minimum_rate_arrives_whole() {
        // 100 bytes a second against a minimum of 50: never late.
        let body = MinRateBody::new(trickle(60, 100, Duration::from_secs(1)), 50, Duration::from_secs(2));
        assert_eq!(collect(body).await.unwrap(), 6000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_below_the_minimum_rate_fails_after_its_grace_and_credit() {
        // 10 bytes a second against a minimum of 100: the grace (5 s) and
        // the credit earned (0.1 s per chunk) run out after 6 chunks.
        let started = Instant::now();
        let body = MinRateBody::new(trickle(1000, 10, Duration::from_secs(1)), 100, Duration::from_secs(5));
        let error = collect(body).await.unwrap_err();
        assert!(error.downcast_ref::<SlowBody>().is_some(), "{error}");
        let elapsed = started.elapsed();
        assert!((Duration::from_secs(5)..Duration::from_secs(7)).contains(&elapsed), "{elapsed:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_body_fails_after_the_grace() {
        let started = Instant::now();
        let body = MinRateBody::new(trickle(1, 10, Duration::from_secs(3600)), 100, Duration::from_secs(10));
        assert!(collect(body).await.unwrap_err().downcast_ref::<SlowBody>().is_some());
        assert_eq!(started.elapsed().as_secs(), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_rate_disables_the_check() {
        let body = MinRateBody::new(trickle(2, 10, Duration::from_secs(3600)), 0, Duration::from_secs(1));
        assert_eq!(collect(body).await.unwrap(), 20);
    }

    /// A listener on a free loopback port serving `/healthz`, `/readyz`
    /// and `/work` within `limits`; it stops when the sender is dropped.
    async fn listening(limits: ConnectionLimits) -> (SocketAddr, oneshot::Sender<()>) {
        listening_behind(limits, TrustedProxies::default()).await
    }

    /// As [`listening`], with `proxies` trusted; `/peer` answers the
    /// address the handlers see.
    async fn listening_behind(
        limits: ConnectionLimits,
        proxies: impl Into<Proxies>,
    ) -> (SocketAddr, oneshot::Sender<()>) {
        let proxies = proxies.into();
        use axum::routing::get;
        let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0)), limits.max_connections).unwrap();
        let address = listener.local_addr().unwrap();
        let router = Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route("/readyz", get(|| async { "ready" }))
            .route("/work", get(|| async { "done" }))
            .route(
                "/peer",
                get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.ip().to_string() }),
            );
        let (stop, signal) = oneshot::channel();
        tokio::spawn(serve(listener, router, None, limits, proxies, signal));
        (address, stop)
    }

    /// A connection to `address` from the loopback address `source`.
    async fn connect_from(source: [u8; 4], address: SocketAddr) -> tokio::net::TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::from((source, 0))).unwrap();
        socket.connect(address).await.unwrap()
    }

    /// `GET path` from `source` on a fresh connection: the status and the
    /// whole response.
    async fn get_from(source: [u8; 4], address: SocketAddr, path: &str) -> (u16, String) {
        let text = request_from(source, address, b"", path).await;
        (text.split_whitespace().nth(1).unwrap().parse().unwrap(), text)
    }

    /// `prefix`, then `GET path`, from `source` on a fresh connection: the
    /// whole response (empty if the connection was closed without one).
    async fn request_from(source: [u8; 4], address: SocketAddr, prefix: &[u8], path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = connect_from(source, address).await;
        let head = format!("GET {path} HTTP/1.1\r\nHost: cohort\r\nConnection: close\r\n\r\n");
        let _ = stream.write_all(&[prefix, head.as_bytes()].concat()).await;
        let mut response = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut response)).await;
        assert!(read.is_ok(), "no answer within 5 s");
        String::from_utf8_lossy(&response).into_owned()
    }

    fn small(max_connections: usize, max_connections_per_address: usize) -> ConnectionLimits {
        ConnectionLimits { max_connections, max_connections_per_address, ..ConnectionLimits::default() }
    }

    #[tokio::test]
    async fn an_address_over_its_cap_is_refused_while_others_and_probes_are_served() {
        let (address, _stop) = listening(small(16, 2)).await;
        let _held =
            [connect_from([127, 0, 0, 1], address).await, connect_from([127, 0, 0, 1], address).await];
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (status, refusal) = get_from([127, 0, 0, 1], address, "/work").await;
        assert_eq!(status, 503, "{refusal}");
        assert!(refusal.contains("retry-after: 1") && refusal.contains("\"overloaded\""), "{refusal}");
        assert_eq!(get_from([127, 0, 0, 2], address, "/work").await.0, 200);
        for probe in ["/healthz", "/readyz"] {
            let (status, answer) = get_from([127, 0, 0, 1], address, probe).await;
            assert_eq!(status, 200, "{probe} over the cap: {answer}");
        }
    }

    #[tokio::test]
    async fn probes_are_answered_and_the_rest_refused_while_the_global_cap_is_full() {
        let (address, _stop) = listening(small(4, 2)).await;
        let mut held = Vec::new();
        for source in [[127, 0, 0, 1], [127, 0, 0, 2]] {
            for _ in 0..2 {
                held.push(connect_from(source, address).await);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(get_from([127, 0, 0, 3], address, "/work").await.0, 503);
        assert_eq!(get_from([127, 0, 0, 3], address, "/healthz").await.0, 200);
        assert_eq!(get_from([127, 0, 0, 3], address, "/readyz").await.0, 200);
        drop(held);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            get_from([127, 0, 0, 3], address, "/work").await.0,
            200,
            "served again once there is room"
        );
    }

    #[tokio::test]
    async fn a_connection_that_sends_nothing_is_closed_at_the_header_timeout() {
        use tokio::io::AsyncReadExt;
        let limits = ConnectionLimits {
            header_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_secs(30),
            ..ConnectionLimits::default()
        };
        let (address, _stop) = listening(limits).await;
        let started = Instant::now();
        let mut silent = connect_from([127, 0, 0, 1], address).await;
        let mut buffer = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buffer)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "still open after 5 s: {read:?}");
        let elapsed = started.elapsed();
        assert!(elapsed >= Duration::from_millis(300), "closed before the header timeout: {elapsed:?}");
    }

    /// A PROXY protocol header from a balancer for `client`.
    fn proxied(client: [u8; 4], address: SocketAddr) -> Vec<u8> {
        proxy::v2_header(SocketAddr::from((client, 40_000)), address, &[])
    }

    #[tokio::test]
    async fn a_trusted_proxy_s_header_names_the_client_to_the_handlers_and_the_caps() {
        use tokio::io::AsyncWriteExt;
        let proxies = TrustedProxies::new(["127.0.0.2/32".parse().unwrap()]);
        let (address, _stop) = listening_behind(small(16, 1), proxies).await;
        let answer =
            request_from([127, 0, 0, 2], address, &proxied([203, 0, 113, 1], address), "/peer").await;
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("\r\n203.0.113.1"), "{answer}");
        // Client 203.0.113.1 holds its one connection through the balancer:
        // its next is over its cap, another client's is not, and neither
        // counts against the balancer's own address.
        let mut held = connect_from([127, 0, 0, 2], address).await;
        held.write_all(&proxied([203, 0, 113, 1], address)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let over = request_from([127, 0, 0, 2], address, &proxied([203, 0, 113, 1], address), "/work").await;
        assert!(over.starts_with("HTTP/1.1 503"), "{over}");
        let other = request_from([127, 0, 0, 2], address, &proxied([203, 0, 113, 2], address), "/peer").await;
        assert!(other.ends_with("\r\n203.0.113.2"), "{other}");
        // A balancer's health check (LOCAL) stays at the balancer's address.
        let mut local = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
        local.extend([0x20, 0x00, 0, 0]);
        let check = request_from([127, 0, 0, 2], address, &local, "/peer").await;
        assert!(check.ends_with("\r\n127.0.0.2"), "{check}");
        drop(held);
    }

    #[tokio::test]
    async fn a_balancer_s_health_checks_are_answered_while_the_cap_is_full() {
        let proxies = TrustedProxies::new(["127.0.0.2/32".parse().unwrap()]);
        let (address, _stop) = listening_behind(small(4, 4), proxies).await;
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(connect_from([127, 0, 0, 3], address).await);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut local = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
        local.extend([0x20, 0x00, 0, 0]);
        let check = request_from([127, 0, 0, 2], address, &local, "/readyz").await;
        assert!(check.starts_with("HTTP/1.1 200"), "a health check over the cap: {check}");
        let work = request_from([127, 0, 0, 2], address, &proxied([203, 0, 113, 1], address), "/work").await;
        assert!(work.starts_with("HTTP/1.1 503") && work.contains("retry-after: 1"), "{work}");
        drop(held);
    }

    #[tokio::test]
    async fn a_trusted_proxy_must_send_the_header_and_nobody_else_can() {
        let proxies = TrustedProxies::new(["127.0.0.2/32".parse().unwrap()]);
        let (address, _stop) = listening_behind(ConnectionLimits::default(), proxies).await;
        // From the balancer's address without a header: closed unanswered.
        assert_eq!(request_from([127, 0, 0, 2], address, b"", "/peer").await, "");
        // From any other address a header is not read: it is bytes that
        // are not HTTP, and the address stays the connection's own.
        let forged =
            request_from([127, 0, 0, 3], address, &proxied([203, 0, 113, 9], address), "/peer").await;
        assert!(forged.starts_with("HTTP/1.1 400"), "{forged}");
        let plain = request_from([127, 0, 0, 3], address, b"", "/peer").await;
        assert!(plain.ends_with("\r\n127.0.0.3"), "{plain}");
    }

    /// `GET /peer` from `source` with `X-Forwarded-For: forwarded` (if
    /// any), on `stream` (kept open): the status and the address the
    /// handler saw.
    async fn peer_via(stream: &mut tokio::net::TcpStream, forwarded: Option<&str>) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let header = forwarded.map_or(String::new(), |value| format!("X-Forwarded-For: {value}\r\n"));
        let head = format!("GET /peer HTTP/1.1\r\nHost: cohort\r\n{header}\r\n");
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        let mut buffer = [0u8; 1024];
        // One response: its head, then the body its length announces.
        loop {
            let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buffer)).await;
            let n = read.expect("an answer within 5 s").unwrap();
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&response));
            response.extend_from_slice(&buffer[..n]);
            let text = String::from_utf8_lossy(&response).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length: usize = head
                    .lines()
                    .find_map(|line| {
                        line.to_ascii_lowercase().strip_prefix("content-length: ").map(str::to_owned)
                    })
                    .and_then(|n| n.trim().parse().ok())
                    .unwrap_or(0);
                if body.len() >= length {
                    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
                    return (status, body.to_string());
                }
            }
        }
    }

    #[tokio::test]
    async fn a_trusted_http_proxy_names_each_request_s_client_and_nobody_else_can() {
        let http = TrustedProxies::new(["127.0.0.2/32".parse().unwrap()]);
        let proxies = Proxies { protocol: TrustedProxies::default(), http };
        // One connection per address: the proxy is not held to it.
        let (address, _stop) = listening_behind(small(16, 1), proxies).await;
        let mut connections = Vec::new();
        for _ in 0..3 {
            connections.push(connect_from([127, 0, 0, 2], address).await);
        }
        let proxy = &mut connections[2];
        // Each request names its own client: the last entry, the one the
        // proxy appended; what the client wrote before it is ignored.
        assert_eq!(peer_via(proxy, Some("10.9.9.9, 203.0.113.9")).await, (200, "203.0.113.9".into()));
        assert_eq!(peer_via(proxy, Some("2001:db8::7")).await, (200, "2001:db8::7".into()));
        // Without the header (the proxy's own health check): the proxy.
        assert_eq!(peer_via(proxy, None).await, (200, "127.0.0.2".into()));
        // A last entry that is not an address: refused, named.
        let (status, body) = peer_via(proxy, Some("203.0.113.9, unknown")).await;
        assert_eq!(status, 400, "{body}");
        assert!(body.contains("X-Forwarded-For"), "{body}");
        for held in &mut connections[..2] {
            assert_eq!(peer_via(held, Some("198.51.100.1")).await, (200, "198.51.100.1".into()));
        }
        // From any other address the header is not read.
        let mut stranger = connect_from([127, 0, 0, 3], address).await;
        assert_eq!(peer_via(&mut stranger, Some("203.0.113.9")).await, (200, "127.0.0.3".into()));
        // ... and that address is held to its one connection.
        let (status, _) = get_from([127, 0, 0, 3], address, "/work").await;
        assert_eq!(status, 503);
    }

    /// A PROXY protocol header that names an address of a trusted HTTP
    /// proxy does not make its connection one: whether `X-Forwarded-For`
    /// is read is decided on the connection's own address.
    #[tokio::test]
    async fn a_client_named_by_a_balancer_is_never_a_trusted_http_proxy() {
        use tokio::io::AsyncWriteExt;
        let proxies = Proxies {
            protocol: TrustedProxies::new(["127.0.0.2/32".parse().unwrap()]),
            http: TrustedProxies::new(["203.0.113.0/24".parse().unwrap()]),
        };
        let (address, _stop) = listening_behind(small(16, 1), proxies).await;
        let mut stream = connect_from([127, 0, 0, 2], address).await;
        stream.write_all(&proxied([203, 0, 113, 1], address)).await.unwrap();
        assert_eq!(peer_via(&mut stream, Some("198.51.100.66")).await, (200, "203.0.113.1".into()));
        // ... and it is held to its address's cap of one.
        let over = request_from([127, 0, 0, 2], address, &proxied([203, 0, 113, 1], address), "/work").await;
        assert!(over.starts_with("HTTP/1.1 503"), "{over}");
    }

    #[tokio::test]
    async fn a_trusted_proxy_that_sends_no_header_is_closed_at_the_header_timeout() {
        use tokio::io::AsyncReadExt;
        let limits =
            ConnectionLimits { header_timeout: Duration::from_millis(300), ..ConnectionLimits::default() };
        let proxies = TrustedProxies::new(["127.0.0.2/32".parse().unwrap()]);
        let (address, _stop) = listening_behind(limits, proxies).await;
        let started = Instant::now();
        let mut silent = connect_from([127, 0, 0, 2], address).await;
        let read = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut [0u8; 8])).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "still open after 5 s: {read:?}");
        assert!(started.elapsed() >= Duration::from_millis(300), "closed before the header timeout");
    }

    #[test]
    fn the_default_cap_leaves_descriptors_free() {
        let limits = ConnectionLimits::default();
        assert!(limits.validate().is_ok());
        let too_many = ConnectionLimits { max_connections: usize::MAX / 2, ..limits };
        let refused = too_many.validate().unwrap_err();
        assert!(matches!(refused, LimitsError::TooManyConnections { .. }), "{refused:?}");
        assert!(refused.to_string().contains("file descriptors"), "{refused}");
        assert_eq!(
            ConnectionLimits { max_connections: 0, ..limits }.validate(),
            Err(LimitsError::NoConnections)
        );
        assert_eq!(
            ConnectionLimits { max_connections_per_address: 0, ..limits }.validate(),
            Err(LimitsError::NoConnectionsPerAddress)
        );
        assert_eq!(
            ConnectionLimits { idle_timeout: Duration::ZERO, ..limits }.validate(),
            Err(LimitsError::ZeroTimeout("idle_timeout"))
        );
    }
}
