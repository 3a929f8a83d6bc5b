//! Rate limits on the client API, per network address and per credential,
//! with GCRA limiters from the `governor` crate.
//!
//! An address is counted as its network: an IPv4 address alone, an IPv6
//! address by its /64 (the block one host or one customer line is given,
//! in which a host picks any address at will: counting single addresses
//! would give it 2^64 budgets), an IPv4 address mapped into IPv6 as the
//! IPv4 address it is. The connection caps count alike
//! (`listener::peers`).
//!
//! Enrollment is limited per address and per enrollment token (it is the
//! call that creates state, and a token may be public, as the demo's is;
//! a token may carry its own rate, see [`Limiters::check_token`]);
//! check-in and metric reports per address and per participant. A refusal carries the wait after which the same call would
//! pass, which the API sends as `429` with `Retry-After`. Keys of clients
//! that stay quiet are forgotten by [`Limiters::prune`], so the limiters'
//! memory is bounded by the clients active in the last minutes.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota, RateLimiter};
use serde::{Deserialize, Serialize};

/// A sustained rate and the burst allowed above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Rate {
    /// Calls per minute, sustained.
    #[schema(minimum = 1)]
    pub per_minute: u32,
    /// Calls allowed at once before the sustained rate applies.
    #[schema(minimum = 1)]
    pub burst: u32,
}

impl Rate {
    fn quota(self) -> Option<Quota> {
        let per_minute = NonZeroU32::new(self.per_minute)?;
        let burst = NonZeroU32::new(self.burst)?;
        Some(Quota::per_minute(per_minute).allow_burst(burst))
    }
}

/// The client API's rate limits; `null` (or a zero rate) switches one off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimits {
    /// Enrollments from one address.
    pub enroll_per_address: Option<Rate>,
    /// Enrollments with one enrollment token, from anywhere (a token
    /// created with its own rate has that instead).
    pub enroll_per_token: Option<Rate>,
    /// Check-ins from one address.
    pub check_in_per_address: Option<Rate>,
    /// Check-ins of one participant.
    pub check_in_per_credential: Option<Rate>,
    /// Metric reports from one address.
    pub reports_per_address: Option<Rate>,
    /// Metric reports of one participant.
    pub reports_per_credential: Option<Rate>,
    /// Refused admin requests of one project key, each written to the
    /// audit log; past it a key's refusals are `429` and not written, so
    /// that no key can flood the log the projects share.
    pub admin_refusals_per_key: Option<Rate>,
}

impl Default for RateLimits {
    /// Generous for clients that follow the protocol (a client checks in
    /// about once a second while it waits and reports once a round; a load
    /// test enrolls a thousand clients from one address at once), tight
    /// enough that one credential or address cannot fill the database: a
    /// token admits a thousand enrollments at once and ten a second after
    /// that, from however many addresses (an application expecting more
    /// gets a token with its own rate, or the server a higher one).
    fn default() -> Self {
        Self {
            enroll_per_address: Some(Rate { per_minute: 60, burst: 2_000 }),
            enroll_per_token: Some(Rate { per_minute: 600, burst: 1_000 }),
            check_in_per_address: Some(Rate { per_minute: 120_000, burst: 20_000 }),
            check_in_per_credential: Some(Rate { per_minute: 120, burst: 30 }),
            reports_per_address: Some(Rate { per_minute: 12_000, burst: 4_000 }),
            reports_per_credential: Some(Rate { per_minute: 12, burst: 6 }),
            admin_refusals_per_key: Some(Rate { per_minute: 120, burst: 240 }),
        }
    }
}

/// The key an address is limited under: an IPv4 address itself (also
/// when mapped into IPv6), an IPv6 address with its last 64 bits cleared.
pub fn network(address: IpAddr) -> IpAddr {
    match address.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => IpAddr::V6(std::net::Ipv6Addr::from_bits(v6.to_bits() & !u128::from(u64::MAX))),
    }
}

/// A limited call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// `POST /v1/tasks/{id}/enroll`.
    Enroll,
    /// `POST /v1/checkin`.
    CheckIn,
    /// `POST /v1/metrics`.
    Report,
    /// An admin request of a project key that was refused (and is written
    /// to the audit log).
    AdminRefusal,
}

type Keyed<K> = Option<DefaultKeyedRateLimiter<K>>;

fn keyed<K: std::hash::Hash + Eq + Clone>(rate: Option<Rate>) -> Keyed<K> {
    rate.and_then(Rate::quota).map(RateLimiter::keyed)
}

/// The limiters of one service; cheap to clone.
#[derive(Clone)]
pub struct Limiters(Arc<Inner>);

struct Inner {
    enroll_address: Keyed<IpAddr>,
    enroll_token: Keyed<String>,
    check_in_address: Keyed<IpAddr>,
    check_in_credential: Keyed<String>,
    report_address: Keyed<IpAddr>,
    report_credential: Keyed<String>,
    admin_refusal_key: Keyed<String>,
    /// Tokens with a rate of their own: token id → its rate and limiter.
    own_rates: Mutex<HashMap<String, (Rate, DefaultDirectRateLimiter)>>,
    clock: DefaultClock,
}

impl std::fmt::Debug for Limiters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiters").finish_non_exhaustive()
    }
}

impl Limiters {
    /// Limiters for `limits`.
    pub fn new(limits: &RateLimits) -> Self {
        Self(Arc::new(Inner {
            enroll_address: keyed(limits.enroll_per_address),
            enroll_token: keyed(limits.enroll_per_token),
            check_in_address: keyed(limits.check_in_per_address),
            check_in_credential: keyed(limits.check_in_per_credential),
            report_address: keyed(limits.reports_per_address),
            report_credential: keyed(limits.reports_per_credential),
            admin_refusal_key: keyed(limits.admin_refusals_per_key),
            own_rates: Mutex::default(),
            clock: DefaultClock::default(),
        }))
    }

    /// Counts one `call` from `address` (if known) with `credential` (the
    /// participant for check-in and reports, the task whose enrollment
    /// token was presented for enrollment); `Err(wait)` if a limit is
    /// exceeded, where `wait` is how long until the same call would pass.
    pub fn check(
        &self,
        call: Call,
        address: Option<IpAddr>,
        credential: Option<&str>,
    ) -> Result<(), Duration> {
        let inner = &self.0;
        let (by_address, by_credential) = match call {
            Call::Enroll => (&inner.enroll_address, &inner.enroll_token),
            Call::CheckIn => (&inner.check_in_address, &inner.check_in_credential),
            Call::Report => (&inner.report_address, &inner.report_credential),
            Call::AdminRefusal => (&None, &inner.admin_refusal_key),
        };
        if let (Some(limiter), Some(address)) = (by_address, address) {
            limiter
                .check_key(&network(address))
                .map_err(|not_until| not_until.wait_time_from(inner.clock.now()))?;
        }
        if let (Some(limiter), Some(credential)) = (by_credential, credential) {
            limiter
                .check_key(&credential.to_string())
                .map_err(|not_until| not_until.wait_time_from(inner.clock.now()))?;
        }
        Ok(())
    }

    /// Counts one enrollment with the token `token_id`: at `rate` if it
    /// has one of its own, else at the server's `enroll_per_token`.
    /// `Err(wait)` as for [`check`](Self::check).
    pub fn check_token(&self, token_id: &str, rate: Option<Rate>) -> Result<(), Duration> {
        let inner = &self.0;
        let Some(rate) = rate else {
            return self.check(Call::Enroll, None, Some(token_id));
        };
        let Some(quota) = rate.quota() else { return Ok(()) };
        let mut own = inner.own_rates.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = own.entry(token_id.to_string()).or_insert_with(|| (rate, RateLimiter::direct(quota)));
        if entry.0 != rate {
            *entry = (rate, RateLimiter::direct(quota));
        }
        entry.1.check().map_err(|not_until| not_until.wait_time_from(inner.clock.now()))
    }

    /// The limiters keyed by address, and those keyed by a credential.
    fn keyed(&self) -> ([&Keyed<IpAddr>; 3], [&Keyed<String>; 4]) {
        let inner = &self.0;
        (
            [&inner.enroll_address, &inner.check_in_address, &inner.report_address],
            [
                &inner.enroll_token,
                &inner.check_in_credential,
                &inner.report_credential,
                &inner.admin_refusal_key,
            ],
        )
    }

    /// Forgets keys whose limits have fully recovered.
    pub fn prune(&self) {
        let (addresses, credentials) = self.keyed();
        for limiter in addresses.into_iter().flatten() {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
        for limiter in credentials.into_iter().flatten() {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
    }

    /// Keys currently remembered, over every limiter.
    pub fn tracked(&self) -> usize {
        let (addresses, credentials) = self.keyed();
        let addresses: usize = addresses.into_iter().flatten().map(|l| l.len()).sum();
        let credentials: usize = credentials.into_iter().flatten().map(|l| l.len()).sum();
        addresses + credentials
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rate: Rate) -> RateLimits {
        RateLimits {
            enroll_per_address: Some(rate),
            enroll_per_token: None,
            check_in_per_address: None,
            check_in_per_credential: Some(rate),
            reports_per_address: Some(rate),
            reports_per_credential: None,
            admin_refusals_per_key: None,
        }
    }

    #[test]
    fn a_burst_passes_then_calls_wait_for_the_sustained_rate() {
        let limiters = Limiters::new(&limits(Rate { per_minute: 60, burst: 3 }));
        let address = Some(IpAddr::from([10, 0, 0, 1]));
        for _ in 0..3 {
            assert_eq!(limiters.check(Call::Enroll, address, None), Ok(()));
        }
        let wait = limiters.check(Call::Enroll, address, None).unwrap_err();
        assert!(wait > Duration::from_millis(900) && wait <= Duration::from_secs(1), "{wait:?}");
        // Another address has its own budget.
        assert_eq!(limiters.check(Call::Enroll, Some(IpAddr::from([10, 0, 0, 2])), None), Ok(()));
    }

    #[test]
    fn an_ipv6_64_shares_one_budget_and_a_mapped_ipv4_is_itself() {
        let limiters = Limiters::new(&limits(Rate { per_minute: 1, burst: 2 }));
        let v6 = |text: &str| Some(text.parse::<IpAddr>().unwrap());
        assert_eq!(limiters.check(Call::Enroll, v6("2001:db8:1:2::1"), None), Ok(()));
        assert_eq!(limiters.check(Call::Enroll, v6("2001:db8:1:2:ffff:0:0:7"), None), Ok(()));
        // A third address of the same /64 is the same host's third call.
        assert!(limiters.check(Call::Enroll, v6("2001:db8:1:2:8000::9"), None).is_err());
        // The next /64 has its own budget.
        assert_eq!(limiters.check(Call::Enroll, v6("2001:db8:1:3::1"), None), Ok(()));
        // An IPv4 address mapped into IPv6 shares its budget with itself.
        assert_eq!(limiters.check(Call::Enroll, v6("::ffff:10.0.0.9"), None), Ok(()));
        assert_eq!(limiters.check(Call::Enroll, Some(IpAddr::from([10, 0, 0, 9])), None), Ok(()));
        assert!(limiters.check(Call::Enroll, Some(IpAddr::from([10, 0, 0, 9])), None).is_err());
        assert_eq!(limiters.check(Call::Enroll, Some(IpAddr::from([10, 0, 0, 10])), None), Ok(()));
        assert_eq!(
            network("2001:db8:1:2:aaaa:bbbb:cccc:dddd".parse().unwrap()),
            v6("2001:db8:1:2::").unwrap()
        );
    }

    #[test]
    fn credentials_are_limited_apart_from_addresses() {
        let limiters = Limiters::new(&limits(Rate { per_minute: 1, burst: 1 }));
        let address = Some(IpAddr::from([10, 0, 0, 1]));
        // No per-address limit on check-in: only the credential counts.
        assert_eq!(limiters.check(Call::CheckIn, address, Some("a")), Ok(()));
        assert!(limiters.check(Call::CheckIn, address, Some("a")).is_err());
        assert_eq!(limiters.check(Call::CheckIn, address, Some("b")), Ok(()));
        // Reports: per address only.
        assert_eq!(limiters.check(Call::Report, address, Some("a")), Ok(()));
        assert!(limiters.check(Call::Report, address, Some("c")).is_err());
        // Unknown addresses are not limited per address.
        assert_eq!(limiters.check(Call::Report, None, Some("c")), Ok(()));
    }

    #[test]
    fn a_public_enrollment_token_is_limited_across_addresses() {
        let limits =
            RateLimits { enroll_per_token: Some(Rate { per_minute: 60, burst: 2 }), ..RateLimits::default() };
        let limiters = Limiters::new(&limits);
        for i in 0..2u8 {
            assert_eq!(limiters.check(Call::Enroll, Some(IpAddr::from([10, 0, 1, i])), Some("task")), Ok(()));
        }
        assert!(limiters.check(Call::Enroll, Some(IpAddr::from([10, 0, 1, 9])), Some("task")).is_err());
        assert_eq!(limiters.check(Call::Enroll, Some(IpAddr::from([10, 0, 1, 9])), Some("other")), Ok(()));
    }

    /// A token with a rate of its own is held to it, apart from the other
    /// tokens and from the server's per-token default.
    #[test]
    fn a_token_with_its_own_rate_is_held_to_it() {
        let limits =
            RateLimits { enroll_per_token: Some(Rate { per_minute: 60, burst: 2 }), ..RateLimits::default() };
        let limiters = Limiters::new(&limits);
        let own = Some(Rate { per_minute: 6, burst: 3 });
        for _ in 0..3 {
            assert_eq!(limiters.check_token("app", own), Ok(()));
        }
        let wait = limiters.check_token("app", own).unwrap_err();
        assert!(wait > Duration::from_secs(9) && wait <= Duration::from_secs(10), "{wait:?}");
        // Other tokens: the default (burst 2), each its own budget.
        for token in ["default", "web"] {
            assert_eq!(limiters.check_token(token, None), Ok(()));
            assert_eq!(limiters.check_token(token, None), Ok(()));
            assert!(limiters.check_token(token, None).is_err());
        }
        // A changed rate starts afresh; a zero rate is no limit.
        assert_eq!(limiters.check_token("app", Some(Rate { per_minute: 60, burst: 1 })), Ok(()));
        for _ in 0..10 {
            assert_eq!(limiters.check_token("open", Some(Rate { per_minute: 0, burst: 0 })), Ok(()));
        }
    }

    /// The flood the old default let through: 5 000 enrollments with one
    /// token from three addresses, as the enrollment handler checks them
    /// (the address, then the token). The default token admits its burst
    /// of 1 000 and then what its rate refills, however many addresses.
    #[test]
    fn the_default_token_holds_a_flood_from_several_addresses_to_its_burst() {
        let limiters = Limiters::new(&RateLimits::default());
        let addresses: [IpAddr; 3] = ["192.0.2.1", "192.0.2.2", "2001:db8::1"].map(|a| a.parse().unwrap());
        let started = std::time::Instant::now();
        let admitted = (0..5_000)
            .filter(|k| {
                limiters.check(Call::Enroll, Some(addresses[k % 3]), None).is_ok()
                    && limiters.check_token("default", None).is_ok()
            })
            .count();
        // 600 a minute refill ten a second while the flood runs.
        let refilled = (started.elapsed().as_secs_f64() * 10.0).ceil() as usize;
        assert!((1_000..=1_000 + refilled).contains(&admitted), "{admitted} admitted");
    }

    /// A project key's refused admin requests, each an audit entry, are
    /// limited per key, so that one key cannot flood the shared log.
    #[test]
    fn a_keys_refusals_are_limited_per_key() {
        let limits = RateLimits {
            admin_refusals_per_key: Some(Rate { per_minute: 60, burst: 3 }),
            ..RateLimits::default()
        };
        let limiters = Limiters::new(&limits);
        for _ in 0..3 {
            assert_eq!(limiters.check(Call::AdminRefusal, None, Some("k1")), Ok(()));
        }
        let wait = limiters.check(Call::AdminRefusal, None, Some("k1")).unwrap_err();
        assert!(wait > Duration::from_millis(500) && wait <= Duration::from_secs(1), "{wait:?}");
        assert_eq!(limiters.check(Call::AdminRefusal, None, Some("k2")), Ok(()), "another key is its own");
        assert_eq!(RateLimits::default().admin_refusals_per_key, Some(Rate { per_minute: 120, burst: 240 }));
    }

    #[test]
    fn switched_off_limits_never_refuse() {
        let off = RateLimits {
            enroll_per_address: None,
            enroll_per_token: None,
            check_in_per_address: Some(Rate { per_minute: 0, burst: 5 }),
            check_in_per_credential: None,
            reports_per_address: None,
            reports_per_credential: None,
            admin_refusals_per_key: None,
        };
        let limiters = Limiters::new(&off);
        for _ in 0..1000 {
            assert_eq!(limiters.check(Call::Enroll, Some(IpAddr::from([1, 2, 3, 4])), Some("x")), Ok(()));
            assert_eq!(limiters.check(Call::CheckIn, Some(IpAddr::from([1, 2, 3, 4])), Some("x")), Ok(()));
        }
        assert_eq!(limiters.tracked(), 0);
    }

    #[test]
    fn pruning_forgets_recovered_keys() {
        let limiters = Limiters::new(&limits(Rate { per_minute: 60_000, burst: 1 }));
        for i in 0..100u8 {
            let _ = limiters.check(Call::Enroll, Some(IpAddr::from([10, 0, 0, i])), None);
        }
        assert_eq!(limiters.tracked(), 100);
        std::thread::sleep(Duration::from_millis(20));
        limiters.prune();
        assert_eq!(limiters.tracked(), 0);
    }
}
