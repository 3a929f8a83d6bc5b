//! The client's address from an HTTP reverse proxy's `X-Forwarded-For`.
//!
//! A proxy that ends HTTP itself (nginx's `http` proxy, a cloud's HTTPS
//! load balancer) cannot send a PROXY protocol header (see [`super::proxy`]):
//! it names the client in a request header instead. Each proxy on the way
//! appends the address it received the request from, so the **last**
//! entry is the one the proxy next to the coordinator saw, and only that
//! one is taken: the entries before it are whatever the client wrote. The
//! listener reads it only on connections from the networks the operator
//! lists as `trusted_http_proxies`; from any other address the header is
//! ignored, so that no client can name another address.
//!
//! A request from a trusted proxy without the header (the proxy's own
//! health check) keeps the proxy's address; one whose last entry is not an
//! address (`unknown`, an obfuscated name, an address with a port) is
//! refused, since the proxy is then not configured as the deployment
//! guide says. Every `X-Forwarded-For` line counts as one list, in order.

use std::net::IpAddr;

use axum::http::HeaderMap;

/// The header.
pub const X_FORWARDED_FOR: &str = "x-forwarded-for";

/// Why a trusted proxy's header named no client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the last X-Forwarded-For entry from a trusted HTTP proxy must be the client's IP address")]
pub struct NotAnAddress;

/// The client a trusted proxy names: the last entry of the last
/// `X-Forwarded-For` line, as an address (an IPv4 address mapped into IPv6
/// as the IPv4 address it is); `None` without the header.
pub fn client(headers: &HeaderMap) -> Result<Option<IpAddr>, NotAnAddress> {
    let Some(line) = headers.get_all(X_FORWARDED_FOR).iter().next_back() else { return Ok(None) };
    let text = line.to_str().map_err(|_| NotAnAddress)?;
    let last = text.rsplit(',').next().unwrap_or_default().trim();
    let address: IpAddr = last.parse().map_err(|_| NotAnAddress)?;
    Ok(Some(address.to_canonical()))
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn headers(lines: &[&[u8]]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for line in lines {
            headers.append(X_FORWARDED_FOR, HeaderValue::from_bytes(line).unwrap());
        }
        headers
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn the_last_entry_names_the_client() {
        assert_eq!(client(&headers(&[b"203.0.113.7"])), Ok(Some(ip("203.0.113.7"))));
        // What the client wrote comes first; the proxy's entry is last.
        assert_eq!(client(&headers(&[b"10.9.9.9, 198.51.100.2,203.0.113.7"])), Ok(Some(ip("203.0.113.7"))));
        assert_eq!(client(&headers(&[b"1.1.1.1", b"2.2.2.2, 203.0.113.8"])), Ok(Some(ip("203.0.113.8"))));
        assert_eq!(client(&headers(&[b" 2001:db8::5 "])), Ok(Some(ip("2001:db8::5"))));
        assert_eq!(client(&headers(&[b"::ffff:192.0.2.1"])), Ok(Some(ip("192.0.2.1"))));
        assert_eq!(client(&HeaderMap::new()), Ok(None));
    }

    #[test]
    fn a_last_entry_that_is_not_an_address_is_refused() {
        for bad in [
            &b""[..],
            b"unknown",
            b"203.0.113.7:4711",
            b"[2001:db8::5]:443",
            b"203.0.113.7, ",
            b"_hidden",
            b"203.0.113.7 extra",
            b"\xff\xfe",
        ] {
            assert_eq!(client(&headers(&[bad])), Err(NotAnAddress), "{:?}", String::from_utf8_lossy(bad));
        }
        // An address the client wrote does not help a bad last entry.
        assert_eq!(client(&headers(&[b"203.0.113.7", b"unknown"])), Err(NotAnAddress));
    }
}
