//! Balancer affinity: a client's requests reach the replica that serves
//! them, without a forwarding hop.
//!
//! Behind a balancer that spreads requests round robin, two requests in
//! three of a client reach a replica that does not serve it (its task's
//! leader, or its group's owner) and take a forwarding hop
//! ([`crate::cluster::forward`]). Each replica therefore tells the client,
//! in a cookie ([`COOKIE`]) on its client API answers, which replica its
//! next request belongs at: the owner of its group while it is in a round
//! whose group another replica runs, until its last message of the round
//! ([`RoundDone`]), else the task's leader. The balancer
//! routes a request that carries the cookie to the replica it names
//! (HAProxy: `cookie cohort_replica insert indirect preserve nocache` and
//! `cookie` on each `server` line; nginx: a `map` from `$cookie_cohort_replica`
//! to the upstream; docs/DEPLOYMENT.md shows both). The client library's
//! HTTP transport keeps cookies, and so does a browser.
//!
//! The cookie only routes. Its value is a name derived from the replica's
//! advertised URL ([`name_of`]), which does not spell the address out (one
//! who guesses the URL can check the guess), and nothing trusts it: a
//! request with a wrong, stale or forged cookie reaches another replica,
//! which forwards it as before.

use axum::http::HeaderValue;

/// The cookie that names the replica a client's next request belongs at.
pub const COOKIE: &str = "cohort_replica";

/// The affinity name of the replica whose advertised URL (`--public-url`)
/// is `url`: 16 hex digits of SHA-256 over a fixed label and the URL
/// without a trailing `/`. Every replica computes every other's, and so
/// does the balancer's configuration ([`crate::cluster::balancer`]).
pub fn name_of(url: &str) -> String {
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    context.update(b"cohort replica affinity\0");
    context.update(url.trim_end_matches('/').as_bytes());
    hex::encode(&context.finish().as_ref()[..8])
}

/// The `Set-Cookie` value that sends a client's next requests to the
/// replica at `url`: for every path, out of reach of scripts, and kept for
/// the browser session only (a replica that went away is forgotten with it;
/// the balancer ignores a cookie that names no live replica).
pub fn set_cookie(url: &str) -> HeaderValue {
    let value = format!("{COOKIE}={}; Path=/; HttpOnly; SameSite=Lax", name_of(url));
    // Hex digits and fixed ASCII: always a valid header value.
    HeaderValue::from_str(&value).unwrap_or(HeaderValue::from_static(""))
}

/// Marks the answer to a client's last message of its round (its
/// unmasking): the cookie then names the task's leader, where the client's
/// next requests (its metrics, its check-in) belong, not its group's
/// replica.
#[derive(Debug, Clone, Copy)]
pub struct RoundDone;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_is_named_by_its_url_alone() {
        let a = name_of("http://10.0.0.5:8080");
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(a, name_of("http://10.0.0.5:8080/"), "a trailing slash names the same replica");
        assert_ne!(a, name_of("http://10.0.0.5:8081"));
        assert!(!a.contains("10.0.0.5"));
        // A known answer, so that a balancer configuration written by
        // hand from the documentation keeps matching.
        assert_eq!(name_of("http://127.0.0.1:8081"), KNOWN);
        let cookie = set_cookie("http://127.0.0.1:8081");
        assert_eq!(
            cookie.to_str().unwrap(),
            format!("cohort_replica={KNOWN}; Path=/; HttpOnly; SameSite=Lax")
        );
    }

    const KNOWN: &str = "68cb6058bd9f9668";
}
