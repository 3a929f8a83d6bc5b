//! The PROXY protocol (HAProxy's, versions 1 and 2) on connections from a
//! trusted balancer.
//!
//! Behind a balancer every connection comes from the balancer's address, so
//! the per-address caps, the per-address rate limits and the audit log
//! would all see one client. A balancer that speaks the PROXY protocol
//! (HAProxy's `send-proxy-v2`, nginx's `proxy_protocol on` in its `stream`
//! module) puts a short header naming the client's address before the
//! connection's own bytes. The listener reads it **only** on connections
//! from the networks the operator lists as trusted proxies
//! (`trusted_proxies`):
//!
//! * From a trusted address, the header is required: a connection that
//!   does not begin with one within the header timeout is closed. Were it
//!   optional, a client whose bytes reach the coordinator unchanged (a
//!   balancer configured without the header) could write a header of its
//!   own and take any address it liked.
//! * From any other address, nothing is read: a header there is just bytes
//!   that are not HTTP, and the connection gets the `400` any garbage gets.
//!   No client can claim another address.
//! * A `LOCAL` header (a balancer's own health check) or one with no
//!   internet address (`UNKNOWN`, a UNIX socket) leaves the connection at
//!   the balancer's address.
//!
//! The header is read exactly, never a byte past it, so that the stream
//! handed to TLS or HTTP begins where the client's bytes begin.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The networks whose connections begin with a PROXY protocol header.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies(Arc<[IpNet]>);

/// Why a `trusted_proxies` list was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProxiesError {
    /// A network written with bits set past its prefix (`10.0.0.5/8`),
    /// which would trust far more than the address it names.
    #[error(
        "{0}: {1} has bits set past its prefix; write {2} if that is meant, or the balancer's own address"
    )]
    HostBits(&'static str, IpNet, IpNet),
    /// A network that holds every address (`0.0.0.0/0`, `::/0`): anyone
    /// could name any client.
    #[error("{0}: {1} trusts every address; list the balancers' own addresses")]
    Everything(&'static str, IpNet),
}

impl TrustedProxies {
    /// Trusts connections from `networks`, as given.
    pub fn new(networks: impl IntoIterator<Item = IpNet>) -> Self {
        Self(networks.into_iter().collect())
    }

    /// Trusts connections from `networks`, refusing a network written with
    /// bits past its prefix or one that holds every address, and taking an
    /// IPv4-mapped IPv6 network (`::ffff:10.0.0.5/128`) as the IPv4 one
    /// (the listener compares a peer by its IPv4 address).
    pub fn checked(networks: impl IntoIterator<Item = IpNet>) -> Result<Self, ProxiesError> {
        Self::checked_as("trusted_proxies", networks)
    }

    /// As [`checked`](Self::checked), the setting named `setting` in a
    /// refusal.
    pub fn checked_as(
        setting: &'static str,
        networks: impl IntoIterator<Item = IpNet>,
    ) -> Result<Self, ProxiesError> {
        let mut checked = Vec::new();
        for network in networks {
            if network.prefix_len() == 0 {
                return Err(ProxiesError::Everything(setting, network));
            }
            if network != network.trunc() {
                return Err(ProxiesError::HostBits(setting, network, network.trunc()));
            }
            let mapped = match network {
                IpNet::V6(v6) if v6.prefix_len() > 96 => v6
                    .network()
                    .to_ipv4_mapped()
                    .and_then(|v4| ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).ok()),
                _ => None,
            };
            let network = mapped.map_or(network, IpNet::V4);
            checked.push(network);
        }
        Ok(Self(checked.into()))
    }

    /// Whether a connection from `address` must begin with a header (an
    /// IPv4 client of a dual-stack listener, `::ffff:a.b.c.d`, counts as
    /// its IPv4 address).
    pub fn trusts(&self, address: IpAddr) -> bool {
        let address = address.to_canonical();
        self.0.iter().any(|network| network.contains(&address))
    }

    /// Whether no network is trusted (no header is ever read).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The signature that begins a version 2 header.
const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// A version 2 header's fixed part: the signature, the version and
/// command, the family and protocol, and the length of what follows.
const V2_FIXED: usize = 16;
/// The longest version 2 header read: its addresses (216 bytes for UNIX
/// sockets) and room for the TLVs a balancer adds (TLS details, a unique
/// id). The protocol lets a receiver refuse longer ones.
pub(super) const MAX_V2_LENGTH: usize = 4096;
/// The longest version 1 header, its `\r\n` included (the protocol's own
/// bound).
pub(super) const MAX_V1_LENGTH: usize = 107;

/// Why a connection from a trusted proxy was closed.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    /// The connection's first bytes are not a PROXY protocol header.
    #[error("the connection does not begin with a PROXY protocol header")]
    Missing,
    /// A header longer than the listener reads.
    #[error("the PROXY protocol header is longer than {0} bytes")]
    TooLong(usize),
    /// A header that does not parse.
    #[error("malformed PROXY protocol header: {0}")]
    Malformed(String),
    /// The connection failed or ended within the header.
    #[error("reading the PROXY protocol header: {0}")]
    Io(#[from] std::io::Error),
}

/// Reads the PROXY protocol header at the start of `stream`, and nothing
/// after it: the client's address, or `None` for a header that names none
/// (`LOCAL`, `UNKNOWN`, UNIX sockets).
pub async fn read_header<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Option<SocketAddr>, HeaderError> {
    let mut first = [0u8; 1];
    stream.read_exact(&mut first).await?;
    match first[0] {
        b'\r' => read_v2(stream).await,
        b'P' => read_v1(stream).await,
        _ => Err(HeaderError::Missing),
    }
}

/// The rest of a version 2 header, whose first byte has been read.
async fn read_v2<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Option<SocketAddr>, HeaderError> {
    let mut header = vec![0u8; V2_FIXED];
    header[0] = b'\r';
    stream.read_exact(&mut header[1..]).await?;
    if header[..V2_SIGNATURE.len()] != V2_SIGNATURE {
        return Err(HeaderError::Missing);
    }
    let length = V2_FIXED + usize::from(u16::from_be_bytes([header[14], header[15]]));
    if length > MAX_V2_LENGTH {
        return Err(HeaderError::TooLong(MAX_V2_LENGTH));
    }
    header.resize(length, 0);
    stream.read_exact(&mut header[V2_FIXED..]).await?;
    v2_address(&header)
}

/// The client's address in a whole version 2 header.
pub(super) fn v2_address(header: &[u8]) -> Result<Option<SocketAddr>, HeaderError> {
    use ppp::v2::{Addresses, Command, Header};
    let parsed = Header::try_from(header).map_err(|error| HeaderError::Malformed(error.to_string()))?;
    if parsed.command == Command::Local {
        return Ok(None);
    }
    Ok(match parsed.addresses {
        Addresses::IPv4(ip) => Some(SocketAddr::from((ip.source_address, ip.source_port))),
        // A balancer names an IPv4 client in IPv6 form (::ffff:a.b.c.d)
        // when its listener's family differs: the client is the IPv4 one.
        Addresses::IPv6(ip) => {
            Some(SocketAddr::new(IpAddr::V6(ip.source_address).to_canonical(), ip.source_port))
        }
        Addresses::Unspecified | Addresses::Unix(_) => None,
    })
}

/// The rest of a version 1 header (a line of text), whose first byte has
/// been read: a byte at a time, so that nothing after its `\r\n` is taken.
async fn read_v1<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Option<SocketAddr>, HeaderError> {
    let mut line = Vec::with_capacity(MAX_V1_LENGTH);
    line.push(b'P');
    while !line.ends_with(b"\r\n") {
        if line.len() == MAX_V1_LENGTH {
            return Err(if line.starts_with(b"PROXY ") {
                HeaderError::TooLong(MAX_V1_LENGTH)
            } else {
                HeaderError::Missing
            });
        }
        let mut byte = [0u8; 1];
        stream.read_exact(&mut byte).await?;
        line.push(byte[0]);
        if line.len() <= 6 && !b"PROXY ".starts_with(&line) {
            return Err(HeaderError::Missing);
        }
    }
    v1_address(&line)
}

/// The client's address in a whole version 1 header.
pub(super) fn v1_address(line: &[u8]) -> Result<Option<SocketAddr>, HeaderError> {
    use ppp::v1::{Addresses, Header};
    let parsed = Header::try_from(line).map_err(|error| HeaderError::Malformed(error.to_string()))?;
    if parsed.header.len() != line.len() {
        return Err(HeaderError::Malformed("bytes after the header's end".into()));
    }
    Ok(match parsed.addresses {
        Addresses::Tcp4(ip) => Some(SocketAddr::from((ip.source_address, ip.source_port))),
        Addresses::Tcp6(ip) => {
            Some(SocketAddr::new(IpAddr::V6(ip.source_address).to_canonical(), ip.source_port))
        }
        Addresses::Unknown => None,
    })
}

#[cfg(test)]
/// A version 2 `PROXY` header from `source` to `destination`, with
/// `tlvs` bytes of TLVs after the addresses.
pub(super) fn v2_header(source: SocketAddr, destination: SocketAddr, tlvs: &[u8]) -> Vec<u8> {
    let mut header = V2_SIGNATURE.to_vec();
    let mut addresses = Vec::new();
    let family = match (source, destination) {
        (SocketAddr::V4(s), SocketAddr::V4(d)) => {
            addresses.extend(s.ip().octets());
            addresses.extend(d.ip().octets());
            0x11
        }
        (SocketAddr::V6(s), SocketAddr::V6(d)) => {
            addresses.extend(s.ip().octets());
            addresses.extend(d.ip().octets());
            0x21
        }
        _ => panic!("one family for both"),
    };
    addresses.extend(source.port().to_be_bytes());
    addresses.extend(destination.port().to_be_bytes());
    addresses.extend(tlvs);
    header.extend([0x21, family]);
    header.extend(u16::try_from(addresses.len()).unwrap().to_be_bytes());
    header.extend(addresses);
    header
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What `read_header` makes of `bytes`, and the bytes it left unread.
    fn read(bytes: &[u8]) -> (Result<Option<SocketAddr>, HeaderError>, Vec<u8>) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let mut stream = bytes;
            let result = read_header(&mut stream).await;
            (result, stream.to_vec())
        })
    }

    fn address(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    #[test]
    fn a_v2_header_names_the_client_and_leaves_what_follows_unread() {
        let client = address("203.0.113.7:40001");
        let mut bytes = v2_header(client, address("10.0.0.5:8080"), &[0x04, 0, 2, 1, 2]);
        bytes.extend(b"GET / HTTP/1.1\r\n");
        let (result, rest) = read(&bytes);
        assert_eq!(result.unwrap(), Some(client));
        assert_eq!(rest, b"GET / HTTP/1.1\r\n");

        let client = address("[2001:db8::1]:5000");
        let (result, rest) = read(&v2_header(client, address("[2001:db8::2]:443"), &[]));
        assert_eq!((result.unwrap(), rest.len()), (Some(client), 0));
    }

    #[test]
    fn a_v1_header_names_the_client_and_leaves_what_follows_unread() {
        let (result, rest) = read(b"PROXY TCP4 198.51.100.9 10.0.0.5 51000 8080\r\n\x16\x03\x01");
        assert_eq!(result.unwrap(), Some(address("198.51.100.9:51000")));
        assert_eq!(rest, b"\x16\x03\x01");
        let (result, _) = read(b"PROXY TCP6 2001:db8::9 2001:db8::1 51000 443\r\n");
        assert_eq!(result.unwrap(), Some(address("[2001:db8::9]:51000")));
    }

    #[test]
    fn local_and_unknown_headers_name_no_client() {
        let mut local = V2_SIGNATURE.to_vec();
        local.extend([0x20, 0x00, 0, 0]);
        local.extend(b"GET");
        let (result, rest) = read(&local);
        assert_eq!((result.unwrap(), rest.as_slice()), (None, b"GET".as_slice()));
        let (result, rest) = read(b"PROXY UNKNOWN\r\nGET");
        assert_eq!((result.unwrap(), rest.as_slice()), (None, b"GET".as_slice()));
    }

    #[test]
    fn bytes_that_are_not_a_header_are_refused_early() {
        for bytes in [
            &b"GET / HTTP/1.1\r\n\r\n"[..],
            b"\x16\x03\x01\x02\x00",
            b"PRI * HTTP/2.0\r\n",
            b"\r\n\r\nGET / HTTP/1.1\r\n",
        ] {
            let (result, rest) = read(bytes);
            assert!(matches!(result, Err(HeaderError::Missing)), "{bytes:?}: {result:?}");
            assert!(bytes.len() - rest.len() <= V2_FIXED, "read far past a non-header: {bytes:?}");
        }
    }

    #[test]
    fn long_truncated_and_malformed_headers_are_refused() {
        let mut long = V2_SIGNATURE.to_vec();
        long.extend([0x21, 0x11]);
        long.extend(u16::try_from(MAX_V2_LENGTH).unwrap().to_be_bytes());
        assert!(matches!(read(&long).0, Err(HeaderError::TooLong(_))));
        let mut line = b"PROXY TCP4 ".to_vec();
        line.extend([b'1'; 120]);
        assert!(matches!(read(&line).0, Err(HeaderError::TooLong(_))));

        let whole = v2_header(address("203.0.113.7:1"), address("10.0.0.5:2"), &[]);
        assert!(matches!(read(&whole[..whole.len() - 1]).0, Err(HeaderError::Io(_))), "truncated");
        let mut version_three = whole.clone();
        version_three[12] = 0x31;
        assert!(matches!(read(&version_three).0, Err(HeaderError::Malformed(_))));
        for line in
            [&b"PROXY TCP4 1.2.3 10.0.0.5 1 2\r\n"[..], b"PROXY TCP9 1.2.3.4 5.6.7.8 1 2\r\n", b"PROXY\r\n"]
        {
            assert!(
                matches!(read(line).0, Err(HeaderError::Malformed(_) | HeaderError::Missing)),
                "{line:?}"
            );
        }
    }

    #[test]
    fn a_mapped_ipv4_client_is_its_ipv4_address() {
        let (result, _) = read(b"PROXY TCP6 ::ffff:198.51.100.9 ::ffff:10.0.0.5 51000 8080\r\n");
        assert_eq!(result.unwrap(), Some(address("198.51.100.9:51000")));
        let (result, _) = read(&v2_header(address("[::ffff:203.0.113.7]:1"), address("[::1]:2"), &[]));
        assert_eq!(result.unwrap(), Some(address("203.0.113.7:1")));
    }

    #[test]
    fn a_trusted_list_that_trusts_too_much_is_refused() {
        let checked = |text: &str| TrustedProxies::checked([text.parse::<IpNet>().unwrap()]);
        assert!(matches!(checked("10.0.0.5/8"), Err(ProxiesError::HostBits(..))));
        assert!(checked("10.0.0.5/8").unwrap_err().to_string().contains("10.0.0.0/8"));
        assert!(matches!(checked("0.0.0.0/0"), Err(ProxiesError::Everything(..))));
        assert!(matches!(checked("::/0"), Err(ProxiesError::Everything(..))));
        let mapped = checked("::ffff:10.0.0.5/128").unwrap();
        assert!(
            mapped.trusts("10.0.0.5".parse().unwrap()) && mapped.trusts("::ffff:10.0.0.5".parse().unwrap())
        );
        assert!(checked("2001:db8::/32").unwrap().trusts("2001:db8::1".parse().unwrap()));
    }

    #[test]
    fn only_the_listed_networks_are_trusted() {
        let proxies = TrustedProxies::new(["10.0.0.0/8".parse().unwrap(), "2001:db8::/32".parse().unwrap()]);
        assert!(proxies.trusts("10.1.2.3".parse().unwrap()));
        assert!(proxies.trusts("::ffff:10.1.2.3".parse().unwrap()), "an IPv4 peer of a dual-stack listener");
        assert!(proxies.trusts("2001:db8:5::1".parse().unwrap()));
        assert!(!proxies.trusts("11.0.0.1".parse().unwrap()));
        assert!(!proxies.trusts("2001:db9::1".parse().unwrap()));
        assert!(
            TrustedProxies::default().is_empty()
                && !TrustedProxies::default().trusts("10.0.0.1".parse().unwrap())
        );
    }

    proptest! {
        /// Any bytes: no panic, never a read past what a header can hold,
        /// and a header accepted only where what was read parses whole.
        #[test]
        fn arbitrary_bytes_never_panic_or_overread(bytes in proptest::collection::vec(any::<u8>(), 0..300), v2_start in any::<bool>()) {
            let mut bytes = bytes;
            if v2_start {
                let mut prefixed = V2_SIGNATURE.to_vec();
                prefixed.extend(&bytes);
                bytes = prefixed;
            }
            let (result, rest) = read(&bytes);
            let taken = bytes.len() - rest.len();
            prop_assert!(taken <= MAX_V2_LENGTH);
            if result.is_ok() {
                let header = &bytes[..taken];
                let again = if header[0] == b'\r' { v2_address(header) } else { v1_address(header) };
                prop_assert_eq!(again.unwrap(), result.unwrap());
            }
        }
    }
}
